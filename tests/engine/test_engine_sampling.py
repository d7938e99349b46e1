"""Sampling through the whole engine, each knob checked against an independent computation.

The reference is transformers' logits for the same token prefix (``hf_reference``); the
penalties, filters and draws are recomputed here by hand from those logits, so the
engine's sampler, scheduler, stop checks and detokenizer are all on the path under test.
Everything runs on the tiny random Llama (float32, CPU-fast).
"""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from loramux.engine import Engine, RequestOutput, SamplingParams
from tests.engine.factories import PROMPTS, build_engine, put_adapters_on_device
from tests.engine.hf_reference import first_step_logits, greedy_tokens

TARGET_PROMPT = PROMPTS[0]
EOS_ID = 2  # <|im_end|>, the tokenizer's (and the tiny model's) EOS
EOS_PROMPT = PROMPTS[0]
EOS_STEP = 3  # the EOS-prone model (below) emits EOS greedily at this index for EOS_PROMPT
TARGET_PARAMS = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, make_adapter):
    return {
        "a4": make_adapter(tiny_model_dir, rank=4, targets=("q_proj", "v_proj"), seed=11),
        "a8": make_adapter(
            tiny_model_dir, rank=8, targets=("o_proj", "gate_proj", "down_proj"), seed=12
        ),
    }


@pytest.fixture(scope="module")
def eos_model_dir(tiny_model_dir, tmp_path_factory, tokenizer):
    """The tiny model with lm_head's EOS row made a scaled copy of another token's row.

    That token is the one the tiny model emits greedily at step EOS_STEP for
    EOS_PROMPT, so this model emits a real EOS there (and possibly elsewhere later).
    """
    prompt_ids = tokenizer(EOS_PROMPT)["input_ids"]
    base = greedy_tokens(tiny_model_dir, None, prompt_ids, EOS_STEP + 1)
    donor = base[EOS_STEP]
    assert donor not in base[:EOS_STEP]
    out = tmp_path_factory.mktemp("tiny-eos")
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    weights = load_file(out / "model.safetensors")
    lm_head = weights["lm_head.weight"].clone()
    lm_head[EOS_ID] = lm_head[donor] * 1.1
    weights["lm_head.weight"] = lm_head
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


# --------------------------------------------------------------------------- references


def hf_logits(model_dir, adapter_dir, ids: list[int]) -> torch.Tensor:
    """transformers' next-token logits for the prefix ``ids`` (float32 copy)."""
    return first_step_logits(model_dir, adapter_dir, list(ids)).float().clone()


def reference_greedy(
    model_dir,
    prompt_ids: list[int],
    max_tokens: int,
    *,
    adapter_dir=None,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    stop_ids: frozenset[int] = frozenset(),
    min_tokens: int = 0,
) -> list[int]:
    """Greedy decoding recomputed step by step from transformers' logits.

    Penalties by hand: Hugging Face repetition over prompt + output (each distinct id
    once), OpenAI presence / frequency over the output only. ``stop_ids`` end the
    output (the stop token included) once ``min_tokens`` were produced, and are
    suppressed before that.
    """
    out: list[int] = []
    while len(out) < max_tokens:
        z = hf_logits(model_dir, adapter_dir, prompt_ids + out)
        if len(out) < min_tokens:
            for t in stop_ids:
                z[t] = float("-inf")
        if repetition_penalty != 1.0:
            for t in set(prompt_ids) | set(out):
                z[t] = z[t] / repetition_penalty if z[t] > 0 else z[t] * repetition_penalty
        for t, count in Counter(out).items():
            z[t] -= frequency_penalty * count + presence_penalty
        token = int(z.argmax())
        out.append(token)
        if token in stop_ids and len(out) > min_tokens:
            break
    return out


