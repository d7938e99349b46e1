"""The CPU's native decode forward (``csrc/decode_cpu.c``): a decode-only step's decoder layers
in one call, through ctypes. The C file gives the maths; :mod:`loramux.engine.native_decode`
decides which steps take it.

:func:`bind_decoder` lays the model's weights out once as the C structs (pointers into the
model's own tensors and the KV cache's, which must outlive the binding: the engine keeps both
for its life); :meth:`NativeDecoder.run` then passes only the step's small arrays.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.kernels.native_build import CSRC, load_native_library
from loramux.kernels.quant_linear import QuantizedWeight

SOURCE = CSRC / "decode_cpu.c"
_KIND_BITS = {"int8": 8, "int4": 4}
_FLOAT_ROWS = 32
# The projections in the LoRA slices' order (the C file's enum; llama.LORA_TARGETS).
MODULES = 7

_size, _pointer = ctypes.c_int64, ctypes.c_void_p


class _Weight(ctypes.Structure):
    _fields_ = [
        ("kind", _size),
        ("group", _size),
        ("n", _size),
        ("k", _size),
        ("q", _pointer),
        ("scales", _pointer),
        ("mins", _pointer),
        ("bias", _pointer),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _pointer),
        ("post_norm", _pointer),
        *((name, _Weight) for name in ("q", "k", "v", "o", "gate", "up", "down")),
        ("k_cache", _pointer),
        ("v_cache", _pointer),
        ("lora_a", _pointer * MODULES),
        ("lora_b", _pointer * MODULES),
        ("a_stride", _size * MODULES),
        ("b_stride", _size * MODULES),
    ]


class _StepLoRA(ctypes.Structure):
    _fields_ = [
        ("first_row", _pointer),
        ("ranks", _pointer),
        ("scales", _pointer),
        ("max_rank", _size),
    ]


class _Decoder(ctypes.Structure):
    _fields_ = [
        ("layers", _size),
        ("hidden", _size),
        ("heads", _size),
        ("kv_heads", _size),
        ("head_dim", _size),
        ("inter", _size),
        ("block_size", _size),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layer", ctypes.POINTER(_Layer)),
    ]


@dataclass(frozen=True)
class DecoderShape:
    """What the C code needs of the model's configuration."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    block_size: int
    eps: float
    scale: float


@dataclass(frozen=True)
class LayerTensors:
    """One layer's tensors as the C code reads them; a projection is a ``QuantizedWeight``
    or a float32 ``[out, in]`` matrix, each with its bias or None."""

    input_norm: torch.Tensor  # [hidden] float32
    post_norm: torch.Tensor
    projections: dict[str, tuple[QuantizedWeight | torch.Tensor, torch.Tensor | None]]
    k_cache: torch.Tensor  # [blocks, block_size, kv_heads, head_dim] float32
    v_cache: torch.Tensor
    # Per module in LORA_TARGETS' order, the adapter pool's A [rows, in] and B [rows, out]
    # views (rows strided); None without a pool.
    lora_pools: list[tuple[torch.Tensor, torch.Tensor]] | None = None


@dataclass(frozen=True)
class StepAdapters:
    """A step's adapters, one row per token: its adapter's first pool row (-1: none) and its
    rank and scaling in each module."""

    first_row: torch.Tensor  # [T] int64
    ranks: torch.Tensor  # [T, 7] int32
    scales: torch.Tensor  # [T, 7] float32
    max_rank: int


def _float32_cpu(name: str, tensor: torch.Tensor) -> int:
    if tensor.device.type != "cpu" or tensor.dtype != torch.float32 or not tensor.is_contiguous():
        raise ValueError(f"native decode: {name} must be a contiguous float32 CPU tensor")
    return tensor.data_ptr()


def _rows(name: str, pool: torch.Tensor) -> int:
    """A pool view's address: float32 on the CPU, its rows strided, each row contiguous."""
    if pool.device.type != "cpu" or pool.dtype != torch.float32 or pool.stride(1) != 1:
        raise ValueError(f"native decode: {name} must be float32 rows on the CPU")
    return pool.data_ptr()


def _weight(name: str, weight: QuantizedWeight | torch.Tensor, bias: torch.Tensor | None):
    bias_at = None if bias is None else _float32_cpu(f"{name}'s bias", bias)
    if isinstance(weight, torch.Tensor):
        n, k = weight.shape
        data = _float32_cpu(name, weight)
        return _Weight(_FLOAT_ROWS, k, n, k, data, None, None, bias_at)
    if weight.qweight.device.type != "cpu" or not weight.qweight.is_contiguous():
        raise ValueError(f"native decode: {name}'s packed weight must be contiguous on the CPU")
    mins = None if weight.mins is None else _float32_cpu(f"{name}'s mins", weight.mins)
    return _Weight(
        _KIND_BITS[weight.kind],
        weight.group_size,
        weight.out_features,
        weight.in_features,
        weight.qweight.data_ptr(),
        _float32_cpu(f"{name}'s scales", weight.scales),
        mins,
        bias_at,
    )


