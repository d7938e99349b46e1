"""The KV + adapter budget: sized to the machine unless set, and what it holds, logged at start."""

from __future__ import annotations

import logging

import pytest
import torch

from loramux.engine import Engine, EngineConfig
from loramux.engine.memory import budget as mb
from loramux.engine.memory.budget import GIB, MIB
from tests.engine.factories import ODD_ROWS_CONFIG, build_engine

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


# --- reading the machine ---------------------------------------------------------------------


def test_mem_available_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       24684096 kB\nMemFree:         1000000 kB\n"
        "MemAvailable:   20971520 kB\nBuffers:          123 kB\n"
    )
    assert mb.read_mem_available(meminfo) == 20 * GIB


def test_without_meminfo_the_free_pages_are_asked(tmp_path):
    value = mb.read_mem_available(tmp_path / "missing")
    assert value is None or value > 0


# --- the rules -------------------------------------------------------------------------------


def test_cpu_takes_a_share_of_the_available_ram():
    budget = mb.cpu_budget(20 * GIB)
    assert budget.bytes == 3 * GIB  # 15%
    assert budget.source == "machine"
    assert budget.detail == "sized to the machine: 15% of 20 GiB available RAM"


@pytest.mark.parametrize(
    ("available", "expected", "words"),
    [
        (2 * GIB, 512 * MIB, "raised to the 512 MiB floor"),  # 15% would be 307 MiB
        (64 * GIB, 4 * GIB, "capped at 4 GiB"),  # 15% would be 9.6 GiB
        (800 * MIB, 400 * MIB, "held to half of what is available"),  # the floor is too much
    ],
)
def test_cpu_share_is_clamped(available, expected, words):
    budget = mb.cpu_budget(available)
    assert budget.bytes == expected
    assert words in budget.detail


def test_cpu_with_the_available_ram_unknown_takes_the_floor():
    budget = mb.cpu_budget(None)
    assert budget.bytes == mb.CPU_MIN_BYTES and "unknown" in budget.detail


