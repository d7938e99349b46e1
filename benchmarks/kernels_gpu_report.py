"""Tables, target verdicts and the JSON / markdown files of ``kernels_gpu``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from loramux.benchmarks.files import write_atomic


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
        Column("build_step ms", "build_step_ms", ".3f"),
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
}
SECTION_TITLES = {
    "decode_attention": "Paged decode attention (Triton split-context kernel vs torch reference)",
    "decode_step": "Full decode step (engine model, LoRA on all seven modules vs none)",
    "prefill_attention": "Paged prefill attention (Triton vs per-sequence masked SDPA)",
    "lora": "LoRA shrink / expand (Triton SGMV/BGMV vs torch gather + bmm)",
}


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
    columns = SECTION_COLUMNS[section]
    cells = [[c.header for c in columns], *([_cell(r, c) for c in columns] for r in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True)) for line in cells]
    errors = [f"  error: {r['error']}" for r in rows if "error" in r]
    return "\n".join([f"== {SECTION_TITLES[section]} ==", *lines, *errors])


def markdown_table(section: str, rows: list[dict]) -> str:
    columns = SECTION_COLUMNS[section]
    lines = [
        "| " + " | ".join(c.header for c in columns) + " |",
        "|" + "---:|" * len(columns),
        *("| " + " | ".join(_cell(r, c) for c in columns) + " |" for r in rows),
    ]
    errors = [f"- error: `{r['error']}`" for r in rows if "error" in r]
    return "\n".join(lines + (["", *errors] if errors else []))


# --- target verdicts ------------------------------------------------------------------


def _status(target_rows: list[dict]) -> str:
    if not target_rows or any(r.get("target_pass") is None for r in target_rows):
        return "NOT MEASURED"
    return "PASS" if all(r["target_pass"] for r in target_rows) else "FAIL"


def step_verdict(rows: list[dict], shape: str) -> dict:
    """The decode-step target: LoRA overhead ≤ 15% on every target row (one per KV heads),
    on the CUDA-graph path the engine takes for decode steps where it was captured."""
    target = [r for r in rows if r.get("target")]
    detail = "; ".join(
        f"{r['kv_heads']} KV heads: eager {r['overhead_pct']:+.1f}% "
        f"({r['step_ms']:.3f} vs {r['base_ms']:.3f} ms), CUDA graph "
        f"{r['graph_overhead_pct']:+.1f}% ({r['graph_ms']:.3f} ms"
        f"{'' if r.get('graph_captured') else ', not captured: no CUDA'})"
        for r in target
        if "overhead_pct" in r
    )
    return {
        "line": f"Verdict, decode step LoRA overhead ≤ 15% ({shape}): {_status(target)}",
        "status": _status(target),
        "detail": detail or "no target row measured",
    }


def attention_verdict(rows: list[dict], shape: str) -> dict:
    """The attention target: ≥ 70% of the copy bandwidth on every target row."""
    target = [r for r in rows if r.get("target")]
    detail = "; ".join(
        f"{r['kv_heads']} KV heads: {r['copy_fraction']:.0%} ({r['achieved_gbs']:.0f} GB/s)"
        for r in target
        if "copy_fraction" in r
    )
    return {
        "line": (
            f"Verdict, paged decode attention ≥ 70% of copy bandwidth ({shape}): {_status(target)}"
        ),
        "status": _status(target),
        "detail": detail or "no target row measured",
    }


# --- files ------------------------------------------------------------------------------


def write_json(path: Path, results: dict) -> None:
    write_atomic(path, json.dumps(results, indent=2) + "\n")


def render_markdown(results: dict) -> str:
    device, rates, config = results["machine"]["accelerator"], results["rates"], results["config"]
    lines = [
        f"# Triton kernels on {device['device']} ({config['grid']} grid)",
        "",
    ]
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


def write_markdown(path: Path, results: dict) -> None:
    write_atomic(path, render_markdown(results))
