"""The compiled-grammar cache is bounded in bytes, for the engine and for each tenant.

The cache alone (values of made-up sizes): the budgets hold whatever arrives, one tenant's
new schemas evict its own first and never more than its share of the others', a grammar
larger than the tenant budget is not kept. Then SmolLM2's compiler: what a grammar's build
kept is measured, many distinct large schemas stay within the budget, and the memory of the
evicted ones goes back to malloc.
"""

from __future__ import annotations

import gc
import random
import weakref

import pytest

from loramux.engine.structured import GrammarCompiler, JsonSchema, Regex
from loramux.engine.structured.grammar_bytes import HeapMeter, lower_bound
from loramux.engine.structured.grammar_cache import GrammarCache


def test_many_distinct_entries_stay_within_both_budgets():
    cache: GrammarCache[str] = GrammarCache(1000, 400)
    rng = random.Random(3)
    for i in range(500):
        tenant = rng.choice(["a", "b", "c", "d", "e", None])
        assert cache.put(tenant, f"schema-{i}", f"compiled-{i}", rng.randint(1, 400))
        stats = cache.stats()
        assert stats.bytes <= 1000
        assert all(nbytes <= 400 for nbytes, _ in cache.tenant_usage().values())
        assert stats.bytes == sum(nbytes for nbytes, _ in cache.tenant_usage().values())
        assert cache.get(tenant, f"schema-{i}") == f"compiled-{i}"  # the newest is kept
    stats = cache.stats()
    assert stats.evictions > 400 and stats.evicted_bytes > 0 and stats.not_kept == 0
    assert stats.entries == len(cache) == sum(n for _, n in cache.tenant_usage().values())


def test_one_tenants_new_schemas_evict_its_own_first():
    cache: GrammarCache[int] = GrammarCache(budget_bytes=4, tenant_budget_bytes=2)
    cache.put("b", "b1", 1, 1)
    cache.put("b", "b2", 2, 1)
    for i in range(20):  # tenant a churns through schemas
        cache.put("a", f"a{i}", i, 1)
    assert cache.get("b", "b1") == 1 and cache.get("b", "b2") == 2
    assert cache.tenant_usage() == {"a": (2, 2), "b": (2, 2)}
    assert cache.get("a", "a19") == 19 and cache.get("a", "a17") is None
    stats = cache.stats()
    assert stats.evictions == stats.tenant_evictions == 18


def test_under_engine_pressure_a_tenant_displaces_no_more_than_its_share():
    cache: GrammarCache[int] = GrammarCache(budget_bytes=6, tenant_budget_bytes=2)
    for tenant in ("b", "c", "d"):
        for i in range(2):
            cache.put(tenant, f"{tenant}{i}", i, 1)
    for i in range(50):
        cache.put("a", f"a{i}", i, 1)
    usage = cache.tenant_usage()
    assert usage["a"] == (2, 2)
    others = sum(nbytes for tenant, (nbytes, _) in usage.items() if tenant != "a")
    assert others == 4  # 6 held before a came; a took its 2, never more


def test_hits_refresh_recency_per_tenant_and_tenants_do_not_share_entries():
    cache: GrammarCache[str] = GrammarCache(budget_bytes=3, tenant_budget_bytes=3)
    for key in ("x", "y", "z"):
        cache.put("a", key, key, 1)
    assert cache.get("b", "x") is None  # the same spec, another tenant: its own entry
    cache.get("a", "x")
    cache.put("a", "w", "w", 1)  # evicts y, the least recently used
    assert cache.get("a", "y") is None and cache.get("a", "x") == "x"


def test_a_grammar_larger_than_the_tenant_budget_is_not_kept():
    cache: GrammarCache[str] = GrammarCache(budget_bytes=100, tenant_budget_bytes=25)
    cache.put("a", "small", "s", 10)
    assert not cache.put("a", "huge", "h", 26)
    assert cache.get("a", "huge") is None and cache.get("a", "small") == "s"
    assert cache.stats().not_kept == 1 and cache.stats().evictions == 0


