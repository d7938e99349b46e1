"""loramux engine: one shared base model, many LoRA adapters per batch.

from loramux.engine import Engine, EngineConfig, SamplingParams

This module is the engine's front door: the platform imports only what is exported here
(a test checks it), so the engine's modules can move without breaking it.
"""

from loramux.engine.async_engine import AsyncEngine, AsyncEngineError, EngineStoppedError
from loramux.engine.compute_threads import default_compute_threads
from loramux.engine.config import INT4_GROUP_SIZES, QUANTIZATIONS, EngineConfig
from loramux.engine.engine import Engine
from loramux.engine.errors import AdapterInUse, EngineError, UnknownAdapter
from loramux.engine.lora.adapter import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    AdapterConfig,
    AdapterError,
    LoRARequest,
    load_adapter,
    parse_lora_tensor_name,
    parse_token_tensor_name,
    read_adapter_config,
)
from loramux.engine.lora.expert_lora import parse_expert_tensor_name
from loramux.engine.lora.source import CallableSource
from loramux.engine.memory.plan import MemoryPlan
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
from loramux.engine.stats import EngineStats, LatencySummary, SpeculationStats, TierStats
from loramux.engine.structured import (
    GrammarCacheStats,
    GrammarError,
    JsonObject,
    JsonSchema,
    ParsedToolCall,
    Regex,
    StructuredSpec,
    Tool,
    ToolCalls,
    ToolChoice,
    ToolOutput,
    check_spec,
    format_instructions,
    parse_tool_output,
    spec_from_json,
    spec_to_json,
)
from loramux.engine.structured.tool_calls import CLOSE as TOOL_CALL_CLOSE
from loramux.engine.structured.tool_calls import OPEN as TOOL_CALL_OPEN
from loramux.engine.tenant_share import TenantShareStats, merge_tenants

__all__ = [
    "CONFIG_FILE",
    "INT4_GROUP_SIZES",
    "LORA_TARGETS",
    "MAX_CONFIG_BYTES",
    "QUANTIZATIONS",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "WEIGHTS_FILE",
    "AdapterConfig",
    "AdapterError",
    "AdapterInUse",
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
    "GrammarCacheStats",
    "GrammarError",
    "JsonObject",
    "JsonSchema",
    "LatencySummary",
    "LoRARequest",
    "MemoryPlan",
    "ModelConfig",
    "ParsedToolCall",
    "Regex",
    "RequestMetrics",
    "RequestOutput",
    "ResidencyStats",
    "SamplingParams",
    "SpeculationStats",
    "StructuredSpec",
    "TenantShareStats",
    "TierStats",
    "TokenLogprobs",
    "Tool",
    "ToolCalls",
    "ToolChoice",
    "ToolOutput",
    "UnknownAdapter",
    "check_spec",
    "convert_gguf_to_hf",
    "default_compute_threads",
    "extract_gguf_metadata",
    "format_instructions",
    "is_converted",
    "load_adapter",
    "merge_tenants",
    "parse_expert_tensor_name",
    "parse_lora_tensor_name",
    "parse_token_tensor_name",
    "parse_tool_output",
    "read_adapter_config",
    "spec_from_json",
    "spec_to_json",
]
