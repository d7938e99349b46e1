"""The engine's Triton path gives transformers + PEFT's greedy tokens too.

``LORAMUX_KERNELS=triton`` sends every op the engine makes on CUDA through the Triton
kernels; without a GPU they run in Triton's interpreter (see
``tests/fixtures/triton_interpreter.py``), so this checks on the CPU what the kernels'
own tests cannot: the engine's wiring (the pool's per-step ``LoRABatch`` over all seven
target modules, each projection group's slices in one launch (fused per token, fused per
segment tile) or two (shrink and expand), the attention plan's Triton tables, and decode
and prefill rows in the same step). Small requests: the interpreter is slow.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from loramux.engine import SamplingParams
from loramux.kernels import attention_triton, dispatch, lora_triton, lora_triton_fused
from tests.engine.factories import build_engine
from tests.engine.test_exactness import (
    FORMAT_ADAPTER_SPECS,
    assert_matches_reference,
    mixed_requests,
    run_staggered,
    tiny_adapters,  # noqa: F401 (fixture)
)

LAUNCHERS = {
    lora_triton: ("lora_shrink_sgmv", "lora_expand_sgmv_outs"),
    lora_triton_fused: ("lora_fused_bgmv", "lora_fused_sgmv"),
    attention_triton: ("paged_decode_attention", "paged_prefill_attention"),
}
# Steps of more tokens than this take the two-launch path (the default table fuses up to
# 128, more than these small requests ever batch), so every LoRA form runs.
FUSED_MAX_TOKENS = 6


@pytest.fixture
def triton_kernels(monkeypatch) -> Counter:
    """Triton ops everywhere; counts the launcher calls (the test asserts they all ran)."""
    monkeypatch.setenv(dispatch.KERNELS_ENV, "triton")
    calls: Counter = Counter()
    for module, names in LAUNCHERS.items():
        for name in names:
            launcher = getattr(module, name)

            def counted(*args, _launcher=launcher, _name=name, **kwargs):
                calls[_name] += 1
                return _launcher(*args, **kwargs)

            monkeypatch.setattr(module, name, counted)
    return calls


TWO_LAUNCH = {"lora_shrink_sgmv", "lora_expand_sgmv_outs"}


def _assert_every_launcher_ran(calls: Counter, *, but: frozenset[str] = frozenset()) -> None:
    expected = {name for names in LAUNCHERS.values() for name in names} - but
    assert {name for name, count in calls.items() if count} == expected, calls


def _engine(model_dir, adapters, fused_max_tokens: int = FUSED_MAX_TOKENS, **overrides):
    # Every step built afresh (decode-only steps too): tests/engine/test_static_decode.py
    # covers the fixed-buffer path.
    engine = build_engine(model_dir, adapters, cuda_graph_max_batch=0, **overrides)
    assert engine.backend.name == "triton", "the engine did not take the Triton backend"
    engine.backend.tiles = dataclasses.replace(
        engine.backend.tiles, fused_max_tokens=fused_max_tokens
    )
    return engine


def test_mixed_batch_matches_peft(triton_kernels, tiny_model_dir, tiny_adapters):  # noqa: F811
    """The default tiles: the prompts' step is fused per segment tile, decodes per token."""
    engine = _engine(tiny_model_dir, tiny_adapters, fused_max_tokens=128)
    requests = mixed_requests(4)
    outs = engine.generate(
        [p for p, _ in requests],
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        adapters=[a for _, a in requests],
    )
    assert_matches_reference(
        engine, tiny_model_dir, tiny_adapters, requests, [o.token_ids for o in outs], 5
    )
    _assert_every_launcher_ran(triton_kernels, but=frozenset(TWO_LAUNCH))


def test_staggered_chunks_and_prefix_hits_match_peft(
    triton_kernels,
    tiny_model_dir,
    tiny_adapters,  # noqa: F811
):
    """Steps that mix decodes with prefill chunks over cached prefixes."""
    engine = _engine(
        tiny_model_dir, tiny_adapters, block_size=4, max_num_batched_tokens=12, max_prefill_chunk=5
    )
    system = "Answer briefly. "
    requests = [(system + p, a) for p, a in mixed_requests(4)]
    first = run_staggered(engine, requests, 4)
    second = run_staggered(engine, requests, 4)
    assert engine.kv.prefix_cache_hits > 0
    assert first == second
    assert_matches_reference(engine, tiny_model_dir, tiny_adapters, requests, second, 4)
    _assert_every_launcher_ran(triton_kernels)


