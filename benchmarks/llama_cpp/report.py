"""``loramux bench llama-cpp``'s report: the markdown and the plot (tokens/s of each engine
per workload, the ratio on each panel, and lines at 1x, 2x and 3x llama.cpp's speed: the
targets loramux is measured against)."""

from __future__ import annotations

from pathlib import Path

from loramux.benchmarks.common.files import pyplot, save_figure
from loramux.benchmarks.common.machine import machine_text
from loramux.benchmarks.common.report import Markdown, mark, num, pct

TARGETS = (1, 2, 3)  # loramux at these multiples of llama.cpp's tokens/s
COLORS = {"loramux": "tab:blue", "llama.cpp": "tab:orange"}


def what(workload: str, report: dict) -> str:
    """A workload in words, with its sizes."""
    spec = report["workloads"][workload]
    if workload == "prefill":
        return f"1 prompt of {spec['prompt_tokens']:,} random token ids; prompt tokens/s"
    if workload == "decode":
        return (
            f"1 request, a {spec['prompt_tokens']}-token chat prompt, {spec['new_tokens']} new "
            "tokens; decode tokens/s after the first"
        )
    return (
        f"{spec['requests']} chat requests over {len(spec['adapters'])} adapters, "
        f"{spec['new_tokens']} new tokens each, submitted at once; output tokens/s"
    )


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def markdown(report: dict, plots: list[Path]) -> Markdown:
    llama, checks = report["llama_cpp"], report["checks"]
    md = Markdown("llama.cpp as a peer: the embedded default on the CPU")
    md.text(
        f"`{report['command']}`: loramux and llama.cpp on the same file, `{report['gguf']}`, "
        f"each with {report['threads']} thread(s) and each run in a process of its own; "
        f"{report['rounds']} round(s) in which the two take turns workload by workload (the "
        "order flipping each round, so that a busy moment of the machine falls on both). "
        "Figures are medians over the rounds; the ratio is loramux's over llama.cpp's. Both "
        "engines get the same token ids; every request is greedy and runs its full length "
        "(EOS suppressed)."
    )
    if "skipped" in llama:
        md.text(
            f"**llama.cpp was skipped**: {llama['skipped']}. Install it with {llama['install']}"
            " and, where it is another venv, pass its interpreter as `--llama-cpp-python PY`. "
            "The figures below are loramux's alone."
        )
    md.table(
        ("workload", "what", "loramux tok/s", "llama.cpp tok/s", "loramux / llama.cpp"),
        [
            (
                s["workload"],
                what(s["workload"], report),
                num(s["loramux_tokens_per_s"], 1),
                num(s["llama_cpp_tokens_per_s"], 1),
                f"**{_ratio(s['ratio'])}**",
            )
            for s in report["summary"]
        ],
        "llrrr",
    )
    md.plots(plots)
    md.section("Outputs")
    md.bullets(_check_lines(checks))
    md.section("How each engine ran")
    md.bullets(_engine_lines(report))
    md.section("Every run")
    md.table(
        ("round", "workload", "engine", "tokens", "seconds", "tokens/s", "cores used", "notes"),
        [
            (
                r["round"] + 1,
                r["workload"],
                r["engine"],
                r["tokens"],
                num(r["seconds"], 3),
                num(r["tokens_per_s"], 1),
                r["clock"]["cores_used"],
                _notes(r),
            )
            for r in report["rows"]
        ],
        "rllrrrrl",
    )
    return md.busy(report, report["machine"]).machine(report["machine"])


def _check_lines(checks: dict) -> list[str]:
    lines = []
    if "loramux_matches_peft" in checks:
        ok = checks["loramux_matches_peft"]
        lines.append(
            f"loramux's mixed-adapter tokens against transformers + PEFT's (each request alone, "
            f"on the GGUF's de-quantized float32 weights and the same adapters): {mark(ok)}"
            + (", identical in every round" if ok else ": they differ; the study failed")
        )
    changed = checks.get("adapters_change_outputs")
    if changed:
        lines.append(
            f"The adapters change the outputs: {changed['requests']} of {changed['of']} "
            "requests' tokens differ from the base model's on the same prompts."
        )
    if "llama_cpp_against_peft" in checks:
        lines.append(
            _agreement(
                "llama.cpp's mixed-adapter tokens against PEFT's", checks["llama_cpp_against_peft"]
            )
        )
    if "llama_cpp_decode_against_loramux" in checks:
        lines.append(
            _agreement(
                "llama.cpp's decode tokens against loramux's (no adapter)",
                checks["llama_cpp_decode_against_loramux"],
            )
        )
    if any(k.startswith("llama_cpp") for k in checks):
        lines.append(
            "llama.cpp's agreement is reported, not asserted: its matmuls quantize the "
            "activations to 8 bits against the 4-bit weights, where loramux and PEFT compute "
            "in float32, so a near tie can go the other way and greedy decoding then follows "
            "its own path."
        )
    return lines or ["No output was checked (the mixed workload did not run)."]


def _agreement(label: str, found: dict) -> str:
    share = found["tokens_matching"] / found["tokens"] if found["tokens"] else None
    return (
        f"{label}: {found['requests_identical']} of {found['requests']} request(s) identical; "
        f"{found['tokens_matching']:,} of {found['tokens']:,} tokens before each request's "
        f"first difference ({pct(share)})."
    )


