"""The device budget the KV cache and resident adapters share, and what it holds.

``EngineConfig.kv_cache_bytes`` is one budget for KV blocks and adapter rank-rows (S-LoRA
unified paging, see ``arena.py``). Set, it is used as it is. Left ``None`` it
is sized to the machine once the weights are loaded:

* **CPU**: ``CPU_SHARE`` (15%) of ``MemAvailable`` (``/proc/meminfo``), at least
  ``CPU_MIN_BYTES`` (512 MiB) and at most ``CPU_MAX_BYTES`` (4 GiB), never above half of
  what is available. Why: the same RAM also holds the weights (already counted out of
  ``MemAvailable`` when this runs), the host adapter tier (``adapter_host_bytes``, 1 GiB by
  default), the platform and whatever else runs on the box, so the engine takes a modest
  share; 4 GiB is vLLM's CPU default (``VLLM_CPU_KVCACHE_SPACE`` unset), about 90,000
  tokens of SmolLM2's fp32 KV, more than a CPU computes on at once; 512 MiB still holds a
  full batch of short requests beside a few adapters. On CPU the arena's pages are
  committed only as they are first written (``DeviceArena``), so an unused budget costs
  address space, not RAM.
* **CUDA**: ``CUDA_SHARE`` (90%, vLLM's ``gpu_memory_utilization``) of the device memory
  free after the weights (``torch.cuda.mem_get_info`` plus what PyTorch's caching
  allocator holds unused), less headroom for a step's activations: a fixed
  ``CUDA_FIXED_HEADROOM_BYTES`` (1 GiB: CUDA graphs' pools, cuBLAS and Triton workspaces)
  plus an estimate of one step's tensors at ``max_num_batched_tokens`` and
  ``max_num_seqs`` (:func:`activation_bytes`). An estimate, not a profile of a dummy
  step as vLLM does: conservative, and the budget can always be set.

The functions here are pure (the machine's figures are their arguments) apart from
:func:`read_mem_available` and :func:`cuda_free_bytes`, which read them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.engine.config import EngineConfig
from loramux.engine.model.config import ModelConfig
from loramux.kernels.kv_quant import bytes_per_slot_head, storage_dtype

MIB = 1 << 20
GIB = 1 << 30

CPU_SHARE = 0.15
CPU_MIN_BYTES = 512 * MIB
CPU_MAX_BYTES = 4 * GIB
CUDA_SHARE = 0.90
CUDA_FIXED_HEADROOM_BYTES = 1 * GIB
ACTIVATION_SAFETY = 2  # the activation estimate counts each live tensor once; allow twice


@dataclass(frozen=True)
class Budget:
    """Bytes for KV and adapters, and where the figure came from."""

    bytes: int
    source: str  # "set" (kv_cache_bytes given) or "machine" (sized to it)
    detail: str  # in words, for the log and the engine panel


def format_bytes(value: int | float) -> str:
    """1.5 GiB, 256 MiB, 12 KiB, 100 B."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1 << 10)):
        if abs(value) >= size:
            text = f"{value / size:.1f}".removesuffix(".0")
            return f"{text} {unit}"
    return f"{int(value)} B"


