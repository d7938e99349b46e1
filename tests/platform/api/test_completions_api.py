"""The OpenAI-compatible inference routes, driven by the official ``openai`` client against
a real uvicorn server over the tiny model: results, streaming, parameters, errors, limits,
budget and metering."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from loramux.engine import Engine, EngineConfig, SamplingParams
from tests.platform.api.conftest import (
    assert_openai_error,
    speculation_totals,
    store_ready_adapter,
)
from tests.platform.api.slowed_platform import sse_events, tenant_headers
from tests.platform.raw_http import request_then_leave

PROMPT = "The quick brown fox"


def reference_engine(context) -> Engine:
    """A second engine on the same weights, outside the server."""
    return Engine(
        EngineConfig(
            model=str(context.base_model.path),
            kv_cache_bytes=context.settings.engine.cache.kv_cache_bytes,
        )
    )


def stream_text(chunks, attr: str) -> tuple[dict[int, str], list]:
    texts: dict[int, str] = {}
    usage = []
    for chunk in chunks:
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for choice in chunk.choices:
            piece = choice.text if attr == "text" else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
    return texts, usage


def test_greedy_completion_matches_the_engine_and_streams_the_same(make_client, context, base):
    client, _ = make_client()
    result = client.completions.create(model=base, prompt=PROMPT, max_tokens=12, temperature=0)
    reference = reference_engine(context).generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0)
    )[0]

    assert result.object == "text_completion" and result.model == base
    assert result.choices[0].text == reference.text
    assert result.choices[0].finish_reason == reference.finish_reason
    assert result.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert result.usage.completion_tokens == len(reference.token_ids)
    assert result.usage.total_tokens == result.usage.prompt_tokens + len(reference.token_ids)

    chunks = list(
        client.completions.create(
            model=base,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts, usage = stream_text(chunks, "text")
    assert texts == {0: reference.text}
    assert len(usage) == 1 and chunks[-1].usage is not None and chunks[-1].choices == []
    assert usage[0].completion_tokens == len(reference.token_ids)
    assert usage[0].prompt_tokens == result.usage.prompt_tokens


def test_chat_and_its_stream_agree(make_client, base):
    client, _ = make_client()
    messages = [{"role": "user", "content": "Say hello."}]
    result = client.chat.completions.create(
        model=base, messages=messages, max_completion_tokens=10, temperature=0
    )
    assert result.object == "chat.completion"
    message = result.choices[0].message
    assert message.role == "assistant" and message.content
    assert result.usage.completion_tokens >= 1

    stream = client.chat.completions.create(
        model=base,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    texts, usage = stream_text(chunks, "delta")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert texts == {0: message.content}
    assert usage[-1].completion_tokens == result.usage.completion_tokens
    assert usage[-1].prompt_tokens == result.usage.prompt_tokens

    plain = list(
        client.chat.completions.create(
            model=base, messages=messages, max_tokens=4, temperature=0, stream=True
        )
    )
    assert all(chunk.usage is None for chunk in plain)


def test_n_seed_and_stop(make_client, base):
    client, _ = make_client()
    two = client.completions.create(model=base, prompt=PROMPT, max_tokens=6, n=2, seed=3)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert 2 <= two.usage.completion_tokens <= 12  # both choices' tokens, summed
    again = client.completions.create(model=base, prompt=PROMPT, max_tokens=6, n=2, seed=3)
    assert [c.text for c in again.choices] == [c.text for c in two.choices]

    streamed = client.completions.create(
        model=base, prompt=PROMPT, max_tokens=6, n=2, seed=3, stream=True
    )
    texts, _ = stream_text(streamed, "text")
    assert texts == {c.index: c.text for c in two.choices}

    full = client.completions.create(model=base, prompt=PROMPT, max_tokens=16, temperature=0)
    text = full.choices[0].text
    middle = len(text) // 2
    stop = text[middle : middle + 2]
    assert stop, text
    cut = client.completions.create(
        model=base, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "\u2603\u2603"]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs(make_client, base):
    client, _ = make_client()
    result = client.completions.create(
        model=base, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    logprobs = result.choices[0].logprobs
    count = result.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == count
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == count
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert logprobs.text_offset[0] == 0

    chat = client.chat.completions.create(
        model=base,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(item.top_logprobs) == 2 for item in content)
    # greedy: the chosen token is the most likely one
    assert all(item.logprob == pytest.approx(item.top_logprobs[0].logprob) for item in content)


def test_errors(make_client, server, base):
    client, _ = make_client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    bad = [{"temperature": -1}, {"top_p": 2}, {"max_tokens": -5}, {"presence_penalty": 3}]
    for params in bad:
        with pytest.raises((openai.BadRequestError, openai.UnprocessableEntityError)) as info:
            client.completions.create(model=base, prompt=PROMPT, **{"max_tokens": 2, **params})
        assert next(iter(params)) in str(info.value)
    with pytest.raises((openai.BadRequestError, openai.UnprocessableEntityError)):
        client.chat.completions.create(
            model=base, messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    stranger = openai.OpenAI(base_url=f"{server.url}/v1", api_key="lmx-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.completions.create(model=base, prompt=PROMPT, max_tokens=2)
    missing = httpx.post(f"{server.url}/v1/completions", json={"model": base, "prompt": "x"})
    assert missing.status_code == 401
    # Checked before a stream starts: the same 400 streamed or not, not a 200 with an error.
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match=r"prompt token ids must be in \[0, "):
            client.completions.create(model=base, prompt=[1, 49152], max_tokens=2, stream=stream)


def test_rate_limit_and_budget(make_client, base):
    limited, _ = make_client(requests_per_minute=1)
    limited.completions.create(model=base, prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.RateLimitError) as info:
        limited.completions.create(model=base, prompt=PROMPT, max_tokens=2)
    assert int(info.value.response.headers["retry-after"]) >= 1

    # A budget of 300 µ$ at 100 µ$ per output token: a request of 2 tokens may cost 200, so
    # the first passes and spends 200; the second could reach 400: refused.
    broke, _ = make_client(monthly_budget_usd=0.0003, output_price_per_mtok=100.0)
    exact = {"max_tokens": 2, "extra_body": {"ignore_eos": True}}
    assert broke.completions.create(model=base, prompt=PROMPT, **exact).usage.completion_tokens == 2
    with pytest.raises(openai.APIStatusError) as refused:
        broke.completions.create(model=base, prompt=PROMPT, **exact)
    assert refused.value.status_code == 402
    assert "budget" in refused.value.message.lower()


def test_usage_returned_equals_the_billing_export(make_client, server, context, base):
    client, tenant_id = make_client(
        input_price_per_mtok=1.5, cached_input_price_per_mtok=0.5, output_price_per_mtok=7.0
    )
    usages = [
        client.completions.create(model=base, prompt=PROMPT, max_tokens=5).usage,
        client.completions.create(model=base, prompt=PROMPT, max_tokens=3, n=2).usage,
        client.chat.completions.create(
            model=base, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        ).usage,
    ]
    for chunk in client.completions.create(
        model=base,
        prompt=PROMPT,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usages.append(chunk.usage)
    assert len(usages) == 4

    report = httpx.get(
        f"{server.url}/admin/usage",
        params={"tenant_id": tenant_id},
        headers={"Authorization": f"Bearer {context.admin_token}"},
    )
    assert report.status_code == 200, report.text
    totals = report.json()["totals"]
    assert totals["requests"] == 4
    assert totals["prompt_tokens"] == sum(u.prompt_tokens for u in usages)
    assert totals["completion_tokens"] == sum(u.completion_tokens for u in usages)
    cost = sum(u.model_extra["cost_micro_usd"] for u in usages)
    assert totals["cost_micro_usd"] == cost > 0


def test_adapter_by_model_name_and_by_path(make_client, server, context, make_adapter):
    client, tenant_id = make_client()
    adapter_dir = make_adapter(context.base_model.path, rank=4, seed=1, std=0.2)
    store_ready_adapter(context, tenant_id, "support", adapter_dir)

    engine = reference_engine(context)
    engine.add_adapter("support", adapter_dir)
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = engine.generate([PROMPT], params, adapters=["support"])[0].text
    plain = engine.generate([PROMPT], params)[0].text
    assert expected != plain  # the adapter matters

    by_name = client.completions.create(model="support", prompt=PROMPT, max_tokens=8, temperature=0)
    assert by_name.choices[0].text == expected and by_name.model == "support"
    by_path = client.post(
        "/adapters/support/completions",
        body={"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        cast_to=httpx.Response,
    )
    assert by_path.json()["choices"][0]["text"] == expected

    other, _ = make_client()
    with pytest.raises(openai.NotFoundError):
        other.completions.create(model="support", prompt=PROMPT, max_tokens=2)


def test_a_dropped_stream_bills_only_what_was_delivered(make_client, server, context, base):
    client, tenant_id = make_client(output_price_per_mtok=1.0)
    body = {"model": base, "prompt": PROMPT, "max_tokens": 480, "stream": True}
    headers = {"Authorization": f"Bearer {client.api_key}"}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # the client is gone after one chunk: the record is written when the server notices

    admin = {"Authorization": f"Bearer {context.admin_token}"}
    deadline = time.monotonic() + 20
    while True:
        totals = httpx.get(
            f"{server.url}/admin/usage", params={"tenant_id": tenant_id}, headers=admin
        ).json()["totals"]
        if totals["requests"]:
            break
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out waiting for the dropped stream's usage record (tenant {tenant_id})"
            )
        time.sleep(0.1)
    assert totals["requests"] == 1
    assert 1 <= totals["completion_tokens"] < 480


def test_a_prompt_longer_than_the_context_is_a_400(make_client, base):
    client, _ = make_client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=base, prompt="word " * 2000, max_tokens=2)
    assert "context" in str(info.value)


def test_deleting_an_adapter_mid_stream_frees_it_once_the_stream_ends(
    make_client, server, context, make_adapter
):
    client, tenant_id = make_client()
    adapter_dir = make_adapter(context.base_model.path, rank=4, seed=2, std=0.2)
    version_id = store_ready_adapter(context, tenant_id, "leaving", adapter_dir)
    headers = {"Authorization": f"Bearer {client.api_key}"}
    body = {"model": "leaving", "prompt": PROMPT, "max_tokens": 64, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60
    ) as streamed:
        lines = streamed.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        deleted = httpx.delete(f"{server.url}/v1/adapters/leaving", headers=headers)
        assert deleted.status_code == 204, deleted.text  # not refused while in use
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    # The engine forgets the version once its stream has ended.
    deadline = time.monotonic() + 10
    while version_id in asyncio.run(context.engine.list_adapters()):
        assert time.monotonic() < deadline, "the deleted version was never unregistered"
        time.sleep(0.1)
    gone = httpx.post(
        f"{server.url}/v1/completions", json={**body, "stream": False}, headers=headers
    )
    assert gone.status_code == 404


def test_min_tokens_and_ignore_eos_extensions_give_exact_lengths(make_client, base):
    client, _ = make_client()
    exact = {"min_tokens": 24, "ignore_eos": True}
    result = client.completions.create(
        model=base, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=exact
    )
    assert result.usage.completion_tokens == 24
    assert result.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.completions.create(
            model=base, prompt=PROMPT, max_tokens=4, extra_body={"min_tokens": 9}
        )


def _usage_totals(server, context, tenant_id: str) -> dict:
    admin = {"Authorization": f"Bearer {context.admin_token}"}
    report = httpx.get(f"{server.url}/admin/usage", params={"tenant_id": tenant_id}, headers=admin)
    assert report.status_code == 200, report.text
    return report.json()["totals"]


def test_a_non_streamed_request_whose_client_leaves_is_aborted_and_billed_its_prefill(
    make_client, server, context, base
):
    client, tenant_id = make_client(output_price_per_mtok=1.0)
    engine = context.engine.engine
    body = {"model": base, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
    generated = engine.metrics.registry.get_sample_value
    before = generated("loramux_generated_tokens_total")
    with request_then_leave(server.url, "/v1/completions", client.api_key, body):
        deadline = time.monotonic() + 20
        while generated("loramux_generated_tokens_total") == before:  # prefilled: now leave
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.005)

    deadline = time.monotonic() + 20
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine kept running the abandoned request"
        time.sleep(0.05)
    assert generated("loramux_generated_tokens_total") - before < 480  # aborted long before
    time.sleep(0.5)  # the run's end (and its billing) follows the abort at once
    # Nothing was delivered, but the engine's work was not free: its prompt is billed.
    totals = _usage_totals(server, context, tenant_id)
    prompt_tokens = len(context.engine.tokenizer(PROMPT)["input_ids"])
    assert (totals["requests"], totals["prompt_tokens"], totals["completion_tokens"]) == (
        1,
        prompt_tokens,
        0,
    )


def test_max_tokens_must_fit_the_context_and_defaults_fit_the_limits(make_client, context, base):
    client, _ = make_client()
    context_len = context.engine.max_model_len
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=base, prompt=PROMPT, max_tokens=context_len)
    assert info.value.code == "context_length_exceeded"
    assert f"maximum context length is {context_len}" in info.value.message

    # Chat without max_tokens defaults to the rest of the context; a tokens/minute limit of
    # 64 could never reserve that, so the request gets what fits in the bucket and stops.
    messages = [{"role": "user", "content": "Hi"}]
    limited, _ = make_client(tokens_per_minute=64)
    chat = limited.chat.completions.create(
        model=base, messages=messages, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 64

    # With a monthly budget the default stops at what the budget affords: 5,000 µ$ at
    # 100 µ$ per output token (input free) is 50 tokens.
    budgeted, _ = make_client(monthly_budget_usd=0.005, output_price_per_mtok=100.0)
    chat = budgeted.chat.completions.create(
        model=base, messages=messages, extra_body={"ignore_eos": True}
    )
    assert (chat.choices[0].finish_reason, chat.usage.completion_tokens) == ("length", 50)


def test_parallel_requests_cannot_overshoot_the_budget(make_client, server, context, base):
    # Each request may cost 20 tokens × 100 µ$ = 2,000 µ$; a 5,000 µ$ budget holds two.
    client, tenant_id = make_client(monthly_budget_usd=0.005, output_price_per_mtok=100.0)
    barrier = threading.Barrier(4)

    def request(_: int) -> int:
        barrier.wait(timeout=30)
        try:
            client.completions.create(
                model=base, prompt=PROMPT, max_tokens=20, extra_body={"ignore_eos": True}
            )
        except openai.APIStatusError as refused:
            return refused.status_code
        return 200

    with ThreadPoolExecutor(max_workers=4) as pool:
        statuses = sorted(pool.map(request, range(4)))
    assert statuses == [200, 200, 402, 402]
    assert _usage_totals(server, context, tenant_id)["cost_micro_usd"] == 4_000


LOOPING = "one two three one two three one two"  # greedy text the n-gram proposer predicts
EXACT = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


def _streamed_text(response, attr: str) -> str:
    assert response.status_code == 200, response.text
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    return "".join(
        choice["text"] if attr == "text" else choice["delta"].get("content") or ""
        for event in events[:-1]
        for choice in event["choices"]
    )


def test_speculative_false_opts_a_request_out_streamed_or_not(speculating):
    """On an engine that speculates, ``speculative: false`` requests (completions and chat,
    streamed or not) are decoded without proposals; the default speculates; the text and
    the billed tokens are the same either way."""
    client, context = speculating
    _, headers = tenant_headers(client, context)
    model = context.base_model.model_id
    completion = {"model": model, "prompt": LOOPING, **EXACT}
    chat = {"model": model, "messages": [{"role": "user", "content": LOOPING}], **EXACT}

    def post(path: str, body: dict):
        response = client.post(path, json=body, headers=headers)
        assert response.status_code == 200, response.text
        return response

    out = {"speculative": False}
    plain = post("/v1/completions", {**completion, **out}).json()
    plain_chat = post("/v1/chat/completions", {**chat, **out}).json()
    streamed = _streamed_text(
        post("/v1/completions", {**completion, **out, "stream": True}), "text"
    )
    streamed_chat = _streamed_text(
        post("/v1/chat/completions", {**chat, **out, "stream": True}), "delta"
    )
    totals = speculation_totals(client, context)
    assert totals["proposed_tokens"] == 0 and totals["generated_tokens"] == 4 * 24
    assert totals["tokens_per_step"] == 1.0

    fast = post("/v1/completions", completion).json()
    fast_streamed = _streamed_text(post("/v1/completions", {**completion, "stream": True}), "text")
    fast_chat = post("/v1/chat/completions", {**chat, "speculative": True}).json()
    totals = speculation_totals(client, context)
    assert totals["proposed_tokens"] > 0 and totals["accepted_tokens"] > 0
    assert plain["choices"][0]["text"] == streamed == fast["choices"][0]["text"] == fast_streamed
    message = plain_chat["choices"][0]["message"]["content"]
    assert message == streamed_chat == fast_chat["choices"][0]["message"]["content"]
    # Billed: the emitted tokens, however many steps they took (the prompt's the same).
    for slow, quick in ((plain, fast), (plain_chat, fast_chat)):
        assert _billed(slow) == _billed(quick) == (_billed(quick)[0], 24)


def test_a_draft_model_speculates_over_http_and_changes_no_text(drafting):
    """``LORAMUX_ENGINE_SPECULATIVE_METHOD=draft``: completions and chat, streamed or not,
    give the text the same requests get without proposals, billed alike; the operator's
    view says a draft model proposed."""
    client, context = drafting
    _, headers = tenant_headers(client, context)
    model = context.base_model.model_id
    completion = {"model": model, "prompt": LOOPING, **EXACT}
    chat = {"model": model, "messages": [{"role": "user", "content": LOOPING}], **EXACT}

    def post(path: str, body: dict):
        response = client.post(path, json=body, headers=headers)
        assert response.status_code == 200, response.text
        return response

    plain = post("/v1/completions", {**completion, "speculative": False}).json()
    plain_chat = post("/v1/chat/completions", {**chat, "speculative": False}).json()
    assert speculation_totals(client, context)["proposed_tokens"] == 0
    drafted = post("/v1/completions", completion).json()
    drafted_chat = post("/v1/chat/completions", chat).json()
    streamed = _streamed_text(post("/v1/completions", {**completion, "stream": True}), "text")
    assert plain["choices"][0]["text"] == drafted["choices"][0]["text"] == streamed
    message = plain_chat["choices"][0]["message"]["content"]
    assert message == drafted_chat["choices"][0]["message"]["content"]
    assert _billed(plain) == _billed(drafted) and _billed(plain_chat) == _billed(drafted_chat)
    admin = {"Authorization": f"Bearer {context.admin_token}"}
    speculation = client.get("/admin/engine", headers=admin).json()["speculation"]
    assert speculation["method"] == "draft"
    assert speculation["total"]["proposed_tokens"] > 0


def _billed(body: dict) -> tuple[int, int]:
    return body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]


def test_a_speculative_that_is_not_a_boolean_is_refused_by_name(client, context):
    """As every field of the wrong JSON type: a 422 naming it (strict: no "false" nor 0)."""
    _, headers = tenant_headers(client, context)
    model = context.base_model.model_id
    for path, body in (
        ("/v1/completions", {"model": model, "prompt": "Hi"}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi"}]}),
    ):
        for value, stream in (("false", False), (0, True), (None, False), ([False], True)):
            response = client.post(
                path, json={**body, "stream": stream, "speculative": value}, headers=headers
            )
            error = assert_openai_error(response, 422)
            assert error["message"].startswith("speculative: "), error
            assert error["code"] == "invalid_parameters"
