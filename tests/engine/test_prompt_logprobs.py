"""Prompt logprobs (``echo`` + ``logprobs`` scoring) equal transformers + PEFT's, however the
prompt is computed: in chunks, after a prefix-cache hit, after a preemption, beside
requests that don't ask, and on the static decode path; ``max_tokens=0`` scores a prompt
without generating.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from loramux.engine import AsyncEngine, EngineError, SamplingParams
from loramux.engine.model import llama
from loramux.engine.sampling_params import MAX_LOGPROBS
from loramux.kernels import dispatch
from tests.engine.factories import PROMPTS, build_engine
from tests.engine.hf_reference import greedy_tokens, reference_model

TOL = 1e-4
ADAPTERS = {
    "r8-attn": {"rank": 8, "targets": ("q_proj", "k_proj", "v_proj", "o_proj"), "seed": 2},
    "r16-mlp": {"rank": 16, "targets": ("o_proj", "gate_proj", "up_proj", "down_proj"), "seed": 3},
}
LONG = "You are a helpful assistant who answers briefly and precisely, in plain words. "


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, make_adapter):
    return {name: make_adapter(tiny_model_dir, **spec) for name, spec in ADAPTERS.items()}


@torch.inference_mode()
def reference_logprobs(model_dir, adapter_dir, prompt_ids: list[int]) -> torch.Tensor:
    """transformers + PEFT's log_softmax over the prompt's positions, [P, vocab]."""
    model = reference_model(model_dir, adapter_dir)
    logits = model(input_ids=torch.tensor([prompt_ids])).logits[0]
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


def assert_matches_reference(out, model_dir, adapter_dir, top: int) -> None:
    ids = out.prompt_token_ids
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(ids)
    assert entries[0] is None  # the first token has no context
    ref = reference_logprobs(model_dir, adapter_dir, ids)
    worst = 0.0
    for i in range(1, len(ids)):
        entry = entries[i]
        assert entry.token_id == ids[i]
        worst = max(worst, abs(entry.logprob - float(ref[i - 1, ids[i]])))
        assert len(entry.top) == top
        if top:
            values, indices = ref[i - 1].topk(top)
            assert [t for t, _ in entry.top] == indices.tolist(), f"position {i}"
            got = torch.tensor([v for _, v in entry.top])
            worst = max(worst, float((got - values).abs().max()))
    assert worst < TOL, worst


def adapter_dir(adapters, name):
    return None if name is None else adapters[name]


def run_all(engine, requests) -> dict[str, list]:
    """Add (request id, prompt, params, adapter) requests at once; every output per id."""
    for rid, prompt, params, adapter in requests:
        engine.add_request(rid, prompt, params, adapter=adapter)
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


@pytest.mark.parametrize("adapter", [None, "r8-attn", "r16-mlp"])
def test_prompt_logprobs_match_peft(tiny_model_dir, adapters, adapter):
    engine = build_engine(tiny_model_dir, adapters)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5)
    out = engine.generate([LONG + PROMPTS[1]], params, adapters=[adapter])[0]
    assert_matches_reference(out, tiny_model_dir, adapter_dir(adapters, adapter), top=5)


def test_prompt_logprobs_zero_is_the_tokens_alone(tiny_model_dir):
    engine = build_engine(tiny_model_dir)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out = engine.generate([PROMPTS[0]], params)[0]
    assert_matches_reference(out, tiny_model_dir, None, top=0)


def test_chunked_prefill_mixed_adapters_match_peft(tiny_model_dir, adapters):
    """Chunks of 3 tokens in steps of 7: every chunk's first token is scored by the last
    position of the chunk before it, which ran in an earlier step."""
    engine = build_engine(tiny_model_dir, adapters, max_num_batched_tokens=7, max_prefill_chunk=3)
    names = [None, "r8-attn", "r16-mlp", None]
    requests = [
        (f"r{i}", LONG + PROMPTS[i], SamplingParams(max_tokens=2, prompt_logprobs=3), name)
        for i, name in enumerate(names)
    ]
    outputs = run_all(engine, requests)
    for rid, _, _, name in requests:
        assert_matches_reference(outputs[rid][-1], tiny_model_dir, adapter_dir(adapters, name), 3)


def test_a_prefix_cache_hit_does_not_lose_entries(tiny_model_dir):
    """The same prompt twice: the second finds the first's blocks cached. A request that
    collects prompt logprobs computes its prompt anyway; one that doesn't still hits."""
    engine = build_engine(tiny_model_dir, block_size=4)
    prompt = LONG + PROMPTS[2]
    scored = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    first = engine.generate([prompt], scored)[0]
    again = engine.generate([prompt], scored)[0]
    assert again.metrics.cached_prompt_tokens == 0
    assert again.prompt_logprobs == first.prompt_logprobs
    assert_matches_reference(again, tiny_model_dir, None, top=2)
    assert engine.generate([prompt], plain)[0].metrics.cached_prompt_tokens > 0
    # Cached by a request that did not ask: the blocks are there, and still not used.
    other = LONG + PROMPTS[3]
    engine.generate([other], plain)
    late = engine.generate([other], scored)[0]
    assert late.metrics.cached_prompt_tokens == 0
    assert_matches_reference(late, tiny_model_dir, None, top=2)