# --- the machine's figures -------------------------------------------------------------------
def read_mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemAvailable`` in bytes (Linux), else the free physical pages; None if unknown."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                value, unit = line.split()[1:3]
                return int(value) * (1024 if unit.lower() == "kb" else 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def cuda_free_bytes(device: torch.device) -> int:
    """Device memory free now, counting what PyTorch's caching allocator holds unused."""
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached


def kv_block_bytes(
    model: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes one KV block takes across all layers (keys and values; with a quantized
    cache, its 8-bit data and per-slot scales: ``DeviceArena.bytes_per_block``)."""
    storage = storage_dtype(kv_cache_dtype)
    if storage is None:
        per_head = model.head_dim * dtype.itemsize
    else:
        per_head = bytes_per_slot_head(model.head_dim, storage)
    return 2 * model.num_layers * model.num_kv_heads * per_head * block_size


# --- the rules -------------------------------------------------------------------------------
def cpu_budget(mem_available: int | None) -> Budget:
    """``CPU_SHARE`` of the available RAM, clamped (see the module doc)."""
    if mem_available is None:
        return Budget(
            CPU_MIN_BYTES,
            "machine",
            f"sized to the machine: available RAM unknown, the {format_bytes(CPU_MIN_BYTES)} floor",
        )
    share = int(mem_available * CPU_SHARE)
    value = min(max(share, CPU_MIN_BYTES), CPU_MAX_BYTES)
    why = f"{CPU_SHARE:.0%} of {format_bytes(mem_available)} available RAM"
    if value > share:
        why += f", raised to the {format_bytes(CPU_MIN_BYTES)} floor"
    elif value < share:
        why += f", capped at {format_bytes(CPU_MAX_BYTES)}"
    if value > mem_available // 2:
        value = mem_available // 2
        why += ", held to half of what is available"
    return Budget(value // MIB * MIB or value, "machine", f"sized to the machine: {why}")


def activation_bytes(
    model: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, dtype_bytes: int
) -> int:
    """A step's activations, estimated: per token, one layer's live tensors (residual and
    norm, q/k/v, attention out, gate/up/act) and its LoRA intermediates; per sequence, the
    fp32 logits and probabilities of its next token. Times ``ACTIVATION_SAFETY``."""
    per_token = (
        4 * model.hidden_size
        + model.q_size
        + 2 * model.kv_size
        + 3 * model.intermediate_size
        + 7 * 64  # LoRA shrink outputs, up to rank 64 for the seven targets
    ) * dtype_bytes
    logits = max_num_seqs * model.vocab_size * 4 * 2
    return ACTIVATION_SAFETY * (max_num_batched_tokens * per_token + logits)


def cuda_budget(free_bytes: int, activations: int) -> Budget:
    """``CUDA_SHARE`` of the free memory, less the fixed headroom and ``activations``."""
    headroom = CUDA_FIXED_HEADROOM_BYTES + activations
    value = int(free_bytes * CUDA_SHARE) - headroom
    if value <= 0:
        raise ValueError(
            f"only {format_bytes(free_bytes)} of device memory is free after the weights, "
            f"less than the {format_bytes(headroom)} kept for activations: no room for the KV "
            "cache; set kv_cache_bytes (LORAMUX_ENGINE_KV_CACHE_BYTES), or lower "
            "max_num_batched_tokens / max_num_seqs"
        )
    return Budget(
        value // MIB * MIB or value,
        "machine",
        f"sized to the machine: {CUDA_SHARE:.0%} of {format_bytes(free_bytes)} free after "
        f"the weights, less {format_bytes(headroom)} for activations",
    )


def resolve_budget(
    *,
    kv_cache_bytes: int | None,
    adapter_device_bytes: int | None,
    device: torch.device,
    model: ModelConfig,
    dtype: torch.dtype,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    mem_available: int | None = None,
    cuda_free: int | None = None,
) -> Budget:
    """The budget for this engine: ``kv_cache_bytes`` when set, else sized to the machine
    (``mem_available`` / ``cuda_free`` are read when not given). ``ValueError`` when
    ``adapter_device_bytes`` (a share of it) exceeds it."""
    if kv_cache_bytes is not None:
        budget = Budget(kv_cache_bytes, "set", "set by kv_cache_bytes")
    elif device.type == "cuda":
        free = cuda_free_bytes(device) if cuda_free is None else cuda_free
        budget = cuda_budget(
            free,
            activation_bytes(model, max_num_batched_tokens, max_num_seqs, dtype.itemsize),
        )
    else:
        budget = cpu_budget(read_mem_available() if mem_available is None else mem_available)
    if adapter_device_bytes is not None and adapter_device_bytes > budget.bytes:
        raise ValueError(
            f"EngineConfig.adapter_device_bytes ({adapter_device_bytes}) is a share of the KV "
            f"and adapter budget, {budget.bytes} bytes ({budget.detail}), and cannot exceed "
            "it: lower adapter_device_bytes or set kv_cache_bytes"
        )
    return budget


def budget_for(config: EngineConfig, model: ModelConfig) -> Budget:
    """:func:`resolve_budget` for an engine of ``config`` on ``model``, reading the machine."""
    return resolve_budget(
        kv_cache_bytes=config.kv_cache_bytes,
        adapter_device_bytes=config.adapter_device_bytes,
        device=config.torch_device,
        model=model,
        dtype=config.torch_dtype,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
    )
