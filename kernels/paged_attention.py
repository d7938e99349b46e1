"""Attention over the paged KV cache.

Layout: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, kv_heads, head_dim]``;
a sequence's token at position p lives in block ``block_table[p // block_size]`` at
offset ``p % block_size``. A flat slot id is ``block * block_size + offset``.

Semantics (per sequence s with ``L_s`` tokens of context after this step, whose last
``n_s`` tokens are the new queries, query head h reading KV head ``h // (Hq / Hkv)``):

    out[i, h] = sum_{j <= p_i} softmax_j(q[i, h] . k[j, h'] * scale) v[j, h']

with ``p_i = L_s - n_s + i`` (causal, bottom-right aligned: new tokens see the whole
cached prefix). Decode is the case ``n_s = 1``. Accumulation in float32.

Dispatch (:func:`paged_attention`): CUDA tensors in float16/bfloat16/float32 go to the Triton
kernels of :mod:`loramux.kernels.attention_triton` (imported only then) unless
``LORAMUX_KERNELS=reference``; everything else to :func:`paged_attention_reference` (see
:mod:`loramux.kernels.dispatch`).
On the Triton path the decode sequences (``n_s = 1``, rows ``plan.decode_rows``) run the
split-context decode kernel and the others the prefill kernel (or, with
``TRITON_PREFILL = False``, the per-sequence SDPA of the reference), each over its own
sub-batch of the step; together they cover every row exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loramux.kernels.dispatch import use_triton, use_triton_on

# Prefill chunks on CUDA: True runs the Triton prefill kernel, False the reference's
# per-sequence masked SDPA (decodes stay on Triton either way). A benchmark decides.
TRITON_PREFILL = True
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def write_kv(
    key: torch.Tensor,  # [T, kv_heads, head_dim]
    value: torch.Tensor,  # [T, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64 flat slot per token
) -> None:
    """``cache.flat[slot_mapping[t]] = kv[t]`` for both caches, in place."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


@dataclass(frozen=True)
class TritonAttentionPlan:
    """The step's sub-batches as the Triton kernels take them (int32, on the device).

    Decode sequences (one new token) in batch order, their query rows being
    ``AttentionPlan.decode_rows``; prefilling sequences (``n_s > 1``) in batch order,
    sequence p owning query rows ``prefill_query_starts[p] .. prefill_query_ends[p] - 1``.
    When a step is all decodes or all prefills, the tensors are the whole batch's.
    The maxima are host ints so launches never read the device back.
    """

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


@dataclass(frozen=True)
class AttentionPlan:
    """Per-step indices shared by every layer (built once by the runner).

    Decode tokens (one query each) are attended in one batched call over their
    contexts padded to the longest; prefill chunks one sequence at a time.
    """

    positions: torch.Tensor  # [T] absolute position of every new token
    new_token_slots: torch.Tensor  # [T] flat cache slot each new token's KV is written to
    decode_rows: torch.Tensor  # [B] token rows of the decode queries
    decode_slots: torch.Tensor  # [B, L_max] flat cache slots of each context (block 0 past its end)
    decode_mask: torch.Tensor  # [B, 1, 1, L_max] True where a slot is part of the context
    # (first row, n_new, slots [ctx], causal mask [n_new, ctx]) per prefilling sequence
    prefill: list[tuple[int, int, torch.Tensor, torch.Tensor]]
    # Built only for the Triton path (CUDA, references not forced): the CPU path pays nothing.
    triton: TritonAttentionPlan | None = None
    # A plan over fixed buffers refilled every step (``static_decode_plan``): only its
    # Triton tables are valid, so the reference refuses it.
    static: bool = False


def static_decode_plan(
    positions: torch.Tensor,  # [B] int64
    new_token_slots: torch.Tensor,  # [B] int64
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32; 0 for a padding row
    max_context_len: int,  # a bound on every L_s (the context cap)
) -> AttentionPlan:
    """A decode-only plan over the caller's fixed device buffers (the CUDA-graph path).

    The buffers are refilled before every replay, so nothing here reads them: the Triton
    decode kernel takes the tables and lengths as they are, and ``max_context_len`` only
    sizes the launch. Rows with ``L_s = 0`` attend to nothing (zeros).
    """
    batch = context_lens.shape[0]
    rows = torch.arange(batch, dtype=torch.long, device=context_lens.device)
    none = block_tables[:0]
    return AttentionPlan(
        positions=positions,
        new_token_slots=new_token_slots,
        decode_rows=rows,
        decode_slots=rows[:0, None],
        decode_mask=rows[:0, None, None, None] > 0,
        prefill=[],
        triton=TritonAttentionPlan(
            decode_block_tables=block_tables,
            decode_context_lens=context_lens,
            decode_max_context_len=max_context_len,
            prefill_block_tables=none,
            prefill_context_lens=context_lens[:0],
            prefill_query_starts=context_lens[:0],
            prefill_query_ends=context_lens[:0],
            prefill_max_query_len=0,
        ),
        static=True,
    )


