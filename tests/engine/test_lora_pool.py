"""Tests for engine/lora/pool.py: adapter residency in the memory KV shares (unified paging),
and the engine's wiring of that one budget."""

from __future__ import annotations

import random

import pytest
import torch

from loramux.engine import EngineConfig, SamplingParams
from loramux.engine.lora.adapter import LoRAWeights, ModuleWeights
from loramux.engine.lora.pool import LoRAPool, PoolFull
from loramux.engine.lora.torch_backend import TorchBackend
from loramux.engine.memory.arena import DeviceArena
from loramux.engine.memory.kv_cache import KVCacheManager
from loramux.engine.model.llama import LORA_TARGETS
from tests.engine.factories import ODD_ROWS_CONFIG, build_engine

# Σ in = 184 = W, Σ out = 168; with 4-token blocks of one 8-wide KV head, E = 32, so a row
# spans 5.75 blocks and 92 blocks hold exactly 16 rows: kv_limit_for(r) = floor(5.75 r).
CONFIG = ODD_ROWS_CONFIG
NUM_BLOCKS, BLOCK_SIZE, TOTAL_ROWS = 92, 4, 16


def make_pool(*, max_rows=None, min_limit=1) -> tuple[LoRAPool, KVCacheManager, DeviceArena]:
    arena = DeviceArena(CONFIG, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, min_limit=min_limit)
    pool = LoRAPool(CONFIG, arena, kv, max_rows=max_rows)
    assert arena.layout.total_rows == TOTAL_ROWS
    return pool, kv, arena


def make_weights(
    rank: int,
    seed: int,
    modules=LORA_TARGETS,
    layers=(0, 1),
    module_ranks: dict[str, int] | None = None,
) -> LoRAWeights:
    gen = torch.Generator().manual_seed(seed)
    result = {}
    for m in modules:
        in_f, out_f = CONFIG.module_shape(m)
        r = (module_ranks or {}).get(m, rank)
        result[m] = ModuleWeights(
            rank=r,
            scale=0.25 + seed,
            a={layer: torch.randn(r, in_f, generator=gen) for layer in layers},
            b={layer: torch.randn(out_f, r, generator=gen) for layer in layers},
        )
    return LoRAWeights(name=f"w{seed}", modules=result)


def assert_holds(pool: LoRAPool, adapter_id: int, weights: LoRAWeights) -> None:
    """The module views give exactly the adapter's A and B^T, and zeros where it has none."""
    resident = pool.resident(adapter_id)
    start, end = resident.row_start, resident.row_end
    assert end - start == weights.rank
    for layer in range(CONFIG.num_layers):
        for m in LORA_TARGETS:
            a, b = pool.a_pool(layer, m)[start:end], pool.b_pool(layer, m)[start:end]
            mw = weights.modules.get(m)
            if mw is None or layer not in mw.a:
                assert not a.any() and not b.any(), (adapter_id, layer, m)
                continue
            assert torch.equal(a[: mw.rank], mw.a[layer]), (adapter_id, layer, m)
            assert torch.equal(b[: mw.rank], mw.b[layer].T), (adapter_id, layer, m)


def check(pool: LoRAPool, kv: KVCacheManager, loaded: dict[int, LoRAWeights]) -> None:
    pool.check_invariants()
    kv.check_invariants()
    assert sorted(pool.resident_ids()) == sorted(loaded)
    for adapter_id, weights in loaded.items():
        assert_holds(pool, adapter_id, weights)


def use_kv(kv: KVCacheManager, request_id: str, blocks: int) -> list[int]:
    kv.allocate(request_id, blocks * BLOCK_SIZE)
    return kv.block_table(request_id)


def limit_for(first_row: int) -> int:
    return first_row * 184 // 32


# -- placement and growth -------------------------------------------------------------------


