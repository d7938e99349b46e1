"""loramux engine: one shared base model, many LoRA adapters per batch.

from loramux.engine import Engine, EngineConfig, SamplingParams

This module is the engine's front door: the platform imports only what is exported here
(a test checks it), so the engine's modules can move without breaking it.
"""

from loramux.engine.async_engine import AsyncEngine, AsyncEngineError, EngineStoppedError
from loramux.engine.config import EngineConfig
from loramux.engine.engine import Engine, EngineError
from loramux.engine.lora.adapter import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    AdapterConfig,
    AdapterError,
    LoRARequest,
    load_adapter,
    parse_lora_tensor_name,
    read_adapter_config,
)
from loramux.engine.lora.source import CallableSource
from loramux.engine.memory_budget import MemoryPlan
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.gguf_convert import (
    convert_gguf_to_hf,
    extract_gguf_metadata,
    is_converted,
)
from loramux.engine.model.llama import LORA_TARGETS
from loramux.engine.outputs import RequestOutput
from loramux.engine.residency import ResidencyStats
from loramux.engine.sampler import TokenLogprobs
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.sequence import ErrorKind, FinishReason, RequestMetrics
from loramux.engine.stats import EngineStats, LatencySummary, TierStats
from loramux.engine.tenant_share import TenantShareStats, merge_tenants

__all__ = [
    "CONFIG_FILE",
    "LORA_TARGETS",
    "MAX_CONFIG_BYTES",
    "WEIGHTS_FILE",
    "AdapterConfig",
    "AdapterError",
    "AsyncEngine",
    "AsyncEngineError",
    "CallableSource",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "EngineStoppedError",
    "ErrorKind",
    "FinishReason",
    "LatencySummary",
    "LoRARequest",
    "MemoryPlan",
    "ModelConfig",
    "RequestMetrics",
    "RequestOutput",
    "ResidencyStats",
    "SamplingParams",
    "TenantShareStats",
    "TierStats",
    "TokenLogprobs",
    "convert_gguf_to_hf",
    "extract_gguf_metadata",
    "is_converted",
    "load_adapter",
    "merge_tenants",
    "parse_lora_tensor_name",
    "read_adapter_config",
]
