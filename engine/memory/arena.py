"""One device memory budget for the paged KV cache and the resident adapters (S-LoRA).

Each layer's arena is that layer's key tensor and value tensor, shaped
``[num_blocks, block_size, kv_heads, head_dim]`` as attention expects, so neither
attention nor the kernels know the memory is shared. Seen flat, each tensor is
``num_blocks * E`` elements with ``E = block_size * kv_heads * head_dim`` per KV block.

The same memory is also cut into *rank-rows* of ``W`` elements, counted from element 0:

    A_rows[layer] = k.view(-1)[: total_rows * W].view(total_rows, W)
    B_rows[layer] = v.view(-1)[: total_rows * W].view(total_rows, W)
    total_rows    = (num_blocks * E) // W
    W             = max(Σ in_m, Σ out_m) over m in LORA_TARGETS

so row j covers elements ``[jW, (j+1)W)`` of both tensors of every layer, i.e. KV blocks
``floor(jW/E) .. floor(((j+1)W - 1)/E)``. One row holds one rank-row of an adapter for all
seven target modules at fixed offsets: module m's A row (``A_m[i, :]``) at
``[offA_m, offA_m + in_m)`` of the A row, its B row (B transposed, ``B_m[:, i]``) at
``[offB_m, offB_m + out_m)`` of the B row. The pools the model reads are strided views,
``a_pool(layer, m) = A_rows[layer][:, offA_m : offA_m + in_m]`` (row stride W), which the
LoRA references slice and the Triton kernels reach by (base pointer, row stride).

KV takes blocks from the bottom, adapters take rows from the top. With the adapter region
being rows ``[first_row, total_rows)``, KV may use blocks ``[0, kv_limit_for(first_row))``
and the two never overlap: the block that holds row ``first_row``'s first element, and
everything above it, is the adapters'. ``kv_limit_for`` and ``first_row_for`` convert
between the two and form a Galois pair:

    kv_limit_for(r) >= L   <=>   r >= first_row_for(L)

Optionally ``scratch_blocks`` more KV blocks follow the ``num_blocks`` the layout knows
(neither KV's nor any row's): the static decode path (``loramux.engine.static_decode``)
pads its batch with rows that write their keys and values to :attr:`DeviceArena.scratch_slot`.

A quantized KV cache (``kv_cache_dtype`` int8 or fp8, ``loramux.kernels.kv_quant``) views
the same memory's bytes as its blocks, each its 8-bit data then its per-slot scales, so E
counts a block's bytes in the rows' elements (SmolLM2's 16-token block: 3 x 16 x 68 bytes,
816 float32 elements where a float32 block takes 3,072). Rows and blocks still tile the
same memory, with nothing kept aside for scales.

This module only lays the memory out; which rows are whose is ``LoRAPool``'s business,
and which blocks are whose ``KVCacheManager``'s.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from loramux.engine.lora.adapter import LoRAWeights
from loramux.engine.lora.tokens import slab_capacity, token_table_rows, write_tables
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import LORA_TARGETS
from loramux.kernels.kv_quant import QuantizedKV, bytes_per_slot_head, storage_dtype
from loramux.kernels.paged_attention import KVCache

__all__ = [
    "AdapterRows",
    "DeviceArena",
    "RowLayout",
    "block_bytes",
    "quantized_block_elems",
    "row_bytes",
    "zeroed",
]


@dataclass(frozen=True)
class RowLayout:
    """The rows ↔ blocks arithmetic of an arena (no tensors; see the module docstring)."""

    num_blocks: int
    block_elems: int  # E: elements of one KV block in one layer's k (or v) tensor
    row_width: int  # W: elements of one rank-row
    in_features: dict[str, int]
    out_features: dict[str, int]
    a_offsets: dict[str, int]  # module -> offA_m, first element of its A row in a row
    b_offsets: dict[str, int]  # module -> offB_m, first element of its B row in a row

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        *,
        block_elems: int | None = None,
    ) -> RowLayout:
        """``block_elems``: a KV block of one layer's keys in the rows' elements (default:
        a cache in the rows' dtype; a quantized one passes its bytes over the rows')."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need positive num_blocks and block_size, got {num_blocks}, {block_size}"
            )
        if block_elems is None:
            block_elems = block_size * config.num_kv_heads * config.head_dim
        shapes = {m: config.module_shape(m) for m in LORA_TARGETS}
        a_offsets, b_offsets, a_end, b_end = {}, {}, 0, 0
        for module, (in_f, out_f) in shapes.items():  # LORA_TARGETS order
            a_offsets[module], b_offsets[module] = a_end, b_end
            a_end, b_end = a_end + in_f, b_end + out_f
        return cls(
            num_blocks=num_blocks,
            block_elems=block_elems,
            row_width=max(a_end, b_end),
            in_features={m: s[0] for m, s in shapes.items()},
            out_features={m: s[1] for m, s in shapes.items()},
            a_offsets=a_offsets,
            b_offsets=b_offsets,
        )

    @classmethod
    def for_arena(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str,
    ) -> RowLayout:
        """The layout of an arena in ``dtype`` whose KV cache is of ``kv_cache_dtype``."""
        block_elems = quantized_block_elems(config, block_size, dtype, kv_cache_dtype)
        return cls.for_model(config, num_blocks, block_size, block_elems=block_elems)

    @property
    def total_rows(self) -> int:
        """Rows the whole memory would hold if KV had none of it."""
        return self.num_blocks * self.block_elems // self.row_width

    def kv_limit_for(self, first_row: int) -> int:
        """Blocks KV may use while adapters hold rows ``[first_row, total_rows)``.

        The largest L with block L-1 entirely below row ``first_row``: ``floor(first_row·W/E)``,
        or every block when the region is empty (``first_row == total_rows``): the rows'
        rounding leaves a tail of memory no row covers, which is KV's then.
        """
        if not 0 <= first_row <= self.total_rows:
            raise ValueError(f"first_row {first_row} outside [0, {self.total_rows}]")
        if first_row == self.total_rows:
            return self.num_blocks
        return first_row * self.row_width // self.block_elems

    def first_row_for(self, kv_limit: int) -> int:
        """The lowest row adapters may use while KV holds blocks ``[0, kv_limit)``.

        ``ceil(kv_limit·E/W)``: the first row starting at or after the end of block
        ``kv_limit - 1`` (``total_rows`` when no row does).
        """
        if not 0 <= kv_limit <= self.num_blocks:
            raise ValueError(f"kv_limit {kv_limit} outside [0, {self.num_blocks}]")
        return min(self.total_rows, -(-kv_limit * self.block_elems // self.row_width))

    def blocks_of_rows(self, start: int, end: int) -> range:
        """KV blocks that rows ``[start, end)`` touch (partly or wholly)."""
        if not 0 <= start < end <= self.total_rows:
            raise ValueError(f"rows [{start}, {end}) outside [0, {self.total_rows})")
        w, e = self.row_width, self.block_elems
        return range(start * w // e, (end * w - 1) // e + 1)


def quantized_block_elems(
    config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str
) -> int | None:
    """A quantized KV block's bytes (data and scales) in the rows' elements of ``dtype``,
    or None for a cache in ``dtype`` itself."""
    storage = storage_dtype(kv_cache_dtype)
    if storage is None:
        return None
    block_bytes = block_size * config.num_kv_heads * bytes_per_slot_head(config.head_dim, storage)
    if block_bytes % dtype.itemsize:
        raise ValueError(
            f"a quantized KV block of {block_bytes} bytes is not a whole number of "
            f"{dtype} elements: use a block size of a multiple of {dtype.itemsize}"
        )
    return block_bytes // dtype.itemsize


def token_rows(layout: RowLayout, num_layers: int, weights: LoRAWeights) -> int:
    """Rank-rows an adapter's embedding and head rows take (``lora/tokens.py``)."""
    hidden = layout.in_features["q_proj"]
    return token_table_rows(weights.token_rows, layout.row_width, hidden, num_layers)


def adapter_rows(layout: RowLayout, num_layers: int, weights: LoRAWeights) -> int:
    """Every rank-row an adapter takes: its rank, DoRA's row, its token tables'."""
    return weights.num_rows + token_rows(layout, num_layers, weights)


def row_bytes(layout: RowLayout, num_layers: int, dtype: torch.dtype) -> int:
    """Device bytes one rank-row takes across all layers (A in k, B in v)."""
    return 2 * num_layers * layout.row_width * dtype.itemsize


def block_bytes(layout: RowLayout, num_layers: int, dtype: torch.dtype) -> int:
    """Device bytes one KV block takes across all layers (keys and values; a quantized
    block's scales are in its bytes)."""
    return 2 * num_layers * layout.block_elems * dtype.itemsize


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU it lies in anonymous ``mmap`` pages, which the kernel
    hands out zero-filled on first touch: a budget of gigabytes costs no time at start
    (``torch.zeros`` writes every byte: about 1.3-2.7 s and 3 GiB resident for 3 GiB, on
    the 2-core development machine) and RAM only as KV blocks and adapter rows are written.
    Never uninitialized memory: attention multiplies masked slots by zero weights, and a
    NaN there would survive (NaN * 0 = NaN). The pages go back when the last view does.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class AdapterRows(Protocol):
    """The adapter rows as the pool sees them: their geometry, the row pools the LoRA ops
    read, and the three changes it makes. A ``DeviceArena`` is one; over several ranks,
    ``engine/parallel/executor.MirroredRows`` sends each change to the others first."""

    layout: RowLayout
    num_layers: int
    device: torch.device

    @property
    def bytes_per_row(self) -> int: ...

    @property
    def bytes_per_block(self) -> int: ...

    def a_pool(self, layer: int, module: str) -> torch.Tensor: ...

    def b_pool(self, layer: int, module: str) -> torch.Tensor: ...

    def token_slabs(self, first_row: int, rows: int) -> list[torch.Tensor]: ...

    def write_adapter(self, start: int, weights: LoRAWeights) -> None: ...

    def zero_rows(self, start: int, end: int) -> None: ...

    def move_rows(self, src: int, dst: int, count: int) -> None: ...


class DeviceArena:
    """Per-layer k/v tensors (the paged KV cache) and the adapter row views over them.

    ``kv_caches`` goes to the runner as the model's KV cache; ``a_pool`` / ``b_pool`` are the
    row pools the LoRA ops read. Allocated zeroed (:func:`zeroed`), so every row holds
    finite values before anything writes it.
    """

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
        fold: Callable[[LoRAWeights], LoRAWeights] | None = None,
    ):
        if scratch_blocks < 0:
            raise ValueError(f"scratch_blocks must be >= 0, got {scratch_blocks}")
        self.kv_cache_dtype = kv_cache_dtype
        # How an adapter's weights become its rows on this device (``lora/dora.py``'s fold
        # of DoRA adapters, from this device's base weights); None: as they are.
        self.fold = fold
        self.kv_storage = storage_dtype(kv_cache_dtype)  # None: KV in ``dtype``
        self.layout = RowLayout.for_arena(
            model_config, num_blocks, block_size, dtype, kv_cache_dtype
        )
        self.dtype, self.device = dtype, torch.device(device)
        self.num_layers = model_config.num_layers
        self.scratch_blocks = scratch_blocks
        self._scratch_slot = num_blocks * block_size  # first slot past the layout's blocks
        self.block_size = block_size
        blocks = num_blocks + scratch_blocks
        shape = (blocks, block_size, model_config.num_kv_heads, model_config.head_dim)
        # The memory the rows share with KV: per layer, one tensor for keys, one for values.
        memory = [
            (
                zeroed((blocks * self.layout.block_elems,), dtype, self.device),
                zeroed((blocks * self.layout.block_elems,), dtype, self.device),
            )
            for _ in range(self.num_layers)
        ]
        # [num_blocks, block_size, kv_heads, head_dim] per layer, keys and values.
        self.kv_caches: list[tuple[KVCache, KVCache]] = [
            (self._kv_view(k, shape), self._kv_view(v, shape)) for k, v in memory
        ]
        rows, width = self.layout.total_rows, self.layout.row_width
        # [total_rows, W] per layer: A rows over the key tensor, B rows over the value tensor.
        self._a_rows = [k[: rows * width].view(rows, width) for k, _ in memory]
        self._b_rows = [v[: rows * width].view(rows, width) for _, v in memory]
        # The model asks for a pool per (layer, module) on every projection of every step:
        # the views are made once.
        lay = self.layout
        self._a_pools = {
            (layer, m): a[:, lay.a_offsets[m] : lay.a_offsets[m] + lay.in_features[m]]
            for layer, a in enumerate(self._a_rows)
            for m in LORA_TARGETS
        }
        self._b_pools = {
            (layer, m): b[:, lay.b_offsets[m] : lay.b_offsets[m] + lay.out_features[m]]
            for layer, b in enumerate(self._b_rows)
            for m in LORA_TARGETS
        }

    def _kv_view(self, memory: torch.Tensor, shape: tuple[int, ...]) -> KVCache:
        """The KV cache over one layer's ``memory``: the tensor itself, or its bytes as
        the blocks of a ``QuantizedKV`` (each its 8-bit data, then its scales)."""
        if self.kv_storage is None:
            return memory.view(shape)
        blocks, block_size, kv_heads, head_dim = shape
        raw = memory.view(torch.uint8).view(blocks, -1)
        return QuantizedKV(raw, block_size, kv_heads, head_dim, self.kv_storage)

    @property
    def scratch_slot(self) -> int:
        """A flat KV slot no sequence and no adapter row owns (needs ``scratch_blocks``)."""
        if not self.scratch_blocks:
            raise ValueError("this arena has no scratch block (scratch_blocks=0)")
        return self._scratch_slot

    # --- sizes -----------------------------------------------------------------
    @property
    def bytes_per_row(self) -> int:
        """Device bytes one rank-row takes across all layers (A in k, B in v)."""
        return row_bytes(self.layout, self.num_layers, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        """Device bytes one KV block takes across all layers (keys and values; a quantized
        block's scales are in its bytes)."""
        return block_bytes(self.layout, self.num_layers, self.dtype)

    # --- views -----------------------------------------------------------------
    def a_pool(self, layer: int, module: str) -> torch.Tensor:
        """``[total_rows, in_m]``, row stride W: row i is A_m's rank-row of whoever owns i."""
        return self._a_pools[(layer, module)]

    def b_pool(self, layer: int, module: str) -> torch.Tensor:
        """``[total_rows, out_m]``, row stride W: row i is B_m's column i, transposed."""
        return self._b_pools[(layer, module)]

    # --- whole-row operations (all layers, A and B, every module) ---------------
    def zero_rows(self, start: int, end: int) -> None:
        for a, b in zip(self._a_rows, self._b_rows, strict=True):
            a[start:end] = 0
            b[start:end] = 0

    def token_slabs(self, first_row: int, rows: int) -> list[torch.Tensor]:
        """Rows ``[first_row, first_row + rows)`` as ``2·layers`` slabs of rows of the
        embedding's width (``lora/tokens.py``): each layer's A memory, then its B memory."""
        hidden = self.layout.in_features["q_proj"]
        cap = slab_capacity(rows, self.layout.row_width, hidden)
        return [
            memory[first_row : first_row + rows].reshape(-1)[: cap * hidden].view(cap, hidden)
            for a, b in zip(self._a_rows, self._b_rows, strict=True)
            for memory in (a, b)
        ]

    def write_adapter(self, start: int, weights: LoRAWeights) -> None:
        """Zero rows ``[start, start + weights.num_rows)`` (modules and layers the adapter
        skips stay zero), then write each module's A and B^T of each layer into them, and a
        DoRA adapter's scales into its last row (folded by ``fold``, ``lora/dora.py``)."""
        if self.fold is not None:
            weights = self.fold(weights)
        tables = token_rows(self.layout, self.num_layers, weights)
        self.zero_rows(start, start + weights.num_rows + tables)
        for module, mw in weights.modules.items():
            rows = slice(start, start + mw.rank)
            for layer, a in mw.a.items():
                # (an MoE expert's may be narrower than the dense MLP's slot: its start)
                a_rows = self.a_pool(layer, module)[rows, : a.shape[1]]
                a_rows.copy_(a.to(self.dtype), non_blocking=True)
                # B is copied as it is (contiguous, pinned) and transposed on the device.
                b = mw.b[layer].to(self.device, self.dtype, non_blocking=True)
                self.b_pool(layer, module)[rows, : b.shape[0]] = b.T
            if mw.magnitude and not mw.dora_excess:
                raise ValueError(
                    f"DoRA adapter {weights.name!r} must be folded before it is written"
                )
            for layer, excess in mw.dora_excess.items():
                self.b_pool(layer, module)[start + weights.dora_row].copy_(excess)
            for layer, bias in mw.bias.items():  # lora_bias: s·b_B (output_terms.py)
                self.b_pool(layer, module)[start + weights.bias_row].copy_(mw.scale * bias.float())
        if tables:
            write_tables(weights, self.token_slabs(start + weights.num_rows, tables))

    def move_rows(self, src: int, dst: int, count: int) -> None:
        """Copy rows ``[src, src + count)`` to ``[dst, dst + count)``; the ranges may overlap."""
        for rows in (*self._a_rows, *self._b_rows):
            rows[dst : dst + count] = rows[src : src + count].clone()
