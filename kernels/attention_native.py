"""The CPU's native causal attention of a prefill chunk (``csrc/prefill_attention_cpu.c``), over
the paged KV cache; ``kernels/paged_attention.py``'s SDPA path is its reference (and what runs
where it does not: heads other than 64 or 128 floats, no AVX-512, a quantized cache, a window)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.kernels.native_build import CSRC, load_native_library

SOURCE = CSRC / "prefill_attention_cpu.c"
_size, _pointer = ctypes.c_int64, ctypes.c_void_p


@dataclass(frozen=True)
class NativePrefillAttention:
    library: ctypes.CDLL
    path: Path

    def takes(self, query: torch.Tensor, k_cache, v_cache) -> bool:
        """Whether this op runs these operands (else the caller's SDPA does)."""
        return (
            type(k_cache) is torch.Tensor
            and type(v_cache) is torch.Tensor
            and query.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and query.device.type == "cpu"
            and query.stride(2) == 1
            and query.stride(1) == query.shape[2]
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and bool(self.library.loramux_prefill_attention_supported(query.shape[-1]))
        )

    def attend(
        self,
        query: torch.Tensor,  # [n, heads, dim]: the chunk's queries, each head contiguous
        k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, dim]
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [L] int64: flat cache slots of positions 0 .. L-1
        scale: float,
        out: torch.Tensor,  # [n, heads, dim], written
    ) -> None:
        n, heads, dim = query.shape
        kv_heads = k_cache.shape[2]
        if not (
            query.stride(2) == 1
            and query.stride(1) == dim
            and out.shape == query.shape
            and out.stride(2) == 1
            and out.stride(1) == dim
            and out.dtype == torch.float32
            and slots.dtype == torch.int64
            and slots.dim() == 1
            and slots.is_contiguous()
            and slots.shape[0] >= n
            and heads % kv_heads == 0
            and k_cache.shape[-1] == dim
        ):
            raise ValueError("native prefill attention: the operands do not fit")
        status = self.library.loramux_prefill_attention_f32(
            query.data_ptr(), query.stride(0), n, heads, kv_heads, dim, k_cache.data_ptr(),
            v_cache.data_ptr(), slots.data_ptr(), slots.shape[0], scale, out.data_ptr(),
            out.stride(0),
        )  # fmt: skip
        if status == 2:
            raise MemoryError("the native prefill attention could not allocate its buffers")
        if status != 0:
            raise ValueError(f"native prefill attention: heads of {dim} are not taken here")


def load_native_prefill_attention(
    cache_dir: Path | None = None,
) -> tuple[NativePrefillAttention | None, str]:
    """The op, built here if needed; or None and why it is not available."""
    library, how = load_native_library(SOURCE, cache_dir)
    if library is None:
        return None, how
    supported = library.loramux_prefill_attention_supported
    supported.argtypes, supported.restype = [_size], ctypes.c_int
    run = library.loramux_prefill_attention_f32
    # q, q_stride, n, heads, kv_heads, dim, k_cache, v_cache, slots, context, scale, out, stride
    run.argtypes = [_pointer, _size, _size, _size, _size, _size, _pointer, _pointer, _pointer]
    run.argtypes += [_size, ctypes.c_float, _pointer, _size]
    run.restype = ctypes.c_int
    return NativePrefillAttention(library, Path(library._name)), how
