"""The ``kernels-gpu`` report: the targets' verdicts and each section's table."""

from __future__ import annotations

from loramux.benchmarks.common.report import Markdown

# The tables' columns by the row key each shows: its header and the format of its numbers
# (a key not here is its own header). The JSON keeps every field of every row.
COLUMNS = {
    "num_seqs": ("seqs", ""),
    "seqs": ("seqs", ""),
    "new_tokens": ("new", ""),
    "kv_heads": ("Hkv", ""),
    "kv_cache_dtype": ("KV", ""),
    "num_splits": ("splits", ""),
    "projection": ("proj", ""),
    "out_features": ("N", ""),
    "in_features": ("K", ""),
    "triton_ms": ("triton ms", ".4f"),
    "baseline_ms": ("baseline ms", ".4f"),
    "floor_ms": ("floor ms", ".4f"),
    "triton_vs_floor": ("÷floor", ".2f"),
    "speedup_vs_baseline": ("speedup", ".2f"),
    "floor_speedup": ("floor speedup", ".2f"),
    "achieved_gbs": ("GB/s", ".0f"),
    "copy_fraction": ("of copy", ".0%"),
    "baseline_gbs": ("dense GB/s", ".0f"),
    "step_ms": ("step ms", ".3f"),
    "step_vs_floor": ("÷floor", ".2f"),
    "overhead_pct": ("overhead %", "+.1f"),
    "graph_ms": ("graph ms", ".3f"),
    "graph_overhead_pct": ("graph overhead %", "+.1f"),
    "graph_err": ("graph err", ".1e"),
    "graph_launches_per_layer": ("launches/layer", "g"),
    "launches_per_layer": ("launches/layer", "g"),
    "build_step_ms": ("build_step ms", ".3f"),
    "rel_err": ("err vs ref", ".1e"),
    "lora_effect": ("LoRA effect", ".2f"),
    "triton_rel_err": ("triton err", ".1e"),
    "matches": ("ok", ""),
    "target_pass": ("target", ""),
}
_TIMES = "triton_ms baseline_ms floor_ms bound triton_vs_floor speedup_vs_baseline"
_STEP = "variant adapters rank kernel step_ms floor_ms step_vs_floor overhead_pct"
# Each section's title and columns, in the order the runner measures them.
SECTIONS = {
    "decode_attention": (
        "Paged decode attention (Triton split-context kernel vs torch reference)",
        f"batch context kv_heads kv_cache_dtype num_splits {_TIMES} achieved_gbs "
        "copy_fraction triton_rel_err matches target_pass",
    ),
    "decode_step": (
        "Full decode step (engine model, LoRA on all seven modules vs none)",
        f"layers kv_heads batch {_STEP} graph_ms graph_overhead_pct graph_err "
        "graph_launches_per_layer build_step_ms rel_err lora_effect matches target_pass",
    ),
    "prefill_step": (
        "Full prefill step (engine model, LoRA on all seven modules vs none)",
        f"layers kv_heads seqs tokens {_STEP} launches_per_layer rel_err lora_effect matches "
        "target_pass",
    ),
    "prefill_attention": (
        "Paged prefill attention (Triton vs per-sequence masked SDPA)",
        f"num_seqs new_tokens prefix kv_heads {_TIMES} triton_rel_err matches",
    ),
    "lora": (
        "LoRA shrink / expand (Triton SGMV/BGMV vs torch gather + bmm) and fused (one launch "
        "vs the two-launch Triton path)",
        f"projection op phase kernel tokens adapters rank {_TIMES} triton_rel_err matches",
    ),
    "quant_linear": (
        "Weight-only quantized linear (Triton int8 / int4 vs dense F.linear)",
        f"projection out_features in_features tokens weights {_TIMES} floor_speedup "
        "achieved_gbs copy_fraction baseline_gbs triton_rel_err matches",
    ),
}


def _cell(row: dict, key: str) -> str:
    value = row.get(key)
    if key == "matches" and "error" in row:
        return "ERROR"
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    spec = COLUMNS.get(key, (key, ""))[1]
    return format(value, spec) if isinstance(value, int | float) and spec else str(value)


def _step_detail(row: dict) -> str:
    """A decode-step target is judged on the CUDA-graph path the engine takes for decode
    steps where it was captured, and eagerly."""
    graph = "" if row.get("graph_captured") else ", not captured: no CUDA"
    return (
        f"{row['kv_heads']} KV heads: CUDA graph {1 + row['graph_overhead_pct'] / 100:.3f}× "
        f"({row['graph_ms']:.3f} ms{graph}), eager {1 + row['overhead_pct'] / 100:.3f}× "
        f"({row['step_ms']:.3f} vs {row['base_ms']:.3f} ms), floor "
        f"{row['floor_ms'] / row['base_floor_ms']:.3f}× base's, "
        f"{row['graph_launches_per_layer']:g} LoRA launches a layer"
    )


