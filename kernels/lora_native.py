"""The CPU's native LoRA op (``csrc/lora_cpu.c``): built once per machine, called through ctypes.

Same definition as :mod:`loramux.kernels.lora`'s references, for one projection group and
float32: ``out_s[t] += c_ks * ((x[t] @ A_s[rows_k]^T) @ B_s[rows_k])`` for each segment k's
tokens and each slice s, reading the adapter pool directly (an adapter's rows are
consecutive). The C file says why it is
faster than torch here and how it is laid out.

Building: :func:`load_native_lora` builds the C file once per machine
(``loramux.kernels.native_build``); where no compiler works, it returns None with the
reason and the engine uses the torch ops.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.kernels.native_build import CSRC, load_native_library

SOURCE = CSRC / "lora_cpu.c"
SEGMENT_FIELDS = 3  # start, end, first pool row


@dataclass(frozen=True)
class GroupCall:
    """What a step's calls for one projection group share (from :meth:`NativeLoRA.prepare`)."""

    segments: torch.Tensor  # [k, 3] int64: start, end, first pool row
    ranks: torch.Tensor  # [k, S] int64
    scales: torch.Tensor  # [k, S] float32
    scratch: torch.Tensor  # [T, >= S * rank_width] float32
    rank_width: int
    a_shape: torch.Size  # [pool rows, in]: every slice's A pool, in every layer
    a_stride: int  # the pools' row strides (every layer's pools share them)
    b_stride: int
    out_shapes: tuple[torch.Size, ...]
    in_features: int
    arguments: tuple  # the C function's per-step arguments, as ctypes values


@dataclass(frozen=True)
class NativeLoRA:
    """The loaded library's op. :meth:`prepare` checks a group's operands once a step;
    :meth:`apply` then checks, per call, only what a layer could change."""

    library: ctypes.CDLL
    path: Path

    def prepare(
        self,
        x: torch.Tensor,
        outs: Sequence[torch.Tensor],
        a_pools: Sequence[torch.Tensor],
        b_pools: Sequence[torch.Tensor],
        segments: Sequence[tuple[int, int, int]],  # (start, end, first pool row) per segment
        ranks: Sequence[Sequence[int]],  # [segment][slice]
        scales: Sequence[Sequence[float]],  # [segment][slice]
        scratch: torch.Tensor,  # [T, >= slices * rank_width] float32
        rank_width: int,
    ) -> GroupCall:
        """A :class:`GroupCall` for these operands (one layer's; every layer's pools must be
        shaped alike), after :func:`check_operands`: a ValueError says what is wrong."""
        check_operands(x, outs, a_pools, b_pools, segments, ranks, scales, scratch, rank_width)
        count, words = len(outs), ctypes.c_int64 * len(outs)
        return GroupCall(
            segments=torch.tensor(segments, dtype=torch.int64).view(-1, SEGMENT_FIELDS),
            ranks=torch.tensor(ranks, dtype=torch.int64).view(-1, count),
            scales=torch.tensor(scales, dtype=torch.float32).view(-1, count),
            scratch=scratch,
            rank_width=rank_width,
            a_shape=a_pools[0].shape,
            a_stride=a_pools[0].stride(0),
            b_stride=b_pools[0].stride(0),
            out_shapes=tuple(out.shape for out in outs),
            in_features=x.shape[1],
            arguments=(
                count,
                words(*(out.stride(0) for out in outs)),
                words(*(out.shape[1] for out in outs)),
            ),
        )

    def apply(
        self,
        x: torch.Tensor,  # [T, in] float32, rows contiguous
        outs: Sequence[torch.Tensor],  # per slice [T, out_s] float32 contiguous; updated
        a_pools: Sequence[torch.Tensor],  # per slice [R, in], rows contiguous, one row stride
        b_pools: Sequence[torch.Tensor],  # per slice [R, out_s], likewise
        call: GroupCall,
    ) -> None:
        """``out_s[start:end] += c * ((x[start:end] @ A_s[f:f+r]^T) @ B_s[f:f+r])`` for every
        segment and slice (r, c: the segment's rank and scaling in slice s)."""
        if not (
            len(outs) == len(a_pools) == len(b_pools) == len(call.out_shapes)
            and x.is_contiguous()
            and x.shape == (call.scratch.shape[0], call.in_features)
            and all(
                o.is_contiguous()
                and o.shape == shape
                and a.shape == call.a_shape
                and a.stride(0) == call.a_stride
                and b.stride(0) == call.b_stride
                and b.shape == (call.a_shape[0], shape[1])
                for o, shape, a, b in zip(outs, call.out_shapes, a_pools, b_pools, strict=True)
            )
        ):
            raise ValueError("native LoRA: x, outs or pools differ from the prepared call's")
        count, out_strides, out_dims = call.arguments
        pointers = ctypes.c_void_p * count
        status = self.library.loramux_lora_f32(
            x.data_ptr(),
            x.stride(0),
            x.shape[1],
            count,
            pointers(*(out.data_ptr() for out in outs)),
            out_strides,
            out_dims,
            pointers(*(pool.data_ptr() for pool in a_pools)),
            call.a_stride,
            pointers(*(pool.data_ptr() for pool in b_pools)),
            call.b_stride,
            call.segments.data_ptr(),
            call.segments.shape[0],
            call.ranks.data_ptr(),
            call.scales.data_ptr(),
            call.scratch.data_ptr(),
            call.scratch.stride(0),
            call.rank_width,
        )
        if status != 0:
            raise MemoryError("the native LoRA op could not allocate its work lists")


