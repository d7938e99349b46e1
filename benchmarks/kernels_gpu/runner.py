"""``loramux bench kernels-gpu``: loramux's Triton kernels at Llama-7B shapes, and whole steps.

Each section times its kernels at Llama-7B shapes (bf16 on the GPU) against a floor (bytes
over the measured copy bandwidth, FLOPs over the measured matmul rate: ``timing.py``) and
a torch or two-launch baseline, and checks every output against a float32 reference once
per shape: LoRA shrink, expand and both fused (``lora.py``); paged decode and prefill
attention (``attention.py``); a full decode step, eager and replayed from a CUDA graph,
and a prefill step, with LoRA on all seven modules against the same step without
(``step.py``); weight-only int8 / int4 linear layers against dense bf16 (``quant.py``).
The targets and their verdicts are ``report.TARGETS``.

    python -m loramux.benchmarks.kernels_gpu          # full grid on the GPU (a few minutes)
    python -m loramux.benchmarks.kernels_gpu --quick  # a reduced grid
    python -m loramux.benchmarks.kernels_gpu --smoke --out /tmp/x  # CPU plumbing (seconds)

Writes ``kernels_gpu_<device>.json`` (every row, the machine, the measured ceilings) and
``.md`` (verdicts and tables) to ``--out`` after every section, so a run cut short keeps
what it measured; ``--quick``, ``--smoke`` and a subset of ``--sections`` add their names
to ``<device>``. Exits 1 when any output did not match its reference (or a case failed),
2 without a GPU outside ``--smoke``, which runs the same code at tiny shapes in float32 on
the CPU: the Triton kernels in Triton's interpreter (``TRITON_INTERPRET=1``) and the
engine's ops on the Triton path (``LORAMUX_KERNELS=triton``), each unless already set.
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

from loramux.benchmarks.common.files import add_output_options, check_output_options
from loramux.benchmarks.common.machine import machine_info
from loramux.benchmarks.common.report import write

# None of these imports a Triton kernel module at import time: the kernels are imported
# where they run, after run() has chosen compiler or interpreter.
from loramux.benchmarks.kernels_gpu.attention import AttentionCase, run_attention_case
from loramux.benchmarks.kernels_gpu.lora import PROJECTIONS, LoRACase, device_tiles, run_lora_case
from loramux.benchmarks.kernels_gpu.quant import QuantCase, projection_shapes, run_quant_case
from loramux.benchmarks.kernels_gpu.report import render, target_verdicts
from loramux.benchmarks.kernels_gpu.step import STEP_TOLERANCE, StepCase, fit_layers, run_step_case
from loramux.benchmarks.kernels_gpu.timing import (
    BenchContext,
    Timer,
    free_device_memory,
    measure_rates,
)
from loramux.benchmarks.serve.gpu_model import LLAMA_7B
from loramux.engine.model.config import ModelConfig
from loramux.kernels.dispatch import KERNELS_ENV
from loramux.kernels.interpreter import use_cpu_interpreter


def llama_config(*, num_layers: int, kv_heads: int, **shape) -> ModelConfig:
    """Llama-7B's shape (``serve.gpu_model.LLAMA_7B``) with ``num_layers`` layers and
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
    fused_max_tokens = device_tiles(ctx.device).fused_max_tokens
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
    cases = itertools.product(grid.quant_shapes, grid.quant_tokens, grid.quant_weights)
    return [
        run_quant_case(QuantCase(projection, n, k, tokens, kind, group), ctx)
        for (projection, n, k), tokens, (kind, group) in cases
    ]


def run_attention(grid: Grid, ctx: BenchContext, decode: bool) -> list[dict]:
    """Decode: every (KV heads, KV cache, batch, context); prefill: every (KV heads, shape)."""
    if decode:
        kv_heads, kv_cache_dtypes = grid.attn_kv_heads, grid.attn_kv_cache_dtypes
        pairs = itertools.product(grid.attn_batches, grid.attn_contexts)
        shapes = [(batch, 1, context - 1) for batch, context in pairs]  # (seqs, new, prefix)
    else:
        kv_heads, kv_cache_dtypes, shapes = grid.prefill_kv_heads, ("auto",), grid.prefill_shapes
    rows = []
    for heads, kv_cache_dtype in itertools.product(kv_heads, kv_cache_dtypes):
        config = grid.model(num_layers=1, kv_heads=heads)
        for num_seqs, new_tokens, prefix in shapes:
            target = (num_seqs, prefix + new_tokens) == grid.attn_target
            case = AttentionCase(
                num_seqs=num_seqs,
                new_tokens=new_tokens,
                prefix=prefix,
                kv_heads=heads,
                q_heads=config.num_heads,
                head_dim=config.head_dim,
                block_size=grid.block_size,
                target=decode and kv_cache_dtype == "auto" and target,
                kv_cache_dtype=kv_cache_dtype,
            )
            rows.append(run_attention_case(case, ctx))
    return rows


