"""Shared by the kernel reference tests: dtypes with their tolerances, and the comparison."""

from __future__ import annotations

import pytest
import torch

DTYPES = [
    pytest.param(torch.float32, 1e-5, id="float32"),
    pytest.param(torch.float64, 1e-12, id="float64"),
]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """``actual`` equals the float64 ``expected`` to ``rtol``, relative to the result's scale.

    The absolute tolerance scales with the largest expected entry, so entries near zero from
    cancellation don't demand more precision than the dtype has.
    """
    atol = rtol * float(expected.abs().max())
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)
