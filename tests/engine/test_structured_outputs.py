"""Structured outputs inside the engine's batch.

With the real SmolLM2 (greedy and seeded): JSON that parses, JSON valid against a strict
schema (with and without an adapter, ``n > 1``), tool calls that parse, stop strings and
max_tokens cutting a document short, a bad schema refused before anything is queued,
preemption, and unconstrained requests whose tokens do not change beside constrained ones.

With the tiny random model (the grammar alone makes its output valid), the mechanics: a
re-run step (isolation) or a step cut short never advances a matcher twice, the grammar wins
over min_tokens and ignore_eos and applies after logit bias, a refused token fails only its
request, an unconstrained engine builds nothing, and AsyncEngine compiles off its thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter

import jsonschema
import pytest

from loramux.engine import (
    AsyncEngine,
    EngineError,
    JsonObject,
    JsonSchema,
    SamplingParams,
    Tool,
    ToolCalls,
    ToolChoice,
    format_instructions,
    parse_tool_output,
)
from loramux.engine.structured import GrammarMatcher
from loramux.kernels import dispatch
from tests.engine.factories import PROMPTS, UNTIMED_PREFILL_S, build_engine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
# Bounded (a number below 100; JSON whitespace is bounded too): the random model must finish.
SMALL = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["n"],
    "additionalProperties": False,
}
WEATHER = Tool(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
    strict=True,
)
# The adapter test_exactness uses on SmolLM2 (make_adapter caches it for the session).
ADAPTER = {"rank": 4, "targets": ("q_proj", "v_proj"), "seed": 1}


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)


def seeded(seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=seed, **kwargs)


def chat(engine, question: str, system: str | None = None) -> str:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": question})
    return engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def assert_valid(out, schema) -> dict:
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    value = json.loads(out.text)
    jsonschema.validate(value, schema)
    return value


# --- the real SmolLM2 ------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(smollm2_dir, make_adapter):
    adapters = {"r4-qv": make_adapter(smollm2_dir, **ADAPTER)}
    return build_engine(smollm2_dir, adapters, kv_cache_bytes=64 << 20, max_model_len=512)


@pytest.mark.slow
def test_json_object_output_parses(engine):
    questions = [
        'Answer in JSON: {"answer": ...}. What is the capital of France?',
        'Give a JSON object with keys "city" and "country" for Paris.',
    ]
    prompts = [chat(engine, q) for q in questions] * 2
    spec = {"max_tokens": 48, "structured": JsonObject()}
    params = [greedy(**spec), greedy(**spec), seeded(1, **spec), seeded(2, **spec)]
    for out in engine.generate(prompts, params):
        assert out.finish_reason == "stop", out.text
        assert isinstance(json.loads(out.text), dict)


@pytest.mark.slow
def test_strict_schema_output_validates_for_each_of_n_sequences(engine):
    prompt = chat(engine, "Describe a person as JSON with name, age and city.")
    spec = {"max_tokens": 120, "structured": JsonSchema(PERSON)}
    # n = 3 sampled sequences of one request (each its own matcher) beside the greedy one.
    params = [greedy(**spec), seeded(11, **spec), seeded(12, **spec), seeded(13, **spec)]
    outs = engine.generate([prompt] * 4, params)
    values = [assert_valid(out, PERSON) for out in outs]
    assert len({json.dumps(v) for v in values[1:]}) > 1  # the sequences went their own ways


@pytest.mark.slow
def test_strict_schema_output_validates_with_an_adapter(engine):
    prompt = chat(engine, "Describe a person as JSON with name, age and city.")
    spec = {"max_tokens": 120, "structured": JsonSchema(PERSON)}
    outs = engine.generate([prompt] * 2, [greedy(**spec), seeded(5, **spec)], ["r4-qv"] * 2)
    for out in outs:
        assert out.adapter == "r4-qv"
        assert_valid(out, PERSON)


@pytest.mark.slow
def test_unconstrained_tokens_do_not_change_beside_constrained_requests(engine):
    plain = [greedy(max_tokens=10, ignore_eos=True), seeded(7, max_tokens=10, ignore_eos=True)]
    alone = engine.generate(PROMPTS[:2], plain, [None, "r4-qv"])
    constrained = [
        greedy(max_tokens=10, structured=JsonObject()),
        seeded(8, max_tokens=10, structured=JsonSchema(PERSON)),
    ]
    mixed = engine.generate(
        [PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[1]],
        [constrained[0], plain[0], constrained[1], plain[1]],
        ["r4-qv", None, None, "r4-qv"],
    )
    assert [mixed[1].token_ids, mixed[3].token_ids] == [o.token_ids for o in alone]
    assert mixed[0].text.startswith("{") and mixed[2].text.startswith("{")


@pytest.mark.slow
def test_a_stop_string_or_max_tokens_cut_the_document_short(engine):
    prompt = chat(engine, "Describe a person as JSON with name, age and city.")
    structured = JsonSchema(PERSON)
    stopped, cut = engine.generate(
        [prompt] * 2,
        [
            greedy(max_tokens=120, stop=['"age"'], structured=structured),
            greedy(max_tokens=5, structured=structured),
        ],
    )
    assert stopped.finish_reason == "stop" and stopped.stop_reason == '"age"'
    assert stopped.text.startswith("{") and '"age"' not in stopped.text
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5
    for out in (stopped, cut):  # an incomplete document, as OpenAI returns it
        with pytest.raises(json.JSONDecodeError):
            json.loads(out.text)


@pytest.mark.slow
def test_tool_calls_required_and_named_parse(engine):
    required = ToolCalls((WEATHER,), ToolChoice.REQUIRED, parallel=False)
    named = ToolCalls((WEATHER, Tool("get_time", strict=True)), ToolChoice.NAMED, "get_weather")
    question = "What is the weather in Paris?"
    prompts = [chat(engine, question, format_instructions(spec)) for spec in (required, named)]
    params = [greedy(max_tokens=80, structured=spec) for spec in (required, named)]
    params.append(seeded(2, max_tokens=80, structured=named))
    for out in engine.generate([*prompts, prompts[1]], params):
        assert out.finish_reason == "stop", out.text
        parsed = parse_tool_output(out.text)
        assert [call.name for call in parsed.calls] == ["get_weather"], out.text
        arguments = json.loads(parsed.calls[0].arguments)
        jsonschema.validate(arguments, WEATHER.parameters)


@pytest.mark.slow
def test_a_bad_schema_is_refused_by_name_and_nothing_is_queued(engine):
    bad = JsonSchema(
        {"type": "object", "properties": {"c": {"type": "string", "format": "colour"}}}
    )
    with pytest.raises(EngineError, match="json_schema cannot be enforced: Unknown format: colour"):
        engine.add_request("bad-schema", "Hi", greedy(structured=bad))
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.waiting and not engine.scheduler.running
    misses = engine.grammars.compiler.cache_stats().misses
    with pytest.raises(EngineError, match="Unknown format"):  # a failed spec is not cached
        engine.add_request("bad-schema", "Hi", greedy(structured=bad))
    assert engine.grammars.compiler.cache_stats().misses == misses + 1


@pytest.mark.slow
def test_a_preempted_constrained_request_still_gives_the_same_valid_json(engine, smollm2_dir):
    # 36 blocks of 4 tokens (46 KiB a token; adapters of rank 1 reserve little) for three
    # requests of ~65 tokens each: some are preempted and recomputed, and their matchers
    # must not see a token twice.
    small = build_engine(
        smollm2_dir,
        kv_cache_bytes=36 * 4 * 46080,
        max_lora_rank=1,
        max_model_len=96,
        block_size=4,
        max_num_batched_tokens=32,
        max_prefill_chunk=8,
        prefill_step_target_s=UNTIMED_PREFILL_S,  # preempts by tokens, not the load
    )
    prompts = [
        chat(small, "Describe a person as JSON with name, age and city."),
        chat(small, 'Give a JSON object with keys "city" and "country" for Paris.'),
        chat(small, "Describe a person as JSON with name, age and city."),
    ]
    params = [
        greedy(max_tokens=40, structured=JsonSchema(PERSON)),
        greedy(max_tokens=40, structured=JsonObject()),
        seeded(21, max_tokens=40, structured=JsonSchema(PERSON)),
    ]
    preempt, generated = small.scheduler._preempt, []

    def spy(seq, preempted):
        generated.append(len(seq.output_token_ids))
        preempt(seq, preempted)

    small.scheduler._preempt = spy
    outs = small.generate(prompts, params)
    assert max(generated, default=0) > 0  # preempted with output tokens to recompute
    assert [o.token_ids for o in outs] == [o.token_ids for o in engine.generate(prompts, params)]
    assert_valid(outs[0], PERSON)
    assert_valid(outs[2], PERSON)
    assert isinstance(json.loads(outs[1].text), dict)


# --- the mechanics, on the tiny random model ---------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return build_engine(tiny_model_dir)


@pytest.fixture
def accepts(monkeypatch) -> list[int]:
    """Every token any matcher accepts, in order."""
    seen: list[int] = []
    accept = GrammarMatcher.accept

    def spy(self, token_id):
        seen.append(token_id)
        return accept(self, token_id)

    monkeypatch.setattr(GrammarMatcher, "accept", spy)
    return seen


MIXED = [
    (PROMPTS[0], greedy(max_tokens=100, structured=JsonSchema(SMALL))),
    (PROMPTS[1], greedy(max_tokens=12, ignore_eos=True)),
    (PROMPTS[2], seeded(9, max_tokens=100, structured=JsonSchema(SMALL))),
]


def run_mixed(engine):
    prompts, params = zip(*MIXED, strict=True)
    return engine.generate(list(prompts), list(params))


def test_requests_without_a_spec_build_and_fill_nothing(tiny_model_dir):
    engine = build_engine(tiny_model_dir)
    engine.generate(PROMPTS[:2], greedy(max_tokens=4))
    assert not engine.grammars.built
    assert engine.executor._mask_filler is None


def test_a_re_run_step_accepts_each_token_once(tiny, tiny_model_dir, accepts, monkeypatch):
    expected = run_mixed(build_engine(tiny_model_dir))
    accepts.clear()
    execute, calls = tiny.executor.execute, []

    def fails_the_first_run(plan):
        calls.append(plan)
        result = execute(plan)  # masks filled and tokens sampled, then the step fails
        if len(calls) % 2:
            raise RuntimeError("injected")
        return result

    monkeypatch.setattr(tiny.executor, "execute", fails_the_first_run)
    outs = run_mixed(tiny)
    assert len(calls) > 2  # every step ran twice
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert Counter(accepts) == Counter(outs[0].token_ids + outs[2].token_ids)
    for out in (outs[0], outs[2]):
        assert_valid(out, SMALL)


def test_a_step_cut_short_accepts_nothing(tiny, tiny_model_dir, accepts):
    expected = run_mixed(build_engine(tiny_model_dir))
    accepts.clear()
    for i, (prompt, p) in enumerate(MIXED):
        tiny.add_request(f"cut-{i}", prompt, p)
    tokens: dict[str, list[int]] = {}
    step = 0
    while tiny.has_unfinished_requests():
        if step in (0, 3, 6):  # a higher priority announced: the step is abandoned
            tiny.note_arrival(5)
            assert tiny.step() == []
            tiny.step_interrupt.taken(5)
        for out in tiny.step():
            tokens.setdefault(out.request_id, []).extend(out.delta_token_ids)
        step += 1
    assert [tokens[f"cut-{i}"] for i in range(3)] == [o.token_ids for o in expected]
    assert tiny.metrics.steps_interrupted._value.get() >= 3
    assert Counter(accepts) == Counter(tokens["cut-0"] + tokens["cut-2"])


def test_the_grammar_wins_over_min_tokens_ignore_eos_and_logit_bias(tiny):
    forbidden = tiny.tokenizer.encode("x", add_special_tokens=False)[0]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=100,
        min_tokens=100,
        ignore_eos=True,
        logit_bias={forbidden: 100},
        structured=JsonSchema(SMALL),
    )
    out = tiny.generate([PROMPTS[3]], params)[0]
    assert len(out.token_ids) < 100 and forbidden not in out.token_ids
    assert_valid(out, SMALL)


def test_prompt_logprobs_and_logprobs_stay_the_raw_models(tiny):
    # The mask changes what is sampled, not the log-probabilities reported.
    common = {"temperature": 0.0, "max_tokens": 1, "logprobs": 3, "prompt_logprobs": 2}
    plain, constrained = tiny.generate(
        [PROMPTS[4]] * 2,
        [SamplingParams(**common), SamplingParams(**common, structured=JsonSchema(SMALL))],
    )
    assert constrained.prompt_logprobs == plain.prompt_logprobs
    assert constrained.logprobs[0].top == plain.logprobs[0].top
    token = constrained.token_ids[0]
    assert tiny.tokenizer.decode([token]).strip() in ("", "{")  # what the grammar allows


def test_a_token_the_grammar_refuses_fails_only_its_request(tiny, monkeypatch):
    # The sampler is made to skip the masks (an engine bug): the biased token is sampled.
    forbidden = tiny.tokenizer.encode("x", add_special_tokens=False)[0]
    monkeypatch.setattr(tiny.executor, "_grammar_masks", lambda sampling: None)
    bad = greedy(max_tokens=8, logit_bias={forbidden: 100}, structured=JsonSchema(SMALL))
    plain = greedy(max_tokens=8, ignore_eos=True)
    expected = tiny.generate([PROMPTS[1]], plain)[0]
    failed, other = tiny.generate([PROMPTS[0], PROMPTS[1]], [bad, plain])
    assert failed.finish_reason == "error" and failed.error_kind == "grammar_failed"
    assert f"refused sampled token id {forbidden}" in failed.error
    assert other.finish_reason == "length" and other.token_ids == expected.token_ids


def test_async_generate_compiles_off_the_engine_thread(tiny_model_dir):
    engine = build_engine(tiny_model_dir)
    threads: list[str] = []
    compile_ = engine.grammars.compile

    def spy(spec, tenant=None):
        threads.append(threading.current_thread().name)
        return compile_(spec, tenant)

    engine.grammars.compile = spy
    async_engine = AsyncEngine(engine)
    bad = JsonSchema({"type": "string", "format": "colour"})

    async def main():
        try:
            outs = [
                o
                async for o in async_engine.generate(
                    PROMPTS[0], greedy(max_tokens=100, structured=JsonSchema(SMALL))
                )
            ]
            with pytest.raises(EngineError, match="Unknown format: colour"):
                async for _ in async_engine.generate(PROMPTS[0], greedy(structured=bad)):
                    pass
            return outs[-1], await async_engine.has_unfinished_requests()
        finally:
            await async_engine.stop()

    final, unfinished = asyncio.run(main())
    assert_valid(final, SMALL)
    assert not unfinished
    # Compiled first off the engine thread; the engine thread's compile at add is a hit.
    assert threads[0] != "loramux-engine" and threads[1] == "loramux-engine"
    assert engine.grammars.compiler.cache_stats().misses == 2  # SMALL, then the bad one
    assert threads[2:] == [threads[0]]  # the bad spec never reached the engine thread


def check_static_decode_masks(engine, reference) -> None:
    """``engine``'s decode steps took the static path, and its outputs are the eager
    ``reference``'s (greedy) and valid (all)."""
    static = engine.executor.static_decode
    assert static is not None
    outs = run_mixed(engine)
    assert sum(static.steps_run.values()) > 0
    expected = run_mixed(reference)
    assert outs[0].token_ids == expected[0].token_ids  # greedy and constrained
    assert outs[1].token_ids == expected[1].token_ids
    for out in (outs[0], outs[2]):
        assert_valid(out, SMALL)


def test_static_decode_steps_are_masked_too(tiny_model_dir, monkeypatch):
    # The static path's eager form on the CPU (Triton's interpreter): it returns hidden
    # states, and the runner masks and samples their logits like any step's.
    monkeypatch.setenv(dispatch.KERNELS_ENV, "triton")
    engine = build_engine(tiny_model_dir, block_size=4, cuda_graph_max_batch=4, max_num_seqs=8)
    check_static_decode_masks(engine, build_engine(tiny_model_dir))


@pytest.mark.gpu
def test_cuda_graph_replays_are_masked_too(tiny_model_dir):
    cuda = {"device": "cuda", "dtype": "float32", "block_size": 4, "max_num_seqs": 8}
    engine = build_engine(tiny_model_dir, cuda_graph_max_batch=4, **cuda)
    assert engine.executor.static_decode.captured
    check_static_decode_masks(engine, build_engine(tiny_model_dir, cuda_graph_max_batch=0, **cuda))
