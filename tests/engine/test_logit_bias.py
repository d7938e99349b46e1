"""``logit_bias`` (OpenAI): added to the logits before anything else picks a token, for the
rows that have one only; the returned logprobs stay the raw model's."""

from __future__ import annotations

import math

import pytest
import torch

from loramux.engine import EngineError, SamplingParams
from loramux.engine.sampler import Sampler, SamplingRow, apply_penalties, make_generator
from tests.engine.factories import PROMPTS, build_engine

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return build_engine(tiny_model_dir)


def test_a_large_positive_bias_forces_the_token(engine):
    forced = 1234
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            max_tokens=5, temperature=temperature, ignore_eos=True, logit_bias={forced: 100}
        )
        out = engine.generate([PROMPTS[0]], params)[0]
        assert out.token_ids == [forced] * 5


def test_a_large_negative_bias_bans_the_greedy_token(engine):
    plain = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=1, logprobs=2, **GREEDY))[0]
    best, runner_up = (token for token, _ in plain.logprobs[0].top)
    assert plain.token_ids == [best]
    params = SamplingParams(max_tokens=1, logprobs=2, logit_bias={best: -100}, **GREEDY)
    banned = engine.generate([PROMPTS[1]], params)[0]
    assert banned.token_ids == [runner_up]
    # The logprobs returned are the raw model's, before the bias (as before penalties).
    assert banned.logprobs[0].top == plain.logprobs[0].top


def test_min_tokens_suppression_outranks_a_bias_on_eos(engine):
    eos = min(engine.eos_token_ids)
    params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3, logit_bias={eos: 100})
    out = engine.generate([PROMPTS[2]], params)[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == eos
    assert eos not in out.token_ids[:3] and out.finish_reason == "stop"


def test_only_the_biased_row_changes_in_a_batch(engine):
    """Greedy and seeded rows beside one biased row give exactly what they give without it."""
    rows = [
        SamplingParams(max_tokens=6, **GREEDY),
        SamplingParams(max_tokens=6, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=6, **GREEDY),
    ]
    biased = SamplingParams(max_tokens=6, logit_bias={99: 100, 5: -50}, **GREEDY)
    prompts = PROMPTS[:4]
    alone = engine.generate(prompts[:3], rows)
    mixed = engine.generate(prompts, [*rows, biased])
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    assert mixed[3].token_ids == [99] * 6


def test_the_sampler_adds_the_bias_at_the_biased_rows_only():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    rows = [
        SamplingRow(SamplingParams(), [1], []),
        SamplingRow(SamplingParams(logit_bias={3: 2.5, 49: -100}), [1], []),
        SamplingRow(SamplingParams(logit_bias={}), [1], []),
    ]
    out = apply_penalties(logits, rows)
    expected = logits.clone()
    expected[1, 3] += 2.5
    expected[1, 49] -= 100
    assert torch.equal(out, expected)


def test_the_bias_comes_before_temperature_and_top_k():
    """With top_k=1 only the biased argmax survives the filter: the draw is forced."""
    logits = torch.zeros(1, 10)
    logits[0, 0] = 5.0
    params = SamplingParams(temperature=2.0, top_k=1, seed=1, logit_bias={6: 10})
    row = SamplingRow(params, [1], [], generator=make_generator(1))
    assert Sampler().sample(logits, [row]).token_ids == [6]


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bias", "words"),
    [
        ({5: 100.5}, ["logit_bias[5]", "100.5", "[-100, 100]"]),
        ({7: -101}, ["logit_bias[7]", "-101", "[-100, 100]"]),
        ({5: math.inf}, ["logit_bias[5]", "finite"]),
        ({5: math.nan}, ["logit_bias[5]", "finite"]),
        ({5: "1"}, ["logit_bias[5]", "number"]),
        ({5: True}, ["logit_bias[5]", "number"]),
        ({-1: 1.0}, ["logit_bias", "-1"]),
        ({"5": 1.0}, ["logit_bias", "'5'"]),
        ({True: 1.0}, ["logit_bias", "True"]),
        ([(5, 1.0)], ["logit_bias", "dict"]),
    ],
)
def test_bad_biases_are_refused_by_token_and_value(bias, words):
    with pytest.raises(ValueError) as info:
        SamplingParams(logit_bias=bias)
    for word in words:
        assert word in str(info.value)


def test_biases_are_normalised():
    given = {3: 1, 4: -100, 5: 100}
    params = SamplingParams(logit_bias=given)
    assert params.logit_bias == {3: 1.0, 4: -100.0, 5: 100.0}
    assert all(isinstance(v, float) for v in params.logit_bias.values())
    given[6] = 1.0  # the caller's dict is not kept
    assert 6 not in params.logit_bias
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert params == SamplingParams(logit_bias={5: 100, 4: -100, 3: 1})
    assert hash(params) == hash(SamplingParams(logit_bias={3: 1}))  # still hashable


def test_token_ids_past_the_vocab_are_refused_by_the_engine(engine):
    vocab = engine.model_config.vocab_size
    for token in (vocab, vocab + 1000):
        params = SamplingParams(logit_bias={1: 1.0, token: 1.0})
        with pytest.raises(EngineError) as info:
            engine.add_request(f"bad-{token}", "hi", params)
        assert str(token) in str(info.value) and str(vocab) in str(info.value)
    assert not engine.has_unfinished_requests()
    engine.add_request("edge", "hi", SamplingParams(max_tokens=1, logit_bias={vocab - 1: 1.0}))
    while engine.has_unfinished_requests():
        engine.step()
