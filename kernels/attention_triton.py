"""Triton paged attention: split-context decode (flash-decoding) and prefill over a cache.

Same semantics as :mod:`loramux.kernels.paged_attention` (its reference is the
definition): cache ``[num_blocks, block_size, kv_heads, head_dim]``, the key at position
``p`` of sequence s in block ``table[s, p // block_size]`` at offset ``p % block_size``;
query head h reads KV head ``h // G`` with ``G = Hq / Hkv``; query i of a sequence with
``L`` tokens of context and ``n`` new tokens sits at ``p_i = L - n + i`` and sees keys
``0..p_i``:

    out[i, h] = sum_{j <= p_i} softmax_j(s_ij) v_j,    s_ij = scale * q[i, h] . k[j, h // G]

Both kernels run the online softmax over key tiles, in float32 and in base 2 (``exp2`` is
the native instruction; ``e^x = 2^(x log2 e)``). With ``t_ij = s_ij log2 e`` and, after the
tiles seen so far, running max ``m``, sum ``l = sum_j 2^(t_j - m)`` and accumulator
``a = sum_j 2^(t_j - m) v_j``, a new tile ``T`` updates them as

    m' = max(m, max_{j in T} t_j),   c = 2^(m - m')
    l' = c l + sum_{j in T} 2^(t_j - m'),   a' = c a + sum_{j in T} 2^(t_j - m') v_j

and ``out = a / l``. (``m`` starts at ``-inf``, so ``c = 0`` on the first tile.)

Decode (one query per sequence) splits each context into ``num_splits`` spans, one
program per (sequence, KV head, split), so that a few long sequences still fill the GPU.
Each sequence's spans are its own: ``split_len_s = round_up(ceil(L_s / num_splits),
BLOCK_N)``, computed in the kernel from ``L_s``, so the launch depends only on the batch
size and ``num_splits`` (never on the contexts): a CUDA graph captured once serves every
step of that batch size. Program k leaves partial ``(m_k, l_k, a_k)`` in float32
scratch; a second kernel combines them exactly:

    M = max_k m_k,   w_k = 2^(m_k - M),   out = sum_k w_k a_k / sum_k w_k l_k

An empty split (its span starts past the context) writes ``m = -inf, l = 0, a = 0``, so
``w_k = 0``. An empty context (``L = 0``, a padded batch row) yields zeros.

Grouped-query attention: all G query heads of one KV head are rows of one program's query
tile, so each K/V tile is loaded once per group and fed to ``tl.dot``.

Keys are gathered per token through the block table, so any block size works (a
constexpr; powers of two make the ``//`` and ``%`` shifts). Head dims up to 256 are padded
to the next power of two (at least 16, ``tl.dot``'s minimum) with masked loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loramux.kernels.kv_quant import QuantizedKV
from loramux.kernels.paged_attention import KVCache, TritonAttentionPlan

# Decode: each split covers at least this many tokens, so short contexts run unsplit
# (no scratch, no second kernel) and a split amortizes its partial write-out.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32
# Enough (sequence, KV head, split) programs for about two waves on a ~132-SM GPU; more
# splits than that only add reduction work.
TARGET_PROGRAMS = 256
# Tile sizes (not tuned on hardware yet). Rows of a prefill tile are (token, group head)
# pairs, so a tile holds PREFILL_BLOCK_M // next_pow2(G) tokens.
PREFILL_BLOCK_M = 64
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _dot(a, b, INTERPRET: tl.constexpr, IEEE: tl.constexpr):
    """``a @ b`` accumulated in float32.

    INTERPRET: the interpreter keeps bfloat16 as raw uint16 and would multiply the bit
    patterns, so it gets float32 operands (exact for 16-bit inputs, and numpy's float32
    matmul stands in for the fp32-accumulating tensor-core product). IEEE: float32
    operands use full-precision fp32 instead of TF32 on tensor cores.
    """
    if INTERPRET:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 ``x`` rounded to ``dtype``, to nearest even as the GPU's native cast does.

    The interpreter's float32 -> bfloat16 cast truncates, so there it is done on the bits:
    adding ``0x7FFF + lsb`` to the float32 pattern carries into bit 16 exactly when the
    dropped low half is above one half ulp, or equal to it with an odd kept part.
    """
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _dequantize(x, QUANT: tl.constexpr):
    """A quantized cache's 8-bit values in float32 (``kv_quant``): int8 (QUANT 1) as they
    are; fp8 e4m3 (QUANT 2, loaded as its bytes) decoded from the bits, exactly and alike
    in the interpreter: ``1.mmm x 2^(eeee - 7)``, subnormals ``0.mmm x 2^-6``, and the NaN
    byte (a stale slot's) as 0, as the torch gather reads it."""
    if QUANT == 1:
        return x.to(tl.float32)
    else:
        bits = x.to(tl.int32) & 0xFF
        exponent = (bits >> 3) & 0xF
        mantissa = bits & 0x7
        normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
        value = tl.where((bits & 0x7F) == 0x7F, 0.0, value)
        return tl.where((bits & 0x80) != 0, -value, value)


