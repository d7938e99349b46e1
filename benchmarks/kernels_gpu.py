"""GPU benchmark of loramux's Triton kernels at Llama-7B shapes, and of whole steps.

At Llama-7B shapes (hidden 4096, 32 query heads and 8 or 32 KV heads of dim 128,
intermediate 11008, bf16) it times

* LoRA shrink and expand (``kernels_gpu_lora``): SGMV on prefill batches, BGMV/SGMV on
  decode batches of 1 to 256 tokens, ranks 8 to 64 and mixed, 1 to batch distinct
  adapters, for the q/k/v and gate/up projection groups; torch gather + bmm baseline;
  and the fused shrink+expand on the batches the engine fuses, against the two launches;
* paged decode and prefill attention (``kernels_gpu_attention``) against the torch
  reference (SDPA over gathered pages); decode also as a fraction of copy bandwidth;
* one full decode step of the engine's model (``kernels_gpu_step``) with rank-16 LoRA on
  all seven modules against the same step without LoRA, eager and replayed from a CUDA
  graph, with the LoRA launches it makes per layer; and one prefill step of 2,048 tokens
  (``kernels_gpu_prefill_step``) likewise;
* weight-only quantized linear layers (``kernels_gpu_quant``): the Triton kernel on int8
  per-channel and int4 (groups of 32 and 128) weights of the q/o, gate/up and down
  projections, 1 to 2048 tokens, against the dense bf16 ``F.linear``; decode rows also as
  achieved bandwidth;

each with its floor from bytes moved over the measured copy bandwidth and FLOPs over the
measured matmul rate (``kernels_gpu_timing``), and checks every kernel's output against
a float32 reference once per shape. Four targets get a verdict: at batch 64 with rank-16
adapters on all seven modules, the decode step with 64 distinct adapters ≤ 1.25× the base
step and with one adapter ≤ 1.10× (CUDA graphs), each ≤ 1.5× eagerly; the prefill of 2,048
tokens with 4 adapters ≤ 1.15× the base prefill; paged decode attention at batch 64 ×
2048 context ≥ 70% of the copy bandwidth.

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
import re
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from loramux.benchmarks.bench_gpu_model import LLAMA_7B
from loramux.benchmarks.common.files import add_output_options, check_output_options
from loramux.benchmarks.common.machine import machine_info

# None of these imports a Triton kernel module at import time: the kernels are imported
# where they run, after main() has chosen compiler or interpreter.
from loramux.benchmarks.kernels_gpu_attention import AttentionCase, run_attention_case
from loramux.benchmarks.kernels_gpu_lora import PROJECTIONS, LoRACase, run_lora_case
from loramux.benchmarks.kernels_gpu_prefill_step import PrefillStepCase, run_prefill_step_case
from loramux.benchmarks.kernels_gpu_quant import QuantCase, projection_shapes, run_quant_case
from loramux.benchmarks.kernels_gpu_report import target_verdicts, text_table, write_results
from loramux.benchmarks.kernels_gpu_step import (
    STEP_TOLERANCE,
    StepCase,
    decode_targets,
    fit_layers,
    run_step_case,
)
from loramux.benchmarks.kernels_gpu_timing import (
    BenchContext,
    Timer,
    free_device_memory,
    measure_rates,
)
from loramux.engine.model.config import ModelConfig
from loramux.kernels.dispatch import KERNELS_ENV
from loramux.kernels.interpreter import use_cpu_interpreter
from loramux.kernels.lora_tiles import tiles_for

SECTIONS = (  # run order
    "decode_attention",
    "decode_step",
    "prefill_step",
    "prefill_attention",
    "lora",
    "quant_linear",
)


def llama_config(*, num_layers: int, kv_heads: int, **shape) -> ModelConfig:
    """Llama-7B's shape (``bench_gpu_model.LLAMA_7B``) with ``num_layers`` layers and
    ``kv_heads`` KV heads (32, or 8 for a GQA variant); ``shape`` overrides HF fields."""
    hf_config = {**LLAMA_7B, "num_hidden_layers": num_layers, "num_key_value_heads": kv_heads}
    return ModelConfig.from_hf_dict({**hf_config, **shape})


@dataclasses.dataclass(frozen=True)
class Grid:
    """The shapes of one run; the defaults are the full grid's."""

    name: str = "full"
    dtype: torch.dtype = torch.bfloat16
    model: Callable[..., ModelConfig] = llama_config  # (num_layers=, kv_heads=) -> shape
    block_size: int = 16
    copy_bytes: int = 1 << 30  # the copy-bandwidth buffer
    matmul_size: int = 8192  # n of the n³ matmul-rate product
    iters: int = 50
    warmup: int = 10
    lora_kv_heads: int = 8
    lora_decode_batches: tuple[int, ...] = (1, 8, 32, 64, 128, 256)
    lora_prefill_shapes: tuple[tuple[int, int], ...] = ((1, 2048), (8, 256), (64, 32))
    # one rank, or several (mixed)
    lora_ranks: tuple[tuple[int, ...], ...] = ((8,), (16,), (32,), (64,), (8, 16, 32, 64))
    attn_batches: tuple[int, ...] = (1, 8, 64, 256)
    attn_contexts: tuple[int, ...] = (512, 2048, 8192)
    attn_kv_heads: tuple[int, ...] = (8, 32)
    attn_target: tuple[int, int] = (64, 2048)  # (batch, context) of the bandwidth target
    # Decode attention over these KV caches too (the target is the model dtype's)
    attn_kv_cache_dtypes: tuple[str, ...] = ("auto", "fp8", "int8")
    # (sequences, new tokens, prefix)
    prefill_shapes: tuple[tuple[int, int, int], ...] = ((1, 2048, 0), (8, 512, 1024))
    prefill_kv_heads: tuple[int, ...] = (8, 32)
    step_layers: int = 32
    step_kv_heads: tuple[int, ...] = (32, 8)
    step_batch: int = 64
    step_context: int = 512
    step_rank: int = 16
    # (sequences, new tokens each): 2,048 tokens, one adapter per sequence at most
    prefill_step_shape: tuple[int, int] = (4, 512)
    prefill_step_adapter_counts: tuple[int, ...] = (1, 4)
    prefill_step_kv_heads: tuple[int, ...] = (32,)
    step_adapter_counts: tuple[int, ...] = (1, 16, 64)  # 1 and step_batch: the targets'
    # (projection, N, K): Llama-7B's q/o, gate/up and down weights
    quant_shapes: tuple[tuple[str, int, int], ...] = projection_shapes(
        LLAMA_7B["hidden_size"], LLAMA_7B["intermediate_size"]
    )
    quant_tokens: tuple[int, ...] = (1, 16, 64, 256, 2048)
    # (kind, group size): None is per-channel
    quant_weights: tuple[tuple[str, int | None], ...] = (
        ("int8", None),
        ("int4", 32),
        ("int4", 128),
    )