def test_requests_that_dont_ask_are_unchanged_beside_ones_that_do(tiny_model_dir, adapters):
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    scored = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=4)
    names = [None, "r8-attn", None, "r16-mlp", "r8-attn", None]
    mixed = [greedy if i % 2 else scored for i in range(len(names))]
    prompts = [PROMPTS[i] for i in range(len(names))]
    alone = build_engine(tiny_model_dir, adapters).generate(prompts, greedy, adapters=names)
    outs = build_engine(tiny_model_dir, adapters).generate(prompts, mixed, adapters=names)
    for i, (out, ref) in enumerate(zip(outs, alone, strict=True)):
        assert out.token_ids == ref.token_ids
        if i % 2:
            assert out.prompt_logprobs is None
        else:
            assert_matches_reference(out, tiny_model_dir, adapter_dir(adapters, names[i]), 4)


def test_prompt_logprobs_come_on_the_first_and_the_final_output(tiny_model_dir):
    engine = build_engine(tiny_model_dir, max_num_batched_tokens=8, max_prefill_chunk=4)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    prompt = LONG + PROMPTS[4]
    outs = run_all(engine, [("r", prompt, params, None)])["r"]
    assert len(outs) == 5  # one per token, none for the prefill chunks before the first
    first, *middle, final = outs
    assert first.prompt_logprobs is not None and final.prompt_logprobs == first.prompt_logprobs
    assert all(out.prompt_logprobs is None for out in middle)
    assert_matches_reference(final, tiny_model_dir, None, top=1)
    # Generation after scoring is what greedy decoding gives.
    prompt_ids = engine.tokenizer(prompt)["input_ids"]
    assert final.token_ids == greedy_tokens(tiny_model_dir, None, prompt_ids, 5)


def test_preemption_mid_prompt_neither_duplicates_nor_loses_entries(tiny_model_dir, adapters):
    """Little KV and small chunks: requests are preempted part-way through their prompt
    and recomputed from the start; their entries are each computed once."""
    engine = build_engine(
        tiny_model_dir,
        kv_cache_bytes=20 * 4 * 512,  # 20 blocks of 4 tokens (512 bytes a token)
        max_model_len=80,
        block_size=4,
        max_num_batched_tokens=16,
        max_prefill_chunk=8,
    )
    caught = []
    preempt = engine.scheduler._preempt

    def spy(seq, preempted):
        if seq.prompt_logprobs is not None:
            caught.append((len(seq.prompt_logprobs), len(seq.prompt_token_ids)))
        preempt(seq, preempted)

    engine.scheduler._preempt = spy
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    prompts = [LONG + p for p in PROMPTS[:5]]
    outputs = run_all(engine, [(f"r{i}", p, params, None) for i, p in enumerate(prompts)])
    assert any(1 < have < total for have, total in caught), caught  # mid-prompt preemptions
    for i, prompt in enumerate(prompts):
        final = outputs[f"r{i}"][-1]
        assert_matches_reference(final, tiny_model_dir, None, top=2)
        ids = engine.tokenizer(prompt)["input_ids"]
        assert final.token_ids == greedy_tokens(tiny_model_dir, None, ids, 6)
    assert engine.kv.num_used_blocks == 0


