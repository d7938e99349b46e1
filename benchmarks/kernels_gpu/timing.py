"""Timing, machine ceilings and error measures of the ``kernels-gpu`` study.

Every time is the median of ``iters`` runs after ``warmup`` runs (the warm-up absorbs
Triton's compiles and cuBLAS's handle creation). On CUDA each run sits between two CUDA
events, after a write of ``L2_FLUSH_BYTES`` to a scratch buffer outside the events: an
operand small enough to stay in the H100's 50 MB L2 (one adapter's rows, a few hundred KB)
is then read from memory, as the engine meets it once per step, not from a warm cache.
On the CPU (the smoke run) ``perf_counter`` around each run.

The two ceilings the floors are built from are measured in the same run, not taken from
a datasheet: copy bandwidth (a large device-to-device ``copy_``, bytes read + bytes
written over time) and the matmul rate (a large ``torch.mm`` in the benchmark's dtype).
The floor of an op is ``max(bytes / copy bandwidth, flops / matmul rate)``: no version of
the op runs much faster, and the larger term says which resource bounds it.
"""

from __future__ import annotations

import gc
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

L2_FLUSH_BYTES = 256 << 20  # 5x an H100's L2
BASELINE_SLACK = 3.0


def host_median_s(fn: Callable[[], object], iters: int) -> float:
    """Median ``perf_counter`` time of ``fn``, any CUDA work it queued included."""
    times = []
    for _ in range(iters):
        begin = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


class Timer:
    """Median wall time of a callable on one device (see the module docstring)."""

    def __init__(self, device: torch.device, *, iters: int, warmup: int):
        if iters < 1 or warmup < 0:
            raise ValueError(f"iters must be ≥ 1 and warmup ≥ 0, got {iters} and {warmup}")
        self.device, self.iters, self.warmup = device, iters, warmup
        self._flush: torch.Tensor | None = None
        if device.type == "cuda":
            self._flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)

    def median_s(self, fn: Callable[[], object], *, flush_l2: bool = True) -> float:
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            return host_median_s(fn, self.iters)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        torch.cuda.synchronize(self.device)
        for start, end in zip(starts, ends, strict=True):
            if flush_l2 and self._flush is not None:
                self._flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(self.device)  # also surfaces any launch error of fn
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) / 1e3


@dataclass(frozen=True)
class MachineRates:
    copy_bytes_per_s: float  # device-to-device copy: (read + written) bytes / s
    matmul_flops_per_s: float  # torch.mm in the benchmark dtype

    def floor_s(self, num_bytes: float, flops: float) -> float:
        return max(num_bytes / self.copy_bytes_per_s, flops / self.matmul_flops_per_s)


def measure_rates(
    timer: Timer, dtype: torch.dtype, *, copy_bytes: int, matmul_size: int
) -> MachineRates:
    """Copy bandwidth over a ``copy_bytes`` buffer and the rate of an n³ matmul, n = size."""
    device = timer.device
    # Random data, never zeros: zero pages and zero operands can run faster than real data.
    source = torch.randn(copy_bytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    copy_s = timer.median_s(partial(target.copy_, source), flush_l2=False)
    a = torch.randn(matmul_size, matmul_size, dtype=dtype, device=device)
    b = torch.randn(matmul_size, matmul_size, dtype=dtype, device=device)
    mm_s = timer.median_s(partial(torch.mm, a, b, out=torch.empty_like(a)), flush_l2=False)
    return MachineRates(
        copy_bytes_per_s=2 * source.numel() * source.element_size() / copy_s,
        matmul_flops_per_s=2 * matmul_size**3 / mm_s,
    )


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖actual − expected‖ / ‖expected‖`` in float64; inf when anything is not finite."""
    a, e = actual.detach().double(), expected.detach().double()
    if a.shape != e.shape or not bool(torch.isfinite(a).all()):
        return float("inf")
    scale = float(e.norm())
    diff = float((a - e).norm())
    return diff / scale if scale > 0 else diff


@dataclass(frozen=True)
class BenchContext:
    device: torch.device
    dtype: torch.dtype
    timer: Timer
    rates: MachineRates
    # A kernel's output matches when its relative error against the float32 reference
    # (same inputs, upcast) is below this: bf16 rounding lands near 3e-3, fp32 far below.
    tolerance: float


def kernel_row(
    ctx: BenchContext,
    triton_fn: Callable[[], torch.Tensor],
    baseline_fn: Callable[[], torch.Tensor] | None,
    expected: torch.Tensor,
    num_bytes: int,
    flops: int,
    rows: int | None = None,
) -> dict:
    """The columns every kernel row shares. Each callable is checked once against
    ``expected`` (its first ``rows`` rows), then timed; no ``baseline_fn``: too large to
    run. The baseline matches within ``BASELINE_SLACK`` times Triton's tolerance: torch's
    16-bit paths round more intermediates (the scores and probabilities of SDPA's math
    path, the delta before the add), and its check only shows it computes the same function.
    """
    errors = {"triton_rel_err": relative_error(triton_fn()[:rows], expected)}
    if baseline_fn is not None:
        errors["baseline_rel_err"] = relative_error(baseline_fn()[:rows], expected)
    triton_s = ctx.timer.median_s(triton_fn)
    baseline_s = None if baseline_fn is None else ctx.timer.median_s(baseline_fn)
    floor_s = ctx.rates.floor_s(num_bytes, flops)
    memory_bound = num_bytes / ctx.rates.copy_bytes_per_s >= floor_s
    baseline_ok = errors.get("baseline_rel_err", 0.0) < BASELINE_SLACK * ctx.tolerance
    return {
        "triton_ms": triton_s * 1e3,
        "baseline_ms": None if baseline_s is None else baseline_s * 1e3,
        "floor_ms": floor_s * 1e3,
        "bound": "memory" if memory_bound else "compute",
        "triton_vs_floor": triton_s / floor_s,
        "speedup_vs_baseline": None if baseline_s is None else baseline_s / triton_s,
        "bytes": num_bytes,
        "flops": flops,
        **errors,
        "matches": errors["triton_rel_err"] < ctx.tolerance and baseline_ok,
    }


def run_case(fields: dict, measure: Callable[[], dict]) -> dict:
    """``fields`` plus what ``measure`` returns. One case running out of memory or tripping
    a kernel check must not lose the rest of a run on a borrowed GPU: its row records the
    error, counts as a mismatch (the exit status says so), and the next case starts from
    freed memory."""
    try:
        return {**fields, **measure()}
    except Exception as exc:  # the row carries it; the exit code reports it
        traceback.print_exc()
        return {**fields, "matches": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        free_device_memory()


def free_device_memory() -> None:
    """Drop this case's tensors and hand cached blocks back before the next case."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
