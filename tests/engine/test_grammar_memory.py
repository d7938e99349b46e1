"""The engine's compiled grammars: charged to the tenant whose request asked, bounded by
EngineConfig's budgets, shown in the stats and in /metrics, and let go of when they are
evicted and their requests have ended (tiny random model, SmolLM2's tokenizer)."""

from __future__ import annotations

import gc
import weakref

import pytest
from prometheus_client import generate_latest

from loramux.engine import EngineConfig, JsonSchema, SamplingParams
from loramux.engine.structured import GrammarMatcher
from tests.engine.factories import PROMPTS, build_engine


def _enum(tag: str, values: int = 1000) -> JsonSchema:
    return JsonSchema(
        {
            "type": "object",
            "properties": {"v": {"enum": [f"{tag}-{k}" for k in range(values)]}},
            "required": ["v"],
            "additionalProperties": False,
        }
    )


def _run(engine, spec: JsonSchema, tenant: str | None, request_id: str) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, structured=spec)
    engine.add_request(request_id, PROMPTS[0], params, tenant=tenant)
    while engine.has_unfinished_requests():
        engine.step()


@pytest.fixture
def engine(tiny_model_dir):
    # Room for about four 1,000-value enums in all (~0.5 MB each), two per tenant.
    return build_engine(
        tiny_model_dir, grammar_cache_bytes=2_200_000, grammar_cache_tenant_bytes=1_100_000
    )


def test_requests_charge_their_tenants_share_of_the_cache(engine):
    before = engine.stats().grammar_cache
    assert (before.entries, before.bytes) == (0, 0)
    assert (before.budget_bytes, before.tenant_budget_bytes) == (2_200_000, 1_100_000)
    _run(engine, _enum("b0"), "tenant-b", "b0")
    for i in range(8):
        _run(engine, _enum(f"a{i}"), "tenant-a", f"a{i}")
    stats = engine.stats().grammar_cache
    usage = engine.grammars.tenant_usage()
    assert usage["tenant-b"][1] == 1  # a's eight schemas evicted a's own
    assert usage["tenant-a"][0] <= 1_100_000 and stats.bytes <= 2_200_000
    assert stats.bytes == sum(nbytes for nbytes, _ in usage.values())
    assert stats.tenant_evictions > 0 and stats.misses == 9


def test_metrics_show_the_cache_in_bytes(engine):
    _run(engine, _enum("m0"), "tenant-m", "m0")
    _run(engine, _enum("m1"), None, "m1")
    stats = engine.stats().grammar_cache
    registry = engine.metrics.registry
    assert registry.get_sample_value("loramux_grammar_cache_bytes") == stats.bytes > 500_000
    assert registry.get_sample_value("loramux_grammar_cache_entries") == 2
    assert registry.get_sample_value("loramux_grammar_cache_budget_bytes") == 2_200_000
    assert registry.get_sample_value("loramux_grammar_cache_tenant_budget_bytes") == 1_100_000
    usage = engine.grammars.tenant_usage()
    for tenant, label in (("tenant-m", "tenant-m"), (None, "")):
        labels = {"tenant": label}
        value = registry.get_sample_value("loramux_grammar_cache_tenant_bytes", labels)
        assert value == usage[tenant][0]
    hits = registry.get_sample_value("loramux_grammar_cache_lookups_total", {"result": "hit"})
    assert hits is not None
    text = generate_latest(registry).decode()
    assert 'loramux_grammar_cache_evictions_total{budget="tenant"} 0.0' in text


def test_finished_and_evicted_grammars_are_let_go(engine):
    _run(engine, _enum("gone"), "tenant-g", "gone")
    first = weakref.ref(engine.grammars.compile(_enum("gone"), "tenant-g"))
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is GrammarMatcher]
    for i in range(3):  # the tenant's share holds two: the first goes
        _run(engine, _enum(f"next{i}"), "tenant-g", f"next{i}")
    gc.collect()
    assert first() is None


def test_the_tenant_budget_cannot_exceed_the_engines():
    with pytest.raises(ValueError, match="grammar_cache_tenant_bytes"):
        EngineConfig(
            model="unused", grammar_cache_bytes=1 << 20, grammar_cache_tenant_bytes=2 << 20
        )
    with pytest.raises(ValueError, match="grammar_cache_bytes"):
        EngineConfig(model="unused", grammar_cache_bytes=0)
