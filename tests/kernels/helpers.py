"""Shared by the kernel reference tests: dtypes with their tolerances, and the comparison."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DTYPES = [
    pytest.param(torch.float32, 1e-5, id="float32"),
    pytest.param(torch.float64, 1e-12, id="float64"),
]

# One step of the batched-LoRA tests: four adapters in a pool of POOL_ROWS rows, three slices.
POOL_ROWS = 64
FIRST_ROWS = [3, 12, 30, 40]  # adapter a owns rows FIRST_ROWS[a] .. + max(RANKS[.][a]) - 1
RANKS = [[4, 8, 2, 16], [4, 0, 2, 16], [1, 8, 0, 16]]  # [slice][adapter]; 0: not targeted
SCALES = [[0.5, 2.0, -1.0, 0.25], [1.0, 1.0, 3.0, 0.5], [2.0, -0.5, 1.0, 0.125]]
# (start, end, adapter): long segments 2..12 and 20..33 (prefill chunks), short ones (decodes
# of one or two tokens) and tokens with no adapter elsewhere
SPANS = [(0, 1, 0), (1, 2, None), (2, 12, 1), (12, 14, 3), (14, 15, 0), (15, 20, None)]
SPANS += [(20, 33, 2), (33, 34, 1), (34, 35, None)]
TOKENS = 35


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """``actual`` equals the float64 ``expected`` to ``rtol``, relative to the result's scale.

    The absolute tolerance scales with the largest expected entry, so entries near zero from
    cancellation don't demand more precision than the dtype has.
    """
    atol = rtol * float(expected.abs().max())
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)


def multi_slice_expected(x, a_pools, b_pools, outs, spans, first_rows, ranks, scales):
    """``outs`` (side by side, float64) plus every slice's LoRA by the references: adapter a
    owns rows ``first_rows[a] ..`` (as many as its widest slice), ``ranks[s][a]`` and
    ``scales[s][a]`` per slice. NaN in the pools outside those rows is never read."""
    from loramux.kernels.lora import lora_expand_slices_reference, lora_shrink_slices_reference
    from loramux.kernels.lora_batch import LoRABatch

    rows = [
        list(range(first, first + max(adapter_ranks)))
        for first, adapter_ranks in zip(first_rows, zip(*ranks, strict=True), strict=True)
    ]
    batch = LoRABatch.build(spans, rows, ranks, scales, x.shape[0], "cpu")
    wide = [t.double().nan_to_num(0.0) for t in (*a_pools, *b_pools)]
    count = len(a_pools)
    y = lora_shrink_slices_reference(x.double(), wide[:count], batch)
    out = torch.cat([o.double() for o in outs], dim=1)
    widths = [o.shape[1] for o in outs]
    offsets = [sum(widths[:s]) for s in range(count)]
    lora_expand_slices_reference(out, y, wide[count:], offsets, batch)
    return out


# --- the compiled Triton path, checked without a GPU ------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, *, interpret: bool = True) -> None:
    """Run ``code`` in a fresh interpreter at the repository root; ``interpret=False`` drops
    ``TRITON_INTERPRET`` so Triton compiles (the choice is made when a kernel is defined)."""
    env = {k: v for k, v in os.environ.items() if interpret or k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-4000:]


def compile_for_hopper(kernel, pointers: dict[str, str], constexprs: dict) -> None:
    """Compile ``kernel`` for sm_90 without a GPU (call it in a ``run_python(...,
    interpret=False)`` subprocess): arguments in ``constexprs`` take those values, pointers
    the types in ``pointers`` (an unlisted ``*_ptr`` is ``*i32``), the rest are ``i32``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {
        n: "constexpr" if n in constexprs else pointers.get(n, "*i32" if "ptr" in n else "i32")
        for n in names
    }
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
    )
    triton.compile(source, target=GPUTarget("cuda", 90, 32))
