"""Several adapters on one request (``engine/lora/mix.py``): the engine's tokens equal
transformers + PEFT's on ``add_weighted_adapter(..., combination_type="cat")`` of the same
adapters and weights, batched with plain requests on the same adapters and the base model;
a mix's cache is its own; what a mix cannot be is refused with the reason."""

from __future__ import annotations

import pytest

from loramux.engine import EngineError, SamplingParams
from loramux.engine.lora.mix import LoRAMix, split_passes
from tests.engine.factories import PROMPTS, build_engine
from tests.engine.hf_reference import greedy_tokens
from tests.engine.test_exactness import ADAPTER_SPECS

MAX_TOKENS = 12
# Different ranks and target modules; weights above one, below zero, and a mix of one.
MIXES = [
    (("r4-qv", 0.7), ("r16-mlp", 0.3)),
    (("r8-attn", 1.5), ("r4-qv", -0.5), ("r16-mlp", 0.25)),
    (("r8-attn", 0.5),),
]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, make_adapter):
    # Larger weights than the exactness test's: a mix must visibly differ from its parts.
    return {
        name: make_adapter(tiny_model_dir, **spec, std=0.3) for name, spec in ADAPTER_SPECS.items()
    }


@pytest.fixture(scope="module")
def engine(tiny_model_dir, adapters):
    return build_engine(tiny_model_dir, adapters)


def _ids(engine, prompt: str) -> list[int]:
    return engine.tokenizer(prompt)["input_ids"]


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _run(engine, requests: list[tuple[str, str | None, tuple | None]]) -> list:
    """Each (prompt, adapter, mix) added in one batch, run to the end; outputs in order."""
    for i, (prompt, adapter, mix) in enumerate(requests):
        engine.add_request(f"mix-{i}", prompt, _greedy(), adapter=adapter, mix=mix)
    final = {}
    while len(final) < len(requests):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[f"mix-{i}"] for i in range(len(requests))]


def test_split_passes_gives_each_mix_part_its_pass_over_one_table():
    entries, passes = split_passes([(0, 3, None), (3, 5, 7), (5, 9, ((7, 0.5), (8, 2.0)))])
    assert entries == [(7, 1.0), (7, 0.5), (8, 2.0)]
    assert passes == [
        [(0, 3, None), (3, 5, 0), (5, 9, 1)],
        [(0, 3, None), (3, 5, None), (5, 9, 2)],
    ]
    assert split_passes([(0, 2, 4)]) == ([(4, 1.0)], [[(0, 2, 0)]])


def test_a_mix_gives_peft_weighted_combinations_tokens_batched_with_plain_requests(
    engine, tiny_model_dir, adapters
):
    requests = [(PROMPTS[i], None, mix) for i, mix in enumerate(MIXES)]
    # The same adapters alone (weight 1) and the base model in the same steps.
    requests += [
        (PROMPTS[3], "r4-qv", None),
        (PROMPTS[4], "r16-mlp", None),
        (PROMPTS[5], None, None),
    ]
    outputs = _run(engine, requests)
    for (prompt, adapter, mix), out in zip(requests, outputs, strict=True):
        assert out.finish_reason == "length", out.error
        parts = None if mix is None else [(adapters[name], weight) for name, weight in mix]
        expected = greedy_tokens(
            tiny_model_dir,
            None if adapter is None else adapters[adapter],
            _ids(engine, prompt),
            MAX_TOKENS,
            mix=parts,
        )
        assert out.token_ids == expected, (adapter, mix)
    # Not trivially equal to a part alone: the first mix differs from r4-qv by itself.
    alone = _run(engine, [(PROMPTS[0], "r4-qv", None)])[0]
    assert alone.token_ids != outputs[0].token_ids
    assert outputs[0].adapter == "r4-qv*0.7+r16-mlp*0.3"


def test_a_mix_never_shares_cached_kv_with_its_parts_or_other_weights(engine):
    prompt = " ".join(PROMPTS)  # several KV blocks
    first, again = (
        _run(engine, [(prompt, None, MIXES[0])]),
        _run(engine, [(prompt, None, MIXES[0])]),
    )
    assert first[0].metrics.cached_prompt_tokens == 0
    assert again[0].metrics.cached_prompt_tokens > 0  # the same mix hits its own blocks
    reweighted = (("r4-qv", 0.7), ("r16-mlp", 0.31))
    for adapter, mix in (("r4-qv", None), (None, reweighted), (None, MIXES[0][::-1])):
        out = _run(engine, [(prompt, adapter, mix)])[0]
        assert out.metrics.cached_prompt_tokens == 0, (adapter, mix)


def test_what_a_mix_cannot_be_is_refused_naming_it(engine):
    greedy = _greedy()
    for mix, words in (
        ((("r4-qv", 0.5), ("nope", 0.5)), "unknown adapter 'nope'"),
        ((("r4-qv", 0.5), ("r4-qv", 0.5)), "names an adapter twice"),
        ((("r4-qv", float("nan")),), "not a finite number"),
        ((("r4-qv", 1e9),), "not a finite number"),
        ((), "at least one adapter"),
    ):
        with pytest.raises(EngineError, match=words):
            engine.add_request("refused", "Hi", greedy, mix=mix)
    with pytest.raises(EngineError, match="not both"):
        engine.add_request("refused", "Hi", greedy, adapter="r4-qv", mix=(("r8-attn", 1.0),))
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="at least one"):
        LoRAMix(())


def test_a_mix_with_a_dora_part_ends_with_the_reason(tiny_model_dir, make_adapter, adapters):
    dora = make_adapter(tiny_model_dir, **ADAPTER_SPECS["r8-attn"], use_dora=True)
    engine = build_engine(tiny_model_dir, {"dora": dora, "r4-qv": adapters["r4-qv"]})
    out = _run(engine, [(PROMPTS[0], None, (("r4-qv", 0.5), ("dora", 0.5)))])[0]
    assert out.finish_reason == "error"
    assert out.error_kind == "not_mixable"
    assert "'dora' cannot be part of a mix: it is a DoRA adapter" in out.error
    # Its parts still serve alone, and a request in use of one holds it against removal.
    assert _run(engine, [(PROMPTS[1], "dora", None)])[0].finish_reason == "length"
    engine.add_request("holds", PROMPTS[2], _greedy(), mix=(("r4-qv", 2.0),))
    with pytest.raises(EngineError, match="in use"):
        engine.remove_adapter("r4-qv")
    engine.abort("holds")