def test_load_grows_the_region_into_free_kv_blocks_from_the_top():
    pool, kv, _ = make_pool()
    assert (kv.limit, pool.region_rows, pool.rows_used) == (NUM_BLOCKS, 0, 0)
    loaded = {1: make_weights(4, seed=1)}
    resident = pool.load(1, loaded[1])
    assert (resident.row_start, resident.num_rows) == (12, 4)
    assert kv.limit == limit_for(12) == 69 and kv.num_free_blocks == 69
    loaded[2] = make_weights(3, seed=2)
    assert pool.load(2, loaded[2]).row_start == 9  # packed right below
    assert kv.limit == limit_for(9) == 51
    assert pool.rows_used == pool.num_rows_used == pool.region_rows == 7
    assert pool.bytes_used == 7 * 2 * 2 * 184 * 4
    assert use_kv(kv, "r", 51) == list(range(51))  # KV still has every block below the limit
    check(pool, kv, loaded)
    with pytest.raises(ValueError, match="already resident"):
        pool.load(1, loaded[1])


def test_load_waits_while_kv_blocks_are_in_use_then_fits_once_they_are_freed():
    pool, kv, _ = make_pool()
    use_kv(kv, "small", 60)  # blocks 0..59, lowest first
    assert pool.try_load(1, make_weights(4, seed=1)) is not None  # needs blocks >= 69 only
    pool.pin(1)  # in use: it may not make way
    big = make_weights(5, seed=2)  # rows 7..11 need blocks >= 40: 40..59 are in use
    assert pool.try_load(2, big) is None
    assert (kv.limit, pool.resident_ids(), pool.evictions) == (69, [1], 0)
    with pytest.raises(PoolFull, match=r"adapter 2 needs 5 rows \(14720 bytes\)"):
        pool.load(2, big)
    kv.free("small")
    assert pool.try_load(2, big).row_start == 7
    assert kv.limit == limit_for(7)
    check(pool, kv, {1: make_weights(4, seed=1), 2: big})


def test_an_adapter_larger_than_the_memory_evicts_nobody():
    pool, kv, _ = make_pool(min_limit=40)  # KV's floor leaves rows 7..15 (ceil(40/5.75) = 7)
    assert pool.capacity == 9
    pool.load(1, make_weights(4, seed=1))
    assert pool.try_load(2, make_weights(10, seed=2)) is None
    assert (pool.resident_ids(), pool.evictions) == ([1], 0)
    # Within the floor, the idle adapter makes way.
    assert pool.try_load(3, make_weights(9, seed=3)).row_start == 7
    assert (pool.resident_ids(), pool.evictions, kv.limit) == ([3], 1, 40)


# -- eviction -------------------------------------------------------------------------------


def test_eviction_is_least_recently_used_first_and_larger_first_among_equals():
    pool, kv, _ = make_pool(max_rows=12)
    evicted = []
    pool.on_evict = evicted.append
    loaded = {1: make_weights(4, seed=1), 2: make_weights(8, seed=2)}
    for adapter_id, weights in loaded.items():
        pool.load(adapter_id, weights)  # same step: equally recent
    loaded[3] = make_weights(4, seed=3)
    pool.load(3, loaded[3])  # the cap is reached: the larger of the two goes
    assert evicted == [2]
    del loaded[2]
    check(pool, kv, loaded)

    pool.step_table([(0, 2, 1)])  # adapter 1 used in a later step than 3
    loaded[4] = make_weights(8, seed=4)
    pool.load(4, loaded[4])
    assert evicted == [2, 3] and pool.evictions == 2
    del loaded[3]
    check(pool, kv, loaded)


def test_pinned_adapters_are_never_evicted_or_moved():
    pool, kv, _ = make_pool(max_rows=12)
    loaded = {i: make_weights(4, seed=i) for i in (1, 2, 3)}
    for adapter_id, weights in loaded.items():
        pool.load(adapter_id, weights)
    pool.pin(1)
    pool.pin(3)
    pool.pin(3)
    pool.unload(2)  # a hole between the two pinned adapters
    del loaded[2]
    starts = {a: pool.resident(a).row_start for a in (1, 3)}
    with pytest.raises(PoolFull):
        pool.load(4, make_weights(8, seed=4))  # only the hole: nothing may be evicted or moved
    assert {a: pool.resident(a).row_start for a in (1, 3)} == starts and pool.evictions == 0
    with pytest.raises(ValueError, match="pinned"):
        pool.unload(3)

    loaded[5] = make_weights(4, seed=5)
    pool.load(5, loaded[5])  # fills the hole
    pool.unpin(3)
    assert pool.is_pinned(3)  # pinned twice
    pool.unpin(3)
    assert not pool.is_pinned(3)
    with pytest.raises(ValueError, match="not pinned"):
        pool.unpin(3)
    loaded[6] = make_weights(8, seed=6)
    pool.load(6, loaded[6])  # evicts the idle 3 and 5; 1 stays put
    assert sorted(pool.resident_ids()) == [1, 6] and pool.resident(1).row_start == starts[1]
    del loaded[3], loaded[5]
    check(pool, kv, loaded)
    with pytest.raises(KeyError):
        pool.pin(99)


