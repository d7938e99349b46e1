"""AsyncEngine: streamed deltas, concurrency, aborts on disconnect, refusals, shutdown.

Each test builds its own Engine on the tiny random Llama and drives the AsyncEngine
with ``asyncio.run`` (no pytest-asyncio).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from loramux.engine import Engine, EngineError, RequestOutput, SamplingParams, UnknownAdapter
from loramux.engine.async_engine import AsyncEngine, AsyncEngineError, EngineStoppedError
from tests.engine.factories import PROMPTS, build_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


@pytest.fixture
def adapters(tiny_model_dir, make_adapter):
    return {
        "a": make_adapter(tiny_model_dir, rank=4, targets=("q_proj", "v_proj"), seed=1),
        "b": make_adapter(tiny_model_dir, rank=4, targets=("q_proj", "v_proj"), seed=2),
    }


@pytest.fixture
def engine(tiny_model_dir, adapters) -> Engine:
    return build_engine(tiny_model_dir, adapters)


async def collect(aengine: AsyncEngine, prompt, params=GREEDY, **kwargs) -> list[RequestOutput]:
    return [out async for out in aengine.generate(prompt, params, **kwargs)]


async def wait_until_idle(aengine: AsyncEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while await aengine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the request was not aborted in the engine"
        await asyncio.sleep(0.01)


def assert_stream_equals(outs: list[RequestOutput], expected: RequestOutput) -> None:
    assert outs, "no outputs"
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert all(o.delta_token_ids for o in outs)  # one output per step that gave tokens
    assert [t for o in outs for t in o.delta_token_ids] == expected.token_ids
    assert "".join(o.delta_text for o in outs) == expected.text
    assert outs[-1].token_ids == expected.token_ids
    assert outs[-1].text == expected.text
    assert outs[-1].finish_reason == expected.finish_reason


def test_stream_matches_engine_generate(engine):
    [expected] = engine.generate([PROMPTS[0]], GREEDY, adapters=["a"])
    aengine = AsyncEngine(engine)

    async def main():
        try:
            return await collect(aengine, PROMPTS[0], adapter="a", request_id="r1")
        finally:
            await aengine.stop()

    outs = asyncio.run(main())
    assert_stream_equals(outs, expected)
    assert {o.request_id for o in outs} == {"r1"}
    assert {o.adapter for o in outs} == {"a"}
    assert len(outs) == GREEDY.max_tokens


def test_concurrent_requests_each_equal_their_alone_result(engine):
    requests = [(prompt, adapter) for prompt in PROMPTS[:3] for adapter in (None, "a", "b")]
    alone = [engine.generate([p], GREEDY, adapters=[a])[0] for p, a in requests]
    aengine = AsyncEngine(engine)

    async def main():
        try:
            return await asyncio.gather(
                *(
                    collect(aengine, p, adapter=a, tenant=f"t{i % 2}")
                    for i, (p, a) in enumerate(requests)
                )
            )
        finally:
            await aengine.stop()

    streams = asyncio.run(main())
    for outs, expected in zip(streams, alone, strict=True):
        assert_stream_equals(outs, expected)


def test_break_aborts_the_request(engine):
    aengine = AsyncEngine(engine)

    async def main():
        try:
            async for out in aengine.generate(PROMPTS[0], LONG, adapter="a"):
                assert not out.finished
                break
            await wait_until_idle(aengine)
        finally:
            await aengine.stop()

    asyncio.run(main())
    assert not engine.has_unfinished_requests()


def test_aclose_aborts_the_request(engine):
    aengine = AsyncEngine(engine)

    async def main():
        try:
            stream = aengine.generate(PROMPTS[1], LONG)
            await anext(stream)
            await stream.aclose()
            await wait_until_idle(aengine)
        finally:
            await aengine.stop()

    asyncio.run(main())
    assert not engine.has_unfinished_requests()


def test_cancelling_the_consumer_aborts_the_request(engine):
    aengine = AsyncEngine(engine)

    async def main():
        got_one = asyncio.Event()

        async def consume():
            async for _ in aengine.generate(PROMPTS[2], LONG, adapter="b"):
                got_one.set()

        try:
            task = asyncio.create_task(consume())
            await asyncio.wait_for(got_one.wait(), timeout=30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_until_idle(aengine)
        finally:
            await aengine.stop()

    asyncio.run(main())
    assert not engine.has_unfinished_requests()


def test_abort_ends_the_stream_with_an_abort_output(engine):
    aengine = AsyncEngine(engine)

    async def main():
        outs = []
        try:
            async for out in aengine.generate(PROMPTS[0], LONG, request_id="victim"):
                outs.append(out)
                if len(outs) == 1:
                    aborted = await aengine.abort("victim")
                    assert aborted is not None and aborted.finish_reason == "abort"
            assert await aengine.abort("victim") is None  # already gone
            assert not await aengine.has_unfinished_requests()
        finally:
            await aengine.stop()
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert len(outs[-1].token_ids) < LONG.max_tokens


@pytest.mark.parametrize(
    ("kwargs", "prompt", "match"),
    [
        ({"adapter": "missing"}, PROMPTS[0], "unknown adapter"),
        ({}, list(range(1, 601)), "context limit"),  # the tiny model's limit is 512
    ],
    ids=["unknown-adapter", "over-long-prompt"],
)
def test_refused_request_raises_before_output_and_leaves_nothing(engine, kwargs, prompt, match):
    aengine = AsyncEngine(engine)

    async def main():
        outs = []
        try:
            with pytest.raises(EngineError, match=match):
                async for out in aengine.generate(prompt, GREEDY, request_id="bad", **kwargs):
                    outs.append(out)
            assert not await aengine.has_unfinished_requests()
            # The engine still serves, and the refused id is free again.
            good = await collect(aengine, PROMPTS[1], request_id="bad")
        finally:
            await aengine.stop()
        return outs, good

    outs, good = asyncio.run(main())
    assert outs == []
    assert good[-1].finished and len(good[-1].token_ids) == GREEDY.max_tokens
    assert not engine.has_unfinished_requests()


def test_duplicate_request_id_is_refused_without_hurting_the_first(engine):
    aengine = AsyncEngine(engine)

    async def main():
        try:
            first = aengine.generate(PROMPTS[0], GREEDY, request_id="dup")
            head = await anext(first)
            with pytest.raises(EngineError, match="already in use"):
                await collect(aengine, PROMPTS[1], request_id="dup")
            rest = [out async for out in first]
        finally:
            await aengine.stop()
        return [head, *rest]

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert len(outs[-1].token_ids) == GREEDY.max_tokens


def test_failed_step_fails_in_flight_requests_and_the_loop_survives(engine, monkeypatch):
    """A failure outside the model run (which isolates its own failures per request, see
    test_blast_radius) ends every in-flight request with an error; the loop goes on."""
    aengine = AsyncEngine(engine)
    real_schedule = engine.scheduler.schedule
    failed = []

    def flaky_schedule():
        if not failed and len(engine.scheduler.running) == 2:  # both requests in flight
            failed.append(True)
            raise RuntimeError("device on fire")
        return real_schedule()

    monkeypatch.setattr(engine.scheduler, "schedule", flaky_schedule)

    async def main():
        try:
            results = await asyncio.gather(
                collect(aengine, PROMPTS[0], LONG),
                collect(aengine, PROMPTS[1], LONG, adapter="a"),
                return_exceptions=True,
            )
            assert not await aengine.has_unfinished_requests()
            after = await collect(aengine, PROMPTS[2])
        finally:
            await aengine.stop()
        return results, after

    results, after = asyncio.run(main())
    assert failed
    for result in results:
        assert isinstance(result, AsyncEngineError)
        assert isinstance(result.__cause__, RuntimeError)
        assert "device on fire" in str(result)
    assert after[-1].finished and len(after[-1].token_ids) == GREEDY.max_tokens


def test_adapter_pass_throughs(engine, adapters):
    aengine = AsyncEngine(engine)

    async def main():
        try:
            request = await aengine.add_adapter("c", adapters["a"])
            assert request.name == "c"
            assert await aengine.list_adapters() == ["a", "b", "c"]
            await aengine.set_tenant_weight("acme", 2.0)
            outs = await collect(aengine, PROMPTS[0], adapter="c", tenant="acme")
            await aengine.remove_adapter("c")
            with pytest.raises(UnknownAdapter, match="not loaded"):  # its type crosses threads
                await aengine.remove_adapter("c")
            with pytest.raises(ValueError, match="weight"):
                await aengine.set_tenant_weight("acme", 0.0)
            return outs
        finally:
            await aengine.stop()

    outs = asyncio.run(main())
    [expected] = engine.generate([PROMPTS[0]], GREEDY, adapters=["a"])  # same weights as "c"
    assert outs[-1].token_ids == expected.token_ids
    assert engine.scheduler.fair.weights["acme"] == 2.0


def test_idle_loop_does_not_step(engine, monkeypatch):
    aengine = AsyncEngine(engine)
    steps = {"n": 0}
    real_step = engine.step

    def counting_step():
        steps["n"] += 1
        return real_step()

    monkeypatch.setattr(engine, "step", counting_step)

    async def main():
        try:
            await aengine.start()
            await asyncio.sleep(0.2)
            idle_steps = steps["n"]
            await collect(aengine, PROMPTS[0])
            busy_steps = steps["n"]
            await asyncio.sleep(0.2)
            return idle_steps, busy_steps, steps["n"]
        finally:
            await aengine.stop()

    idle_steps, busy_steps, final_steps = asyncio.run(main())
    assert idle_steps == 0
    assert busy_steps >= GREEDY.max_tokens
    assert final_steps == busy_steps


def test_stop_ends_the_thread_and_start_again_works(engine):
    aengine = AsyncEngine(engine)

    async def main():
        await aengine.start()
        thread = aengine._loop.thread
        assert aengine.is_running and thread.is_alive()
        await collect(aengine, PROMPTS[0])
        await aengine.stop()
        assert not aengine.is_running
        assert not thread.is_alive()
        await aengine.stop()  # idempotent

        # A stop with a request in flight: its iterator raises, the engine is left empty.
        stream = aengine.generate(PROMPTS[1], LONG)
        await anext(stream)
        await aengine.stop()
        with pytest.raises(EngineStoppedError):
            async for _ in stream:  # outputs queued before the stop come first
                pass
        assert not engine.has_unfinished_requests()

        # Starting again runs a fresh thread on the same engine.
        outs = await collect(aengine, PROMPTS[2])
        second = aengine._loop.thread
        assert second is not thread
        await aengine.stop()
        assert not second.is_alive()
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished
