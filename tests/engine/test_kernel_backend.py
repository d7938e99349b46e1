"""The kernel backend: chosen once from the device, dtype and LORAMUX_KERNELS; the torch
backend's LoRA over a real pool (against the adapters' own weights) by both of its ops: the
native op (``auto`` on a float32 CPU engine) and the stacked torch ops, whose stacks are
kept across steps while the same adapters decode and rebuilt when the pool's rows change."""

from __future__ import annotations

import pytest
import torch

from loramux.engine import EngineConfig
from loramux.engine.lora.backend import select_backend
from loramux.engine.lora.torch_backend import SHORT_SEGMENT_TOKENS, TorchBackend
from loramux.engine.model.llama import PROJECTION_GROUPS
from loramux.kernels.dispatch import KERNELS_ENV, resolve_kernels
from tests.engine.factories import build_engine
from tests.engine.test_lora_pool import CONFIG, make_pool, make_weights

CPU = torch.device("cpu")


def test_resolve_kernels():
    assert resolve_kernels(None, "cpu") == "torch"
    assert resolve_kernels(" AUTO ", "cuda") == "triton"
    assert resolve_kernels("reference", "cuda") == "torch"  # the old name
    assert resolve_kernels("triton", "cpu") == "triton"  # Triton's interpreter, in tests
    with pytest.raises(ValueError, match="not one of auto, torch, triton"):
        resolve_kernels("cuda", "cpu")


def test_select_backend_reads_the_environment_once_and_checks_the_dtype(monkeypatch):
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert select_backend(CPU, torch.float32).name == "torch"
    monkeypatch.setenv(KERNELS_ENV, "torch")
    assert select_backend(torch.device("cuda"), torch.bfloat16).name == "torch"
    monkeypatch.setenv(KERNELS_ENV, "nonsense")
    with pytest.raises(ValueError, match="LORAMUX_KERNELS='nonsense'"):
        select_backend(CPU, torch.float32)
    # auto on CUDA with a dtype the Triton kernels lack: torch; forced Triton: an error.
    assert select_backend(torch.device("cuda"), torch.float64, "auto").name == "torch"
    with pytest.raises(ValueError, match="Triton kernels take"):
        select_backend(CPU, torch.float64, "triton")


def test_auto_on_a_float32_cpu_engine_applies_lora_with_the_native_op(monkeypatch):
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert select_backend(CPU, torch.float32).lora_op == "native"
    assert select_backend(CPU, torch.float32, "auto").lora_op == "native"
    # An explicit torch keeps to torch ops; the native op takes float32 only.
    assert select_backend(CPU, torch.float32, "torch").lora_op == "stacked"
    assert select_backend(CPU, torch.float64).lora_op == "stacked"


def test_the_engine_holds_one_backend(tiny_model_dir, monkeypatch):
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    engine = build_engine(tiny_model_dir)
    assert engine.backend.name == "torch"
    assert engine.backend.lora_op == "native"
    assert engine.executor.backend is engine.backend
    assert engine.executor.static_decode is None


def test_the_engine_config_chooses_the_kernels_over_the_environment(tiny_model_dir, monkeypatch):
    """EngineConfig.kernels (the platform's LORAMUX_ENGINE_KERNELS) wins; LORAMUX_KERNELS is
    read only when it is unset."""
    monkeypatch.setenv(KERNELS_ENV, "nonsense")
    engine = build_engine(tiny_model_dir, kernels="torch")
    assert (engine.backend.name, engine.backend.lora_op) == ("torch", "stacked")
    with pytest.raises(ValueError, match=r"EngineConfig\.kernels must be one of auto, torch"):
        EngineConfig(model=str(tiny_model_dir), kernels="cuda")


def _expected(pool, loaded, spans, x, layer, module):
    out = torch.zeros(x.shape[0], CONFIG.module_shape(module)[1])
    for start, end, adapter in spans:
        mw = None if adapter is None else loaded[adapter].modules.get(module)
        if mw is not None and layer in mw.a:
            out[start:end] = mw.scale * (x[start:end] @ mw.a[layer].T @ mw.b[layer].T)
    return out


