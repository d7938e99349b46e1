"""Adapters as the simulator serves them: a source that takes the simulated time a fetch
would, and gives weights of the adapter's shapes.

The weights are real ``LoRAWeights`` whose tensors are one zero broadcast to each shape
(``expand``): the host cache, the pool and the tiers count their true bytes, and a
thousand 7B adapters take no memory. With ``materialize_weights`` the tensors are drawn at
random instead (small models only), so an engine that runs the model can serve the same
source: the simulator's tests compare the two engines' decisions.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from loramux.engine.lora.adapter import LoRAWeights, ModuleWeights
from loramux.engine.lora.source import AdapterFetchError, AdapterSource
from loramux.engine.model.config import ModelConfig
from loramux.engine.simulation.clock import SimulatedClock
from loramux.engine.simulation.profile import DeviceProfile

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")  # S-LoRA's targets


def adapter_bytes(model: ModelConfig, rank: int, targets: tuple[str, ...], dtype_bytes: int) -> int:
    """Bytes of an adapter's A and B over every layer."""
    width = sum(sum(model.module_shape(m)) for m in targets)
    return rank * width * model.num_layers * dtype_bytes


class SimulatedAdapterSource(AdapterSource):
    cache_key = None

    def __init__(
        self,
        name: str,
        rank: int,
        clock: SimulatedClock,
        profile: DeviceProfile,
        *,
        targets: tuple[str, ...] = QKVO,
        alpha: float | None = None,
        materialize_weights: bool = False,
    ):
        self.description = f"simulated adapter {name!r} (rank {rank}, {'/'.join(targets)})"
        self.name, self.rank, self.targets = name, rank, targets
        self.clock, self.profile = clock, profile
        self.scale = (alpha if alpha is not None else 2 * rank) / rank
        self.materialize_weights = materialize_weights

    @contextlib.contextmanager
    def materialize(self) -> Iterator[Path]:
        raise AdapterFetchError(f"{self.description} has no files")
        yield Path()  # pragma: no cover

    def fetch_seconds(self, model: ModelConfig, dtype: torch.dtype) -> float:
        nbytes = adapter_bytes(model, self.rank, self.targets, dtype.itemsize)
        return self.profile.store_latency_s + nbytes / self.profile.store_bytes_per_s

    def load(
        self, model_config: ModelConfig, *, name: str, max_rank: int, dtype: torch.dtype
    ) -> LoRAWeights:
        if self.rank > max_rank:
            raise AdapterFetchError(f"{self.description}: rank above max_lora_rank {max_rank}")
        self.clock.sleep(self.fetch_seconds(model_config, dtype))
        return self.weights(model_config, name=name, dtype=dtype)

    def weights(self, model_config: ModelConfig, *, name: str, dtype: torch.dtype) -> LoRAWeights:
        """The adapter's weights at once (no fetch): for one already in host RAM."""
        generator = torch.Generator().manual_seed(zlib.crc32(self.name.encode()))
        modules = {}
        for module in self.targets:
            in_f, out_f = model_config.module_shape(module)
            a, b = {}, {}
            for layer in range(model_config.num_layers):
                a[layer] = self._tensor((self.rank, in_f), dtype, generator, 1 / in_f**0.5)
                b[layer] = self._tensor((out_f, self.rank), dtype, generator, 0.02)
            modules[module] = ModuleWeights(rank=self.rank, scale=self.scale, a=a, b=b)
        return LoRAWeights(name=name, modules=modules)

    def _tensor(self, shape, dtype, generator, std) -> torch.Tensor:
        if self.materialize_weights:
            return (torch.randn(shape, generator=generator) * std).to(dtype)
        return torch.zeros((), dtype=dtype).expand(shape)
