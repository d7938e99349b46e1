"""Tests for engine/kv_cache.py: block accounting, growth, exhaustion, prefix caching."""

import random

import pytest

from loramux.engine.memory import kv_cache
from loramux.engine.memory.kv_cache import (
    BlockPoolExhausted,
    CachedPrefix,
    KVCacheManager,
    block_hash,
)

SALT = ("adapter-a", "tenant-1")


def snapshot(mgr: KVCacheManager, request_ids, prompts=()):
    """Everything observable through the public API, to compare before/after a failed call."""
    return (
        mgr.num_free_blocks,
        mgr.num_used_blocks,
        {r: mgr.block_table(r) for r in request_ids if mgr.has(r)},
        [mgr.find_cached_prefix(p, SALT) for p in prompts],
        mgr.prefix_cache_queries,
        mgr.prefix_cache_hits,
    )


def run_request(mgr, rid, tokens, salt=SALT):
    """Admit with a prefix lookup, 'compute' everything, commit, and return the prefix used."""
    prefix = mgr.find_cached_prefix(tokens, salt)
    mgr.allocate(rid, len(tokens), prefix)
    mgr.commit(rid, tokens, len(tokens), salt)
    return prefix


# -- hashing --------------------------------------------------------------------------------


def test_block_hash_is_stable_and_sensitive_to_every_input():
    h = block_hash(None, [1, 2, 3, 4], SALT)
    assert h == block_hash(None, (1, 2, 3, 4), SALT)
    assert 0 <= h < 2**64
    # A golden value: cache keys must not silently change between releases or processes.
    assert h == 9753562152356309877
    others = {
        block_hash(h, [1, 2, 3, 4], SALT),
        block_hash(None, [1, 2, 3, 5], SALT),
        block_hash(None, [1, 2, 3, 4], ("adapter-b", "tenant-1")),
        block_hash(None, [1, 2, 3, 4], ("adapter-a", "tenant-2")),
        block_hash(None, [1, 2, 3, 4], ("adapter-", "atenant-1")),
        block_hash(None, [1, 2, 3, 4], None),
    }
    assert h not in others
    assert len(others) == 6