@pytest.mark.parametrize(("budget", "tenant"), [(0, None), (-1, None), (100, 0), (100, 101)])
def test_budgets_are_checked(budget, tenant):
    with pytest.raises(ValueError):
        GrammarCache(budget, tenant)


def test_without_a_tenant_budget_a_tenant_gets_a_quarter():
    cache: GrammarCache[str] = GrammarCache(1000)
    assert cache.tenant_budget_bytes == 250
    assert cache.stats().budget_bytes == 1000


# --- SmolLM2's compiler ---------------------------------------------------------------------


def _enum_schema(tag: str, values: int) -> JsonSchema:
    """A strict object with one property, one of ``values`` distinct strings."""
    return JsonSchema(
        {
            "type": "object",
            "properties": {"v": {"enum": [f"{tag}-value-{k}" for k in range(values)]}},
            "required": ["v"],
            "additionalProperties": False,
        }
    )


def _compiler(tokenizer, cache_bytes: int, tenant_cache_bytes: int | None = None):
    return GrammarCompiler(
        tokenizer,
        vocab_size=len(tokenizer),
        eos_token_ids=[tokenizer.eos_token_id],
        cache_bytes=cache_bytes,
        tenant_cache_bytes=tenant_cache_bytes,
    )


def test_a_grammars_bytes_are_measured_and_grow_with_it(compiler):
    small = compiler.compile(_enum_schema("measured-small", 100))
    large = compiler.compile(_enum_schema("measured-large", 3000))
    assert small.nbytes >= lower_bound(len(small.key))
    # 3,000 values keep about 1.5 MB (the lexer's states for the whole enum, built eagerly).
    assert large.nbytes > 4 * small.nbytes and large.nbytes > 500_000
    usage = compiler.tenant_usage()[None]
    assert usage[0] == compiler.cache_stats().bytes >= small.nbytes + large.nbytes


def test_many_distinct_large_schemas_stay_within_the_budget(tokenizer):
    budget = 4 << 20
    compiler = _compiler(tokenizer, budget, budget)
    sizes = []
    for i in range(16):  # about 500 kB each: 8 MB in all
        sizes.append(compiler.compile(_enum_schema(f"many-{i}", 1000)).nbytes)
        assert compiler.cache_stats().bytes <= budget
    stats = compiler.cache_stats()
    assert sum(sizes) > 2 * budget and stats.evictions > 0
    assert 0 < stats.entries < 16 and stats.bytes > budget // 2


def test_one_tenants_schemas_cannot_evict_another_tenants(tokenizer):
    compiler = _compiler(tokenizer, 8 << 20, 3 << 20)
    kept = [compiler.compile(_enum_schema(f"b-{i}", 1000), tenant="b") for i in range(2)]
    for i in range(20):
        compiler.compile(_enum_schema(f"a-{i}", 1000), tenant="a")
        assert compiler.tenant_usage()["a"][0] <= 3 << 20
    for i, grammar in enumerate(kept):
        assert compiler.compile(_enum_schema(f"b-{i}", 1000), tenant="b") is grammar
    # The same spec for another tenant is that tenant's own compile.
    assert compiler.compile(_enum_schema("b-0", 1000), tenant="c") is not kept[0]


def test_evicted_grammars_give_their_memory_back(tokenizer):
    """Twenty 500 kB grammars through a 2 MB cache: malloc's bytes in use grow by about the
    budget, not by the twenty (nothing else holds an evicted grammar)."""
    meter = HeapMeter()
    if not meter.measures:
        pytest.skip("needs glibc's malloc statistics")
    budget = 2 << 20
    compiler = _compiler(tokenizer, budget, budget)
    compiler.compile(Regex("warm-up"))
    gc.collect()
    before = meter.in_use()
    evicted = []
    for i in range(20):
        grammar = compiler.compile(_enum_schema(f"returned-{i}", 1000))
        grammar.matcher()  # a request's copy, dropped at once as a finished request's is
        evicted.append(weakref.ref(grammar))
        del grammar
    gc.collect()
    grown = meter.in_use() - before
    assert sum(ref() is None for ref in evicted) >= 15
    assert grown < 2 * budget, f"{grown / 2**20:.1f} MiB still in use"
