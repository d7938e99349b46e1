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
(``lora_*_slices_reference`` on upcast inputs). Inputs are random: A ~ N(0, 1/K) keeps
y ~ N(0, 1) for x ~ N(0, 1), and B ~ N(0, 1/R) the delta ~ N(0, c²), the scale of out.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from loramux.benchmarks.kernels_gpu.timing import BenchContext, kernel_row, run_case
from loramux.engine.model.config import ModelConfig
from loramux.kernels.lora import (
    lora_expand_slices_gather_bmm,
    lora_expand_slices_reference,
    lora_shrink_slices_gather_bmm,
    lora_shrink_slices_reference,
)
from loramux.kernels.lora_batch import LoRABatch
from loramux.kernels.lora_tiles import tiles_for

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


def lora_batch(ranks: list[int], spans: list[tuple], slices: int, tokens: int, device) -> LoRABatch:
    """Adapter a of rank ``ranks[a]`` in every slice over ``spans``, its pool rows after
    adapter a - 1's."""
    starts = itertools.accumulate(ranks[:-1], initial=0)
    rows = [list(range(start, start + r)) for start, r in zip(starts, ranks, strict=True)]
    scales = [[LORA_SCALE] * len(ranks)] * slices
    return LoRABatch.build(spans, rows, [ranks] * slices, scales, tokens, device)


def device_tiles(device: torch.device):
    """The fused kernels' tiles the engine takes on ``device``."""
    return tiles_for(torch.cuda.get_device_name(device) if device.type == "cuda" else None)


def lora_traffic(
    op: str, in_features: int, widths: list[int], batch: LoRABatch, ranks: list[int], spans
) -> tuple[int, int]:
    """(elements read and written, flops) of the floor, by the module docstring's formulas."""
    k, s, n, t = in_features, len(widths), sum(widths), batch.num_tokens
    rank_rows = sum(ranks)  # Σ_a r_a
    token_ranks = sum((end - start) * ranks[a] for start, end, a in spans)  # Σ_t r_t
    if op == "shrink":
        return t * k + s * k * rank_rows + s * t * batch.max_rank, 2 * k * s * token_ranks
    if op == "fused":
        return t * k + (s * k + n) * rank_rows + 2 * t * n, 2 * (k * s + n) * token_ranks
    return s * token_ranks + n * rank_rows + 2 * t * n, 2 * n * token_ranks


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
    # After the caller chose compiler or interpreter.
    from loramux.kernels import lora_triton, lora_triton_fused

    modules = PROJECTIONS[case.projection]
    k = config.module_shape(modules[0])[0]
    widths = [config.module_shape(m)[1] for m in modules]
    offsets = list(itertools.accumulate(widths[:-1], initial=0))
    ranks = [case.ranks[a % len(case.ranks)] for a in range(case.num_adapters)]
    spans = grouped_spans(case.num_seqs, case.tokens_per_seq, list(range(case.num_adapters)))
    batch = lora_batch(ranks, spans, len(modules), case.num_seqs * case.tokens_per_seq, ctx.device)
    form = "bgmv" if batch.is_decode else "sgmv"

    def rand(rows: int, columns: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(rows, columns, dtype=ctx.dtype, device=ctx.device) * std

    a_pools = [rand(sum(ranks), k, k**-0.5) for _ in widths]
    b_pools = [rand(sum(ranks), n, max(1, batch.max_rank) ** -0.5) for n in widths]
    x, out0 = rand(batch.num_tokens, k), rand(batch.num_tokens, sum(widths))
    y = lora_shrink_slices_reference(x.float(), [p.float() for p in a_pools], batch)
    if case.op == "shrink":
        args = (x, a_pools, batch)
        kernel = getattr(lora_triton, f"lora_shrink_{form}")
        triton_fn, expected = partial(kernel, *args), y
        baseline_fn = partial(lora_shrink_slices_gather_bmm, *args)
    else:
        # Each adds into its own copy of out0, which it returns; timed runs keep adding:
        # the cost does not depend on the values.
        out, base_out = out0.clone(), out0.clone()
        if case.op == "expand":
            y = y.to(ctx.dtype)  # its input: [S, T, R]
            kernel = getattr(lora_triton, f"lora_expand_{form}")
            triton_fn = _into(out, partial(kernel, out, y, b_pools, offsets, batch))
            baseline = partial(lora_expand_slices_gather_bmm, base_out, y, b_pools, offsets, batch)
        else:  # the engine's form and tiles for the batch, into the slices' column views
            tiles = device_tiles(ctx.device)
            tiles = tiles.decode if form == "bgmv" else tiles.segments
            fused = getattr(lora_triton_fused, f"lora_fused_{form}")
            views = lora_triton.slice_views(out, b_pools, offsets)
            triton_fn = _into(out, partial(fused, x, views, a_pools, b_pools, batch, tiles))
            shrink = getattr(lora_triton, f"lora_shrink_{form}")
            expand = getattr(lora_triton, f"lora_expand_{form}_outs")
            base_views = lora_triton.slice_views(base_out, b_pools, offsets)

            def baseline() -> None:  # the two launches it replaces
                expand(base_views, shrink(x, a_pools, batch), b_pools, batch)

        baseline_fn = _into(base_out, baseline)
        expected = out0.to(torch.float32, copy=True)  # .float() would alias a float32 out0
        b_float = [p.float() for p in b_pools]
        lora_expand_slices_reference(expected, y.float(), b_float, offsets, batch)
    elements, flops = lora_traffic(case.op, k, widths, batch, ranks, spans)
    row = kernel_row(ctx, triton_fn, baseline_fn, expected, elements * ctx.dtype.itemsize, flops)
    return {"kernel": f"fused-{form}" if case.op == "fused" else form, **row}


def _into(out: torch.Tensor, launch: Callable[[], object]) -> Callable[[], torch.Tensor]:
    """``launch`` (which adds into ``out``), returning ``out``."""

    def run() -> torch.Tensor:
        launch()
        return out

    return run
