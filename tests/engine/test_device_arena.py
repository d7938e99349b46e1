"""Tests for engine/lora/device_arena.py: the rows ↔ blocks arithmetic and the shared memory."""

from __future__ import annotations

import itertools

import pytest
import torch

from loramux.engine.memory.arena import DeviceArena, RowLayout, zeroed
from loramux.engine.model.llama import LORA_TARGETS
from tests.engine.factories import ODD_ROWS_CONFIG

# Odd sizes, so no offset or width lines up with a block by accident. Σ in = 184, Σ out = 168.
CONFIG = ODD_ROWS_CONFIG
# (num_blocks, block_size): a row spans several blocks (E = 32 < W = 184), or a block
# holds more than a row (E = 512).
SHAPES = [(40, 4), (9, 64)]


def make_arena(num_blocks: int, block_size: int, dtype=torch.float32) -> DeviceArena:
    return DeviceArena(CONFIG, num_blocks, block_size, dtype, "cpu")


def test_layout_widths_and_offsets():
    layout = RowLayout.for_model(CONFIG, num_blocks=40, block_size=4)
    assert (
        layout.row_width
        == 184
        == max(
            sum(CONFIG.module_shape(m)[0] for m in LORA_TARGETS),
            sum(CONFIG.module_shape(m)[1] for m in LORA_TARGETS),
        )
    )
    assert layout.block_elems == 4 * 1 * 8
    assert layout.total_rows == 40 * 32 // 184 == 6
    for offsets, sizes in (
        (layout.a_offsets, layout.in_features),
        (layout.b_offsets, layout.out_features),
    ):
        spans = sorted((offsets[m], offsets[m] + sizes[m]) for m in LORA_TARGETS)
        assert spans[0][0] == 0 and spans[-1][1] <= layout.row_width
        assert all(end == start for (_, end), (start, _) in itertools.pairwise(spans))  # packed


@pytest.mark.parametrize(("num_blocks", "block_size"), SHAPES)
def test_kv_limit_and_first_row_are_a_galois_pair(num_blocks, block_size):
    layout = RowLayout.for_model(CONFIG, num_blocks, block_size)
    rows, w, e = layout.total_rows, layout.row_width, layout.block_elems
    assert layout.kv_limit_for(rows) == num_blocks  # no adapters: KV has everything
    assert layout.first_row_for(num_blocks) == rows
    for first_row in range(rows + 1):
        limit = layout.kv_limit_for(first_row)
        # The last KV block ends at or before the first adapter element...
        assert first_row == rows or limit * e <= first_row * w
        # ...and is the highest such block.
        assert first_row == rows or (limit + 1) * e > first_row * w
        assert layout.first_row_for(limit) <= first_row  # round trip
        for kv_limit in range(num_blocks + 1):
            assert (limit >= kv_limit) == (first_row >= layout.first_row_for(kv_limit))
    for kv_limit in range(num_blocks + 1):
        assert layout.kv_limit_for(layout.first_row_for(kv_limit)) >= kv_limit
    for bad in (-1, rows + 1):
        with pytest.raises(ValueError):
            layout.kv_limit_for(bad)
    with pytest.raises(ValueError):
        layout.first_row_for(num_blocks + 1)


