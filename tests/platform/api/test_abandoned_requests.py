"""A client that leaves a non-streamed prompt list mid-prefill: the engine stops within a
step or so, and the request is billed for the prompt tokens the engine prefilled for it
(abandoning work is never free), exactly once, with no completion tokens.

The app runs on a real uvicorn server and the client is a bare socket closed mid-request,
so the disconnect travels the way it does in production."""

from __future__ import annotations

import random
from collections import Counter

import httpx

from loramux.platform.app import create_app
from loramux.platform.services.metering import Meter
from tests.fixtures.browser import ServerThread
from tests.fixtures.polling import eventually
from tests.platform.api.conftest import platform_context, usage_rows
from tests.platform.api.slowed_platform import completion, engine_idle, slow_steps, tenant_headers
from tests.platform.raw_http import request_then_leave

PROMPTS = 16
PROMPT_TOKENS = 300
STEP_TOKENS = 64  # max_num_batched_tokens: the 4,800 prompt tokens take ~75 steps
LEAVE_AFTER_STEPS = 12  # mid-prefill
STEPS_AFTER_LEAVING = 3  # the step running when the client left, and the abort's turn


def _distinct_prompts(vocab: int) -> list[list[int]]:
    """Prompts of random token ids: no prefix-cache hits between them."""
    rng = random.Random(7)
    return [[rng.randrange(100, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]


def _prefilled(step_log: list) -> int:
    """The prompt tokens the engine computed, per sequence capped at its prompt (a
    sequence whose prefill ended decodes after it)."""
    computed: Counter[str] = Counter()
    for step in step_log:
        for request_id, _, tokens in step:
            computed[request_id] += tokens
    return sum(min(tokens, PROMPT_TOKENS) for tokens in computed.values())


def test_a_client_leaving_a_prompt_list_stops_the_engine_and_pays_its_prefill(
    tmp_path, tiny_model_dir, postgres_database_url
):
    with (
        platform_context(
            tmp_path, tiny_model_dir, postgres_database_url, max_num_batched_tokens=STEP_TOKENS
        ) as context,
        ServerThread(create_app(context)) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        step_log = slow_steps(context)
        tenant_id, headers = tenant_headers(client, context)
        key = headers["Authorization"].removeprefix("Bearer ")
        scheduler = context.engine.engine.scheduler
        body = completion(
            context,
            prompt=_distinct_prompts(len(context.engine.tokenizer)),
            max_tokens=100,
            ignore_eos=True,
        )
        start = scheduler.step_count
        with request_then_leave(server.url, "/v1/completions", key, body):
            eventually(
                lambda: scheduler.step_count >= start + LEAVE_AFTER_STEPS,
                "the prefill to be under way",
                interval_s=0.002,
            )
            left_at = scheduler.step_count
        engine_idle(context)
        assert scheduler.step_count - left_at <= STEPS_AFTER_LEAVING, (
            f"the engine ran {scheduler.step_count - left_at} steps after the client left"
        )
        assert len(step_log) < PROMPTS * PROMPT_TOKENS // STEP_TOKENS  # far from done

        rows = eventually(lambda: usage_rows(server, context, tenant_id), "the usage record", 10)
        assert len(rows) == 1, rows
        record = Meter(context.sessions).stored(rows[0]["request_id"])
        assert record.completion_tokens == 0
        assert 0 < record.prompt_tokens <= PROMPTS * PROMPT_TOKENS
        assert record.prompt_tokens == _prefilled(step_log)
        assert record.cached_prompt_tokens == 0
        assert record.finish_reason == "abort"
