"""Paged attention: the Triton decode and prefill kernels against the torch reference.

A case is ``num_seqs`` sequences of ``prefix`` cached tokens and ``new_tokens`` new ones
each; one new token is a decode batch (Triton's decode kernel), more a prefill batch
(its prefill kernel). The cache holds random keys and values; each sequence's blocks are
scattered over the cache in random order (a running engine's allocator hands out
whatever is free).

Bytes and FLOPs of the floor, with e the element size, B sequences, L_s their context
lengths, n_s their new tokens (T = Σ n_s queries), Hq / Hkv query / KV heads of dim D:

    bytes = e (2 Σ_s L_s Hkv D  +  2 T Hq D)  +  4 Σ_s ceil(L_s / block)
            keys and values of each context read once, queries read, outputs written,
            the int32 block tables read
    flops = 4 Hq D Σ_s Σ_i (p_i + 1)          q·k and p·v for the keys each query sees
                                               (decode: p + 1 = L_s)

With ``kv_cache_dtype`` int8 or fp8 the kernels read an 8-bit cache (``kernels/kv_quant.py``):
``e`` of the keys and values becomes ``(D + 4) / D`` bytes (the data and each slot's scale),
and the reference reads the de-quantized values.

Decode rows also give the achieved bandwidth (bytes / time) and its fraction of the
measured copy bandwidth: the target is ≥ 70% at batch 64 × 2048 context.

The baseline is ``paged_attention_reference`` with its plan built beforehand (as the
runner does once per step): decodes gather every context into a padded batch and run
one SDPA; prefills run a masked SDPA per sequence. Its gathered copy of the contexts
takes as much memory as the cache: above ``BASELINE_GATHER_BYTES`` it is not run.
Correctness: the Triton output (and the baseline's) against the reference in float32 on
a compacted copy of the first ``CHECK_SEQS`` sequences' blocks.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from functools import partial

import torch

from loramux.benchmarks.kernels_gpu.timing import BenchContext, kernel_row, run_case
from loramux.kernels.kv_quant import (
    QuantizedKV,
    bytes_per_slot_head,
    dequantize_kv,
    storage_dtype,
    write_quantized_kv,
)
from loramux.kernels.paged_attention import paged_attention_reference, plan_attention

BASELINE_GATHER_BYTES = 16 << 30
CHECK_SEQS = 8
TARGET_COPY_FRACTION = 0.70


@dataclass(frozen=True)
class AttentionCase:
    num_seqs: int
    new_tokens: int  # per sequence; 1: a decode batch
    prefix: int  # tokens already cached before them
    kv_heads: int
    q_heads: int
    head_dim: int
    block_size: int
    target: bool = False  # the decode target's shape (batch 64 × 2048 on the GPU grid)
    kv_cache_dtype: str = "auto"  # "int8" / "fp8": an 8-bit cache (kernels/kv_quant.py)

    @property
    def decode(self) -> bool:
        return self.new_tokens == 1


def shuffled_block_tables(context_lens: list[int], block_size: int) -> list[list[int]]:
    """Block tables over blocks ``0 .. total - 1``, each sequence's blocks in random places."""
    counts = [math.ceil(length / block_size) for length in context_lens]
    order = list(range(sum(counts)))
    random.Random(0).shuffle(order)
    ends = list(itertools.accumulate(counts))
    return [order[end - count : end] for end, count in zip(ends, counts, strict=True)]


def _quantized(cache: torch.Tensor, storage: torch.dtype) -> QuantizedKV:
    """``cache`` ([num_blocks, block_size, Hkv, D]) written into an 8-bit cache, every slot."""
    blocks, block_size, heads, head_dim = cache.shape
    quantized = QuantizedKV.empty(blocks, block_size, heads, head_dim, storage, cache.device)
    slots = torch.arange(blocks * block_size, device=cache.device)
    write_quantized_kv(cache.view(-1, heads, head_dim), quantized, slots)
    return quantized


def run_attention_case(case: AttentionCase, ctx: BenchContext) -> dict:
    heads = {"q_heads": case.q_heads, "kv_heads": case.kv_heads, "head_dim": case.head_dim}
    if case.decode:
        target = "decode_attention_bandwidth" if case.target else None
        shape = {"batch": case.num_seqs, "context": case.prefix + 1, "target": target}
    else:
        shape = {"num_seqs": case.num_seqs, "new_tokens": case.new_tokens, "prefix": case.prefix}
    fields = {**shape, **heads, "kv_cache_dtype": case.kv_cache_dtype}
    return run_case(fields, lambda: _measure(case, ctx))