@pytest.mark.parametrize(("num_blocks", "block_size"), SHAPES)
def test_blocks_of_rows_cover_exactly_their_elements(num_blocks, block_size):
    layout = RowLayout.for_model(CONFIG, num_blocks, block_size)
    w, e = layout.row_width, layout.block_elems
    for row in range(layout.total_rows):
        blocks = layout.blocks_of_rows(row, row + 1)
        touched = {element // e for element in range(row * w, (row + 1) * w)}
        assert set(blocks) == touched
        assert blocks.start >= layout.kv_limit_for(row)


@pytest.mark.parametrize(("num_blocks", "block_size"), SHAPES)
def test_kv_below_the_limit_and_adapter_rows_never_overlap(num_blocks, block_size):
    arena = make_arena(num_blocks, block_size)
    rows = arena.layout.total_rows
    gen = torch.Generator().manual_seed(0)
    for first_row in range(rows + 1):
        limit = arena.layout.kv_limit_for(first_row)
        kv = [
            (
                torch.randn(k[:limit].shape, generator=gen),
                torch.randn(v[:limit].shape, generator=gen),
            )
            for k, v in arena.kv_caches
        ]
        a = {
            (layer, m): torch.randn(rows - first_row, arena.layout.in_features[m], generator=gen)
            for layer in range(CONFIG.num_layers)
            for m in LORA_TARGETS
        }
        b = {
            (layer, m): torch.randn(rows - first_row, arena.layout.out_features[m], generator=gen)
            for layer in range(CONFIG.num_layers)
            for m in LORA_TARGETS
        }
        # KV first, then the rows: a row writing into a KV block would clobber it.
        for (k, v), (k_new, v_new) in zip(arena.kv_caches, kv, strict=True):
            k[:limit], v[:limit] = k_new, v_new
        for (layer, m), value in a.items():
            arena.a_pool(layer, m)[first_row:] = value
        for (layer, m), value in b.items():
            arena.b_pool(layer, m)[first_row:] = value
        for (k, v), (k_new, v_new) in zip(arena.kv_caches, kv, strict=True):
            assert torch.equal(k[:limit], k_new) and torch.equal(v[:limit], v_new)
        # And the other way: rewriting KV leaves every row as written.
        for k, v in arena.kv_caches:
            k[:limit], v[:limit] = 7.0, -7.0
        for (layer, m), value in a.items():
            assert torch.equal(arena.a_pool(layer, m)[first_row:], value)
        for (layer, m), value in b.items():
            assert torch.equal(arena.b_pool(layer, m)[first_row:], value)


def test_module_pools_are_strided_views_of_the_kv_tensors():
    arena = make_arena(40, 4)
    layout = arena.layout
    rows, w = layout.total_rows, layout.row_width
    for layer, (k, v) in enumerate(arena.kv_caches):
        for m in LORA_TARGETS:
            a, b = arena.a_pool(layer, m), arena.b_pool(layer, m)
            assert a.shape == (rows, layout.in_features[m]) and a.stride() == (w, 1)
            assert b.shape == (rows, layout.out_features[m]) and b.stride() == (w, 1)
            a[3, 1] = 123.0
            b[5, 2] = -321.0
            assert k.view(-1)[3 * w + layout.a_offsets[m] + 1] == 123.0
            assert v.view(-1)[5 * w + layout.b_offsets[m] + 2] == -321.0
    # The same (layer, module) always gives the same view object: no per-call work.
    assert arena.a_pool(1, "q_proj") is arena.a_pool(1, "q_proj")


def test_sizes_and_zeroed_start():
    arena = make_arena(40, 4, dtype=torch.bfloat16)
    layers, itemsize = CONFIG.num_layers, 2
    assert arena.bytes_per_row == 2 * layers * 184 * itemsize
    assert arena.bytes_per_block == 2 * layers * 4 * 1 * 8 * itemsize
    total = sum(k.numel() + v.numel() for k, v in arena.kv_caches) * itemsize
    assert total == 40 * arena.bytes_per_block
    assert all(not k.any() and not v.any() for k, v in arena.kv_caches)
    assert arena.kv_caches[0][0].shape == (40, 4, 1, 8)


def test_zero_and_move_rows_cover_every_layer_and_module():
    arena = make_arena(40, 4)
    gen = torch.Generator().manual_seed(1)
    before = {}
    for layer in range(CONFIG.num_layers):
        for m in LORA_TARGETS:
            for pool in (arena.a_pool(layer, m), arena.b_pool(layer, m)):
                pool.copy_(torch.randn(pool.shape, generator=gen))
                before[pool.data_ptr(), pool.shape[1]] = pool.clone()
    arena.move_rows(src=1, dst=2, count=3)  # overlapping: rows 1..3 -> 2..4
    arena.zero_rows(0, 1)
    for layer in range(CONFIG.num_layers):
        for m in LORA_TARGETS:
            for pool in (arena.a_pool(layer, m), arena.b_pool(layer, m)):
                old = before[pool.data_ptr(), pool.shape[1]]
                assert torch.equal(pool[2:5], old[1:4])
                assert not pool[0].any()
                assert torch.equal(pool[1], old[1]) and torch.equal(pool[5], old[5])


# --- the CPU arena's memory ------------------------------------------------------------------


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_arena_memory_is_zero_and_writable(dtype):
    tensor = zeroed((3, 5, 2, 8), dtype, torch.device("cpu"))
    assert tensor.shape == (3, 5, 2, 8) and tensor.dtype == dtype and tensor.is_contiguous()
    assert not tensor.any()
    tensor[1, 2] = 1.5
    assert tensor.sum().item() == 1.5 * 16


def test_a_large_cpu_arena_takes_ram_only_where_written():
    """Zero pages from the kernel: a 1 GiB budget costs nothing until KV or rows are written."""
    before = _resident_bytes()
    tensor = zeroed((1 << 28,), torch.float32, torch.device("cpu"))  # 1 GiB
    assert _resident_bytes() - before < 64 << 20
    assert not tensor[:: 1 << 20].any()  # reading touches no new memory either
    tensor[: 1 << 22] = 1.0  # 16 MiB written
    assert 16 << 20 <= _resident_bytes() - before < 96 << 20
    del tensor
