"""The workload generator: seeded, statistically what the spec says, and validated."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from loramux.benchmarks.common.workload import (
    TenantSpec,
    WorkloadRequest,
    WorkloadSpec,
    adapter_ranks,
    generate,
    prompt_token_ids,
)


def make_spec(**overrides) -> WorkloadSpec:
    fields = {"num_requests": 200, "rate": 5.0, "num_adapters": 4, "seed": 7}
    fields.update(overrides)
    return WorkloadSpec(**fields)


def gaps_of(requests: list[WorkloadRequest]) -> np.ndarray:
    return np.diff([0.0] + [r.arrival_s for r in requests])


def adapter_counts(requests: list[WorkloadRequest], n: int) -> np.ndarray:
    return np.bincount([r.adapter for r in requests], minlength=n)


# --- determinism ---------------------------------------------------------------------


def test_same_spec_same_requests():
    assert generate(make_spec()) == generate(make_spec())


def test_another_seed_other_requests():
    first, second = generate(make_spec(seed=0)), generate(make_spec(seed=1))
    assert [r.arrival_s for r in first] != [r.arrival_s for r in second]
    assert [r.adapter for r in first] != [r.adapter for r in second]
    assert [r.prompt_len for r in first] != [r.prompt_len for r in second]


def test_changing_lengths_keeps_arrivals_and_adapters():
    first = generate(make_spec(input_len=(1, 4)))
    second = generate(make_spec(input_len=(100, 400)))
    assert [(r.arrival_s, r.adapter) for r in first] == [(r.arrival_s, r.adapter) for r in second]


def test_requests_indexed_and_sorted_by_arrival():
    requests = generate(make_spec())
    assert [r.index for r in requests] == list(range(200))
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    assert arrivals[0] > 0


# --- arrivals ------------------------------------------------------------------------


@pytest.mark.parametrize("cv", [1.0, 2.0, 0.5])
def test_gamma_gaps_have_the_asked_mean_and_cv(cv):
    rate = 20.0
    gaps = gaps_of(generate(make_spec(num_requests=40_000, rate=rate, cv=cv, num_adapters=1)))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


# --- popularity ----------------------------------------------------------------------


def test_zipf_frequencies_follow_one_over_rank_power():
    n, s = 10, 1.2
    requests = generate(
        make_spec(num_requests=50_000, num_adapters=n, popularity="zipf", popularity_param=s)
    )
    counts = adapter_counts(requests, n)
    assert counts.argmax() == 0
    for k in range(1, 4):
        assert counts[k] / counts[0] == pytest.approx(1 / (k + 1) ** s, rel=0.1)


def test_power_popularity_matches_its_distribution():
    n, alpha = 10, 0.5
    requests = generate(
        make_spec(num_requests=50_000, num_adapters=n, popularity="power", popularity_param=alpha)
    )
    freq = adapter_counts(requests, n) / 50_000
    edges = (np.arange(n + 1) / n) ** alpha
    expected = np.diff(edges)  # P(floor(x n) = k) = ((k+1)/n)^a - (k/n)^a
    np.testing.assert_allclose(freq, expected, rtol=0.1)
    assert list(freq) == sorted(freq, reverse=True)


def test_uniform_popularity_is_flat():
    n, total = 8, 16_000
    counts = adapter_counts(generate(make_spec(num_requests=total, num_adapters=n)), n)
    expected = total / n
    chi_square = ((counts - expected) ** 2 / expected).sum()
    assert chi_square < 30  # 7 degrees of freedom: p ≈ 1e-4


def test_distinct_popularity_gives_each_request_its_own_adapter():
    spec = make_spec(num_requests=32, num_adapters=32, popularity="distinct")
    requests = generate(spec)
    assert [r.adapter for r in requests] == list(range(32))
    wrapped = generate(dataclasses.replace(spec, num_adapters=5))
    assert [r.adapter for r in wrapped] == [i % 5 for i in range(32)]
    # the adapters' draws are still made: lengths and tenants match a uniform spec's
    uniform = generate(dataclasses.replace(spec, popularity="uniform"))
    assert [(r.prompt_len, r.output_len, r.arrival_s) for r in requests] == [
        (r.prompt_len, r.output_len, r.arrival_s) for r in uniform
    ]


def test_adapter_indices_in_range():
    requests = generate(
        make_spec(num_requests=2000, num_adapters=3, popularity="power", popularity_param=3.0)
    )
    assert {r.adapter for r in requests} == {0, 1, 2}


# --- ranks, lengths, base model, tenants ---------------------------------------------


def test_adapter_ranks_cycle_through_the_mix():
    spec = make_spec(num_adapters=5, ranks=(8, 16, 64))
    assert adapter_ranks(spec) == [8, 16, 64, 8, 16]
    assert adapter_ranks(make_spec(num_adapters=0, base_fraction=1.0)) == []


def test_lengths_from_an_inclusive_range():
    requests = generate(make_spec(num_requests=1000, input_len=(3, 5), output_len=(1, 2)))
    assert {r.prompt_len for r in requests} == {3, 4, 5}
    assert {r.output_len for r in requests} == {1, 2}


def test_lengths_from_a_list_override_the_range():
    spec = make_spec(num_requests=1000, input_lens=(7, 100, 1000), output_lens=(42,))
    requests = generate(spec)
    assert {r.prompt_len for r in requests} == {7, 100, 1000}
    assert {r.output_len for r in requests} == {42}


@pytest.mark.parametrize("fraction", [0.0, 0.3, 1.0])
def test_base_fraction(fraction):
    requests = generate(make_spec(num_requests=10_000, base_fraction=fraction))
    base = sum(r.adapter is None for r in requests) / len(requests)
    assert base == pytest.approx(fraction, abs=0.02)


def test_all_base_model_without_adapters():
    requests = generate(make_spec(num_adapters=0, base_fraction=1.0))
    assert all(r.adapter is None for r in requests)


def test_tenant_shares():
    tenants = (TenantSpec("a", share=3.0), TenantSpec("b", priority=9, share=1.0))
    requests = generate(make_spec(num_requests=10_000, tenants=tenants))
    share_a = sum(r.tenant == "a" for r in requests) / len(requests)
    assert share_a == pytest.approx(0.75, abs=0.02)
    assert {r.tenant for r in requests} == {"a", "b"}


# --- JSON ----------------------------------------------------------------------------


def test_json_round_trip():
    spec = make_spec(
        cv=1.5,
        popularity="zipf",
        popularity_param=0.9,
        ranks=(8, 32),
        input_lens=(16, 64),
        output_len=(2, 9),
        base_fraction=0.1,
        tenants=(TenantSpec("a", priority=7, weight=2.0, share=0.5), TenantSpec("b")),
        seed=123,
    )
    raw = json.loads(json.dumps(spec.to_json()))
    again = WorkloadSpec.from_json(raw)
    assert again == spec
    assert generate(again) == generate(spec)


def test_from_json_rejects_unknown_fields():
    raw = make_spec().to_json() | {"burstiness": 3}
    with pytest.raises(ValueError, match="burstiness"):
        WorkloadSpec.from_json(raw)


def test_lists_are_stored_as_tuples():
    spec = make_spec(ranks=[8, 16], input_len=[2, 3], tenants=[TenantSpec("a")])
    assert spec == make_spec(ranks=(8, 16), input_len=(2, 3), tenants=(TenantSpec("a"),))


# --- validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_requests": 0}, "num_requests"),
        ({"rate": 0.0}, "rate"),
        ({"cv": -1.0}, "cv"),
        ({"num_adapters": -1}, "num_adapters"),
        ({"num_adapters": 0}, "base_fraction"),
        ({"popularity": "pareto"}, "popularity"),
        ({"popularity_param": 0.0}, "popularity_param"),
        ({"ranks": ()}, "ranks"),
        ({"ranks": (8, 0)}, "ranks"),
        ({"input_len": (0, 5)}, "input_len"),
        ({"input_len": (9, 5)}, "input_len"),
        ({"output_len": (1, 2, 3)}, "output_len"),
        ({"input_lens": (4, 0)}, "input_lens"),
        ({"output_lens": (-2,)}, "output_lens"),
        ({"base_fraction": 1.5}, "base_fraction"),
        ({"base_fraction": -0.1}, "base_fraction"),
        ({"tenants": ()}, "tenants"),
        ({"tenants": (TenantSpec("a"), TenantSpec("a"))}, "unique"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_specs_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_spec(**overrides)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"name": ""}, "name"),
        ({"name": "a", "priority": 10}, "priority"),
        ({"name": "a", "priority": -1}, "priority"),
        ({"name": "a", "weight": 0.0}, "weight"),
        ({"name": "a", "share": -1.0}, "share"),
    ],
)
def test_bad_tenants_are_rejected(fields, message):
    with pytest.raises(ValueError, match=message):
        TenantSpec(**fields)


# --- prompt token ids ----------------------------------------------------------------


def request_of(index: int = 0, prompt_len: int = 50) -> WorkloadRequest:
    return WorkloadRequest(
        index=index, arrival_s=0.0, adapter=None, prompt_len=prompt_len, output_len=1, tenant="a"
    )


def test_prompt_ids_have_the_exact_length_and_stay_in_the_vocab():
    ids = prompt_token_ids(request_of(prompt_len=321), vocab_size=1000, seed=0)
    assert len(ids) == 321
    assert all(isinstance(t, int) and 0 <= t < 1000 for t in ids)


def test_prompt_ids_deterministic_per_seed_and_index():
    request = request_of(index=3)
    assert prompt_token_ids(request, vocab_size=1000, seed=5) == prompt_token_ids(
        request, vocab_size=1000, seed=5
    )
    assert prompt_token_ids(request, vocab_size=1000, seed=5) != prompt_token_ids(
        request, vocab_size=1000, seed=6
    )
    assert prompt_token_ids(request, vocab_size=1000, seed=5) != prompt_token_ids(
        request_of(index=4), vocab_size=1000, seed=5
    )


def test_prompt_ids_never_use_avoided_ids():
    avoid = frozenset({0, 1, 2, 5, 9, 10_000})  # 10_000 is outside the vocabulary
    ids = prompt_token_ids(request_of(prompt_len=2000), vocab_size=10, seed=1, avoid=avoid)
    assert set(ids) == {3, 4, 6, 7, 8}


def test_prompt_ids_need_an_allowed_id():
    with pytest.raises(ValueError, match="avoid"):
        prompt_token_ids(request_of(), vocab_size=3, seed=0, avoid=frozenset({0, 1, 2}))


def test_requests_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        request_of().prompt_len = 3  # type: ignore[misc]
