"""Engine metrics: the Prometheus registry and the per-request RequestOutput.metrics."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from loramux.engine import Engine, EngineConfig, SamplingParams
from loramux.engine.metrics import EngineMetrics
from tests.engine.factories import PROMPTS as ALL_PROMPTS
from tests.engine.factories import build_engine

PROMPTS = ALL_PROMPTS[:3]
MAX_TOKENS = [5, 8, 3]
# Well over a few 16-token blocks, so a second run finds a cached prefix.
LONG_PROMPT = " ".join(f"item {i} is number {i * 7} in the list;" for i in range(12))


@pytest.fixture
def adapter_paths(tiny_model_dir, make_adapter):
    return [
        make_adapter(tiny_model_dir, rank=4, targets=("q_proj", "v_proj"), seed=1),
        make_adapter(tiny_model_dir, rank=4, targets=("q_proj", "v_proj"), seed=2),
    ]


def sample(engine: Engine, name: str) -> float:
    value = engine.metrics.registry.get_sample_value(name)
    assert value is not None, f"{name} is not in the registry"
    return value


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_registry_after_generate(tiny_model_dir, adapter_paths):
    engine = build_engine(tiny_model_dir)
    for i, path in enumerate(adapter_paths):
        engine.add_adapter(f"a{i}", path)
    outs = engine.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS], adapters=[None, "a0", "a1"])
    requests, tokens = len(outs), sum(len(o.token_ids) for o in outs)
    assert tokens == sum(MAX_TOKENS)

    assert sample(engine, "loramux_time_to_first_token_seconds_count") == requests
    assert sample(engine, "loramux_inter_token_latency_seconds_count") == tokens - requests
    assert sample(engine, "loramux_queue_time_seconds_count") == requests
    assert sample(engine, "loramux_generated_tokens_total") == tokens
    assert sample(engine, "loramux_adapter_loads_total") == len(adapter_paths)
    assert sample(engine, "loramux_kv_blocks_total") == engine.kv.num_blocks > 0
    assert sample(engine, "loramux_running_requests") == 0
    assert sample(engine, "loramux_waiting_requests") == 0
    assert sample(engine, "loramux_kv_blocks_used") == 0
    assert sample(engine, "loramux_preemptions_total") == 0
    # Every prompt token was looked up in the prefix cache on admission.
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    assert sample(engine, "loramux_prefix_cache_query_tokens_total") == prompt_tokens
    assert sample(engine, "loramux_prefix_cache_hit_tokens_total") == 0

    text = generate_latest(engine.metrics.registry).decode()
    assert "loramux_time_to_first_token_seconds_bucket" in text
    assert f"loramux_generated_tokens_total {float(tokens)}" in text


def test_prefix_cache_hits_after_the_same_long_prompt_twice(tiny_model_dir):
    engine = build_engine(tiny_model_dir)
    [first] = engine.generate([LONG_PROMPT], greedy(4))
    assert sample(engine, "loramux_prefix_cache_hit_tokens_total") == 0
    [second] = engine.generate([LONG_PROMPT], greedy(4))

    hits = sample(engine, "loramux_prefix_cache_hit_tokens_total")
    assert hits > 0
    assert hits == second.metrics.cached_prompt_tokens
    assert hits % engine.config.block_size == 0
    assert sample(engine, "loramux_prefix_cache_query_tokens_total") == 2 * len(
        first.prompt_token_ids
    )
    assert first.metrics.cached_prompt_tokens == 0
    assert second.metrics.cached_prompt_tokens > 0
    assert second.token_ids == first.token_ids


def test_per_request_metrics(tiny_model_dir):
    engine = build_engine(tiny_model_dir)
    outs = engine.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])
    [again] = engine.generate([LONG_PROMPT], greedy(6))
    [repeat] = engine.generate([LONG_PROMPT], greedy(6))

    for out in [*outs, again, repeat]:
        m = out.metrics
        assert m is not None
        assert m.prompt_tokens == len(out.prompt_token_ids)
        assert m.completion_tokens == len(out.token_ids)
        assert m.queue_time is not None and m.queue_time >= 0
        assert m.time_to_first_token is not None and m.time_to_first_token > 0
        assert len(m.inter_token_times) == m.completion_tokens - 1
        assert all(t >= 0 for t in m.inter_token_times)
        assert m.finished_time is not None and m.finished_time >= m.last_token_time
        assert m.num_preemptions == 0
    assert [o.metrics.completion_tokens for o in outs] == MAX_TOKENS
    assert again.metrics.cached_prompt_tokens == 0
    assert 0 < repeat.metrics.cached_prompt_tokens < repeat.metrics.prompt_tokens


def test_counts_hold_through_preemption(tiny_model_dir):
    # A KV cache of 8 blocks cannot hold four 40-token requests at once: some are
    # preempted and recomputed, which must not count their tokens twice.
    block_bytes = 2 * 2 * 2 * 16 * 4 * 16  # kv x layers x kv heads x head_dim x fp32 x block
    engine = build_engine(tiny_model_dir, kv_cache_bytes=8 * block_bytes)
    assert engine.kv.num_blocks == 8
    outs = engine.generate(PROMPTS + PROMPTS[:1], greedy(30))
    requests, tokens = len(outs), sum(len(o.token_ids) for o in outs)
    assert tokens == 4 * 30

    assert sample(engine, "loramux_preemptions_total") == engine.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == engine.num_preemptions
    assert sample(engine, "loramux_time_to_first_token_seconds_count") == requests
    assert sample(engine, "loramux_inter_token_latency_seconds_count") == tokens - requests
    assert sample(engine, "loramux_queue_time_seconds_count") == requests
    assert sample(engine, "loramux_generated_tokens_total") == tokens
    assert sample(engine, "loramux_running_requests") == 0
    assert sample(engine, "loramux_waiting_requests") == 0
    for out in outs:
        assert len(out.metrics.inter_token_times) == out.metrics.completion_tokens - 1


def test_engines_keep_separate_registries(tiny_model_dir):
    shared = EngineMetrics()
    one = build_engine(tiny_model_dir, kv_cache_bytes=1 << 20)
    two = build_engine(tiny_model_dir, kv_cache_bytes=1 << 20)
    assert one.metrics.registry is not two.metrics.registry
    one.generate([PROMPTS[0]], greedy(3))
    assert sample(one, "loramux_generated_tokens_total") == 3
    assert sample(two, "loramux_generated_tokens_total") == 0
    # An engine can be handed its metrics (e.g. to put them in the app's registry).
    three = Engine(EngineConfig(model=str(tiny_model_dir), kv_cache_bytes=1 << 20), metrics=shared)
    assert three.metrics is shared
    assert shared.registry.get_sample_value("loramux_kv_blocks_total") == three.kv.num_blocks
