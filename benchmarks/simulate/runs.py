"""``simulate calibrate`` (the recorded GPU runs replayed, each figure beside its
simulation) and ``simulate slora`` (S-LoRA's table); each report names the profile that
made its figures."""

from __future__ import annotations

import json
from pathlib import Path

from loramux.benchmarks.common.report import DASH, Markdown, pct
from loramux.benchmarks.common.slora_workloads import SETTINGS, adapter_rank, slora_requests
from loramux.benchmarks.common.workload import WorkloadSpec, adapter_ranks, generate
from loramux.benchmarks.simulate.serve import PER_MINUTE, engine_config, model_dir, serve
from loramux.engine.simulation.calibration import decode_step_table
from loramux.engine.simulation.profile import DeviceProfile

# The recorded run's own engine settings that the simulation takes (the rest are the GPU
# presets' and the simulation's).
ENGINE_SETTINGS = (
    "kv_cache_bytes",
    "adapter_host_bytes",
    "adapter_load_workers",
    "max_num_seqs",
    "max_num_batched_tokens",
    "cuda_graph_max_batch",
    "block_size",
    "max_lora_rank",
)
# Each recorded preset's figures compared: (figure, unit, its path in the run's figures).
COMPARED = {
    "slora-s2": (
        ("requests per second", "req/s", "requests_per_s"),
        ("TTFT P50", "s", "ttft_s.p50"),
        ("ITL P50", "s", "itl_s.p50"),
        ("preemptions", "count", "adapter_traffic.preemptions"),
        ("device evictions", "count", "adapter_traffic.device_evictions"),
        ("adapter loads", "count", "adapter_traffic.loads"),
    ),
    "punica-distinct": (
        ("output tokens per second", "tok/s", "output_tokens_per_s"),
        ("ITL P50", "s", "itl_s.p50"),
    ),
}


def recorded_runs(folder: Path, profile: DeviceProfile, suffix: str = "") -> dict[str, Path]:
    """The recorded GPU runs in ``folder`` a profile is calibrated against (those present):
    the presets' and the kernels' quick run on that profile's GPU. ``suffix``: "-smoke" for
    the CPU smoke's files (a plumbing check of ``make gpu-check --smoke``)."""
    runs = {
        "slora-s2": folder / f"bench_slora-s2{suffix}.json",
        "punica-distinct": folder / f"bench_punica-distinct{suffix}.json",
        "kernels": folder / f"kernels_gpu_{profile.name}-quick.json",
    }
    return {name: path for name, path in runs.items() if path.is_file()}


def hf_config(recorded: dict) -> dict:
    """config.json for a recorded run's model (its report holds the engine's ModelConfig)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": recorded["vocab_size"],
        "hidden_size": recorded["hidden_size"],
        "intermediate_size": recorded["intermediate_size"],
        "num_hidden_layers": recorded["num_layers"],
        "num_attention_heads": recorded["num_heads"],
        "num_key_value_heads": recorded["num_kv_heads"],
        "head_dim": recorded["head_dim"],
        "max_position_embeddings": recorded["max_position_embeddings"],
        "rms_norm_eps": recorded["rms_norm_eps"],
        "rope_theta": recorded["rope_theta"],
        "tie_word_embeddings": recorded["tie_word_embeddings"],
        "bos_token_id": recorded["bos_token_id"],
        "eos_token_id": recorded["eos_token_ids"][0],
        "torch_dtype": "bfloat16",
    }


def calibration(
    profile: DeviceProfile, cache_dir: Path, tokenizer_dir: Path, recorded: Path, suffix: str
) -> dict:
    """Every recorded figure in ``recorded`` against its simulation, with the error; and
    the slora-s2 run's steps, simulated beside measured (when the run recorded them)."""
    runs = recorded_runs(recorded, profile, suffix)
    rows, steps = [], {}
    if "kernels" in runs:
        for r in decode_step_table(profile, runs["kernels"]):
            rows.append(
                _row("kernels_gpu decode step", r.what, "ms", r.measured_ms, r.simulated_ms)
            )
    for name, compared in COMPARED.items():
        if name not in runs:
            continue
        raw = json.loads(runs[name].read_text())
        model = hf_config(raw["model"]["config"])
        folder = f"recorded-{model['hidden_size']}x{model['num_hidden_layers']}"
        spec = WorkloadSpec.from_json(raw["workload"])
        run = serve(
            engine_config(
                model_dir(cache_dir, folder, model, tokenizer_dir),
                **{k: raw["engine_config"][k] for k in ENGINE_SETTINGS},
            ),
            profile,
            generate(spec),
            adapter_ranks(spec),
            vocab_size=model["vocab_size"],
            seed=spec.seed,
            avoid=frozenset(raw["model"]["config"]["eos_token_ids"]),
            preload=spec.popularity == "distinct",  # the punica preset loads them first
        )
        measured, simulated = raw["loramux"], {**run.summary, "adapter_traffic": run.traffic}
        for figure, unit, path in compared:
            rows.append(_row(name, figure, unit, _at(measured, path), _at(simulated, path)))
        if name == "slora-s2":
            steps[name] = {"measured": measured.get("steps"), "simulated": run.step_summary}
    return {
        "profile": profile.name,
        "label": profile.describe(),
        "recorded": {name: str(path) for name, path in runs.items()},
        "rows": rows,
        "steps": steps,
    }