def reference_probs(z: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """softmax after temperature, top-k, top-p, min-p (in that order), in float64."""
    x = z.double() / params.temperature
    if params.top_k is not None:
        kth = x.sort(descending=True).values[params.top_k - 1]
        x[x < kth] = float("-inf")
    if params.top_p < 1.0:
        p = x.softmax(-1)
        order = torch.argsort(p, descending=True, stable=True)
        mass_before = torch.cumsum(p[order], 0) - p[order]
        x[order[mass_before >= params.top_p]] = float("-inf")
    if params.min_p > 0.0:
        p = x.softmax(-1)
        x[p < params.min_p * p.max()] = float("-inf")
    return x.softmax(-1)


def reference_seeded(model_dir, prompt_ids, params: SamplingParams, steps: int) -> list[int]:
    """A seeded request's tokens recomputed with the documented exponential race.

    Each step draws V i.i.d. Exp(1) from a generator seeded with ``params.seed`` and
    takes argmax(pi / q), pi being the filtered distribution of transformers' logits.
    """
    gen = torch.Generator().manual_seed(params.seed)
    out: list[int] = []
    for _ in range(steps):
        z = hf_logits(model_dir, None, prompt_ids + out)
        for t, count in Counter(out).items():
            z[t] -= params.frequency_penalty * count + params.presence_penalty
        pi = reference_probs(z, params)
        q = torch.empty(z.shape[0], dtype=torch.float32).exponential_(generator=gen)
        q = q.clamp(min=torch.finfo(torch.float32).tiny).double()
        out.append(int((pi / q).argmax()))
    return out


def stream(
    engine: Engine, requests: dict[str, tuple], add_at: Callable[[int], list[str]] | None = None
) -> dict[str, tuple[RequestOutput, list[RequestOutput]]]:
    """Run requests through add_request / step; rid -> (final output, every output).

    ``requests`` maps rid -> (prompt, params, adapter). ``add_at(step)`` says which rids
    to add before that step (default: all before the first).
    """
    pending = dict(requests)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    step = 0
    while pending or engine.has_unfinished_requests():
        due = list(pending) if add_at is None else add_at(step)
        for rid in due:
            prompt, params, adapter = pending.pop(rid)
            engine.add_request(rid, prompt, params, adapter=adapter)
        for out in engine.step():
            outs[out.request_id].append(out)
        step += 1
        assert step < 10_000
    for rid, seen in outs.items():
        assert seen and seen[-1].finished, rid
        assert sum(o.finished for o in seen) == 1, rid
    return {rid: (seen[-1], seen) for rid, seen in outs.items()}


def ids_of(tokenizer, prompt: str) -> list[int]:
    return tokenizer(prompt)["input_ids"]


# --------------------------------------------------------------------------- seeds


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        # chunked prefill and a KV cache small enough to force preemption by recompute:
        # 24 blocks of 4 tokens (512 bytes a token) beside room for the adapters' rows
        # (one 8 KiB rank-row each; the budget is shared), contexts capped at 96 tokens
        {
            "max_num_batched_tokens": 24,
            "max_prefill_chunk": 4,
            "kv_cache_bytes": 24 * 4 * 512 + 12 * 8192,
            "max_model_len": 96,
            "block_size": 4,
        },
    ],
    ids=["default", "chunked-preempting"],
)
def test_seeded_request_is_batch_invariant(tiny_model_dir, adapters, overrides):
    alone = build_engine(tiny_model_dir, adapters, **overrides)
    [solo] = alone.generate([TARGET_PROMPT], TARGET_PARAMS)
    assert len(solo.token_ids) == TARGET_PARAMS.max_tokens

    engine = build_engine(tiny_model_dir, adapters, **overrides)
    mk = SamplingParams
    requests = {
        "greedy": (PROMPTS[1], mk(temperature=0.0, max_tokens=20, ignore_eos=True), None),
        "seed7-a4": (PROMPTS[2], mk(temperature=0.8, seed=7, max_tokens=12), "a4"),
        "unseeded": (PROMPTS[3], mk(temperature=1.0, max_tokens=18, ignore_eos=True), None),
        # the same prompt on an adapter, and the same prompt on the base (prefix hits)
        "same-prompt-a8": (TARGET_PROMPT, mk(temperature=0.8, top_p=0.9, seed=99), "a8"),
        "same-prompt-greedy": (TARGET_PROMPT, mk(temperature=0.0, max_tokens=10), None),
        "target": (TARGET_PROMPT, TARGET_PARAMS, None),
        "unseeded-topk-a4": (PROMPTS[4], mk(top_k=20, max_tokens=14, ignore_eos=True), "a4"),
        "same-seed": (PROMPTS[5], mk(temperature=0.8, top_p=0.9, seed=123), None),
        "penalty-a8": (PROMPTS[6], mk(repetition_penalty=1.3, max_tokens=9), "a8"),
    }
    order = list(requests)
    schedule = {0: order[:4], 2: order[4:6], 3: order[6:7], 5: order[7:]}
    if overrides:  # KV left its floor: preemption
        put_adapters_on_device(engine, adapters)
    results = stream(engine, requests, add_at=lambda step: schedule.get(step, []))
    busy = results["target"][0]
    assert busy.token_ids == solo.token_ids
    assert busy.text == solo.text
    if overrides:
        assert engine.num_preemptions > 0
    assert engine.kv.num_used_blocks == 0


