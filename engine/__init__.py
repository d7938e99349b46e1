"""loramux engine: one shared base model, many LoRA adapters per batch.

from loramux.engine import Engine, EngineConfig, SamplingParams
"""

from loramux.engine.async_engine import AsyncEngine, AsyncEngineError, EngineStoppedError
from loramux.engine.config import EngineConfig
from loramux.engine.engine import Engine, EngineError
from loramux.engine.lora.adapter import AdapterError, LoRARequest
from loramux.engine.memory_budget import MemoryPlan
from loramux.engine.outputs import RequestOutput
from loramux.engine.residency import ResidencyStats
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.sequence import ErrorKind, FinishReason

__all__ = [
    "AdapterError",
    "AsyncEngine",
    "AsyncEngineError",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineStoppedError",
    "ErrorKind",
    "FinishReason",
    "LoRARequest",
    "MemoryPlan",
    "RequestOutput",
    "ResidencyStats",
    "SamplingParams",
]