def flat_slots(
    tables: torch.Tensor,  # [S, max_blocks] block ids (padded)
    positions: torch.Tensor,  # [..., N] positions, broadcastable against rows of `tables`
    block_size: int,
) -> torch.Tensor:
    """``table[p // block_size] * block_size + p % block_size`` for each row's positions."""
    return tables.gather(-1, positions // block_size) * block_size + positions % block_size


def plan_attention(
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    device: torch.device,
    triton: bool | None = None,
) -> AttentionPlan:
    """Indices for one step. ``triton`` (default: CUDA device and references not forced)
    also builds :class:`TritonAttentionPlan`."""
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
    span = torch.arange(longest, **long)
    decode_slots = flat_slots(tables[decode], span.expand(len(decode), longest), block_size)
    decode_mask = span[None, :] < ctx[decode][:, None]

    prefill = []
    first_row = 0
    for i, (table_len, ctx_len, n) in enumerate(
        zip(map(len, block_tables), context_lens, query_lens, strict=True)
    ):
        first_row += n
        if n == 1:
            continue
        keys = torch.arange(ctx_len, **long)
        slots = flat_slots(tables[i, :table_len], keys, block_size)
        # Causal, bottom-right aligned: query j (position ctx - n + j) sees keys <= it.
        causal = keys[ctx_len - n :, None] >= keys[None, :]
        prefill.append((first_row - n, n, slots, causal))

    if triton is None:
        triton = use_triton_on(device)
    triton_plan = None
    if triton:
        triton_plan = _triton_plan(tables, ctx, n_new, ends, decode, longest, query_lens)
    return AttentionPlan(
        positions=positions,
        new_token_slots=new_token_slots,
        decode_rows=ends[decode] - 1,
        decode_slots=decode_slots,
        decode_mask=decode_mask[:, None, None, :],
        prefill=prefill,
        triton=triton_plan,
    )


def _triton_plan(
    tables: torch.Tensor,  # [S, max_blocks] int64
    ctx: torch.Tensor,  # [S] int64 L_s
    n_new: torch.Tensor,  # [S] int64 n_s
    ends: torch.Tensor,  # [S] int64 cumulative n_s: one past each sequence's last row
    decode: torch.Tensor,  # [B] int64 indices of the decode sequences
    decode_max_context_len: int,
    query_lens: list[int],
) -> TritonAttentionPlan:
    """Sub-batches for the kernels: a few small device ops, aliases when the step is uniform."""
    tables32, ctx32, ends32 = tables.int(), ctx.int(), ends.int()
    starts32 = ends32 - n_new.int()
    num_decodes = decode.shape[0]
    if num_decodes == len(query_lens):  # all decodes
        dec_tables, dec_ctx = tables32, ctx32
        pre_tables, pre_ctx, pre_starts, pre_ends = tables32[:0], ctx32[:0], ends32[:0], ends32[:0]
    elif num_decodes == 0:  # all prefills
        dec_tables, dec_ctx = tables32[:0], ctx32[:0]
        pre_tables, pre_ctx, pre_starts, pre_ends = tables32, ctx32, starts32, ends32
    else:
        prefill = torch.tensor(
            [i for i, n in enumerate(query_lens) if n != 1], dtype=torch.long, device=ctx.device
        )
        dec_tables, dec_ctx = tables32[decode], ctx32[decode]
        pre_tables, pre_ctx = tables32[prefill], ctx32[prefill]
        pre_starts, pre_ends = starts32[prefill], ends32[prefill]
    return TritonAttentionPlan(
        decode_block_tables=dec_tables,
        decode_context_lens=dec_ctx,
        decode_max_context_len=decode_max_context_len,
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
) -> torch.Tensor:
    """Torch reference: batched SDPA for decodes, masked SDPA per prefilling sequence."""
    if plan is not None and plan.static:
        raise ValueError(
            "a static decode plan (fixed buffers for CUDA graphs) runs on the Triton kernels "
            "only; build the step's plan with plan_attention for the reference"
        )
    if plan is None:
        plan = plan_attention(
            block_tables, context_lens, query_lens, k_cache.shape[1], query.device, triton=False
        )
    out = torch.empty_like(query)
    _reference_decodes(query, k_cache, v_cache, plan, scale, out)
    _reference_prefills(query, k_cache, v_cache, plan, scale, out)
    return out


def _reference_decodes(query, k_cache, v_cache, plan: AttentionPlan, scale, out) -> None:
    """Rows ``plan.decode_rows`` of ``out``: one batched SDPA over padded contexts."""
    if not plan.decode_rows.numel():
        return
    _, q_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    k_flat = k_cache.view(-1, kv_heads, head_dim)
    v_flat = v_cache.view(-1, kv_heads, head_dim)
    # The `group` query heads sharing a KV head act as `group` query positions of
    # that head: q [B, Hkv, group, D] against k, v [B, Hkv, L, D]; no causal mask.
    batch = plan.decode_rows.shape[0]
    q = query.index_select(0, plan.decode_rows).view(batch, kv_heads, group, head_dim)
    k = k_flat[plan.decode_slots].transpose(1, 2)  # [B, Hkv, L, D]
    v = v_flat[plan.decode_slots].transpose(1, 2)
    attn = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.decode_mask, scale=scale)
    out.index_copy_(0, plan.decode_rows, attn.reshape(batch, q_heads, head_dim))