def test_different_seeds_give_different_outputs(tiny_model_dir):
    engine = build_engine(tiny_model_dir)
    seeds = [123, 124, 125, 123]
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=12, ignore_eos=True)
        for s in seeds
    ]
    outs = [o.token_ids for o in engine.generate([TARGET_PROMPT] * 4, params)]
    assert outs[0] == outs[3]
    assert len({tuple(o) for o in outs[:3]}) == 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.3, top_k=20, seed=2),
        SamplingParams(temperature=1.0, top_p=0.5, seed=3),
        SamplingParams(temperature=0.9, min_p=0.2, seed=4),
        SamplingParams(temperature=1.2, top_k=50, top_p=0.8, min_p=0.05, seed=5),
        SamplingParams(
            temperature=1.0, top_k=5, presence_penalty=1.0, frequency_penalty=0.5, seed=6
        ),
    ],
    ids=["temperature", "top-k", "top-p", "min-p", "all-filters", "penalties"],
)
def test_seeded_tokens_match_independent_draw(tiny_model_dir, tokenizer, params):
    """The documented draw (exponential race on the filtered softmax), recomputed by hand."""
    engine = build_engine(tiny_model_dir)
    steps = 5
    params = replace(params, max_tokens=steps, ignore_eos=True)
    for prompt in PROMPTS[:3]:
        [out] = engine.generate([prompt], params)
        expected = reference_seeded(tiny_model_dir, ids_of(tokenizer, prompt), params, steps)
        assert out.token_ids == expected, prompt


def test_filters_keep_draws_inside_the_reference_support(tiny_model_dir, tokenizer):
    """Many seeds, one step: every draw lies in the set the filter keeps."""
    engine = build_engine(tiny_model_dir)
    prompt = PROMPTS[1]
    z = hf_logits(tiny_model_dir, None, ids_of(tokenizer, prompt))
    cases = [
        SamplingParams(temperature=2.0, top_k=3, max_tokens=1),
        SamplingParams(temperature=0.1, top_p=0.9, max_tokens=1),
        SamplingParams(temperature=0.2, min_p=0.3, max_tokens=1),
    ]
    for case in cases:
        support = set(torch.nonzero(reference_probs(z, case) > 0).flatten().tolist())
        assert 2 <= len(support) <= 100, "the filter must matter for this test to mean much"
        params = [replace(case, seed=s) for s in range(40)]
        drawn = {o.token_ids[0] for o in engine.generate([prompt] * 40, params)}
        assert drawn <= support, case
        assert len(drawn) > 1, case  # the draw is random, not argmax


# --------------------------------------------------------------------------- knobs


ARGMAX_KNOBS = [
    {"temperature": 0.0},
    {"temperature": 1.0, "top_k": 1, "seed": 5},
    {"temperature": 1.0, "top_k": 1},  # unseeded: the shared generator
    {"temperature": 1e-4, "seed": 6},
    {"temperature": 1.0, "min_p": 1.0, "seed": 7},
    {"temperature": 1.0, "top_p": 1e-6, "seed": 8},
]


