"""Paged attention: the Triton decode and prefill kernels against the torch reference.

The cache holds random keys and values; each sequence's blocks are scattered over the
cache in random order (a running engine's allocator hands out whatever is free). Every
context is exactly ``context`` tokens long (decode: including the new token).

Bytes and FLOPs of the floor, with e the element size, B sequences, L_s their context
lengths, n_s their new tokens (T = Σ n_s queries), Hq / Hkv query / KV heads of dim D:

    bytes = e (2 Σ_s L_s Hkv D  +  2 T Hq D)  +  4 Σ_s ceil(L_s / block)
            keys and values of each context read once, queries read, outputs written,
            the int32 block tables read
    flops = 4 Hq D Σ_s Σ_i (p_i + 1)          q·k and p·v for the keys each query sees
                                               (decode: p + 1 = L_s)

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

from loramux.benchmarks.kernels_gpu_timing import (
    BenchContext,
    relative_error,
    run_case,
    timing_fields,
)
from loramux.kernels.paged_attention import paged_attention_reference, plan_attention

BASELINE_GATHER_BYTES = 16 << 30
CHECK_SEQS = 8
TARGET_COPY_FRACTION = 0.70


@dataclass(frozen=True)
class DecodeAttentionCase:
    batch: int
    context: int
    kv_heads: int
    q_heads: int
    head_dim: int
    block_size: int
    target: bool  # the target's shape (batch 64 × 2048 on the GPU grid)


@dataclass(frozen=True)
class PrefillAttentionCase:
    num_seqs: int
    new_tokens: int  # per sequence
    prefix: int  # tokens already cached before them
    kv_heads: int
    q_heads: int
    head_dim: int
    block_size: int


@dataclass
class _PagedKV:
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    tables: torch.Tensor  # [B, max_blocks] int32, 0-padded
    table_lists: list[list[int]]
    context_lens: list[int]
    lens: torch.Tensor  # [B] int32

    @property
    def table_bytes(self) -> int:
        return 4 * sum(map(len, self.table_lists))


def shuffled_block_tables(context_lens: list[int], block_size: int) -> list[list[int]]:
    """Block tables over blocks ``0 .. total - 1``, each sequence's blocks in random places."""
    counts = [math.ceil(length / block_size) for length in context_lens]
    order = list(range(sum(counts)))
    random.Random(0).shuffle(order)
    ends = list(itertools.accumulate(counts))
    return [order[end - count : end] for end, count in zip(ends, counts, strict=True)]


def padded_tables(table_lists: list[list[int]], device: torch.device) -> torch.Tensor:
    """``[B, max_blocks]`` int32, 0-padded: the Triton kernels' block tables."""
    width = max(map(len, table_lists))
    rows = [t + [0] * (width - len(t)) for t in table_lists]
    return torch.tensor(rows, dtype=torch.int32, device=device)


def random_paged_kv(
    context_lens: list[int], kv_heads: int, head_dim: int, block_size: int, ctx: BenchContext
) -> _PagedKV:
    table_lists = shuffled_block_tables(context_lens, block_size)
    shape = (sum(map(len, table_lists)), block_size, kv_heads, head_dim)
    return _PagedKV(
        k_cache=torch.randn(shape, dtype=ctx.dtype, device=ctx.device),
        v_cache=torch.randn(shape, dtype=ctx.dtype, device=ctx.device),
        tables=padded_tables(table_lists, ctx.device),
        table_lists=table_lists,
        context_lens=list(context_lens),
        lens=torch.tensor(context_lens, dtype=torch.int32, device=ctx.device),
    )


def _reference_first_seqs(
    query: torch.Tensor, kv: _PagedKV, query_lens: list[int], num_seqs: int, scale: float
) -> torch.Tensor:
    """float32 reference for the first ``num_seqs`` sequences, on a compacted cache copy."""
    tables = kv.table_lists[:num_seqs]
    blocks = torch.tensor([b for t in tables for b in t], device=kv.k_cache.device)
    renumbered, next_block = [], 0
    for table in tables:
        renumbered.append(list(range(next_block, next_block + len(table))))
        next_block += len(table)
    rows = sum(query_lens[:num_seqs])
    return paged_attention_reference(
        query[:rows].float(),
        kv.k_cache[blocks].float(),
        kv.v_cache[blocks].float(),
        renumbered,
        kv.context_lens[:num_seqs],
        query_lens[:num_seqs],
        scale,
    )


def _attention_traffic(
    kv: _PagedKV, queries: int, q_heads: int, head_dim: int, element_size: int, keys_seen: int
) -> tuple[int, int]:
    """(bytes, flops) by the module docstring; ``keys_seen`` = Σ_s Σ_i (p_i + 1)."""
    kv_heads = kv.k_cache.shape[2]
    kv_elements = 2 * sum(kv.context_lens) * kv_heads * head_dim
    num_bytes = element_size * (kv_elements + 2 * queries * q_heads * head_dim) + kv.table_bytes
    return num_bytes, 4 * q_heads * head_dim * keys_seen


def _baseline_fits(kv: _PagedKV, ctx: BenchContext) -> bool:
    gathered = 2 * sum(kv.context_lens) * kv.k_cache.shape[2] * kv.k_cache.shape[3]
    return gathered * ctx.element_size <= BASELINE_GATHER_BYTES


