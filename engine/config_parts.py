"""``EngineConfig`` by concern: each part a typed value checked on its own.

``EngineConfig`` keeps its flat fields (``EngineConfig(model=..., kv_cache_bytes=...)``, the
settings table, the ranks' command line); it checks each part as it is made and gives
them as ``config.cache``, ``config.scheduler``, ``config.lora``, ``config.speculative``,
``config.parallel``, ``config.load`` and ``config.compute``. Every field belongs to
exactly one part (a test holds it so). A message names the field as the user sets it:
``EngineConfig.<field>``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from loramux.kernels.dispatch import KERNEL_CHOICES
from loramux.kernels.kv_quant import KV_CACHE_DTYPES
from loramux.kernels.quant_linear import INT4_GROUP_SIZES

LOAD_FORMATS = ("safetensors", "random")
SPECULATIVE_METHODS = ("off", "ngram", "draft")
QUANTIZATIONS = ("none", "int8", "int4")  # what each packs: model/quantized.py
DTYPES = {  # EngineConfig.dtype -> the torch dtype
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class _Part:
    """What every part does: built from the flat config, checked as it is built."""

    @classmethod
    def of(cls, config) -> _Part:
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})

    def _positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive, got {value}")

    def _positive_or_none(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive or None, got {value}")

    def _one_of(self, name: str, allowed) -> None:
        value = getattr(self, name)
        if value not in allowed:
            raise ValueError(
                f"EngineConfig.{name} must be one of {', '.join(allowed)}, got {value!r}"
            )


@dataclass(frozen=True)
class CacheConfig(_Part):
    """The device memory KV blocks and adapters share, and the grammar cache in RAM."""

    kv_cache_bytes: int | None
    adapter_device_bytes: int | None
    block_size: int
    kv_cache_dtype: str
    enable_prefix_caching: bool
    max_model_len: int | None
    grammar_cache_bytes: int
    grammar_cache_tenant_bytes: int | None

    def __post_init__(self) -> None:
        self._positive("block_size", "grammar_cache_bytes")
        self._positive_or_none(
            "kv_cache_bytes", "adapter_device_bytes", "max_model_len", "grammar_cache_tenant_bytes"
        )
        if (  # against a budget sized to the machine: checked when the engine starts
            self.adapter_device_bytes is not None
            and self.kv_cache_bytes is not None
            and self.adapter_device_bytes > self.kv_cache_bytes
        ):
            raise ValueError(
                f"EngineConfig.adapter_device_bytes ({self.adapter_device_bytes}) is a share of "
                f"kv_cache_bytes ({self.kv_cache_bytes}) and cannot exceed it"
            )
        self._one_of("kv_cache_dtype", KV_CACHE_DTYPES)
        if (
            self.grammar_cache_tenant_bytes is not None
            and self.grammar_cache_tenant_bytes > self.grammar_cache_bytes
        ):
            raise ValueError(
                f"EngineConfig.grammar_cache_tenant_bytes ({self.grammar_cache_tenant_bytes}) "
                f"is one tenant's share of grammar_cache_bytes ({self.grammar_cache_bytes}) and "
                "cannot exceed it"
            )


@dataclass(frozen=True)
class SchedulerConfig(_Part):
    """What one step may hold and how prompt tokens are shared."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_chunk: int | None
    prefill_step_target_s: float | None
    max_adapters_per_step: int | None
    adapter_wait_steps: int

    def __post_init__(self) -> None:
        self._positive("max_num_seqs", "max_num_batched_tokens", "adapter_wait_steps")
        self._positive_or_none(
            "max_prefill_chunk", "prefill_step_target_s", "max_adapters_per_step"
        )


@dataclass(frozen=True)
class LoRAConfig(_Part):
    """Adapters: the largest rank, and the host and disk tiers and their loaders."""

    max_lora_rank: int
    adapter_host_bytes: int
    adapter_load_workers: int
    adapter_disk_cache_dir: str | None
    adapter_disk_cache_bytes: int

    def __post_init__(self) -> None:
        self._positive(
            "max_lora_rank",
            "adapter_host_bytes",
            "adapter_load_workers",
            "adapter_disk_cache_bytes",
        )