QUICK = Grid(
    name="quick",
    lora_decode_batches=(1, 64, 256),
    lora_prefill_shapes=((1, 2048), (64, 32)),
    lora_ranks=((16,), (64,)),
    attn_batches=(1, 64, 256),
    attn_contexts=(2048,),
    prefill_shapes=((8, 512, 1024),),
    prefill_kv_heads=(8,),
    step_adapter_counts=(1, 64),
    quant_tokens=(1, 64, 2048),
)
SMOKE = Grid(
    name="smoke",
    dtype=torch.float32,
    model=partial(
        llama_config,
        hidden_size=128,
        intermediate_size=192,
        num_attention_heads=4,
        vocab_size=256,
    ),
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
    attn_kv_heads=(2,),
    attn_target=(3, 300),
    attn_kv_cache_dtypes=("auto", "fp8"),
    prefill_shapes=((1, 24, 0), (2, 8, 16)),
    prefill_kv_heads=(2,),
    step_layers=2,
    step_kv_heads=(2,),
    step_batch=4,
    step_context=20,
    step_rank=8,
    step_adapter_counts=(1, 4),
    prefill_step_shape=(2, 8),
    prefill_step_adapter_counts=(1, 2),
    prefill_step_kv_heads=(2,),
    # one shape (K a multiple of the 128-input group): the interpreter is slow
    quant_shapes=projection_shapes(128, 256)[:1],
    quant_tokens=(1, 5),
)


