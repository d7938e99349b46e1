"""The Triton SGMV/BGMV LoRA kernels, the multi-slice references and LoRABatch.

Every launcher is called directly and compared
with the reference computed in float64 on the same inputs. Without a GPU the kernels run
in Triton's interpreter (``conftest.py``); with one, on it.

The batch has three slices (out widths 29, 19, 7 inside an out of 60 columns, the B pools
being column views of one fused pool) over ``in = 37``, and mixes: ranks 1..64 plus one
of 80 (two rank tiles), per-slice ranks including 0 (slice not targeted), one-token and
many-token segments, two adjacent spans of one adapter (merged into one segment), an
adapter used by two separate segments, tokens with no adapter, contiguous and scattered
pool rows, and an adapter in the table that no token uses.

Tolerances: float32 within 1e-5 of float64 (relative to the result's scale); bfloat16 and
float16 at most twice the error of the same-dtype torch reference. No floor is added: the
data is random, so the reference's rounding error is never zero, and both sides round
the same fp32 sums to the same format once (shrink) or the reference rounds more often
(expand).
"""

from __future__ import annotations

import pytest
import torch

from loramux.kernels import lora_triton
from loramux.kernels.lora import (
    lora_expand_slices_gather_bmm,
    lora_expand_slices_reference,
    lora_shrink_slices_gather_bmm,
    lora_shrink_slices_reference,
)
from loramux.kernels.lora_batch import LoRABatch
from tests.kernels.helpers import DTYPES, assert_close, compile_for_hopper, run_python

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

IN_FEATURES = 37
POOL_ROWS = 160
SLICE_WIDTHS = (29, 19, 7)
SLICE_OFFSETS = (0, 29, 48)
OUT_FEATURES = 60  # columns 55.. belong to no slice

_perm = torch.randperm(POOL_ROWS, generator=torch.Generator().manual_seed(1234))
ADAPTER_ROWS = [
    [7, 2, 19],  # 0: gathered rows
    list(range(40, 48)),  # 1: contiguous
    [100],  # 2
    _perm[:64].tolist(),  # 3: scattered
    list(range(0, 64)),  # 4: contiguous
    [150, 3, 77, 9, 120],  # 5
    list(range(64, 80)),  # 6
    [130, 131],  # 7: in the table, used by no token
    _perm[80:].tolist(),  # 8: 80 scattered rows: two rank tiles of 64
]
# RANKS[s][a]: adapter a's rank in slice s; 0 = a does not target that module.
RANKS = [
    [3, 8, 1, 64, 64, 5, 16, 2, 80],
    [3, 4, 1, 16, 64, 0, 16, 2, 70],
    [0, 8, 1, 64, 33, 5, 0, 2, 0],
]
SCALES = [
    [0.5, 2.0, 1.0, 0.125, 1.5, -0.75, 0.25, 3.0, 0.375],
    [1.0, -0.5, 2.0, 0.25, 0.75, 1.0, 1.25, 0.5, 2.0],
    [0.5, 1.5, -1.0, 1.0, 0.5, 0.25, 1.0, 1.0, 1.0],
]
PREFILL_SPANS = [
    (0, 2, None),
    (2, 3, 0),  # one token
    (3, 11, 1),  # eight tokens
    (11, 12, 2),
    (12, 15, None),
    (15, 23, 3),  # these two spans merge into one segment of 25 tokens
    (23, 40, 3),
    (40, 41, 4),
    (41, 46, 5),
    (46, 47, 2),  # adapter 2 again, in a segment of its own
    (47, 48, None),
    (48, 54, 6),
    (54, 58, 8),  # rank 80
    (58, 60, None),
]
DECODE_ADAPTERS = [3, None, 0, 4, 3, 5, None, 1, 6, 2, 8, None]  # one token per sequence
DECODE_SPANS = [(t, t + 1, a) for t, a in enumerate(DECODE_ADAPTERS)]
BATCHES = {"prefill": (PREFILL_SPANS, 60), "decode": (DECODE_SPANS, len(DECODE_SPANS))}

LOW_PRECISION = [torch.bfloat16, torch.float16]
ALL_DTYPES = [torch.float32, *LOW_PRECISION]

