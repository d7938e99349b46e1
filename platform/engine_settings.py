"""Which platform setting sets each field of the engine's ``EngineConfig``.

Every ``EngineConfig`` field is decided exactly once (a test checks it, so a field added
to the engine without a decision fails the suite):

* a field of the engine's settings (``settings_engine``: ``Settings.engine.<part>.<field>``,
  ``LORAMUX_ENGINE_<FIELD>``) is copied as it is (:data:`FROM_SETTINGS`, derived from them):
  exposing an engine field is its one line there;
* :data:`SET_BY_THE_PLATFORM`: derived from other settings, as :func:`engine_config` says;
* :data:`ENGINE_DEFAULTS`: left at the engine's default, each with the reason.

The rank limit is one setting for uploads and engine alike (``LORAMUX_MAX_ADAPTER_RANK``):
with two, an upload could be validated and marked ready at a rank the engine refuses.
"""

from __future__ import annotations

from loramux.engine import EngineConfig, default_compute_threads
from loramux.platform.base_model import ResolvedBaseModel
from loramux.platform.settings import Settings
from loramux.platform.settings_engine import PART_OF

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
# EngineConfig field -> the setting it is copied from: the engine's settings under their
# own names (but those the platform derives, above), and the rank limit uploads share.
FROM_SETTINGS = {
    **{field: field for field in PART_OF if field not in SET_BY_THE_PLATFORM},
    "max_lora_rank": "max_adapter_rank",
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


def engine_setting(settings: Settings, field: str):
    """The engine setting ``field`` (an ``EngineConfig`` field's name) of ``settings``."""
    return getattr(getattr(settings.engine, PART_OF[field]), field)


def engine_config(
    settings: Settings, base_model: ResolvedBaseModel, *, shares_process: bool = False
) -> EngineConfig:
    """The engine this platform's settings describe: in the platform's process
    (``shares_process``) or as ``loramux engine``."""
    engine = settings.engine
    values = {field: engine_setting(settings, field) for field in FROM_SETTINGS if field in PART_OF}
    values["max_lora_rank"] = settings.max_adapter_rank
    values["compute_threads"] = engine.compute.compute_threads
    if engine.compute.compute_threads is None and shares_process:
        values["compute_threads"] = default_compute_threads(shares_process=True)
    if engine.lora.adapter_disk_cache_bytes:
        values["adapter_disk_cache_dir"] = str(settings.data_dir / "adapter-cache")
        values["adapter_disk_cache_bytes"] = engine.lora.adapter_disk_cache_bytes
    if engine.speculative.draft_model is not None:
        values["draft_model"] = str(engine.speculative.draft_model)
    if base_model.gguf_file is not None:
        values["gguf_file"] = str(base_model.gguf_file)
    if settings.quantization in ("int8", "int4"):
        values["quantization"] = settings.quantization
        values["quantization_group_size"] = settings.quantization_group_size
    return EngineConfig(model=str(base_model.path), **values)
