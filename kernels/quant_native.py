"""The CPU's native quantized linear op (``csrc/quant_cpu.c``): built once per machine, called
through ctypes.

Same definition as :mod:`loramux.kernels.quant_linear` (``y = x @ dequantize(W)^T + bias``)
for float32 activations. Steps of up to :data:`DOT_MAX_TOKENS` tokens take the C file's dot
products over rows de-quantized in L1 (a decode step reads each packed weight once); longer
ones (prefill) de-quantize tiles of :data:`TILE_BYTES` and hand them to the BLAS, whose
blocking is worth more there than the bytes saved. The C file says how it is laid out.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.kernels.native_build import CSRC, load_native_library
from loramux.kernels.quant_linear import QuantizedWeight

SOURCE = CSRC / "quant_cpu.c"
# Up to this many tokens: the C dot products. Above: de-quantized tiles through the BLAS
# (measured on SmolLM2's layers, one thread: see benchmarks/results/quant_cpu_kernels.md).
DOT_MAX_TOKENS = 8
TILE_BYTES = 2 << 20  # float32 bytes of one de-quantized tile (stays in L2/L3)
_KIND_BITS = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class NativeQuantLinear:
    """The loaded library's op."""

    library: ctypes.CDLL
    path: Path

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
        tile = x.new_empty(rows, k)
        y = x.new_empty(x.shape[0], n)
        for first in range(0, n, rows):
            count = min(rows, n - first)
            self.dequantize_rows(weight, first, tile[:count])
            torch.mm(x, tile[:count].t(), out=y[:, first : first + count])
        if bias is not None:
            y += bias
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
    return NativeQuantLinear(library, Path(library._name)), how