# (kernel, batch) pairs: "sgmv-m16" forces 16-token tiles, so the 25-token segment spans
# two tiles; on the decode batch it would be plain "sgmv" again.
KERNEL_BATCHES = [
    (kernel, batch)
    for kernel in ("sgmv", "sgmv-m16", "bgmv")
    for batch in BATCHES
    if (kernel, batch) != ("sgmv-m16", "decode")
]
SHRINKS = {
    "sgmv": lora_triton.lora_shrink_sgmv,
    "sgmv-m16": lambda *a, **k: lora_triton.lora_shrink_sgmv(*a, **k, block_m=16),
    "bgmv": lora_triton.lora_shrink_bgmv,
}
EXPANDS = {
    "sgmv": lora_triton.lora_expand_sgmv,
    "sgmv-m16": lambda *a, **k: lora_triton.lora_expand_sgmv(*a, **k, block_m=16),
    "bgmv": lora_triton.lora_expand_bgmv,
}


# --- data ---------------------------------------------------------------------------------


def _batch(name: str) -> LoRABatch:
    spans, tokens = BATCHES[name]
    return LoRABatch.build(spans, ADAPTER_ROWS, RANKS, SCALES, tokens, DEVICE)


def _token_adapters(name: str) -> list[int | None]:
    spans, tokens = BATCHES[name]
    adapters: list[int | None] = [None] * tokens
    for start, end, adapter in spans:
        adapters[start:end] = [adapter] * (end - start)
    return adapters


def _computed(name: str) -> torch.Tensor:
    """[slices, T, max_rank] bool: the entries of y the maths defines (r of t's adapter)."""
    adapters = _token_adapters(name)
    mask = torch.zeros(len(RANKS), len(adapters), max(max(r) for r in RANKS), dtype=torch.bool)
    for s, ranks in enumerate(RANKS):
        for t, a in enumerate(adapters):
            if a is not None:
                mask[s, t, : ranks[a]] = True
    return mask.to(DEVICE)


def _touched(name: str) -> torch.Tensor:
    """[T, out] bool: the out entries expand may change (t's adapter targets that slice)."""
    adapters = _token_adapters(name)
    mask = torch.zeros(len(adapters), OUT_FEATURES, dtype=torch.bool)
    for s, (offset, width) in enumerate(zip(SLICE_OFFSETS, SLICE_WIDTHS, strict=True)):
        for t, a in enumerate(adapters):
            if a is not None and RANKS[s][a] > 0:
                mask[t, offset : offset + width] = True
    return mask.to(DEVICE)


def _inputs(dtype: torch.dtype, tokens: int, device: str = DEVICE):
    """x (a view with row stride > in), A pools, B pools (views of one fused pool), out."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, IN_FEATURES + 3, generator=gen)[:, :IN_FEATURES]
    a_pools = [torch.randn(POOL_ROWS, IN_FEATURES, generator=gen) * 0.2 for _ in SLICE_WIDTHS]
    fused_b = torch.randn(POOL_ROWS, sum(SLICE_WIDTHS), generator=gen) * 0.2
    out = torch.randn(tokens, OUT_FEATURES, generator=gen)
    x, fused_b, out = (t.to(device, dtype) for t in (x, fused_b, out))
    a_pools = [p.to(device, dtype) for p in a_pools]
    b_pools = [fused_b[:, o : o + w] for o, w in zip(SLICE_OFFSETS, SLICE_WIDTHS, strict=True)]
    return x, a_pools, b_pools, out


def _wide(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.double() for t in tensors]


def _assert_accurate(actual, same_dtype_reference, exact, dtype) -> None:
    """float32: 1e-5 of the float64 result; 16-bit: ≤ 2 × the reference's own error."""
    if dtype == torch.float32:
        assert_close(actual, exact, 1e-5)
        return
    error = (actual.double() - exact).abs().max().item()
    reference_error = (same_dtype_reference.double() - exact).abs().max().item()
    assert error <= 2 * reference_error, f"{error=} vs torch {reference_error=}"


# --- LoRABatch ------------------------------------------------------------------------------


def test_build_matches_docstring():
    batch = _batch("prefill")

    assert batch.num_tokens == 60
    assert batch.num_slices == 3
    # Segments skip tokens without an adapter and merge the two adjacent spans of adapter 3.
    assert batch.seg_start.tolist() == [2, 3, 11, 15, 40, 41, 46, 48, 54]
    assert batch.seg_len.tolist() == [1, 8, 1, 25, 1, 5, 1, 6, 4]
    assert batch.seg_adapter.tolist() == [0, 1, 2, 3, 4, 5, 2, 6, 8]
    assert batch.max_seg_len == 25
    assert not batch.is_decode
    assert batch.token_adapter.tolist() == [
        -1 if a is None else a for a in _token_adapters("prefill")
    ]
    assert batch.max_rank == 80
    assert batch.rows.shape == (len(ADAPTER_ROWS), 80)
    for a, rows in enumerate(ADAPTER_ROWS):
        assert batch.rows[a, : len(rows)].tolist() == rows
        assert torch.all(batch.rows[a, len(rows) :] == 0)
    assert batch.rank.tolist() == RANKS
    assert batch.scale.tolist() == SCALES
    for tensor in (batch.seg_start, batch.seg_len, batch.seg_adapter, batch.token_adapter):
        assert tensor.dtype == torch.int32 and tensor.device.type == DEVICE
    assert batch.rows.dtype == batch.rank.dtype == torch.int32
    assert batch.scale.dtype == torch.float32 and batch.scale.device.type == DEVICE


