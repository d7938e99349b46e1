"""Speculative decoding in the engine: the same tokens as without it, in fewer steps.

Each greedy request is compared with the same request run alone through transformers +
PEFT, in mixed-adapter batches (ranks and targets varied), with prefix hits, small prefill
chunks and preemptions forced by a small KV budget. The tiny random model's greedy text
falls into loops, which n-gram proposals predict, so most steps verify proposals and both
acceptances and rejections happen: each test checks that they did, so it cannot pass by
never speculating.
"""

from __future__ import annotations

import pytest

from loramux.engine import SamplingParams
from tests.engine.factories import PROMPTS, build_engine, put_adapters_on_device
from tests.engine.test_exactness import (
    ADAPTER_SPECS,
    assert_matches_reference,
    mixed_requests,
    run_staggered,
)

NGRAM = {"speculative_method": "ngram", "num_speculative_tokens": 4, "ngram_min_n": 1}


@pytest.fixture(scope="module")
def tiny_adapters(tiny_model_dir, make_adapter):
    return {name: make_adapter(tiny_model_dir, **spec) for name, spec in ADAPTER_SPECS.items()}


def spec_counts(engine) -> tuple[float, float]:
    """(proposed, accepted) over all adapters, from the engine's metrics."""
    proposed = accepted = 0.0
    for metric in engine.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "loramux_spec_proposed_tokens_total":
                proposed += sample.value
            elif sample.name == "loramux_spec_accepted_tokens_total":
                accepted += sample.value
    return proposed, accepted


def assert_speculated(engine) -> None:
    proposed, accepted = spec_counts(engine)
    assert proposed > 0 and 0 < accepted < proposed, (proposed, accepted)


def test_mixed_batch_matches_peft_with_ngram_speculation(tiny_model_dir, tiny_adapters):
    engine = build_engine(tiny_model_dir, tiny_adapters, **NGRAM)
    requests = mixed_requests(6)
    outputs = run_staggered(engine, requests, 24)
    assert_speculated(engine)
    assert_matches_reference(engine, tiny_model_dir, tiny_adapters, requests, outputs, 24)
    assert engine.kv.num_used_blocks == 0


def test_prefix_hits_and_small_chunks_match_peft_with_speculation(tiny_model_dir, tiny_adapters):
    engine = build_engine(
        tiny_model_dir,
        tiny_adapters,
        block_size=4,
        max_num_batched_tokens=9,
        max_prefill_chunk=3,
        **NGRAM,
    )
    system = "You are a helpful assistant who answers briefly and precisely. "
    requests = [(system + p, a) for p, a in mixed_requests(6)]
    first = run_staggered(engine, requests, 20)
    hits = engine.kv.prefix_cache_hits
    second = run_staggered(engine, requests, 20)
    assert engine.kv.prefix_cache_hits > hits > 0
    assert first == second
    assert_speculated(engine)
    assert_matches_reference(engine, tiny_model_dir, tiny_adapters, requests, second, 20)


def test_preemption_matches_peft_with_speculation(tiny_model_dir, tiny_adapters):
    # The budget of test_exactness's preemption test: 24 KV blocks of 4 tokens.
    engine = build_engine(
        tiny_model_dir,
        tiny_adapters,
        kv_cache_bytes=24 * 4 * 512 + 28 * 8192,
        max_model_len=96,
        block_size=4,
        **NGRAM,
    )
    requests = mixed_requests(8)
    put_adapters_on_device(engine, tiny_adapters)  # KV left its floor: preemption
    outputs = run_staggered(engine, requests, 24)
    assert engine.num_preemptions > 0
    assert_speculated(engine)
    assert_matches_reference(engine, tiny_model_dir, tiny_adapters, requests, outputs, 24)
    assert engine.kv.num_used_blocks == 0


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tiny_adapters):
    """An engine without speculation and one with it, alike otherwise (shared by the tests
    that compare the two: each leaves them idle)."""
    return build_engine(tiny_model_dir, tiny_adapters), build_engine(
        tiny_model_dir, tiny_adapters, **NGRAM
    )


