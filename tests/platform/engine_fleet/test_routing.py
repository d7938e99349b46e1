"""Routing rules: adapter affinity (device, host, sent before), within a bound on imbalance."""

from __future__ import annotations

from collections import Counter

import pytest

from loramux.platform.engine_fleet.routing import Candidate, choose, load_cap


def _pick(*candidates: Candidate, factor: float = 1.25, key: str = "adapter") -> str:
    chosen = choose(list(candidates), factor, key)
    assert chosen is not None
    return chosen.engine_id


def test_no_candidate_no_engine():
    assert choose([], 1.25, "k") is None


def test_affinity_order_device_then_host_then_sent_then_least_loaded():
    device = Candidate("a", load=2, holds_on_device=True)
    host = Candidate("b", load=1, holds_in_host=True)
    sent = Candidate("c", load=1, sent_before=True)
    idle = Candidate("d", load=0)
    # Mean load 1 with 4 engines: cap = ceil(1.25 * 5 / 4) = 2... a at 2 is not eligible.
    assert load_cap([2, 1, 1, 0], 1.25) == 2
    assert _pick(device, host, sent, idle) == "b"
    assert _pick(device, host, sent, idle, factor=2.0) == "a"  # cap 3: a is eligible
    assert _pick(sent, idle) == "c"
    assert _pick(Candidate("x", load=1), idle) == "d"


def test_ties_go_to_the_least_loaded_then_the_keys_rendezvous_rank():
    assert _pick(Candidate("a", load=3), Candidate("b", load=2), factor=4.0) == "b"
    idle = [Candidate("a", load=0), Candidate("b", load=0), Candidate("c", load=0)]
    picks = {key: _pick(*idle, key=key) for key in (f"adapter-{i}" for i in range(60))}
    # Deterministic, whatever the order the engines are listed in...
    assert all(_pick(*reversed(idle), key=key) == engine for key, engine in picks.items())
    # ...and new adapters spread over idle engines instead of piling on one.
    counts = Counter(picks.values())
    assert set(counts) == {"a", "b", "c"} and min(counts.values()) >= 10, counts


def test_a_hot_adapter_spills_once_its_engine_is_over_the_bound():
    """Every request for one adapter: its engine takes them until it holds more than
    load_factor times the mean, then the other engine takes some."""
    loads = {"a": 0, "b": 0}
    picks = []
    for _ in range(40):
        candidates = [
            Candidate("a", load=loads["a"], holds_on_device=True),
            Candidate("b", load=loads["b"]),
        ]
        engine = _pick(*candidates)
        loads[engine] += 1
        picks.append(engine)
    assert picks[:2] == ["a", "a"]
    assert 20 < loads["a"] <= 26 and loads["b"] >= 14  # bounded: a ≤ 1.25 × mean + 1
    assert max(loads.values()) <= load_cap(list(loads.values()), 1.25)


def test_load_factor_below_one_is_refused():
    with pytest.raises(ValueError, match="load_factor"):
        choose([Candidate("a", load=0)], 0.9, "k")