def test_decode_batch_is_decode():
    batch = _batch("decode")
    assert batch.is_decode
    assert batch.max_seg_len == 1
    assert batch.seg_start.tolist() == [t for t, a in enumerate(DECODE_ADAPTERS) if a is not None]
    # Two adjacent one-token sequences of one adapter form a two-token segment: not decode.
    merged = LoRABatch.build([(0, 1, 2), (1, 2, 2)], ADAPTER_ROWS, RANKS, SCALES, 2, DEVICE)
    assert merged.seg_len.tolist() == [2]
    assert not merged.is_decode


def test_build_without_adapters():
    batch = LoRABatch.build([(0, 3, None), (3, 5, None)], ADAPTER_ROWS, RANKS, SCALES, 5, DEVICE)
    assert batch.num_segments == 0 and batch.max_seg_len == 0
    assert batch.token_adapter.tolist() == [-1] * 5


@pytest.mark.parametrize(
    ("spans", "tokens", "ranks", "message"),
    [
        ([(0, 2, None), (3, 5, 0)], 5, RANKS, "in order"),
        ([(0, 2, None), (2, 5, 9)], 5, RANKS, "outside the table"),
        ([(0, 2, 0)], 3, RANKS, "cover 2 tokens"),
        ([(0, 2, 0)], 2, [[4, *RANKS[0][1:]]], "rank 4 but 3 rows"),
    ],
)
def test_build_rejects_inconsistent_input(spans, tokens, ranks, message):
    with pytest.raises(ValueError, match=message):
        LoRABatch.build(spans, ADAPTER_ROWS, ranks, SCALES[: len(ranks)], tokens, DEVICE)


# --- Triton launchers against the reference ---------------------------------------------------


