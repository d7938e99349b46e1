"""The CPU's native read of an 8-bit KV cache (``csrc/kv_cpu.c``): built once per machine,
called through ctypes.

Same definition as :func:`loramux.kernels.kv_quant.gather_quantized_context` (whole blocks of
a context, de-quantized to float32), in one pass over the context's bytes where the torch
ops take three. The torch attention takes it as its ``gather`` on a float32 CPU engine
(``engine/lora/backend.py``); anything else (a float cache, other dtypes) goes to
:func:`loramux.kernels.paged_attention.gather_kv`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.kernels.kv_quant import QuantizedKV
from loramux.kernels.native_build import CSRC, load_native_library
from loramux.kernels.paged_attention import KVCache, gather_kv

SOURCE = CSRC / "kv_cpu.c"


@dataclass(frozen=True)
class NativeKVGather:
    """The loaded library's op (and fp8's 256 values, as torch converts them)."""

    library: ctypes.CDLL
    path: Path
    fp8_values: torch.Tensor  # [256] float32: byte -> e4m3 value, NaN bytes 0

    def gather(self, cache: KVCache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """:func:`gather_kv`'s result (``[R, L, kv_heads, head_dim]``), natively for a
        quantized cache on the CPU read as float32."""
        if not (
            isinstance(cache, QuantizedKV)
            and dtype == torch.float32
            and cache.device.type == "cpu"
            and slots.device.type == "cpu"
        ):
            return gather_kv(cache, slots, dtype)
        rows, length = slots.shape
        num_blocks, block_size, heads, head_dim = cache.data.shape
        blocks = (slots[:, ::block_size] // block_size).contiguous()  # [R, blocks per row]
        if blocks.numel() and not 0 <= int(blocks.min()) <= int(blocks.max()) < num_blocks:
            raise ValueError(f"gather: slots outside the cache's {num_blocks} blocks")
        per_row = blocks.shape[1]
        out = torch.empty(rows * per_row, block_size, heads, head_dim)
        self.library.loramux_gather_dequantize_kv(
            int(cache.data.dtype == torch.float8_e4m3fn),
            self.fp8_values.data_ptr(),
            cache.raw.data_ptr(),
            cache.raw.shape[1],
            blocks.data_ptr(),
            blocks.numel(),
            block_size * heads,
            head_dim,
            out.data_ptr(),
        )
        return out.view(rows, per_row * block_size, heads, head_dim)[:, :length]


def load_native_kv_gather(cache_dir: Path | None = None) -> tuple[NativeKVGather | None, str]:
    """The op, built here if needed; or None and why it is not available."""
    library, how = load_native_library(SOURCE, cache_dir)
    if library is None:
        return None, how
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    gather = library.loramux_gather_dequantize_kv
    # fp8, fp8_values, raw, block_bytes, blocks, count, vectors, head_dim, out
    gather.argtypes = [ctypes.c_int, pointer, pointer, size, pointer, size, size, size, pointer]
    gather.restype = None
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    fp8_values = every_byte.view(torch.float8_e4m3fn).float().nan_to_num_(nan=0.0)
    return NativeKVGather(library, Path(library._name), fp8_values), how