def _prefill_detail(row: dict) -> str:
    return (
        f"{row['kv_heads']} KV heads: {1 + row['overhead_pct'] / 100:.3f}× "
        f"({row['step_ms']:.3f} vs {row['base_ms']:.3f} ms), floor "
        f"{row['floor_ms'] / row['base_floor_ms']:.3f}× base's"
    )


def _attention_detail(row: dict) -> str:
    return (
        f"{row['kv_heads']} KV heads: {row['copy_fraction']:.0%} ({row['achieved_gbs']:.0f} GB/s)"
    )


# The targets: the verdict's key (rows carry it as "target"), its section, its goal, the
# detail of a target row.
TARGETS = (
    (
        "decode_step_distinct_adapters",
        "decode_step",
        "decode step ≤ 1.25× base with CUDA graphs, ≤ 1.5× eager",
        _step_detail,
    ),
    (
        "decode_step_one_adapter",
        "decode_step",
        "decode step ≤ 1.10× base with CUDA graphs, ≤ 1.5× eager",
        _step_detail,
    ),
    ("prefill_step_adapters", "prefill_step", "prefill step ≤ 1.15× base", _prefill_detail),
    (
        "decode_attention_bandwidth",
        "decode_attention",
        "paged decode attention ≥ 70% of copy bandwidth",
        _attention_detail,
    ),
)


def target_verdicts(sections: dict[str, list[dict]], shapes: dict[str, str]) -> dict:
    """Each target's verdict on its section's rows (``shapes``: the shape each judges):
    PASS when every target row (one per KV heads) passes, NOT MEASURED while one has not
    been judged; the detail describes each target row that has its measurement."""
    verdicts = {}
    for key, section, goal, detail in TARGETS:
        target = [r for r in sections.get(section, []) if r.get("target") == key]
        if not target or any(r.get("target_pass") is None for r in target):
            status = "NOT MEASURED"
        else:
            status = "PASS" if all(r["target_pass"] for r in target) else "FAIL"
        details = [detail(r) for r in target if r.get("target_pass") is not None]
        verdicts[key] = {
            "line": f"Verdict, {goal} ({shapes[key]}): {status}",
            "status": status,
            "detail": "; ".join(details) or "no target row measured",
        }
    return verdicts


def render(results: dict) -> Markdown:
    """Verdicts, how to read the tables, the machine, then every section's table."""
    rates, config, machine = results["rates"], results["config"], results["machine"]
    gpu = machine["accelerator"]
    doc = Markdown(f"Triton kernels on {gpu['device']} ({config['grid']} grid)")
    if config["grid"] == "smoke":
        doc.text(
            "Smoke run: tiny shapes, few iterations, Triton's interpreter on the CPU. It checks "
            "the script's plumbing and the kernels' outputs; its times measure nothing."
        )
    doc.bullets(f"**{v['line']}** — {v['detail']}" for v in results["targets"].values())
    doc.text(
        f"Measured ceilings: copy bandwidth {rates['copy_gbs']:.0f} GB/s (read + written), "
        f"{config['dtype']} matmul {rates['matmul_tflops']:.1f} TFLOP/s. Floor = max(bytes / "
        "copy bandwidth, flops / matmul rate); ÷floor = time / floor. Times are medians of "
        f"{config['iters']} runs after {config['warmup']} warm-up runs. An output matches "
        f"when its relative error against the float32 reference is below "
        f"{config['tolerance']:g} (the torch baseline's: 3x that); the decode step's output "
        f"against the same step on the torch reference ops, below {config['step_tolerance']:g}."
    )
    sms = f"Capability {gpu['capability']}, {gpu['sm_count']} SMs." if "sm_count" in gpu else ""
    doc.machine(machine, ("torch",), sms).command(results["command"])
    for section, rows in results["sections"].items():
        title, keys = SECTIONS[section][0], SECTIONS[section][1].split()
        header = [COLUMNS.get(k, (k, ""))[0] for k in keys]
        doc.section(title).table(
            header, [[_cell(r, k) for k in keys] for r in rows], "r" * len(keys)
        )
        if errors := [f"error: `{r['error']}`" for r in rows if "error" in r]:
            doc.bullets(errors)
    return doc