def _reference_prefills(query, k_cache, v_cache, plan: AttentionPlan, scale, out) -> None:
    """Rows of each prefilling sequence of ``out``: a causally masked SDPA per sequence."""
    _, q_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    k_flat = k_cache.view(-1, kv_heads, head_dim)
    v_flat = v_cache.view(-1, kv_heads, head_dim)
    for first, n_new, slots, causal in plan.prefill:
        q = query[first : first + n_new].view(n_new, kv_heads, group, head_dim)
        q = q.permute(1, 2, 0, 3).reshape(kv_heads, group * n_new, head_dim)
        k = k_flat[slots].transpose(0, 1)  # [Hkv, L, D]
        v = v_flat[slots].transpose(0, 1)
        mask = causal.repeat(group, 1)  # query rows are group-major: [group * n_new, L]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        attn = attn.view(kv_heads, group, n_new, head_dim).permute(2, 0, 1, 3)
        out[first : first + n_new] = attn.reshape(n_new, q_heads, head_dim)


def paged_attention(
    query: torch.Tensor,  # [T, q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    scale: float,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """The public op: the module docstring's maths, by Triton on CUDA, else the reference.

    ``plan`` (built once per step by the runner) is rebuilt here when missing, or when it
    lacks the Triton sub-batches the chosen path needs.
    """
    triton_ok = use_triton(query) and query.dtype in _TRITON_DTYPES
    if not triton_ok or k_cache.dtype not in _TRITON_DTYPES:
        return paged_attention_reference(
            query, k_cache, v_cache, block_tables, context_lens, query_lens, scale, plan
        )
    # Imported here so CPU-only installs never import triton.
    from loramux.kernels import attention_triton

    if plan is None or plan.triton is None:
        plan = plan_attention(
            block_tables, context_lens, query_lens, k_cache.shape[1], query.device, triton=True
        )
    sub = plan.triton
    assert sub is not None
    if sub.num_prefills == 0:  # pure decode step (the hot path): rows are the batch, in order
        return attention_triton.paged_decode_attention(
            query,
            k_cache,
            v_cache,
            sub.decode_block_tables,
            sub.decode_context_lens,
            scale,
            max_context_len=sub.decode_max_context_len,
        )
    out = torch.empty_like(query)
    if sub.num_decodes:
        rows = plan.decode_rows
        decoded = attention_triton.paged_decode_attention(
            query.index_select(0, rows),
            k_cache,
            v_cache,
            sub.decode_block_tables,
            sub.decode_context_lens,
            scale,
            max_context_len=sub.decode_max_context_len,
        )
        out.index_copy_(0, rows, decoded)
    if TRITON_PREFILL:
        attention_triton.paged_prefill_attention(
            query,
            k_cache,
            v_cache,
            sub.prefill_block_tables,
            sub.prefill_context_lens,
            sub.prefill_query_starts,
            scale,
            sub.prefill_max_query_len,
            query_ends=sub.prefill_query_ends,
            out=out,
        )
    else:
        _reference_prefills(query, k_cache, v_cache, plan, scale, out)
    return out
