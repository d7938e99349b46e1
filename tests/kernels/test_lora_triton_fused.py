"""The fused shrink+expand LoRA kernels against the multi-slice references.

The data is ``test_lora_triton``'s (three slices of widths 29, 19, 7 over in = 37; ranks
1..80 with one of 80 beyond the 64-wide tiles, per-slice ranks of 0 where an adapter skips
a module, merged and separate segments, tokens without an adapter, scattered rows, an
adapter no token uses). The fused result must be what the two references give in a row:
shrink rounded to the dtype, then expand, within the tolerances of that file.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loramux.kernels import lora_triton
from loramux.kernels.lora import lora_expand_slices_reference, lora_shrink_slices_reference
from loramux.kernels.lora_batch import LoRABatch
from loramux.kernels.lora_tiles import FusedTiles, tiles_for
from loramux.kernels.lora_triton_fused import _split_shape, lora_fused_bgmv, lora_fused_sgmv
from tests.kernels.helpers import compile_for_hopper, run_python
from tests.kernels.test_lora_triton import (
    ADAPTER_ROWS,
    ALL_DTYPES,
    DEVICE,
    LOW_PRECISION,
    RANKS,
    SCALES,
    SLICE_OFFSETS,
    _assert_accurate,
    _batch,
    _inputs,
    _touched,
    _wide,
)

# Small tiles split each slice's columns across programs (29 columns: two 16-wide tiles,
# one per split), and a rank budget that narrows block_k below the data's width.
SPLIT = FusedTiles(block_k=16, block_n=16, target_programs=10_000, num_warps=4, rank_budget=2048)
DEFAULT = tiles_for(None).decode
TILES = {"default": DEFAULT, "split": SPLIT}
FUSED = {"bgmv": lora_fused_bgmv, "sgmv": lora_fused_sgmv}
# The per-token form needs one-token segments; the segment form takes either batch.
FORMS = [("bgmv", "decode"), ("sgmv", "decode"), ("sgmv", "prefill")]


def _expected(x, a_pools, b_pools, out, batch, first_slice=0):
    """(float64 result, same-dtype result) of shrink then expand by the references."""
    offsets = SLICE_OFFSETS[first_slice : first_slice + len(a_pools)]
    exact = out.double()
    y = lora_shrink_slices_reference(x.double(), _wide(a_pools), batch, first_slice=first_slice)
    lora_expand_slices_reference(exact, y, _wide(b_pools), offsets, batch, first_slice=first_slice)
    same = out.clone()
    y = lora_shrink_slices_reference(x, a_pools, batch, first_slice=first_slice)
    lora_expand_slices_reference(same, y, b_pools, offsets, batch, first_slice=first_slice)
    return exact, same


@pytest.mark.parametrize("tiles", list(TILES))
@pytest.mark.parametrize(("form", "batch_name"), FORMS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_fused_matches_shrink_then_expand(form, batch_name, tiles, dtype):
    batch = _batch(batch_name)
    x, a_pools, b_pools, out = _inputs(dtype, batch.num_tokens)
    exact, same = _expected(x, a_pools, b_pools, out, batch)
    before = out.clone()

    outs = lora_triton.slice_views(out, b_pools, SLICE_OFFSETS)
    launches = FUSED[form](x, outs, a_pools, b_pools, batch, TILES[tiles])

    assert launches == 1
    _assert_accurate(out, same, exact, dtype)
    untouched = ~_touched(batch_name)
    assert torch.equal(out[untouched], before[untouched])


def _ulps(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|actual − expected| in units of the last place of ``actual``'s dtype at expected."""
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10}[actual.dtype]
    exponent = torch.floor(torch.log2(expected.abs().clamp(min=2.0**-14)))
    return (actual.double() - expected).abs() / torch.exp2(exponent - mantissa_bits)


@pytest.mark.parametrize(("form", "batch_name"), FORMS)
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_fused_rounds_the_intermediate_as_peft_does(form, batch_name, dtype):
    """PEFT computes ``lora_A(x)`` in the model's dtype, then ``lora_B`` of it: out must be
    within one unit in the last place of ``out + c · (round(x A^T) B)`` in float64 (one
    rounding of the sum); an intermediate kept in fp32 lands further off."""
    batch = _batch(batch_name)
    x, a_pools, b_pools, out = _inputs(dtype, batch.num_tokens)
    y = lora_shrink_slices_reference(x.double(), _wide(a_pools), batch).to(dtype)
    expected = out.double()
    lora_expand_slices_reference(expected, y.double(), _wide(b_pools), SLICE_OFFSETS, batch)

    FUSED[form](
        x, lora_triton.slice_views(out, b_pools, SLICE_OFFSETS), a_pools, b_pools, batch, SPLIT
    )

    assert _ulps(out, expected).max().item() <= 1.0


