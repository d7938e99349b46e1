"""A simulated GPU behind the engine's ``Devices`` seam: the model's geometry without its
weights, an arena of geometry only, and the simulated executor on a simulated clock.

    engine = simulated_engine(EngineConfig(model=llama_7b_dir, ...), "nvidia-h100-80gb-hbm3")
    engine.register_adapter("a0", SimulatedAdapterSource("a0", 64, engine.clock, profile))
    ... add requests at engine.clock.now(), step, engine.clock.advance_to(next arrival) ...

The engine's tensors (its LoRA tables, its sequences' generators) live on the CPU; the
config's dtype is the simulated GPU's (bfloat16), which sizes KV blocks and adapter rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from loramux.engine.config import EngineConfig
from loramux.engine.engine import Engine
from loramux.engine.executor.local import LocalExecutor
from loramux.engine.lora.pool import LoRAPool
from loramux.engine.model.config import ModelConfig
from loramux.engine.simulation.arena import GeometryArena
from loramux.engine.simulation.clock import SimulatedClock
from loramux.engine.simulation.executor import SimulatedExecutor
from loramux.engine.simulation.profile import DeviceProfile
from loramux.engine.simulation.step_time import StepTimeModel


class GeometryModel(nn.Module):
    """A model's config and nothing else: what the engine sizes its memory by."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config


class SimulatedDevice:
    """The ``Devices`` of a simulated GPU."""

    shard = None  # the whole model
    compute_threads = None
    governs_threads = False

    def __init__(self, profile: DeviceProfile, clock: SimulatedClock | None = None):
        self.profile = profile
        self.clock = clock or SimulatedClock()
        self.device = torch.device("cpu")
        self._config: EngineConfig | None = None
        self._model: ModelConfig | None = None
        self._arena: GeometryArena | None = None

    def load_model(self, config: EngineConfig, *, quant_op) -> GeometryModel:
        self._config = config
        self._model = ModelConfig.from_pretrained(config.model)
        return GeometryModel(self._model)

    def close(self) -> None:
        """Nothing runs beside it."""

    def arena(self, *args, **kwargs) -> GeometryArena:
        self._arena = GeometryArena(*args, **kwargs)
        return self._arena

    def adapter_rows(self, arena: GeometryArena) -> GeometryArena:
        return arena

    def static_decode(self, *args, capture: bool, **kwargs):
        raise RuntimeError("a simulated device replays no CUDA graphs (its step time does)")

    def executor(self, local: Callable[[], LocalExecutor], pool: LoRAPool) -> SimulatedExecutor:
        return simulated_executor(
            self.profile, self._config, self._model, self.clock, self._arena, pool
        )


def simulated_executor(
    profile: DeviceProfile,
    config: EngineConfig,
    model: ModelConfig,
    clock: SimulatedClock,
    arena: GeometryArena,
    pool: LoRAPool,
) -> SimulatedExecutor:
    """The simulated executor of an engine of ``config`` on ``model``'s geometry."""
    return SimulatedExecutor(
        StepTimeModel(profile, model, config.torch_dtype.itemsize),
        clock,
        arena,
        pool,
        graph_max_batch=config.cuda_graph_max_batch,
        vocab_size=model.vocab_size,
    )


def simulated_engine(config: EngineConfig, profile: DeviceProfile | str) -> Engine:
    """An engine of ``config`` on a simulated GPU of ``profile``; its clock is
    ``engine.clock`` (a ``SimulatedClock`` at 0), its executor's totals
    ``engine.executor.totals``."""
    if isinstance(profile, str):
        profile = DeviceProfile.load(profile)
    if config.kv_cache_bytes is None:
        raise ValueError(
            "a simulated engine needs kv_cache_bytes: the simulated GPU's memory for KV and "
            "adapters (this machine's says nothing about it)"
        )
    if config.speculative_method != "off":
        raise ValueError("speculative decoding is not simulated: set speculative_method 'off'")
    device = SimulatedDevice(profile)
    engine = Engine(config, devices=device)
    # Loader threads sleep on the clock; it moves only once they are at rest.
    device.clock.activity = engine.residency.tiers.loader.activity
    return engine
