"""The engine gives exactly transformers + PEFT's greedy tokens, whatever the batch does.

Each request is compared with the same request run alone through transformers + PEFT.
The batch mixes base requests with three adapters of different ranks and target
modules, requests arrive at different steps, and the engine is pushed through prefix
hits, tiny prefill chunks and preemption.
"""

from __future__ import annotations

import pytest
import torch

from loramux.engine import Engine, SamplingParams
from loramux.kernels.dispatch import KERNELS_ENV
from tests.engine.factories import PROMPTS, build_engine, put_adapters_on_device
from tests.engine.hf_reference import first_step_logits, greedy_tokens

ADAPTER_SPECS = {
    "r4-qv": {"rank": 4, "targets": ("q_proj", "v_proj"), "seed": 1},
    "r8-attn": {"rank": 8, "targets": ("q_proj", "k_proj", "v_proj", "o_proj"), "seed": 2},
    "r16-mlp": {"rank": 16, "targets": ("o_proj", "gate_proj", "up_proj", "down_proj"), "seed": 3},
}
ADAPTER_CYCLE = [None, "r4-qv", "r8-attn", "r16-mlp"]
# The same in PEFT's other formats: r8-attn a DoRA adapter that also trains the tokens of its
# prompts (trainable_token_indices), r4-qv one that saves the LM head whole (modules_to_save),
# r16-mlp one whose B matrices have biases (lora_bias).
FORMAT_ADAPTER_SPECS = {
    "r4-qv": {**ADAPTER_SPECS["r4-qv"], "modules_to_save": ("lm_head",)},
    "r8-attn": {
        **ADAPTER_SPECS["r8-attn"],
        "use_dora": True,
        "trainable_text": f"{PROMPTS[2]} {PROMPTS[6]}",  # mixed_requests' for r8-attn
    },
    "r16-mlp": {**ADAPTER_SPECS["r16-mlp"], "lora_bias": True},
}


# For a mixture-of-experts model: r16-mlp's MLP LoRA is on the stacked experts
# (target_parameters, rank 8 per expert; PEFT takes neither DoRA nor a LoRA bias there),
# r4-qv has the LoRA biases instead.
MOE_ADAPTER_SPECS = {
    "r4-qv": {**FORMAT_ADAPTER_SPECS["r4-qv"], "lora_bias": True},
    "r8-attn": FORMAT_ADAPTER_SPECS["r8-attn"],
    "r16-mlp": {
        "rank": 8,
        "targets": ("o_proj",),
        "target_parameters": ("experts.gate_up_proj", "experts.down_proj"),
        "seed": 3,
    },
}


def device_rows(model_dir, adapters: dict, shard=None) -> int:
    """The rank-rows ``adapters`` (name -> dir) take on the device together (of one rank's
    share under ``shard``, a ShardPlan): ranks, DoRA's rows, token tables."""
    from loramux.engine.lora.adapter import load_adapter
    from loramux.engine.memory.arena import RowLayout, adapter_rows
    from loramux.engine.model.config import ModelConfig

    config = ModelConfig.from_pretrained(model_dir)
    local = config if shard is None else shard.local_config()
    layout = RowLayout.for_model(local, 1, 4)
    return sum(
        adapter_rows(layout, local.num_layers, load_adapter(path, config))
        for path in adapters.values()
    )


@pytest.fixture(scope="module")
def tiny_adapters(tiny_model_dir, make_adapter):
    return {name: make_adapter(tiny_model_dir, **spec) for name, spec in ADAPTER_SPECS.items()}


@pytest.fixture(scope="module")
def smollm2_adapters(smollm2_dir, make_adapter):
    return {name: make_adapter(smollm2_dir, **spec) for name, spec in ADAPTER_SPECS.items()}


