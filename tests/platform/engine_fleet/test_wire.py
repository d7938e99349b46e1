"""The engine processes' wire format gives back the engine's own values."""

from __future__ import annotations

import dataclasses
import json

import pytest

from loramux.engine import (
    GrammarError,
    JsonObject,
    JsonSchema,
    Regex,
    SamplingParams,
    Tool,
    ToolCalls,
    ToolChoice,
)
from loramux.engine.memory.plan import MemoryPlan
from loramux.engine.outputs import RequestOutput
from loramux.engine.residency import ResidencyStats
from loramux.engine.sampler import TokenLogprobs
from loramux.engine.sequence import RequestMetrics
from loramux.engine.stats import EngineStats, LatencySummary, SpeculationStats, TierStats
from loramux.engine.structured import GrammarCacheStats
from loramux.engine.tenant_share import TenantShareStats, with_shares
from loramux.platform.engine_fleet import wire


def _through_json(data):
    return json.loads(json.dumps(data))


def test_sampling_params_round_trip():
    params = SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_k=5,
        top_p=0.9,
        seed=2**63,
        logprobs=3,
        stop=("\n", "END"),
        stop_token_ids=(2, 7),
        ignore_eos=True,
        min_tokens=2,
    )
    assert wire.params_from_json(_through_json(wire.params_to_json(params))) == params


def test_prompt_logprobs_and_logit_bias_round_trip():
    params = SamplingParams(
        max_tokens=0, prompt_logprobs=5, logit_bias={0: -100, 50256: 2.5, 7: 100}
    )
    data = _through_json(wire.params_to_json(params))
    assert data["logit_bias"] == [[0, -100.0], [50256, 2.5], [7, 100.0]]
    back = wire.params_from_json(data)
    assert back == params and back.logit_bias == {0: -100.0, 50256: 2.5, 7: 100.0}


def test_unset_new_params_are_left_out_for_older_engines():
    data = wire.params_to_json(SamplingParams(max_tokens=3))
    assert "prompt_logprobs" not in data and "logit_bias" not in data
    assert "speculative" not in data  # the default: sent only to opt out
    assert wire.params_from_json(_through_json(data)) == SamplingParams(max_tokens=3)


def test_a_speculation_opt_out_round_trips():
    params = SamplingParams(max_tokens=3, speculative=False)
    data = _through_json(wire.params_to_json(params))
    assert data["speculative"] is False
    assert wire.params_from_json(data) == params


@pytest.mark.parametrize(
    "spec",
    [
        JsonObject(),
        JsonSchema({"type": "object", "properties": {"b": {}, "a": {"type": "integer"}}}),
        JsonSchema({"type": "array"}, strict=False),
        Regex(r"[0-9]{3}-[a-z]+"),
        ToolCalls(
            (
                Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}}),
                Tool("noop", strict=True),
            ),
            ToolChoice.NAMED,
            "get_weather",
            parallel=False,
        ),
    ],
    ids=["json_object", "json_schema", "lenient", "regex", "tools"],
)
def test_structured_specs_round_trip(spec):
    params = SamplingParams(max_tokens=9, temperature=0.0, structured=spec)
    data = _through_json(wire.params_to_json(params))
    back = wire.params_from_json(data)
    assert back == params and back.structured == spec
    if isinstance(spec, JsonSchema):  # property order is the output's order: kept
        assert list(back.structured.schema) == list(spec.schema)
        assert json.dumps(back.structured.schema) == json.dumps(spec.schema)


def test_an_unset_spec_is_left_out():
    data = wire.params_to_json(SamplingParams(max_tokens=3, logprobs=1))
    assert "structured" not in data


def test_a_malformed_spec_on_the_wire_is_refused_by_name():
    with pytest.raises(GrammarError, match="unknown structured-output type 'yaml'"):
        wire.params_from_json({"structured": {"type": "yaml"}})
    with pytest.raises(ValueError, match="tool name"):
        wire.params_from_json(
            {"structured": {"type": "tool_calls", "tools": [{"name": "bad name"}]}}
        )
    with pytest.raises(ValueError, match=r"json_schema\.schema"):
        wire.params_from_json({"structured": {"type": "json_schema", "schema": [1]}})


def test_bad_logit_bias_on_the_wire_is_refused_by_name():
    with pytest.raises(ValueError, match="logit_bias"):
        wire.params_from_json({"logit_bias": {"5": 1.0}})  # an object, not pairs
    with pytest.raises(ValueError, match=r"logit_bias\[5\]"):
        wire.params_from_json({"logit_bias": [[5, 101]]})
    with pytest.raises(ValueError, match="max_tokens"):
        wire.params_from_json({"max_tokens": 0})


def test_bad_sampling_params_are_refused_by_name():
    with pytest.raises(ValueError, match="temperature"):
        wire.params_from_json({"temperature": -1})
    with pytest.raises(TypeError):
        wire.params_from_json({"no_such_knob": 1})


def test_request_output_round_trip():
    out = RequestOutput(
        request_id="r1",
        prompt_token_ids=[1, 2],
        token_ids=[5, 6],
        text="hi!",
        delta_token_ids=[6],
        delta_text="!",
        finished=True,
        finish_reason="stop",
        stop_reason="!",
        logprobs=[TokenLogprobs(6, -0.25, [(6, -0.25), (9, -1.5)])],
        adapter="a1",
        metrics=RequestMetrics(arrival_time=1.0, completion_tokens=2, inter_token_times=[0.1]),
    )
    assert wire.output_from_json(_through_json(wire.output_to_json(out))) == out


