"""Several engines' snapshots as one: each tenant's tokens and requests summed, its share
recomputed over the fleet's window tokens (not averaged over the engines' shares)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loramux.engine import (
    EngineStats,
    GrammarCacheStats,
    LatencySummary,
    SpeculationStats,
    TenantShareStats,
    TierStats,
)
from loramux.engine.tenant_share import with_shares
from loramux.platform.engine_fleet.merge import merge_pin_states, merge_stats

NO_LATENCY = LatencySummary(samples=0, p50=None, p90=None, p99=None)
NO_TIER = TierStats(adapters=(), bytes=0, capacity_bytes=100)


def _engine(**tenants: tuple[int, int, int, int, float]) -> EngineStats:
    """An engine whose tenants have (window prompt, window output, queued, running, weight);
    since the start each was served ten times its window."""
    return EngineStats(
        running_requests=sum(t[3] for t in tenants.values()),
        waiting_requests=sum(t[2] for t in tenants.values()),
        kv_blocks_used=0,
        kv_blocks_usable=8,
        kv_blocks_total=8,
        kv_block_size=16,
        device=NO_TIER,
        host=NO_TIER,
        adapter_residency={},
        ttft=NO_LATENCY,
        itl=NO_LATENCY,
        window_s=300.0,
        tenant_priorities={name: 0 for name in tenants},
        tenant_weights={name: t[4] for name, t in tenants.items()},
        tenants=with_shares(
            {
                name: TenantShareStats(
                    served_prompt_tokens=10 * prompt,
                    served_output_tokens=10 * output,
                    window_prompt_tokens=prompt,
                    window_output_tokens=output,
                    queued_requests=queued,
                    running_requests=running,
                    weight=weight,
                )
                for name, (prompt, output, queued, running, weight) in tenants.items()
            }
        ),
    )


def test_tenants_tokens_and_queues_add_up_and_shares_are_the_fleets():
    # Engine a mostly serves light, engine b only heavy: each alone is lopsided.
    a = _engine(light=(60, 30, 4, 2, 1.0), heavy=(0, 0, 1, 0, 3.0))
    b = _engine(heavy=(180, 90, 3, 6, 3.0), light=(0, 0, 0, 0, 1.0))
    assert a.tenants["light"].share == 1.0 and b.tenants["heavy"].share == 1.0

    merged = merge_stats([a, b]).tenants
    light, heavy = merged["light"], merged["heavy"]
    assert (light.served_prompt_tokens, light.served_output_tokens) == (600, 300)
    assert (heavy.window_prompt_tokens, heavy.window_output_tokens) == (180, 90)
    assert (light.queued_requests, light.running_requests) == (4, 2)
    assert (heavy.queued_requests, heavy.running_requests) == (4, 6)
    assert light.share == pytest.approx(0.25) and heavy.share == pytest.approx(0.75)
    assert (light.weight_share, heavy.weight_share) == (0.25, 0.75)


def test_a_tenant_one_engine_never_saw_is_kept():
    merged = merge_stats([_engine(solo=(10, 5, 1, 1, 2.0)), _engine()]).tenants
    assert set(merged) == {"solo"}
    assert merged["solo"].share == 1.0 and merged["solo"].weight == 2.0


def test_speculation_totals_add_up_per_adapter():
    """Each adapter's proposals, acceptances and steps summed over the engines, so its
    acceptance rate and tokens per step are the fleet's (not an average of rates)."""
    a = replace(
        _engine(),
        speculative_method="ngram",
        num_speculative_tokens=4,
        speculation={
            "": SpeculationStats(40, 30, 10, 12, 42),
            "x": SpeculationStats(8, 0, 2, 9, 9),
        },
    )
    b = replace(
        _engine(),
        speculative_method="ngram",
        num_speculative_tokens=4,
        speculation={"x": SpeculationStats(12, 10, 3, 4, 14)},
    )
    merged = merge_stats([a, b])
    assert (merged.speculative_method, merged.num_speculative_tokens) == ("ngram", 4)
    assert merged.speculation[""] == SpeculationStats(40, 30, 10, 12, 42)
    assert merged.speculation["x"] == SpeculationStats(20, 10, 5, 13, 23)
    assert merged.speculation["x"].acceptance_rate == 0.5
    assert merged.speculation["x"].tokens_per_step == pytest.approx(23 / 13)


def test_engines_that_speculate_differently_are_mixed():
    ngram = replace(_engine(), speculative_method="ngram", num_speculative_tokens=4)
    off = _engine()  # an engine without speculation (or from before it)
    merged = merge_stats([ngram, off])
    assert (merged.speculative_method, merged.num_speculative_tokens) == ("mixed", 4)
    assert merge_stats([off, off]).speculative_method == "off"


def test_grammar_caches_add_up_and_the_largest_tenant_is_one_engines():
    a = replace(
        _engine(),
        grammar_cache=GrammarCacheStats(
            entries=2,
            bytes=300,
            budget_bytes=1000,
            tenant_budget_bytes=250,
            tenants=2,
            largest_tenant_bytes=200,
            hits=5,
            misses=2,
            evictions=1,
            tenant_evictions=1,
            evicted_bytes=100,
            not_kept=0,
        ),
    )
    b = replace(
        _engine(),
        grammar_cache=GrammarCacheStats(
            entries=1,
            bytes=240,
            budget_bytes=1000,
            tenant_budget_bytes=250,
            tenants=1,
            largest_tenant_bytes=240,
            hits=1,
            misses=1,
            not_kept=1,
        ),
    )
    merged = merge_stats([a, b]).grammar_cache
    assert merged == GrammarCacheStats(
        entries=3,
        bytes=540,
        budget_bytes=2000,
        tenant_budget_bytes=500,
        tenants=3,
        largest_tenant_bytes=240,
        hits=6,
        misses=3,
        evictions=1,
        tenant_evictions=1,
        evicted_bytes=100,
        not_kept=1,
    )


def test_lora_launches_are_the_costliest_engines():
    """An engine that has not run a decode step with adapters yet (None) does not hide
    another's figure; none has one: None."""
    a = replace(_engine(), lora_launches_per_decode_step=120, lora_launches_per_layer=4.0)
    b = replace(_engine(), lora_launches_per_decode_step=448, lora_launches_per_layer=14.0)
    merged = merge_stats([a, b, _engine()])
    assert (merged.lora_launches_per_decode_step, merged.lora_launches_per_layer) == (448, 14.0)
    assert merge_stats([_engine(), _engine()]).lora_launches_per_layer is None


def test_pin_states_merge_to_pinned_only_where_every_engine_holds_the_pin():
    merged = merge_pin_states(
        [
            {"a": "pinned", "b": "pinned", "c": "loading"},
            {"a": "pinned", "b": "waiting for device memory no request is promised"},
        ]
    )
    assert merged == {
        "a": "pinned",
        "b": "pinned on 1 of 2 engines; waiting for device memory no request is promised",
        "c": "loading",
    }
    assert merge_pin_states([{}, {}]) == {}