def run_beside_a_bad_adapter(engine, adapters, tiny_model_dir, message: str) -> None:
    """Scored requests on the base model and a good adapter share their prefill steps with
    a failing adapter's: theirs fail, the others keep every entry, exactly."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    names = [None, "r8-attn", "r16-mlp", "r8-attn"]
    requests = [(f"r{i}", LONG + PROMPTS[i], params, n) for i, n in enumerate(names)]
    outputs = run_all(engine, requests)
    for rid, _, _, name in requests:
        final = outputs[rid][-1]
        if name == "r16-mlp":
            assert final.finish_reason == "error" and message in final.error
            assert final.prompt_logprobs is None
        else:
            assert final.finish_reason == "length"
            assert_matches_reference(final, tiny_model_dir, adapter_dir(adapters, name), 2)


def test_non_finite_rows_of_one_adapter_leave_the_others_entries(
    tiny_model_dir, adapters, monkeypatch
):
    """The runner names the NaN adapter's requests; the others' entries of that step come
    with the error, as their sampled tokens do."""
    engine = build_engine(tiny_model_dir, adapters, max_prefill_chunk=16)
    pool = engine.lora_pool
    real_write = pool._write

    def write(start, weights):
        real_write(start, weights)
        if weights.name == "r16-mlp":
            for layer in weights.modules["down_proj"].a:
                pool.a_pool(layer, "down_proj")[start] = float("nan")

    monkeypatch.setattr(pool, "_write", write)
    run_beside_a_bad_adapter(engine, adapters, tiny_model_dir, "non-finite")


def test_a_step_re_run_in_parts_keeps_the_others_entries(tiny_model_dir, adapters, monkeypatch):
    """An exception in one adapter's LoRA step: the step is re-run adapter by adapter, and
    the parts that succeed give their requests' entries."""
    engine = build_engine(tiny_model_dir, adapters, max_prefill_chunk=16)
    real_project = llama._project

    def project(x, linears, layer, modules, lora):
        if lora is not None and layer == 1 and modules == llama.DOWN:
            bad = engine.lora_pool.resident(engine.tiers.get("r16-mlp").adapter_id).row_start
            if any(rows[:1] == [bad] for rows in lora.table.adapter_rows):
                raise RuntimeError("injected fault")
        return real_project(x, linears, layer, modules, lora)

    monkeypatch.setattr(llama, "_project", project)
    run_beside_a_bad_adapter(engine, adapters, tiny_model_dir, "injected fault")
    assert engine.metrics.step_reruns._value.get() > 0


# --- max_tokens=0: score the prompt, generate nothing ---------------------------------------


def test_max_tokens_zero_scores_the_prompt_and_finishes_without_a_token(tiny_model_dir):
    engine = build_engine(tiny_model_dir, max_num_batched_tokens=8, max_prefill_chunk=5)
    registry = engine.metrics.registry

    def generated():
        return registry.get_sample_value("loramux_generated_tokens_total")

    before = generated()
    score = SamplingParams(max_tokens=0, prompt_logprobs=3)
    decode = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outputs = run_all(
        engine,
        [
            ("score", LONG + PROMPTS[5], score, None),
            ("decode", PROMPTS[6], decode, None),
            ("score-short", "Hi", score, None),
        ],
    )
    for rid in ("score", "score-short"):
        (out,) = outputs[rid]  # one output, the final one
        assert out.finished and out.finish_reason == "length" and out.stop_reason is None
        assert out.token_ids == [] and out.delta_token_ids == [] and out.text == ""
        assert out.logprobs == []
        assert out.metrics.completion_tokens == 0 and out.metrics.first_token_time is None
        assert out.metrics.time_to_first_token is None
        assert_matches_reference(out, tiny_model_dir, None, top=3)
    assert len(outputs["decode"][-1].token_ids) == 4
    assert generated() - before == 4
    assert engine.kv.num_used_blocks == 0 and not engine.scheduler.running
    assert engine.stats().tenants[None].served_output_tokens == 4


