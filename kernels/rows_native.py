"""The CPU's native row-wise ops of long steps (``csrc/rows_cpu.c``): RMSNorm, SiLU times up
and RoPE, one pass each over a prefill chunk's activations. The C file gives the maths; the torch
code they stand in for (``engine/model/llama.py``'s ``RMSNorm`` and ``LlamaMLP``) is their
reference. :func:`install_native_rows` hands them to a model's modules."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.kernels.native_build import CSRC, load_native_library

SOURCE = CSRC / "rows_cpu.c"
# Rows from which a step takes these ops (fewer: torch's, whose dispatch is then the cost).
MIN_ROWS = 64

_size, _pointer = ctypes.c_int64, ctypes.c_void_p


def _rows_of(name: str, tensor: torch.Tensor) -> None:
    if (
        tensor.device.type != "cpu"
        or tensor.dtype != torch.float32
        or tensor.dim() != 2
        or tensor.stride(1) != 1
    ):
        raise ValueError(f"native rows: {name} must be float32 [rows, size] with rows contiguous")


@dataclass(frozen=True)
class NativeRows:
    library: ctypes.CDLL
    path: Path

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * (x * rsqrt(mean(x^2, -1) + eps))`` of each row of ``x`` ``[rows, size]``."""
        _rows_of("x", x)
        if weight.shape != (x.shape[1],) or weight.dtype != torch.float32 or weight.stride(0) != 1:
            raise ValueError("native rows: the norm's weight must be float32 [size]")
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        self.library.loramux_rms_norm_f32(
            x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], weight.data_ptr(), eps,
            out.data_ptr(), out.stride(0),
        )  # fmt: skip
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up``, both ``[rows, size]``."""
        _rows_of("gate", gate)
        _rows_of("up", up)
        if gate.shape != up.shape:
            raise ValueError("native rows: gate and up must have one shape")
        out = torch.empty(gate.shape, dtype=torch.float32)
        self.library.loramux_silu_mul_f32(
            gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), gate.shape[0],
            gate.shape[1], out.data_ptr(), out.stride(0),
        )  # fmt: skip
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` in place, ``x`` ``[rows, heads, dim]`` (each
        head contiguous), ``cos``, ``sin`` ``[rows, dim]``; returns ``x``."""
        rows, heads, dim = x.shape
        if not (
            x.device.type == "cpu"
            and x.dtype == cos.dtype == sin.dtype == torch.float32
            and x.stride(2) == 1
            and cos.shape == sin.shape == (rows, dim)
            and cos.stride() == sin.stride()
            and cos.stride(1) == 1
            and dim % 2 == 0
            and dim <= 512
        ):
            raise ValueError("native rows: RoPE takes float32 [rows, heads, dim <= 512] heads")
        self.library.loramux_rope_f32(
            x.data_ptr(), x.stride(0), x.stride(1), rows, heads, dim, cos.data_ptr(),
            sin.data_ptr(), cos.stride(0),
        )  # fmt: skip
        return x


def load_native_rows(cache_dir: Path | None = None) -> tuple[NativeRows | None, str]:
    """The ops, built here if needed; or None and why they are not available."""
    library, how = load_native_library(SOURCE, cache_dir)
    if library is None:
        return None, how
    norm = library.loramux_rms_norm_f32
    # x, x_stride, rows, size, weight, eps, out, out_stride
    norm.argtypes = [_pointer, _size, _size, _size, _pointer, ctypes.c_float, _pointer, _size]
    norm.restype = None
    silu = library.loramux_silu_mul_f32
    # gate, gate_stride, up, up_stride, rows, size, out, out_stride
    silu.argtypes = [_pointer, _size, _pointer, _size, _size, _size, _pointer, _size]
    silu.restype = None
    rope = library.loramux_rope_f32
    # x, x_stride, head_stride, rows, heads, dim, cos, sin, table_stride
    rope.argtypes = [_pointer, _size, _size, _size, _size, _size, _pointer, _pointer, _size]
    rope.restype = None
    return NativeRows(library, Path(library._name)), how