@triton.jit
def _attend_tiles(
    acc,  # [M, D_PAD] fp32 running a
    m_i,  # [M] fp32 running max (log2 domain)
    l_i,  # [M] fp32 running sum
    q,  # [M, D_PAD] in the cache dtype
    q_pos,  # [M] int32 position of each query row (used when CAUSAL)
    table_ptr,  # this sequence's row of the block table
    k_base,  # k_cache pointer offset to this KV head
    v_base,
    ks_base,  # a quantized cache's scales, offset to this KV head (QUANT only)
    vs_base,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    stride_ksb,
    stride_kss,
    stride_vsb,
    stride_vss,
    lo,  # first key position
    hi,  # one past the last key position
    qk_scale,  # scale * log2(e)
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    INTERPRET: tl.constexpr,
    IEEE: tl.constexpr,
    QUANT: tl.constexpr,
    WINDOW: tl.constexpr,  # a sliding window of keys per query row (CAUSAL; 0: every key)
):
    """Online-softmax update of (acc, m, l) over keys ``lo <= p < hi`` (module docstring).

    Under a sliding window a row may see no key of a tile (its window starts past it): its
    running max stays -inf there, and the exponentials are taken from 0 instead, so they
    come out 0 rather than ``2^(-inf + inf)``.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n  # [N] key positions
        valid = pos < hi
        # Gather through the block table: key p is in block table[p // bs] at p % bs.
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offset = (pos % BLOCK_SIZE).to(tl.int64)
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_base + block[:, None] * stride_kb + offset[:, None] * stride_ks + offs_d[None, :],
            mask=kv_mask,
            other=0,
        )  # [N, D_PAD]
        if QUANT != 0:
            k_scale = tl.load(
                ks_base + block * stride_ksb + offset * stride_kss, mask=valid, other=0.0
            )
            k = _cast(_dequantize(k, QUANT) * k_scale[:, None], q.dtype, INTERPRET)
        s = _dot(q, tl.trans(k), INTERPRET, IEEE) * qk_scale  # [M, N] t_ij (log2 domain)
        if CAUSAL:
            seen = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                seen = seen & (pos[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(seen, s, float("-inf"))
        else:
            s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet
        correction = tl.exp2(m_i - m_safe)  # c = 2^(m - m')
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * correction + tl.sum(p, 1)
        v = tl.load(
            v_base + block[:, None] * stride_vb + offset[:, None] * stride_vs + offs_d[None, :],
            mask=kv_mask,
            other=0,
        )  # [N, D_PAD]
        if QUANT != 0:
            v_scale = tl.load(
                vs_base + block * stride_vsb + offset * stride_vss, mask=valid, other=0.0
            )
            v = _cast(_dequantize(v, QUANT) * v_scale[:, None], q.dtype, INTERPRET)
        # P is rounded to the cache dtype for the tensor-core product (as flash attention
        # does); the sum l above used the unrounded fp32 P.
        acc = acc * correction[:, None] + _dot(_cast(p, v.dtype, INTERPRET), v, INTERPRET, IEEE)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,
    ks_ptr,  # [num_blocks, block_size, Hkv] fp32 scales of a quantized cache (QUANT)
    vs_ptr,
    tables_ptr,  # [B, max_blocks] int32
    ctx_ptr,  # [B] int32
    out_ptr,  # [B, Hq, D], written when NUM_SPLITS == 1
    part_m_ptr,  # [B, Hq, NUM_SPLITS] fp32 scratch, when NUM_SPLITS > 1
    part_l_ptr,  # [B, Hq, NUM_SPLITS]
    part_acc_ptr,  # [B, Hq, NUM_SPLITS, D_PAD]
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ksb,
    stride_kss,
    stride_ksh,
    stride_vsb,
    stride_vss,
    stride_vsh,
    stride_tb,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    INTERPRET: tl.constexpr,
    IEEE: tl.constexpr,
    QUANT: tl.constexpr,  # 0: the cache in the query's dtype; 1: int8; 2: fp8 (its bytes)
    WINDOW: tl.constexpr,  # a sliding window: the query sees the last WINDOW keys (0: all)
):
    """One (sequence, KV head, split): the G query heads against keys of one span."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP
    ctx_len = tl.load(ctx_ptr + seq)
    start = 0
    if WINDOW > 0:  # only the last WINDOW keys
        start = tl.maximum(ctx_len - WINDOW, 0)
    # This sequence's span per split: ceil((L - start) / NUM_SPLITS) rounded up to whole
    # key tiles.
    split_len = tl.cdiv(tl.cdiv(ctx_len - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * split_len
    hi = tl.minimum(lo + split_len, ctx_len)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    head = kv_head * GROUP + offs_g  # [G_PAD] query heads of this group
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [G_PAD, D_PAD]
    if QUANT == 0:
        q = q.to(k_ptr.dtype.element_ty)

    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    q_pos = tl.zeros([G_PAD], dtype=tl.int32) + ctx_len - 1  # unused: not causal
    acc, m_i, l_i = _attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        q_pos,
        tables_ptr + seq.to(tl.int64) * stride_tb,
        k_ptr + kv_head * stride_kh,
        v_ptr + kv_head * stride_vh,
        ks_ptr + kv_head * stride_ksh,
        vs_ptr + kv_head * stride_vsh,
        stride_kb,
        stride_ks,
        stride_vb,
        stride_vs,
        stride_ksb,
        stride_kss,
        stride_vsb,
        stride_vss,
        lo,
        hi,
        qk_scale,
        HEAD_DIM,
        D_PAD,
        BLOCK_SIZE,
        BLOCK_N,
        False,
        INTERPRET,
        IEEE,
        QUANT,
        0,  # every key of the span lies within the window
    )

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l = 0 only for an empty context
        tl.store(
            out_ptr + seq * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
            _cast(out, out_ptr.dtype.element_ty, INTERPRET),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        part = (seq * num_q_heads + head) * NUM_SPLITS + split  # [G_PAD] flat partial index
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _decode_reduce_kernel(
    part_m_ptr,  # [B, Hq, NUM_SPLITS] fp32
    part_l_ptr,
    part_acc_ptr,  # [B, Hq, NUM_SPLITS, D_PAD]
    out_ptr,  # [B, Hq, D]
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One (sequence, query head): out = sum_k w_k a_k / sum_k w_k l_k, w_k = 2^(m_k - M)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < NUM_SPLITS
    part = (seq * tl.num_programs(1) + head) * NUM_SPLITS + offs_s  # [S_PAD]
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    l_k = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0
    )  # [S_PAD, D_PAD]
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: all w_k = 0
    w = tl.exp2(m - m_max)  # [S_PAD]; 0 for empty splits
    denom = tl.sum(w * l_k, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + offs_d,
        _cast(out, out_ptr.dtype.element_ty, INTERPRET),
        mask=offs_d < HEAD_DIM,
    )


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,
    v_ptr,
    ks_ptr,  # [num_blocks, block_size, Hkv] fp32 scales of a quantized cache (QUANT)
    vs_ptr,
    tables_ptr,  # [S, max_blocks] int32
    ctx_ptr,  # [S] int32
    starts_ptr,  # [S] int32 first query row of each sequence
    ends_ptr,  # [S] int32 one past its last row
    out_ptr,  # [T, Hq, D]
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ksb,
    stride_kss,
    stride_ksh,
    stride_vsb,
    stride_vss,
    stride_vsh,
    stride_tb,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows: BLOCK_M // G_PAD tokens x G_PAD heads
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
    IEEE: tl.constexpr,
    QUANT: tl.constexpr,  # 0: the cache in the query's dtype; 1: int8; 2: fp8 (its bytes)
    WINDOW: tl.constexpr,  # a sliding window of keys per query (0: all)
):
    """One (token tile, sequence, KV head): causal attention of the tile's queries."""
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    row0 = tl.load(starts_ptr + seq)
    n_new = tl.load(ends_ptr + seq) - row0
    first = tile * BLOCK_Q  # first new token of this tile
    if first >= n_new:
        return  # the grid covers the longest sequence; shorter ones have fewer tiles
    ctx_len = tl.load(ctx_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    token = first + offs_m // G_PAD  # [M] new-token index of each row
    g = offs_m % G_PAD
    head = kv_head * GROUP + g
    row_mask = (token < n_new) & (g < GROUP)
    d_mask = offs_d < HEAD_DIM
    io_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + (row0 + token)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )  # [M, D_PAD]
    if QUANT == 0:
        q = q.to(k_ptr.dtype.element_ty)
    q_pos = ctx_len - n_new + token  # bottom-right aligned causal position of each row
    # The tile's last token sees keys up to its own position; padding rows (past n_new)
    # sit past it and are never stored.
    hi = ctx_len - n_new + tl.minimum(n_new, first + BLOCK_Q)
    lo = 0  # the tile's first token sees keys from its window's start on
    if WINDOW > 0:
        lo = tl.maximum(ctx_len - n_new + first - WINDOW + 1, 0)

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        q_pos,
        tables_ptr + seq.to(tl.int64) * stride_tb,
        k_ptr + kv_head * stride_kh,
        v_ptr + kv_head * stride_vh,
        ks_ptr + kv_head * stride_ksh,
        vs_ptr + kv_head * stride_vsh,
        stride_kb,
        stride_ks,
        stride_vb,
        stride_vs,
        stride_ksb,
        stride_kss,
        stride_vsb,
        stride_vss,
        lo,
        hi,
        qk_scale,
        HEAD_DIM,
        D_PAD,
        BLOCK_SIZE,
        BLOCK_N,
        True,
        INTERPRET,
        IEEE,
        QUANT,
        WINDOW,
    )
    out = acc / l_i[:, None]  # l >= 1: every row sees its own key
    tl.store(
        out_ptr + (row0 + token)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        _cast(out, out_ptr.dtype.element_ty, INTERPRET),
        mask=io_mask,
    )