def generate_both(engines, prompts, params):
    """The same requests on the engine without speculation and on the one with it; returns
    both outputs and how much the speculating engine proposed and accepted meanwhile."""
    plain, spec = engines
    names = [None, "r8-attn"] * (len(prompts) // 2) + [None] * (len(prompts) % 2)
    before = spec_counts(spec)
    a = plain.generate(prompts, params, adapters=names)
    b = spec.generate(prompts, params, adapters=names)
    after = spec_counts(spec)
    return a, b, (after[0] - before[0], after[1] - before[1])


def assert_proposed_and_judged(counts) -> None:
    proposed, accepted = counts
    assert proposed > 0 and 0 < accepted < proposed, counts


def test_tokens_per_step_and_streamed_chunks(tiny_model_dir, tiny_adapters):
    engine = build_engine(tiny_model_dir, tiny_adapters, **NGRAM)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("r", PROMPTS[2], params, adapter="r4-qv")
    chunks = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            chunks.append(out.delta_token_ids)
            final = out
    assert [t for chunk in chunks for t in chunk] == final.token_ids
    assert max(len(chunk) for chunk in chunks) > 1  # several tokens in one streamed chunk
    m = final.metrics
    assert m.completion_tokens == 40 == len(final.token_ids)
    assert m.decode_steps == len([c for c in chunks if c]) < 40
    assert 0 < m.spec_accepted_tokens <= m.spec_proposed_tokens
    # Every step emits one token more than it accepted.
    assert m.completion_tokens == m.decode_steps + m.spec_accepted_tokens


def test_stop_string_and_max_tokens_inside_an_accepted_run(engines):
    prompts = PROMPTS[:4]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain, spec, counts = generate_both(engines, prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert_proposed_and_judged(counts)
    # Stop on a piece of text each output reaches late, and odd max_tokens values: the
    # request must end exactly where it ends without speculation.
    stops = [o.text[len(o.text) * 2 // 3 :][:3] for o in plain]
    for prompt, stop, max_tokens in zip(prompts, stops, (7, 13, 29, 30), strict=True):
        p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=[stop])
        a, b, _ = generate_both(engines, [prompt], p)
        assert (b[0].token_ids, b[0].text, b[0].finish_reason) == (
            a[0].token_ids,
            a[0].text,
            a[0].finish_reason,
        )


def test_logprobs_of_accepted_tokens_equal_those_without_speculation(engines):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    plain, spec, counts = generate_both(engines, PROMPTS[:4], params)
    assert_proposed_and_judged(counts)
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids
        assert len(b.logprobs) == len(a.logprobs) == 24
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert y.token_id == x.token_id
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
            assert [t for t, _ in y.top] == [t for t, _ in x.top]


def test_penalties_and_min_tokens_are_applied_to_each_verified_position(engines):
    # Penalties change what the argmax is once a token repeats: position i of a proposal
    # must count the proposals before it, or the runs would differ. (Mild ones: strong
    # penalties end the loops that n-gram proposals predict, leaving nothing to verify.)
    params = SamplingParams(
        max_tokens=24,
        temperature=0.0,
        frequency_penalty=0.01,
        presence_penalty=0.01,
        repetition_penalty=1.01,
        min_tokens=10,
    )
    plain, spec, counts = generate_both(engines, PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert_proposed_and_judged(counts)


def test_a_request_can_opt_out(engines):
    _, spec = engines
    before = spec_counts(spec)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, speculative=False)
    [out] = spec.generate([PROMPTS[2]], params)
    assert out.metrics.spec_proposed_tokens == 0
    assert out.metrics.decode_steps == 24
    assert spec_counts(spec) == before


def test_seeded_sampling_is_reproducible_with_speculation(tiny_model_dir, tiny_adapters):
    """The same seeded requests on an engine in the same state give the same tokens. (Not
    across different batch layouts: a row's logits change in the last bits with the rows
    beside it in a matmul, on the CPU's BLAS too, which can tip a sampled token; so the
    prefix cache, which changes the second run's layout, is off here.)"""
    spec = build_engine(tiny_model_dir, tiny_adapters, enable_prefix_caching=False, **NGRAM)
    params = SamplingParams(max_tokens=24, temperature=0.7, top_k=20, seed=123, ignore_eos=True)
    first = spec.generate(PROMPTS[:3], params, adapters=[None, "r4-qv", None])
    second = spec.generate(PROMPTS[:3], params, adapters=[None, "r4-qv", None])
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert all(len(o.token_ids) == 24 for o in first)
    assert spec_counts(spec)[0] > 0