def _engine_lines(report: dict) -> list[str]:
    llama = report["llama_cpp"]
    settings = next((r["engine_settings"] for r in report["rows"] if "engine_settings" in r), {})
    threads = [
        r["engine_settings"]["torch_threads"] for r in report["rows"] if "engine_settings" in r
    ]
    gave_back = (
        f" (after {sum(t < report['threads'] for t in threads)} of {len(threads)} runs "
        "fewer than asked: the engine's governor gave cores back to other processes)"
        if any(t < report["threads"] for t in threads)
        else ""
    )
    lines = [
        "loramux: the engine as `loramux serve` builds it on the embedded default (the GGUF's "
        "own 4-bit weights, the engine's default settings but a KV budget of "
        f"{num(settings.get('kv_cache_bytes'), 0, scale=2**-20)} MiB), driven by `add_request` "
        f"and `step`: kernels {settings.get('kernels')}, LoRA by the {settings.get('lora_op')} "
        f"op, speculative decoding {settings.get('speculative')}, {report['threads']} torch "
        f"threads{gave_back}. The mixed workload's adapters are registered "
        "with `add_adapter` from their PEFT folders (random, seeded: ranks 8 and 16 on q, k, "
        "v, o, gate, up, down).",
    ]
    if "skipped" in llama:
        return [*lines, f"llama.cpp: skipped ({llama['skipped']})."]
    mixed = next((r for r in report["rows"] if r["engine"] == "llama.cpp" and "n_ctx" in r), None)
    flash = next((r["flash_attn"] for r in report["rows"] if "flash_attn" in r), "auto")
    lines.append(
        f"llama.cpp: llama-cpp-python {llama['version']} through its low-level API (the C "
        "functions): `llama_decode` of one token per request per step on a `llama_batch` "
        "filled in Python, greedy argmax in numpy over `llama_get_logits_ith` with the EOS "
        f"ids masked; `n_batch` 2048, `n_ubatch` 512, flash attention {flash}, the rest "
        "llama.cpp's defaults (an F16 KV cache)."
        + (
            f" Mixed: one context of {len(report['workloads']['mixed']['prompt_tokens'])} "
            f"sequences (`n_seq_max`, `kv_unified` off, `n_ctx` {mixed['n_ctx']:,}); at each "
            f"step each of the {mixed['groups']} adapters' groups in turn gets its adapter "
            "alone on the context (`llama_set_adapters_lora`) and one `llama_decode` of its "
            "tokens, as llama.cpp's server batches only slots whose LoRAs are equal (each "
            "switch makes llama.cpp reserve its compute graph anew: "
            "`llama_context::set_adapters_lora` sets `sched_need_reserve`); the adapters "
            "converted from PEFT to GGUF LoRA files (F32)."
            if mixed
            else ""
        )
    )
    lines.append(
        f'llama.cpp\'s build: `CMAKE_ARGS="{llama["cmake_args"]}"`; it reports '
        f"`{llama['system_info']}`."
    )
    return lines


def _notes(row: dict) -> str:
    notes = []
    if "ttft_s" in row:
        notes.append(f"first token {row['ttft_s'] * 1000:.0f} ms")
    if "agreement" in row:
        found = row["agreement"]
        notes.append(f"{found['requests_identical']}/{found['requests']} as PEFT")
    if "cached_prompt_tokens" in row:
        notes.append(f"{row['cached_prompt_tokens']} cached prompt tokens")
    if row.get("preemptions"):
        notes.append(f"{row['preemptions']} preemptions")
    return "; ".join(notes)


def write_plot(report: dict, stem: Path) -> list[Path]:
    plt = pyplot()
    if plt is None or not report["summary"]:
        return []
    summary = report["summary"]
    fig, axes = plt.subplots(1, len(summary), figsize=(max(8.0, 3.6 * len(summary) + 1), 4.6))
    axes = [axes] if len(summary) == 1 else list(axes)
    for ax, s in zip(axes, summary, strict=True):
        speeds = {"loramux": s["loramux_tokens_per_s"], "llama.cpp": s["llama_cpp_tokens_per_s"]}
        engines = [e for e, v in speeds.items() if v is not None]
        bars = ax.bar(engines, [speeds[e] for e in engines], color=[COLORS[e] for e in engines])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        for engine in engines:  # each round's figure beside the median
            values = [
                r["tokens_per_s"]
                for r in report["rows"]
                if (r["workload"], r["engine"]) == (s["workload"], engine)
            ]
            ax.plot([engines.index(engine)] * len(values), values, "k.", markersize=4)
        top = max(v for v in speeds.values() if v is not None)
        if speeds["llama.cpp"] is not None:
            for target in TARGETS:
                level = target * speeds["llama.cpp"]
                ax.axhline(level, color="gray", linestyle=":", linewidth=1)
                ax.annotate(  # right of the bars, where no label sits
                    f"{target}x llama.cpp",
                    (2.35, level),
                    fontsize=7,
                    color="gray",
                    ha="right",
                    va="bottom",
                )
            top = max(top, TARGETS[-1] * speeds["llama.cpp"])
        ax.set_ylim(0, top * 1.12)
        ax.set_xlim(-0.6, 2.4)
        ax.set_title(f"{s['workload']}: loramux / llama.cpp = {_ratio(s['ratio'])}", fontsize=10)
        ax.set_ylabel("tokens/s (higher is better)")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"loramux and llama.cpp on {report['gguf']}\n{report['threads']} thread(s) each, "
        f"medians of {report['rounds']} round(s)",
        fontsize=10,
    )
    note = machine_text(report["machine"]).split(" Date")[0]
    return [save_figure(fig, stem.with_name(stem.name + ".png"), note=note)]