@pytest.mark.parametrize(("form", "batch_name"), FORMS)
def test_fused_into_separate_outputs(form, batch_name):
    """Each slice its own tensor (q, k, v as three linears make them), two slices only
    (gate/up: the third output slot unused), from the batch's second slice on."""
    batch = _batch(batch_name)
    x, a_pools, b_pools, out = _inputs(torch.float32, batch.num_tokens)
    exact, _ = _expected(x, a_pools[1:], b_pools[1:], out, batch, first_slice=1)
    outs = [v.clone() for v in lora_triton.slice_views(out, b_pools, SLICE_OFFSETS)][1:]

    FUSED[form](x, outs, a_pools[1:], b_pools[1:], batch, SPLIT, first_slice=1)

    for out_s, offset in zip(outs, SLICE_OFFSETS[1:], strict=True):
        expected = exact[:, offset : offset + out_s.shape[1]]
        torch.testing.assert_close(out_s.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", list(FUSED))
def test_fused_without_adapters_launches_nothing(form):
    batch = LoRABatch.build([(0, 4, None)], ADAPTER_ROWS, RANKS, SCALES, 4, DEVICE)
    x, a_pools, b_pools, out = _inputs(torch.float32, 4)
    before = out.clone()
    outs = lora_triton.slice_views(out, b_pools, SLICE_OFFSETS)
    assert FUSED[form](x, outs, a_pools, b_pools, batch, SPLIT) == 0
    assert torch.equal(out, before)


def test_fused_per_token_batch_skips_tokens_without_adapter():
    """The CUDA-graph path's batch: one segment per token, adapter -1 where none; rows and
    ranks in buffers wider than any adapter needs."""
    decode = _batch("decode")
    batch = LoRABatch.per_token(decode.token_adapter, decode.rows, decode.rank, decode.scale)
    x, a_pools, b_pools, out = _inputs(torch.float32, batch.num_tokens)
    exact, _ = _expected(x, a_pools, b_pools, out, decode)
    for form in FUSED:
        result = out.clone()
        views = lora_triton.slice_views(result, b_pools, SLICE_OFFSETS)
        FUSED[form](x, views, a_pools, b_pools, batch, SPLIT)
        torch.testing.assert_close(result.double(), exact, rtol=1e-5, atol=1e-5)


def test_fused_rejects_mismatched_outputs():
    batch = _batch("decode")
    x, a_pools, b_pools, out = _inputs(torch.float32, batch.num_tokens)
    outs = lora_triton.slice_views(out, b_pools, SLICE_OFFSETS)
    with pytest.raises(ValueError, match="outs\\[1\\] must be 12 × 19"):
        lora_fused_bgmv(x, [outs[0], outs[2], outs[1]], a_pools, b_pools, batch, SPLIT)
    with pytest.raises(ValueError, match="one output per B pool"):
        lora_fused_bgmv(x, outs[:2], a_pools, b_pools, batch, SPLIT)


def test_split_shape_fills_the_grid_and_respects_the_rank_budget():
    x = torch.empty(64, 4096)
    pools = [torch.empty(1, 4096)] * 3
    tiles = DEFAULT
    # 64 tokens × 3 slices = 192 programs a split: two splits of 16 tiles reach 264.
    assert _split_shape(x, pools, tiles, 16, 192) == (256, 128, 2, 16)
    # One token: as many splits as there are column tiles.
    assert _split_shape(x, pools, tiles, 16, 3) == (256, 128, 32, 1)
    # Rank 512: the budget narrows both tiles to 32.
    wide_rank = dataclasses.replace(tiles, rank_budget=16384)
    assert _split_shape(x, pools, wide_rank, 512, 192)[:2] == (32, 32)
    # Narrow data: tiles no wider than it.
    assert _split_shape(torch.empty(4, 37), [torch.empty(1, 29)], tiles, 16, 4)[:2] == (64, 32)


# --- GPU only -------------------------------------------------------------------------------


def _real_problem(tokens: int, adapters: int, rank: int, seed: int):
    """Llama-7B's q/k/v (in 4096; 4096, 1024, 1024 out: 8 KV heads) in bf16 on the GPU:
    ``tokens`` decode tokens over ``adapters`` distinct adapters, grouped as the scheduler
    groups them, each adapter's rows scattered in a pool of 4096."""
    gen = torch.Generator().manual_seed(seed)
    widths = (4096, 1024, 1024)
    pool_rows = torch.randperm(4096, generator=gen)
    rows = [pool_rows[a * rank : (a + 1) * rank].tolist() for a in range(adapters)]
    spans = [(t, t + 1, t * adapters // tokens) for t in range(tokens)]
    batch = LoRABatch.build(
        spans, rows, [[rank] * adapters] * 3, [[0.5] * adapters] * 3, tokens, "cuda"
    )
    x = torch.randn(tokens, 4096, generator=gen).to("cuda", torch.bfloat16)
    a_pools = [(torch.randn(4096, 4096, generator=gen) / 64).to("cuda", torch.bfloat16)] * 3
    b_pools = [(torch.randn(4096, n, generator=gen) / 4).to("cuda", torch.bfloat16) for n in widths]
    outs = [torch.randn(tokens, n, generator=gen).to("cuda", torch.bfloat16) for n in widths]
    return batch, x, a_pools, b_pools, outs


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "adapters"), [(1, 1), (64, 1), (64, 64), (256, 16)])
@pytest.mark.parametrize("form", list(FUSED))
def test_real_shapes_on_gpu(form, tokens, adapters):
    """Compiled, with the committed tiles for this GPU, against float64 shrink-then-expand:
    at most twice the error of the same-dtype torch references (a bf16 intermediate's
    rounding may flip either way after a 4096-long sum, so no tighter bound holds). One
    adapter's tokens form one segment (the segment form's tiles of 16), distinct ones a
    segment each."""
    from loramux.kernels.lora_tiles import tiles_for

    batch, x, a_pools, b_pools, outs = _real_problem(tokens, adapters, 16, seed=tokens + adapters)
    offsets = [0, 4096, 5120]
    out = torch.cat(outs, dim=1)
    exact, same = out.double(), out.clone()
    y = lora_shrink_slices_reference(x.double(), _wide(a_pools), batch)
    lora_expand_slices_reference(exact, y, _wide(b_pools), offsets, batch)
    y = lora_shrink_slices_reference(x, a_pools, batch)
    lora_expand_slices_reference(same, y, b_pools, offsets, batch)
    tiles = tiles_for(torch.cuda.get_device_name())

    FUSED[form](
        x, outs, a_pools, b_pools, batch, tiles.decode if form == "bgmv" else tiles.segments
    )

    _assert_accurate(torch.cat(outs, dim=1), same, exact, torch.bfloat16)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """A fused launch captured over fixed buffers and replayed on new adapter tables gives
    what the eager launch gives (the engine's static decode path)."""
    from loramux.kernels.lora_tiles import tiles_for

    batch, x, a_pools, b_pools, outs = _real_problem(64, 64, 16, seed=3)
    static = LoRABatch.per_token(
        batch.token_adapter.clone(), batch.rows.clone(), batch.rank.clone(), batch.scale.clone()
    )
    tiles = tiles_for(torch.cuda.get_device_name()).decode
    start = [o.clone() for o in outs]
    lora_fused_bgmv(x, outs, a_pools, b_pools, static, tiles)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_fused_bgmv(x, outs, a_pools, b_pools, static, tiles)
    for seed in (4, 5):
        fresh, *_ = _real_problem(64, 64, 16, seed=seed)
        static.token_adapter.copy_(fresh.token_adapter.flip(0))
        static.rows.copy_(fresh.rows)
        for out, first in zip(outs, start, strict=True):
            out.copy_(first)
        graph.replay()
        torch.cuda.synchronize()
        eager = [o.clone() for o in start]
        lora_fused_bgmv(x, eager, a_pools, b_pools, static, tiles)
        assert all(torch.equal(a, b) for a, b in zip(outs, eager, strict=True))


def _compile_for_hopper() -> None:
    """Compile both fused kernels for sm_90, without a GPU (run in a subprocess)."""
    from loramux.kernels import lora_triton_fused

    for dtype in ("bf16", "fp32"):
        pointers = {
            **dict.fromkeys(("x_ptr", "out0_ptr", "out1_ptr", "out2_ptr"), f"*{dtype}"),
            "table_ptr": "*i64",
            "scale_ptr": "*fp32",
        }
        common = {"IN_FEATURES": 4096, "TILES_PER_SPLIT": 16, "BLOCK_K": 256, "BLOCK_N": 128}
        compile_for_hopper(
            lora_triton_fused._fused_bgmv_kernel, pointers, {**common, "BLOCK_R": 16}
        )
        precision = "ieee" if dtype == "fp32" else "tf32"
        constexprs = {**common, "BLOCK_K": 128, "BLOCK_N": 64, "BLOCK_M": 16, "BLOCK_R": 16}
        compile_for_hopper(
            lora_triton_fused._fused_sgmv_kernel,
            pointers,
            {**constexprs, "DOT_PRECISION": precision},
        )


def test_fused_kernels_compile_for_hopper():
    run_python(
        "from tests.kernels.test_lora_triton_fused import _compile_for_hopper; "
        "_compile_for_hopper()",
        interpret=False,
    )