def test_a_one_token_prompt_scores_nothing(tiny_model_dir):
    engine = build_engine(tiny_model_dir)
    out = engine.generate([[42]], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert out.finished and out.token_ids == [] and out.prompt_logprobs == [None]


def test_a_prompt_only_request_may_fill_the_context(tiny_model_dir):
    engine = build_engine(tiny_model_dir, max_model_len=32)
    ids = engine.tokenizer(LONG * 3)["input_ids"][:32]
    out = engine.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert len(out.prompt_logprobs) == 32
    with pytest.raises(EngineError, match="context limit"):
        engine.add_request("x", ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
    with pytest.raises(EngineError, match="context limit"):
        engine.add_request("y", [*ids, 5], SamplingParams(max_tokens=0, prompt_logprobs=0))


def test_max_tokens_zero_streams_one_final_output(tiny_model_dir):
    async def main():
        engine = AsyncEngine(build_engine(tiny_model_dir))
        try:
            params = SamplingParams(max_tokens=0, prompt_logprobs=1)
            return [out async for out in engine.generate(PROMPTS[7], params)]
        finally:
            await engine.stop()

    (out,) = asyncio.run(main())
    assert out.finished and out.finish_reason == "length" and out.token_ids == []
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)


def test_static_decode_path_scores_one_token_chunks(monkeypatch, tiny_model_dir):
    """Prefill chunks of one token beside decodes make steps the static (CUDA-graph) path
    runs; its hidden rows score the prompt as well, and a prompt-only request in such a
    batch never decodes."""
    monkeypatch.setenv(dispatch.KERNELS_ENV, "triton")
    engine = build_engine(tiny_model_dir, cuda_graph_max_batch=4, max_prefill_chunk=1, block_size=4)
    static = engine.executor.static_decode
    assert static is not None
    decode = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    score = SamplingParams(max_tokens=0, prompt_logprobs=2)
    outputs = run_all(engine, [("a", PROMPTS[1], decode, None), ("b", PROMPTS[6], score, None)])
    assert sum(static.steps_run.values()) > 0
    assert outputs["b"][-1].token_ids == [] and len(outputs["a"][-1].token_ids) == 3
    for rid in ("a", "b"):
        assert_matches_reference(outputs[rid][-1], tiny_model_dir, None, top=2)


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"prompt_logprobs": -1}, ["prompt_logprobs", "-1"]),
        ({"prompt_logprobs": MAX_LOGPROBS + 1}, ["prompt_logprobs", str(MAX_LOGPROBS + 1)]),
        ({"prompt_logprobs": 1.5}, ["prompt_logprobs", "integer"]),
        ({"prompt_logprobs": True}, ["prompt_logprobs", "integer"]),
        ({"max_tokens": 0}, ["max_tokens", "prompt_logprobs"]),
        ({"max_tokens": -1, "prompt_logprobs": 0}, ["max_tokens", "-1"]),
        ({"max_tokens": 0, "prompt_logprobs": 0, "min_tokens": 1}, ["min_tokens"]),
    ],
)
def test_bad_prompt_logprobs_params_are_refused(fields, words):
    with pytest.raises(ValueError) as info:
        SamplingParams(**fields)
    for word in words:
        assert word in str(info.value)


def test_prompt_logprobs_params_accept_the_range():
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=MAX_LOGPROBS).prompt_logprobs == MAX_LOGPROBS
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    assert params.max_tokens == 0 and params.min_tokens == 0
    assert SamplingParams().prompt_logprobs is None


@pytest.mark.slow
def test_smollm2_prompt_logprobs_match_peft(smollm2_dir, make_adapter):
    """The real model and a real PEFT adapter, with chunks, beside a request that generates."""
    adapter = make_adapter(smollm2_dir, **ADAPTERS["r8-attn"])
    engine = build_engine(
        smollm2_dir,
        {"r8-attn": adapter},
        kv_cache_bytes=64 << 20,
        max_model_len=256,
        max_num_batched_tokens=32,
        max_prefill_chunk=16,
    )
    score = SamplingParams(max_tokens=0, prompt_logprobs=5)
    decode = SamplingParams(max_tokens=4, temperature=0.0)
    prompt = LONG + PROMPTS[7]
    outputs = run_all(
        engine,
        [
            ("base", prompt, score, None),
            ("lora", prompt, score, "r8-attn"),
            ("gen", PROMPTS[0], decode, "r8-attn"),
        ],
    )
    assert_matches_reference(outputs["base"][-1], smollm2_dir, None, top=5)
    assert_matches_reference(outputs["lora"][-1], smollm2_dir, adapter, top=5)
