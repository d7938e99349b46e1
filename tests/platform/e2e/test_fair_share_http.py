"""Weighted fair share and priority, over HTTP with the official ``openai`` client.

One platform on the embedded default (SQLite, local store, engine in-process) with 8
sequence slots serves the tiny model; each engine step is stretched by a fixed sleep, so
the engine, not the clients or the test machine's two cores, is what is short, and steps
have the steady length of a GPU's. Tenants keep more streamed completions open than the
slots can run (a closed loop): they stay backlogged, and what each receives is its share.

The share is counted as the client receives it: the output tokens of each completion
(``usage``), spread evenly between its first token and its end, that fall in the window.
Every request has the same prompt/output mix, so that is also the share of service as the
scheduler's VTC counts it (prompt x1, output x2).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from loramux.platform.settings import Settings
from tests.fixtures.models import build_tiny_model
from tests.platform.e2e.conftest import Platform, Tenant, start_platform

# Shares and times to first token measured against the clock: run alone (``make test``).
pytestmark = pytest.mark.exclusive

SLOTS = 8
STEP_S = 0.025  # sleep added to each engine step (the tiny model's own step is a few ms)
MAX_TOKENS = 16  # short requests: many of them end in a window, so the share is fine-grained
WARM_UP_S = 3.0
TOLERANCE = 0.10  # the issue's +-10% of the weights
LIGHTEST_COMPLETIONS = 24  # requests the lightest tenant completes in a share's window
MAX_WINDOW_S = 90.0
REPO_ROOT = Path(__file__).resolve().parents[3]


@contextlib.contextmanager
def slowed_platform(tmp_path_factory, model_dir: Path) -> Iterator[Platform]:
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("fair-share"),
        model=str(model_dir),
        device="cpu",
        max_num_seqs=SLOTS,
    )
    with start_platform(settings) as running:
        slow_steps(running, STEP_S)
        yield running


@pytest.fixture(scope="module")
def platform(tmp_path_factory, tiny_model_dir) -> Iterator[Platform]:
    with slowed_platform(tmp_path_factory, tiny_model_dir) as running:
        yield running


@pytest.fixture
def layered_platform(tmp_path_factory, tokenizer_dir) -> Iterator[Platform]:
    """Eight layers, not the tiny model's two: a step can be cut short only between layers
    (engine/step_interrupt.py), and with two the cut comes up to half a step late where a
    real model's 30 layers give it within a thirtieth. (Only here: each layer costs the
    CPU a few milliseconds of its own, which the share tests would rather not spend.)"""
    model_dir = build_tiny_model(
        tmp_path_factory.mktemp("tiny-llama-8-layers"), tokenizer_dir, num_hidden_layers=8
    )
    with slowed_platform(tmp_path_factory, model_dir) as running:
        yield running


def slow_steps(platform: Platform, seconds: float) -> None:
    """Stretch every step by ``seconds``, spread over the decoder layers as a model's own
    compute is (so a higher-priority arrival can cut a step short between layers, as it
    does a real one: engine/step_interrupt.py)."""
    layers = platform.context.engine.engine.model.model.layers
    for layer in layers:
        forward = layer.forward

        def slowed(*args, _forward=forward, **kwargs):
            time.sleep(seconds / len(layers))
            return _forward(*args, **kwargs)

        layer.forward = slowed


def async_client(platform: Platform, tenant: Tenant) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{platform.url}/v1", api_key=tenant.key, max_retries=0, timeout=120
    )


async def completion(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int):
    """Stream one completion; returns (``time.monotonic()`` of its first token, output
    tokens)."""
    first = None
    tokens = 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.monotonic()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return first, tokens


class ClosedLoop:
    """Tenants each keeping ``streams`` completions open until ``stop()``; the output tokens
    of each completion are recorded with its tenant, first-token and end times."""

    def __init__(self, platform: Platform, streams: int, max_tokens: int = MAX_TOKENS):
        self.platform = platform
        self.streams = streams
        self.max_tokens = max_tokens
        self.ended: list[tuple[float, float, str, int]] = []  # (first, end, tenant, tokens)
        self.tasks: list[asyncio.Task] = []
        self._stopping = False

    def start(self, name: str, tenant: Tenant) -> None:
        client = async_client(self.platform, tenant)
        for k in range(self.streams):
            self.tasks.append(asyncio.create_task(self._stream(client, name, k)))

    async def _stream(self, client: openai.AsyncOpenAI, name: str, k: int) -> None:
        i = 0
        while not self._stopping:
            i += 1
            # ~20 prompt tokens, distinct per request (no prefix-cache hits past the start)
            prompt = f"{name} stream {k} request {i}: a story about the sea and a lighthouse."
            first, tokens = await completion(
                client, self.platform.base_model, prompt, self.max_tokens
            )
            self.ended.append((first, time.monotonic(), name, tokens))

    async def stop(self) -> None:
        self._stopping = True
        await asyncio.gather(*self.tasks)

    def tokens(self, start: float, end: float) -> Counter:
        """Output tokens per tenant received in ``[start, end)`` (a completion's spread over
        its stream, so the share is not counted in lumps of whole requests)."""
        counts: Counter = Counter()
        for first, last, name, tokens in self.ended:
            overlap = min(end, last) - max(start, first)
            if last <= first:
                counts[name] += tokens if start <= last < end else 0
            elif overlap > 0:
                counts[name] += tokens * overlap / (last - first)
        return counts


def shares_vs_weights(tokens: Counter, weights: dict[str, float]) -> dict[str, float]:
    """Each tenant's share of ``tokens`` over its weight's share (1.0: exactly its weight)."""
    total_tokens = sum(tokens.values())
    total_weight = sum(weights.values())
    return {t: (tokens[t] / total_tokens) / (w / total_weight) for t, w in weights.items()}


def assert_shares(tokens: Counter, weights: dict[str, float]) -> None:
    ratios = shares_vs_weights(tokens, weights)
    print("tokens", {t: round(n) for t, n in tokens.items()}, "share/weight", ratios)
    for tenant, ratio in ratios.items():
        assert 1 - TOLERANCE <= ratio <= 1 + TOLERANCE, (tenant, ratios, dict(tokens))


async def backlogged_shares(platform: Platform, weights: dict[str, float], seconds: float):
    """Tokens per tenant over a window of at least ``seconds`` that lasts until the lightest
    tenant has had ``LIGHTEST_COMPLETIONS`` completions in it.

    VTC keeps a backlogged tenant within about one request's service of its share, so what a
    window can tell is bounded by how many requests the lightest tenant gets in it, not by
    its seconds: 15 s gave the weight-1 tenant of 1:2:8 some 12-16 requests, and a slow run
    of the CI machine measured it at 0.89 of its weight from one request's lag (about 5%
    at 24 requests).
    """
    loop = ClosedLoop(platform, streams=SLOTS + 4)  # more than all slots: always a backlog
    for name, weight in weights.items():
        loop.start(name, platform.new_tenant(weight=weight))
    await asyncio.sleep(WARM_UP_S)
    start = time.monotonic()
    lightest = min(weights, key=weights.__getitem__)
    await asyncio.sleep(seconds)
    while time.monotonic() - start < MAX_WINDOW_S and (
        sum(1 for first, _, name, _ in loop.ended if name == lightest and first >= start)
        < LIGHTEST_COMPLETIONS
    ):
        await asyncio.sleep(0.5)
    end = time.monotonic()
    await loop.stop()
    return loop.tokens(start, end)


@pytest.mark.parametrize(
    "weights",
    [{"light": 1.0, "heavy": 3.0}, {"w1": 1.0, "w2": 2.0, "w8": 8.0}],
    ids=["1:3", "1:2:8"],
)
def test_backlogged_tenants_receive_tokens_in_proportion_to_their_weights(platform, weights):
    tokens = asyncio.run(backlogged_shares(platform, weights, seconds=15.0))
    assert_shares(tokens, weights)


async def return_after_idle(platform: Platform, busy_s: float, seconds: float):
    weights = {"busy": 1.0, "idle": 1.0}
    tenants = {name: platform.new_tenant(weight=w) for name, w in weights.items()}
    idle_client = async_client(platform, tenants["idle"])
    await completion(idle_client, platform.base_model, "one request, then quiet", MAX_TOKENS)
    loop = ClosedLoop(platform, streams=SLOTS + 4)
    loop.start("busy", tenants["busy"])  # alone: its counter runs far ahead of "idle"'s
    await asyncio.sleep(busy_s)
    loop.start("idle", tenants["idle"])
    start = time.monotonic()
    await asyncio.sleep(seconds)
    await loop.stop()
    # From when the requests "busy" had running at the return have ended.
    return weights, loop.tokens(start + 2.0, start + seconds)


def test_a_tenant_back_from_idle_gets_its_weight_not_banked_credit(platform):
    """ "idle" was served little while "busy" had every slot: back with a backlog, it gets
    its weight's share from the start (with its counter left behind it would take all the
    slots until it caught up, about as long as it was away)."""
    weights, tokens = asyncio.run(return_after_idle(platform, busy_s=10.0, seconds=8.0))
    assert_shares(tokens, weights)


async def ttfts(platform: Platform, tenant: Tenant, n: int, period_s: float) -> list[float]:
    """Seconds to the first token of ``n`` short streamed requests, one every ``period_s``."""
    client = async_client(platform, tenant)
    times = []
    for i in range(n):
        start = time.monotonic()
        first, _ = await completion(client, platform.base_model, f"probe {i}: a colour", 4)
        times.append(first - start)
        await asyncio.sleep(max(0.0, period_s - (time.monotonic() - start)))
    return times


@contextlib.contextmanager
def flood_process(platform: Platform, tenant: Tenant, streams: int) -> Iterator[Callable[[], int]]:
    """Lower-priority streams from a process of their own (flood_client.py); yields a call
    that stops them and returns how many completions they finished."""
    command = [
        *(sys.executable, "-m", "tests.platform.e2e.flood_client"),
        *(platform.url, tenant.key, platform.base_model, str(streams), "48"),
    ]
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT
    )
    finished: list[int] = []

    def stop() -> int:
        if not finished:
            out, _ = process.communicate("", timeout=60)
            finished.append(int(out.split()[-1]))
        return finished[0]

    try:
        yield stop
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def priority_under_flood(platform: Platform, n: int, period_s: float):
    vip = platform.new_tenant(priority=9)
    await ttfts(platform, vip, 3, period_s)  # warm-up
    idle = await ttfts(platform, vip, n, period_s)
    scheduler = platform.context.engine.engine.scheduler
    with flood_process(platform, platform.new_tenant(priority=0), streams=24) as stop_flood:
        await asyncio.sleep(WARM_UP_S)
        waiting = len(scheduler.waiting)  # the flood keeps more than the slots busy
        flooded = await ttfts(platform, vip, n, period_s)
        finished = stop_flood()
    return idle, flooded, waiting, finished


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def test_a_higher_priority_tenant_keeps_its_time_to_first_token_under_a_flood(layered_platform):
    """24 lower-priority streams want three times the slots; a priority-9 tenant's short
    requests keep their idle time to first token: the step in flight is cut short when
    one arrives (step_interrupt.py), and its first step leaves the lower-priority decodes
    out (the scheduler's policy 7). The issue's bounds: median within 1.5x of idle, P99
    within 3x. Without either, the probes wait for the step in flight and share the next
    with 7 decodes; without priority at all they queue behind 16 waiting requests. The
    flood comes from a process of its own, as other clients' requests would."""
    idle, flooded, waiting, finished = asyncio.run(
        priority_under_flood(layered_platform, n=24, period_s=0.25)
    )
    figures = {
        "idle": (statistics.median(idle), p99(idle)),
        "flood": (statistics.median(flooded), p99(flooded)),
    }
    print("TTFT median, P99", figures, "flood: waiting", waiting, "finished", finished)
    assert waiting > 0 and finished > 0, (waiting, finished)  # more streams than slots
    assert statistics.median(flooded) <= 1.5 * statistics.median(idle), figures
    assert p99(flooded) <= 3 * p99(idle), figures
