"""Attention over the paged KV cache.

Layout: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, kv_heads, head_dim]``;
a sequence's token at position p lives in block ``block_table[p // block_size]`` at
offset ``p % block_size``. A flat slot id is ``block * block_size + offset``.

Semantics (per sequence s with ``L_s`` tokens of context after this step, whose last
``n_s`` tokens are the new queries, query head h reading KV head ``h // (Hq / Hkv)``):

    out[i, h] = sum_{j <= p_i} softmax_j(q[i, h] . k[j, h'] * scale) v[j, h']

with ``p_i = L_s - n_s + i`` (causal, bottom-right aligned: new tokens see the whole
cached prefix). Decode is the case ``n_s = 1``. Accumulation in float32. A layer with a
sliding window of ``w`` keys (Gemma 3's local layers, Mistral-style models) sums over
``p_i - w < j <= p_i`` only: each op takes ``window`` (None: every key).

Each implementation has its own plan, built once per step and shared by every layer:
:class:`AttentionPlan` for the torch implementation here (:func:`attend_reference`),
:class:`TritonAttentionPlan` for the Triton kernels of
:mod:`loramux.kernels.attention_triton`. The engine's backend picks one pair once; no op
here chooses between them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from loramux.kernels.kv_quant import QuantizedKV, gather_quantized_context, write_quantized_kv

if TYPE_CHECKING:
    from loramux.kernels.attention_native import NativePrefillAttention

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


KVCache = torch.Tensor | QuantizedKV  # one layer's keys (or values)


def write_kv(
    key: torch.Tensor,  # [T, kv_heads, head_dim]
    value: torch.Tensor,  # [T, kv_heads, head_dim]
    k_cache: KVCache,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: KVCache,
    slot_mapping: torch.Tensor,  # [T] int64 flat slot per token
) -> None:
    """``cache.flat[slot_mapping[t]] = kv[t]`` for both caches, in place (quantized as
    ``kv_quant`` says for a quantized cache)."""
    for x, cache in ((key, k_cache), (value, v_cache)):
        if isinstance(cache, QuantizedKV):
            write_quantized_kv(x, cache, slot_mapping)
        else:
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x.to(cache.dtype))


def gather_kv(cache: KVCache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The keys (or values) of contexts: ``slots`` ``[R, L]``, each row the flat slots of
    positions ``0 .. L-1`` through one block table; returns ``[R, L, kv_heads, head_dim]``.
    (index_select on the flat slots: several times faster on a CPU than 2-D indexing; a
    quantized cache copies whole blocks.)"""
    if isinstance(cache, QuantizedKV):
        return gather_quantized_context(cache, slots, dtype)
    flat = cache.view(-1, *cache.shape[2:]).index_select(0, slots.reshape(-1))
    return flat.view(*slots.shape, *cache.shape[2:])


# Sequences with at most this many new tokens over a cached prefix attend as that many
# decode rows (row j: a query whose context ends at its own position), batched with the
# decodes; other chunks attend one sequence at a time. It is the verification of
# speculative proposals (k + 1 rows over a cached prefix) that this keeps batched: on the
# CPU a masked SDPA per verifying sequence made a batch-4 step with proposals 10% slower.
# A prompt's first chunk stays on its own: its prompt logprobs then do not depend on the
# rows beside it (a batched SDPA's last bits do).
SHORT_QUERY_ROWS = 8