def run_staggered(engine: Engine, requests: list[tuple[str, str | None]], max_tokens: int):
    """Add one request per step (so they arrive at different steps), then drain."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pending = list(enumerate(requests))
    results: dict[int, list[int]] = {}
    while pending or engine.has_unfinished_requests():
        if pending:
            index, (prompt, adapter) = pending.pop(0)
            engine.add_request(f"r{index}", prompt, params, adapter=adapter)
        for out in engine.step():
            if out.finished:
                results[int(out.request_id[1:])] = out.token_ids
    return [results[i] for i in range(len(requests))]


def assert_matches_reference(engine, model_dir, adapters, requests, outputs, max_tokens):
    tokenizer = engine.tokenizer
    for (prompt, adapter), got in zip(requests, outputs, strict=True):
        prompt_ids = tokenizer(prompt)["input_ids"]
        expected = greedy_tokens(
            model_dir,
            None if adapter is None else adapters[adapter],
            prompt_ids,
            max_tokens,
            kv_cache_dtype=engine.config.kv_cache_dtype,
        )
        assert got == expected, f"prompt {prompt!r} adapter {adapter}"


def mixed_requests(count: int) -> list[tuple[str, str | None]]:
    return [
        (PROMPTS[i % len(PROMPTS)], ADAPTER_CYCLE[i % len(ADAPTER_CYCLE)]) for i in range(count)
    ]


@pytest.mark.parametrize(
    ("kernels", "lora_op", "decode_launches"), [("auto", "native", 0.0), ("torch", "stacked", 4.0)]
)
def test_mixed_batch_matches_peft(
    tiny_model_dir, tiny_adapters, monkeypatch, kernels, lora_op, decode_launches
):
    """With both of the CPU's LoRA paths: the native ones (the default: the native decode
    step, the native op in prefill) and the torch ones."""
    monkeypatch.setenv(KERNELS_ENV, kernels)
    engine = build_engine(tiny_model_dir, tiny_adapters)
    assert engine.backend.lora_op == lora_op
    requests = mixed_requests(8)
    outs = engine.generate(
        [p for p, _ in requests],
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        adapters=[a for _, a in requests],
    )
    assert_matches_reference(
        engine, tiny_model_dir, tiny_adapters, requests, [o.token_ids for o in outs], 24
    )
    # The native decode step applies LoRA inside its one call (no op launches of its own);
    # the stacked ops make one batched call per group and layer for a decode step.
    assert engine.stats().lora_launches_per_layer == decode_launches
    native = engine.executor.native_decode
    assert (native is not None and native.steps_run > 0) == (kernels == "auto")


def test_staggered_arrivals_match_peft(tiny_model_dir, tiny_adapters):
    engine = build_engine(tiny_model_dir, tiny_adapters)
    requests = mixed_requests(8)
    outputs = run_staggered(engine, requests, 20)
    assert_matches_reference(engine, tiny_model_dir, tiny_adapters, requests, outputs, 20)


def test_small_prefill_chunks_match_peft(tiny_model_dir, tiny_adapters):
    engine = build_engine(
        tiny_model_dir, tiny_adapters, max_num_batched_tokens=7, max_prefill_chunk=3
    )
    requests = mixed_requests(6)
    outputs = run_staggered(engine, requests, 12)
    assert_matches_reference(engine, tiny_model_dir, tiny_adapters, requests, outputs, 12)


def test_prefix_cache_hits_match_peft(tiny_model_dir, tiny_adapters):
    engine = build_engine(tiny_model_dir, tiny_adapters, block_size=4)
    system = "You are a helpful assistant who answers briefly and precisely. "
    requests = [(system + p, a) for p, a in mixed_requests(8)]
    first = run_staggered(engine, requests, 10)
    hits_before = engine.kv.prefix_cache_hits
    assert hits_before > 0  # the shared system prompt hit within the first round
    second = run_staggered(engine, requests, 10)
    assert engine.kv.prefix_cache_hits > hits_before
    assert first == second
    assert_matches_reference(engine, tiny_model_dir, tiny_adapters, requests, second, 10)


def test_prefix_cache_is_keyed_by_adapter(tiny_model_dir, tiny_adapters):
    engine = build_engine(tiny_model_dir, tiny_adapters, block_size=4)
    prompt = "A prompt long enough to fill several KV blocks of four tokens each."
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    base = engine.generate([prompt], params)[0]
    adapted = engine.generate([prompt], params, adapters=["r8-attn"])[0]
    assert adapted.metrics.cached_prompt_tokens == 0  # no KV shared across adapters
    again = engine.generate([prompt], params, adapters=["r8-attn"])[0]
    assert again.metrics.cached_prompt_tokens > 0
    assert again.token_ids == adapted.token_ids
    assert base.token_ids == greedy_tokens(
        tiny_model_dir, None, engine.tokenizer(prompt)["input_ids"], 8
    )


def test_preemption_matches_peft(tiny_model_dir, tiny_adapters):
    # ~2 layers x 2 kv heads x 16 dim x 2 x 4 bytes = 512 bytes/token; 24 blocks of 4 for KV
    # beside the adapters' 28 rank-rows of 8 KiB (one budget), contexts capped at 96 tokens.
    engine = build_engine(
        tiny_model_dir,
        tiny_adapters,
        kv_cache_bytes=24 * 4 * 512 + 28 * 8192,
        max_model_len=96,
        block_size=4,
    )
    requests = mixed_requests(8)
    put_adapters_on_device(engine, tiny_adapters)  # KV left its floor: preemption
    outputs = run_staggered(engine, requests, 24)
    assert engine.num_preemptions > 0
    assert_matches_reference(engine, tiny_model_dir, tiny_adapters, requests, outputs, 24)
    assert engine.kv.num_used_blocks == 0


def assert_first_step_logits_match(engine, model_dir, adapters):
    """The engine's logits for a mixed first step equal transformers + PEFT's, per request."""
    captured = []
    compute = engine.model.compute_logits
    engine.model.compute_logits = lambda *args: captured.append(compute(*args)) or captured[-1]
    requests = mixed_requests(4)
    engine.generate(
        [p for p, _ in requests],
        SamplingParams(max_tokens=1, temperature=0.0),
        adapters=[a for _, a in requests],
    )
    logits = captured[0]
    assert logits.shape[0] == len(requests)
    for row, (prompt, adapter) in enumerate(requests):
        expected = first_step_logits(
            model_dir,
            None if adapter is None else adapters[adapter],
            engine.tokenizer(prompt)["input_ids"],
        )
        got = logits[_row_of(engine, requests, row)]
        rel = (got - expected).abs().max() / expected.abs().max()
        assert rel < 1e-4, (prompt, adapter, float(rel))


def test_first_step_logits_match_peft(tiny_model_dir, tiny_adapters):
    engine = build_engine(tiny_model_dir, tiny_adapters)
    assert_first_step_logits_match(engine, tiny_model_dir, tiny_adapters)


def _row_of(engine, requests, index):
    """Logit rows follow the runner's layout: grouped by adapter id, base first."""

    def key(i):
        adapter = requests[i][1]
        return -1 if adapter is None else engine.tiers.get(adapter).adapter_id

    return sorted(range(len(requests)), key=key).index(index)


