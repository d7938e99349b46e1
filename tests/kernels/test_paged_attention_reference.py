"""write_kv + paged_attention_reference against dense causal attention done by hand.

The reference is computed in float64 from each sequence's logical K/V (before they
are scattered into the paged cache): scores, causal mask, softmax by hand, KV heads
repeated for grouped-query attention. The paged side uses shuffled, non-consecutive
physical blocks, partially filled last blocks, and a batch mixing a decode, a full
prefill and a chunked prefill over a cached prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from loramux.kernels.paged_attention import (
    attend_reference,
    paged_attention_reference,
    plan_attention,
    write_kv,
)
from tests.kernels.helpers import DTYPES, assert_close

# (q_heads, kv_heads): GQA ratios 1, 3 and 8.
HEADS = [
    pytest.param(3, 3, id="mha"),
    pytest.param(6, 2, id="gqa3"),
    pytest.param(8, 1, id="gqa8"),
]

# (block_size, head_dim): odd sizes on purpose.
SHAPES = [
    pytest.param(3, 7, id="block3-dim7"),
    pytest.param(5, 33, id="block5-dim33"),
    pytest.param(16, 64, id="block16-dim64"),
]

# (context_len, query_len) per sequence: a decode, a full prefill, a chunked prefill
# over a cached prefix, a one-token prompt, and a decode landing on a block's first slot.
BATCH = [(11, 1), (7, 7), (13, 4), (1, 1), (16, 1)]


@dataclass
class Sequence:
    keys: torch.Tensor  # [L, kv_heads, D] logical order
    values: torch.Tensor  # [L, kv_heads, D]
    queries: torch.Tensor  # [n, q_heads, D] for positions L-n .. L-1
    table: list[int]  # physical blocks, logical order


def _tables(batch, block_size: int, num_blocks: int, gen) -> list[list[int]]:
    """Shuffled physical blocks with gaps: every other block is left unused."""
    usable = torch.randperm(num_blocks, generator=gen).tolist()[: num_blocks // 2]
    tables, cursor = [], 0
    for ctx_len, _ in batch:
        need = math.ceil(ctx_len / block_size)
        tables.append(usable[cursor : cursor + need])
        cursor += need
    assert cursor <= len(usable)
    return tables


def _build(batch, q_heads, kv_heads, head_dim, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total_blocks = sum(math.ceil(c / block_size) for c, _ in batch)
    num_blocks = 2 * total_blocks + 3
    tables = _tables(batch, block_size, num_blocks, gen)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    # Unused blocks and the tails of partially filled blocks hold large stale values:
    # reading any of them would swamp the softmax and break the comparison.
    k_cache = (torch.randn(shape, generator=gen) * 50).to(dtype)
    v_cache = (torch.randn(shape, generator=gen) * 50).to(dtype)
    seqs = []
    for (ctx_len, n_new), table in zip(batch, tables, strict=True):
        seqs.append(
            Sequence(
                keys=torch.randn(ctx_len, kv_heads, head_dim, generator=gen).to(dtype),
                values=torch.randn(ctx_len, kv_heads, head_dim, generator=gen).to(dtype),
                queries=torch.randn(n_new, q_heads, head_dim, generator=gen).to(dtype),
                table=table,
            )
        )
    return seqs, k_cache, v_cache


def _slots(table: list[int], positions, block_size: int) -> torch.Tensor:
    return torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions])


def _write_all(seqs, k_cache, v_cache, block_size):
    """Cached prefixes first (an earlier step), then this step's tokens in one call."""
    for seq in seqs:
        n_prefix = seq.keys.shape[0] - seq.queries.shape[0]
        if n_prefix:
            slots = _slots(seq.table, range(n_prefix), block_size)
            write_kv(seq.keys[:n_prefix], seq.values[:n_prefix], k_cache, v_cache, slots)
    new_k, new_v, new_slots = [], [], []
    for seq in seqs:
        ctx_len, n_new = seq.keys.shape[0], seq.queries.shape[0]
        new_k.append(seq.keys[ctx_len - n_new :])
        new_v.append(seq.values[ctx_len - n_new :])
        new_slots.append(_slots(seq.table, range(ctx_len - n_new, ctx_len), block_size))
    write_kv(torch.cat(new_k), torch.cat(new_v), k_cache, v_cache, torch.cat(new_slots))


def _dense_causal(seq: Sequence, scale: float, window: int | None = None) -> torch.Tensor:
    """[n, q_heads, D] in float64: softmax over j <= p_i (and j > p_i - window under a
    sliding window) of q_i . k_j * scale, times v_j."""
    q = seq.queries.double()
    k, v = seq.keys.double(), seq.values.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]: query head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)
    ctx_len, n_new = k.shape[0], q.shape[0]
    scores = torch.einsum("ihd,jhd->hij", q, k) * scale  # [Hq, n, L]
    q_pos = torch.arange(ctx_len - n_new, ctx_len)[:, None]
    visible = torch.arange(ctx_len)[None, :] <= q_pos  # [n, L]
    if window is not None:
        visible &= torch.arange(ctx_len)[None, :] > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return torch.einsum("hij,jhd->ihd", weights, v)


