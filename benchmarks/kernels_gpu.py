"""GPU benchmark of loramux's Triton kernels at Llama-7B shapes, and of one decode step.

At Llama-7B shapes (hidden 4096, 32 query heads and 8 or 32
KV heads of dim 128, intermediate 11008, bf16) it times

* LoRA shrink and expand (``kernels_gpu_lora``): SGMV on prefill batches, BGMV/SGMV on
  decode batches of 1 to 256 tokens, ranks 8 to 64 and mixed, 1 to batch distinct
  adapters, for the fused q/k/v and gate/up projections; torch gather + bmm baseline;
* paged decode and prefill attention (``kernels_gpu_attention``) against the torch
  reference (SDPA over gathered pages); decode also as a fraction of copy bandwidth;
* one full decode step of the engine's model (``kernels_gpu_step``) with rank-16 LoRA on
  all seven modules against the same step without LoRA;

each with its floor from bytes moved over the measured copy bandwidth and FLOPs over the
measured matmul rate (``kernels_gpu_timing``), and checks every kernel's output against
a float32 reference once per shape. Two targets get a verdict: the decode step with 64
distinct rank-16 adapters at batch 64 costs ≤ 15% more than the base step; paged decode
attention at batch 64 × 2048 context reaches ≥ 70% of the copy bandwidth.

    python -m loramux.benchmarks.kernels_gpu          # full grid on the GPU (a few minutes)
    python -m loramux.benchmarks.kernels_gpu --quick  # a reduced grid
    python -m loramux.benchmarks.kernels_gpu --smoke --out /tmp/x  # CPU plumbing (seconds)

Writes ``kernels_gpu_<device>.json`` (every row, the machine, the measured ceilings) and
``.md`` (verdicts and tables) to ``--out`` (default ``benchmarks/results``), after every
section, so a run cut short keeps what it measured; ``--quick``, ``--smoke`` and a subset
of ``--sections`` add their names to ``<device>``. Exits 1 when any output did not
match its reference (or a case failed), 2 without a GPU outside ``--smoke``.

``--smoke`` runs the same code at tiny shapes in float32 on the CPU: the Triton kernels
in Triton's interpreter (``TRITON_INTERPRET=1``, set here unless already set) and the
engine's ops on the Triton path (``LORAMUX_KERNELS=triton``, likewise).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from loramux.benchmarks.files import add_output_options, check_output_options

# None of these imports a Triton kernel module at import time: the kernels are imported
# where they run, after main() has chosen compiler or interpreter.
from loramux.benchmarks.kernels_gpu_attention import (
    DecodeAttentionCase,
    PrefillAttentionCase,
    run_decode_case,
    run_prefill_case,
)
from loramux.benchmarks.kernels_gpu_lora import LoRACase, run_lora_case
from loramux.benchmarks.kernels_gpu_report import (
    attention_verdict,
    step_verdict,
    text_table,
    write_json,
    write_markdown,
)
from loramux.benchmarks.kernels_gpu_step import (
    STEP_TOLERANCE,
    StepCase,
    fit_layers,
    llama_config,
    run_step_case,
)
from loramux.benchmarks.kernels_gpu_timing import (
    BenchContext,
    Timer,
    device_slug,
    free_device_memory,
    measure_rates,
)
from loramux.benchmarks.machine import machine_info
from loramux.engine.model.config import ModelConfig

SECTIONS = ("decode_attention", "decode_step", "prefill_attention", "lora")  # run order
LORA_PROJECTIONS = ("qkv", "gate_up")
LORA_OPS = ("shrink", "expand")


@dataclasses.dataclass(frozen=True)
class Grid:
    """The shapes of one run (full, quick or smoke)."""

    name: str
    dtype: torch.dtype
    model: Callable[..., ModelConfig]  # (num_layers=, kv_heads=) -> the model's shape
    block_size: int
    copy_bytes: int  # the copy-bandwidth buffer
    matmul_size: int  # n of the n³ matmul-rate product
    iters: int
    warmup: int
    # LoRA
    lora_kv_heads: int
    lora_decode_batches: tuple[int, ...]
    lora_prefill_shapes: tuple[tuple[int, int], ...]  # (sequences, tokens each)
    lora_ranks: tuple[tuple[int, ...], ...]  # one rank, or several (mixed)
    # attention
    attn_batches: tuple[int, ...]
    attn_contexts: tuple[int, ...]
    attn_kv_heads: tuple[int, ...]
    attn_target: tuple[int, int]  # (batch, context) of the bandwidth target
    prefill_shapes: tuple[tuple[int, int, int], ...]  # (sequences, new tokens, prefix)
    prefill_kv_heads: tuple[int, ...]
    # decode step
    step_layers: int
    step_kv_heads: tuple[int, ...]
    step_batch: int
    step_context: int
    step_rank: int
    step_adapter_counts: tuple[int, ...]
    step_target_adapters: int


def _grids() -> dict[str, Grid]:
    full = Grid(
        name="full",
        dtype=torch.bfloat16,
        model=llama_config,
        block_size=16,
        copy_bytes=1 << 30,
        matmul_size=8192,
        iters=50,
        warmup=10,
        lora_kv_heads=8,
        lora_decode_batches=(1, 8, 32, 64, 128, 256),
        lora_prefill_shapes=((1, 2048), (8, 256), (64, 32)),
        lora_ranks=((8,), (16,), (32,), (64,), (8, 16, 32, 64)),
        attn_batches=(1, 8, 64, 256),
        attn_contexts=(512, 2048, 8192),
        attn_kv_heads=(8, 32),
        attn_target=(64, 2048),
        prefill_shapes=((1, 2048, 0), (8, 512, 1024)),
        prefill_kv_heads=(8, 32),
        step_layers=32,
        step_kv_heads=(32, 8),
        step_batch=64,
        step_context=512,
        step_rank=16,
        step_adapter_counts=(1, 16, 64),
        step_target_adapters=64,
    )
    quick = dataclasses.replace(
        full,
        name="quick",
        lora_decode_batches=(1, 64, 256),
        lora_prefill_shapes=((1, 2048), (64, 32)),
        lora_ranks=((16,), (64,)),
        attn_batches=(1, 64, 256),
        attn_contexts=(2048,),
        prefill_shapes=((8, 512, 1024),),
        prefill_kv_heads=(8,),
        step_adapter_counts=(1, 64),
    )
    smoke = Grid(
        name="smoke",
        dtype=torch.float32,
        model=partial(
            llama_config,
            hidden_size=128,
            intermediate_size=192,
            num_attention_heads=4,
            vocab_size=256,
        ),
        block_size=16,
        copy_bytes=16 << 20,
        matmul_size=256,
        iters=1,
        warmup=0,  # each shape's output check has already run (and compiled) it once
        lora_kv_heads=2,
        lora_decode_batches=(4,),
        lora_prefill_shapes=((2, 8),),
        lora_ranks=((8,), (8, 16)),
        attn_batches=(3,),
        attn_contexts=(24, 300),  # 300: past one split of MIN_SPLIT_TOKENS
        attn_kv_heads=(2, 4),
        attn_target=(3, 300),
        prefill_shapes=((1, 24, 0), (2, 8, 16)),
        prefill_kv_heads=(2,),
        step_layers=2,
        step_kv_heads=(2,),
        step_batch=4,
        step_context=20,
        step_rank=8,
        step_adapter_counts=(1, 4),
        step_target_adapters=4,
    )
    return {"full": full, "quick": quick, "smoke": smoke}


# --- cases ------------------------------------------------------------------------------


def lora_cases(grid: Grid) -> list[LoRACase]:
    """Every (projection, op, batch, adapters, ranks); adapters 1, batch / 4 and batch."""
    shapes = [(b, 1) for b in grid.lora_decode_batches] + list(grid.lora_prefill_shapes)
    cases = []
    for projection, op, (num_seqs, tokens), ranks in itertools.product(
        LORA_PROJECTIONS, LORA_OPS, shapes, grid.lora_ranks
    ):
        for adapters in sorted({1, max(1, num_seqs // 4), num_seqs}):
            if len(ranks) == 1 or adapters > 1:  # one adapter has one rank: not "mixed"
                cases.append(LoRACase(projection, op, num_seqs, tokens, adapters, ranks))
    return cases


def run_lora(grid: Grid, ctx: BenchContext) -> list[dict]:
    config = grid.model(num_layers=1, kv_heads=grid.lora_kv_heads)
    return [run_lora_case(case, config, ctx) for case in lora_cases(grid)]


def run_decode_attention(grid: Grid, ctx: BenchContext) -> list[dict]:
    rows = []
    for kv_heads in grid.attn_kv_heads:
        config = grid.model(num_layers=1, kv_heads=kv_heads)
        for batch in grid.attn_batches:
            for context in grid.attn_contexts:
                case = DecodeAttentionCase(
                    batch=batch,
                    context=context,
                    kv_heads=kv_heads,
                    q_heads=config.num_heads,
                    head_dim=config.head_dim,
                    block_size=grid.block_size,
                    target=(batch, context) == grid.attn_target,
                )
                rows.append(run_decode_case(case, ctx))
    return rows


def run_prefill_attention(grid: Grid, ctx: BenchContext) -> list[dict]:
    rows = []
    for kv_heads in grid.prefill_kv_heads:
        config = grid.model(num_layers=1, kv_heads=kv_heads)
        for num_seqs, new_tokens, prefix in grid.prefill_shapes:
            case = PrefillAttentionCase(
                num_seqs=num_seqs,
                new_tokens=new_tokens,
                prefix=prefix,
                kv_heads=kv_heads,
                q_heads=config.num_heads,
                head_dim=config.head_dim,
                block_size=grid.block_size,
            )
            rows.append(run_prefill_case(case, ctx))
    return rows


def run_decode_step(grid: Grid, ctx: BenchContext, layers: int | None) -> list[dict]:
    rows = []
    for kv_heads in grid.step_kv_heads:
        requested = layers or grid.step_layers
        probe = grid.model(num_layers=requested, kv_heads=kv_heads)
        pool_rows = max(grid.step_adapter_counts) * grid.step_rank
        fitted = fit_layers(
            probe, requested, grid.step_batch, grid.step_context, pool_rows, grid.block_size
        )
        if fitted < requested:
            print(f"decode step: {requested} layers do not fit the free memory; {fitted} do")
        case = StepCase(
            config=grid.model(num_layers=max(1, fitted), kv_heads=kv_heads),
            batch=grid.step_batch,
            context=grid.step_context,
            rank=grid.step_rank,
            adapter_counts=grid.step_adapter_counts,
            target_adapters=grid.step_target_adapters,
            block_size=grid.block_size,
        )
        rows += run_step_case(case, ctx)
        free_device_memory()  # this model before the next one
    return rows


# --- the run ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (plumbing)")
    mode.add_argument("--quick", action="store_true", help="a reduced grid on the GPU")
    parser.add_argument(
        "--layers",
        type=int,
        help="decode-step layers (default: 32, or fewer when they do not fit; 2 in --smoke)",
    )
    parser.add_argument("--iters", type=int, help="timed runs per measurement (median)")
    parser.add_argument("--warmup", type=int, help="untimed runs before them")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {', '.join(SECTIONS)}",
    )
    add_output_options(parser)
    args = parser.parse_args(argv)
    check_output_options(parser, args)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be ≥ 1")
    return args


def use_triton_interpreter() -> None:
    """Run the Triton kernels on the CPU: before any kernel module is imported."""
    from loramux.kernels.dispatch import KERNELS_ENV
    from loramux.kernels.interpreter import use_cpu_interpreter

    os.environ.setdefault(KERNELS_ENV, "triton")
    use_cpu_interpreter()


def results_slug(device: torch.device, grid: Grid, sections: list[str]) -> str:
    """``nvidia-h100-80gb-hbm3`` for a full run; other grids and section subsets say so,
    so that they never overwrite the full run's files."""
    name = "cpu" if device.type == "cpu" else device_slug(torch.cuda.get_device_name(device))
    parts = [name] + ([] if grid.name == "full" else [grid.name])
    if set(sections) != set(SECTIONS):
        parts += [s for s in SECTIONS if s in sections]
    return "-".join(parts)


