"""Removing an adapter from the engine: retried while requests use it (``AdapterInUse``),
done when the engine no longer has it (``UnknownAdapter``), told apart by type."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from loramux.engine import AdapterInUse, UnknownAdapter
from loramux.platform.services import adapter_runtime
from loramux.platform.services.adapter_runtime import AdapterRuntime


class _Engine:
    """remove_adapter answers with each of ``answers`` in turn (an error to raise, or None)."""

    def __init__(self, *answers: Exception | None):
        self.answers = list(answers)
        self.calls = 0

    async def remove_adapter(self, name: str) -> None:
        self.calls += 1
        answer = self.answers.pop(0)
        if answer is not None:
            raise answer


@pytest.fixture(autouse=True)
def _no_waiting(monkeypatch):
    monkeypatch.setattr(adapter_runtime, "REMOVAL_RETRY_S", 0.0)


def _remove(engine: _Engine) -> None:
    asyncio.run(asyncio.wait_for(AdapterRuntime._remove_when_idle(engine, "v1", delay=0), 5))


def test_an_adapter_in_use_is_removed_once_its_requests_end():
    engine = _Engine(AdapterInUse("in use by 1 request"), AdapterInUse("in use"), None)
    _remove(engine)
    assert engine.calls == 3 and not engine.answers


def test_an_adapter_the_engine_no_longer_has_is_not_tried_again():
    # Told by its type: the words are for people (these are not the engine's).
    engine = _Engine(AdapterInUse("busy"), UnknownAdapter("no adapter of that name here"))
    _remove(engine)
    assert engine.calls == 2


def test_unloading_an_adapter_in_use_removes_it_later():
    engine = _Engine(AdapterInUse("in use by 1 request"), None)
    runtime = AdapterRuntime(SimpleNamespace(engine=engine))
    runtime._loaded.add("v1")

    async def go():
        await runtime.unload(SimpleNamespace(id="v1"))
        assert engine.calls == 1 and runtime._pending_removals  # refused: retried later
        await asyncio.wait_for(asyncio.gather(*runtime._pending_removals), 5)

    asyncio.run(go())
    assert engine.calls == 2 and not engine.answers
