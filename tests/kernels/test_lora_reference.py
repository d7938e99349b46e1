"""lora_shrink / lora_expand against a naive per-token loop computed in float64.

The batch mixes ranks 1..64, one-token and many-token segments, tokens with no
adapter, pool rows given as a contiguous slice and as an arbitrary gather, and a
``max_rank`` wider than every segment's rank.
"""

from __future__ import annotations

import pytest
import torch

from loramux.kernels.lora import LoRASegment, lora_expand, lora_shrink
from tests.kernels.helpers import DTYPES, assert_close

IN_FEATURES = 37
OUT_FEATURES = 29
POOL_ROWS = 160
MAX_RANK = 72  # wider than the largest segment rank (64): columns 64.. stay zero


def _segment(start: int, end: int, rows: list[int], scale: float, contiguous: bool) -> LoRASegment:
    if contiguous:
        assert rows == list(range(rows[0], rows[0] + len(rows)))
    return LoRASegment(
        start=start,
        end=end,
        rows=torch.tensor(rows, dtype=torch.long),
        rank=len(rows),
        scale=scale,
        contiguous_start=rows[0] if contiguous else None,
    )


def _batch() -> tuple[int, list[LoRASegment], set[int]]:
    """(tokens, segments, token indices covered by no segment)."""
    gen = torch.Generator().manual_seed(1234)
    scattered = torch.randperm(POOL_ROWS, generator=gen)[:64].tolist()
    segments = [
        # tokens 0..1 have no adapter
        _segment(2, 3, [7, 2, 19], 0.5, contiguous=False),  # one token, gathered rows, rank 3
        _segment(3, 11, list(range(40, 48)), 2.0, contiguous=True),  # 8 tokens, rank 8
        _segment(11, 12, [100], 1.0, contiguous=True),  # one token, rank 1
        # tokens 12..14 have no adapter
        _segment(15, 31, scattered, 0.125, contiguous=False),  # 16 tokens, rank 64, scattered
        _segment(31, 32, list(range(0, 64)), 1.5, contiguous=True),  # one token, rank 64
        _segment(32, 37, [150, 3, 77, 9, 120], -0.75, contiguous=False),  # rank 5
        _segment(37, 38, [5], 3.0, contiguous=False),  # one token, rank 1, gathered
        # token 38 has no adapter
        _segment(39, 45, list(range(64, 80)), 0.25, contiguous=True),  # rank 16
        # tokens 45..46 have no adapter
    ]
    tokens = 47
    covered = {t for seg in segments for t in range(seg.start, seg.end)}
    return tokens, segments, set(range(tokens)) - covered


def _naive_shrink(x, a_pool, segments, max_rank):
    x64, a64 = x.double(), a_pool.double()
    y = torch.zeros(x.shape[0], max_rank, dtype=torch.float64)
    for seg in segments:
        rows = seg.rows.tolist()
        for t in range(seg.start, seg.end):
            for k, row in enumerate(rows):
                y[t, k] = torch.dot(x64[t], a64[row])
    return y


def _naive_expand(out, y, b_pool, segments):
    result = out.double().clone()
    y64, b64 = y.double(), b_pool.double()
    for seg in segments:
        rows = seg.rows.tolist()
        for t in range(seg.start, seg.end):
            delta = torch.zeros(b_pool.shape[1], dtype=torch.float64)
            for k, row in enumerate(rows):
                delta += y64[t, k] * b64[row]
            result[t] += seg.scale * delta
    return result


def _data(dtype, tokens):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, IN_FEATURES, generator=gen).to(dtype)
    a_pool = (torch.randn(POOL_ROWS, IN_FEATURES, generator=gen) * 0.2).to(dtype)
    b_pool = (torch.randn(POOL_ROWS, OUT_FEATURES, generator=gen) * 0.2).to(dtype)
    out = torch.randn(tokens, OUT_FEATURES, generator=gen).to(dtype)
    return x, a_pool, b_pool, out