@pytest.mark.parametrize("adapter", [None, "a4"])
def test_argmax_knobs_pick_the_reference_argmax(tiny_model_dir, adapters, tokenizer, adapter):
    engine = build_engine(tiny_model_dir, adapters)
    adapter_dir = None if adapter is None else adapters[adapter]
    prompts = PROMPTS[:4]
    expected = []
    for prompt in prompts:
        z = hf_logits(tiny_model_dir, adapter_dir, ids_of(tokenizer, prompt))
        top2 = z.topk(2).values
        assert top2[0] - top2[1] > 1e-3, "near-tie: pick another prompt"
        expected.append(int(z.argmax()))
    for knob in ARGMAX_KNOBS:
        params = SamplingParams(max_tokens=1, **knob)
        outs = engine.generate(prompts, params, adapters=[adapter] * len(prompts))
        assert [o.token_ids[0] for o in outs] == expected, knob


def test_vanishing_temperature_still_picks_the_argmax(tiny_model_dir, tokenizer):
    engine = build_engine(tiny_model_dir)
    prompt_ids = ids_of(tokenizer, PROMPTS[1])
    expected = int(hf_logits(tiny_model_dir, None, prompt_ids).argmax())
    [out] = engine.generate([prompt_ids], SamplingParams(temperature=1e-40, seed=1, max_tokens=1))
    assert out.token_ids == [expected]


PENALTIES = [
    {"repetition_penalty": 2.0},
    {"repetition_penalty": 0.5},  # < 1 favours repeats: exercises both signs
    {"presence_penalty": 2.0},
    {"frequency_penalty": 1.5},
    {"frequency_penalty": -2.0},
    {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5},
]


@pytest.mark.parametrize("adapter", [None, "a8"])
@pytest.mark.parametrize(
    "penalty", PENALTIES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items())
)
def test_penalties_match_stepwise_reference(tiny_model_dir, adapters, tokenizer, penalty, adapter):
    max_tokens = 10
    engine = build_engine(tiny_model_dir, adapters)
    adapter_dir = None if adapter is None else adapters[adapter]
    prompt_ids = ids_of(tokenizer, PROMPTS[0])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **penalty)
    [out] = engine.generate([prompt_ids], params, adapters=[adapter])
    expected = reference_greedy(
        tiny_model_dir, prompt_ids, max_tokens, adapter_dir=adapter_dir, **penalty
    )
    assert out.token_ids == expected
    plain = reference_greedy(tiny_model_dir, prompt_ids, max_tokens, adapter_dir=adapter_dir)
    assert expected != plain, "the penalty changed nothing: the test would prove nothing"


# --------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(logprobs=5, temperature=1.0, seed=21, max_tokens=6, ignore_eos=True),
        # logprobs are raw: penalties and temperature must not show in them
        SamplingParams(
            logprobs=5,
            temperature=0.5,
            repetition_penalty=1.5,
            frequency_penalty=1.0,
            seed=22,
            max_tokens=6,
            ignore_eos=True,
        ),
        SamplingParams(logprobs=0, temperature=0.0, max_tokens=4, ignore_eos=True),
    ],
    ids=["sampled", "penalised", "sampled-only"],
)
def test_logprobs_match_reference_log_softmax(tiny_model_dir, tokenizer, params):
    engine = build_engine(tiny_model_dir)
    prompt_ids = ids_of(tokenizer, PROMPTS[2])
    [out] = engine.generate([prompt_ids], params)
    assert len(out.logprobs) == len(out.token_ids) == params.max_tokens
    for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        ref = torch.log_softmax(
            hf_logits(tiny_model_dir, None, prompt_ids + out.token_ids[:step]).double(), -1
        )
        assert lp.token_id == token
        assert abs(lp.logprob - float(ref[token])) < 1e-4, step
        top = ref.topk(params.logprobs)
        assert [t for t, _ in lp.top] == top.indices.tolist(), step
        for (_, got), want in zip(lp.top, top.values.tolist(), strict=True):
            assert abs(got - want) < 1e-4, step


def test_no_logprobs_by_default(tiny_model_dir):
    engine = build_engine(tiny_model_dir)
    [out] = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=3, seed=1))
    assert out.logprobs == []


# --------------------------------------------------------------------------- stopping