def test_dora_adapters_match_peft_over_the_triton_kernels(
    triton_kernels, tiny_model_dir, make_adapter
):
    """DoRA's term beside every LoRA form (its folded B goes through the kernels as any B)."""
    adapters = {
        name: make_adapter(tiny_model_dir, **spec) for name, spec in FORMAT_ADAPTER_SPECS.items()
    }
    engine = _engine(tiny_model_dir, adapters, max_num_batched_tokens=12, max_prefill_chunk=5)
    requests = mixed_requests(4)
    outputs = run_staggered(engine, requests, 4)
    assert_matches_reference(engine, tiny_model_dir, adapters, requests, outputs, 4)
    _assert_every_launcher_ran(triton_kernels)


def test_quantized_model_matches_peft_on_its_dequantized_weights(
    triton_kernels,
    tiny_model_dir,
    tiny_adapters,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """int4 projections and an int8 LM head through the Triton quantized matmul."""
    from loramux.kernels import quant_triton
    from tests.fixtures.models import build_dequantized_model

    launcher = quant_triton.quant_linear_triton

    def counted(*args, **kwargs):
        triton_kernels["quant_linear_triton"] += 1
        return launcher(*args, **kwargs)

    monkeypatch.setattr(quant_triton, "quant_linear_triton", counted)
    engine = _engine(tiny_model_dir, tiny_adapters, quantization="int4")
    requests = mixed_requests(4)
    outs = engine.generate(
        [p for p, _ in requests],
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        adapters=[a for _, a in requests],
    )
    reference = build_dequantized_model(tiny_model_dir, tmp_path / "deq", quantization="int4")
    assert_matches_reference(
        engine, reference, tiny_adapters, requests, [o.token_ids for o in outs], 3
    )
    assert triton_kernels["quant_linear_triton"] > 0


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_cache_matches_peft_with_the_same_cache(
    triton_kernels,
    tiny_model_dir,
    tiny_adapters,  # noqa: F811
    kv_cache_dtype,
):
    """The attention kernels read 8-bit keys and values with their scales; decode and
    prefill rows in one step, staggered arrivals."""
    engine = _engine(tiny_model_dir, tiny_adapters, kv_cache_dtype=kv_cache_dtype)
    requests = mixed_requests(4)
    outputs = run_staggered(engine, requests, 4)
    assert_matches_reference(engine, tiny_model_dir, tiny_adapters, requests, outputs, 4)
    _assert_every_launcher_ran(triton_kernels)


class _CountedKernel:
    """A Triton kernel whose grid launches are counted (``kernel[grid](...)``)."""

    def __init__(self, kernel, launches: Counter, name: str):
        self.kernel, self.launches, self.name = kernel, launches, name

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def counted(*args, **kwargs):
            self.launches[self.name] += 1
            return launch(*args, **kwargs)

        return counted


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_a_decode_step_makes_one_lora_launch_per_projection_group(
    monkeypatch,
    tiny_model_dir,
    tiny_adapters,  # noqa: F811
    static,
):
    """Counted at the kernels themselves, not by the backend: every step of these small
    requests with adapters launches exactly one LoRA kernel per projection group and
    layer (4 a layer, where a shrink per group, an expand per module and the intermediate's
    zero-fill per group made 15), what the backend
    counts is the same, and the engine's stats report it. ``static``: the fixed-buffer
    path the CUDA graphs capture (run eagerly on the CPU)."""
    monkeypatch.setenv(dispatch.KERNELS_ENV, "triton")
    launches: Counter = Counter()
    for module in (lora_triton, lora_triton_fused):
        for name in [n for n in vars(module) if n.endswith("_kernel")]:
            monkeypatch.setattr(module, name, _CountedKernel(getattr(module, name), launches, name))
    engine = build_engine(tiny_model_dir, tiny_adapters, cuda_graph_max_batch=4 if static else 0)
    executor = engine.executor
    assert (executor.static_decode is not None) == static
    layers = len(executor.model.model.layers)
    steps = []  # (decode only, launches counted at the kernels, launches the backend counted)
    execute = executor.execute

    def counted_execute(batch):
        before = launches.total()
        result = execute(batch)
        steps.append(
            (batch.forward.is_decode_only, launches.total() - before, result.lora_launches)
        )
        return result

    monkeypatch.setattr(executor, "execute", counted_execute)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, (prompt, adapter) in enumerate(mixed_requests(4)):
        engine.add_request(f"r{i}", prompt, params, adapter=adapter)
    while engine.has_unfinished_requests():
        engine.step()

    assert sum(decode for decode, _, _ in steps) >= 2, steps
    assert all(kernels == backend == 4 * layers for _, kernels, backend in steps), steps
    stats = engine.stats()
    assert stats.lora_launches_per_decode_step == 4 * layers
    assert stats.lora_launches_per_layer == 4.0
    decode_kernel = "_fused_bgmv_kernel"
    assert set(launches) == {decode_kernel, "_fused_sgmv_kernel"}, launches
