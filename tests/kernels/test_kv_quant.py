"""The quantized KV cache (``kernels/kv_quant.py``): its maths, the torch attention over it,
and the Triton kernels reading it (in the interpreter without a GPU).

The torch attention over a quantized cache must equal, bit for bit, the float attention
over the de-quantized values; the Triton kernels must match the float64 reference over
those values as they do for a float cache. Stale slots hold garbage as in a real arena:
int8 anything, and fp8's NaN bytes (0x7F, 0xFF), which a read outside a context would
spread.
"""

from __future__ import annotations

import pytest
import torch

from loramux.kernels import paged_attention as pa
from loramux.kernels.attention_triton import paged_decode_attention, paged_prefill_attention
from loramux.kernels.kv_quant import (
    QuantizedKV,
    dequantize_kv,
    fake_quantize_kv,
    gather_quantized_kv,
    quantize_kv,
    storage_dtype,
    write_quantized_kv,
)
from tests.kernels.helpers import assert_close, compile_for_hopper, run_python
from tests.kernels.test_attention_triton import DECODES, DEVICE, PREFILLS, _step

MODES = ["int8", "fp8"]


def _empty_cache(mode, blocks=6, block_size=4, heads=2, head_dim=16) -> QuantizedKV:
    return QuantizedKV.empty(blocks, block_size, heads, head_dim, storage_dtype(mode))


@pytest.mark.parametrize("mode", MODES)
def test_each_token_and_head_is_scaled_by_its_own_largest_value(mode):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 16, generator=gen) * torch.tensor([0.01, 1.0, 300.0])[:, None]
    x[2, 1] = 0.0  # an all-zero head: scale 0, reads back 0
    q, scales = quantize_kv(x, storage_dtype(mode))
    qmax = 127.0 if mode == "int8" else 448.0
    assert torch.equal(scales, x.abs().amax(-1) / qmax)
    assert float(q.float().abs().amax()) == qmax  # every non-zero head reaches the range
    x_hat = dequantize_kv(q, scales, torch.float32)
    assert torch.equal(x_hat[2, 1], torch.zeros(16))
    error = (x_hat - x).abs()
    if mode == "int8":  # round to nearest: half a step
        assert bool((error <= scales[..., None] * 0.5 * (1 + 1e-6)).all())
    else:  # e4m3: 3 mantissa bits, at most 2^-4 relative (subnormals: half their step)
        step = torch.maximum(x.abs() * 2.0**-4, scales[..., None] * 2.0**-10)
        assert bool((error <= step * (1 + 1e-6)).all())
    assert torch.equal(fake_quantize_kv(x, mode), x_hat)
    assert torch.equal(fake_quantize_kv(x, "auto"), x)


