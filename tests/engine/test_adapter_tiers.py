"""A thousand adapters through three tiers: store (source) → host RAM → device rows.

The engine has 1,000 registered adapters (ranks 4 to 64, varied targets), a host tier that
holds about 50 of them and a device share that holds about 16, and serves 1,000 requests
whose adapters follow a uniform and a Zipf(1.0) popularity (622 and 337 distinct adapters:
both far beyond what the tiers hold). Every request's greedy tokens must equal those of the
same request served by an engine holding only its adapter; the tiers' memory must stay
within their budgets after every step; and the per-tier lookups must add up
(device hits + misses = requests; host lookups = device misses).
"""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import pytest

from loramux.engine import SamplingParams
from loramux.engine.lora.source import LocalDirectorySource
from loramux.engine.model.config import ModelConfig
from tests.engine.factories import build_engine
from tests.engine.synthetic_adapters import write_adapter

NUM_ADAPTERS = 1000
NUM_REQUESTS = 1000
RANKS = (4, 8, 16, 24, 32, 48, 64)
TARGET_SETS = (
    ("q_proj", "v_proj"),
    ("q_proj", "k_proj", "v_proj", "o_proj"),
    ("gate_proj", "up_proj", "down_proj"),
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
)
MAX_TOKENS = 2
ARRIVALS_PER_STEP = 24
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _adapter_spec(index: int) -> tuple[int, tuple[str, ...]]:
    return RANKS[index % len(RANKS)], TARGET_SETS[(index // len(RANKS)) % len(TARGET_SETS)]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory) -> list[Path]:
    config = ModelConfig.from_pretrained(tiny_model_dir)
    root = tmp_path_factory.mktemp("thousand-adapters")
    dirs = []
    for index in range(NUM_ADAPTERS):
        rank, targets = _adapter_spec(index)
        dirs.append(
            write_adapter(root / f"a{index}", config, rank=rank, targets=targets, seed=index)
        )
    return dirs


def _trace(popularity: str) -> list[tuple[int, list[int]]]:
    """(adapter index, prompt token ids) per request, in arrival order."""
    rng = random.Random(f"tiers-{popularity}")
    if popularity == "uniform":
        adapters = [rng.randrange(NUM_ADAPTERS) for _ in range(NUM_REQUESTS)]
    else:  # Zipf(1.0): adapter k (0-based) is drawn with weight 1 / (k + 1)
        weights = [1.0 / (k + 1) for k in range(NUM_ADAPTERS)]
        adapters = rng.choices(range(NUM_ADAPTERS), weights=weights, k=NUM_REQUESTS)
    return [
        (adapter, [rng.randrange(1, 4000) for _ in range(rng.randrange(3, 7))])
        for adapter in adapters
    ]


def _reference_tokens(model_dir, adapter_dirs, trace) -> dict[int, list[int]]:
    """Each request's tokens from an engine holding only that request's adapter."""
    engine = build_engine(model_dir)
    by_adapter: dict[int, list[int]] = defaultdict(list)
    for request, (adapter, _) in enumerate(trace):
        by_adapter[adapter].append(request)
    tokens: dict[int, list[int]] = {}
    for adapter, requests in by_adapter.items():
        engine.add_adapter("only", adapter_dirs[adapter])
        outs = engine.generate(
            [trace[r][1] for r in requests], PARAMS, adapters=["only"] * len(requests)
        )
        for request, out in zip(requests, outs, strict=True):
            tokens[request] = out.token_ids
        engine.remove_adapter("only")
    return tokens


def _tiered_engine(model_dir, adapter_dirs):
    sizes = [_weights_bytes(adapter_dirs[i]) for i in range(NUM_ADAPTERS)]
    mean_bytes = sum(sizes) // len(sizes)
    mean_rank = sum(_adapter_spec(i)[0] for i in range(NUM_ADAPTERS)) / NUM_ADAPTERS
    probe = build_engine(model_dir)
    row_bytes = probe.arena.bytes_per_row
    device_bytes = int(16 * mean_rank) * row_bytes
    engine = build_engine(
        model_dir,
        kv_cache_bytes=(16 << 20) + device_bytes,
        adapter_device_bytes=device_bytes,
        adapter_host_bytes=50 * mean_bytes,
        max_num_seqs=32,
    )
    for index, path in enumerate(adapter_dirs):
        engine.register_adapter(f"a{index}", LocalDirectorySource(path))
    return engine


def _weights_bytes(adapter_dir: Path) -> int:
    # fp32 tensors: the file's payload is the host tier's size, give or take the header.
    return (adapter_dir / "adapter_model.safetensors").stat().st_size


def _check_budgets(engine) -> None:
    config = engine.config
    host, pool = engine.tiers.host, engine.lora_pool
    assert host.bytes_used <= config.adapter_host_bytes
    assert pool.bytes_used <= config.adapter_device_bytes
    kv_bytes = engine.kv.limit * engine.arena.bytes_per_block
    assert kv_bytes + pool.region_rows * engine.arena.bytes_per_row <= config.kv_cache_bytes


def _serve(engine, trace) -> dict[int, list[int]]:
    """Feed the trace in waves while stepping; the tokens of every request."""
    pending = list(enumerate(trace))
    tokens: dict[int, list[int]] = {}
    peak = {"device": 0, "host": 0}
    while pending or engine.has_unfinished_requests():
        for request, (adapter, prompt) in pending[:ARRIVALS_PER_STEP]:
            engine.add_request(f"r{request}", prompt, PARAMS, adapter=f"a{adapter}")
        del pending[:ARRIVALS_PER_STEP]
        for out in engine.step():
            if out.finished:
                assert out.finish_reason == "length", (out.request_id, out.error)
                tokens[int(out.request_id[1:])] = out.token_ids
        _check_budgets(engine)
        residency = engine.adapter_residency().values()
        peak["device"] = max(peak["device"], sum(t == "device" for t in residency))
        peak["host"] = max(peak["host"], len(engine.tiers.host))
    engine.lora_pool.check_invariants()
    engine.kv.check_invariants()
    return tokens, peak


def _counter(engine, name: str, tier: str) -> float:
    return engine.metrics.registry.get_sample_value(f"loramux_adapter_{name}_total", {"tier": tier})


@pytest.mark.parametrize("popularity", ["uniform", "zipf"])
def test_thousand_adapters_serve_exactly_within_budgets(tiny_model_dir, adapter_dirs, popularity):
    trace = _trace(popularity)
    engine = _tiered_engine(tiny_model_dir, adapter_dirs)
    tokens, peak = _serve(engine, trace)
    assert len(tokens) == NUM_REQUESTS

    # The tiers were exercised: far fewer adapters resident than used, many evictions.
    used = len({adapter for adapter, _ in trace})
    assert peak["device"] <= 32 < used and peak["host"] <= 100 < used
    device_hits, device_misses = (
        _counter(engine, "hits", "device"),
        _counter(engine, "misses", "device"),
    )
    host_hits, host_misses = _counter(engine, "hits", "host"), _counter(engine, "misses", "host")
    assert device_hits + device_misses == NUM_REQUESTS
    assert host_hits + host_misses == device_misses
    assert _counter(engine, "evictions", "device") > 0
    assert _counter(engine, "evictions", "host") > 0
    # Popular adapters stay resident under Zipf; under uniform popularity a lookup finds
    # its adapter on the device about as often as 16 resident adapters in 1,000 allow.
    hit_rate = device_hits / NUM_REQUESTS
    assert hit_rate > 0.1 if popularity == "zipf" else hit_rate < 0.1

    expected = _reference_tokens(tiny_model_dir, adapter_dirs, trace)
    mismatched = [r for r in range(NUM_REQUESTS) if tokens[r] != expected[r]]
    assert not mismatched, f"{len(mismatched)} requests differ, e.g. {mismatched[:5]}"