# -- compaction -----------------------------------------------------------------------------


def test_compaction_slides_idle_adapters_up_instead_of_evicting():
    pool, kv, _ = make_pool()
    loaded = {1: make_weights(4, seed=1), 2: make_weights(2, seed=2), 3: make_weights(4, seed=3)}
    for adapter_id, weights in loaded.items():
        pool.load(adapter_id, weights)
    assert [pool.resident(a).row_start for a in (1, 2, 3)] == [12, 10, 6]
    pool.unload(2)  # a 2-row hole at 10..11; the region still starts at 6
    del loaded[2]
    assert kv.limit == limit_for(6) == 34
    use_kv(kv, "r", 23)  # blocks 0..22 in use: the region may reach row 4 (23 / 5.75), no lower

    loaded[4] = make_weights(4, seed=4)
    pool.load(4, loaded[4])  # the hole is too small and the region cannot grow by 4
    assert pool.evictions == 0
    assert pool.resident(3).row_start == 8  # moved up into the hole
    assert pool.resident(4).row_start == 4
    assert kv.limit == limit_for(4) == 23
    check(pool, kv, loaded)


def test_moved_adapters_compute_the_same_lora_deltas():
    pool, kv, _ = make_pool()
    loaded = {
        1: make_weights(4, seed=1),
        2: make_weights(2, seed=2),
        3: make_weights(5, seed=3, modules=("q_proj", "down_proj"), module_ranks={"q_proj": 2}),
    }
    for adapter_id, weights in loaded.items():
        pool.load(adapter_id, weights)
    assert pool.resident(3).row_start == 5
    pool.unload(2)  # a 2-row hole at 10..11
    del loaded[2]
    use_kv(kv, "r", limit_for(3))  # the region may grow to row 3: 2 rows, plus the hole
    loaded[4] = make_weights(4, seed=4, layers=(1,))
    pool.load(4, loaded[4])
    assert pool.resident(3).row_start == 7 and pool.evictions == 0  # 3 moved up
    assert pool.resident(4).row_start == 3
    check(pool, kv, loaded)

    gen = torch.Generator().manual_seed(9)
    spans = [(0, 3, 4), (3, 5, None), (5, 9, 3), (9, 12, 1)]
    backend = TorchBackend(torch.device("cpu"))
    for single in (False, True):  # several adapters (short and long segments) and one
        step_spans = spans[2:3] if single else spans
        num_tokens = step_spans[-1][1]
        table = pool.step_table(
            [(s - step_spans[0][0], e - step_spans[0][0], a) for s, e, a in step_spans]
        )
        step = backend.lora_step(table, pool)
        for layer in range(CONFIG.num_layers):
            for m in LORA_TARGETS:
                in_f, out_f = CONFIG.module_shape(m)
                x = torch.randn(num_tokens - step_spans[0][0], in_f, generator=gen)
                got = torch.zeros(x.shape[0], out_f)
                step.add(x, [got], layer, (m,))
                expected = torch.zeros_like(got)
                for s, e, a in step_spans:
                    s, e = s - step_spans[0][0], e - step_spans[0][0]
                    mw = None if a is None else loaded[a].modules.get(m)
                    if mw is not None and layer in mw.a:
                        expected[s:e] = mw.scale * (x[s:e] @ mw.a[layer].T @ mw.b[layer].T)
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# -- giving memory back ---------------------------------------------------------------------


