"""Cold adapters load in the background: the steps go on, failures stay contained.

* While an adapter's fetch hangs, requests on the base model and on resident adapters
  keep getting tokens; the cold request waits in the queue, then runs once its adapter
  has arrived.
* A fetch that fails ends only the requests waiting for that adapter, with the reason;
  the next request for it retries the load and succeeds once the source is back.
* A registered adapter larger than the device can ever hold is refused at its request,
  not left waiting forever.
* An adapter whose config the loader refuses (``lora_alpha: 1e308``) fails only its own
  requests; the others get the tokens they would have had.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

from loramux.engine import SamplingParams
from loramux.engine.lora.source import CallableSource
from tests.engine.factories import build_engine

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 300, 42]


def _copying_source(adapter_dir: Path, gate: threading.Event | None = None, failures=None):
    """A source that copies ``adapter_dir``'s files, after ``gate`` opens; it raises while
    ``failures`` (a list) is non-empty, popping one entry per attempt."""
    attempts = []

    def fetch(dest: Path) -> None:
        attempts.append(1)
        if gate is not None and not gate.wait(timeout=30):
            raise TimeoutError("the test never opened the gate")
        if failures:
            raise ConnectionError(failures.pop(0))
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copyfile(adapter_dir / name, dest / name)

    return CallableSource(fetch, description=f"test copy of {adapter_dir.name}"), attempts


def _run(engine, until) -> list:
    outputs = []
    for _ in range(2000):
        outputs += engine.step()
        if until(outputs):
            return outputs
    raise AssertionError(f"not done after 2000 steps: {[o.request_id for o in outputs]}")


def _finished(outputs, request_id):
    return next((o for o in outputs if o.request_id == request_id and o.finished), None)


def test_a_hanging_fetch_does_not_stall_other_requests(tiny_model_dir, make_adapter):
    hot = make_adapter(tiny_model_dir, rank=4, seed=11)
    cold = make_adapter(tiny_model_dir, rank=8, seed=12)
    reference = build_engine(tiny_model_dir, {"cold": cold})
    [expected] = reference.generate([PROMPT], PARAMS, adapters=["cold"])

    engine = build_engine(tiny_model_dir, {"hot": hot})
    gate = threading.Event()
    source, attempts = _copying_source(cold, gate)
    engine.register_adapter("cold", source)
    assert engine.adapter_residency() == {"cold": "store", "hot": "host"}

    engine.add_request("cold-1", PROMPT, PARAMS, adapter="cold")
    engine.add_request("base", PROMPT, PARAMS)
    engine.add_request("hot", PROMPT, PARAMS, adapter="hot")
    # The others finish while the cold adapter's fetch is still blocked.
    outputs = _run(engine, lambda outs: _finished(outs, "base") and _finished(outs, "hot"))
    assert not any(o.request_id == "cold-1" for o in outputs)
    assert engine.adapter_residency()["cold"] == "loading" and attempts == [1]

    gate.set()
    outputs = _run(engine, lambda outs: _finished(outs, "cold-1"))
    done = _finished(outputs, "cold-1")
    assert done.finish_reason == "length" and done.token_ids == expected.token_ids
    assert engine.adapter_residency()["cold"] == "device"


def test_a_failed_fetch_fails_only_its_requests_and_is_retried(tiny_model_dir, make_adapter):
    flaky = make_adapter(tiny_model_dir, rank=8, seed=13)
    reference = build_engine(tiny_model_dir, {"flaky": flaky})
    [expected] = reference.generate([PROMPT], PARAMS, adapters=["flaky"])

    engine = build_engine(tiny_model_dir)
    failures = ["object store unreachable"]
    source, attempts = _copying_source(flaky, failures=failures)
    engine.register_adapter("flaky", source)
    engine.add_request("f1", PROMPT, PARAMS, adapter="flaky")
    engine.add_request("f2", PROMPT, PARAMS, adapter="flaky")
    engine.add_request("base", PROMPT, PARAMS)
    outputs = _run(engine, lambda outs: all(_finished(outs, r) for r in ("f1", "f2", "base")))
    for request_id in ("f1", "f2"):
        failed = _finished(outputs, request_id)
        assert failed.finish_reason == "error" and failed.token_ids == []
        assert failed.error_kind == "adapter_load_failed"
        assert "'flaky' could not be loaded" in failed.error
        assert "object store unreachable" in failed.error
    assert _finished(outputs, "base").finish_reason == "length"
    assert attempts == [1]  # one fetch for both waiting requests
    assert engine.adapter_residency()["flaky"] == "failed"
    assert not engine.has_unfinished_requests()

    # The source is back: the next request retries and is served.
    engine.add_request("f3", PROMPT, PARAMS, adapter="flaky")
    outputs = _run(engine, lambda outs: _finished(outs, "f3"))
    assert _finished(outputs, "f3").token_ids == expected.token_ids
    assert attempts == [1, 1]
    assert engine.adapter_residency()["flaky"] == "device"


def test_an_adapter_too_big_for_the_device_fails_at_its_request(tiny_model_dir, make_adapter):
    row_bytes = build_engine(tiny_model_dir).arena.bytes_per_row
    engine = build_engine(tiny_model_dir, adapter_device_bytes=4 * row_bytes)
    big = make_adapter(tiny_model_dir, rank=8, seed=14)
    source, _ = _copying_source(big)
    engine.register_adapter("big", source)  # its rank is unknown until it is loaded
    engine.add_request("big-1", PROMPT, PARAMS, adapter="big")
    outputs = _run(engine, lambda outs: _finished(outs, "big-1"))
    failed = _finished(outputs, "big-1")
    assert failed.finish_reason == "error" and failed.error_kind == "adapter_too_large"
    assert "needs 8 rows" in failed.error and "at most 4 adapter rows" in failed.error
    assert not engine.has_unfinished_requests()


def test_the_disk_cache_serves_a_reloaded_adapter_without_fetching(
    tiny_model_dir, make_adapter, tmp_path
):
    adapter = make_adapter(tiny_model_dir, rank=4, seed=15)
    engine = build_engine(
        tiny_model_dir,
        adapter_disk_cache_dir=str(tmp_path / "disk"),
        adapter_disk_cache_bytes=1 << 30,
    )
    fetches = []

    def fetch(dest: Path) -> None:
        fetches.append(1)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copyfile(adapter / name, dest / name)

    source = CallableSource(fetch, description="counted", cache_key="sha-of-the-weights")
    engine.register_adapter("cached", source)
    [first] = engine.generate([PROMPT], PARAMS, adapters=["cached"])
    # Unregistered (device rows and host memory freed), then registered again: the files
    # come from the local disk cache, not the source.
    engine.remove_adapter("cached")
    assert engine.tiers.host.bytes_used == 0
    engine.register_adapter("cached", source)
    [second] = engine.generate([PROMPT], PARAMS, adapters=["cached"])
    assert fetches == [1]
    assert second.token_ids == first.token_ids


def test_an_adapter_with_an_absurd_alpha_fails_only_its_requests(
    tiny_model_dir, make_adapter, adapter_copy
):
    """lora_alpha 1e308 once made every step raise, failing every tenant's requests
    (issue 14); the loader now refuses it, and only its requests end, with the reason."""
    good = make_adapter(tiny_model_dir, rank=4, seed=11)
    hostile = adapter_copy(make_adapter(tiny_model_dir, rank=4, seed=16))
    config = json.loads((hostile / "adapter_config.json").read_text())
    (hostile / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 1e308}))
    reference = build_engine(tiny_model_dir, {"good": good})
    [expected_good, expected_base] = reference.generate(
        [PROMPT, PROMPT], PARAMS, adapters=["good", None]
    )

    engine = build_engine(tiny_model_dir, {"good": good})
    source, _ = _copying_source(hostile)
    engine.register_adapter("hostile", source)
    engine.add_request("hostile-1", PROMPT, PARAMS, adapter="hostile")
    engine.add_request("good", PROMPT, PARAMS, adapter="good")
    engine.add_request("base", PROMPT, PARAMS)
    ids = ("hostile-1", "good", "base")
    outputs = _run(engine, lambda outs: all(_finished(outs, r) for r in ids))
    failed = _finished(outputs, "hostile-1")
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert "lora_alpha must be a number above 0 and at most 1000000" in failed.error
    assert _finished(outputs, "good").token_ids == expected_good.token_ids
    assert _finished(outputs, "base").token_ids == expected_base.token_ids
    assert engine.adapter_residency()["hostile"] == "failed"
