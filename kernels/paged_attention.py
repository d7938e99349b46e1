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


def paged_attention_reference(
    query: torch.Tensor,  # [T, q_heads, head_dim], tokens of all sequences, in order
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: list[list[int]],  # per sequence
    context_lens: list[int],  # L_s: tokens of context including the new ones
    query_lens: list[int],  # n_s: new tokens (queries) per sequence
    scale: float,
) -> torch.Tensor:
    """Torch reference: gather each sequence's keys and values, masked SDPA per sequence."""
    _, q_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    block_size = k_cache.shape[1]
    out = torch.empty_like(query)
    start = 0
    for table, ctx_len, n_new in zip(block_tables, context_lens, query_lens, strict=True):
        q = query[start : start + n_new]  # [n, Hq, D]
        num_blocks = (ctx_len + block_size - 1) // block_size
        blocks = torch.tensor(table[:num_blocks], dtype=torch.long, device=query.device)
        k = k_cache.index_select(0, blocks).reshape(-1, kv_heads, head_dim)[:ctx_len]
        v = v_cache.index_select(0, blocks).reshape(-1, kv_heads, head_dim)[:ctx_len]
        if group > 1:  # grouped-query: each KV head serves `group` query heads
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        q_t, k_t, v_t = (t.transpose(0, 1) for t in (q, k, v))  # [H, n | L, D]
        mask, causal = None, False
        if n_new == ctx_len and n_new > 1:
            causal = True  # no cached prefix: plain causal attention
        elif n_new > 1:
            q_pos = torch.arange(ctx_len - n_new, ctx_len, device=query.device)
            mask = q_pos[:, None] >= torch.arange(ctx_len, device=query.device)[None, :]
        # (n_new == 1 needs no mask: a decode token sees its whole context.)
        attn = F.scaled_dot_product_attention(
            q_t, k_t, v_t, attn_mask=mask, is_causal=causal, scale=scale
        )
        out[start : start + n_new] = attn.transpose(0, 1)
        start += n_new
    return out


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """The public op. Only the reference exists so far; Triton joins behind this."""
    return paged_attention_reference(
        query, k_cache, v_cache, block_tables, context_lens, query_lens, scale
    )