def test_unload_gives_the_rows_below_the_lowest_adapter_back_to_kv():
    pool, kv, _ = make_pool()
    pool.load(1, make_weights(4, seed=1))
    pool.load(2, make_weights(4, seed=2))
    pool.load(3, make_weights(2, seed=3))
    assert kv.limit == limit_for(6)
    pool.unload(2)  # a hole: 3 still holds the bottom
    assert kv.limit == limit_for(6)
    pool.unload(3)
    assert kv.limit == limit_for(12) and pool.region_rows == 4
    pool.unload(1)
    assert kv.limit == NUM_BLOCKS and pool.region_rows == 0
    assert use_kv(kv, "all", NUM_BLOCKS) == list(range(NUM_BLOCKS))
    check(pool, kv, {})


def test_release_for_kv_evicts_idle_adapters_lru_until_kv_has_the_blocks():
    pool, kv, _ = make_pool()
    evicted = []
    pool.on_evict = evicted.append
    loaded = {i: make_weights(4, seed=i) for i in (1, 2, 3)}  # rows 12.., 8.., 4..
    for adapter_id, weights in loaded.items():
        pool.load(adapter_id, weights)
    pool.step_table([(0, 1, 1)])
    pool.step_table([(0, 1, 3)])  # 2 is the least recently used
    use_kv(kv, "r", kv.limit)
    assert pool.release_for_kv(0) == 0
    gained = pool.release_for_kv(10)
    assert evicted == [2]  # then 3 slides up into its rows
    assert gained == limit_for(8) - limit_for(4) == 23 and kv.limit == 46
    del loaded[2]
    check(pool, kv, loaded)
    assert use_kv(kv, "more", 23)[-1] == 45


def test_release_for_kv_evicts_nobody_when_a_pinned_adapter_is_in_the_way():
    pool, kv, _ = make_pool()
    loaded = {i: make_weights(4, seed=i) for i in (1, 2, 3)}
    for adapter_id, weights in loaded.items():
        pool.load(adapter_id, weights)
    pool.pin(3)  # the lowest
    assert pool.release_for_kv(5) == 0
    assert pool.evictions == 0
    pool.unload(2)
    assert pool.release_for_kv(5) == 0  # 3 cannot move up into the hole either
    pool.unpin(3)
    assert pool.release_for_kv(5) == limit_for(8) - limit_for(4)  # compaction alone
    assert pool.evictions == 0
    del loaded[2]
    check(pool, kv, loaded)


def test_max_rows_caps_the_region():
    pool, kv, arena = make_pool(max_rows=6)
    assert pool.capacity == 6
    pool.load(1, make_weights(4, seed=1))
    assert pool.try_load(2, make_weights(7, seed=2)) is None  # above the cap: nobody evicted
    assert (pool.resident_ids(), pool.evictions) == ([1], 0)
    pool.load(3, make_weights(2, seed=3))
    assert pool.region_rows == 6 and kv.limit == limit_for(10)
    pool.load(4, make_weights(2, seed=4))  # evicts 1, the larger of the equally recent
    assert sorted(pool.resident_ids()) == [3, 4] and pool.region_rows <= 6
    check(pool, kv, {3: make_weights(2, seed=3), 4: make_weights(2, seed=4)})
    with pytest.raises(ValueError):
        LoRAPool(CONFIG, arena, kv, max_rows=-1)


# -- everything at once ---------------------------------------------------------------------


def test_random_operations_keep_kv_and_adapters_apart():
    outcomes = {"loaded": 0, "refused": 0, "released": 0, "evicted": 0}
    for seed in range(6):
        rng = random.Random(seed)
        pool, kv, arena = make_pool(max_rows=rng.choice([None, 9, 12]), min_limit=10)
        loaded: dict[int, LoRAWeights] = {}
        requests: dict[str, int] = {}
        next_id = 0
        for _ in range(120):
            op = rng.random()
            if op < 0.3:
                next_id += 1
                weights = make_weights(rng.randint(1, 5), seed=next_id)
                if pool.try_load(next_id, weights) is None:
                    outcomes["refused"] += 1
                else:
                    loaded[next_id] = weights
                    outcomes["loaded"] += 1
            elif op < 0.4 and loaded:
                adapter_id = rng.choice(sorted(loaded))
                if pool.is_pinned(adapter_id):
                    pool.unpin(adapter_id)
                else:
                    pool.pin(adapter_id)
            elif op < 0.5 and loaded:
                idle = [a for a in loaded if not pool.is_pinned(a)]
                if idle:
                    pool.unload(adapter_id := rng.choice(sorted(idle)))
                    del loaded[adapter_id]
            elif op < 0.6 and loaded:
                pool.step_table([(0, 1, rng.choice(sorted(loaded)))])
            elif op < 0.7:
                outcomes["released"] += pool.release_for_kv(rng.randint(1, 30)) > 0
            elif op < 0.85:
                rid, blocks = f"r{rng.random()}", rng.randint(1, 12)
                if kv.can_allocate(rid, blocks * BLOCK_SIZE):
                    for block in use_kv(kv, rid, blocks):
                        assert block < kv.limit
                        for k, v in arena.kv_caches:  # KV data that would poison any row
                            k[block], v[block] = float("nan"), float("inf")
                    requests[rid] = blocks
            elif requests:
                kv.free(rid := rng.choice(sorted(requests)))
                del requests[rid]
            for adapter_id in [a for a in loaded if not pool.is_resident(a)]:
                del loaded[adapter_id]  # evicted
            check(pool, kv, loaded)
        outcomes["evicted"] += pool.evictions
    assert all(outcomes.values()), outcomes  # every path was taken


