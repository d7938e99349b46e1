"""``prompt`` as a batch in ``/v1/completions`` (and per adapter): a list of strings or of
token-id lists, ``n`` choices each, indexed prompt-major as OpenAI does, streamed and not,
one usage record summing the batch; the bounds and the 400s that name the prompt."""

from __future__ import annotations

import openai
import pytest

from loramux.platform.services.prompts import MAX_SEQUENCES
from tests.platform.api.conftest import store_ready_adapter, usage_rows

PROMPTS = ["The quick brown fox", "Once upon a time", "def fibonacci(n):"]
GREEDY = {"max_tokens": 6, "temperature": 0}


def _alone(client, model: str, prompt) -> tuple[str, int, int]:
    """The prompt's greedy completion on its own: text, prompt and completion tokens."""
    result = client.completions.create(model=model, prompt=prompt, **GREEDY)
    return result.choices[0].text, result.usage.prompt_tokens, result.usage.completion_tokens


def test_a_batch_of_strings_gets_n_choices_each_indexed_prompt_major(make_client, base):
    client, _ = make_client()
    alone = [_alone(client, base, prompt) for prompt in PROMPTS]

    batch = client.completions.create(model=base, prompt=PROMPTS, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == list(range(6))
    for choice in batch.choices:
        assert choice.text == alone[choice.index // 2][0]  # index = prompt_index * n + i
    assert batch.usage.prompt_tokens == 2 * sum(a[1] for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a[2] for a in alone)


def test_a_batch_of_token_id_lists_and_its_stream(make_client, base, context):
    client, _ = make_client()
    tokenizer = context.engine.tokenizer
    ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    alone = [_alone(client, base, prompt) for prompt in ids]

    batch = client.completions.create(model=base, prompt=ids, **GREEDY)
    assert [(c.index, c.text) for c in batch.choices] == [(i, a[0]) for i, a in enumerate(alone)]

    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(
        model=base,
        prompt=ids,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    ):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert texts == {i: alone[i // 2][0] for i in range(6)}
    assert set(finished) == set(range(6))
    assert usage.completion_tokens == 2 * sum(a[2] for a in alone)
    assert usage.prompt_tokens == 2 * sum(len(prompt) for prompt in ids)


def test_one_usage_record_per_batched_request(make_client, server, context, base):
    client, tenant_id = make_client()
    batch = client.completions.create(model=base, prompt=PROMPTS[:2], n=2, **GREEDY)
    rows = usage_rows(server, context, tenant_id)
    assert [row["request_id"] for row in rows] == [batch.id]
    assert rows[0]["prompt_tokens"] == batch.usage.prompt_tokens
    assert rows[0]["completion_tokens"] == batch.usage.completion_tokens


def test_an_adapters_own_route_takes_a_batch(make_client, context, make_adapter):
    client, tenant_id = make_client()
    adapter_dir = make_adapter(context.base_model.path, rank=4, seed=3, std=0.2)
    store_ready_adapter(context, tenant_id, "batcher", adapter_dir)
    alone = [_alone(client, "batcher", prompt)[0] for prompt in PROMPTS[:2]]
    by_path = client.post(
        "/adapters/batcher/completions",
        body={"prompt": PROMPTS[:2], **GREEDY},
        cast_to=object,
    )
    assert [c["text"] for c in by_path["choices"]] == alone


def test_bad_prompts_in_a_batch_are_400s_naming_the_prompt(make_client, base):
    client, _ = make_client()
    for stream in (False, True):
        cases = [
            (["fine", ""], r"prompt\[1\] is empty"),
            ([[1, 2], [3, 49152]], r"prompt\[1\] token ids must be in \[0, 49152\)"),
            ([], "prompt is empty"),
            ([[]], "prompt is empty"),
            (["fine", "word " * 2000], r"prompt\[1\] has \d+ tokens; the context limit"),
        ]
        for prompt, message in cases:
            with pytest.raises(openai.BadRequestError, match=message):
                client.completions.create(model=base, prompt=prompt, max_tokens=2, stream=stream)


def test_a_batch_over_the_limit_is_a_400_naming_it(make_client, base):
    client, _ = make_client()
    too_many = ["x"] * (MAX_SEQUENCES // 4 + 1)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=base, prompt=too_many, n=4, max_tokens=1)
    assert f"a request may run at most {MAX_SEQUENCES}" in info.value.message
    assert f"{len(too_many) * 4} sequences" in info.value.message
    at_limit = client.completions.create(
        model=base, prompt=["x"] * (MAX_SEQUENCES // 16), n=16, max_tokens=1
    )
    assert len(at_limit.choices) == MAX_SEQUENCES


def test_the_queue_counts_each_sequence_of_a_batch(make_client, base):
    client, _ = make_client(max_queued_requests=3)
    with pytest.raises(openai.BadRequestError, match=r"4 sequences .* limit of 3 queued"):
        client.completions.create(model=base, prompt=PROMPTS[:2], n=2, max_tokens=1)
    assert len(client.completions.create(model=base, prompt=PROMPTS, max_tokens=1).choices) == 3


def test_the_rate_limit_reserves_every_sequence(make_client, base, context):
    # 3 prompts x (their tokens + 16) pass 48 tokens/minute; one of them alone fits.
    client, _ = make_client(tokens_per_minute=48)
    assert client.completions.create(model=base, prompt=PROMPTS[0], max_tokens=16)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=base, prompt=PROMPTS, max_tokens=16)
