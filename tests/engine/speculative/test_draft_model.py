"""Draft-model speculation: the same tokens as without it, with a draft that is sometimes right.

The draft is the tiny Llama with its layers' weights perturbed (``tiny_draft_dir``): it
shares the target's vocabulary and agrees with it often but not always, so the tests see
acceptances and rejections (each checks both, so none can pass by never speculating). A
draft identical to the target must have every proposal accepted: that checks the draft's
own KV cache, which a stale entry would make disagree.

A draft the size of its target never pays for itself, so the draft-length model would
back off at once (a proposal's cost counts the draft's forward passes): the engines here
cost a proposal what ``build_engine`` fixes for the n-gram tests, to keep speculating
while tested.
"""

from __future__ import annotations

import pytest
import torch

from loramux.engine import SamplingParams
from loramux.engine.engine import EngineError
from loramux.engine.speculative.draft_model import DraftCache, DraftState
from tests.engine.factories import PROMPTS, build_engine, put_adapters_on_device
from tests.engine.speculative.test_speculative_engine import (
    assert_speculated,
    spec_counts,
    tiny_adapters,  # noqa: F401 (fixture)
)
from tests.engine.test_exactness import assert_matches_reference, mixed_requests, run_staggered
from tests.fixtures.models import build_tiny_model


def draft_settings(draft_dir, **more) -> dict:
    return {
        "speculative_method": "draft",
        "draft_model": str(draft_dir),
        "num_speculative_tokens": 4,
        **more,
    }


def test_mixed_batch_matches_peft_with_a_draft_model(
    tiny_model_dir,
    tiny_draft_dir,
    tiny_adapters,  # noqa: F811
):
    engine = build_engine(tiny_model_dir, tiny_adapters, **draft_settings(tiny_draft_dir))
    requests = mixed_requests(6)
    outputs = run_staggered(engine, requests, 24)
    assert_speculated(engine)
    assert_matches_reference(engine, tiny_model_dir, tiny_adapters, requests, outputs, 24)
    assert engine.kv.num_used_blocks == 0
    draft = engine.speculator.draft
    assert draft.num_cached_requests == 0  # every finished request's draft blocks freed
    assert draft.cache.num_free_blocks == draft.cache.num_blocks