def test_cuda_takes_a_share_of_the_free_memory_less_headroom():
    budget = mb.cuda_budget(free_bytes=60 * GIB, activations=GIB // 2)
    # 90% of 60 GiB = 54 GiB, less 1 GiB fixed and 0.5 GiB of activations.
    assert budget.bytes == 52 * GIB + GIB // 2
    assert budget.detail == (
        "sized to the machine: 90% of 60 GiB free after the weights, less 1.5 GiB for activations"
    )


def test_cuda_with_no_room_after_the_weights_says_what_to_set():
    with pytest.raises(ValueError, match="LORAMUX_ENGINE_KV_CACHE_BYTES"):
        mb.cuda_budget(free_bytes=GIB, activations=GIB // 2)


def test_activations_grow_with_the_step_budget():
    # ODD_ROWS_CONFIG: hidden 24, q 24, kv 8, intermediate 40, vocab 32.
    per_token = (4 * 24 + 24 + 2 * 8 + 3 * 40 + 7 * 64) * 2  # bf16
    logits = 4 * 32 * 4 * 2
    assert mb.activation_bytes(ODD_ROWS_CONFIG, 100, 4, 2) == 2 * (100 * per_token + logits)


def _resolve(**overrides):
    fields = {
        "kv_cache_bytes": None,
        "adapter_device_bytes": None,
        "device": CPU,
        "model": ODD_ROWS_CONFIG,
        "dtype": torch.float32,
        "max_num_batched_tokens": 256,
        "max_num_seqs": 8,
        "mem_available": 10 * GIB,
        **overrides,
    }
    return mb.resolve_budget(**fields)


def test_an_explicit_budget_wins():
    budget = _resolve(kv_cache_bytes=123 << 20, mem_available=64 * GIB, cuda_free=70 * GIB)
    assert (budget.bytes, budget.source) == (123 << 20, "set")
    assert _resolve(kv_cache_bytes=5 << 20, device=CUDA).bytes == 5 << 20


def test_unset_it_is_sized_by_device():
    assert _resolve().bytes == int(10 * GIB * 0.15) // MIB * MIB
    on_gpu = _resolve(device=CUDA, dtype=torch.bfloat16, cuda_free=40 * GIB)
    activations = mb.activation_bytes(ODD_ROWS_CONFIG, 256, 8, 2)
    expected = int(40 * GIB * 0.9) - GIB - activations
    assert on_gpu.bytes == expected // MIB * MIB and on_gpu.source == "machine"


def test_adapter_device_bytes_is_checked_against_the_resolved_budget():
    assert _resolve(adapter_device_bytes=GIB).bytes > GIB  # 1.5 GiB
    with pytest.raises(ValueError, match=r"adapter_device_bytes .* cannot exceed it"):
        _resolve(adapter_device_bytes=2 * GIB)


def test_config_leaves_the_budget_to_the_machine_by_default():
    config = EngineConfig(model="unused")
    assert config.kv_cache_bytes is None
    EngineConfig(model="unused", adapter_device_bytes=64 << 30)  # checked at start instead
    with pytest.raises(ValueError, match="kv_cache_bytes must be positive or None"):
        EngineConfig(model="unused", kv_cache_bytes=0)


def test_an_engine_refuses_adapter_bytes_beyond_the_machine_sized_budget(tiny_model_dir):
    with pytest.raises(ValueError, match=r"adapter_device_bytes .* cannot exceed it"):
        Engine(
            EngineConfig(model=str(tiny_model_dir), dtype="float32", adapter_device_bytes=8 << 30)
        )


# --- what it holds, logged at start ----------------------------------------------------------


# The engine's other start lines, checked where their subject is tested: the weights'
# (test_quantized_engine.py), the threads' (test_compute_threads.py), the grammar cache's.
OTHER_START_LINES = ("base weights:", "Compute threads:", "compiled grammars:")


def _log_lines(caplog) -> list[str]:
    """The engine's start lines about its budget."""
    lines = [r.getMessage() for r in caplog.records if r.name == "loramux.engine.engine"]
    return [line for line in lines if not line.startswith(OTHER_START_LINES)]


def test_start_logs_an_explicit_budget_and_what_it_holds(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="loramux.engine.engine"):
        engine = build_engine(tiny_model_dir)  # 16 MiB, 16 sequences
    plan = engine.memory_plan
    assert (plan.budget_bytes, plan.source, plan.device) == (16 << 20, "set", "cpu")
    assert plan.kv_blocks == engine.kv.num_blocks and plan.kv_tokens == plan.kv_blocks * 16
    assert plan.kv_block_bytes == engine.arena.bytes_per_block
    assert plan.rank_adapter_bytes == 16 * engine.arena.bytes_per_row
    assert (plan.full_batch_requests, plan.full_batch_context) == (16, 512)
    assert plan.full_batch_blocks == 16 * 512 // 16
    budget, holds = _log_lines(caplog)
    assert (
        budget
        == "KV + adapter budget 16 MiB on cpu, set by kv_cache_bytes (LORAMUX_ENGINE_KV_CACHE_BYTES)"
    )
    assert holds.startswith(
        f"it holds {plan.kv_blocks:,} KV blocks of 16 tokens = {plan.kv_tokens:,} tokens "
        f"(8 KiB a block); a rank-16 adapter takes 128 KiB: "
        f"{plan.adapters_beside_full_batch:,} fit beside a full batch "
        "(16 requests x 512 tokens = 512 blocks)"
    )
    assert holds.endswith(f", {plan.adapters_max:,} at most (KV at its floor)")


def test_the_adapters_beside_a_full_batch_are_as_many_as_fit(tiny_model_dir):
    engine = build_engine(tiny_model_dir)
    plan = engine.memory_plan
    batch = plan.full_batch_blocks * plan.kv_block_bytes
    n = plan.adapters_beside_full_batch
    assert 0 < n < plan.adapters_max
    assert batch + n * plan.rank_adapter_bytes <= plan.budget_bytes
    # One more would not fit (up to the rounding of rows to whole KV blocks).
    slack = plan.kv_block_bytes + plan.adapter_row_bytes
    assert batch + (n + 1) * plan.rank_adapter_bytes > plan.budget_bytes - slack


def test_start_logs_a_machine_sized_budget_and_a_batch_that_does_not_fit(
    tiny_model_dir, caplog, monkeypatch
):
    monkeypatch.setattr(mb, "read_mem_available", lambda: 4 * GIB)
    with caplog.at_level(logging.INFO, logger="loramux.engine.engine"):
        engine = build_engine(tiny_model_dir, kv_cache_bytes=None)
    plan = engine.memory_plan
    assert plan.budget_bytes == 614 * MIB and plan.source == "machine"
    assert engine.kv.num_blocks == plan.kv_blocks == 614 * MIB // plan.kv_block_bytes
    budget, holds = _log_lines(caplog)
    assert budget == (
        "KV + adapter budget 614 MiB on cpu, sized to the machine: 15% of 4 GiB available RAM "
        "(kv_cache_bytes / LORAMUX_ENGINE_KV_CACHE_BYTES overrides it)"
    )
    assert f"{plan.adapters_beside_full_batch:,} fit beside a full batch (16 requests" in holds


def test_a_full_batch_that_does_not_fit_leaves_no_adapter_beside_it(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="loramux.engine.engine"):
        engine = build_engine(tiny_model_dir, kv_cache_bytes=4 << 20, max_num_seqs=64)
    plan = engine.memory_plan
    assert plan.kv_blocks == 512 < plan.full_batch_blocks == 64 * 32
    assert not plan.full_batch_fits and plan.adapters_beside_full_batch == 0
    holds = _log_lines(caplog)[1]
    assert (
        "none beside a full batch (64 requests x 512 tokens = 2,048 blocks), which does not fit "
        "(the KV cache holds 16 such requests with no adapter)" in holds
    )


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"adapter_device_bytes": 2 << 20},
        {"kv_cache_bytes": 1 << 20},  # small: the context is capped to leave an adapter room
        {"cuda_graph_max_batch": 4, "dtype": "float32"},
    ],
    ids=["default", "adapter-cap", "small", "static-decode"],
)
def test_the_engine_is_built_from_its_memory_plan(tiny_model_dir, settings):
    """The plan the engine reports is the one it was built from: arena, KV manager, pool,
    context limit."""
    engine = build_engine(tiny_model_dir, **settings)
    plan = engine.memory_plan
    assert engine.kv.num_blocks == engine.arena.layout.num_blocks == plan.kv_blocks
    assert engine.arena.scratch_blocks == plan.scratch_blocks
    assert engine.arena.bytes_per_block == plan.kv_block_bytes
    assert engine.arena.bytes_per_row == plan.adapter_row_bytes
    assert engine.kv.min_limit == plan.kv_floor_blocks
    assert plan.kv_floor_blocks * plan.block_size >= plan.max_model_len == engine.max_model_len
    assert engine.lora_pool.capacity == plan.adapter_capacity_rows
    assert engine.lora_pool.max_rows == plan.adapter_max_rows
    assert plan.adapter_capacity_rows >= plan.adapter_reserve_rows > 0
