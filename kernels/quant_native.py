"""The CPU's native quantized linear op (``csrc/quant_cpu.c``): built once per machine, called
through ctypes.

Same definition as :mod:`loramux.kernels.quant_linear` (``y = x @ dequantize(W)^T + bias``)
for float32 activations. Steps of up to :data:`DOT_MAX_TOKENS` tokens take the C file's dot
products over rows de-quantized in L1 (a decode step reads each packed weight once); longer
ones (prefill) de-quantize tiles of :data:`TILE_BYTES` and hand them to a matrix multiply,
whose blocking is worth more there than the bytes saved. The C file says how it is laid out.

The multiply is oneDNN's (``mkldnn._linear_pointwise``) where torch has it, else
``torch.mm`` (MKL's). On the AMD machines this project runs on, MKL's float32 GEMM takes a
path that does about 90 GFLOP/s a core and oneDNN's about 215 at prefill sizes
(``benchmarks/results/prefill_cpu.md``); both sum in float32, in different orders.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loramux.kernels.native_build import CSRC, load_native_library
from loramux.kernels.quant_linear import QuantizedWeight

SOURCE = CSRC / "quant_cpu.c"
# Up to this many tokens: the C dot products. Above: de-quantized tiles through the BLAS
# (measured on SmolLM2's layers, one thread: see benchmarks/results/quant_cpu_kernels.md).
DOT_MAX_TOKENS = 8
TILE_BYTES = 8 << 20  # float32 bytes of one de-quantized tile: a small model's whole weight
_KIND_BITS = {"int8": 8, "int4": 4}

# y [T, N] = x [T, K] @ w[N, K]^T + bias [N] (bias may be None)
TileMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def mm_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch.mm(x, w.t())
    return y if bias is None else y.add_(bias)


def onednn_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


def pick_tile_matmul() -> tuple[TileMatmul, str]:
    """oneDNN's multiply where this torch has it and it agrees with ``torch.mm`` on a probe;
    else ``torch.mm``. Returns the op and its name."""
    try:
        if not torch.backends.mkldnn.is_available():
            return mm_matmul, "torch.mm"
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(16, 64, generator=generator)
        w = torch.randn(24, 64, generator=generator)
        bias = torch.randn(24, generator=generator)
        if torch.allclose(onednn_matmul(x, w, bias), mm_matmul(x, w, bias), atol=1e-4):
            return onednn_matmul, "oneDNN"
    except (AttributeError, RuntimeError):  # an op this torch build lacks
        pass
    return mm_matmul, "torch.mm"


@dataclass(frozen=True)
class NativeQuantLinear:
    """The loaded library's op."""

    library: ctypes.CDLL
    path: Path
    tile_matmul: TileMatmul = mm_matmul  # the multiply of de-quantized tiles (prefill)
    # Each thread's tile buffer, kept: a fresh one each call was memory the allocator mapped
    # anew, and its page faults cost five times the de-quantization itself (about 45 against
    # 9 ms for SmolLM2's layers in a step of 50 tokens).
    _scratch: threading.local = field(default_factory=threading.local, compare=False, repr=False)

    def _tile_buffer(self) -> torch.Tensor:
        buffer = getattr(self._scratch, "tile", None)
        if buffer is None:
            buffer = self._scratch.tile = torch.empty(TILE_BYTES // 4, dtype=torch.float32)
        return buffer

    def linear(
        self,
        x: torch.Tensor,  # [T, K] float32 on the CPU
        weight: QuantizedWeight,
        bias: torch.Tensor | None = None,  # [N] float32
    ) -> torch.Tensor:  # [T, N] float32
        """``x @ dequantize(weight)^T + bias``."""
        check_operands(x, weight, bias)
        x = x if x.stride(-1) == 1 else x.contiguous()
        tokens = x.shape[0]
        if tokens > DOT_MAX_TOKENS:
            return self._tiled(x, weight, bias)
        y = x.new_empty(tokens, weight.out_features)
        status = self.library.loramux_quant_linear_f32(
            _KIND_BITS[weight.kind],
            x.data_ptr(),
            x.stride(0),
            tokens,
            weight.in_features,
            weight.qweight.data_ptr(),
            weight.scales.data_ptr(),
            None if weight.mins is None else weight.mins.data_ptr(),
            weight.group_size,
            weight.out_features,
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            y.stride(0),
        )
        if status != 0:
            raise MemoryError("the native quantized linear op could not allocate its row buffers")
        return y

    def dequantize_rows(self, weight: QuantizedWeight, first: int, out: torch.Tensor) -> None:
        """``out[r] = dequantize(weight)[first + r]`` for each row of ``out`` (float32,
        rows contiguous)."""
        rows = out.shape[0]
        if not (
            first >= 0
            and first + rows <= weight.out_features
            and out.dtype == torch.float32
            and out.shape[1] == weight.in_features
            and out.stride(1) == 1
        ):
            raise ValueError("dequantize_rows: out does not fit the weight's rows")
        self.library.loramux_dequantize_rows(
            _KIND_BITS[weight.kind],
            weight.qweight.data_ptr(),
            weight.scales.data_ptr(),
            None if weight.mins is None else weight.mins.data_ptr(),
            weight.in_features,
            weight.group_size,
            first,
            rows,
            out.data_ptr(),
            out.stride(0),
        )

    def _tiled(self, x, weight: QuantizedWeight, bias) -> torch.Tensor:
        n, k = weight.out_features, weight.in_features
        rows = max(1, min(n, TILE_BYTES // (4 * k)))
        tile = self._tile_buffer()[: rows * k].view(rows, k)
        if rows == n:  # one tile: the whole weight
            self.dequantize_rows(weight, 0, tile)
            return self.tile_matmul(x, tile, bias)
        y = x.new_empty(x.shape[0], n)
        for first in range(0, n, rows):
            count = min(rows, n - first)
            self.dequantize_rows(weight, first, tile[:count])
            part = None if bias is None else bias[first : first + count]
            y[:, first : first + count] = self.tile_matmul(x, tile[:count], part)
        return y


def check_operands(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
    """Raise ValueError unless the C code may be given these (it trusts them)."""
    tensors = {"x": x, "scales": weight.scales, "qweight": weight.qweight}
    if weight.mins is not None:
        tensors["mins"] = weight.mins
    if bias is not None:
        tensors["bias"] = bias
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu":
            raise ValueError(f"native quantized linear: {name} is on {tensor.device}, not the CPU")
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(
            f"native quantized linear: x must be float32 [T, {weight.in_features}], "
            f"got {x.dtype} {tuple(x.shape)}"
        )
    for name in ("qweight", "scales", "mins"):
        if name in tensors and not tensors[name].is_contiguous():
            raise ValueError(f"native quantized linear: {name} must be contiguous")
    if bias is not None and (
        bias.dtype != torch.float32 or bias.shape != (weight.out_features,) or bias.stride(0) != 1
    ):
        raise ValueError(f"native quantized linear: bias must be float32 [{weight.out_features}]")


def load_native_quant_linear(
    cache_dir: Path | None = None,
) -> tuple[NativeQuantLinear | None, str]:
    """The op, built here if needed; or None and why it is not available."""
    library, how = load_native_library(SOURCE, cache_dir)
    if library is None:
        return None, how
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    linear = library.loramux_quant_linear_f32
    # kind, x, x_stride, tokens, k, q, scales, mins, group, n, bias, y, y_stride
    linear.argtypes = [ctypes.c_int, pointer, size, size, size, pointer, pointer, pointer]
    linear.argtypes += [size, size, pointer, pointer, size]
    linear.restype = ctypes.c_int
    rows = library.loramux_dequantize_rows
    # kind, q, scales, mins, k, group, first, rows, out, out_stride
    rows.argtypes = [ctypes.c_int, pointer, pointer, pointer, size, size, size, size, pointer]
    rows.argtypes += [size]
    rows.restype = None
    matmul, name = pick_tile_matmul()
    return NativeQuantLinear(library, Path(library._name), matmul), f"{how}; prefill tiles: {name}"