@dataclass(frozen=True)
class AttentionPlan:
    """The torch implementation's per-step indices (built once, shared by every layer).

    Decode tokens (one query each), and the rows of short chunks (``SHORT_QUERY_ROWS``),
    are attended in one batched call over their contexts padded to the longest; longer
    prefill chunks one sequence at a time.
    """

    positions: torch.Tensor  # [T] absolute position of every new token
    new_token_slots: torch.Tensor  # [T] flat cache slot each new token's KV is written to
    decode_rows: torch.Tensor  # [B] token rows of the decode queries
    decode_slots: torch.Tensor  # [B, L_max] flat cache slots of each context (block 0 past its end)
    decode_mask: torch.Tensor  # [B, 1, 1, L_max] True where a slot is part of the context
    decode_lengths: torch.Tensor  # [B] int64 keys each decode query sees
    # (first row, n_new, slots [ctx], causal mask [n_new, ctx]) per prefilling sequence; the
    # mask is None for a chunk with no cached prefix (ctx == n_new: plain causal attention)
    prefill: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]
    # window -> (decode mask, prefill masks) of a sliding window, made by the first layer
    # that asks (windowed_masks) and shared by the others
    windowed: dict = field(default_factory=dict)

    @property
    def all_decode(self) -> bool:
        """Every sequence decodes: the decode rows are the whole batch, in order."""
        return not self.prefill

    def windowed_masks(self, window: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The decode mask and each prefill's mask for a sliding window of ``window`` keys:
        query position p sees keys ``p - window < j <= p``."""
        if window not in self.windowed:
            span = torch.arange(self.decode_mask.shape[-1], device=self.decode_mask.device)
            first = (self.decode_lengths - window)[:, None, None, None]
            decode = self.decode_mask & (span >= first)
            prefill = []
            for _, n_new, slots, _ in self.prefill:
                keys = torch.arange(slots.shape[0], device=slots.device)
                queries = keys[slots.shape[0] - n_new :, None]
                prefill.append((keys[None, :] <= queries) & (keys[None, :] > queries - window))
            self.windowed[window] = (decode, prefill)
        return self.windowed[window]


@dataclass(frozen=True)
class TritonAttentionPlan:
    """The Triton kernels' per-step tables (int32, on the device).

    Decode sequences (one new token) in batch order, their query rows being
    ``decode_rows``; prefilling sequences (``n_s > 1``) in batch order, sequence p owning
    query rows ``prefill_query_starts[p] .. prefill_query_ends[p] - 1``. When a step is
    all decodes or all prefills, the tensors are the whole batch's. The maxima are host
    ints so launches never read the device back.
    """

    positions: torch.Tensor  # [T] int64 absolute position of every new token
    new_token_slots: torch.Tensor  # [T] int64 flat cache slot of every new token
    decode_rows: torch.Tensor  # [B] int64 token rows of the decode queries
    decode_block_tables: torch.Tensor  # [B, max_blocks] int32 (0-padded)
    decode_context_lens: torch.Tensor  # [B] int32 L_s
    decode_max_context_len: int
    prefill_block_tables: torch.Tensor  # [P, max_blocks] int32
    prefill_context_lens: torch.Tensor  # [P] int32 L_s
    prefill_query_starts: torch.Tensor  # [P] int32 first query row
    prefill_query_ends: torch.Tensor  # [P] int32 one past the last query row
    prefill_max_query_len: int

    @property
    def num_decodes(self) -> int:
        return self.decode_context_lens.shape[0]

    @property
    def num_prefills(self) -> int:
        return self.prefill_context_lens.shape[0]


def static_decode_plan(
    positions: torch.Tensor,  # [B] int64
    new_token_slots: torch.Tensor,  # [B] int64
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32; 0 for a padding row
    max_context_len: int,  # a bound on every L_s (the context cap)
) -> TritonAttentionPlan:
    """A decode-only plan over the caller's fixed device buffers (the CUDA-graph path).

    The buffers are refilled before every replay, so nothing here reads them: the Triton
    decode kernel takes the tables and lengths as they are, and ``max_context_len`` only
    sizes the launch. Rows with ``L_s = 0`` attend to nothing (zeros).
    """
    batch = context_lens.shape[0]
    rows = torch.arange(batch, dtype=torch.long, device=context_lens.device)
    none = context_lens[:0]
    return TritonAttentionPlan(
        positions=positions,
        new_token_slots=new_token_slots,
        decode_rows=rows,
        decode_block_tables=block_tables,
        decode_context_lens=context_lens,
        decode_max_context_len=max_context_len,
        prefill_block_tables=block_tables[:0],
        prefill_context_lens=none,
        prefill_query_starts=none,
        prefill_query_ends=none,
        prefill_max_query_len=0,
    )


def flat_slots(
    tables: torch.Tensor,  # [S, max_blocks] block ids (padded)
    positions: torch.Tensor,  # [..., N] positions, broadcastable against rows of `tables`
    block_size: int,
) -> torch.Tensor:
    """``table[p // block_size] * block_size + p % block_size`` for each row's positions."""
    return tables.gather(-1, positions // block_size) * block_size + positions % block_size


@dataclass(frozen=True)
class _StepRows:
    """What both plans start from: the step's tables and where its new tokens go."""

    tables: torch.Tensor  # [S, max_blocks] int64 (0-padded)
    ctx: torch.Tensor  # [S] int64 L_s
    n_new: torch.Tensor  # [S] int64 n_s
    ends: torch.Tensor  # [S] int64 one past each sequence's last row
    positions: torch.Tensor  # [T] int64
    new_token_slots: torch.Tensor  # [T] int64
    decode: torch.Tensor  # [B] int64 indices of the decode sequences
    longest_decode: int  # max L_s over the decode sequences (0 without any)


def _step_rows(block_tables, context_lens, query_lens, block_size, device) -> _StepRows:
    long = {"dtype": torch.long, "device": device}
    num_seqs = len(block_tables)
    width = max((len(t) for t in block_tables), default=0) or 1
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], **long)
    tables = tables.reshape(num_seqs, width)
    ctx = torch.tensor(context_lens, **long)
    n_new = torch.tensor(query_lens, **long)
    # New tokens: sequence s owns rows [ends[s] - n_new[s], ends[s]) at positions
    # ctx[s] - n_new[s] .. ctx[s] - 1.
    ends = n_new.cumsum(0)
    total = sum(query_lens)  # host sums and sizes: no device read-back on CUDA
    seq_of_row = torch.repeat_interleave(torch.arange(num_seqs, **long), n_new, output_size=total)
    row = torch.arange(total, **long)
    positions = (ctx - ends)[seq_of_row] + row
    new_token_slots = flat_slots(tables[seq_of_row], positions[:, None], block_size)[:, 0]
    is_decode = [n == 1 for n in query_lens]
    decode = torch.tensor([i for i, d in enumerate(is_decode) if d], **long)
    longest = max((c for c, d in zip(context_lens, is_decode, strict=True) if d), default=0)
    return _StepRows(tables, ctx, n_new, ends, positions, new_token_slots, decode, longest)


def plan_attention(
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    device: torch.device | str,
) -> AttentionPlan:
    """The torch implementation's indices for one step."""
    long = {"dtype": torch.long, "device": device}
    step = _step_rows(block_tables, context_lens, query_lens, block_size, device)
    # Decode rows: (token row, sequence, context length it sees).
    rows: list[tuple[int, int, int]] = []
    prefill = []
    first_row = 0
    for i, (table_len, ctx_len, n) in enumerate(
        zip(map(len, block_tables), context_lens, query_lens, strict=True)
    ):
        if n == 1 or (n <= SHORT_QUERY_ROWS and ctx_len > n):
            # Query j (position ctx - n + j) sees the ctx - n + j + 1 keys up to it.
            rows.extend((first_row + j, i, ctx_len - n + j + 1) for j in range(n))
        else:
            keys = torch.arange(ctx_len, **long)
            slots = flat_slots(step.tables[i, :table_len], keys, block_size)
            # Causal, bottom-right aligned: query j (position ctx - n + j) sees keys <= it.
            # Without a prefix that is SDPA's own (top-left) causal case, which needs no mask.
            causal = None if ctx_len == n else keys[ctx_len - n :, None] >= keys[None, :]
            prefill.append((first_row, n, slots, causal))
        first_row += n
    longest = max((length for _, _, length in rows), default=0)
    span = torch.arange(longest, **long)
    sequences = torch.tensor([seq for _, seq, _ in rows], **long)
    lengths = torch.tensor([length for _, _, length in rows], **long)
    decode_slots = flat_slots(step.tables[sequences], span.expand(len(rows), longest), block_size)
    decode_mask = span[None, :] < lengths[:, None]
    return AttentionPlan(
        positions=step.positions,
        new_token_slots=step.new_token_slots,
        decode_rows=torch.tensor([row for row, _, _ in rows], **long),
        decode_slots=decode_slots,
        decode_mask=decode_mask[:, None, None, :],
        decode_lengths=lengths,
        prefill=prefill,
    )


def plan_attention_triton(
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    device: torch.device | str,
) -> TritonAttentionPlan:
    """The Triton kernels' tables for one step: a few small device ops, aliases of the
    whole batch's tensors when the step is uniform."""
    step = _step_rows(block_tables, context_lens, query_lens, block_size, device)
    tables32, ctx32, ends32 = step.tables.int(), step.ctx.int(), step.ends.int()
    starts32 = ends32 - step.n_new.int()
    num_decodes = step.decode.shape[0]
    if num_decodes == len(query_lens):  # all decodes
        dec_tables, dec_ctx = tables32, ctx32
        pre_tables, pre_ctx, pre_starts, pre_ends = tables32[:0], ctx32[:0], ends32[:0], ends32[:0]
    elif num_decodes == 0:  # all prefills
        dec_tables, dec_ctx = tables32[:0], ctx32[:0]
        pre_tables, pre_ctx, pre_starts, pre_ends = tables32, ctx32, starts32, ends32
    else:
        prefill = torch.tensor(
            [i for i, n in enumerate(query_lens) if n != 1], dtype=torch.long, device=device
        )
        dec_tables, dec_ctx = tables32[step.decode], ctx32[step.decode]
        pre_tables, pre_ctx = tables32[prefill], ctx32[prefill]
        pre_starts, pre_ends = starts32[prefill], ends32[prefill]
    return TritonAttentionPlan(
        positions=step.positions,
        new_token_slots=step.new_token_slots,
        decode_rows=step.ends[step.decode] - 1,
        decode_block_tables=dec_tables,
        decode_context_lens=dec_ctx,
        decode_max_context_len=step.longest_decode,
        prefill_block_tables=pre_tables,
        prefill_context_lens=pre_ctx,
        prefill_query_starts=pre_starts,
        prefill_query_ends=pre_ends,
        prefill_max_query_len=max((n for n in query_lens if n != 1), default=0),
    )


def paged_attention_reference(
    query: torch.Tensor,  # [T, q_heads, head_dim], tokens of all sequences, in order
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: list[list[int]],  # per sequence
    context_lens: list[int],  # L_s: tokens of context including the new ones
    query_lens: list[int],  # n_s: new tokens (queries) per sequence
    scale: float,
    plan: AttentionPlan | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """The definition: the module docstring's maths over plain per-sequence lists."""
    if plan is None:
        plan = plan_attention(
            block_tables, context_lens, query_lens, k_cache.shape[1], query.device
        )
    return attend_reference(query, k_cache, v_cache, plan, scale, window=window)


def attend_reference(
    query: torch.Tensor,  # [T, q_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    gather: Callable = gather_kv,
    window: int | None = None,
    prefill: NativePrefillAttention | None = None,
) -> torch.Tensor:  # [T, q_heads, head_dim]
    """The torch implementation: batched SDPA for decodes, a causal SDPA per prefilling
    sequence. ``gather`` reads contexts (``gather_kv``'s contract; the CPU's native read of
    an 8-bit cache, ``kv_native``, is another). ``window``: a sliding window of keys.
    ``prefill``: the CPU's native causal attention (``attention_native``), which takes the
    prefilling sequences' attention where it takes the operands (no window)."""
    decode_mask, prefill_masks = plan.decode_mask, [causal for *_, causal in plan.prefill]
    if window is not None:
        decode_mask, prefill_masks = plan.windowed_masks(window)
    if plan.all_decode:  # the hot path: no scatter into a fresh tensor
        return _reference_decodes(query, k_cache, v_cache, plan, scale, gather, decode_mask)
    out = torch.empty_like(query)
    if plan.decode_rows.numel():
        decoded = _reference_decodes(
            query.index_select(0, plan.decode_rows),
            k_cache,
            v_cache,
            plan,
            scale,
            gather,
            decode_mask,
        )
        out.index_copy_(0, plan.decode_rows, decoded)
    if prefill is not None and window is None and prefill.takes(query, k_cache, v_cache):
        for first, n_new, slots, _ in plan.prefill:
            span = slice(first, first + n_new)
            prefill.attend(query[span], k_cache, v_cache, slots, scale, out[span])
        return out
    _reference_prefills(query, k_cache, v_cache, plan, scale, out, gather, prefill_masks)
    return out


def _reference_decodes(
    query, k_cache, v_cache, plan: AttentionPlan, scale, gather, mask
) -> torch.Tensor:
    """Attention of the decode queries ``[B, q_heads, head_dim]`` (rows ``decode_rows`` of
    the step): one batched SDPA over their contexts padded to the longest."""
    batch, q_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    # The `group` query heads sharing a KV head act as `group` query positions of
    # that head: q [B, Hkv, group, D] against k, v [B, Hkv, L, D]; no causal mask.
    q = query.view(batch, kv_heads, group, head_dim)
    k = gather(k_cache, plan.decode_slots, query.dtype).transpose(1, 2)
    v = gather(v_cache, plan.decode_slots, query.dtype).transpose(1, 2)
    attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return attn.reshape(batch, q_heads, head_dim)


def _reference_prefills(
    query, k_cache, v_cache, plan: AttentionPlan, scale, out, gather, masks
) -> None:
    """Rows of each prefilling sequence of ``out``: a causal SDPA per sequence.

    The operands are 4-D (``[1, heads, tokens, head_dim]``) and the KV heads are shared by
    ``enable_gqa`` (query head h reads KV head ``h // group``, as the maths says), so that
    torch takes its fused CPU kernel, which never materialises the ``[n_new, ctx]`` scores:
    with 3-D operands, or an explicit mask over a repeated query, it took its math path
    (about 70% of a 2,000-token prefill went to scores, softmax and masking). A chunk with no
    cached prefix needs no mask at all (``is_causal``: fully masked tiles are skipped)."""
    for (first, n_new, slots, _), causal in zip(plan.prefill, masks, strict=True):
        q = query[first : first + n_new].transpose(0, 1)[None].contiguous()  # [1, Hq, n, D]
        k = gather(k_cache, slots[None], query.dtype).transpose(1, 2)  # [1, Hkv, L, D]
        v = gather(v_cache, slots[None], query.dtype).transpose(1, 2)
        attn = F.scaled_dot_product_attention(
            q, k, v, attn_mask=causal, is_causal=causal is None, scale=scale, enable_gqa=True
        )
        out[first : first + n_new] = attn[0].transpose(0, 1)  # [n, Hq, D]