def test_eos_stops_and_is_not_in_the_text(eos_model_dir, tokenizer):
    engine = build_engine(eos_model_dir)
    prompt_ids = ids_of(tokenizer, EOS_PROMPT)
    expected = greedy_tokens(eos_model_dir, None, prompt_ids, 16, eos_ids=frozenset({EOS_ID}))
    assert expected[-1] == EOS_ID and len(expected) == EOS_STEP + 1
    [out] = engine.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=16))
    assert out.token_ids == expected
    assert out.finish_reason == "stop"
    assert out.stop_reason == EOS_ID
    assert out.text == tokenizer.decode(expected[:-1])
    assert tokenizer.eos_token not in out.text


def test_ignore_eos_keeps_going_past_eos(eos_model_dir, tokenizer):
    engine = build_engine(eos_model_dir)
    prompt_ids = ids_of(tokenizer, EOS_PROMPT)
    expected = greedy_tokens(eos_model_dir, None, prompt_ids, 12)
    assert expected[EOS_STEP] == EOS_ID
    [out, raw] = engine.generate(
        [prompt_ids, prompt_ids],
        [
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            SamplingParams(
                temperature=0.0, max_tokens=12, ignore_eos=True, skip_special_tokens=False
            ),
        ],
    )
    for o in (out, raw):
        assert o.token_ids == expected
        assert o.finish_reason == "length"
        assert o.stop_reason is None
    assert out.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert tokenizer.eos_token not in out.text
    assert raw.text == tokenizer.decode(expected, skip_special_tokens=False)
    assert tokenizer.eos_token in raw.text


@pytest.mark.parametrize("extra", [0, 1, 3], ids=["eos-allowed-at-min", "just-past", "well-past"])
def test_min_tokens_suppresses_eos(eos_model_dir, tokenizer, extra):
    """min_tokens = EOS_STEP still allows the EOS at index EOS_STEP; one more forbids it."""
    engine = build_engine(eos_model_dir)
    prompt_ids = ids_of(tokenizer, EOS_PROMPT)
    min_tokens = EOS_STEP + extra
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=min_tokens)
    [out] = engine.generate([prompt_ids], params)
    expected = reference_greedy(
        eos_model_dir, prompt_ids, 16, stop_ids=frozenset({EOS_ID}), min_tokens=min_tokens
    )
    assert out.token_ids == expected
    assert EOS_ID not in out.token_ids[:min_tokens]
    if extra == 0:
        assert out.token_ids[-1] == EOS_ID and len(out.token_ids) == EOS_STEP + 1
    else:
        assert len(out.token_ids) > EOS_STEP + 1
    assert out.finish_reason == ("stop" if expected[-1] == EOS_ID else "length")


def test_stop_token_ids_stop_and_are_not_in_the_text(tiny_model_dir, tokenizer):
    engine = build_engine(tiny_model_dir)
    prompt_ids = ids_of(tokenizer, PROMPTS[0])
    greedy = greedy_tokens(tiny_model_dir, None, prompt_ids, 12)
    index = next(i for i in range(2, 12) if greedy[i] not in greedy[:i])
    stop_token = greedy[index]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_token, 7])
    [out] = engine.generate([prompt_ids], params)
    assert out.token_ids == greedy[: index + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_token
    assert out.text == tokenizer.decode(greedy[:index])


def test_min_tokens_suppresses_stop_token_ids(tiny_model_dir, tokenizer):
    engine = build_engine(tiny_model_dir)
    prompt_ids = ids_of(tokenizer, PROMPTS[0])
    greedy = greedy_tokens(tiny_model_dir, None, prompt_ids, 12)
    stop_token, min_tokens = greedy[1], 4
    params = SamplingParams(
        temperature=0.0, max_tokens=12, stop_token_ids=[stop_token], min_tokens=min_tokens
    )
    [out] = engine.generate([prompt_ids], params)
    expected = reference_greedy(
        tiny_model_dir,
        prompt_ids,
        12,
        stop_ids=frozenset({stop_token, EOS_ID}),
        min_tokens=min_tokens,
    )
    assert out.token_ids == expected
    assert stop_token not in out.token_ids[:min_tokens]
    assert out.token_ids[:2] != greedy[:2]  # the suppression changed the output


def test_max_tokens_finishes_with_length(tiny_model_dir, tokenizer):
    engine = build_engine(tiny_model_dir)
    prompt_ids = ids_of(tokenizer, PROMPTS[1])
    for max_tokens in (1, 7):
        [out] = engine.generate(
            [prompt_ids], SamplingParams(temperature=0.0, max_tokens=max_tokens)
        )
        assert out.token_ids == greedy_tokens(tiny_model_dir, None, prompt_ids, max_tokens)
        assert len(out.token_ids) == max_tokens
        assert out.finish_reason == "length"
        assert out.stop_reason is None


def test_context_limit_finishes_with_length(tiny_model_dir, tokenizer):
    prompt_ids = ids_of(tokenizer, PROMPTS[2])
    for room in (1, 5):
        engine = build_engine(tiny_model_dir, max_model_len=len(prompt_ids) + room)
        [out] = engine.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=50))
        assert out.token_ids == greedy_tokens(tiny_model_dir, None, prompt_ids, room)
        assert out.finish_reason == "length"
        assert len(out.prompt_token_ids) + len(out.token_ids) == engine.max_model_len
        assert engine.kv.num_used_blocks == 0