def run_decode_case(case: DecodeAttentionCase, ctx: BenchContext) -> dict:
    fields = {
        "batch": case.batch,
        "context": case.context,
        "q_heads": case.q_heads,
        "kv_heads": case.kv_heads,
        "head_dim": case.head_dim,
        "target": case.target,
    }
    return run_case(fields, lambda: _measure_decode(case, ctx))


def _measure_decode(case: DecodeAttentionCase, ctx: BenchContext) -> dict:
    from loramux.kernels import attention_triton  # after the caller chose compiler or interpreter

    kv = random_paged_kv(
        [case.context] * case.batch, case.kv_heads, case.head_dim, case.block_size, ctx
    )
    query = torch.randn(case.batch, case.q_heads, case.head_dim, dtype=ctx.dtype, device=ctx.device)
    scale = case.head_dim**-0.5
    triton_fn = partial(
        attention_triton.paged_decode_attention,
        query,
        kv.k_cache,
        kv.v_cache,
        kv.tables,
        kv.lens,
        scale,
        max_context_len=case.context,
    )
    query_lens = [1] * case.batch
    checked = min(case.batch, CHECK_SEQS)
    expected = _reference_first_seqs(query, kv, query_lens, checked, scale)
    errors = {"triton_rel_err": relative_error(triton_fn()[:checked], expected)}
    triton_s = ctx.timer.median_s(triton_fn)
    baseline_s = None
    if _baseline_fits(kv, ctx):
        plan = plan_attention(
            kv.table_lists, kv.context_lens, query_lens, case.block_size, ctx.device
        )
        baseline_fn = partial(
            paged_attention_reference,
            query,
            kv.k_cache,
            kv.v_cache,
            kv.table_lists,
            kv.context_lens,
            query_lens,
            scale,
            plan,
        )
        errors["baseline_rel_err"] = relative_error(baseline_fn()[:checked], expected)
        baseline_s = ctx.timer.median_s(baseline_fn)
    num_bytes, flops = _attention_traffic(
        kv, case.batch, case.q_heads, case.head_dim, ctx.element_size, sum(kv.context_lens)
    )
    fraction = num_bytes / triton_s / ctx.rates.copy_bytes_per_s
    return {
        "num_splits": attention_triton.choose_num_splits(case.context, case.batch, case.kv_heads),
        **timing_fields(ctx, triton_s, baseline_s, num_bytes, flops),
        "achieved_gbs": num_bytes / triton_s / 1e9,
        "copy_fraction": fraction,
        "target_pass": fraction >= TARGET_COPY_FRACTION if case.target else None,
        **errors,
        "matches": ctx.matches(errors),
    }


def run_prefill_case(case: PrefillAttentionCase, ctx: BenchContext) -> dict:
    fields = {
        "num_seqs": case.num_seqs,
        "new_tokens": case.new_tokens,
        "prefix": case.prefix,
        "q_heads": case.q_heads,
        "kv_heads": case.kv_heads,
        "head_dim": case.head_dim,
    }
    return run_case(fields, lambda: _measure_prefill(case, ctx))


def _measure_prefill(case: PrefillAttentionCase, ctx: BenchContext) -> dict:
    from loramux.kernels import attention_triton

    context = case.prefix + case.new_tokens
    kv = random_paged_kv(
        [context] * case.num_seqs, case.kv_heads, case.head_dim, case.block_size, ctx
    )
    tokens = case.num_seqs * case.new_tokens
    query = torch.randn(tokens, case.q_heads, case.head_dim, dtype=ctx.dtype, device=ctx.device)
    starts = torch.arange(
        0, tokens + 1, case.new_tokens, dtype=torch.int32, device=ctx.device
    )  # [S + 1] cumulative query rows
    scale = case.head_dim**-0.5
    triton_fn = partial(
        attention_triton.paged_prefill_attention,
        query,
        kv.k_cache,
        kv.v_cache,
        kv.tables,
        kv.lens,
        starts,
        scale,
        case.new_tokens,
    )
    query_lens = [case.new_tokens] * case.num_seqs
    checked = min(case.num_seqs, CHECK_SEQS)
    expected = _reference_first_seqs(query, kv, query_lens, checked, scale)
    rows = checked * case.new_tokens
    errors = {"triton_rel_err": relative_error(triton_fn()[:rows], expected)}
    triton_s = ctx.timer.median_s(triton_fn)
    plan = plan_attention(kv.table_lists, kv.context_lens, query_lens, case.block_size, ctx.device)
    baseline_fn = partial(
        paged_attention_reference,
        query,
        kv.k_cache,
        kv.v_cache,
        kv.table_lists,
        kv.context_lens,
        query_lens,
        scale,
        plan,
    )
    errors["baseline_rel_err"] = relative_error(baseline_fn()[:rows], expected)
    baseline_s = ctx.timer.median_s(baseline_fn)
    # Query i of a sequence sits at p_i = prefix + i and sees p_i + 1 keys.
    n = case.new_tokens
    keys_seen = case.num_seqs * (n * case.prefix + n * (n + 1) // 2)
    num_bytes, flops = _attention_traffic(
        kv, tokens, case.q_heads, case.head_dim, ctx.element_size, keys_seen
    )
    return {
        **timing_fields(ctx, triton_s, baseline_s, num_bytes, flops),
        **errors,
        "matches": ctx.matches(errors),
    }