def test_prefix_hits_and_small_chunks_match_peft_with_a_draft_model(
    tiny_model_dir,
    tiny_draft_dir,
    tiny_adapters,  # noqa: F811
):
    engine = build_engine(
        tiny_model_dir,
        tiny_adapters,
        block_size=4,
        max_num_batched_tokens=9,
        max_prefill_chunk=3,
        **draft_settings(tiny_draft_dir),
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


def test_preemption_matches_peft_with_a_draft_model(
    tiny_model_dir,
    tiny_draft_dir,
    tiny_adapters,  # noqa: F811
):
    # The CPU preemption test's 24 target blocks beside the adapters, plus the draft's cache:
    # 24 blocks of 2,048 bytes (2 layers, 4 tokens), one request of max_model_len.
    draft_bytes = 48 * 1024
    engine = build_engine(
        tiny_model_dir,
        tiny_adapters,
        kv_cache_bytes=24 * 4 * 512 + 28 * 8192 + draft_bytes,
        max_model_len=96,
        block_size=4,
        **draft_settings(tiny_draft_dir, draft_kv_cache_bytes=draft_bytes),
    )
    requests = mixed_requests(8)
    put_adapters_on_device(engine, tiny_adapters)  # KV left its floor: preemption
    outputs = run_staggered(engine, requests, 24)
    assert engine.num_preemptions > 0
    assert_speculated(engine)
    assert_matches_reference(engine, tiny_model_dir, tiny_adapters, requests, outputs, 24)
    assert engine.kv.num_used_blocks == 0


def test_a_draft_equal_to_the_target_is_always_right(tiny_model_dir):
    """Its proposals are the target's own greedy tokens, provided the draft's cache holds
    exactly the request's tokens at every step (across catch-ups and rejections: none)."""
    engine = build_engine(tiny_model_dir, **draft_settings(tiny_model_dir))
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = build_engine(tiny_model_dir).generate(PROMPTS[:3], params)
    spec = engine.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    proposed, accepted = spec_counts(engine)
    assert proposed > 0 and accepted == proposed
    for out in spec:
        assert out.metrics.decode_steps < 30 / 3  # 4 proposals and one more, most steps


def test_sampling_with_a_draft_model_is_seeded_and_uses_its_distributions(
    tiny_model_dir, tiny_draft_dir
):
    """Seeded requests beside unseeded ones: the same tokens on two engines in the same
    state (the draft's draws come from generators of its own, seeded from the request's
    seed, so the target's stream is the request's alone); proposals judged by the rule."""
    seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    others = SamplingParams(max_tokens=24, temperature=1.0, seed=8, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = build_engine(
            tiny_model_dir, enable_prefix_caching=False, **draft_settings(tiny_draft_dir)
        )
        engine.add_request("others", PROMPTS[1], others)
        engine.add_request("seeded", PROMPTS[0], seeded)
        tokens = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.token_ids
        runs.append(tokens)
        proposed, accepted = spec_counts(engine)
        assert proposed > 0 and 0 < accepted < proposed
    assert runs[0] == runs[1]
    assert all(len(t) == 24 for t in runs[0].values())


def test_draft_state_keeps_only_the_tentative_tokens_the_request_appended():
    state = DraftState(confirmed=5, tentative=[7, 8, 9])
    state.sync([0, 1, 2, 3, 4, 7, 8, 3, 3])  # 7, 8 accepted, then another token
    assert (state.confirmed, state.tentative) == (7, [])
    state = DraftState(confirmed=5, tentative=[7, 8, 9])
    state.sync([0, 1, 2, 3, 4, 7, 8, 9])  # all appended: the last token is fed again
    assert state.confirmed == 7
    state = DraftState(confirmed=5, tentative=[7])
    state.sync([0, 1, 2, 3, 4, 6])  # rejected at once
    assert state.confirmed == 5


def test_draft_cache_grows_by_blocks_and_refuses_what_it_cannot_hold(tiny_model_dir):
    from loramux.engine.model.loader import load_model

    model = load_model(tiny_model_dir, dtype=torch.float32, device=torch.device("cpu"))
    cache = DraftCache(model, num_blocks=4, block_size=4)
    blocks: list[int] = []
    assert cache.grow(blocks, 9) and len(blocks) == 3
    assert not cache.grow(blocks, 17) and len(blocks) == 3  # 5 blocks needed, 4 exist
    assert cache.grow(blocks, 16) and cache.num_free_blocks == 0
    cache.release(blocks)
    assert blocks == [] and cache.num_free_blocks == 4


def test_a_draft_with_a_shorter_context_is_refused(tiny_model_dir, tmp_path, tokenizer_dir):
    other = build_tiny_model(tmp_path / "other", tokenizer_dir, max_position_embeddings=64)
    with pytest.raises(EngineError, match="handles 64 positions, fewer than"):
        build_engine(tiny_model_dir, **draft_settings(other))


def test_a_draft_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path, tokenizer_dir):
    other = build_tiny_model(tmp_path / "other", tokenizer_dir, vocab_size=50_000)
    with pytest.raises(EngineError, match="50000 tokens and the target's 49152"):
        build_engine(tiny_model_dir, **draft_settings(other))


def test_a_draft_cache_too_small_to_propose_is_refused(tiny_model_dir, tiny_draft_dir):
    with pytest.raises(EngineError, match="holds 4 tokens: raise draft_kv_cache_bytes"):
        build_engine(
            tiny_model_dir,
            block_size=4,
            **draft_settings(tiny_draft_dir, draft_kv_cache_bytes=2048),
        )


def test_requests_past_the_draft_cache_decode_without_proposals(tiny_model_dir, tiny_draft_dir):
    """A draft cache of 8 blocks (32 tokens): a 40-token request never gets proposals, a
    short one does, and both end with the plain engine's tokens."""
    engine = build_engine(
        tiny_model_dir,
        block_size=4,
        **draft_settings(tiny_draft_dir, draft_kv_cache_bytes=8 * 2048),
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    long_prompt = " ".join(PROMPTS) + " " + PROMPTS[0]
    prompts = [long_prompt, PROMPTS[1]]
    assert len(engine.tokenizer(long_prompt)["input_ids"]) > 32
    plain = build_engine(tiny_model_dir, block_size=4).generate(prompts, params)
    spec = engine.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec[0].metrics.spec_proposed_tokens == 0 < spec[1].metrics.spec_proposed_tokens
