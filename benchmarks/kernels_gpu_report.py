"""Tables, target verdicts and the JSON / markdown files of ``kernels_gpu``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from loramux.benchmarks.common.files import write_atomic


@dataclass(frozen=True)
class Column:
    header: str
    key: str
    spec: str = ""  # format spec for numbers


# Columns shown per section (the JSON keeps every field of every row).
_TIMES = (
    Column("triton ms", "triton_ms", ".4f"),
    Column("baseline ms", "baseline_ms", ".4f"),
    Column("floor ms", "floor_ms", ".4f"),
    Column("bound", "bound"),
    Column("÷floor", "triton_vs_floor", ".2f"),
    Column("speedup", "speedup_vs_baseline", ".2f"),
)
_CHECK = (Column("triton err", "triton_rel_err", ".1e"), Column("ok", "matches"))
SECTION_COLUMNS = {
    "decode_attention": (
        Column("batch", "batch"),
        Column("context", "context"),
        Column("Hkv", "kv_heads"),
        Column("KV", "kv_cache_dtype"),
        Column("splits", "num_splits"),
        *_TIMES,
        Column("GB/s", "achieved_gbs", ".0f"),
        Column("of copy", "copy_fraction", ".0%"),
        *_CHECK,
        Column("target", "target_pass"),
    ),
    "decode_step": (
        Column("layers", "layers"),
        Column("Hkv", "kv_heads"),
        Column("batch", "batch"),
        Column("variant", "variant"),
        Column("adapters", "adapters"),
        Column("rank", "rank"),
        Column("kernel", "kernel"),
        Column("step ms", "step_ms", ".3f"),
        Column("floor ms", "floor_ms", ".3f"),
        Column("÷floor", "step_vs_floor", ".2f"),
        Column("overhead %", "overhead_pct", "+.1f"),
        Column("graph ms", "graph_ms", ".3f"),
        Column("graph overhead %", "graph_overhead_pct", "+.1f"),
        Column("graph err", "graph_err", ".1e"),
        Column("launches/layer", "graph_launches_per_layer", "g"),
        Column("build_step ms", "build_step_ms", ".3f"),
        Column("err vs ref", "rel_err", ".1e"),
        Column("LoRA effect", "lora_effect", ".2f"),
        Column("ok", "matches"),
        Column("target", "target_pass"),
    ),
    "prefill_step": (
        Column("layers", "layers"),
        Column("Hkv", "kv_heads"),
        Column("seqs", "seqs"),
        Column("tokens", "tokens"),
        Column("variant", "variant"),
        Column("adapters", "adapters"),
        Column("rank", "rank"),
        Column("kernel", "kernel"),
        Column("step ms", "step_ms", ".3f"),
        Column("floor ms", "floor_ms", ".3f"),
        Column("÷floor", "step_vs_floor", ".2f"),
        Column("overhead %", "overhead_pct", "+.1f"),
        Column("launches/layer", "launches_per_layer", "g"),
        Column("err vs ref", "rel_err", ".1e"),
        Column("LoRA effect", "lora_effect", ".2f"),
        Column("ok", "matches"),
        Column("target", "target_pass"),
    ),
    "prefill_attention": (
        Column("seqs", "num_seqs"),
        Column("new", "new_tokens"),
        Column("prefix", "prefix"),
        Column("Hkv", "kv_heads"),
        *_TIMES,
        *_CHECK,
    ),
    "lora": (
        Column("proj", "projection"),
        Column("op", "op"),
        Column("phase", "phase"),
        Column("kernel", "kernel"),
        Column("tokens", "tokens"),
        Column("adapters", "adapters"),
        Column("rank", "rank"),
        *_TIMES,
        *_CHECK,
    ),
    "quant_linear": (
        Column("proj", "projection"),
        Column("N", "out_features"),
        Column("K", "in_features"),
        Column("tokens", "tokens"),
        Column("weights", "weights"),
        *_TIMES,
        Column("floor speedup", "floor_speedup", ".2f"),
        Column("GB/s", "achieved_gbs", ".0f"),
        Column("of copy", "copy_fraction", ".0%"),
        Column("dense GB/s", "baseline_gbs", ".0f"),
        *_CHECK,
    ),
}
SECTION_TITLES = {
    "decode_attention": "Paged decode attention (Triton split-context kernel vs torch reference)",
    "decode_step": "Full decode step (engine model, LoRA on all seven modules vs none)",
    "prefill_step": "Full prefill step (engine model, LoRA on all seven modules vs none)",
    "prefill_attention": "Paged prefill attention (Triton vs per-sequence masked SDPA)",
    "lora": "LoRA shrink / expand (Triton SGMV/BGMV vs torch gather + bmm) and fused (one "
    "launch vs the two-launch Triton path)",
    "quant_linear": "Weight-only quantized linear (Triton int8 / int4 vs dense F.linear)",
}


def _cells(section: str, rows: list[dict]) -> list[list[str]]:
    """The header and each row's cells, as both tables show them."""
    columns = SECTION_COLUMNS[section]
    return [[c.header for c in columns], *([_cell(r, c) for c in columns] for r in rows)]