def _measure(case: AttentionCase, ctx: BenchContext) -> dict:
    from loramux.kernels import attention_triton  # after the caller chose compiler or interpreter

    n = case.new_tokens
    context, tokens = case.prefix + n, case.num_seqs * n
    context_lens, query_lens = [context] * case.num_seqs, [n] * case.num_seqs
    tables = shuffled_block_tables(context_lens, case.block_size)
    shape = (sum(map(len, tables)), case.block_size, case.kv_heads, case.head_dim)
    k_cache, v_cache = (torch.randn(shape, dtype=ctx.dtype, device=ctx.device) for _ in "kv")
    # What the kernels read: the float caches, or their 8-bit forms (whose values the
    # reference reads back).
    k_read, v_read, kv_bytes_per_elem = k_cache, v_cache, float(ctx.dtype.itemsize)
    storage = storage_dtype(case.kv_cache_dtype)
    if storage is not None:
        k_read, v_read = (_quantized(c, storage) for c in (k_cache, v_cache))
        k_cache, v_cache = (dequantize_kv(c.data, c.scales, ctx.dtype) for c in (k_read, v_read))
        kv_bytes_per_elem = bytes_per_slot_head(case.head_dim, storage) / case.head_dim
    query = torch.randn(tokens, case.q_heads, case.head_dim, dtype=ctx.dtype, device=ctx.device)
    # Every sequence has as many blocks: the kernels' [B, max_blocks] tables need no padding.
    table_tensor = torch.tensor(tables, dtype=torch.int32, device=ctx.device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=ctx.device)
    scale = case.head_dim**-0.5
    paged = (query, k_read, v_read, table_tensor, lens)
    if case.decode:
        kernel = attention_triton.paged_decode_attention
        triton_fn = partial(kernel, *paged, scale, max_context_len=context)
    else:
        starts = torch.arange(0, tokens + 1, n, dtype=torch.int32, device=ctx.device)  # [S + 1]
        triton_fn = partial(attention_triton.paged_prefill_attention, *paged, starts, scale, n)
    kv_elements = 2 * sum(context_lens) * case.kv_heads * case.head_dim
    baseline_fn = None
    if kv_elements * ctx.dtype.itemsize <= BASELINE_GATHER_BYTES:
        plan = plan_attention(tables, context_lens, query_lens, case.block_size, ctx.device)
        baseline_fn = partial(
            paged_attention_reference, *paged[:3], tables, context_lens, query_lens, scale, plan
        )
    # float32 reference for the first sequences, on a compacted copy of their blocks.
    checked = min(case.num_seqs, CHECK_SEQS)
    blocks = torch.tensor(tables[:checked], device=ctx.device).flatten()
    expected = paged_attention_reference(
        query[: checked * n].float(),
        k_cache[blocks].float(),
        v_cache[blocks].float(),
        torch.arange(len(blocks)).view(checked, -1).tolist(),
        context_lens[:checked],
        query_lens[:checked],
        scale,
    )
    # The floor by the module docstring; query i of a sequence sits at p_i = prefix + i.
    keys_seen = case.num_seqs * (n * case.prefix + n * (n + 1) // 2)
    q_bytes = ctx.dtype.itemsize * 2 * tokens * case.q_heads * case.head_dim
    num_bytes = int(kv_bytes_per_elem * kv_elements) + q_bytes + 4 * table_tensor.numel()
    flops = 4 * case.q_heads * case.head_dim * keys_seen
    row = kernel_row(ctx, triton_fn, baseline_fn, expected, num_bytes, flops, checked * n)
    if not case.decode:
        return row
    fraction = num_bytes / (row["triton_ms"] / 1e3) / ctx.rates.copy_bytes_per_s
    return {
        "num_splits": attention_triton.choose_num_splits(context, case.num_seqs, case.kv_heads),
        **row,
        "achieved_gbs": fraction * ctx.rates.copy_bytes_per_s / 1e9,
        "copy_fraction": fraction,
        "target_pass": fraction >= TARGET_COPY_FRACTION if case.target else None,
    }