def test_block_hash_same_across_processes():
    # Python's hash() of a str changes with PYTHONHASHSEED; block_hash must not.
    import os
    import subprocess
    import sys

    code = (
        "from loramux.engine.memory.kv_cache import block_hash;"
        "print(block_hash(None, [7, 8, 9], ('adapter-a', 'tenant-1')))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {str(block_hash(None, [7, 8, 9], ("adapter-a", "tenant-1")))}


def test_block_hash_rejects_unstable_salt():
    with pytest.raises(TypeError):
        block_hash(None, [1], object())


# -- accounting -----------------------------------------------------------------------------


def test_allocate_and_free_accounting():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    assert (mgr.num_free_blocks, mgr.num_used_blocks, mgr.usage()) == (10, 0, 0.0)

    mgr.allocate("a", 9)  # 3 blocks
    mgr.allocate("b", 4)  # 1 block
    assert len(mgr.block_table("a")) == 3
    assert len(mgr.block_table("b")) == 1
    assert len(set(mgr.block_table("a")) | set(mgr.block_table("b"))) == 4
    assert (mgr.num_free_blocks, mgr.num_used_blocks) == (6, 4)
    assert mgr.usage() == pytest.approx(0.4)
    assert mgr.has("a") and not mgr.has("c")

    mgr.free("a")
    assert not mgr.has("a")
    assert (mgr.num_free_blocks, mgr.num_used_blocks) == (9, 1)
    mgr.free("a")  # unknown ids are a no-op
    mgr.free("b")
    assert (mgr.num_free_blocks, mgr.num_used_blocks) == (10, 0)
    mgr.check_invariants()


def test_block_table_is_a_copy():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    mgr.allocate("a", 2)
    mgr.block_table("a").append(3)
    assert len(mgr.block_table("a")) == 1


def test_growing_table_block_by_block():
    bs = 4
    mgr = KVCacheManager(num_blocks=8, block_size=bs)
    mgr.allocate("a", 1)
    table = mgr.block_table("a")
    assert len(table) == 1
    for n in range(2, 8 * bs + 1):
        assert mgr.can_allocate("a", n)
        mgr.allocate("a", n)
        new_table = mgr.block_table("a")
        assert len(new_table) == -(-n // bs)
        assert new_table[: len(table)] == table  # existing blocks never move
        table = new_table
    assert len(set(table)) == 8
    assert mgr.num_free_blocks == 0
    # Asking for fewer tokens than already covered is a no-op.
    mgr.allocate("a", 3)
    assert mgr.block_table("a") == table
    mgr.check_invariants()


def test_exhaustion_raises_and_leaves_state_unchanged():
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    run_request(mgr, "a", list(range(8)))  # 2 blocks, then cached
    mgr.free("a")
    mgr.allocate("b", 4)
    before = snapshot(mgr, ["a", "b", "c"], [list(range(9))])

    # Growing an existing request too far.
    assert not mgr.can_allocate("b", 4 * 5)
    with pytest.raises(BlockPoolExhausted):
        mgr.allocate("b", 4 * 5)
    assert snapshot(mgr, ["a", "b", "c"], [list(range(9))]) == before

    # A new request with a cached prefix: it would revive the 2 cached blocks (taking them out
    # of the evictable pool) and need 2 fresh ones, but only 1 block is free otherwise.
    prefix = mgr.find_cached_prefix(list(range(9)) + [99] * 7, SALT)
    assert prefix.num_tokens == 8
    assert not mgr.can_allocate("c", 16, prefix)
    with pytest.raises(BlockPoolExhausted):
        mgr.allocate("c", 16, prefix)
    assert snapshot(mgr, ["a", "b", "c"], [list(range(9))]) == before
    assert not mgr.has("c")
    mgr.check_invariants()

    # One token fewer needs one fewer fresh block, which fits exactly.
    assert mgr.can_allocate("c", 12, prefix)
    mgr.allocate("c", 12, prefix)
    assert mgr.num_free_blocks == 0
    mgr.check_invariants()


def test_can_allocate_counts_unreferenced_prefix_blocks():
    # Without accounting for reviving the prefix blocks, can_allocate would over-promise here.
    mgr = KVCacheManager(num_blocks=3, block_size=2)
    run_request(mgr, "a", [1, 2, 3, 4, 5])  # 3 blocks; the 2 full ones get cached
    mgr.free("a")
    assert mgr.num_free_blocks == 3
    prefix = mgr.find_cached_prefix([1, 2, 3, 4, 9, 9, 9, 9], SALT)
    assert len(prefix.block_ids) == 2
    # 2 revived + 2 fresh = 4 > 3, even though num_free_blocks (3) >= 2 fresh.
    assert not mgr.can_allocate("b", 8, prefix)
    with pytest.raises(BlockPoolExhausted):
        mgr.allocate("b", 8, prefix)
    assert mgr.can_allocate("b", 6, prefix)
    mgr.allocate("b", 6, prefix)
    assert mgr.block_table("b")[:2] == list(prefix.block_ids)
    mgr.check_invariants()


def test_can_allocate_agrees_with_allocate_randomized():
    bs = 4
    total_hits = 0
    for seed in range(30):
        rng = random.Random(seed)
        mgr = KVCacheManager(num_blocks=rng.randint(4, 16), block_size=bs)
        # A few shared system prompts so prefix hits (and revivals) actually happen.
        stems = [[rng.randrange(50) for _ in range(rng.randint(1, 3) * bs)] for _ in range(3)]
        tokens: dict[str, list[int]] = {}
        next_id = 0
        admitted = grown = refused = 0
        for _ in range(300):
            op = rng.random()
            live = list(tokens)
            if op < 0.35 or not live:
                rid = f"r{next_id}"
                next_id += 1
                toks = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
                prefix = mgr.find_cached_prefix(toks, SALT)
                assert prefix.num_tokens % bs == 0
                assert prefix.num_tokens <= len(toks) - 1
                ok = mgr.can_allocate(rid, len(toks), prefix)
                before = snapshot(mgr, live)
                if ok:
                    mgr.allocate(rid, len(toks), prefix)
                    tokens[rid] = toks
                    assert mgr.block_table(rid)[: len(prefix.block_ids)] == list(prefix.block_ids)
                    admitted += 1
                else:
                    with pytest.raises(BlockPoolExhausted):
                        mgr.allocate(rid, len(toks), prefix)
                    assert snapshot(mgr, live) == before
                    assert not mgr.has(rid)
                    refused += 1
            elif op < 0.75:
                rid = rng.choice(live)
                toks = tokens[rid]
                # Whatever is allocated has been computed; commit it, then grow by a step.
                mgr.commit(rid, toks, len(toks), SALT)
                extra = rng.randint(1, bs + 1)
                ok = mgr.can_allocate(rid, len(toks) + extra)
                before = snapshot(mgr, live)
                if ok:
                    mgr.allocate(rid, len(toks) + extra)
                    toks.extend(rng.randrange(50) for _ in range(extra))
                    grown += 1
                else:
                    with pytest.raises(BlockPoolExhausted):
                        mgr.allocate(rid, len(toks) + extra)
                    assert snapshot(mgr, live) == before
                    refused += 1
            else:
                rid = rng.choice(live)
                mgr.free(rid)
                del tokens[rid]
            mgr.check_invariants()
            assert mgr.num_free_blocks + mgr.num_used_blocks == mgr.num_blocks
            for rid, toks in tokens.items():
                assert len(mgr.block_table(rid)) == -(-len(toks) // bs)
        assert admitted and grown and refused, (seed, admitted, grown, refused)
        total_hits += mgr.prefix_cache_hits
    assert total_hits > 0  # the prefix paths (revival, shared refs) were exercised


# -- prefix caching -------------------------------------------------------------------------


def test_prefix_hit_after_commit_and_free():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    toks = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    first = run_request(mgr, "a", toks)
    assert first.num_tokens == 0
    table = mgr.block_table("a")
    mgr.free("a")

    prefix = mgr.find_cached_prefix(toks, SALT)
    assert prefix.block_ids == tuple(table[:2])
    assert prefix.num_tokens == 8
    mgr.allocate("b", len(toks), prefix)
    assert mgr.block_table("b")[:2] == table[:2]
    assert len(mgr.block_table("b")) == 3
    mgr.check_invariants()


def test_commit_is_incremental_as_blocks_fill():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    toks = list(range(12))
    mgr.allocate("a", 5)
    mgr.commit("a", toks[:5], 5, SALT)
    assert mgr.find_cached_prefix(toks, SALT).num_tokens == 4
    mgr.allocate("a", 12)
    mgr.commit("a", toks, 7, SALT)  # block 1 not yet fully computed
    assert mgr.find_cached_prefix(toks, SALT).num_tokens == 4
    mgr.commit("a", toks, 12, SALT)
    # Capped at len - 1 = 11 tokens -> 2 blocks.
    assert mgr.find_cached_prefix(toks, SALT).num_tokens == 8
    assert mgr.find_cached_prefix([*toks, 0], SALT).block_ids == tuple(mgr.block_table("a"))


def test_commit_after_prefix_hit_hashes_only_new_blocks(monkeypatch):
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    toks = list(range(13))  # 3 full blocks + 1
    run_request(mgr, "a", toks)
    calls = []
    real = kv_cache.block_hash
    monkeypatch.setattr(
        kv_cache, "block_hash", lambda p, t, s: calls.append(tuple(t)) or real(p, t, s)
    )
    prefix = mgr.find_cached_prefix(toks, SALT)
    assert prefix.num_tokens == 12
    calls.clear()
    mgr.allocate("b", 17, prefix)
    mgr.commit("b", [*toks, 13, 14, 15, 16], 17, SALT)
    # The prefix's hashes seed b's chain: only block 3 is hashed, and it is registered.
    assert calls == [(12, 13, 14, 15)]
    assert mgr.find_cached_prefix([*toks, 13, 14, 15, 16], SALT).num_tokens == 16


def test_partial_last_block_never_cached():
    bs = 4
    mgr = KVCacheManager(num_blocks=4, block_size=bs)
    # Each request: one full block + a half-full one.
    run_request(mgr, "a", [5, 6, 7, 8, 9, 10])
    run_request(mgr, "b", [15, 16, 17, 18, 19, 20])
    a_table, b_table = mgr.block_table("a"), mgr.block_table("b")
    mgr.commit("a", [5, 6, 7, 8, 9, 10], 6, SALT)  # committing again changes nothing
    mgr.free("a")
    mgr.free("b")
    # A lookup extending a's tokens finds only the full block.
    assert mgr.find_cached_prefix([5, 6, 7, 8, 9, 10, 11, 12, 13], SALT).num_tokens == 4
    # The half-full blocks went back to the truly free list, so they are reused first and both
    # full heads survive. Had they been cached, they would have been evictable, and LRU order
    # (a's blocks freed first) would have evicted a's partial block and then a's head.
    mgr.allocate("fill", 2 * bs)
    assert set(mgr.block_table("fill")) == {a_table[1], b_table[1]}
    assert mgr.find_cached_prefix([5, 6, 7, 8, 9], SALT).num_tokens == 4
    assert mgr.find_cached_prefix([15, 16, 17, 18, 19], SALT).num_tokens == 4
    mgr.check_invariants()


def test_prefix_capped_at_len_minus_one():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    toks = list(range(8))  # exactly 2 full blocks
    run_request(mgr, "a", toks)
    mgr.free("a")
    # Both blocks are cached, but the same 8 tokens may reuse only 1 block: at least one
    # token must be computed to produce logits.
    assert mgr.find_cached_prefix(toks, SALT).num_tokens == 4
    assert mgr.find_cached_prefix([*toks, 8], SALT).num_tokens == 8
    assert mgr.find_cached_prefix(toks[:4], SALT).num_tokens == 0
    assert mgr.find_cached_prefix(toks[:5], SALT).num_tokens == 4
    assert mgr.find_cached_prefix([], SALT).num_tokens == 0


def test_different_salt_misses():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    toks = list(range(9))
    run_request(mgr, "a", toks, salt=("adapter-a", "tenant-1"))
    assert mgr.find_cached_prefix(toks, ("adapter-a", "tenant-1")).num_tokens == 8
    assert mgr.find_cached_prefix(toks, ("adapter-b", "tenant-1")).num_tokens == 0
    assert mgr.find_cached_prefix(toks, ("adapter-a", "tenant-2")).num_tokens == 0
    assert mgr.find_cached_prefix(toks, None).num_tokens == 0
    # And the other salt computes its own blocks.
    run_request(mgr, "b", toks, salt=("adapter-b", "tenant-1"))
    assert not set(mgr.block_table("a")) & set(mgr.block_table("b"))


def test_different_earlier_block_misses_later_block():
    # The hash is chained: the same second block after a different first block is not a hit.
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    run_request(mgr, "a", [1, 2, 3, 4, 5])
    assert mgr.find_cached_prefix([9, 9, 3, 4, 5], SALT).num_tokens == 0
    assert mgr.find_cached_prefix([1, 2, 3, 9, 5], SALT).num_tokens == 2


def test_hash_collision_is_verified(monkeypatch):
    monkeypatch.setattr(kv_cache, "block_hash", lambda parent, tokens, salt: 42)
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    run_request(mgr, "a", [1, 2, 3, 4, 5])
    # Every block hashes to 42, so a lookup finds block "a"[0] for any content; only the
    # token check stops a false hit.
    assert mgr.find_cached_prefix([9, 9, 9, 9, 5], SALT).num_tokens == 0
    # Same tokens, other salt: the stored salt is checked too.
    assert mgr.find_cached_prefix([1, 2, 3, 4, 5], ("other", "tenant")).num_tokens == 0
    # Same tokens in block 1 but a different chain (parent) still misses at block 1.
    run_request(mgr, "b", [7, 7, 7, 7, 1, 2, 3, 4, 0])
    assert mgr.find_cached_prefix([7, 7, 7, 7, 1, 2, 3, 4, 0], SALT).num_tokens == 0
    # The genuine content still hits.
    assert mgr.find_cached_prefix([1, 2, 3, 4, 5], SALT).block_ids == (mgr.block_table("a")[0],)
    mgr.check_invariants()


def test_lru_eviction_order():
    bs = 2
    mgr = KVCacheManager(num_blocks=6, block_size=bs)
    seqs = {
        "x": [1, 1, 2, 2, 0],  # blocks: full, full, partial
        "y": [3, 3, 4, 4, 0],
    }
    for rid, toks in seqs.items():
        run_request(mgr, rid, toks)
    x_table, y_table = mgr.block_table("x"), mgr.block_table("y")
    mgr.free("x")  # frees x tail-first: x1 then x0 become evictable, x2 truly free
    mgr.free("y")  # then y1, y0
    assert mgr.num_free_blocks == 6

    # 2 truly free blocks are used first; nothing is evicted.
    mgr.allocate("f1", 2 * bs)
    assert set(mgr.block_table("f1")) == {x_table[2], y_table[2]}
    assert mgr.find_cached_prefix(seqs["x"], SALT).num_tokens == 4
    assert mgr.find_cached_prefix(seqs["y"], SALT).num_tokens == 4

    # Next: x1 (least recently freed), so x loses its second block but keeps its head.
    mgr.allocate("f2", bs)
    assert mgr.block_table("f2") == [x_table[1]]
    assert mgr.find_cached_prefix(seqs["x"], SALT).num_tokens == 2
    assert mgr.find_cached_prefix(seqs["y"], SALT).num_tokens == 4
    # Then x0, then y1, then y0.
    mgr.allocate("f3", bs)
    assert mgr.block_table("f3") == [x_table[0]]
    assert mgr.find_cached_prefix(seqs["x"], SALT).num_tokens == 0
    mgr.allocate("f4", bs)
    assert mgr.block_table("f4") == [y_table[1]]
    assert mgr.find_cached_prefix(seqs["y"], SALT).num_tokens == 2
    mgr.check_invariants()


def test_prefix_hit_refreshes_lru_position():
    bs = 2
    mgr = KVCacheManager(num_blocks=3, block_size=bs)
    run_request(mgr, "x", [1, 1, 0])
    mgr.free("x")
    run_request(mgr, "y", [2, 2, 0])
    mgr.free("y")
    # x's head was freed first (LRU). Reuse it, free again: now y's head is the LRU one.
    run_request(mgr, "x2", [1, 1, 0])
    mgr.free("x2")
    mgr.allocate("big", 2 * bs)  # one truly free block + one eviction
    assert mgr.find_cached_prefix([1, 1, 0], SALT).num_tokens == 2
    assert mgr.find_cached_prefix([2, 2, 0], SALT).num_tokens == 0


def test_shared_prefix_ref_counting():
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    system = list(range(8))
    run_request(mgr, "a", [*system, 100, 101])
    pb = run_request(mgr, "b", [*system, 200])
    assert pb.num_tokens == 8
    shared = mgr.block_table("a")[:2]
    assert mgr.block_table("b")[:2] == shared
    assert mgr.num_used_blocks == 4  # 2 shared + 1 tail each

    mgr.free("a")
    # Shared blocks still referenced by b: not free, not evictable.
    assert mgr.num_used_blocks == 3
    assert mgr.num_free_blocks == 3
    mgr.allocate("fill", 3 * 4)  # takes every free block; must not evict b's blocks
    assert not set(mgr.block_table("fill")) & set(mgr.block_table("b"))
    assert mgr.num_free_blocks == 0
    with pytest.raises(BlockPoolExhausted):
        mgr.allocate("more", 1)
    assert mgr.find_cached_prefix([*system, 1], SALT).block_ids == tuple(shared)

    mgr.free("b")
    assert mgr.num_free_blocks == 3  # b's 2 shared (now evictable) + its unregistered tail
    mgr.check_invariants()


def test_duplicate_commit_keeps_existing_registration():
    # Two requests compute the same prefix concurrently (neither could hit the other).
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    toks = list(range(9))
    for rid in ("a", "b"):
        mgr.allocate(rid, len(toks), mgr.find_cached_prefix(toks, SALT))
    for rid in ("a", "b"):
        mgr.commit(rid, toks, len(toks), SALT)
    assert mgr.find_cached_prefix(toks, SALT).block_ids == tuple(mgr.block_table("a")[:2])
    mgr.free("a")
    mgr.free("b")
    # Only a's 2 blocks stay cached; b's copies are truly free and get reused first.
    mgr.allocate("fill", 6 * 4)
    assert mgr.find_cached_prefix(toks, SALT).num_tokens == 8
    mgr.check_invariants()


def test_prefix_stats_count_only_admitted_lookups():
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    toks = list(range(10))
    run_request(mgr, "a", toks)
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (10, 0)
    mgr.free("a")

    # A lookup that is not admitted counts nothing. (The blocker takes only the 2 truly free
    # blocks, leaving a's 2 cached blocks in place.)
    mgr.allocate("blocker", 4 * 2)
    prefix = mgr.find_cached_prefix(toks, SALT)
    assert prefix.num_tokens == 8
    assert not mgr.can_allocate("b", len(toks), prefix)
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (10, 0)

    mgr.free("blocker")
    prefix = mgr.find_cached_prefix(toks, SALT)
    mgr.allocate("b", len(toks), prefix)
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (20, 8)
    # Growing the request later does not count again.
    mgr.allocate("b", 16, prefix)
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (20, 8)
    assert mgr.prefix_cache_hit_rate == pytest.approx(8 / 20)


def test_stale_prefix_is_rejected():
    mgr = KVCacheManager(num_blocks=2, block_size=2)
    run_request(mgr, "a", [1, 1, 0])
    mgr.free("a")
    prefix = mgr.find_cached_prefix([1, 1, 0], SALT)
    assert prefix.num_tokens == 2
    mgr.allocate("evictor", 4)  # reclaims the cached block
    mgr.free("evictor")
    with pytest.raises(ValueError, match="stale"):
        mgr.can_allocate("b", 3, prefix)
    with pytest.raises(ValueError, match="stale"):
        mgr.allocate("b", 3, prefix)
    assert not mgr.has("b")


def test_disabled_prefix_caching():
    mgr = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    toks = list(range(9))
    run_request(mgr, "a", toks)
    assert mgr.find_cached_prefix(toks, SALT) == CachedPrefix(num_query_tokens=9)
    mgr.free("a")
    assert mgr.find_cached_prefix(toks, SALT).num_tokens == 0
    assert mgr.num_free_blocks == 4
    run_request(mgr, "b", toks)
    assert mgr.prefix_cache_hits == 0
    mgr.check_invariants()


def test_reset_prefix_cache():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    run_request(mgr, "a", list(range(9)))
    run_request(mgr, "b", list(range(50, 59)))
    mgr.free("a")
    mgr.reset_prefix_cache()
    assert mgr.find_cached_prefix(list(range(9)), SALT).num_tokens == 0
    assert mgr.find_cached_prefix(list(range(50, 59)), SALT).num_tokens == 0
    assert mgr.num_used_blocks == 3
    assert mgr.block_table("b") and mgr.has("b")
    mgr.check_invariants()
    mgr.free("b")
    assert mgr.num_free_blocks == 8
    mgr.check_invariants()


# -- the movable limit (memory shared with the adapter pool) --------------------------------


def test_lowest_free_block_is_allocated_first():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    mgr.allocate("a", 12)
    mgr.allocate("b", 8)
    assert (mgr.block_table("a"), mgr.block_table("b")) == ([0, 1, 2], [3, 4])
    mgr.free("a")
    mgr.allocate("c", 8)
    assert mgr.block_table("c") == [0, 1]  # not the never-used 5, 6
    mgr.allocate("c", 16)
    assert mgr.block_table("c") == [0, 1, 2, 5]
    mgr.check_invariants()


def test_lower_limit_takes_free_blocks_and_accounting_follows():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    mgr.allocate("a", 8)  # blocks 0, 1
    assert mgr.try_lower_limit(5)
    assert (mgr.limit, mgr.num_blocks, mgr.num_free_blocks, mgr.num_used_blocks) == (5, 8, 3, 2)
    assert mgr.usage() == 2 / 5
    assert mgr.can_allocate("b", 12) and not mgr.can_allocate("b", 16)
    with pytest.raises(BlockPoolExhausted, match="3 free"):
        mgr.allocate("b", 16)
    mgr.allocate("b", 12)
    assert max(mgr.block_table("b")) == 4  # nothing at or above the limit is handed out
    assert mgr.try_lower_limit(5)  # no-op
    with pytest.raises(ValueError, match="above the limit"):
        mgr.try_lower_limit(6)
    mgr.check_invariants()


def test_lower_limit_refuses_blocks_in_use_and_changes_nothing():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    mgr.allocate("a", 4 * 6)  # blocks 0..5
    mgr.free("a")
    mgr.allocate("b", 4 * 5)  # blocks 0..4
    before = snapshot(mgr, ["b"])
    assert mgr.lowest_possible_limit() == 5
    assert not mgr.try_lower_limit(4)
    assert snapshot(mgr, ["b"]) == before and mgr.limit == 8
    assert mgr.try_lower_limit(5)
    mgr.check_invariants()


def test_lower_limit_takes_evictable_blocks_out_of_the_prefix_cache():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    toks = list(range(13))  # 3 full blocks + 1 token: blocks 0..3
    run_request(mgr, "a", toks)
    mgr.free("a")
    assert mgr.find_cached_prefix(toks, SALT).num_tokens == 12
    stale = mgr.find_cached_prefix(toks, SALT)
    assert mgr.lowest_possible_limit() == 1  # evictable counts as free
    assert mgr.try_lower_limit(2)  # takes cached blocks 2 (and the free 3..7)
    assert mgr.find_cached_prefix(toks, SALT).num_tokens == 8  # blocks 0, 1 still cached
    with pytest.raises(ValueError, match="stale CachedPrefix"):
        mgr.allocate("b", 13, stale)
    assert mgr.num_free_blocks == 2
    mgr.check_invariants()


def test_min_limit_is_never_crossed():
    mgr = KVCacheManager(num_blocks=8, block_size=4, min_limit=3)
    assert mgr.lowest_possible_limit() == 3
    assert not mgr.try_lower_limit(2)
    assert mgr.limit == 8
    assert mgr.try_lower_limit(3)
    for bad in (0, 9):
        with pytest.raises(ValueError, match="min_limit"):
            KVCacheManager(num_blocks=8, block_size=4, min_limit=bad)


def test_raise_limit_gives_the_blocks_back():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    assert mgr.try_lower_limit(2)
    mgr.allocate("a", 8)
    assert not mgr.can_allocate("b", 4)
    mgr.raise_limit(6)
    assert (mgr.limit, mgr.num_free_blocks) == (6, 4)
    mgr.allocate("b", 16)
    assert mgr.block_table("b") == [2, 3, 4, 5]
    for bad in (5, 9):
        with pytest.raises(ValueError, match="new limit"):
            mgr.raise_limit(bad)
    mgr.raise_limit(8)
    mgr.check_invariants()


def test_limit_moves_keep_invariants_randomized():
    lowered = refused = 0
    for seed in range(20):
        rng = random.Random(seed)
        bs = 2
        mgr = KVCacheManager(num_blocks=12, block_size=bs, min_limit=3)
        stems = [[rng.randrange(20) for _ in range(2 * bs)] for _ in range(2)]
        live: dict[str, list[int]] = {}
        for step in range(200):
            op = rng.random()
            if op < 0.4:
                rid, toks = f"r{step}", [*rng.choice(stems), rng.randrange(20)]
                prefix = mgr.find_cached_prefix(toks, SALT)
                if mgr.can_allocate(rid, len(toks), prefix):
                    mgr.allocate(rid, len(toks), prefix)
                    mgr.commit(rid, toks, len(toks), SALT)
                    live[rid] = toks
            elif op < 0.6 and live:
                mgr.free(rid := rng.choice(sorted(live)))
                del live[rid]
            elif op < 0.8:
                target = rng.randint(0, mgr.limit)
                before = mgr.limit
                possible = mgr.lowest_possible_limit()
                ok = mgr.try_lower_limit(target)
                assert ok == (target >= possible)
                lowered += ok and target < before
                refused += not ok
            else:
                mgr.raise_limit(rng.randint(mgr.limit, mgr.num_blocks))
            mgr.check_invariants()
            assert mgr.num_free_blocks + mgr.num_used_blocks == mgr.limit
            assert all(bid < mgr.limit for rid in live for bid in mgr.block_table(rid))
    assert lowered > 20 and refused > 20, (lowered, refused)


def test_hold_keeps_released_blocks_for_the_pool_until_it_takes_them():
    mgr = KVCacheManager(num_blocks=8, block_size=4, min_limit=2)
    toks = list(range(13))
    run_request(mgr, "cached", toks)  # blocks 0..3, three of them registered
    mgr.allocate("low", 4)  # block 4
    mgr.allocate("high", 12)  # blocks 5, 6, 7
    mgr.free("cached")  # 0..2 evictable, 3 free
    mgr.hold_from(3)  # the pool wants blocks 3..7
    assert (mgr.hold, mgr.num_held_blocks) == (3, 1)  # block 3 was free
    assert (mgr.num_free_blocks, mgr.num_used_blocks) == (3, 4)  # held: neither
    assert not mgr.try_lower_limit(3)  # 4..7 are still in use
    mgr.free("high")
    assert mgr.num_held_blocks == 4 and mgr.num_free_blocks == 3
    # Nothing in the hold is handed out: evictable blocks below it are reclaimed instead.
    mgr.allocate("next", 12)
    assert sorted(mgr.block_table("next")) == [0, 1, 2]
    assert mgr.find_cached_prefix(toks, SALT).num_tokens == 0
    mgr.free("next")
    mgr.free("low")
    assert mgr.num_held_blocks == 5
    mgr.check_invariants()
    assert mgr.try_lower_limit(3)
    assert mgr.hold is None and mgr.num_held_blocks == 0  # the pool has them
    mgr.check_invariants()


def test_hold_takes_cached_blocks_out_of_the_prefix_cache_and_release_gives_all_back():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    toks = list(range(9))  # blocks 0..2, two registered
    run_request(mgr, "a", toks)
    mgr.allocate("b", 4 * 4)  # blocks 3..6
    mgr.free("a")
    mgr.hold_from(1)  # cached block 1 and the free 2 and 7 are held
    assert mgr.find_cached_prefix(toks, SALT).num_tokens == 4  # block 0 still cached
    assert mgr.num_held_blocks == 3
    mgr.hold_from(1)  # the same hold again: nothing changes
    assert mgr.num_held_blocks == 3
    mgr.release_hold()
    assert (mgr.hold, mgr.num_held_blocks, mgr.num_free_blocks) == (None, 0, 4)
    mgr.check_invariants()
    mgr.hold_from(0)  # raised to min_limit (1); at or above the limit it is no hold at all
    assert mgr.hold == 1
    mgr.hold_from(8)
    assert mgr.hold == 1  # unchanged: a hold at the limit asks for nothing
    mgr.raise_limit(8)
    mgr.check_invariants()


def test_raise_limit_under_a_hold_holds_the_returned_blocks():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    assert mgr.try_lower_limit(4)
    mgr.allocate("a", 4 * 4)  # 0..3
    mgr.hold_from(2)  # a larger adapter wants 2..3 too, behind the one above the limit
    mgr.raise_limit(6)  # that one went: 4, 5 come back, into the hold
    assert mgr.num_held_blocks == 2 and mgr.num_free_blocks == 0
    mgr.check_invariants()


def test_blocks_in_use_in_the_hold_move_below_with_their_refs_and_cache_entries():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    mgr.allocate("low", 4 * 3)  # blocks 0..2
    toks = list(range(9))
    run_request(mgr, "shared", toks)  # blocks 3..5, 3 and 4 cached
    prefix = mgr.find_cached_prefix(toks, SALT)
    mgr.allocate("twin", 9, prefix)  # shares 3 and 4, takes 6
    mgr.free("low")
    mgr.hold_from(4)  # wants 4..7: 4 (shared, cached), 5 and 6 are in use, 7 is free
    assert (mgr.num_held_blocks, mgr.num_free_blocks, mgr.hold_shortfall) == (1, 3, 0)
    moves = mgr.move_out_of_hold()
    assert [src for src, _ in moves] == [4, 5, 6]
    assert all(dst < 4 for _, dst in moves)
    where = dict(moves)
    assert mgr.block_table("shared") == [3, where[4], where[5]]
    assert mgr.block_table("twin") == [3, where[4], where[6]]
    # The cached content moved with its block: the prefix is still found, at its new place.
    assert mgr.find_cached_prefix(toks, SALT).block_ids == (3, where[4])
    assert mgr.num_held_blocks == 4 and mgr.hold_shortfall == 0
    mgr.check_invariants()
    assert mgr.try_lower_limit(4)
    mgr.check_invariants()


def test_the_hold_shortfall_counts_what_cannot_move_for_want_of_free_blocks():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    mgr.allocate("a", 4 * 8)  # every block
    mgr.hold_from(5)
    assert mgr.hold_shortfall == 3 and mgr.move_out_of_hold() == []
    mgr.free("a")  # everything below the hold free, everything in it held
    assert mgr.hold_shortfall == 0 and mgr.num_held_blocks == 3
    mgr.check_invariants()


@pytest.mark.parametrize("caching", [True, False])
def test_blocks_out_of_a_sliding_window_are_released_as_the_request_advances(caching):
    """Window 6, blocks of 4: with 20 tokens computed the next token (position 20) sees
    keys 15..20, so blocks 0-2 (keys 0..11) go back; their entries point at block 3's id,
    the request's first live block, and the table keeps its length."""
    mgr = KVCacheManager(num_blocks=12, block_size=4, enable_prefix_caching=caching, window=6)
    mgr.allocate("a", 20)
    tokens = list(range(20))
    mgr.commit("a", tokens, 8, salt=0)  # keys 3.. still needed: nothing released
    assert mgr.num_blocks_of("a") == 5
    first = mgr.block_table("a")
    mgr.commit("a", tokens, 20, salt=0)
    table = mgr.block_table("a")
    assert table == [first[3]] * 4 + first[4:]
    assert mgr.num_blocks_of("a") == 2 and mgr.num_used_blocks == 2
    mgr.check_invariants()
    # Released blocks are the cache's (when caching): another request hits the prefix.
    hit = mgr.find_cached_prefix(tokens, salt=0)
    assert hit.num_tokens == (16 if caching else 0)
    mgr.allocate("a", 24)  # grows at the tail as ever
    assert len(mgr.block_table("a")) == 6 and mgr.num_blocks_of("a") == 3
    mgr.check_invariants()
    mgr.free("a")
    assert mgr.num_used_blocks == 0
    mgr.check_invariants()


def test_released_entries_follow_their_block_out_of_a_hold():
    mgr = KVCacheManager(num_blocks=8, block_size=2, window=3)
    mgr.allocate("a", 8)  # blocks 0-3
    mgr.commit("a", list(range(8)), 8, salt=0)  # keys 6.. needed: blocks 0-2 released
    assert mgr.block_table("a") == [3, 3, 3, 3]
    mgr.hold_from(3)
    moves = mgr.move_out_of_hold()
    assert moves == [(3, 0)] and mgr.block_table("a") == [0, 0, 0, 0]
    mgr.check_invariants()
