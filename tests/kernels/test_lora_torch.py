"""The torch LoRA ops (``loramux.kernels.lora_torch``) against the multi-slice reference.

The step mixes long segments (a matmul per slice each) and short ones (stacked ``bmm``),
adapters of different ranks per slice (0: slice not targeted), an adapter with two
short segments, tokens with no adapter, and pools whose rows outside the adapters hold
NaN: neither form may read them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loramux.kernels.lora_torch import (
    StackedTokens,
    lora_segments,
    lora_stacked,
    stack_weights,
)
from tests.kernels.helpers import (
    DTYPES,
    FIRST_ROWS,
    POOL_ROWS,
    RANKS,
    SCALES,
    SPANS,
    TOKENS,
    assert_close,
    multi_slice_expected,
)

IN_FEATURES = 23
OUT_WIDTHS = (17, 6, 6)
SHORT = 3  # segments longer than this are "long" here


def _pools(dtype):
    """Pools whose rows outside every adapter (and past each slice's rank) are NaN or zero
    as the pool guarantees: zero past a slice's rank inside the adapter, NaN elsewhere."""
    gen = torch.Generator().manual_seed(0)
    a_pools, b_pools = [], []
    for s, width in enumerate(OUT_WIDTHS):
        a = torch.full((POOL_ROWS, IN_FEATURES), float("nan"))
        b = torch.full((POOL_ROWS, width), float("nan"))
        for first, rows in zip(FIRST_ROWS, zip(*RANKS, strict=True), strict=True):
            owned = max(rows)
            a[first : first + owned] = 0
            b[first : first + owned] = 0
            r = rows[s]
            a[first : first + r] = torch.randn(r, IN_FEATURES, generator=gen) * 0.3
            b[first : first + r] = torch.randn(r, width, generator=gen) * 0.3
        a_pools.append(a.to(dtype))
        b_pools.append(b.to(dtype))
    x = torch.randn(TOKENS, IN_FEATURES, generator=gen).to(dtype)
    outs = [torch.randn(TOKENS, w, generator=gen).to(dtype) for w in OUT_WIDTHS]
    return x, a_pools, b_pools, outs


def _expected(x, a_pools, b_pools, outs) -> torch.Tensor:
    return multi_slice_expected(x, a_pools, b_pools, outs, SPANS, FIRST_ROWS, RANKS, SCALES)


def _stack(a_pools, b_pools, members):
    """The stacks of the adapters ``members``, in that order."""
    return stack_weights(
        a_pools,
        b_pools,
        [FIRST_ROWS[a] for a in members],
        [[RANKS[s][a] for a in members] for s in range(3)],
        [[SCALES[s][a] for a in members] for s in range(3)],
    )


def _run(x, a_pools, b_pools, outs):
    """Every adapter stacked; long segments by lora_segments, short ones by lora_stacked
    (as the torch backend splits them)."""
    members = sorted({a for _, _, a in SPANS if a is not None})
    short, long = {a: [] for a in members}, []
    for start, end, a in SPANS:
        if a is None:
            continue
        if end - start > SHORT:
            long.append((start, end, members.index(a)))
        else:
            short[a].extend(range(start, end))
    weights = _stack(a_pools, b_pools, members)
    tokens = StackedTokens.build([short[a] for a in members], TOKENS, "cpu")
    assert tokens.filled is not None  # adapter 2 has no short token, 0 has two: padding
    lora_stacked(x, outs, weights, tokens)
    lora_segments(x, outs, weights, long)


@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
def test_segments_and_stacks_match_the_reference(dtype, rtol):
    x, a_pools, b_pools, outs = _pools(dtype)
    expected = _expected(x, a_pools, b_pools, outs)
    no_adapter = [t for s, e, a in SPANS if a is None for t in range(s, e)]
    before = [o.clone() for o in outs]

    _run(x, a_pools, b_pools, outs)

    assert_close(torch.cat(outs, dim=1), expected, rtol)
    for out, old in zip(outs, before, strict=True):
        assert torch.equal(out[no_adapter], old[no_adapter])


def test_stacks_are_zero_past_each_rank():
    _, a_pools, b_pools, _ = _pools(torch.float32)
    weights = stack_weights(a_pools, b_pools, FIRST_ROWS, RANKS, SCALES)
    assert weights.rank_width == 16
    assert weights.a_t.shape == (4, IN_FEATURES, 3 * 16)
    assert not weights.a_t.isnan().any() and not any(b.isnan().any() for b in weights.b)
    for s in range(3):
        for a, first in enumerate(FIRST_ROWS):
            r = RANKS[s][a]
            block = weights.a_t[a, :, s * 16 : (s + 1) * 16].T
            assert torch.equal(block[:r], a_pools[s][first : first + r])
            scaled = SCALES[s][a] * b_pools[s][first : first + r]
            assert torch.equal(weights.b[s][a, :r], scaled)
            assert torch.all(block[r:] == 0) and torch.all(weights.b[s][a, r:] == 0)


def test_an_adapter_with_non_finite_weights_touches_only_its_tokens():
    """Infinite B rows of adapter 0 (two short tokens and padding beside it) reach only
    adapter 0's tokens: padding slots' outputs are dropped, never added elsewhere."""
    x, a_pools, b_pools, outs = _pools(torch.float32)
    first = FIRST_ROWS[0]
    for s in range(3):
        b_pools[s][first : first + RANKS[s][0]] = float("inf")
    _run(x, a_pools, b_pools, outs)
    own = {t for s, e, a in SPANS if a == 0 for t in range(s, e)}
    for t in range(TOKENS):
        finite = all(bool(o[t].isfinite().all()) for o in outs)
        assert finite == (t not in own), t


def test_stacked_tokens_layout():
    tokens = StackedTokens.build([[4, 5, 6], [0], [9, 10, 11]], 12, "cpu")
    assert (tokens.num_adapters, tokens.slots) == (3, 3)
    assert tokens.gather.tolist() == [4, 5, 6, 0, 12, 12, 9, 10, 11]
    assert tokens.tokens.tolist() == [4, 5, 6, 0, 9, 10, 11]
    assert tokens.filled.tolist() == [0, 1, 2, 3, 6, 7, 8]
    assert tokens.contiguous is None
    uniform = StackedTokens.build([[0, 1], [2, 3]], 4, "cpu")
    assert uniform.filled is None and uniform.contiguous == (0, 4)
    in_order = StackedTokens.build([[2, 3], [4, 5]], 8, "cpu")
    assert in_order.contiguous == (2, 6)
    shuffled = StackedTokens.build([[4, 5], [2, 3]], 8, "cpu")
    assert shuffled.filled is None and shuffled.contiguous is None


def test_the_contiguous_layout_is_the_gathered_one():
    """A decode step whose tokens sit in stack order reads x and accumulates into out by
    slices; the result is the gather/scatter form's (up to the rounding of one sum)."""
    x, a_pools, b_pools, outs = _pools(torch.float32)
    members = [0, 1, 3]  # two tokens each, rows 4..9 in order
    weights = _stack(a_pools, b_pools, members)
    tokens = StackedTokens.build([[4, 5], [6, 7], [8, 9]], TOKENS, "cpu")
    assert tokens.contiguous == (4, 10)
    sliced = [o.clone() for o in outs]
    lora_stacked(x, sliced, weights, tokens)
    gathered = [o.clone() for o in outs]
    lora_stacked(x, gathered, weights, dataclasses.replace(tokens, contiguous=None))
    for a, b, before in zip(sliced, gathered, outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert not torch.equal(a[4:10], before[4:10])
        assert torch.equal(a[:4], before[:4]) and torch.equal(a[10:], before[10:])