def _at(figures: dict, path: str):
    for key in path.split("."):
        figures = figures[key]
    return figures


def _row(run: str, figure: str, unit: str, measured: float, simulated: float) -> dict:
    error = None if not measured else simulated / measured - 1
    return {
        "run": run,
        "figure": figure,
        "unit": unit,
        "measured": measured,
        "simulated": simulated,
        "error": error,
    }


def calibration_markdown(report: dict) -> str:
    recorded = ", ".join(f"`{Path(p).name}`" for p in report.get("recorded", {}).values())
    md = Markdown(f"Simulation calibration: {report['profile']}")
    md.text(
        f"**Every simulated figure here is {report['label']}.** Measured figures are the "
        f"recorded GPU runs {recorded}, each replayed with its own workload, model shapes and "
        "engine settings."
    ).command(report.get("command", ""))
    rows = [
        (
            r["run"],
            r["figure"],
            r["unit"],
            f"{r['measured']:,.4g}",
            f"{r['simulated']:,.4g}",
            DASH if r["error"] is None else f"{r['error']:+.0%}",
        )
        for r in report["rows"]
    ]
    md.table(("run", "figure", "unit", "measured", "simulated", "error"), rows, "lll")
    for run, both in report.get("steps", {}).items():
        _steps_markdown(md, run, both["measured"], both["simulated"])
    return md.render()


def _steps_markdown(md: Markdown, run: str, measured: dict | None, simulated: dict) -> None:
    """Median step time by batch size, measured beside simulated."""
    md.section(f"{run}: step by step").text(
        "Median milliseconds of a whole `step()` by the sequences in its batch, decode-only "
        "and mixed (with prompt tokens). "
        + (
            ""
            if measured
            else "The recorded run has no step record (runs before step tracing); the "
            "measured column waits for the next GPU run."
        )
    )
    keyed = {}
    for side, summary in (("measured", measured), ("simulated", simulated)):
        for b in (summary or {}).get("bins", []):
            keyed.setdefault((tuple(b["sequences"]), b["decode_only"]), {})[side] = b
    rows = []
    for (seqs, decode_only), sides in sorted(keyed.items()):
        row = [f"{seqs[0]}-{seqs[1]}", "decode-only" if decode_only else "mixed"]
        for b in (sides.get("measured"), sides.get("simulated")):
            row += [DASH, DASH] if b is None else [str(b["steps"]), f"{b['median_ms']:.1f}"]
        rows.append(row)
    columns = ("measured steps", "measured ms", "simulated steps", "simulated ms")
    md.table(("sequences", "batch", *columns), rows, "ll")
    for side, summary in (("measured", measured), ("simulated", simulated)):
        if summary:
            md.text(
                f"{side}: {summary['steps']:,} steps, {summary['stalls']} of them at least "
                f"0.5 s ({summary['stall_seconds']:.1f} s)."
            )


def per_minute_cell(per_minute: dict[str, float]) -> str:
    """The residency counters per minute, as the reports' tables show them."""
    return " / ".join(f"{per_minute[k]:.0f}" for k in PER_MINUTE)


