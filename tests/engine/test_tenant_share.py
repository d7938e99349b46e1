"""Per-tenant service (tenant_share.py): what a step counts, the 30-second window, the
shares next to the weights' shares, several engines merged; and an engine whose two
backlogged tenants of weights 1 and 3 report shares near 0.25 and 0.75."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loramux.engine import SamplingParams
from loramux.engine.scheduler import ScheduledSequence
from loramux.engine.sequence import SequenceStatus
from loramux.engine.tenant_share import (
    BUCKET_S,
    TenantShare,
    TenantShareStats,
    merge_tenants,
    served_in_step,
    with_shares,
)
from tests.engine.factories import build_engine


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _seq(tenant, *, outputs=0, status=SequenceStatus.RUNNING):
    return SimpleNamespace(
        tenant=tenant, request_id=f"{tenant}-0", output_token_ids=[7] * outputs, status=status
    )


def _prefill(tenant, n, *, last=True, outputs=0):
    """A chunk of ``n`` prompt tokens; ``last``: it reaches the end and samples."""
    return ScheduledSequence(_seq(tenant, outputs=outputs), n, samples=last)


def _decode(tenant, *, status=SequenceStatus.RUNNING):
    return ScheduledSequence(_seq(tenant, outputs=3, status=status), 1, samples=True)


def _tenants(**figures) -> dict:
    """tenant -> (window prompt, window output, queued, running, weight)."""
    return {
        name: TenantShareStats(
            served_prompt_tokens=prompt,
            served_output_tokens=output,
            window_prompt_tokens=prompt,
            window_output_tokens=output,
            queued_requests=queued,
            running_requests=running,
            weight=weight,
        )
        for name, (prompt, output, queued, running, weight) in figures.items()
    }


# --- counting ---------------------------------------------------------------------------------


def test_a_step_counts_prompt_chunks_decodes_and_nothing_for_the_aborted():
    served = served_in_step(
        [
            _prefill("a", 16, last=False),  # a chunk of a long prompt: no token yet
            _prefill("a", 5),  # its last chunk: 5 prompt tokens and the first output
            _decode("a"),
            _decode("b"),
            _decode("b"),
            _decode("c", status=SequenceStatus.FINISHED),  # failed or aborted in the step
            _prefill("d", 1),  # a prompt all cached but its last token
        ]
    )
    assert served == {"a": (21, 2), "b": (0, 2), "d": (1, 1)}


def test_recompute_after_preemption_counts_as_prompt_tokens():
    # A preempted sequence with 3 outputs computes prompt + outputs again, then samples.
    assert served_in_step([_prefill("a", 12, outputs=3)]) == {"a": (12, 1)}


def test_totals_count_since_the_start_and_the_window_the_last_30_seconds():
    clock = FakeClock()
    share = TenantShare(window_s=30.0, clock=clock)
    share.record_step([_prefill("a", 10), _decode("b")])
    clock.now += 20
    share.record_step([_decode("a")])
    stats = share.snapshot([], [], {})
    assert (stats["a"].window_prompt_tokens, stats["a"].window_output_tokens) == (10, 2)
    clock.now += 15  # the first step is now 35 s old, the second 15 s
    stats = share.snapshot([], [], {})
    assert (stats["a"].served_prompt_tokens, stats["a"].served_output_tokens) == (10, 2)
    assert (stats["a"].window_prompt_tokens, stats["a"].window_output_tokens) == (0, 1)
    assert (stats["b"].served_output_tokens, stats["b"].window_output_tokens) == (1, 0)
    assert stats["a"].share == 1.0 and stats["b"].share == 0.0


def test_the_window_holds_at_most_one_bucket_per_second():
    clock = FakeClock()
    share = TenantShare(window_s=30.0, clock=clock)
    for _ in range(1000):  # 100 s of steps, ten a second
        share.record_step([_decode("a"), _decode(f"t{int(clock.now) % 3}")])
        clock.now += 0.1
    assert len(share._buckets) <= 30 / BUCKET_S
    stats = share.snapshot([], [], {})
    assert 290 <= stats["a"].window_output_tokens <= 300  # 29 to 30 s of 10 a second
    assert stats["a"].served_output_tokens == 1000


def test_queue_depth_and_running_per_tenant_and_tenants_stay_once_seen():
    share = TenantShare(clock=FakeClock())
    waiting = [_seq("a", status=SequenceStatus.WAITING)] * 3 + [_seq(None)]
    stats = share.snapshot(waiting, [_seq("a"), _seq("b")], {"c": 2.0})
    assert {t: (s.queued_requests, s.running_requests) for t, s in stats.items()} == {
        "a": (3, 1),
        None: (1, 0),
        "b": (0, 1),
        "c": (0, 0),
    }
    assert stats["c"].weight == 2.0 and stats["a"].weight == 1.0  # the scheduler's default
    later = share.snapshot([], [], {})
    assert set(later) == {"a", "b", "c", None}
    assert all(not s.has_work and s.weight_share is None for s in later.values())


# --- shares -----------------------------------------------------------------------------------


def test_share_weighs_output_tokens_twice_as_the_scheduler_does():
    shares = with_shares(_tenants(a=(200, 0, 1, 0, 1.0), b=(0, 100, 1, 0, 1.0)))
    assert shares["a"].share == shares["b"].share == 0.5


def test_weight_share_counts_only_tenants_with_work():
    shares = with_shares(
        _tenants(a=(100, 50, 4, 2, 1.0), b=(300, 150, 0, 6, 3.0), idle=(0, 0, 0, 0, 4.0))
    )
    assert shares["a"].share == pytest.approx(0.25) and shares["b"].share == pytest.approx(0.75)
    assert shares["a"].weight_share == 0.25 and shares["b"].weight_share == 0.75
    assert shares["idle"].weight_share is None and shares["idle"].share == 0.0


def test_no_share_while_nothing_was_served():
    shares = with_shares(_tenants(a=(0, 0, 1, 0, 1.0)))
    assert shares["a"].share is None and shares["a"].weight_share == 1.0


def test_engines_merge_by_summing_tokens_and_recomputing_shares():
    # Engine one served only a, engine two only b: each alone says 1.0, together 1:3.
    one = with_shares(_tenants(a=(100, 50, 2, 1, 1.0)))
    two = with_shares(_tenants(b=(300, 150, 1, 3, 3.0), a=(0, 0, 1, 1, 1.0)))
    merged = merge_tenants([one, two])
    assert (merged["a"].queued_requests, merged["a"].running_requests) == (3, 2)
    assert merged["a"].window_prompt_tokens == merged["a"].served_prompt_tokens == 100
    assert merged["a"].share == pytest.approx(0.25) and merged["b"].share == pytest.approx(0.75)
    assert merged["a"].weight_share == 0.25 and merged["b"].weight_share == 0.75


def test_a_window_shorter_than_a_bucket_is_refused():
    with pytest.raises(ValueError, match="window"):
        TenantShare(window_s=0.5)


# --- in the engine ----------------------------------------------------------------------------

BACKLOG = 6  # requests each tenant keeps queued
STEPS = 300


def test_backlogged_tenants_of_weights_1_and_3_get_shares_near_a_quarter_and_three_quarters(
    tiny_model_dir,
):
    engine = build_engine(tiny_model_dir, max_num_seqs=4, max_num_batched_tokens=64)
    engine.set_tenant_weight("light", 1.0)
    engine.set_tenant_weight("heavy", 3.0)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    added = 0

    def top_up():
        nonlocal added
        for tenant in ("light", "heavy"):
            queued = sum(s.tenant == tenant for s in engine.scheduler.waiting)
            for _ in range(BACKLOG - queued):
                added += 1  # 16-token prompts, each its own (no prefix-cache hits)
                prompt = [10 + (added + i) % 90 for i in range(16)]
                engine.add_request(f"{tenant}-{added}", prompt, params, tenant=tenant)

    for _ in range(STEPS):
        top_up()
        engine.step()
    top_up()
    tenants = engine.stats().tenants
    light, heavy = tenants["light"], tenants["heavy"]
    print(
        f"light: share {light.share:.3f} weight share {light.weight_share}; "
        f"heavy: share {heavy.share:.3f} weight share {heavy.weight_share}; "
        f"served output {light.served_output_tokens} / {heavy.served_output_tokens}"
    )
    assert (light.weight_share, heavy.weight_share) == (0.25, 0.75)
    assert light.share == pytest.approx(0.25, abs=0.03)
    assert heavy.share == pytest.approx(0.75, abs=0.03)
    assert light.share + heavy.share == pytest.approx(1.0)
    assert light.queued_requests == heavy.queued_requests == BACKLOG
    assert light.running_requests + heavy.running_requests == 4
    # Output tokens follow the weights too (the same request shape for both).
    ratio = heavy.served_output_tokens / light.served_output_tokens
    assert ratio == pytest.approx(3.0, rel=0.15)


def test_engine_metrics_count_each_tenants_tokens_and_queue(tiny_model_dir):
    engine = build_engine(tiny_model_dir, max_num_seqs=1)
    engine.set_tenant_weight("acme", 2.0)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("first", list(range(10, 30)), params, tenant="acme")
    engine.add_request("second", list(range(40, 52)), params, tenant="acme")
    engine.add_request("anon", list(range(60, 65)), params)

    def sample(name, **labels):
        return engine.metrics.registry.get_sample_value(name, labels)

    engine.step()  # one slot: acme's first request runs, the other two wait
    assert sample("loramux_tenant_queued_requests", tenant="acme") == 1
    assert sample("loramux_tenant_running_requests", tenant="acme") == 1
    assert sample("loramux_tenant_queued_requests", tenant="") == 1  # no tenant
    assert sample("loramux_tenant_served_tokens_total", tenant="acme", kind="prompt") == 20
    assert sample("loramux_tenant_served_tokens_total", tenant="acme", kind="output") == 1
    assert sample("loramux_tenant_weight", tenant="acme") == 2.0
    assert sample("loramux_tenant_weight_share", tenant="acme") == pytest.approx(2 / 3)
    assert sample("loramux_tenant_share", tenant="acme") == 1.0
    while engine.has_unfinished_requests():
        engine.step()
    # Prompt tokens as computed (no prefix hit here), output tokens as generated.
    assert sample("loramux_tenant_served_tokens_total", tenant="acme", kind="prompt") == 32
    assert sample("loramux_tenant_served_tokens_total", tenant="acme", kind="output") == 8
    assert sample("loramux_tenant_served_tokens_total", tenant="", kind="output") == 4
    assert sample("loramux_tenant_queued_requests", tenant="acme") == 0  # not left at 1
    assert sample("loramux_tenant_running_requests", tenant="acme") == 0
    assert sample("loramux_tenant_weight_share", tenant="acme") == 0.0  # no work now
    # Shares of the service (output tokens count twice): 32 + 2 * 8 of that plus 5 + 2 * 4.
    assert sample("loramux_tenant_share", tenant="acme") == pytest.approx(48 / 61)
    stats = engine.stats().tenants
    assert stats["acme"].served_prompt_tokens == 32 and stats[None].served_prompt_tokens == 5


def test_a_speculating_decode_serves_every_token_it_emitted():
    # Speculative decoding: one decode step of "a" emitted 4 tokens (3 accepted proposals + 1).
    served = served_in_step([_decode("a"), _decode("b")], {"a-0": 4})
    assert served == {"a": (0, 4), "b": (0, 1)}