def run_steps(grid: Grid, ctx: BenchContext, decode: bool) -> list[dict]:
    """The decode or prefill step for each KV head count, with as many of its layers as fit
    the free memory."""
    if decode:
        all_kv_heads, seqs, new, prefix = grid.step_kv_heads, grid.step_batch, 1, grid.step_context
        adapter_counts = grid.step_adapter_counts
    else:
        all_kv_heads, (seqs, new), prefix = grid.prefill_step_kv_heads, grid.prefill_step_shape, 0
        adapter_counts = grid.prefill_step_adapter_counts
    rows = []
    for kv_heads in all_kv_heads:
        config = grid.model(num_layers=grid.step_layers, kv_heads=kv_heads)
        case = StepCase(config, seqs, new, prefix, grid.step_rank, adapter_counts, grid.block_size)
        fitted = fit_layers(case)
        if fitted < config.num_layers:
            what = "decode step" if decode else "prefill step"
            print(f"{what}: {config.num_layers} layers do not fit the free memory; {fitted} do")
            config = grid.model(num_layers=max(1, fitted), kv_heads=kv_heads)
            case = dataclasses.replace(case, config=config)
        rows += run_step_case(case, ctx)
        free_device_memory()  # this model before the next one
    return rows


RUNNERS = {  # run order
    "decode_attention": partial(run_attention, decode=True),
    "decode_step": partial(run_steps, decode=True),
    "prefill_step": partial(run_steps, decode=False),
    "prefill_attention": partial(run_attention, decode=False),
    "lora": run_lora,
    "quant_linear": run_quant_linear,
}


def add_options(parser: argparse.ArgumentParser) -> None:
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
        default=",".join(RUNNERS),
        help=f"comma-separated subset of {', '.join(RUNNERS)}",
    )
    add_output_options(parser)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_output_options(parser, args)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(RUNNERS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(RUNNERS)}")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be ≥ 1")


def results_slug(device: torch.device, grid: Grid, sections: list[str]) -> str:
    """``nvidia-h100-80gb-hbm3`` for a full run; other grids and section subsets say so,
    so that they never overwrite the full run's files."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    name = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "cpu"
    parts = [name] + ([] if grid.name == "full" else [grid.name])
    if set(sections) != set(RUNNERS):
        parts += [s for s in RUNNERS if s in sections]
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


def run(args: argparse.Namespace) -> int:
    if not args.smoke and not torch.cuda.is_available():
        print("kernels_gpu: no CUDA device; run on a GPU, or use --smoke", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":  # the Triton kernels on the CPU: before any kernel module loads
        os.environ.setdefault(KERNELS_ENV, "triton")
        use_cpu_interpreter()
    grid = SMOKE if args.smoke else QUICK if args.quick else Grid()
    if args.layers:
        grid = dataclasses.replace(grid, step_layers=args.layers)
    iters = grid.iters if args.iters is None else args.iters
    warmup = grid.warmup if args.warmup is None else args.warmup
    timer = Timer(device, iters=iters, warmup=warmup)
    rates = measure_rates(
        timer, grid.dtype, copy_bytes=grid.copy_bytes, matmul_size=grid.matmul_size
    )
    tolerance = 1e-4 if grid.dtype == torch.float32 else 1e-2
    ctx = BenchContext(device, grid.dtype, timer, rates, tolerance)
    shapes = _target_shapes(grid)
    stem = args.out / f"kernels_gpu_{results_slug(device, grid, args.sections)}"
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
        "command": args.command_line,
        "sections": {},
        "seconds": {},  # wall time of each section, set-up and checks included
        "targets": target_verdicts({}, shapes),
    }
    print(
        f"{results['machine']['accelerator']['device']}: copy {results['rates']['copy_gbs']:.0f} "
        f"GB/s, matmul {results['rates']['matmul_tflops']:.1f} TFLOP/s ({grid.name} grid)",
        flush=True,
    )
    for section in (s for s in RUNNERS if s in args.sections):
        began = time.perf_counter()
        results["sections"][section] = RUNNERS[section](grid, ctx)
        results["seconds"][section] = round(time.perf_counter() - began, 1)
        results["targets"] = target_verdicts(results["sections"], shapes)
        # a run cut short keeps what it measured
        write(stem, results, render(results), echo=False)
        print(f"({section}: {results['seconds'][section]} s)\n", flush=True)
    return finish(results, stem)


def finish(results: dict, stem: Path) -> int:
    """Mark the results complete, write them, say what matched; the exit status."""
    rows = [row for rows in results["sections"].values() for row in rows]
    mismatched = [row for row in rows if not row.get("matches")]
    results["complete"] = True
    results["all_match"] = not mismatched
    write(stem, results, render(results))
    for section, section_rows in results["sections"].items():
        ok = sum(bool(r.get("matches")) for r in section_rows)
        print(f"{section}: {ok}/{len(section_rows)} rows match their reference")
    if mismatched:
        print(f"{len(mismatched)} rows did not match (or failed): exit 1", file=sys.stderr)
        return 1
    return 0
