"""Attention over the paged KV cache.

Layout: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, kv_heads, head_dim]``;
a sequence's token at position p lives in block ``block_table[p // block_size]`` at
offset ``p % block_size``. A flat slot id is ``block * block_size + offset``.

Semantics (per sequence s with ``L_s`` tokens of context after this step, whose last
``n_s`` tokens are the new queries, query head h reading KV head ``h // (Hq / Hkv)``):

    out[i, h] = sum_{j <= p_i} softmax_j(q[i, h] . k[j, h'] * scale) v[j, h']

with ``p_i = L_s - n_s + i`` (causal, bottom-right aligned: new tokens see the whole
cached prefix). Decode is the case ``n_s = 1``. Accumulation in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
) -> AttentionPlan:
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
    seq_of_row = torch.repeat_interleave(torch.arange(num_seqs, **long), n_new)
    row = torch.arange(int(ends[-1]) if num_seqs else 0, **long)
    positions = (ctx - ends)[seq_of_row] + row
    new_token_slots = flat_slots(tables[seq_of_row], positions[:, None], block_size)[:, 0]

    is_decode = [n == 1 for n in query_lens]
    decode = torch.tensor([i for i, d in enumerate(is_decode) if d], **long)
    longest = max((c for c, d in zip(context_lens, is_decode, strict=True) if d), default=0)
    span = torch.arange(longest, **long)
    decode_slots = flat_slots(tables[decode], span.expand(len(decode), longest), block_size)
    decode_mask = span[None, :] < ctx[decode][:, None]

    prefill = []
    for i, (table_len, ctx_len, n) in enumerate(
        zip(map(len, block_tables), context_lens, query_lens, strict=True)
    ):
        if n == 1:
            continue
        keys = torch.arange(ctx_len, **long)
        slots = flat_slots(tables[i, :table_len], keys, block_size)
        # Causal, bottom-right aligned: query j (position ctx - n + j) sees keys <= it.
        causal = keys[ctx_len - n :, None] >= keys[None, :]
        prefill.append((int(ends[i]) - n, n, slots, causal))
    return AttentionPlan(
        positions=positions,
        new_token_slots=new_token_slots,
        decode_rows=ends[decode] - 1,
        decode_slots=decode_slots,
        decode_mask=decode_mask[:, None, None, :],
        prefill=prefill,
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
    if plan is None:
        plan = plan_attention(
            block_tables, context_lens, query_lens, k_cache.shape[1], query.device
        )
    _, q_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    k_flat = k_cache.view(-1, kv_heads, head_dim)
    v_flat = v_cache.view(-1, kv_heads, head_dim)
    out = torch.empty_like(query)
    if plan.decode_rows.numel():
        # The `group` query heads sharing a KV head act as `group` query positions of
        # that head: q [B, Hkv, group, D] against k, v [B, Hkv, L, D]; no causal mask.
        batch = plan.decode_rows.shape[0]
        q = query.index_select(0, plan.decode_rows).view(batch, kv_heads, group, head_dim)
        k = k_flat[plan.decode_slots].transpose(1, 2)  # [B, Hkv, L, D]
        v = v_flat[plan.decode_slots].transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.decode_mask, scale=scale)
        out.index_copy_(0, plan.decode_rows, attn.reshape(batch, q_heads, head_dim))
    for first, n_new, slots, causal in plan.prefill:
        q = query[first : first + n_new].view(n_new, kv_heads, group, head_dim)
        q = q.permute(1, 2, 0, 3).reshape(kv_heads, group * n_new, head_dim)
        k = k_flat[slots].transpose(0, 1)  # [Hkv, L, D]
        v = v_flat[slots].transpose(0, 1)
        mask = causal.repeat(group, 1)  # query rows are group-major: [group * n_new, L]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        attn = attn.view(kv_heads, group, n_new, head_dim).permute(2, 0, 1, 3)
        out[first : first + n_new] = attn.reshape(n_new, q_heads, head_dim)
    return out


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    scale: float,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """The public op. Only the reference exists so far; Triton joins behind this."""
    return paged_attention_reference(
        query, k_cache, v_cache, block_tables, context_lens, query_lens, scale, plan
    )