def run_lora(grid: Grid, ctx: BenchContext) -> list[dict]:
    """Every (projection, op, batch, ranks) with 1, batch / 4 and batch distinct adapters;
    the fused op on the batches the engine fuses."""
    config = grid.model(num_layers=1, kv_heads=grid.lora_kv_heads)
    shapes = [(b, 1) for b in grid.lora_decode_batches] + list(grid.lora_prefill_shapes)
    gpu = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None
    fused_max_tokens = tiles_for(gpu).fused_max_tokens  # the steps the engine fuses
    rows = []
    for projection, op, (num_seqs, tokens), ranks in itertools.product(
        PROJECTIONS, ("shrink", "expand", "fused"), shapes, grid.lora_ranks
    ):
        if op == "fused" and num_seqs * tokens > fused_max_tokens:
            continue
        for adapters in sorted({1, max(1, num_seqs // 4), num_seqs}):
            if len(ranks) == 1 or adapters > 1:  # one adapter has one rank: not "mixed"
                case = LoRACase(projection, op, num_seqs, tokens, adapters, ranks)
                rows.append(run_lora_case(case, config, ctx))
    return rows


def run_quant_linear(grid: Grid, ctx: BenchContext) -> list[dict]:
    """Every (projection, tokens, quantized form), each against the dense layer."""
    rows = []
    for (projection, n, k), tokens, (kind, group) in itertools.product(
        grid.quant_shapes, grid.quant_tokens, grid.quant_weights
    ):
        case = QuantCase(projection, n, k, tokens, kind, group)
        rows.append(run_quant_case(case, ctx))
    return rows


def run_attention(grid: Grid, ctx: BenchContext, decode: bool) -> list[dict]:
    """Decode: every (KV heads, batch, context); prefill: every (KV heads, shape)."""
    if decode:
        kv_heads = grid.attn_kv_heads
        pairs = itertools.product(grid.attn_batches, grid.attn_contexts)
        shapes = [(batch, 1, context - 1) for batch, context in pairs]  # (seqs, new, prefix)
    else:
        kv_heads, shapes = grid.prefill_kv_heads, grid.prefill_shapes
    rows = []
    kv_cache_dtypes = grid.attn_kv_cache_dtypes if decode else ("auto",)
    for heads, kv_cache_dtype in itertools.product(kv_heads, kv_cache_dtypes):
        config = grid.model(num_layers=1, kv_heads=heads)
        for num_seqs, new_tokens, prefix in shapes:
            case = AttentionCase(
                num_seqs=num_seqs,
                new_tokens=new_tokens,
                prefix=prefix,
                kv_heads=heads,
                q_heads=config.num_heads,
                head_dim=config.head_dim,
                block_size=grid.block_size,
                target=decode
                and kv_cache_dtype == "auto"
                and (num_seqs, prefix + new_tokens) == grid.attn_target,
                kv_cache_dtype=kv_cache_dtype,
            )
            rows.append(run_attention_case(case, ctx))
    return rows


def run_decode_step(grid: Grid, ctx: BenchContext, layers: int | None) -> list[dict]:
    rows = []
    for kv_heads in grid.step_kv_heads:
        case = StepCase(
            config=grid.model(num_layers=layers or grid.step_layers, kv_heads=kv_heads),
            batch=grid.step_batch,
            context=grid.step_context,
            rank=grid.step_rank,
            adapter_counts=grid.step_adapter_counts,
            targets=decode_targets(grid.step_batch),
            block_size=grid.block_size,
        )
        rows += run_step_case(_fitted(case, grid, kv_heads, "decode step"), ctx)
        free_device_memory()  # this model before the next one
    return rows


def _fitted(case, grid: Grid, kv_heads: int, what: str):
    """``case`` with as many of its layers as fit the free memory (``fit_layers``)."""
    fitted, requested = fit_layers(case), case.config.num_layers
    if fitted >= requested:
        return case
    print(f"{what}: {requested} layers do not fit the free memory; {fitted} do")
    config = grid.model(num_layers=max(1, fitted), kv_heads=kv_heads)
    return dataclasses.replace(case, config=config)


def run_prefill_step(grid: Grid, ctx: BenchContext, layers: int | None) -> list[dict]:
    rows = []
    seqs, tokens = grid.prefill_step_shape
    for kv_heads in grid.prefill_step_kv_heads:
        case = PrefillStepCase(
            config=grid.model(num_layers=layers or grid.step_layers, kv_heads=kv_heads),
            seqs=seqs,
            tokens=tokens,
            rank=grid.step_rank,
            adapter_counts=grid.prefill_step_adapter_counts,
            block_size=grid.block_size,
        )
        rows += run_prefill_step_case(_fitted(case, grid, kv_heads, "prefill step"), ctx)
        free_device_memory()
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (plumbing)")
    mode.add_argument("--quick", action="store_true", help="a reduced grid on the GPU")
    parser.add_argument(
        "--layers",
        type=int,
        help="decode and prefill step layers (default: 32, or fewer when they do not fit; "
        "2 in --smoke)",
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


def results_slug(device: torch.device, grid: Grid, sections: list[str]) -> str:
    """``nvidia-h100-80gb-hbm3`` for a full run; other grids and section subsets say so,
    so that they never overwrite the full run's files."""
    # NVIDIA H100 80GB HBM3 -> nvidia-h100-80gb-hbm3
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    name = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "cpu"
    parts = [name] + ([] if grid.name == "full" else [grid.name])
    if set(sections) != set(SECTIONS):
        parts += [s for s in SECTIONS if s in sections]
    return "-".join(parts)


def _target_shapes(grid: Grid) -> dict[str, str]:
    """The shape each target judges, for its verdict line (keys: ``TARGETS``' keys)."""
    batch, context = grid.attn_target
    # The smoke grid's stand-in shapes get verdicts too (the plumbing is the same), marked.
    note = "; smoke run, not a measurement" if grid.name == "smoke" else ""
    step = (
        f"rank {grid.step_rank} on all seven modules, batch {grid.step_batch}, "
        f"context {grid.step_context}{note}"
    )
    seqs, tokens = grid.prefill_step_shape
    return {
        "decode_step_distinct_adapters": f"{grid.step_batch} distinct adapters, {step}",
        "decode_step_one_adapter": f"one adapter, {step}",
        "prefill_step_adapters": f"{seqs} sequences × {tokens} tokens, one adapter each, "
        f"rank {grid.step_rank} on all seven modules{note}",
        "decode_attention_bandwidth": f"batch {batch} × {context} context{note}",
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("kernels_gpu: no CUDA device; run on a GPU, or use --smoke", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":  # the Triton kernels on the CPU: before any kernel module loads
        os.environ.setdefault(KERNELS_ENV, "triton")
        use_cpu_interpreter()
    grid = SMOKE if args.smoke else QUICK if args.quick else Grid()
    iters = grid.iters if args.iters is None else args.iters
    warmup = grid.warmup if args.warmup is None else args.warmup
    timer = Timer(device, iters=iters, warmup=warmup)
    rates = measure_rates(
        timer, grid.dtype, copy_bytes=grid.copy_bytes, matmul_size=grid.matmul_size
    )
    tolerance = 1e-4 if grid.dtype == torch.float32 else 1e-2
    ctx = BenchContext(
        device=device, dtype=grid.dtype, timer=timer, rates=rates, tolerance=tolerance
    )
    runners = {
        "decode_attention": partial(run_attention, decode=True),
        "decode_step": partial(run_decode_step, layers=args.layers),
        "prefill_step": partial(run_prefill_step, layers=args.layers),
        "prefill_attention": partial(run_attention, decode=False),
        "lora": run_lora,
        "quant_linear": run_quant_linear,
    }
    shapes = _target_shapes(grid)
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
        "targets": target_verdicts({}, shapes),
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
        results["targets"] = target_verdicts(results["sections"], shapes)
        write_results(paths, results)
        print(text_table(section, rows), flush=True)
        print(f"({section}: {results['seconds'][section]} s)\n", flush=True)
    return finish(results, paths)


def finish(results: dict, paths: tuple[Path, Path]) -> int:
    """Mark the results complete, write them, print the verdicts; the exit code."""
    rows = [row for rows in results["sections"].values() for row in rows]
    mismatched = [row for row in rows if not row.get("matches")]
    results["complete"] = True
    results["all_match"] = not mismatched
    write_results(paths, results)
    for target in results["targets"].values():
        print(f"{target['line']} — {target['detail']}")
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