def _interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_prefill_kernel, triton.runtime.JITFunction)


@dataclass(frozen=True)
class _CacheOperands:
    """What the kernels take for the keys and values: the data as they load it, and for a
    quantized cache its scales (the data stands in for them otherwise, never read)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor
    v_scales: torch.Tensor
    quant: int  # the kernels' QUANT: 0 none, 1 int8, 2 fp8 (loaded as bytes)

    def strides(self) -> tuple[int, ...]:
        """(k block, slot, head; v ...; k scales block, slot, head; v scales ...)."""
        return (
            *self.k.stride()[:3],
            *self.v.stride()[:3],
            *self.k_scales.stride()[:3],
            *self.v_scales.stride()[:3],
        )


def _cache_operands(query: torch.Tensor, k_cache: KVCache, v_cache: KVCache) -> _CacheOperands:
    """Checks the caches against the query and returns the kernels' operands."""
    q_heads, head_dim = query.shape[1:]
    if k_cache.shape != v_cache.shape or type(k_cache) is not type(v_cache):
        raise ValueError("k_cache and v_cache must have the same shape and form")
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} vs cache {k_cache.shape[3]} (max {MAX_HEAD_DIM})")
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    if isinstance(k_cache, QuantizedKV):
        if k_cache.data.dtype != v_cache.data.dtype:
            raise ValueError("k_cache and v_cache must be quantized alike")
        if query.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"unsupported query dtype {query.dtype}")
        if k_cache.data.dtype == torch.int8:
            k, v, quant = k_cache.data, v_cache.data, 1
        else:
            k, v, quant = k_cache.data.view(torch.uint8), v_cache.data.view(torch.uint8), 2
        operands = _CacheOperands(k, v, k_cache.scales, v_cache.scales, quant)
    else:
        if k_cache.dtype != v_cache.dtype or k_cache.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"unsupported cache dtypes {k_cache.dtype}, {v_cache.dtype}")
        operands = _CacheOperands(k_cache, v_cache, k_cache, v_cache, 0)
    # Pointers step over (token, head) by stride; the head dim must be contiguous.
    for t in (query, operands.k, operands.v):
        if t.stride(-1) != 1:
            raise ValueError("the head dim must be contiguous")
    return operands