class NativeDecoder:
    """The decoder's layers bound to the C code."""

    def __init__(self, library: ctypes.CDLL, shape: DecoderShape, layers: list[LayerTensors]):
        self._run = library.loramux_decode_layers
        self.shape = shape
        self._layers = (_Layer * len(layers))()
        self.has_adapters = all(tensors.lora_pools is not None for tensors in layers)
        for slot, tensors in zip(self._layers, layers, strict=True):
            slot.input_norm = _float32_cpu("input norm", tensors.input_norm)
            slot.post_norm = _float32_cpu("post-attention norm", tensors.post_norm)
            for name, (weight, bias) in tensors.projections.items():
                setattr(slot, name, _weight(name, weight, bias))
            slot.k_cache = _float32_cpu("the key cache", tensors.k_cache)
            slot.v_cache = _float32_cpu("the value cache", tensors.v_cache)
            for module, (a, b) in enumerate(tensors.lora_pools or ()):
                slot.lora_a[module] = _rows(f"module {module}'s A pool", a)
                slot.lora_b[module] = _rows(f"module {module}'s B pool", b)
                slot.a_stride[module], slot.b_stride[module] = a.stride(0), b.stride(0)
        self._decoder = _Decoder(
            len(layers),
            shape.hidden,
            shape.heads,
            shape.kv_heads,
            shape.head_dim,
            shape.inter,
            shape.block_size,
            shape.eps,
            shape.scale,
            self._layers,
        )

    def run(
        self,
        x: torch.Tensor,  # [T, hidden] float32: embeddings in, the last layer's output out
        cos: torch.Tensor,  # [T, head_dim] float32
        sin: torch.Tensor,
        slots: torch.Tensor,  # [T] int64: each token's flat KV slot
        tables: torch.Tensor,  # [T, blocks] int32: each token's sequence's block table
        lens: torch.Tensor,  # [T] int32: its context length, itself included
        threads: int,
        adapters: StepAdapters | None = None,
    ) -> None:
        tokens = x.shape[0]
        if not (
            x.shape == (tokens, self.shape.hidden)
            and cos.shape == sin.shape == (tokens, self.shape.head_dim)
            and slots.shape == lens.shape == (tokens,)
            and tables.dim() == 2
            and tables.shape[0] == tokens
            and slots.dtype == torch.int64
            and tables.dtype == lens.dtype == torch.int32
            and all(t.is_contiguous() for t in (x, cos, sin, slots, tables, lens))
            and x.dtype == cos.dtype == sin.dtype == torch.float32
        ):
            raise ValueError("native decode: the step's tensors do not fit the decoder")
        step_lora = None
        if adapters is not None:
            if not self.has_adapters:
                raise ValueError("native decode: a step with adapters, bound without a pool")
            if not (
                adapters.first_row.shape == (tokens,)
                and adapters.ranks.shape == adapters.scales.shape == (tokens, MODULES)
                and adapters.first_row.dtype == torch.int64
                and adapters.ranks.dtype == torch.int32
                and adapters.scales.dtype == torch.float32
                and adapters.max_rank >= int(adapters.ranks.max())
                and all(t.is_contiguous() for t in (adapters.ranks, adapters.scales))
            ):
                raise ValueError("native decode: the step's adapters do not fit the decoder")
            step_lora = ctypes.byref(
                _StepLoRA(
                    adapters.first_row.data_ptr(),
                    adapters.ranks.data_ptr(),
                    adapters.scales.data_ptr(),
                    max(adapters.max_rank, 1),
                )
            )
        status = self._run(
            ctypes.byref(self._decoder),
            tokens,
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            lens.data_ptr(),
            step_lora,
            threads,
        )
        if status != 0:
            raise MemoryError("the native decode forward could not allocate its work buffers")


@dataclass(frozen=True)
class NativeDecodeLibrary:
    library: ctypes.CDLL
    path: Path

    def bind(self, shape: DecoderShape, layers: list[LayerTensors]) -> NativeDecoder:
        return NativeDecoder(self.library, shape, layers)


def load_native_decode(cache_dir: Path | None = None) -> tuple[NativeDecodeLibrary | None, str]:
    """The library, built here if needed; or None and why it is not available."""
    library, how = load_native_library(SOURCE, cache_dir)
    if library is None:
        return None, how
    run = library.loramux_decode_layers
    # decoder, tokens, x, cos, sin, slots, tables, table_stride, lens, lora, threads
    run.argtypes = [_pointer, _size, _pointer, _pointer, _pointer, _pointer, _pointer, _size]
    run.argtypes += [_pointer, _pointer, ctypes.c_int]
    run.restype = ctypes.c_int
    return NativeDecodeLibrary(library, Path(library._name)), how