def check_operands(x, outs, a_pools, b_pools, segments, ranks, scales, scratch, rank_width):
    """Raise ValueError unless the operands are what the C code may be given (it trusts
    them): float32 CPU tensors with contiguous rows, every slice's pools alike, and every
    segment's tokens inside x and its rows inside the pools."""
    count = len(outs)
    if not count or len(a_pools) != count or len(b_pools) != count:
        raise ValueError("one out, A pool and B pool per slice are needed")
    tensors = {"x": x, "scratch": scratch, **{f"out {i}": out for i, out in enumerate(outs)}}
    tensors.update({f"A pool {i}": pool for i, pool in enumerate(a_pools)})
    tensors.update({f"B pool {i}": pool for i, pool in enumerate(b_pools)})
    for name, tensor in tensors.items():
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or tensor.dim() != 2:
            raise ValueError(f"{name}: a 2-D float32 CPU tensor is needed, got {tensor.dtype}")
        if tensor.stride(1) != 1:
            raise ValueError(f"{name}: its rows must be contiguous")
    tokens, pool_rows = x.shape[0], a_pools[0].shape[0]
    if any(out.shape[0] != tokens for out in outs) or scratch.shape[0] != tokens:
        raise ValueError("x, every out and the scratch must have a row per token")
    if not scratch.is_contiguous() or scratch.shape[1] < count * rank_width:
        raise ValueError("the scratch must be contiguous and slices x rank_width wide")
    for pools, dims in ((a_pools, [x.shape[1]] * count), (b_pools, [o.shape[1] for o in outs])):
        if {pool.stride(0) for pool in pools} != {pools[0].stride(0)}:
            raise ValueError("a group's pools must share one row stride")
        if any(p.shape != (pool_rows, d) for p, d in zip(pools, dims, strict=True)):
            raise ValueError("the pools' shapes must match x, the outs and each other")
    if not len(segments) == len(ranks) == len(scales):
        raise ValueError("one rank and scale list per segment")
    for (start, end, first), segment_ranks, segment_scales in zip(
        segments, ranks, scales, strict=True
    ):
        if len(segment_ranks) != count or len(segment_scales) != count:
            raise ValueError("a rank and a scale per slice for every segment")
        if not 0 <= start <= end <= tokens:
            raise ValueError(f"segment [{start}, {end}) is outside x's {tokens} tokens")
        if not all(0 <= rank <= rank_width for rank in segment_ranks):
            raise ValueError(f"ranks {list(segment_ranks)} are not within 0..{rank_width}")
        if not 0 <= first <= first + max(segment_ranks) <= pool_rows:
            raise ValueError(f"rows from {first} are outside the pools' {pool_rows} rows")


def load_native_lora(cache_dir: Path | None = None) -> tuple[NativeLoRA | None, str]:
    """The op, built here if needed; or None and why it is not available."""
    library, how = load_native_library(SOURCE, cache_dir)
    if library is None:
        return None, how
    function = library.loramux_lora_f32
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    # x, x_stride, in_dim, slices, outs, out_strides, out_dims, a_slices, a_stride, b_slices,
    # b_stride, segments, num_segments, ranks, scales, h, h_stride, rank_width
    function.argtypes = [pointer, size, size, size, pointer, pointer, pointer, pointer, size]
    function.argtypes += [pointer, size, pointer, size, pointer, pointer, pointer, size, size]
    function.restype = ctypes.c_int
    return NativeLoRA(library, Path(library._name)), how