def _cell(row: dict, column: Column) -> str:
    if column.key == "matches" and "error" in row:
        return "ERROR"
    value = row.get(column.key)
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, int | float) and column.spec:
        return format(value, column.spec)
    return str(value)


def text_table(section: str, rows: list[dict]) -> str:
    cells = _cells(section, rows)
    widths = [max(map(len, column)) for column in zip(*cells, strict=True)]
    lines = ["  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True)) for line in cells]
    errors = [f"  error: {r['error']}" for r in rows if "error" in r]
    return "\n".join([f"== {SECTION_TITLES[section]} ==", *lines, *errors])


def markdown_table(section: str, rows: list[dict]) -> str:
    header, *body = _cells(section, rows)
    lines = ["| " + " | ".join(line) + " |" for line in (header, *body)]
    lines.insert(1, "|" + "---:|" * len(header))
    errors = [f"- error: `{r['error']}`" for r in rows if "error" in r]
    return "\n".join(lines + (["", *errors] if errors else []))


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


def write_results(paths: tuple[Path, Path], results: dict) -> None:
    """The JSON (every field) and the markdown report (verdicts and tables)."""
    write_atomic(paths[0], json.dumps(results, indent=2) + "\n")
    write_atomic(paths[1], render_markdown(results))


def render_markdown(results: dict) -> str:
    device, rates, config = results["machine"]["accelerator"], results["rates"], results["config"]
    lines = [f"# Triton kernels on {device['device']} ({config['grid']} grid)", ""]
    if config["grid"] == "smoke":
        lines += [
            "Smoke run: tiny shapes, few iterations, Triton's interpreter on the CPU. It checks "
            "the script's plumbing and the kernels' outputs; its times measure nothing.",
            "",
        ]
    lines += [f"- **{v['line']}** — {v['detail']}" for v in results["targets"].values()]
    lines += [
        "",
        f"Measured ceilings: copy bandwidth {rates['copy_gbs']:.0f} GB/s (read + written), "
        f"{config['dtype']} matmul {rates['matmul_tflops']:.1f} TFLOP/s. Floor = max(bytes / "
        "copy bandwidth, flops / matmul rate); ÷floor = time / floor. Times are medians of "
        f"{config['iters']} runs after {config['warmup']} warm-up runs. An output matches "
        f"when its relative error against the float32 reference is below "
        f"{config['tolerance']:g} (the torch baseline's: 3x that); the decode step's output "
        f"against the same step on the torch reference ops, below {config['step_tolerance']:g}.",
        "",
        f"Machine: {_device_text(device)}.",
        "",
        f"Command: `{results['command']}`",
    ]
    for section, rows in results["sections"].items():
        lines += ["", f"## {SECTION_TITLES[section]}", "", markdown_table(section, rows)]
    return "\n".join(lines) + "\n"


def _device_text(device: dict) -> str:
    keys = ("device", "capability", "sm_count", "memory_gib", "torch", "cuda", "triton")
    parts = [f"{k} {device[k]}" for k in keys if device.get(k) is not None]
    return ", ".join([*parts, f"Python {device['python']}", f"date {device['date']}"])