def slora_table(
    setting_name: str,
    profile: DeviceProfile,
    cache_dir: Path,
    tokenizer_dir: Path,
    adapter_counts: list[int],
    rates: list[float],
    duration_s: float | None,
    host_resident: bool = False,
    engine: dict | None = None,
) -> dict:
    """S-LoRA's trace for the setting at each adapter count and offered rate, served with
    adapters and by the base model alone (the ceiling); ``host_resident``: the adapters in
    host RAM when the run starts (S-LoRA's setting), else fetched from the store on demand;
    ``engine``: engine settings over the GPU presets'."""
    engine = engine or {}
    setting = SETTINGS[setting_name]
    model = model_dir(cache_dir, f"{setting_name.lower()}-model", setting.model, tokenizer_dir)
    rows = []
    for rate in rates:
        for count in adapter_counts:
            requests = slora_requests(setting, count, rate=rate, duration_s=duration_s)
            ranks = [adapter_rank(setting, k) for k in range(count)]
            # The base model's run does not depend on the adapters: once per rate.
            for base in (False, True) if count == adapter_counts[0] else (False,):
                run = serve(
                    engine_config(model, **engine),
                    profile,
                    requests,
                    ranks,
                    vocab_size=setting.model["vocab_size"],
                    base_model=base,
                    host_resident=host_resident and not base,
                )
                s = run.summary
                rows.append(
                    {
                        "offered_rate": rate,
                        "adapters": None if base else count,  # None: the base model alone
                        "requests": s["requests"]["total"],
                        **run.figures(),
                        "output_tokens_per_s": s["output_tokens_per_s"],
                        "simulated_s": s["duration_s"],
                        "step_seconds": run.step_seconds,  # where the simulated time went
                        "adapter_floor_ratio": run.adapter_floor_ratio,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    return {
        "setting": setting_name,
        "adapters_start": "in host RAM" if host_resident else "in the store (fetched on demand)",
        "engine": engine,
        "profile": profile.name,
        "label": profile.describe(),
        "rows": rows,
    }


def slora_markdown(report: dict) -> str:
    md = Markdown(f"S-LoRA {report['setting']} on a simulated GPU ({report['profile']})")
    md.text(
        f"**Simulated: {report['label']}.** S-LoRA's own trace (seed 42, its arrival, length "
        "and popularity draws; `benchmarks/common/slora_workloads.py`); throughput is S-LoRA's "
        "(finished requests over the time to the last finish). The base-model rows serve the "
        "same trace with no adapter: the ceiling. *Of the base model's*: the row's throughput "
        "over that ceiling's; *the adapters' bytes allow*: the same ratio with the steps "
        "costing the base model's time plus their adapters' bytes at full memory bandwidth "
        "(no launches, no copies): what perfect LoRA kernels would reach. Both ratios mean "
        "something only at a saturating rate: below it every run serves what arrives. "
        "Adapters at the start: "
        f"{report.get('adapters_start', 'in the store (fetched on demand)')}. Engine: the GPU "
        "presets' settings"
        + "".join(f", {k} {v:,}" for k, v in report.get("engine", {}).items())
        + "."
    ).command(report.get("command", ""))
    base = {r["offered_rate"]: r["requests_per_s"] for r in report["rows"] if r["adapters"] is None}
    rows = []
    for r in report["rows"]:
        ceiling = base.get(r["offered_rate"])
        rows.append(
            (
                f"{r['offered_rate']:g}",
                "base model" if r["adapters"] is None else f"{r['adapters']:,}",
                f"{r['requests_per_s']:.2f}",
                pct(None if ceiling is None else r["requests_per_s"] / ceiling),
                pct(r.get("adapter_floor_ratio")),
                f"{r['output_tokens_per_s']:,.0f}",
                f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}",
                f"{1e3 * r['itl_p50_s']:.1f}",
                per_minute_cell(r["per_minute"]),
            )
        )
    columns = (
        "offered req/s",
        "adapters",
        "req/s",
        "of the base model's",
        "the adapters' bytes allow",
        "output tok/s",
        "TTFT P50 / P99 s",
        "ITL P50 ms",
        "re-loads / evictions / room waits / preemptions per min",
    )
    return md.table(columns, rows, "rrrrrrrrl").render()