@dataclass(frozen=True)
class SpeculativeConfig(_Part):
    """Speculative decoding: the method, how many proposals, the n-grams, the draft."""

    speculative_method: str
    num_speculative_tokens: int
    ngram_max_n: int
    ngram_min_n: int
    draft_model: str | None
    draft_kv_cache_bytes: int | None

    def __post_init__(self) -> None:
        self._positive("num_speculative_tokens", "ngram_max_n", "ngram_min_n")
        self._positive_or_none("draft_kv_cache_bytes")
        self._one_of("speculative_method", SPECULATIVE_METHODS)
        if self.ngram_min_n > self.ngram_max_n:
            raise ValueError(
                f"EngineConfig.ngram_min_n ({self.ngram_min_n}) must not exceed ngram_max_n "
                f"({self.ngram_max_n})"
            )
        if (self.speculative_method == "draft") != (self.draft_model is not None):
            raise ValueError(
                "EngineConfig.draft_model is the draft model's directory, set exactly when "
                f"speculative_method is 'draft' (method {self.speculative_method!r}, "
                f"draft_model {self.draft_model!r})"
            )


@dataclass(frozen=True)
class ParallelConfig(_Part):
    """Tensor parallelism: how many ranks, and how long one may be silent."""

    tensor_parallel_size: int
    tensor_parallel_timeout_s: float
    tensor_parallel_heartbeat_timeout_s: float

    def __post_init__(self) -> None:
        self._positive(
            "tensor_parallel_size",
            "tensor_parallel_timeout_s",
            "tensor_parallel_heartbeat_timeout_s",
        )
        if self.tensor_parallel_heartbeat_timeout_s >= self.tensor_parallel_timeout_s:
            raise ValueError(
                "EngineConfig.tensor_parallel_heartbeat_timeout_s "
                f"({self.tensor_parallel_heartbeat_timeout_s}) must be shorter than "
                f"tensor_parallel_timeout_s ({self.tensor_parallel_timeout_s}): a stopped rank "
                "is named by its heartbeat, before the collective's own timeout"
            )


@dataclass(frozen=True)
class LoadConfig(_Part):
    """The model and how its weights load: where, in which dtype and form."""

    model: str
    load_format: str
    quantization: str
    quantization_group_size: int
    gguf_file: str | None
    dtype: str | None
    device: str
    seed: int

    def __post_init__(self) -> None:
        self._one_of("load_format", LOAD_FORMATS)
        self._one_of("quantization", QUANTIZATIONS)
        if self.quantization_group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                "EngineConfig.quantization_group_size must be one of "
                f"{', '.join(map(str, INT4_GROUP_SIZES))}, got {self.quantization_group_size}"
            )
        if self.gguf_file is not None and (
            self.quantization != "none" or self.load_format != "safetensors"
        ):
            raise ValueError(
                "EngineConfig.gguf_file serves the GGUF's own packed weights: it takes "
                f"quantization 'none' and load_format 'safetensors' (got {self.quantization!r}, "
                f"{self.load_format!r}); quantization applies to float checkpoints"
            )
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(
                f"EngineConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}"
            )
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(
                f"EngineConfig.device must be auto, cpu or cuda[:N], got {self.device!r}"
            )


@dataclass(frozen=True)
class KernelConfig(_Part):
    """What runs the ops: the kernels, CUDA graphs, the CPU's threads."""

    kernels: str | None
    cuda_graph_max_batch: int
    compute_threads: int | None

    def __post_init__(self) -> None:
        self._positive_or_none("compute_threads")
        if self.kernels is not None:
            self._one_of("kernels", KERNEL_CHOICES)
        if self.cuda_graph_max_batch < 0:
            raise ValueError(
                "EngineConfig.cuda_graph_max_batch must be 0 (no CUDA graphs) or positive, "
                f"got {self.cuda_graph_max_batch}"
            )


# EngineConfig's property -> its part, in the order they are checked.
PARTS = {
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "lora": LoRAConfig,
    "speculative": SpeculativeConfig,
    "parallel": ParallelConfig,
    "load": LoadConfig,
    "compute": KernelConfig,
}
