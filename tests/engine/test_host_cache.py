"""Tests for engine/lora/host_cache.py: the host-RAM tier's LRU order, byte bound and pins."""

from __future__ import annotations

import pytest
import torch

from loramux.engine.lora.adapter import LoRAWeights, load_adapter
from loramux.engine.lora.host_cache import HostAdapterCache, HostCacheFull, weights_nbytes
from loramux.engine.model.config import ModelConfig

TARGETS = ("q_proj", "v_proj", "down_proj")


@pytest.fixture(scope="module")
def model_config(tiny_model_dir) -> ModelConfig:
    return ModelConfig.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def weights(tiny_model_dir, make_adapter, model_config) -> dict[int, LoRAWeights]:
    """Real adapters of the tiny model loaded with load_adapter, by rank."""
    return {
        rank: load_adapter(
            make_adapter(tiny_model_dir, rank=rank, targets=TARGETS, seed=rank),
            model_config,
            name=f"r{rank}",
        )
        for rank in (4, 8, 16, 32)
    }


@pytest.fixture(scope="module")
def size(weights) -> dict[int, int]:
    return {rank: weights_nbytes(w) for rank, w in weights.items()}


def snapshot(cache: HostAdapterCache):
    return cache.ids(), cache.bytes_used, cache.evictions, len(cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_nbytes_counts_every_a_and_b_tensor(
    tiny_model_dir, make_adapter, model_config, dtype
):
    rank = 8
    folder = make_adapter(tiny_model_dir, rank=rank, targets=TARGETS, seed=rank)
    loaded = load_adapter(folder, model_config, dtype=dtype)
    elements = 0
    for module in TARGETS:
        in_features, out_features = model_config.module_shape(module)
        elements += model_config.num_layers * rank * (in_features + out_features)
    assert weights_nbytes(loaded) == elements * dtype.itemsize


def test_sizes_grow_with_rank(size):
    assert size[4] < size[8] < size[16] < size[32]
    assert size[8] == 2 * size[4] and size[32] == 8 * size[4]


def test_lru_order_get_marks_most_recent(weights, size):
    cache = HostAdapterCache(max_bytes=1 << 30)
    for adapter_id, rank in ((1, 4), (2, 8), (3, 16)):
        assert cache.put(adapter_id, weights[rank]) == []
    assert cache.ids() == [1, 2, 3] and len(cache) == 3
    assert cache.bytes_used == size[4] + size[8] + size[16]
    assert cache.get(1) is weights[4]
    assert cache.ids() == [2, 3, 1]
    assert 2 in cache and 3 in cache and 7 not in cache
    assert cache.ids() == [2, 3, 1]  # `in` does not count as a use
    assert cache.get(7) is None


def test_put_evicts_least_recent_until_it_fits(weights, size):
    cache = HostAdapterCache(max_bytes=size[8] + size[16])
    assert cache.put(1, weights[8]) == [] and cache.put(2, weights[16]) == []
    cache.get(1)
    assert cache.put(3, weights[8]) == [2]  # 2 is least recent
    assert cache.ids() == [1, 3] and cache.evictions == 1
    assert cache.put(4, weights[16]) == [1]
    assert cache.ids() == [3, 4] and cache.bytes_used == size[8] + size[16]
    assert cache.bytes_used <= cache.max_bytes and cache.evictions == 2


def test_put_evicts_several_in_lru_order(weights, size):
    cache = HostAdapterCache(max_bytes=4 * size[4])
    for adapter_id in (1, 2, 3, 4):
        cache.put(adapter_id, weights[4])
    cache.get(1)
    assert cache.put(5, weights[8]) == [2, 3]
    assert cache.ids() == [4, 1, 5] and cache.evictions == 2
    assert cache.bytes_used == 2 * size[4] + size[8]


def test_pinned_entries_are_never_evicted(weights, size):
    cache = HostAdapterCache(max_bytes=2 * size[8])
    cache.put(1, weights[8])
    cache.put(2, weights[8])
    cache.pin(1)
    cache.pin(1)
    assert cache.put(3, weights[8]) == [2]  # 1 is least recent but pinned
    cache.unpin(1)
    assert cache.is_pinned(1)  # pins are counted
    assert cache.put(4, weights[8]) == [3]
    cache.unpin(1)
    assert not cache.is_pinned(1)
    assert cache.put(5, weights[8]) == [1]


def test_put_raises_host_cache_full_and_changes_nothing(weights, size):
    cache = HostAdapterCache(max_bytes=2 * size[8])
    cache.put(1, weights[8])
    cache.put(2, weights[8])
    cache.pin(1)
    cache.pin(2)
    before = snapshot(cache)
    with pytest.raises(HostCacheFull, match=str(size[4])):
        cache.put(3, weights[4])
    assert snapshot(cache) == before and 3 not in cache
    cache.unpin(2)
    before = snapshot(cache)
    # Evicting 2 alone would not make room for rank 16 while 1 stays pinned: 2 must survive.
    with pytest.raises(HostCacheFull, match="pinned"):
        cache.put(3, weights[16])
    assert snapshot(cache) == before and 2 in cache


def test_an_adapter_larger_than_the_whole_budget_is_a_value_error(weights, size):
    cache = HostAdapterCache(max_bytes=size[32] - 1)
    cache.put(1, weights[16])
    with pytest.raises(ValueError, match="r32") as info:
        cache.put(2, weights[32])
    assert str(size[32]) in str(info.value) and str(size[32] - 1) in str(info.value)
    assert cache.ids() == [1] and cache.evictions == 0


def test_put_replaces_an_entry_in_place(weights, size):
    cache = HostAdapterCache(max_bytes=size[16] + size[4])
    cache.put(1, weights[4])
    cache.put(2, weights[16])
    cache.pin(1)
    assert cache.put(1, weights[8]) == [2]  # the bigger replacement needs 2's room
    assert cache.get(1) is weights[8] and cache.ids() == [1]
    assert cache.bytes_used == size[8] and cache.is_pinned(1)  # pins survive a replace
    cache.unpin(1)
    assert cache.put(1, weights[16]) == []  # never evicts itself to make room for itself
    assert cache.bytes_used == size[16] and len(cache) == 1


def test_remove(weights, size):
    cache = HostAdapterCache(max_bytes=1 << 30)
    cache.put(1, weights[4])
    cache.put(2, weights[8])
    assert cache.remove(1) is True and cache.remove(1) is False
    assert cache.ids() == [2] and cache.bytes_used == size[8] and cache.evictions == 0
    cache.pin(2)
    with pytest.raises(ValueError, match="pinned"):
        cache.remove(2)
    cache.unpin(2)
    assert cache.remove(2) is True and cache.bytes_used == 0 and len(cache) == 0


def test_pin_and_unpin_misuse(weights):
    cache = HostAdapterCache(max_bytes=1 << 30)
    with pytest.raises(KeyError):
        cache.pin(1)
    cache.put(1, weights[4])
    with pytest.raises(ValueError, match="not pinned"):
        cache.unpin(1)
    with pytest.raises(ValueError, match="positive"):
        HostAdapterCache(max_bytes=0)