@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
@pytest.mark.parametrize(("block_size", "head_dim"), SHAPES)
@pytest.mark.parametrize(("q_heads", "kv_heads"), HEADS)
def test_mixed_batch_matches_dense_causal_attention(
    q_heads, kv_heads, block_size, head_dim, dtype, rtol
):
    seqs, k_cache, v_cache = _build(BATCH, q_heads, kv_heads, head_dim, block_size, dtype)
    _write_all(seqs, k_cache, v_cache, block_size)
    scale = head_dim**-0.5
    query = torch.cat([s.queries for s in seqs])

    out = paged_attention_reference(
        query,
        k_cache,
        v_cache,
        [s.table for s in seqs],
        [c for c, _ in BATCH],
        [n for _, n in BATCH],
        scale,
    )

    assert out.shape == query.shape
    assert out.dtype == dtype
    expected = torch.cat([_dense_causal(s, scale) for s in seqs])
    assert_close(out, expected, rtol)
    # The engine's op over a plan built once is the same maths.
    plan = plan_attention(
        [s.table for s in seqs],
        [c for c, _ in BATCH],
        [n for _, n in BATCH],
        k_cache.shape[1],
        "cpu",
    )
    assert_close(attend_reference(query, k_cache, v_cache, plan, scale), expected, rtol)


@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
@pytest.mark.parametrize(
    ("ctx_len", "n_new"),
    [
        pytest.param(1, 1, id="single-token"),
        pytest.param(10, 1, id="decode"),
        pytest.param(10, 10, id="prefill"),
        pytest.param(10, 2, id="chunk-of-2"),
        pytest.param(10, 9, id="chunk-after-1"),
        pytest.param(15, 5, id="chunk-fills-last-block"),
    ],
)
def test_single_sequence_shapes(ctx_len, n_new, dtype, rtol):
    batch = [(ctx_len, n_new)]
    seqs, k_cache, v_cache = _build(batch, 6, 2, 7, 5, dtype, seed=3)
    _write_all(seqs, k_cache, v_cache, 5)
    scale = 0.3  # not 1/sqrt(D): the op must use the scale it is given
    out = paged_attention_reference(
        seqs[0].queries, k_cache, v_cache, [seqs[0].table], [ctx_len], [n_new], scale
    )
    assert_close(out, _dense_causal(seqs[0], scale), rtol)


def test_block_table_may_be_longer_than_the_context():
    """Blocks reserved ahead (for tokens not yet computed) are not read."""
    batch = [(7, 3)]
    seqs, k_cache, v_cache = _build(batch, 4, 2, 8, 3, torch.float32, seed=4)
    _write_all(seqs, k_cache, v_cache, 3)
    used = set(seqs[0].table)
    spare = [b for b in range(k_cache.shape[0]) if b not in used][:2]
    out = paged_attention_reference(
        seqs[0].queries, k_cache, v_cache, [seqs[0].table + spare], [7], [3], 0.25
    )
    assert_close(out, _dense_causal(seqs[0], 0.25), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_write_kv_scatters_to_slots_and_nothing_else(dtype):
    gen = torch.Generator().manual_seed(7)
    num_blocks, block_size, kv_heads, head_dim = 6, 5, 3, 7
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([17, 3, 29, 0, 12])  # arbitrary, out of order, across blocks
    key = torch.randn(len(slots), kv_heads, head_dim, generator=gen, dtype=torch.float64)
    value = torch.randn(len(slots), kv_heads, head_dim, generator=gen, dtype=torch.float64)

    write_kv(key, value, k_cache, v_cache, slots)

    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.equal(k_cache[block, offset], key[i].to(dtype))
        assert torch.equal(v_cache[block, offset], value[i].to(dtype))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    untouched = untouched.view(num_blocks, block_size)
    assert torch.equal(k_cache[untouched], k_before[untouched])
    assert torch.equal(v_cache[untouched], v_before[untouched])


@pytest.mark.parametrize("window", [1, 3, 8, 1000])
def test_a_sliding_window_sees_the_last_keys_only(window):
    """Queries at position p see keys p - window < j <= p: decodes, prefill chunks over a
    cached prefix and whole prompts alike; a window past every context sees them all."""
    seqs, k_cache, v_cache = _build(BATCH, 6, 2, 24, 5, torch.float32)
    _write_all(seqs, k_cache, v_cache, 5)
    query = torch.cat([s.queries for s in seqs])
    plan = plan_attention(
        [s.table for s in seqs], [c for c, _ in BATCH], [n for _, n in BATCH], 5, "cpu"
    )
    out = attend_reference(query, k_cache, v_cache, plan, 0.2, window=window)
    expected = torch.cat([_dense_causal(s, 0.2, window) for s in seqs])
    assert_close(out, expected, 1e-5)
    unwindowed = attend_reference(query, k_cache, v_cache, plan, 0.2)
    if window == 1000:
        torch.testing.assert_close(out, unwindowed, rtol=1e-5, atol=1e-6)
    else:
        assert not torch.allclose(out, unwindowed)