@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
def test_shrink_matches_naive_loop(dtype, rtol):
    tokens, segments, untouched = _batch()
    x, a_pool, _, _ = _data(dtype, tokens)

    y = lora_shrink(x, a_pool, segments, MAX_RANK)

    assert y.shape == (tokens, MAX_RANK)
    assert y.dtype == dtype
    assert_close(y, _naive_shrink(x, a_pool, segments, MAX_RANK), rtol)
    # Columns past each segment's rank, past every rank, and rows of tokens without an
    # adapter are exactly zero.
    for seg in segments:
        assert torch.all(y[seg.start : seg.end, seg.rank :] == 0)
    assert torch.all(y[:, 64:] == 0)
    for t in untouched:
        assert torch.all(y[t] == 0)


@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
def test_expand_matches_naive_loop(dtype, rtol):
    tokens, segments, untouched = _batch()
    x, a_pool, b_pool, out = _data(dtype, tokens)
    y = lora_shrink(x, a_pool, segments, MAX_RANK)
    before = out.clone()

    lora_expand(out, y, b_pool, segments)

    assert_close(out, _naive_expand(before, y, b_pool, segments), rtol)
    for t in untouched:
        assert torch.equal(out[t], before[t]), f"token {t} has no adapter but changed"


@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
def test_expand_reads_only_each_segments_rank_columns(dtype, rtol):
    """y's columns past a segment's rank are not part of the maths: garbage there is ignored."""
    tokens, segments, untouched = _batch()
    _, _, b_pool, out = _data(dtype, tokens)
    gen = torch.Generator().manual_seed(5)
    y = torch.randn(tokens, MAX_RANK, generator=gen).to(dtype)
    expected = _naive_expand(out, y, b_pool, segments)
    for seg in segments:
        y[seg.start : seg.end, seg.rank :] = float("nan")
    for t in untouched:
        y[t] = float("nan")
    before = out.clone()

    lora_expand(out, y, b_pool, segments)

    assert not torch.isnan(out).any()
    assert_close(out, expected, rtol)
    for t in untouched:
        assert torch.equal(out[t], before[t])


@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
def test_contiguous_and_gathered_rows_agree(dtype, rtol):
    """The same rows named by a slice (contiguous_start) or by a gather give the same y."""
    tokens = 6
    x, a_pool, b_pool, out = _data(dtype, tokens)
    rows = list(range(20, 36))
    sliced = [_segment(0, tokens, rows, 0.5, contiguous=True)]
    gathered = [_segment(0, tokens, rows, 0.5, contiguous=False)]

    y_sliced = lora_shrink(x, a_pool, sliced, 16)
    y_gathered = lora_shrink(x, a_pool, gathered, 16)
    torch.testing.assert_close(y_sliced, y_gathered, rtol=rtol, atol=0)
    out_sliced, out_gathered = out.clone(), out.clone()
    lora_expand(out_sliced, y_sliced, b_pool, sliced)
    lora_expand(out_gathered, y_gathered, b_pool, gathered)
    torch.testing.assert_close(out_sliced, out_gathered, rtol=rtol, atol=0)


def test_no_segments_is_a_no_op():
    x, a_pool, b_pool, out = _data(torch.float32, 4)
    y = lora_shrink(x, a_pool, [], 8)
    assert torch.equal(y, torch.zeros(4, 8))
    before = out.clone()
    lora_expand(out, y, b_pool, [])
    assert torch.equal(out, before)


@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
def test_matches_peft_formulation(dtype, rtol):
    """out + c * B(A x), with A = a_pool[rows] and B = b_pool[rows]^T, as PEFT computes it."""
    tokens, rows, scale = 5, [11, 4, 30, 2], 0.375
    x, a_pool, b_pool, out = _data(dtype, tokens)
    seg = [_segment(0, tokens, rows, scale, contiguous=False)]
    a = a_pool[rows].double()  # [r, in]  (lora_A.weight)
    b = b_pool[rows].double().T  # [out, r] (lora_B.weight)
    expected = out.double() + scale * (x.double() @ a.T) @ b.T

    y = lora_shrink(x, a_pool, seg, 4)
    lora_expand(out, y, b_pool, seg)

    assert_close(out, expected, rtol)