def test_request_output_with_prompt_logprobs_round_trips():
    out = RequestOutput(
        request_id="r2",
        prompt_token_ids=[1, 2, 3],
        token_ids=[],
        text="",
        finished=True,
        finish_reason="length",
        prompt_logprobs=[
            None,
            TokenLogprobs(2, -3.5, [(9, -0.5), (2, -3.5)]),
            TokenLogprobs(3, -0.125, []),
        ],
        metrics=RequestMetrics(arrival_time=1.0, prompt_tokens=3),
    )
    back = wire.output_from_json(_through_json(wire.output_to_json(out)))
    assert back == out
    assert back.prompt_logprobs[1].top == [(9, -0.5), (2, -3.5)]  # pairs as tuples
    plain = dataclasses.replace(out, prompt_logprobs=None)
    assert wire.output_from_json(_through_json(wire.output_to_json(plain))) == plain


def test_engine_stats_round_trip_with_the_default_tenant():
    latency = LatencySummary(samples=3, p50=0.1, p90=0.2, p99=None)
    stats = EngineStats(
        running_requests=1,
        waiting_requests=2,
        kv_blocks_used=3,
        kv_blocks_usable=10,
        kv_blocks_total=12,
        kv_block_size=16,
        device=TierStats(adapters=("a",), bytes=100, capacity_bytes=1000),
        host=TierStats(adapters=("a", "b"), bytes=200, capacity_bytes=2000),
        adapter_residency={"a": "device", "b": "host"},
        ttft=latency,
        itl=latency,
        window_s=300.0,
        tenant_priorities={None: 0, "t1": 5},
        tenant_weights={None: 1.0, "t1": 2.0},
        kv_blocks_held=4,
        preemptions=7,
        residency=ResidencyStats(
            preemptions=7,
            adapter_evictions=5,
            adapter_reloads=3,
            adapter_room_wait_steps=9,
            adapter_reloads_per_min=3.0,
            thrashing=False,
        ),
        memory=MEMORY,
        tenants=with_shares(
            {
                None: TenantShareStats(5, 0, 5, 0, queued_requests=0, running_requests=1, weight=1),
                "t1": TenantShareStats(
                    90, 30, 9, 3, queued_requests=5, running_requests=2, weight=2
                ),
            }
        ),
        share_window_s=30.0,
        speculative_method="ngram",
        num_speculative_tokens=4,
        speculation={
            "": SpeculationStats(12, 9, 4, 10, 19),  # the base model
            "a": SpeculationStats(8, 2, 3, 6, 8),
        },
        grammar_cache=GrammarCacheStats(
            entries=3,
            bytes=5_000_000,
            budget_bytes=256 << 20,
            tenant_budget_bytes=64 << 20,
            tenants=2,
            largest_tenant_bytes=4_000_000,
            hits=7,
            misses=5,
            evictions=2,
            tenant_evictions=1,
            evicted_bytes=900_000,
            not_kept=1,
        ),
    )
    assert stats.tenants["t1"].share == 0.75  # 9 + 2 * 3 of 5 + 15, output tokens count 2
    back = wire.stats_from_json(_through_json(wire.stats_to_json(stats)))
    assert back == stats
    assert back.tenants["t1"].weight_share == pytest.approx(2 / 3)
    assert (back.speculative_method, back.num_speculative_tokens) == ("ngram", 4)
    assert back.speculation[""].acceptance_rate == 0.75
    assert back.speculation["a"].tokens_per_step == pytest.approx(8 / 6)


MEMORY = MemoryPlan(
    budget_bytes=1 << 30,
    source="machine",
    detail="sized to the machine: 15% of 6.7 GiB available RAM",
    device="cpu",
    block_size=16,
    kv_block_bytes=737_280,
    kv_blocks=1456,
    kv_tokens=23_296,
    adapter_row_bytes=1_244_160,
    rank=16,
    full_batch_requests=64,
    full_batch_context=512,
    full_batch_blocks=2048,
    adapters_beside_full_batch=0,
    adapters_max=40,
)


def test_an_older_engines_stats_still_parse():
    """An engine from before the memory figures sends ``residency`` as adapter -> tier and
    neither ``memory`` nor the counts: the adapters are kept, the rest takes defaults."""
    latency = {"samples": 0, "p50": None, "p90": None, "p99": None}
    tier = {"adapters": ["a"], "bytes": 10, "capacity_bytes": 100}
    old = {
        "running_requests": 0,
        "waiting_requests": 0,
        "kv_blocks_used": 0,
        "kv_blocks_usable": 8,
        "kv_blocks_total": 8,
        "kv_block_size": 16,
        "device": tier,
        "host": tier,
        "residency": {"a": "device"},
        "ttft": latency,
        "itl": latency,
        "window_s": 300.0,
        "tenant_priorities": [],
        "tenant_weights": [],
        "kv_blocks_held": 0,
        "preemptions": 2,
    }
    stats = wire.stats_from_json(old)
    assert stats.adapter_residency == {"a": "device"}
    assert stats.residency == ResidencyStats() and stats.memory is None
    assert stats.tenants == {}  # an engine from before the per-tenant service
    # ...and from before speculative decoding
    assert (stats.speculative_method, stats.num_speculative_tokens) == ("off", 0)
    assert stats.speculation == {}
    assert stats.grammar_cache == GrammarCacheStats()  # ...and from before its figures


def test_metrics_a_newer_engine_adds_are_dropped():
    # Engines may be upgraded before the platforms that call them.
    out = RequestOutput(
        request_id="r",
        prompt_token_ids=[1],
        token_ids=[2],
        text="x",
        delta_token_ids=[2],
        delta_text="x",
        finished=True,
        metrics=RequestMetrics(arrival_time=1.0, prompt_tokens=1),
    )
    data = wire.output_to_json(out)
    data["metrics"]["a_figure_from_the_future"] = 7
    assert wire.output_from_json(data).metrics == out.metrics