@pytest.mark.parametrize("mode", MODES)
def test_a_slot_s_bytes_do_not_depend_on_how_its_block_was_written(mode):
    """One write of a whole prompt, or a token at a time (decode), or in chunks: the same
    bytes, so the engine's tokens do not depend on scheduling."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(10, 2, 16, generator=gen) * 3
    slots = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11, 20, 21])
    whole, one_by_one, chunks = (_empty_cache(mode) for _ in range(3))
    write_quantized_kv(x, whole, slots)
    for t in range(10):
        write_quantized_kv(x[t : t + 1], one_by_one, slots[t : t + 1])
    write_quantized_kv(x[:3], chunks, slots[:3])
    write_quantized_kv(x[3:], chunks, slots[3:])
    for cache in (one_by_one, chunks):
        assert torch.equal(cache.raw, whole.raw)
    assert torch.equal(gather_quantized_kv(whole, slots, torch.float32), fake_quantize_kv(x, mode))


def test_a_stale_fp8_nan_byte_reads_as_zero():
    cache = _empty_cache("fp8")
    cache.data_bytes[1, 2] = 0x7F
    cache.data_bytes[1, 3] = 0xFF
    cache.scales[1] = 2.0
    got = gather_quantized_kv(cache, torch.tensor([6, 7]), torch.float32)
    assert torch.equal(got, torch.zeros_like(got))


def test_a_block_is_its_data_then_its_scales():
    cache = _empty_cache("int8", blocks=3, block_size=2, heads=1, head_dim=4)
    write_quantized_kv(torch.tensor([[[1.0, -2.0, 0.5, 127.0]]]), cache, torch.tensor([3]))
    block = cache.raw[1]  # slot 3: block 1, offset 1
    assert block.tolist()[:8] == [0, 0, 0, 0, 1, 254, 0, 127]  # offset 0, then 1 -2 0.5 127
    assert block[8:].view(torch.float32).tolist() == [0.0, 1.0]  # scales of offsets 0, 1
    assert cache.raw[0].eq(0).all() and cache.raw[2].eq(0).all()


def test_the_cache_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        QuantizedKV(torch.zeros(2, 40, dtype=torch.uint8), 2, 1, 16, torch.float16)
    with pytest.raises(ValueError, match=r"raw must be uint8 \[num_blocks, 40\]"):
        QuantizedKV(torch.zeros(2, 36, dtype=torch.uint8), 2, 1, 16, torch.int8)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        storage_dtype("int4")


def _quantized_step(step, mode: str, device=DEVICE):
    """``step``'s float caches quantized (stale slots too), fp8 NaN bytes planted in the
    stale tails and unused blocks; with the float caches replaced by what they read as."""
    blocks, block_size, heads, head_dim = step.k_cache.shape
    used = {
        (table[p // block_size], p % block_size)
        for table, n in zip(step.tables, step.context_lens, strict=True)
        for p in range(n)
    }
    caches = []
    for values in (step.k_cache, step.v_cache):
        cache = QuantizedKV.empty(blocks, block_size, heads, head_dim, storage_dtype(mode))
        every_slot = torch.arange(blocks * block_size)
        write_quantized_kv(values.float().cpu().view(-1, heads, head_dim), cache, every_slot)
        if mode == "fp8":
            for block in range(blocks):
                for offset in range(block_size):
                    if (block, offset) not in used:
                        cache.data_bytes[block, offset, :, ::3] = 0x7F
                        cache.data_bytes[block, offset, :, 1::3] = 0xFF
        caches.append(
            QuantizedKV(cache.raw.to(device), block_size, heads, head_dim, cache.data.dtype)
        )
    return caches


def _dequantized(cache: QuantizedKV) -> torch.Tensor:
    return dequantize_kv(cache.data, cache.scales, torch.float64)


@pytest.mark.parametrize("mode", MODES)
def test_torch_attention_over_a_quantized_cache_is_attention_over_its_values(mode):
    step = _step([*DECODES, *PREFILLS[:3]], 6, 2, 16, 8, torch.float32, seed=3, device="cpu")
    k, v = _quantized_step(step, mode, "cpu")
    args = (step.tables, step.context_lens, step.query_lens, 0.25)
    got = pa.paged_attention_reference(step.query, k, v, *args)
    k_float = dequantize_kv(k.data, k.scales, torch.float32)
    v_float = dequantize_kv(v.data, v.scales, torch.float32)
    expected = pa.paged_attention_reference(step.query, k_float, v_float, *args)
    assert torch.isfinite(got).all()
    assert torch.equal(got, expected)


def _reference(step, k, v, scale):
    return pa.paged_attention_reference(
        step.query.double(),
        _dequantized(k),
        _dequantized(v),
        step.tables,
        step.context_lens,
        step.query_lens,
        scale,
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_reads_a_quantized_cache(mode, num_splits):
    step = _step(DECODES, 6, 2, 24, 8, torch.float32, seed=4)
    k, v = _quantized_step(step, mode)
    out = paged_decode_attention(step.query, k, v, step.padded, step.ctx(), 0.3, num_splits)
    assert_close(out, _reference(step, k, v, 0.3), 1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_triton_prefill_reads_a_quantized_cache(mode):
    step = _step(PREFILLS, 8, 2, 16, 4, torch.float32, seed=5)
    k, v = _quantized_step(step, mode)
    out = paged_prefill_attention(
        step.query, k, v, step.padded, step.ctx(), step.starts(), 0.25, max(step.query_lens)
    )
    assert_close(out, _reference(step, k, v, 0.25), 1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_triton_over_a_quantized_cache_with_bfloat16_queries(mode):
    """Keys and values de-quantized to the query's dtype, as the torch path does: within
    twice the error of torch's own bfloat16 attention over the same values."""
    step = _step(DECODES[:3], 6, 2, 16, 8, torch.bfloat16, seed=6)
    k, v = _quantized_step(step, mode)
    out = paged_decode_attention(step.query, k, v, step.padded, step.ctx(), 0.25)
    expected = _reference(step, k, v, 0.25)
    torch_out = pa.paged_attention_reference(
        step.query, k, v, step.tables, step.context_lens, step.query_lens, 0.25
    )
    torch_error = float((torch_out.double() - expected).abs().max())
    assert out.dtype == torch.bfloat16
    assert float((out.double() - expected).abs().max()) <= 2 * torch_error