def _run_step(backend, pool, spans, gen):
    """Every group of every layer of one step: (got, x) per (layer, module)."""
    step = backend.lora_step(pool.step_table(spans), pool)
    tokens = spans[-1][1]
    results = {}
    for layer in range(CONFIG.num_layers):
        for group in PROJECTION_GROUPS:
            in_f = CONFIG.module_shape(group[0])[0]
            x = torch.randn(tokens, in_f, generator=gen)
            outs = [torch.zeros(tokens, CONFIG.module_shape(m)[1]) for m in group]
            step.add(x, outs, layer, group)
            for module, out in zip(group, outs, strict=True):
                results[(layer, module)] = (out, x)
    return results


def _loaded_pool():
    """A pool with three adapters of their own modules and ranks; and their weights by id."""
    pool, _, _ = make_pool()
    loaded = {
        1: make_weights(2, seed=1),
        2: make_weights(4, seed=2, modules=("q_proj", "v_proj", "down_proj")),
        3: make_weights(3, seed=3, module_ranks={"k_proj": 1, "up_proj": 2}),
    }
    for adapter_id, weights in loaded.items():
        pool.load(adapter_id, weights)
    return pool, loaded


def _replace_adapter_1(pool, loaded) -> None:
    """Adapter 1 out, adapter 4 in: new contents in the pool's rows."""
    pool.unload(1)
    del loaded[1]
    loaded[4] = make_weights(2, seed=4)
    pool.load(4, loaded[4])


def _check(results, pool, loaded, spans):
    for (layer, module), (got, x) in results.items():
        expected = _expected(pool, loaded, spans, x, layer, module)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_torch_backend_matches_the_adapters_and_reuses_its_stacks():
    pool, loaded = _loaded_pool()
    backend = TorchBackend(CPU)
    gen = torch.Generator().manual_seed(0)
    long = SHORT_SEGMENT_TOKENS + 2
    # Decodes of every adapter (2 twice), then a long prefill of 3 beside them.
    decode = [(0, 1, 2), (1, 2, None), (2, 3, 1), (3, 4, 3), (4, 5, 2)]
    _check(_run_step(backend, pool, decode, gen), pool, loaded, decode)
    builds = backend.stacks.builds
    assert builds == CONFIG.num_layers * len(PROJECTION_GROUPS)

    # The same adapters in the same order, other token counts: reused, not copied again.
    again = [(0, 2, 2), (2, 3, 1), (3, 5, 3)]
    _check(_run_step(backend, pool, again, gen), pool, loaded, again)
    assert backend.stacks.builds == builds
    # In another order: stacked again (the scheduler keeps one order, by adapter id).
    reordered = [(0, 1, 3), (1, 3, 2), (3, 4, 1)]
    _check(_run_step(backend, pool, reordered, gen), pool, loaded, reordered)
    assert backend.stacks.builds == 2 * builds

    mixed = [(0, 1, 1), (1, long + 1, 3), (long + 1, long + 2, 2)]
    _check(_run_step(backend, pool, mixed, gen), pool, loaded, mixed)

    # New contents in the pool's rows (another adapter loaded): stale stacks are rebuilt.
    _replace_adapter_1(pool, loaded)
    builds = backend.stacks.builds
    again = [(0, 1, 4), (1, 2, 2), (2, 3, 3)]
    _check(_run_step(backend, pool, again, gen), pool, loaded, again)
    assert backend.stacks.builds > builds


def test_the_native_op_matches_the_adapters_over_the_pool(monkeypatch):
    """Decodes, a long prefill beside them, adapters with modules and ranks of their own,
    then other adapters in the rows: the op reads the pool as it is at each step."""
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    pool, loaded = _loaded_pool()
    backend = select_backend(CPU, torch.float32)
    assert backend.lora_op == "native"
    gen = torch.Generator().manual_seed(0)
    decode = [(0, 1, 2), (1, 2, None), (2, 3, 1), (3, 4, 3), (4, 5, 2)]
    _check(_run_step(backend, pool, decode, gen), pool, loaded, decode)
    long = SHORT_SEGMENT_TOKENS + 2
    mixed = [(0, 1, 1), (1, long + 1, 3), (long + 1, long + 2, 2)]
    _check(_run_step(backend, pool, mixed, gen), pool, loaded, mixed)
    _replace_adapter_1(pool, loaded)
    again = [(0, 1, 4), (1, 2, 2), (2, 3, 3)]
    _check(_run_step(backend, pool, again, gen), pool, loaded, again)