def _tiles(head_dim: int, group: int) -> tuple[int, int, int]:
    """(D_PAD, G_PAD, BLOCK_N): padded head dim and group, key tile (smaller for big D)."""
    d_pad = max(16, triton.next_power_of_2(head_dim))
    g_pad = triton.next_power_of_2(group)
    return d_pad, g_pad, (64 if d_pad <= 128 else 32)


def choose_num_splits(max_context_len: int, batch: int, kv_heads: int) -> int:
    """Splits per context: at least MIN_SPLIT_TOKENS each, no more than fill the GPU."""
    by_length = math.ceil(max_context_len / MIN_SPLIT_TOKENS)
    by_occupancy = math.ceil(TARGET_PROGRAMS / max(1, batch * kv_heads))
    return max(1, min(MAX_SPLITS, by_length, by_occupancy))


def paged_decode_attention(
    query: torch.Tensor,  # [B, Hq, D] one new token per sequence
    k_cache: KVCache,  # [num_blocks, block_size, Hkv, D]
    v_cache: KVCache,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, L_s (including the new token)
    scale: float,
    num_splits: int | None = None,
    *,
    max_context_len: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Decode attention, ``out[s, h] = sum_{j < L_s} softmax_j(scale q[s,h].k_j) v_j``.

    ``num_splits`` (default: :func:`choose_num_splits`) splits every context into spans of
    ``round_up(ceil(L_s / num_splits), BLOCK_N)`` tokens, combined by a second kernel
    (module docstring). ``max_context_len`` (the largest ``L_s``, or any bound on it: a
    CUDA graph passes the context cap) only chooses the default ``num_splits``, without
    reading ``context_lens`` back from the device. ``window``: only the last ``window``
    keys (a sliding window), split alike. Returns ``[B, Hq, D]`` in the query's dtype;
    float32 accumulation.
    """
    ops = _cache_operands(query, k_cache, v_cache)
    batch, q_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    out = torch.empty_like(query)
    if batch == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    d_pad, g_pad, block_n = _tiles(head_dim, group)
    g_pad = max(16, g_pad)  # tl.dot needs at least 16 rows
    if num_splits is None:
        num_splits = choose_num_splits(max_context_len, batch, kv_heads)
    if num_splits > 1:
        part_m = torch.empty(batch, q_heads, num_splits, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = part_m.new_empty(batch, q_heads, num_splits, d_pad)
    else:
        part_m = part_l = part_acc = out  # unused
    interpret = _interpreting()
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        query,
        ops.k,
        ops.v,
        ops.k_scales,
        ops.v_scales,
        block_tables,
        context_lens,
        out,
        part_m,
        part_l,
        part_acc,
        scale * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        *ops.strides(),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        G_PAD=g_pad,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        INTERPRET=interpret,
        IEEE=query.dtype == torch.float32,
        QUANT=ops.quant,
        WINDOW=window or 0,
        num_warps=4,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, q_heads)](
            part_m,
            part_l,
            part_acc,
            out,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            NUM_SPLITS=num_splits,
            S_PAD=triton.next_power_of_2(num_splits),
            INTERPRET=interpret,
            num_warps=4,
        )
    return out


def paged_prefill_attention(
    query: torch.Tensor,  # [T, Hq, D] new tokens of all sequences
    k_cache: KVCache,  # [num_blocks, block_size, Hkv, D], new tokens already written
    v_cache: KVCache,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    context_lens: torch.Tensor,  # [S] int32, L_s (cached prefix + new tokens)
    query_starts: torch.Tensor,  # [S + 1] int32 cumulative rows, or [S] with query_ends
    scale: float,
    max_query_len: int,
    *,
    query_ends: torch.Tensor | None = None,  # [S] int32
    out: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context.

    Sequence s owns query rows ``query_starts[s] .. query_starts[s+1] - 1`` (or
    ``.. query_ends[s] - 1`` when ``query_ends`` is given, which lets a caller pick some
    sequences of a larger batch); with ``n_s`` rows, row i sits at position
    ``p_i = L_s - n_s + i`` and attends to keys ``0..p_i`` (``p_i - window + 1 .. p_i``
    under a sliding ``window``). ``max_query_len >= max n_s``
    sizes the grid. Writes into ``out`` (default: a new tensor like ``query``); rows of no
    listed sequence are left untouched. Float32 accumulation. Works for ``n_s = 1`` too,
    without the decode kernel's context splitting.
    """
    ops = _cache_operands(query, k_cache, v_cache)
    q_heads, head_dim = query.shape[1:]
    _, block_size, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    if out is None:
        out = torch.empty_like(query)
    if query_ends is None:
        query_starts, query_ends = query_starts[:-1], query_starts[1:]
    num_seqs = block_tables.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return out
    d_pad, g_pad, block_n = _tiles(head_dim, group)
    block_m = max(PREFILL_BLOCK_M, g_pad)
    interpret = _interpreting()
    grid = (triton.cdiv(max_query_len, block_m // g_pad), num_seqs, kv_heads)
    _prefill_kernel[grid](
        query,
        ops.k,
        ops.v,
        ops.k_scales,
        ops.v_scales,
        block_tables,
        context_lens,
        query_starts,
        query_ends,
        out,
        scale * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        *ops.strides(),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        G_PAD=g_pad,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        INTERPRET=interpret,
        IEEE=query.dtype == torch.float32,
        QUANT=ops.quant,
        WINDOW=window or 0,
        num_warps=4 if d_pad <= 64 else 8,
    )
    return out


def paged_attention_triton(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: KVCache,  # [num_blocks, block_size, Hkv, D], new tokens already written
    v_cache: KVCache,
    plan: TritonAttentionPlan,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """A whole step: its decode rows by the split-context decode kernel, its prefilling
    sequences by the prefill kernel, each over its own sub-batch of ``plan``; together
    they cover every row exactly once."""
    out = None
    if plan.num_decodes:
        pure = plan.num_prefills == 0  # the hot path: the decode rows are the batch, in order
        decoded = paged_decode_attention(
            query if pure else query.index_select(0, plan.decode_rows),
            k_cache,
            v_cache,
            plan.decode_block_tables,
            plan.decode_context_lens,
            scale,
            max_context_len=plan.decode_max_context_len,
            window=window,
        )
        if pure:
            return decoded
        out = torch.empty_like(query)
        out.index_copy_(0, plan.decode_rows, decoded)
    return paged_prefill_attention(
        query,
        k_cache,
        v_cache,
        plan.prefill_block_tables,
        plan.prefill_context_lens,
        plan.prefill_query_starts,
        scale,
        plan.prefill_max_query_len,
        query_ends=plan.prefill_query_ends,
        out=out,  # None: a new tensor
        window=window,
    )