# -- the engine's wiring --------------------------------------------------------------------


def test_engine_shares_one_budget_between_kv_and_adapters(tiny_model_dir, make_adapter):
    engine = build_engine(tiny_model_dir, kv_cache_bytes=16 << 20)
    kv, layout = engine.kv, engine.arena.layout
    assert kv.limit == kv.num_blocks == (16 << 20) // engine.arena.bytes_per_block
    assert engine.executor.kv_caches is engine.arena.kv_caches
    prompt = [1, 2, 3, 4, 5]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_adapter("a", make_adapter(tiny_model_dir, rank=8, seed=3))
    assert kv.limit == kv.num_blocks  # in host RAM until a request needs it
    [adapted] = engine.generate([prompt], params, adapters=["a"])
    assert kv.limit == layout.kv_limit_for(layout.total_rows - 8)
    assert engine.lora_pool.bytes_used == 8 * engine.arena.bytes_per_row
    engine.remove_adapter("a")
    assert kv.limit == kv.num_blocks
    engine.add_adapter("b", make_adapter(tiny_model_dir, rank=8, seed=3))  # same weights
    assert engine.generate([prompt], params, adapters=["b"])[0].token_ids == adapted.token_ids


def test_engine_floor_leaves_room_for_one_adapter_of_the_maximum_rank(tiny_model_dir):
    # The tiny model's row is one 16-token block: 8 blocks are 8 rows, half kept for adapters.
    engine = build_engine(tiny_model_dir, kv_cache_bytes=8 * 8192)
    assert (engine.kv.num_blocks, engine.kv.min_limit, engine.max_model_len) == (8, 4, 64)
    # A large budget: the model's context, and room for a rank-64 adapter besides.
    engine = build_engine(tiny_model_dir, kv_cache_bytes=16 << 20)
    assert engine.max_model_len == 512 and engine.kv.min_limit == 32
    assert engine.lora_pool.capacity == engine.arena.layout.total_rows - 32


def test_engine_caps_adapter_bytes(tiny_model_dir, make_adapter):
    row = 2 * 2 * 512 * 4  # k and v, 2 layers, W = 512, fp32
    engine = build_engine(tiny_model_dir, adapter_device_bytes=4 * row + row // 2)
    assert engine.lora_pool.capacity == 4
    with pytest.raises(PoolFull, match="needs 8 rows"):
        engine.add_adapter("big", make_adapter(tiny_model_dir, rank=8, seed=4))
    assert engine.list_adapters() == []
    engine.add_adapter("small", make_adapter(tiny_model_dir, rank=4, seed=5))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    assert engine.generate([[1, 2, 3]], params, adapters=["small"])[0].finish_reason == "length"
    assert engine.lora_pool.rows_used == 4
    with pytest.raises(ValueError, match="holds no adapter row"):
        build_engine(tiny_model_dir, adapter_device_bytes=row - 1)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"adapter_device_bytes": 0}, "adapter_device_bytes must be positive or None"),
        ({"adapter_device_bytes": 2 << 20, "kv_cache_bytes": 1 << 20}, "cannot exceed"),
    ],
)
def test_engine_config_checks_adapter_device_bytes(overrides, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="unused", **overrides)