def _targets(grid: Grid, sections: dict) -> dict:
    batch, context = grid.attn_target
    # The smoke grid's stand-in shapes get verdicts too (the plumbing is the same), marked.
    note = "; smoke run, not a measurement" if grid.name == "smoke" else ""
    return {
        "decode_step_lora_overhead": step_verdict(
            sections.get("decode_step", []),
            f"rank {grid.step_rank} on all seven modules, {grid.step_target_adapters} distinct "
            f"adapters, batch {grid.step_batch}, context {grid.step_context}{note}",
        ),
        "decode_attention_bandwidth": attention_verdict(
            sections.get("decode_attention", []), f"batch {batch} × {context} context{note}"
        ),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("kernels_gpu: no CUDA device; run on a GPU, or use --smoke", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        use_triton_interpreter()
    grid = _grids()["smoke" if args.smoke else "quick" if args.quick else "full"]
    timer = Timer(
        device,
        iters=grid.iters if args.iters is None else args.iters,
        warmup=grid.warmup if args.warmup is None else args.warmup,
    )
    rates = measure_rates(
        timer, grid.dtype, copy_bytes=grid.copy_bytes, matmul_size=grid.matmul_size
    )
    tolerance = 1e-4 if grid.dtype == torch.float32 else 1e-2
    ctx = BenchContext(
        device=device, dtype=grid.dtype, timer=timer, rates=rates, tolerance=tolerance
    )
    runners = {
        "decode_attention": run_decode_attention,
        "decode_step": partial(run_decode_step, layers=args.layers),
        "prefill_attention": run_prefill_attention,
        "lora": run_lora,
    }
    slug = results_slug(device, grid, args.sections)
    paths = (args.out / f"kernels_gpu_{slug}.json", args.out / f"kernels_gpu_{slug}.md")
    results = {
        "benchmark": "kernels_gpu",
        "complete": False,
        "machine": machine_info(device),
        "rates": {
            "copy_gbs": rates.copy_bytes_per_s / 1e9,
            "matmul_tflops": rates.matmul_flops_per_s / 1e12,
        },
        "config": {
            "grid": grid.name,
            "dtype": str(grid.dtype).removeprefix("torch."),
            "iters": timer.iters,
            "warmup": timer.warmup,
            "tolerance": tolerance,
            "step_tolerance": STEP_TOLERANCE[grid.dtype],
            "sections": args.sections,
        },
        "command": " ".join(["python -m loramux.benchmarks.kernels_gpu", *(argv or sys.argv[1:])]),
        "sections": {},
        "seconds": {},  # wall time of each section, set-up and checks included
        "targets": _targets(grid, {}),
    }
    print(
        f"{results['machine']['accelerator']['device']}: copy {results['rates']['copy_gbs']:.0f} GB/s, "
        f"matmul {results['rates']['matmul_tflops']:.1f} TFLOP/s ({grid.name} grid)",
        flush=True,
    )
    for section in (s for s in SECTIONS if s in args.sections):
        began = time.perf_counter()
        rows = runners[section](grid, ctx)
        results["seconds"][section] = round(time.perf_counter() - began, 1)
        results["sections"][section] = rows
        results["targets"] = _targets(grid, results["sections"])
        write_json(paths[0], results)
        write_markdown(paths[1], results)
        print(text_table(section, rows), flush=True)
        print(f"({section}: {results['seconds'][section]} s)\n", flush=True)
    return finish(results, paths)


def finish(results: dict, paths: tuple[Path, Path]) -> int:
    """Mark the results complete, write them, print the verdicts; the exit code."""
    rows = [row for rows in results["sections"].values() for row in rows]
    mismatched = [row for row in rows if not row.get("matches")]
    results["complete"] = True
    results["all_match"] = not mismatched
    write_json(paths[0], results)
    write_markdown(paths[1], results)
    for verdict in results["targets"].values():
        print(f"{verdict['line']} — {verdict['detail']}")
    for section, section_rows in results["sections"].items():
        ok = sum(bool(r.get("matches")) for r in section_rows)
        print(f"{section}: {ok}/{len(section_rows)} rows match their reference")
    print(f"wrote {paths[0]} and {paths[1]}")
    if mismatched:
        print(f"{len(mismatched)} rows did not match (or failed): exit 1", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
