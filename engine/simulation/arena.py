"""The device memory of a simulated GPU: the KV blocks' and adapter rows' geometry, no
tensors. The adapter pool lays rows out in it as on a device (``AdapterRows``); what it
would have copied is counted, and the simulated executor charges the next step for it."""

from __future__ import annotations

import torch

from loramux.engine.lora.adapter import LoRAWeights
from loramux.engine.memory.arena import RowLayout, adapter_rows, block_bytes, row_bytes
from loramux.engine.model.config import ModelConfig


class GeometryArena:
    """A ``DeviceArena``'s layout and sizes, and byte counters instead of its tensors."""

    def __init__(
        self,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        scratch_blocks: int = 0,
        kv_cache_dtype: str = "auto",
        fold=None,  # a device's DoRA fold: nothing to fold without weights
    ):
        self.layout = RowLayout.for_arena(
            model_config, num_blocks, block_size, dtype, kv_cache_dtype
        )
        self.dtype, self.device = dtype, torch.device(device)
        self.num_layers = model_config.num_layers
        self.block_size, self.scratch_blocks = block_size, scratch_blocks
        self.pending_h2d_bytes = 0  # adapter rows written from the host since the last step
        self.pending_device_bytes = 0  # rows zeroed or moved on the device since then

    @property
    def bytes_per_row(self) -> int:
        return row_bytes(self.layout, self.num_layers, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        return block_bytes(self.layout, self.num_layers, self.dtype)

    def a_pool(self, layer: int, module: str) -> torch.Tensor:
        raise RuntimeError("a simulated device holds no adapter weights")

    b_pool = a_pool

    def write_adapter(self, start: int, weights: LoRAWeights) -> None:
        self.zero_rows(start, start + adapter_rows(self.layout, self.num_layers, weights))
        lay, itemsize = self.layout, self.dtype.itemsize
        for module, mw in weights.modules.items():
            width = lay.in_features[module] + lay.out_features[module]
            self.pending_h2d_bytes += mw.rank * width * len(mw.a) * itemsize
            # DoRA: the magnitudes go over, the scales are computed on the device
            self.pending_h2d_bytes += lay.out_features[module] * len(mw.magnitude) * itemsize
        hidden = lay.in_features["q_proj"]
        self.pending_h2d_bytes += weights.token_rows * hidden * itemsize

    def zero_rows(self, start: int, end: int) -> None:
        self.pending_device_bytes += (end - start) * self.bytes_per_row

    def move_rows(self, src: int, dst: int, count: int) -> None:
        self.pending_device_bytes += 2 * count * self.bytes_per_row  # read and written

    def take_pending(self) -> tuple[int, int]:
        """(host -> device bytes, device bytes) copied since the last call; counters reset."""
        pending = (self.pending_h2d_bytes, self.pending_device_bytes)
        self.pending_h2d_bytes = self.pending_device_bytes = 0
        return pending