@pytest.mark.slow
def test_smollm2_mixed_batch_matches_peft(smollm2_dir, smollm2_adapters):
    engine = build_engine(
        smollm2_dir,
        smollm2_adapters,
        kv_cache_bytes=64 << 20,
        max_model_len=512,
        max_num_batched_tokens=64,
    )
    requests = mixed_requests(6)
    outputs = run_staggered(engine, requests, 16)
    assert_matches_reference(engine, smollm2_dir, smollm2_adapters, requests, outputs, 16)


@pytest.mark.slow
def test_smollm2_preemption_and_prefix_hits_match_peft(smollm2_dir, smollm2_adapters):
    # 30 layers x 3 kv heads x 64 x 2 x 4 bytes = 46 KiB per token; 20 blocks of 4 tokens for
    # KV beside the adapters' 28 rank-rows (a row: 5184 x 4 bytes x k, v x 30 layers), in one
    # budget; contexts capped at 80 tokens.
    engine = build_engine(
        smollm2_dir,
        smollm2_adapters,
        kv_cache_bytes=20 * 4 * 46080 + 29 * 1244160,
        max_model_len=80,
        block_size=4,
        max_num_batched_tokens=32,
        max_prefill_chunk=8,
    )
    requests = [
        ("Answer briefly and precisely, in plain English words. " + p, a)
        for p, a in mixed_requests(6)
    ]
    put_adapters_on_device(engine, smollm2_adapters)  # KV left its floor: preemption
    outputs = run_staggered(engine, requests, 12)
    assert engine.num_preemptions > 0
    assert engine.kv.prefix_cache_hits > 0
    assert_matches_reference(engine, smollm2_dir, smollm2_adapters, requests, outputs, 12)


def test_fp32_engine_computes_float32_logits(tiny_model_dir):
    engine = build_engine(tiny_model_dir)
    captured = []
    compute = engine.model.compute_logits
    engine.model.compute_logits = lambda *args: captured.append(compute(*args)) or captured[-1]
    engine.generate(PROMPTS[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert captured
    assert all(logits.dtype == torch.float32 for logits in captured)


@pytest.mark.slow
def test_smollm2_first_step_logits_match_peft(smollm2_dir, smollm2_adapters):
    # 64 MiB holds KV for one 512-token context and the three adapters' rows besides.
    engine = build_engine(smollm2_dir, smollm2_adapters, kv_cache_bytes=64 << 20, max_model_len=512)
    assert_first_step_logits_match(engine, smollm2_dir, smollm2_adapters)
