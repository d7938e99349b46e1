"""The multi-slice LoRA references (the definition) against a naive per-token loop in float64.

The batch mixes ranks 1..64, per-slice ranks including 0, one-token and many-token
segments, tokens with no adapter, and contiguous and scattered pool rows.
"""

from __future__ import annotations

import pytest
import torch

from loramux.kernels.lora import lora_expand_slices_reference, lora_shrink_slices_reference
from loramux.kernels.lora_batch import LoRABatch
from tests.kernels.helpers import DTYPES, assert_close

IN_FEATURES = 37
OUT_WIDTHS = (29, 11)
OFFSETS = (0, 29)
POOL_ROWS = 160

_scattered = torch.randperm(POOL_ROWS, generator=torch.Generator().manual_seed(1234))
ADAPTER_ROWS = [[7, 2, 19], list(range(40, 48)), [100], _scattered[:64].tolist(), [5]]
RANKS = [[3, 8, 1, 64, 1], [2, 0, 1, 16, 1]]  # [slice][adapter]; 0: slice not targeted
SCALES = [[0.5, 2.0, 1.0, 0.125, 3.0], [1.0, 9.0, -2.0, 0.25, 0.5]]
SPANS = [
    (0, 2, None),
    (2, 3, 0),
    (3, 11, 1),
    (11, 12, 2),
    (12, 15, None),
    (15, 31, 3),
    (31, 32, 4),
    (32, 33, None),
]
TOKENS = 33


def _batch() -> LoRABatch:
    return LoRABatch.build(SPANS, ADAPTER_ROWS, RANKS, SCALES, TOKENS, "cpu")


def _adapter_of() -> list[int | None]:
    adapters: list[int | None] = [None] * TOKENS
    for start, end, adapter in SPANS:
        adapters[start:end] = [adapter] * (end - start)
    return adapters


def _data(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, IN_FEATURES, generator=gen).to(dtype)
    a_pools = [(torch.randn(POOL_ROWS, IN_FEATURES, generator=gen) * 0.2).to(dtype) for _ in RANKS]
    b_pools = [(torch.randn(POOL_ROWS, w, generator=gen) * 0.2).to(dtype) for w in OUT_WIDTHS]
    out = torch.randn(TOKENS, sum(OUT_WIDTHS), generator=gen).to(dtype)
    return x, a_pools, b_pools, out


def _naive(x, a_pools, b_pools, out):
    """(y, out + deltas) by the per-token formula, in float64."""
    y = torch.zeros(len(RANKS), TOKENS, 64, dtype=torch.float64)
    result = out.double().clone()
    for t, a in enumerate(_adapter_of()):
        if a is None:
            continue
        for s, offset in enumerate(OFFSETS):
            rows = ADAPTER_ROWS[a][: RANKS[s][a]]
            for k, row in enumerate(rows):
                y[s, t, k] = torch.dot(x[t].double(), a_pools[s][row].double())
            delta = sum(
                (y[s, t, k] * b_pools[s][row].double() for k, row in enumerate(rows)),
                torch.zeros(OUT_WIDTHS[s], dtype=torch.float64),
            )
            result[t, offset : offset + OUT_WIDTHS[s]] += SCALES[s][a] * delta
    return y, result


@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
def test_references_match_the_naive_loop(dtype, rtol):
    x, a_pools, b_pools, out = _data(dtype)
    exact_y, exact_out = _naive(x, a_pools, b_pools, out)
    batch = _batch()

    y = lora_shrink_slices_reference(x, a_pools, batch)
    assert y.shape == (len(RANKS), TOKENS, 64) and y.dtype == dtype
    assert_close(y, exact_y, rtol)
    # Past each rank, and for tokens without an adapter, y is exactly zero.
    assert torch.equal(y == 0, exact_y == 0)

    lora_expand_slices_reference(out, y, b_pools, OFFSETS, batch)
    assert_close(out, exact_out, rtol)


@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
def test_expand_reads_only_each_rank(dtype, rtol):
    """y past a token's rank (and for tokens without an adapter) is not read: NaN there is
    ignored, and tokens without an adapter keep their values exactly."""
    x, a_pools, b_pools, out = _data(dtype)
    batch = _batch()
    y = lora_shrink_slices_reference(x, a_pools, batch)
    _, exact_out = _naive(x, a_pools, b_pools, out)
    y[y == 0] = float("nan")
    before = out.clone()

    lora_expand_slices_reference(out, y, b_pools, OFFSETS, batch)

    assert not torch.isnan(out).any()
    assert_close(out, exact_out, rtol)
    for t, a in enumerate(_adapter_of()):
        if a is None:
            assert torch.equal(out[t], before[t]), f"token {t} has no adapter but changed"


@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
def test_matches_peft_formulation(dtype, rtol):
    """out + c * B(A x), with A = a_pool[rows] and B = b_pool[rows]^T, as PEFT computes it."""
    rows, scale = [11, 4, 30, 2], 0.375
    x, a_pools, b_pools, out = _data(dtype)
    x, out = x[:5], out[:5, : OUT_WIDTHS[0]]
    batch = LoRABatch.build([(0, 5, 0)], [rows], [[4]], [[scale]], 5, "cpu")
    a = a_pools[0][rows].double()  # [r, in]  (lora_A.weight)
    b = b_pools[0][rows].double().T  # [out, r] (lora_B.weight)
    expected = out.double() + scale * (x.double() @ a.T) @ b.T

    y = lora_shrink_slices_reference(x, a_pools[:1], batch)
    lora_expand_slices_reference(out, y, b_pools[:1], [0], batch)

    assert_close(out, expected, rtol)
