"""Engine configuration: one dataclass of flat fields, grouped by concern into typed parts
(``config_parts.py``), each checked on its own."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loramux.engine.config_parts import (
    DTYPES,
    LOAD_FORMATS,
    PARTS,
    QUANTIZATIONS,
    SPECULATIVE_METHODS,
    CacheConfig,
    KernelConfig,
    LoadConfig,
    LoRAConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from loramux.kernels.quant_linear import INT4_GROUP_SIZES

# A CPU step that prefills lasts about this long by default: another tenant's request that
# arrives during one waits for its end and then one more such step, so its first token
# comes within about 1.5 of these on average (benchmarks/results/bench_prefill-flood.md).
DEFAULT_CPU_STEP_TARGET_S = 0.12


__all__ = [
    "INT4_GROUP_SIZES",
    "LOAD_FORMATS",
    "QUANTIZATIONS",
    "SPECULATIVE_METHODS",
    "EngineConfig",
]


@dataclass
class EngineConfig:
    model: str  # HF-format Llama-family directory
    # Device bytes shared by the paged KV cache and the resident adapters (S-LoRA unified
    # paging): KV blocks fill it from the bottom, adapter rank-rows from the top. None: sized
    # to the machine when the engine starts, after the weights (memory/budget.py: on CPU
    # 15% of the available RAM within [512 MiB, 4 GiB], on CUDA 90% of the free memory less
    # room for activations). Tests and anything starting several engines set a small one.
    kv_cache_bytes: int | None = None
    # Cap on the share of kv_cache_bytes adapters may hold (None: all but KV's floor, the
    # blocks one request of max_model_len needs).
    adapter_device_bytes: int | None = None
    # Host-RAM tier: bytes of parsed adapters kept in memory (LRU) between the store and
    # the device, so a re-used adapter is not fetched again.
    adapter_host_bytes: int = 1 << 30
    # Threads fetching and parsing adapters: a fetch that hangs holds up only its own.
    adapter_load_workers: int = 2
    # Optional local-disk tier between the store and RAM (sources with a content id only).
    adapter_disk_cache_dir: str | None = None
    adapter_disk_cache_bytes: int = 8 << 30
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # token budget of one step: decodes + prefill chunks
    max_prefill_chunk: int | None = None  # cap on one request's prefill tokens per step
    # Prompt tokens per step are sized so that a step that prefills lasts about this long
    # (prefill_budget.py), within max_num_batched_tokens: a long prompt then holds another
    # tenant's first token for a step or two, not for its whole prefill. None: the device's
    # default (DEFAULT_CPU_STEP_TARGET_S on the CPU; on CUDA no time target, the token
    # budget alone). Infinity: no time target on any device (steps sized by tokens alone,
    # whatever the machine's load: reproducible chunking, for measurements).
    prefill_step_target_s: float | None = None
    # Threads of torch's CPU ops (intra-op). None: OMP_NUM_THREADS if set, else every core
    # this process may run on (its CPU affinity and cgroup quota; compute_threads.py). The
    # platform passes fewer when it shares the process.
    compute_threads: int | None = None
    max_model_len: int | None = None  # context cap (default: the model's)
    max_adapters_per_step: int | None = None  # distinct adapters in one step (None: no cap)
    adapter_wait_steps: int = 16  # steps a capped-out adapter waits before others drain for it
    max_lora_rank: int = 64
    enable_prefix_caching: bool = True
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N"
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on CUDA
    seed: int = 0  # for requests without their own seed
    # Host RAM of compiled structured-output grammars kept for reuse (LRU, as measured in
    # structured/grammar_bytes.py: a 12,000-value enum keeps about 4.8 MiB), and the most one
    # tenant's may take (None: a quarter), so one tenant's new schemas evict its own first.
    grammar_cache_bytes: int = 256 << 20
    grammar_cache_tenant_bytes: int | None = None
    # "safetensors": the checkpoint in ``model``; "random": weights drawn at random on the
    # device from ``model``'s config.json (benchmarks at real shapes without the files).
    load_format: str = "safetensors"
    # Weight-only quantization of a float checkpoint as it loads (model/quantized.py):
    # "none", "int8" (per output channel) or "int4" (groups of quantization_group_size
    # inputs). The embedding and an untied LM head become int8 either way.
    quantization: str = "none"
    quantization_group_size: int = 32
    # The base weights are this GGUF file's tensors, served in their own packed forms
    # (Q8_0, Q4_0, Q4_1, Q4_K, and float ones); ``model`` then holds only the config and
    # tokenizer (as platform.base_model extracts them).
    gguf_file: str | None = None
    # The paged KV cache's form (kernels/kv_quant.py): "auto" keeps the model's dtype;
    # "int8" (the CPU's) and "fp8" (e4m3, CUDA's) store 8-bit keys and values with a float32
    # scale per token and KV head, so a budget holds 3.8x (float32) or 1.9x (bfloat16) the
    # tokens. Adapters stay in the model's dtype.
    kv_cache_dtype: str = "auto"
    # Decode-only steps of up to this many sequences replay CUDA graphs captured for a set
    # of batch-size buckets (CUDA and the Triton path only); 0 runs every step eagerly.
    cuda_graph_max_batch: int = 64
    # Which kernels run the engine's ops (kernels/dispatch.py, engine/lora/backend.py):
    # "auto" (Triton on CUDA, torch elsewhere), "torch" (torch ops only, on CUDA too) or
    # "triton" (the Triton kernels anywhere; on the CPU inside Triton's interpreter). None:
    # LORAMUX_KERNELS, the developer's override, else auto.
    kernels: str | None = None
    # Speculative decoding (engine/speculative/): "off"; "ngram" proposes the tokens that
    # followed the last n tokens' latest earlier occurrence in the request's own text
    # (prompt lookup, no model); "draft" runs ``draft_model``, a smaller model sharing the
    # tokenizer. A step verifies up to ``num_speculative_tokens`` proposals per request
    # (fewer as its acceptance rate falls); the output is what decoding without them gives.
    speculative_method: str = "off"
    num_speculative_tokens: int = 4
    ngram_max_n: int = 4  # longest suffix looked up first
    ngram_min_n: int = 2  # shortest suffix tried before giving up
    draft_model: str | None = None  # HF-format directory, for speculative_method "draft"
    # Bytes of the draft model's own paged KV cache, taken out of the KV + adapter budget
    # (None: an eighth of it).
    draft_kv_cache_bytes: int | None = None
    # Tensor parallelism (engine/parallel/): one engine over this many processes, one per
    # device (GPUs 0..N-1 on CUDA; on the CPU they share the cores), joined by
    # torch.distributed (NCCL between GPUs, gloo on the CPU). Rank 0 is this process.
    tensor_parallel_size: int = 1
    # Seconds a rank waits for the others (joining, or in a collective) before the engine
    # fails: the bound for a rank alive but stuck. A rank that died is seen at once.
    tensor_parallel_timeout_s: float = 60.0
    # Seconds a rank may go without a heartbeat (its process stopped, frozen) before rank 0
    # kills it and fails the engine naming it; a rank busy in a long step still beats.
    # Shorter than tensor_parallel_timeout_s, or the collective's timeout comes first.
    tensor_parallel_heartbeat_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        # Each concern is a typed part checked on its own (config_parts.py); then what spans
        # two of them.
        for part in PARTS.values():
            part.of(self)
        if self.tensor_parallel_size > 1 and (
            self.quantization != "none" or self.gguf_file is not None
        ):
            raise ValueError(
                "EngineConfig.tensor_parallel_size > 1 serves float weights only for now: set "
                "quantization 'none' and no gguf_file, or tensor_parallel_size 1"
            )

    # --- the parts, by concern (config_parts.py) -----------------------------------
    @property
    def cache(self) -> CacheConfig:
        return CacheConfig.of(self)

    @property
    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig.of(self)

    @property
    def lora(self) -> LoRAConfig:
        return LoRAConfig.of(self)

    @property
    def speculative(self) -> SpeculativeConfig:
        return SpeculativeConfig.of(self)

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig.of(self)

    @property
    def load(self) -> LoadConfig:
        return LoadConfig.of(self)

    @property
    def compute(self) -> KernelConfig:
        return KernelConfig.of(self)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def step_target_s(self) -> float | None:
        """The prefill step target in force (``prefill_step_target_s`` or the device's)."""
        if self.prefill_step_target_s is not None:
            return None if math.isinf(self.prefill_step_target_s) else self.prefill_step_target_s
        return DEFAULT_CPU_STEP_TARGET_S if self.torch_device.type == "cpu" else None

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return DTYPES[self.dtype]
        return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
