"""Adapters pinned on the device (``Engine.keep_adapter``): never evicted by a flood of other
adapters, within their share of the adapter rows, reported as they stand."""

from __future__ import annotations

import pytest

from loramux.engine import SamplingParams, UnknownAdapter
from loramux.engine.lora.tiers import MAX_PINNED_SHARE
from loramux.engine.memory.arena import RowLayout
from loramux.engine.model.config import ModelConfig
from tests.engine.factories import build_engine

GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
NAMES = ("a", "b", "c", "d", "e", "f")


@pytest.fixture(scope="module")
def six_adapters(tiny_model_dir, make_adapter):
    return {
        name: make_adapter(tiny_model_dir, rank=4, targets=("q_proj", "v_proj"), seed=seed)
        for seed, name in enumerate(NAMES, start=60)
    }


@pytest.fixture
def engine(tiny_model_dir, six_adapters):
    """Device room for four of the six rank-4 adapters (16 rows); pins may hold 8."""
    config = ModelConfig.from_pretrained(tiny_model_dir)
    row_bytes = 2 * config.num_layers * RowLayout.for_model(config, 1, 16).row_width * 4  # fp32
    engine = build_engine(tiny_model_dir, adapter_device_bytes=16 * row_bytes)
    assert engine.lora_pool.capacity == 16 and MAX_PINNED_SHARE == 0.5
    for name, path in six_adapters.items():
        engine.add_adapter(name, path)
    return engine


def _run(engine, watch) -> None:
    while engine.has_unfinished_requests():
        engine.step()
        watch()


def test_a_pinned_adapter_survives_a_flood_that_evicts_everything_else(engine):
    engine.keep_adapter("a")
    assert engine.pinned_adapters() == {"a": "loading"}  # until a step stages it
    engine.step()  # the next step puts it on the device, with no request for it
    assert engine.pinned_adapters() == {"a": "pinned"}
    assert engine.adapter_residency()["a"] == "device"
    seen_off = []
    for round_ in range(3):  # every other adapter, again and again: room for three at once
        for i, name in enumerate(NAMES[1:]):
            engine.add_request(f"r{round_}-{i}", "Hello", GREEDY, adapter=name)
        _run(engine, lambda: seen_off.append(engine.adapter_residency()["a"] != "device"))
    stats = engine.stats()
    assert stats.residency.adapter_evictions >= 10  # the flood evicted the others
    assert not any(seen_off)  # ...and never the pinned one
    assert stats.pinned_adapters == {"a": "pinned"}
    engine.lora_pool.check_invariants()
    # Unpinned, it is one more idle adapter: the next flood evicts it.
    engine.keep_adapter("a", keep=False)
    assert engine.pinned_adapters() == {}
    for i, name in enumerate(NAMES[1:]):
        engine.add_request(f"after-{i}", "Hello", GREEDY, adapter=name)
    _run(engine, lambda: None)
    assert engine.adapter_residency()["a"] != "device"


def test_pins_past_their_share_say_so_and_requests_still_run(engine):
    for name in ("a", "b", "c"):
        engine.keep_adapter(name)
    engine.step()
    states = engine.pinned_adapters()
    assert states["a"] == states["b"] == "pinned"
    assert states["c"].startswith("over the pins' share: it needs 4 adapter rows"), states
    assert "pinned adapters hold 8 of the 8 pins may take" in states["c"]
    # Requests for the other adapters still find the room pins leave them.
    outs = engine.generate(["Hi"] * 3, GREEDY, adapters=["d", "e", "f"])
    assert all(out.finish_reason == "length" for out in outs)
    # Unpinning one lets the waiting pin in.
    engine.keep_adapter("b", keep=False)
    engine.step()
    assert engine.pinned_adapters() == {"a": "pinned", "c": "pinned"}


def test_what_a_pin_refuses_and_forgets(engine):
    with pytest.raises(UnknownAdapter, match="'nope' is not loaded"):
        engine.keep_adapter("nope")
    engine.keep_adapter("a")
    engine.step()
    engine.remove_adapter("a")  # no request uses it: the pin goes with it
    assert engine.pinned_adapters() == {}
    engine.lora_pool.check_invariants()
