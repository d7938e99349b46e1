"""LoRA shrink, expand and both fused: the Triton launchers against their baselines.

A case is one fused projection of the model (``qkv``: the q/k/v slices of the hidden
state; ``gate_up``: the gate and up slices), one op, and one batch: ``num_seqs``
sequences of ``tokens_per_seq`` tokens each (1: a decode batch), ``num_adapters``
distinct adapters over them, grouped as the scheduler groups them (sequence i uses
adapter ``i * num_adapters // num_seqs``), adapter a of rank ``ranks[a % len(ranks)]``.
The launcher is the one the public op dispatches to: BGMV when every segment is one
token (distinct adapters on a decode batch), SGMV otherwise (prefill, or decode
sequences that share an adapter, which ``LoRABatch`` merges into one segment).

Bytes and FLOPs of the floor, with e the element size, K = in_features, S slices of
widths n_s (N = Σ n_s), T tokens, r_a adapter a's rank, r_t that of token t's adapter and
R the largest rank:

    shrink  bytes = e (T K  +  S K Σ_a r_a  +  S T R)     x read, each distinct adapter's
            flops = 2 K S Σ_t r_t                           A rows read once, y written
    expand  bytes = e (S Σ_t r_t  +  N Σ_a r_a  +  2 T N)  y read, each distinct adapter's
            flops = 2 N Σ_t r_t                             B rows read once, out read+written

    fused   bytes = e (T K  +  (S K + N) Σ_a r_a  +  2 T N)  no intermediate in memory
            flops = 2 (K S + N) Σ_t r_t

The baseline of shrink and expand is ``lora_{shrink,expand}_slices_gather_bmm`` (gather
every token's adapter rows, one bmm per slice); that of ``fused`` (decode-sized batches,
the engine's form for them: per token when every segment is one token, per segment tile
otherwise) is the two-launch Triton path it replaces, a shrink then an expand into the
slices' own outputs. Each is checked once per case against the float32 reference
(``lora_*_slices_reference`` on upcast inputs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from loramux.benchmarks.kernels_gpu_timing import BenchContext, kernel_row, run_case
from loramux.engine.model.config import ModelConfig
from loramux.kernels.lora import (
    lora_expand_slices_gather_bmm,
    lora_expand_slices_reference,
    lora_shrink_slices_gather_bmm,
    lora_shrink_slices_reference,
)
from loramux.kernels.lora_batch import LoRABatch

PROJECTIONS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
LORA_SCALE = 0.5  # c of every adapter: any finite value costs the same


@dataclass(frozen=True)
class LoRACase:
    projection: str  # a key of PROJECTIONS
    op: str  # "shrink", "expand" or "fused"
    num_seqs: int
    tokens_per_seq: int  # 1: a decode batch
    num_adapters: int
    ranks: tuple[int, ...]  # adapter a has rank ranks[a % len(ranks)]


def grouped_spans(num_seqs: int, tokens_per_seq: int, adapters: list) -> list[tuple]:
    """Spans ``(start, end, adapter)``: sequence i uses ``adapters[i * len // num_seqs]``,
    consecutive sequences with the same adapter merged (the runner's layout)."""
    spans: list[tuple] = []
    for i in range(num_seqs):
        adapter = adapters[i * len(adapters) // num_seqs]
        start, end = i * tokens_per_seq, (i + 1) * tokens_per_seq
        if spans and spans[-1][2] == adapter:
            spans[-1] = (spans[-1][0], end, adapter)
        else:
            spans.append((start, end, adapter))
    return spans


@dataclass
class _Problem:
    batch: LoRABatch
    in_features: int
    widths: list[int]  # n_s per slice
    num_rows: int  # pool rows: Σ_a r_a, each adapter's rows contiguous
    tokens_per_rank: int  # Σ_t r_t of one slice


def _problem(case: LoRACase, config: ModelConfig, device: torch.device) -> _Problem:
    modules = PROJECTIONS[case.projection]
    in_features = config.module_shape(modules[0])[0]
    widths = [config.module_shape(m)[1] for m in modules]
    ranks = [case.ranks[a % len(case.ranks)] for a in range(case.num_adapters)]
    starts = [sum(ranks[:a]) for a in range(len(ranks))]
    rows = [list(range(start, start + r)) for start, r in zip(starts, ranks, strict=True)]
    spans = grouped_spans(case.num_seqs, case.tokens_per_seq, list(range(case.num_adapters)))
    batch = LoRABatch.build(
        spans,
        adapter_rows=rows,
        ranks=[ranks] * len(modules),
        scales=[[LORA_SCALE] * len(ranks)] * len(modules),
        num_tokens=case.num_seqs * case.tokens_per_seq,
        device=device,
    )
    tokens_per_rank = sum((end - start) * ranks[a] for start, end, a in spans)
    return _Problem(batch, in_features, widths, sum(ranks), tokens_per_rank)


def lora_traffic(case: LoRACase, problem: _Problem, element_size: int) -> tuple[int, int]:
    """(bytes, flops) of the floor, by the module docstring's formulas."""
    k, widths = problem.in_features, problem.widths
    s, n = len(widths), sum(widths)
    t = problem.batch.num_tokens
    rank_rows = problem.num_rows  # Σ_a r_a
    if case.op == "shrink":
        num_bytes = t * k + s * k * rank_rows + s * t * problem.batch.max_rank
        return num_bytes * element_size, 2 * k * s * problem.tokens_per_rank
    if case.op == "fused":
        num_bytes = t * k + (s * k + n) * rank_rows + 2 * t * n
        return num_bytes * element_size, 2 * (k * s + n) * problem.tokens_per_rank
    num_bytes = s * problem.tokens_per_rank + n * rank_rows + 2 * t * n
    return num_bytes * element_size, 2 * n * problem.tokens_per_rank


def run_lora_case(case: LoRACase, config: ModelConfig, ctx: BenchContext) -> dict:
    ranks = "/".join(map(str, case.ranks))
    fields = {
        "projection": case.projection,
        "op": case.op,
        "phase": "decode" if case.tokens_per_seq == 1 else "prefill",
        "num_seqs": case.num_seqs,
        "tokens": case.num_seqs * case.tokens_per_seq,
        "adapters": case.num_adapters,
        "rank": ranks if len(case.ranks) == 1 else f"mixed {ranks}",
    }
    return run_case(fields, lambda: _measure(case, config, ctx))


def _measure(case: LoRACase, config: ModelConfig, ctx: BenchContext) -> dict:
    from loramux.kernels import lora_triton  # after the caller chose compiler or interpreter

    problem = _problem(case, config, ctx.device)
    kernel_name = "bgmv" if problem.batch.is_decode else "sgmv"
    if case.op == "fused":
        triton_fn, baseline_fn, expected = _fused(problem, kernel_name, ctx)
        kernel_name = f"fused-{kernel_name}"
    else:
        kernel = getattr(lora_triton, f"lora_{case.op}_{kernel_name}")
        inputs = _shrink if case.op == "shrink" else _expand
        triton_fn, baseline_fn, expected = inputs(problem, kernel, ctx)
    num_bytes, flops = lora_traffic(case, problem, ctx.dtype.itemsize)
    return {
        "kernel": kernel_name,
        **kernel_row(ctx, triton_fn, baseline_fn, expected, num_bytes, flops),
    }


def _random(shape, ctx: BenchContext, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, dtype=ctx.dtype, device=ctx.device) * std


def _shrink(problem: _Problem, kernel: Callable, ctx: BenchContext) -> tuple:
    """The Triton and baseline shrinks of random inputs, and the float32 reference."""
    batch, k = problem.batch, problem.in_features
    # A ~ N(0, 1/K) keeps y ~ N(0, 1) for x ~ N(0, 1).
    a_pools = [_random((problem.num_rows, k), ctx, k**-0.5) for _ in problem.widths]
    x = _random((batch.num_tokens, k), ctx)
    expected = lora_shrink_slices_reference(x.float(), [p.float() for p in a_pools], batch)
    args = (x, a_pools, batch)
    return partial(kernel, *args), partial(lora_shrink_slices_gather_bmm, *args), expected


def _expand(problem: _Problem, kernel: Callable, ctx: BenchContext) -> tuple:
    """The Triton and baseline expands (each adding into its own copy of a random output,
    which it returns), and the float32 reference."""
    batch, widths = problem.batch, problem.widths
    offsets = [sum(widths[:s]) for s in range(len(widths))]
    # B ~ N(0, 1/R) keeps the delta ~ N(0, c²) for y ~ N(0, 1): the same scale as out.
    b_pools = [_random((problem.num_rows, n), ctx, max(1, batch.max_rank) ** -0.5) for n in widths]
    y = _random((len(widths), batch.num_tokens, batch.max_rank), ctx)
    out0 = _random((batch.num_tokens, sum(widths)), ctx)
    expected = out0.to(torch.float32, copy=True)  # .float() would alias a float32 out0
    lora_expand_slices_reference(expected, y.float(), [p.float() for p in b_pools], offsets, batch)
    # Timed runs keep adding into the same buffers: the cost does not depend on the values.
    return (
        partial(_add_into, kernel, out0.clone(), y, b_pools, offsets, batch),
        partial(_add_into, lora_expand_slices_gather_bmm, out0.clone(), y, b_pools, offsets, batch),
        expected,
    )


def _add_into(expand: Callable, out: torch.Tensor, *args) -> torch.Tensor:
    expand(out, *args)
    return out


def _fused(problem: _Problem, form: str, ctx: BenchContext) -> tuple:
    """The fused launch (the form and tiles the engine's backend takes for the batch) and
    the two-launch Triton path (its baseline), each adding into its own copy of a random
    output, and the float32 reference."""
    from loramux.kernels import lora_triton, lora_triton_fused
    from loramux.kernels.lora_tiles import tiles_for

    batch, k, widths = problem.batch, problem.in_features, problem.widths
    tiles = tiles_for(torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None)
    a_pools = [_random((problem.num_rows, k), ctx, k**-0.5) for _ in widths]
    b_pools = [_random((problem.num_rows, n), ctx, max(1, batch.max_rank) ** -0.5) for n in widths]
    x = _random((batch.num_tokens, k), ctx)
    out0 = _random((batch.num_tokens, sum(widths)), ctx)
    expected = out0.to(torch.float32, copy=True)
    offsets = [sum(widths[:s]) for s in range(len(widths))]
    y = lora_shrink_slices_reference(x.float(), [p.float() for p in a_pools], batch)
    lora_expand_slices_reference(expected, y, [p.float() for p in b_pools], offsets, batch)
    if form == "bgmv":
        launch = partial(lora_triton_fused.lora_fused_bgmv, tiles=tiles.decode)
    else:
        launch = partial(lora_triton_fused.lora_fused_sgmv, tiles=tiles.segments)
    shrink = getattr(lora_triton, f"lora_shrink_{form}")
    expand = getattr(lora_triton, f"lora_expand_{form}_outs")
    # Each adds into its own copy of out through the slices' column views (the kernels take
    # one output per slice); timed runs keep adding: the cost does not depend on the values.
    fused_out, two_launch_out = out0.clone(), out0.clone()
    fused_views = lora_triton.slice_views(fused_out, b_pools, offsets)
    two_launch_views = lora_triton.slice_views(two_launch_out, b_pools, offsets)

    def fused() -> torch.Tensor:
        launch(x, fused_views, a_pools, b_pools, batch)
        return fused_out

    def two_launches() -> torch.Tensor:
        expand(two_launch_views, shrink(x, a_pools, batch), b_pools, batch)
        return two_launch_out

    return fused, two_launches, expected
