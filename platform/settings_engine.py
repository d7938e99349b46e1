"""The engine's settings, nested as the engine's config is (``EngineConfig``'s parts:
``engine/config_parts.py``): ``Settings.engine.<part>.<field>``, each field named as the
``EngineConfig`` field it sets.

A field here is the whole decision to expose an engine field: its environment variable
(``LORAMUX_ENGINE_<FIELD>``: field names are unique across the parts, so the part is not
in the name; ``settings_names``), its place in ``Settings`` and its copy into the engine's
config (``engine_settings.engine_config``) all follow from it. Flat keywords
(``Settings(kv_cache_bytes=...)``) and the names from before the families
(``LORAMUX_KV_CACHE_BYTES``, with a warning) still set it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def positive(default: Any, description: str) -> Any:
    """A setting that must be above zero (``None``, where it is the default, means unset)."""
    return Field(default=default, gt=0, description=description)


def non_negative(default: Any, description: str) -> Any:
    """A setting that may be zero (which turns its feature off) but not below."""
    return Field(default=default, ge=0, description=description)


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheSettings(_Part):
    """The device memory KV blocks and adapters share, and the grammar cache in RAM (``EngineConfig.cache``)."""

    kv_cache_bytes: int | None = positive(
        None,
        "Device bytes shared by the paged KV cache and resident adapters (unset: "
        "sized to the machine when the engine starts: on CPU 15% of the available RAM, at "
        "least 512 MiB and at most 4 GiB; on CUDA 90% of the memory free after the weights, "
        "less room for activations). The engine logs the budget and what it holds at start.",
    )
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = Field(
        default="auto",
        description="How the paged KV cache holds keys and values: auto (the engine's dtype); "
        "int8 (the CPU's) or fp8 (e4m3, a GPU's): 8 bits with a float32 scale per token and "
        "KV head, so kv_cache_bytes holds 3.8x the tokens of float32 (1.9x of bfloat16) for a "
        "64-wide head, at a small cost in quality (benchmarks/results/quant_quality.md).",
    )
    adapter_device_bytes: int | None = positive(
        None,
        "Cap on the share of kv_cache_bytes resident adapters may take "
        "(unset: all but the KV cache's floor).",
    )
    enable_prefix_caching: bool = Field(
        default=True,
        description="Reuse the KV blocks of a prompt prefix already computed with the same "
        "adapter (keyed by adapter, so a tenant never reuses another adapter's blocks).",
    )
    max_model_len: int | None = positive(
        None,
        "Context cap, prompt plus output (unset: the model's).",
    )
    grammar_cache_bytes: int = positive(
        256 << 20,
        "Host RAM of compiled structured-output grammars kept for reuse (least "
        "recently used go; a 12,000-value enum schema keeps about 4.8 MiB).",
    )
    grammar_cache_tenant_bytes: int | None = positive(
        None,
        "The most one tenant's compiled grammars keep of "
        "LORAMUX_ENGINE_GRAMMAR_CACHE_BYTES (unset: a quarter), so one tenant's new schemas "
        "evict its own first.",
    )


class SchedulerSettings(_Part):
    """What one step may hold and how prefill is paced (``EngineConfig.scheduler``)."""

    max_num_seqs: int = Field(default=64, gt=0, description="Most requests running at once.")
    max_num_batched_tokens: int = Field(
        default=2048, gt=0, description="Token budget of one engine step (decode + prefill)."
    )
    max_prefill_chunk: int | None = positive(
        None,
        "Most prompt tokens one request prefills in one step (unset: as many as "
        "the step's token budget leaves), so long prompts share steps with decodes.",
    )
    prefill_step_target_s: float | None = positive(
        None,
        "Seconds a step that prefills should last: the prompt tokens per step are "
        "sized from the measured cost of recent steps, so one tenant's long prompts hold "
        "another's first token for a step or two (unset: 0.12 on the CPU; on a GPU no time "
        "target, LORAMUX_ENGINE_MAX_NUM_BATCHED_TOKENS alone).",
    )
    max_adapters_per_step: int | None = positive(
        None,
        "Most distinct adapters in one engine step (unset: no cap).",
    )
    adapter_wait_steps: int = positive(
        16,
        "Steps a request whose adapter is capped out of the step waits before "
        "the others drain to make room for it.",
    )


class LoRASettings(_Part):
    """Adapters between the store and the device: host RAM, loader threads, the disk tier (``EngineConfig.lora``)."""

    adapter_host_bytes: int = positive(
        1 << 30,
        "Host RAM for parsed adapters (LRU) between store and device.",
    )
    adapter_load_workers: int = positive(
        2,
        "Threads fetching and parsing adapters (a fetch that hangs holds up only its own).",
    )
    adapter_disk_cache_bytes: int = non_negative(
        0,
        "Local-disk cache of adapter files between the store and RAM, under "
        "<data dir>/adapter-cache (0: none).",
    )


class SpeculativeSettings(_Part):
    """Speculative decoding (``EngineConfig.speculative``)."""

    speculative_method: Literal["off", "ngram", "draft"] = Field(
        default="off",
        description="Speculative decoding: off; ngram (prompt lookup: proposes the tokens that "
        "followed the output's last few tokens earlier in the request, no extra model); draft "
        "(a smaller model sharing the tokenizer, LORAMUX_ENGINE_DRAFT_MODEL). Output is unchanged.",
    )
    num_speculative_tokens: int = positive(
        4,
        "Most proposed tokens a request verifies per step (fewer as its acceptance rate falls).",
    )
    ngram_max_n: int = Field(
        default=4, gt=0, description="Longest suffix the n-gram proposer looks up."
    )
    ngram_min_n: int = Field(
        default=2, gt=0, description="Shortest suffix the n-gram proposer tries."
    )
    draft_model: Path | None = Field(
        default=None,
        description="HF-format folder of the draft model (speculative_method draft).",
    )
    draft_kv_cache_bytes: int | None = positive(
        None,
        "Bytes of the draft model's own KV cache, taken out of "
        "LORAMUX_ENGINE_KV_CACHE_BYTES (unset: an eighth of it).",
    )


class ParallelSettings(_Part):
    """One engine over several devices (``EngineConfig.parallel``)."""

    tensor_parallel_size: int = positive(
        1,
        "One engine over this many GPUs (tensor parallelism: GPUs 0..N-1 of its "
        "machine, or N processes sharing the CPU's cores), for a base model larger than one "
        "device. Float weights only (no quantization, no GGUF file).",
    )


class LoadSettings(_Part):
    """Where the engine runs and in what dtype (``EngineConfig.load``)."""

    device: str = Field(default="auto", description="`auto`, `cpu`, `cuda` or `cuda:N`.")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None,
        description="The engine's weights and activations (unset: float32 on CPU, bfloat16 on CUDA).",
    )


class ComputeSettings(_Part):
    """Which kernels run and how (``EngineConfig.compute``)."""

    kernels: Literal["auto", "torch", "triton"] | None = Field(
        default=None,
        description="Which kernels run the engine's ops: auto (Triton on CUDA, torch "
        "elsewhere), torch (torch ops only, on CUDA too, to bisect a suspected kernel bug) or "
        "triton (the Triton kernels; on the CPU only inside Triton's interpreter). Unset: "
        "LORAMUX_KERNELS, else auto.",
    )
    cuda_graph_max_batch: int = non_negative(
        64,
        "Decode-only steps of up to this many requests replay CUDA graphs "
        "captured at start (CUDA only; 0: every step eager).",
    )
    compute_threads: int | None = positive(
        None,
        "The engine's CPU threads (unset: the cores this process may use, from "
        "its CPU affinity and cgroup quota, less an eighth of them for the platform when the "
        "engine shares its process). The start-up log says the choice.",
    )


class EngineSettings(BaseModel):
    """Every engine setting, by the part of ``EngineConfig`` it belongs to."""

    model_config = ConfigDict(extra="forbid")

    cache: CacheSettings = Field(default_factory=CacheSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    lora: LoRASettings = Field(default_factory=LoRASettings)
    speculative: SpeculativeSettings = Field(default_factory=SpeculativeSettings)
    parallel: ParallelSettings = Field(default_factory=ParallelSettings)
    load: LoadSettings = Field(default_factory=LoadSettings)
    compute: ComputeSettings = Field(default_factory=ComputeSettings)


# Each part's model, by the part's name in EngineSettings (and in EngineConfig).
PART_MODELS: dict[str, type[_Part]] = {
    "cache": CacheSettings,
    "scheduler": SchedulerSettings,
    "lora": LoRASettings,
    "speculative": SpeculativeSettings,
    "parallel": ParallelSettings,
    "load": LoadSettings,
    "compute": ComputeSettings,
}
# Engine setting -> the part it is in.
PART_OF: dict[str, str] = {
    field: part for part, model in PART_MODELS.items() for field in model.model_fields
}


def nest(flat: dict) -> dict:
    """``{field: value}`` of engine settings as ``EngineSettings``' nested dict."""
    nested: dict[str, dict] = {}
    for field, value in flat.items():
        nested.setdefault(PART_OF[field], {})[field] = value
    return nested