def test_triton_decodes_every_fp8_byte_as_torch_does():
    """All 256 e4m3 bytes as the values of one-key contexts (softmax weight 1: the output
    is the value): normals, subnormals, both zeros, and NaN read as 0."""
    sequences, head_dim = 16, 16
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = QuantizedKV.empty(sequences, 1, 1, head_dim, torch.float8_e4m3fn, DEVICE)
    values.data_bytes.copy_(every_byte.view(sequences, 1, 1, head_dim))
    values.scales.fill_(1.0)
    keys = QuantizedKV.empty(sequences, 1, 1, head_dim, torch.float8_e4m3fn, DEVICE)
    query = torch.zeros(sequences, 1, head_dim, device=DEVICE)
    tables = torch.arange(sequences, dtype=torch.int32, device=DEVICE)[:, None]
    ctx = torch.ones(sequences, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(query, keys, values, tables, ctx, 1.0, 1)
    expected = (
        every_byte.view(torch.float8_e4m3fn).float().nan_to_num(0.0).view(sequences, 1, head_dim)
    )
    assert torch.equal(out.cpu(), expected)


# --- the compiled path ------------------------------------------------------------------------


def _compile_for_hopper() -> None:
    """Compile both attention kernels over int8 and fp8 caches for sm_90 without a GPU (run
    in a subprocess): the 16-bit dots and the fp8 bit decoding the interpreter runs in numpy."""
    from loramux.kernels import attention_triton

    for kernel in (attention_triton._decode_split_kernel, attention_triton._prefill_kernel):
        for quant, data in ((1, "*i8"), (2, "*u8")):
            for act in ("bf16",):  # the float32 dots are the float cache's, compiled there
                pointers = {
                    "q_ptr": f"*{act}",
                    "out_ptr": f"*{act}",
                    "k_ptr": data,
                    "v_ptr": data,
                    "ks_ptr": "*fp32",
                    "vs_ptr": "*fp32",
                    "qk_scale": "fp32",
                    "part_m_ptr": "*fp32",
                    "part_l_ptr": "*fp32",
                    "part_acc_ptr": "*fp32",
                }
                constexprs = {
                    "GROUP": 3,
                    "G_PAD": 16,
                    "HEAD_DIM": 64,
                    "D_PAD": 64,
                    "BLOCK_SIZE": 16,
                    "BLOCK_N": 64,
                    "INTERPRET": False,
                    "IEEE": act == "fp32",
                    "QUANT": quant,
                }
                if kernel is attention_triton._decode_split_kernel:
                    constexprs["NUM_SPLITS"] = 2
                else:
                    constexprs["BLOCK_M"] = 64
                names = set(kernel.arg_names)
                compile_for_hopper(
                    kernel,
                    {k: v for k, v in pointers.items() if k in names},
                    constexprs,
                )


def test_quantized_attention_compiles_for_hopper():
    run_python(
        "from tests.kernels.test_kv_quant import _compile_for_hopper; _compile_for_hopper()",
        interpret=False,
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_context_is_gathered_whole_blocks_at_a_time_as_slot_by_slot(mode):
    """``gather_quantized_context`` (whole blocks) against ``gather_quantized_kv`` (each
    slot), for contexts ending inside a block, on a block edge, and padded with block 0."""
    from loramux.kernels.kv_quant import gather_quantized_context

    gen = torch.Generator().manual_seed(8)
    cache = _empty_cache(mode, blocks=9, block_size=4)
    write_quantized_kv(torch.randn(36, 2, 16, generator=gen), cache, torch.arange(36))
    tables = torch.tensor([[5, 2, 7], [8, 0, 0], [3, 1, 6]])
    positions = torch.arange(10)
    slots = pa.flat_slots(tables, positions.expand(3, 10), 4)
    got = gather_quantized_context(cache, slots, torch.float32)
    expected = gather_quantized_kv(cache, slots.reshape(-1), torch.float32).view(3, 10, 2, 16)
    assert torch.equal(got, expected)
    assert torch.equal(
        gather_quantized_context(cache, slots[:, :8], torch.float32), expected[:, :8]
    )


# --- the CPU's native read --------------------------------------------------------------------


@pytest.fixture(scope="module")
def native_kv():
    from loramux.kernels.kv_native import load_native_kv_gather

    native, how = load_native_kv_gather()
    assert native is not None, how
    return native


@pytest.mark.parametrize("mode", MODES)
def test_the_native_read_gives_the_torch_read_s_bits(native_kv, mode):
    """Whole blocks in any order, contexts ending inside a block and on its edge, stale
    fp8 NaN bytes read as 0: the same float32 bits as ``gather_quantized_context``."""
    from loramux.kernels.kv_quant import gather_quantized_context

    gen = torch.Generator().manual_seed(9)
    cache = _empty_cache(mode, blocks=12, block_size=4, heads=3, head_dim=24)
    write_quantized_kv(torch.randn(48, 3, 24, generator=gen) * 5, cache, torch.arange(48))
    if mode == "fp8":
        cache.data_bytes[10, 1:, :, ::5] = 0x7F
        cache.data_bytes[11, :, 1, 2::7] = 0xFF
    tables = torch.tensor([[5, 11, 7, 0], [10, 2, 0, 0], [3, 1, 6, 9]])
    for length in (16, 12, 9, 1):
        slots = pa.flat_slots(tables, torch.arange(length).expand(3, length), 4)
        got = native_kv.gather(cache, slots, torch.float32)
        assert torch.equal(got, gather_quantized_context(cache, slots, torch.float32)), length
        assert torch.isfinite(got).all()


def test_the_native_read_leaves_what_it_does_not_take_to_torch(native_kv):
    float_cache = torch.randn(4, 2, 1, 8)
    slots = torch.tensor([[0, 1, 2]])
    assert torch.equal(
        native_kv.gather(float_cache, slots, torch.float32),
        pa.gather_kv(float_cache, slots, torch.float32),
    )
    cache = _empty_cache("int8")
    write_quantized_kv(torch.randn(8, 2, 16), cache, torch.arange(8))
    got = native_kv.gather(cache, slots, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, pa.gather_kv(cache, slots, torch.bfloat16))
    with pytest.raises(ValueError, match="outside the cache's 6 blocks"):
        native_kv.gather(cache, torch.tensor([[24, 25]]), torch.float32)
