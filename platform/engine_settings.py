"""Which platform setting sets each field of the engine's ``EngineConfig``: one table.

Every ``EngineConfig`` field is in exactly one of three tables (a test checks it, so a field
added to the engine without a decision here fails the suite):

* :data:`FROM_SETTINGS`: copied from the ``Settings`` field named (``LORAMUX_<NAME>``);
* :data:`SET_BY_THE_PLATFORM`: derived from other settings, as :func:`engine_config` says;
* :data:`ENGINE_DEFAULTS`: left at the engine's default, each with the reason.

The rank limit is one setting for uploads and engine alike (``LORAMUX_MAX_ADAPTER_RANK``):
with two, an upload could be validated and marked ready at a rank the engine refuses.
"""

from __future__ import annotations

from loramux.engine import EngineConfig, default_compute_threads
from loramux.platform.base_model import ResolvedBaseModel
from loramux.platform.settings import Settings

# EngineConfig field -> the Settings field it is copied from.
FROM_SETTINGS = {
    "device": "device",
    "dtype": "dtype",
    "kv_cache_bytes": "kv_cache_bytes",
    "kv_cache_dtype": "kv_cache_dtype",
    "adapter_device_bytes": "adapter_device_bytes",
    "adapter_host_bytes": "adapter_host_bytes",
    "adapter_load_workers": "adapter_load_workers",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "max_prefill_chunk": "max_prefill_chunk",
    "prefill_step_target_s": "prefill_step_target_s",
    "max_model_len": "max_model_len",
    "max_adapters_per_step": "max_adapters_per_step",
    "adapter_wait_steps": "adapter_wait_steps",
    "max_lora_rank": "max_adapter_rank",
    "enable_prefix_caching": "enable_prefix_caching",
    "grammar_cache_bytes": "grammar_cache_bytes",
    "grammar_cache_tenant_bytes": "grammar_cache_tenant_bytes",
    "cuda_graph_max_batch": "cuda_graph_max_batch",
    "kernels": "kernels",
    "speculative_method": "speculative_method",
    "num_speculative_tokens": "num_speculative_tokens",
    "ngram_max_n": "ngram_max_n",
    "ngram_min_n": "ngram_min_n",
    "draft_kv_cache_bytes": "draft_kv_cache_bytes",
    "tensor_parallel_size": "tensor_parallel_size",
}
# EngineConfig field -> what sets it.
SET_BY_THE_PLATFORM = {
    "model": "the resolved base model's folder (LORAMUX_MODEL; of a GGUF, its config and "
    "tokenizer, or with LORAMUX_QUANTIZATION=none its de-quantized copy)",
    "gguf_file": "LORAMUX_MODEL's .gguf (the embedded default's too) unless "
    "LORAMUX_QUANTIZATION=none: its own packed weights are served",
    "quantization": "LORAMUX_QUANTIZATION: int8 or int4 for a float checkpoint; auto and "
    "none are none (a GGUF's forms come with gguf_file)",
    "quantization_group_size": "LORAMUX_QUANTIZATION_GROUP_SIZE, which goes with "
    "LORAMUX_QUANTIZATION (a setting of the model, not of the engine's tuning)",
    "adapter_disk_cache_dir": "<data dir>/adapter-cache while LORAMUX_ENGINE_ADAPTER_DISK_CACHE_BYTES > 0",
    "adapter_disk_cache_bytes": "LORAMUX_ENGINE_ADAPTER_DISK_CACHE_BYTES (0: no disk tier at all)",
    "draft_model": "LORAMUX_ENGINE_DRAFT_MODEL's folder, as a string (unset: none)",
    "compute_threads": "LORAMUX_ENGINE_COMPUTE_THREADS; unset, for an engine in the "
    "platform's process the available cores less an eighth for the platform "
    "(compute_threads.platform_reserve), for a `loramux engine` process the engine's default",
}
# EngineConfig field -> why the platform keeps the engine's default.
ENGINE_DEFAULTS = {
    "block_size": "16 tokens a KV block suits every backend; the kernels are tuned for it",
    "seed": "requests carry their own seed; the engine's only seeds those without one",
    "load_format": "random weights are for benchmarks at real shapes, never for serving",
    "tensor_parallel_timeout_s": "60 s for a rank to join or answer a collective: far above "
    "a step; only a rank alive but stuck waits it out (a dead one is seen at once, a stopped "
    "one by its heartbeat)",
    "tensor_parallel_heartbeat_timeout_s": "10 s without a heartbeat names a stopped rank: "
    "a rank beats every second even inside a long step, so only a frozen process goes silent",
}


def engine_config(
    settings: Settings, base_model: ResolvedBaseModel, *, shares_process: bool = False
) -> EngineConfig:
    """The engine this platform's settings describe: in the platform's process
    (``shares_process``) or as ``loramux engine``."""
    values = {field: getattr(settings, name) for field, name in FROM_SETTINGS.items()}
    values["compute_threads"] = settings.compute_threads
    if settings.compute_threads is None and shares_process:
        values["compute_threads"] = default_compute_threads(shares_process=True)
    if settings.adapter_disk_cache_bytes:
        values["adapter_disk_cache_dir"] = str(settings.data_dir / "adapter-cache")
        values["adapter_disk_cache_bytes"] = settings.adapter_disk_cache_bytes
    if settings.draft_model is not None:
        values["draft_model"] = str(settings.draft_model)
    if base_model.gguf_file is not None:
        values["gguf_file"] = str(base_model.gguf_file)
    if settings.quantization in ("int8", "int4"):
        values["quantization"] = settings.quantization
        values["quantization_group_size"] = settings.quantization_group_size
    return EngineConfig(model=str(base_model.path), **values)