def _boundary_stop(tokenizer, tokens: list[int], text: str) -> tuple[str, int, int]:
    """A 4-character stop string straddling the boundary after some token ``i``.

    Returns (stop, where it starts in ``text``, i + 1 = the token that completes it).
    """
    for i in range(2, len(tokens) - 1):
        end_i = len(tokenizer.decode(tokens[: i + 1]))
        end_next = len(tokenizer.decode(tokens[: i + 2]))
        start_i = len(tokenizer.decode(tokens[:i]))
        if end_i - start_i < 2 or end_next - end_i < 2:
            continue
        stop = text[end_i - 2 : end_i + 2]
        if stop.strip() and text.find(stop) == end_i - 2:
            return stop, end_i - 2, i + 1
    raise AssertionError("no usable token boundary")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_a_token_boundary(tiny_model_dir, tokenizer, include):
    engine = build_engine(tiny_model_dir)
    prompt = PROMPTS[3]
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    [free] = engine.generate([prompt], base)
    text = free.text
    assert text == tokenizer.decode(free.token_ids)
    stop, start, last = _boundary_stop(tokenizer, free.token_ids, text)
    later = text[-3:]  # also occurs, but completes later: the first to complete wins
    assert text.find(later) > start + len(stop)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        ignore_eos=True,
        stop=[later, stop, "never-in-this-output"],
        include_stop_str_in_output=include,
    )
    final, seen = stream(engine, {"one": (prompt, params, None)})["one"]
    assert final.finish_reason == "stop"
    assert final.stop_reason == stop
    assert final.text == (text[: start + len(stop)] if include else text[:start])
    assert final.token_ids == free.token_ids[: last + 1]
    assert "".join(o.delta_text for o in seen) == final.text


# --------------------------------------------------------------------------- streaming


def test_delta_text_concatenates_to_the_final_text(tiny_model_dir, eos_model_dir, tokenizer):
    """Streams of odd tokens (sampled at high temperature: bytes, CJK, specials)."""
    requests = {}
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=1.5, seed=300 + i, max_tokens=40, ignore_eos=True)
        requests[f"r{i}"] = (prompt, params, None)
    requests["greedy"] = (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30), None)
    for model_dir in (tiny_model_dir, eos_model_dir):
        engine = build_engine(model_dir)
        results = stream(engine, requests)
        for rid, (final, seen) in results.items():
            assert "".join(o.delta_text for o in seen) == final.text, rid
            assert [t for o in seen for t in o.delta_token_ids] == final.token_ids, rid
            assert final.finish_reason in ("length", "stop")
            assert final.stop_reason in (None, EOS_ID)  # no stop strings here
            assert final.text == tokenizer.decode(final.token_ids, skip_special_tokens=True), rid
            # every intermediate text is a prefix of the final one
            for o in seen:
                assert final.text.startswith(o.text), rid
        if model_dir == eos_model_dir:
            assert results["greedy"][0].finish_reason == "stop"  # ended by a real EOS
