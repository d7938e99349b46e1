"""Run measures: percentiles like numpy's, and summaries checked on hand-made records."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from loramux.benchmarks.common.measures import (
    RequestRecord,
    memory_high_water,
    percentiles,
    summarize,
)


def record(index, tenant, arrival, tokens, finish, error=None) -> RequestRecord:
    return RequestRecord(
        index=index,
        tenant=tenant,
        adapter=0,
        arrival_s=arrival,
        token_times_s=list(tokens),
        finish_s=finish,
        error=error,
    )


def sample_records() -> list[RequestRecord]:
    """Three ok requests and one failed; times are dyadic so the arithmetic is exact.

    r0: TTFT 0.5, ITLs [0.25, 0.5], E2E 1.25    r1: TTFT 0.25, ITLs [0.125], E2E 0.5
    r2: TTFT 1.0, no ITLs, E2E 1.0              r3: failed after one token
    """
    return [
        record(0, "a", 0.0, [0.5, 0.75, 1.25], 1.25),
        record(1, "b", 1.0, [1.25, 1.375], 1.5),
        record(2, "a", 2.0, [3.0], 3.0),
        record(3, "b", 2.5, [2.625], None, error="boom"),
    ]


# --- RequestRecord ------------------------------------------------------------------


def test_record_properties():
    r = record(0, "a", 1.0, [1.5, 2.0, 2.75], 3.0)
    assert (r.ok, r.output_tokens, r.ttft_s, r.itls_s, r.e2e_s) == (True, 3, 0.5, [0.5, 0.75], 2.0)
    empty = record(1, "a", 1.0, [], None)
    assert (empty.ok, empty.output_tokens, empty.ttft_s, empty.itls_s, empty.e2e_s) == (
        False,
        0,
        None,
        [],
        None,
    )
    assert not record(2, "a", 0.0, [1.0], 1.0, error="reset").ok


# --- percentiles --------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 7, 1000])
def test_percentiles_match_numpy(size):
    values = np.random.default_rng(size).exponential(size=size)
    qs = (0, 25, 50, 90, 99, 99.9, 100)
    got = percentiles(values.tolist(), qs)
    assert list(got) == ["p0", "p25", "p50", "p90", "p99", "p99.9", "p100"]
    for q in qs:
        assert got[f"p{q:g}"] == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentiles_interpolate_linearly():
    assert percentiles([1.0, 2.0, 3.0, 4.0], (50, 90)) == {"p50": 2.5, "p90": pytest.approx(3.7)}


def test_percentiles_of_nothing_are_none():
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


# --- summarize ----------------------------------------------------------------------


def test_summary_of_hand_made_records():
    s = summarize(sample_records(), duration_s=4.0)
    assert s["requests"] == {"total": 4, "ok": 3, "failed": 1}
    assert s["duration_s"] == 4.0
    # failed r3 (TTFT 0.125) is left out of every latency
    assert s["ttft_s"] == {
        "mean": pytest.approx(1.75 / 3),
        "p50": 0.5,
        "p90": pytest.approx(0.9),
        "p99": pytest.approx(0.99),
    }
    assert s["itl_s"] == {
        "mean": pytest.approx(0.875 / 3),
        "p50": 0.25,
        "p90": pytest.approx(0.45),
        "p99": pytest.approx(0.495),
    }
    assert s["e2e_s"] == {
        "mean": pytest.approx(2.75 / 3),
        "p50": 1.0,
        "p90": pytest.approx(1.2),
        "p99": pytest.approx(1.245),
    }
    assert s["requests_per_s"] == 0.75
    assert s["output_tokens_per_s"] == 1.5  # 6 tokens from ok requests over 4 s
    assert s["slo"] == {"ttft_s": None, "itl_s": None}
    assert s["slo_attainment"] is None
    assert s["tenants"] is None
    json.dumps(s)


@pytest.mark.parametrize(
    ("slo_ttft_s", "slo_itl_s", "attainment"),
    [
        (0.5, None, 0.5),  # r0 (TTFT exactly at the SLO) and r1 of 4
        (0.25, None, 0.25),  # r1
        (None, 0.25, 0.5),  # r1, and r2 with no gaps; r0 has a 0.5 gap
        (0.5, 0.25, 0.25),  # r1 only
        (10.0, 10.0, 0.75),  # every ok request; the failed one never attains
        (0.1, None, 0.0),
    ],
)
def test_slo_attainment(slo_ttft_s, slo_itl_s, attainment):
    s = summarize(sample_records(), duration_s=4.0, slo_ttft_s=slo_ttft_s, slo_itl_s=slo_itl_s)
    assert s["slo_attainment"] == attainment
    assert s["slo"] == {"ttft_s": slo_ttft_s, "itl_s": slo_itl_s}


def test_slo_for_a_request_without_tokens():
    silent = [record(0, "a", 0.0, [], 1.0)]
    assert summarize(silent, duration_s=1.0, slo_ttft_s=5.0)["slo_attainment"] == 0.0
    assert summarize(silent, duration_s=1.0, slo_itl_s=5.0)["slo_attainment"] == 1.0


def test_tenant_shares():
    weights = {"a": 3.0, "b": 1.0, "c": 4.0}
    tenants = summarize(sample_records(), duration_s=4.0, tenant_weights=weights)["tenants"]
    assert tenants == {
        "a": {"tokens": 4, "share": pytest.approx(4 / 6), "weight_share": 0.375},
        "b": {"tokens": 2, "share": pytest.approx(2 / 6), "weight_share": 0.125},
        "c": {"tokens": 0, "share": 0.0, "weight_share": 0.5},
    }


def test_tenant_missing_from_the_weights_has_weight_zero():
    tenants = summarize(sample_records(), duration_s=4.0, tenant_weights={"a": 1.0})["tenants"]
    assert tenants["a"] == {"tokens": 4, "share": pytest.approx(4 / 6), "weight_share": 1.0}
    assert tenants["b"] == {"tokens": 2, "share": pytest.approx(2 / 6), "weight_share": 0.0}


def test_summary_of_only_failures():
    failed = [record(0, "a", 0.0, [0.5], None, error="timeout")]
    s = summarize(failed, duration_s=2.0, slo_ttft_s=1.0, tenant_weights={"a": 1.0})
    assert s["requests"] == {"total": 1, "ok": 0, "failed": 1}
    assert s["ttft_s"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert (s["requests_per_s"], s["output_tokens_per_s"], s["slo_attainment"]) == (0.0, 0.0, 0.0)
    assert s["tenants"] == {"a": {"tokens": 0, "share": None, "weight_share": 1.0}}
    json.dumps(s)


def test_summary_of_no_records():
    s = summarize([], duration_s=1.0, slo_ttft_s=1.0)
    assert s["requests"] == {"total": 0, "ok": 0, "failed": 0}
    assert s["slo_attainment"] is None


@pytest.mark.parametrize("duration_s", [0.0, -1.0])
def test_duration_must_be_positive(duration_s):
    with pytest.raises(ValueError, match="duration_s"):
        summarize(sample_records(), duration_s=duration_s)


# --- memory -------------------------------------------------------------------------


def test_memory_high_water():
    memory = memory_high_water()
    assert memory["rss_peak_bytes"] > 10 * 2**20  # this process has imported torch
    if torch.cuda.is_available():
        assert memory["cuda_max_allocated_bytes"] >= 0
    else:
        assert memory["cuda_max_allocated_bytes"] is None
    json.dumps(memory)