@pytest.mark.parametrize(("kernel", "batch_name"), KERNEL_BATCHES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_shrink_kernel_matches_reference(kernel, batch_name, dtype):
    batch = _batch(batch_name)
    x, a_pools, _, _ = _inputs(dtype, batch.num_tokens)
    exact = lora_shrink_slices_reference(x.double(), _wide(a_pools), batch)
    reference = lora_shrink_slices_reference(x, a_pools, batch)

    y = SHRINKS[kernel](x, a_pools, batch)

    assert y.shape == (3, batch.num_tokens, 80) and y.dtype == dtype
    _assert_accurate(y, reference, exact, dtype)
    # Past each rank, for untargeted slices and tokens without an adapter: exactly 0.
    assert torch.all(y[~_computed(batch_name)] == 0)


@pytest.mark.parametrize(("kernel", "batch_name"), KERNEL_BATCHES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_expand_kernel_matches_reference(kernel, batch_name, dtype):
    batch = _batch(batch_name)
    _, _, b_pools, out = _inputs(dtype, batch.num_tokens)
    gen = torch.Generator().manual_seed(7)
    y = torch.randn(3, batch.num_tokens, 80, generator=gen).to(DEVICE, dtype)
    y[~_computed(batch_name)] = float("nan")  # expand must never read these
    exact = out.double()
    lora_expand_slices_reference(exact, y.double(), _wide(b_pools), SLICE_OFFSETS, batch)
    reference = out.clone()
    lora_expand_slices_reference(reference, y, b_pools, SLICE_OFFSETS, batch)
    before = out.clone()

    EXPANDS[kernel](out, y, b_pools, SLICE_OFFSETS, batch)

    assert not torch.isnan(out).any()
    _assert_accurate(out, reference, exact, dtype)
    untouched = ~_touched(batch_name)
    assert torch.equal(out[untouched], before[untouched])


@pytest.mark.parametrize(
    ("shrink", "expand"),
    [
        (lora_triton.lora_shrink_sgmv, lora_triton.lora_expand_sgmv),
        (lora_triton.lora_shrink_bgmv, lora_triton.lora_expand_bgmv),
    ],
    ids=["sgmv", "bgmv"],
)
def test_first_slice_selects_the_rank_table_rows(shrink, expand):
    """Slices 1..2 alone (first_slice=1) give what they give in the three-slice launch."""
    batch = _batch("decode")
    x, a_pools, b_pools, out = _inputs(torch.float32, batch.num_tokens)
    y_all = shrink(x, a_pools, batch)
    out_all = out.clone()
    expand(out_all, y_all, b_pools, SLICE_OFFSETS, batch)

    y_tail = shrink(x, a_pools[1:], batch, first_slice=1)
    out_tail = out.clone()
    expand(out_tail, y_all[:1], b_pools[:1], SLICE_OFFSETS[:1], batch)
    expand(out_tail, y_tail, b_pools[1:], SLICE_OFFSETS[1:], batch, first_slice=1)

    assert torch.equal(y_tail, y_all[1:])
    torch.testing.assert_close(out_tail, out_all, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel", ["sgmv", "bgmv"])
def test_kernels_without_adapters_change_nothing(kernel):
    batch = LoRABatch.build([(0, 4, None)], ADAPTER_ROWS, RANKS, SCALES, 4, DEVICE)
    x, a_pools, b_pools, out = _inputs(torch.float32, 4)
    before = out.clone()
    y = SHRINKS[kernel](x, a_pools, batch)
    EXPANDS[kernel](out, y, b_pools, SLICE_OFFSETS, batch)
    assert torch.equal(y, torch.zeros_like(y))
    assert torch.equal(out, before)


# --- references -------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
def test_gather_bmm_matches_reference(batch_name, dtype, rtol):
    batch = _batch(batch_name)
    x, a_pools, b_pools, out = _inputs(dtype, batch.num_tokens)
    y = lora_shrink_slices_gather_bmm(x, a_pools, batch)
    assert_close(y, lora_shrink_slices_reference(x.double(), _wide(a_pools), batch), rtol)

    y[~_computed(batch_name)] = float("nan")  # not read
    expected = out.double()
    lora_expand_slices_reference(expected, y.double(), _wide(b_pools), SLICE_OFFSETS, batch)
    lora_expand_slices_gather_bmm(out, y, b_pools, SLICE_OFFSETS, batch)
    assert_close(out, expected, rtol)


# --- imports and the compiled path ----------------------------------------------------------


def test_importing_the_ops_does_not_import_triton():
    """Triton (and so kernel decoration) happens only when a Triton path runs."""
    run_python(
        "import sys, loramux.kernels.lora\nassert 'triton' not in sys.modules, 'triton imported'"
    )


def _compile_for_hopper() -> None:
    """Compile every kernel for sm_90, without a GPU (run in a subprocess)."""
    # bf16 takes every 16-bit path (tf32 dots, the bit-exact rounding); fp32 the ieee dots
    # and the plain cast. fp16 differs from bf16 only in the cast's type.
    for dtype in ("bf16", "fp32"):
        precision = "ieee" if dtype == "fp32" else "tf32"
        pointers = {
            **dict.fromkeys(("x_ptr", "y_ptr", "out_ptr"), f"*{dtype}"),
            **dict.fromkeys(("a_table_ptr", "b_table_ptr"), "*i64"),
            "scale_ptr": "*fp32",
        }
        tiles = {"BLOCK_M": 64, "BLOCK_R": 64, "DOT_PRECISION": precision}
        launches = [
            (lora_triton._shrink_sgmv_kernel, {**tiles, "IN_FEATURES": 4099, "BLOCK_K": 64}),
            (lora_triton._shrink_bgmv_kernel, {"IN_FEATURES": 4099, "BLOCK_R": 16, "BLOCK_K": 64}),
            (lora_triton._expand_sgmv_kernel, {**tiles, "NUM_R_TILES": 2, "BLOCK_N": 64}),
            (lora_triton._expand_bgmv_kernel, {"NUM_R_TILES": 1, "BLOCK_R": 16, "BLOCK_N": 64}),
        ]
        for kernel, constexprs in launches:
            compile_for_hopper(kernel, pointers, constexprs)


def test_kernels_compile_for_hopper():
    """The compiled (non-interpreted) path type-checks and lowers to sm_90 code.

    Triton's cache keys on the kernel source, so a cached compile is a valid pass."""
    run_python(
        "from tests.kernels.test_lora_triton import _compile_for_hopper; _compile_for_hopper()",
        interpret=False,
    )
