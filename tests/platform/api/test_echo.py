"""``echo`` and prompt logprobs in ``/v1/completions``, as lm-evaluation-harness scores
multiple-choice tasks: the completion starts with its prompt, the logprobs object with the
prompt's tokens (the first one's logprob and top_logprobs null), ``max_tokens: 0`` scores
the prompt alone; streamed, batched, billed, and the 400s."""

from __future__ import annotations

import openai
import pytest

from loramux.engine import Engine, EngineConfig, SamplingParams
from tests.platform.api.conftest import usage_rows

PROMPT = "The capital of France is Paris"


@pytest.fixture
def reference(context):
    """The prompt scored by an engine of its own (outside the server)."""
    engine = Engine(
        EngineConfig(
            model=str(context.base_model.path),
            kv_cache_bytes=context.settings.engine.cache.kv_cache_bytes,
        )
    )

    def score(prompt, top: int = 2):
        return engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=top))[0]

    return score


def _token_texts(tokenizer, ids) -> list[str]:
    return [tokenizer.decode([token]) for token in ids]


def test_max_tokens_0_with_echo_scores_the_prompt(make_client, server, context, base, reference):
    client, tenant_id = make_client()
    scored = reference(PROMPT)
    ids = scored.prompt_token_ids
    result = client.completions.create(
        model=base, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0
    )
    choice = result.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"

    logprobs = choice.logprobs
    tokenizer = context.engine.tokenizer
    assert logprobs.tokens == _token_texts(tokenizer, ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = [entry.logprob for entry in scored.prompt_logprobs[1:]]
    assert logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
    for top, entry in zip(logprobs.top_logprobs[1:], scored.prompt_logprobs[1:], strict=True):
        assert list(top.values()) == pytest.approx([lp for _, lp in entry.top], abs=1e-5)
        assert len(top) == 2
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(ids))]
    assert logprobs.text_offset == offsets

    # Nothing was generated, yet the prompt was computed and its logprobs delivered: billed.
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(ids), 0)
    rows = usage_rows(server, context, tenant_id)
    assert [(r["request_id"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [
        (result.id, len(ids), 0)
    ]


def test_echo_with_generation_puts_the_prompt_first(make_client, base, context, reference):
    client, _ = make_client()
    plain = client.completions.create(model=base, prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(
        model=base, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1
    )
    choice = echoed.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    prompt_tokens = len(reference(PROMPT).prompt_token_ids)
    generated = echoed.usage.completion_tokens
    assert len(choice.logprobs.tokens) == prompt_tokens + generated
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[1:])
    # The generated tokens' offsets continue after the echoed prompt.
    assert choice.logprobs.text_offset[prompt_tokens] == len(PROMPT)

    # Without logprobs: the text alone; with a token-id prompt, its decoded text.
    text_only = client.completions.create(
        model=base, prompt=PROMPT, max_tokens=4, temperature=0, echo=True
    )
    assert text_only.choices[0].text == choice.text and text_only.choices[0].logprobs is None
    ids = context.engine.tokenizer(PROMPT)["input_ids"]
    by_ids = client.completions.create(model=base, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert by_ids.choices[0].text == context.engine.tokenizer.decode(ids)
    assert by_ids.choices[0].logprobs.top_logprobs[1] == {}  # logprobs 0: the token alone


def test_an_echoed_stream_carries_the_prompt_in_its_first_chunk(make_client, base):
    client, _ = make_client()
    whole = client.completions.create(
        model=base, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=1
    )
    chunks = [
        chunk.choices[0]
        for chunk in client.completions.create(
            model=base,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            echo=True,
            logprobs=1,
            stream=True,
        )
        if chunk.choices
    ]
    assert chunks[0].text.startswith(PROMPT)
    assert "".join(c.text for c in chunks) == whole.choices[0].text
    streamed = [lp for c in chunks for lp in c.logprobs.token_logprobs]
    assert streamed[0] is None
    assert streamed == pytest.approx(whole.choices[0].logprobs.token_logprobs[:1] + streamed[1:])
    assert streamed[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:], abs=1e-5)
    offsets = [o for c in chunks for o in c.logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset

    # Scoring only: one chunk holds the prompt and the finish reason.
    only = [
        chunk.choices[0]
        for chunk in client.completions.create(
            model=base, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0, stream=True
        )
        if chunk.choices
    ]
    assert [(c.text, c.finish_reason) for c in only] == [(PROMPT, "length")]


def test_a_batch_of_echoed_prompts_each_with_n_choices(make_client, base):
    client, _ = make_client()
    prompts = [PROMPT, "Two plus two is four"]
    result = client.completions.create(
        model=base, prompt=prompts, n=2, max_tokens=0, echo=True, logprobs=0
    )
    assert [(c.index, c.text) for c in result.choices] == [
        (0, prompts[0]),
        (1, prompts[0]),
        (2, prompts[1]),
        (3, prompts[1]),
    ]
    first, second = result.choices[0].logprobs, result.choices[2].logprobs
    assert first.token_logprobs[0] is None and second.token_logprobs[0] is None
    assert result.choices[1].logprobs.token_logprobs == first.token_logprobs


def test_max_tokens_0_needs_echo(make_client, base, context):
    client, _ = make_client()
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="0 is allowed only with echo"):
            client.completions.create(model=base, prompt=PROMPT, max_tokens=0, stream=stream)
    with pytest.raises(openai.BadRequestError, match="logprobs must be None or in"):
        client.completions.create(model=base, prompt=PROMPT, max_tokens=0, echo=True, logprobs=21)
    # A scored prompt may fill the context (nothing is generated); one token more may not.
    length = context.engine.max_model_len
    full = client.completions.create(model=base, prompt=[5] * length, max_tokens=0, echo=True)
    assert full.usage.prompt_tokens == length
    with pytest.raises(openai.BadRequestError, match="context limit"):
        client.completions.create(model=base, prompt=[5] * (length + 1), max_tokens=0, echo=True)
