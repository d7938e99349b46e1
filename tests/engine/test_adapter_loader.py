"""Tests for engine/lora/loader.py: background fetch + parse, order, dedupe, errors, close."""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loramux.engine.lora.adapter import WEIGHTS_FILE, LoRAWeights, load_adapter
from loramux.engine.lora.loader import AdapterLoader, LoadResult
from loramux.engine.lora.source import ADAPTER_FILES, CallableSource, LocalDirectorySource
from loramux.engine.model.config import ModelConfig

RANKS = (4, 8, 16)


@pytest.fixture(scope="module")
def model_config(tiny_model_dir) -> ModelConfig:
    return ModelConfig.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, make_adapter) -> dict[int, Path]:
    return {
        rank: make_adapter(tiny_model_dir, rank=rank, targets=("q_proj", "down_proj"), seed=rank)
        for rank in RANKS
    }


@pytest.fixture
def thread_name() -> str:
    return f"test-adapter-loader-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def loader(model_config, thread_name) -> Iterator[AdapterLoader]:
    loader = AdapterLoader(model_config, dtype=torch.float32, max_rank=16, name=thread_name)
    yield loader
    loader.close()


def collect(loader: AdapterLoader, count: int, timeout: float = 30.0) -> list[LoadResult]:
    """Poll until ``count`` results came back (fails the test after ``timeout`` s)."""
    results: list[LoadResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < count:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"only {len(results)} of {count} results after {timeout} s"
        loader.wait(remaining)
        results += loader.poll()
    return results


def thread_alive(name: str) -> bool:
    return any(t.name == name for t in threading.enumerate())


class Gate:
    """A store fetch that blocks until opened: keeps the loader busy on demand."""

    def __init__(self, src: Path):
        self.src = src
        self.started = threading.Event()
        self.opened = threading.Event()

    def fetch(self, dest: Path) -> None:
        self.started.set()
        assert self.opened.wait(30), "the test never opened the gate"
        for name in ADAPTER_FILES:
            shutil.copyfile(self.src / name, dest / name)

    def source(self) -> CallableSource:
        return CallableSource(self.fetch, description=f"gated store {self.src.name}")


def assert_same_weights(got: LoRAWeights, want: LoRAWeights) -> None:
    assert got.name == want.name and got.modules.keys() == want.modules.keys()
    for module, expected in want.modules.items():
        actual = got.modules[module]
        assert (actual.rank, actual.scale) == (expected.rank, expected.scale)
        assert actual.a.keys() == expected.a.keys() and actual.b.keys() == expected.b.keys()
        for layer in expected.a:
            assert torch.equal(actual.a[layer], expected.a[layer])
            assert torch.equal(actual.b[layer], expected.b[layer])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loads_real_adapters_in_the_background(model_config, adapters, thread_name, dtype):
    loader = AdapterLoader(model_config, dtype=dtype, max_rank=16, name=thread_name)
    try:
        assert not thread_alive(thread_name)  # nothing runs before the first submit
        for adapter_id, rank in enumerate(RANKS):
            assert loader.submit(adapter_id, LocalDirectorySource(adapters[rank]), name=f"r{rank}")
        results = collect(loader, len(RANKS))
        assert thread_alive(thread_name)
    finally:
        loader.close()
    for result, rank in zip(results, RANKS, strict=True):
        assert result.error is None and result.seconds > 0
        want = load_adapter(adapters[rank], model_config, name=f"r{rank}", dtype=dtype)
        assert_same_weights(result.weights, want)
        tensor = result.weights.modules["q_proj"].a[0]
        assert tensor.device.type == "cpu" and tensor.dtype == dtype
    assert [r.adapter_id for r in results] == [0, 1, 2]


def test_results_come_back_in_submission_order(loader, adapters):
    gate = Gate(adapters[16])
    order = [7, 3, 9, 1, 5]
    loader.submit(order[0], gate.source(), name="slow")
    for adapter_id, rank in zip(order[1:], (4, 8, 4, 16), strict=True):
        loader.submit(adapter_id, LocalDirectorySource(adapters[rank]), name=f"a{adapter_id}")
    assert gate.started.wait(30)
    gate.opened.set()
    results = collect(loader, len(order))
    assert [r.adapter_id for r in results] == order
    assert all(r.error is None for r in results)


def test_submit_dedupes_until_the_result_is_polled(loader, adapters):
    gate = Gate(adapters[8])
    assert loader.submit(1, gate.source(), name="a1") is True
    assert gate.started.wait(30)
    assert loader.submit(1, gate.source(), name="a1") is False  # in flight
    assert loader.submit(2, LocalDirectorySource(adapters[4]), name="a2") is True
    assert loader.submit(2, LocalDirectorySource(adapters[4]), name="a2") is False  # queued
    assert loader.pending() == {1, 2}
    gate.opened.set()
    assert loader.wait(30)
    assert 1 in loader.pending()  # done but not yet handed over by poll: still pending
    assert loader.submit(1, gate.source(), name="a1") is False
    results = collect(loader, 2)
    assert [r.adapter_id for r in results] == [1, 2] and loader.pending() == set()
    assert loader.submit(1, LocalDirectorySource(adapters[8]), name="a1") is True
    assert collect(loader, 1)[0].error is None


def test_failures_become_results_and_the_thread_keeps_serving(
    loader, adapters, adapter_copy, tmp_path, tiny_model_dir, make_adapter
):
    corrupt = adapter_copy(adapters[4])
    (corrupt / WEIGHTS_FILE).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")

    def unreachable(dest: Path) -> None:
        raise ConnectionError("object store unreachable")

    loader.submit(1, LocalDirectorySource(tmp_path / "missing"), name="missing")
    loader.submit(2, LocalDirectorySource(corrupt), name="corrupt")
    loader.submit(3, CallableSource(unreachable, description="store objects t/a3/*"), name="s3")
    loader.submit(4, LocalDirectorySource(adapters[8]), name="fine")
    missing, broken, offline, fine = collect(loader, 4)

    assert missing.weights is None and "'missing'" in missing.error
    assert str(tmp_path / "missing") in missing.error and "does not exist" in missing.error
    assert broken.weights is None and "'corrupt'" in broken.error
    assert str(corrupt) in broken.error and "safetensors" in broken.error
    assert offline.weights is None and "store objects t/a3/*" in offline.error
    assert "ConnectionError" in offline.error and "unreachable" in offline.error
    assert fine.error is None and fine.weights is not None

    # A rank above the engine's maximum is an adapter error too, and the thread still lives.
    rank32 = make_adapter(tiny_model_dir, rank=32, seed=32)
    loader.submit(5, LocalDirectorySource(rank32), name="too-big")
    (too_big,) = collect(loader, 1)
    assert too_big.weights is None and "'too-big'" in too_big.error
    assert "rank 32" in too_big.error and "maximum of 16" in too_big.error


def test_poll_never_blocks(loader, adapters):
    gate = Gate(adapters[4])
    loader.submit(1, gate.source(), name="blocked")
    assert gate.started.wait(30)
    start = time.perf_counter()
    assert loader.poll() == []
    assert time.perf_counter() - start < 0.1
    assert loader.wait(timeout=0.05) is False and loader.pending() == {1}
    gate.opened.set()
    assert loader.wait(timeout=30) is True
    (result,) = loader.poll()
    assert result.adapter_id == 1 and result.error is None
    assert result.seconds >= 0.05  # the blocked fetch counts in the load time
    assert loader.poll() == []


def test_close_stops_the_thread_and_drops_pending_work(model_config, adapters, thread_name):
    loader = AdapterLoader(model_config, dtype=torch.float32, max_rank=16, name=thread_name)
    gate = Gate(adapters[4])
    loader.submit(1, gate.source(), name="in-flight")
    loader.submit(2, LocalDirectorySource(adapters[8]), name="queued")
    assert gate.started.wait(30) and thread_alive(thread_name)
    loader.close(timeout=0.05)  # the in-flight fetch is still blocked
    assert loader.pending() == set()
    gate.opened.set()
    deadline = time.monotonic() + 30
    while thread_alive(thread_name) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not thread_alive(thread_name)
    assert loader.poll() == [] and loader.wait(0) is False  # results after close are dropped
    with pytest.raises(RuntimeError, match="closed"):
        loader.submit(3, LocalDirectorySource(adapters[8]), name="late")


def test_close_of_an_idle_loader_joins_its_thread(model_config, adapters, thread_name):
    loader = AdapterLoader(model_config, dtype=torch.float32, max_rank=16, name=thread_name)
    loader.close()  # never started: nothing to stop
    loader = AdapterLoader(model_config, dtype=torch.float32, max_rank=16, name=thread_name)
    loader.submit(1, LocalDirectorySource(adapters[4]), name="a1")
    collect(loader, 1)
    loader.close()
    assert not thread_alive(thread_name)


def test_pin_memory_only_with_cuda(model_config, adapters, thread_name):
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            AdapterLoader(model_config, dtype=torch.float32, max_rank=16, pin_memory=True)
        return
    loader = AdapterLoader(
        model_config, dtype=torch.bfloat16, max_rank=16, pin_memory=True, name=thread_name
    )
    try:
        loader.submit(1, LocalDirectorySource(adapters[8]), name="pinned")
        (result,) = collect(loader, 1)
    finally:
        loader.close()
    want = load_adapter(adapters[8], model_config, name="pinned", dtype=torch.bfloat16)
    assert_same_weights(result.weights, want)
    tensors = [t for m in result.weights.modules.values() for d in (m.a, m.b) for t in d.values()]
    assert all(t.is_pinned() and t.device.type == "cpu" for t in tensors)
