"""A trace served by the real engine on a simulated GPU (``engine/simulation``): no kernels
run; each step advances a simulated clock. Every figure from here is simulated.

The engine's settings are the GPU presets' (``serve/presets.H100_ENGINE``). The driver
(``driver_engine.run_engine``) adds requests at their arrival times on the simulated clock
and, when a step could run nothing, moves it to the next arrival or adapter fetch to finish.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

from loramux.benchmarks.common.adapter_traffic import read_counters, traffic_between
from loramux.benchmarks.common.driver_engine import run_engine
from loramux.benchmarks.common.measures import summarize
from loramux.benchmarks.common.step_trace import StepTracer, summarize_steps
from loramux.benchmarks.common.workload import WorkloadRequest, prompt_token_ids
from loramux.benchmarks.serve.gpu_model import random_model_dir
from loramux.benchmarks.serve.presets import H100_ENGINE
from loramux.engine.config import EngineConfig
from loramux.engine.model.config import ModelConfig
from loramux.engine.simulation.adapters import QKVO, SimulatedAdapterSource, adapter_bytes
from loramux.engine.simulation.clock import SimulatedClock
from loramux.engine.simulation.devices import simulated_engine
from loramux.engine.simulation.driver import TraceRequest, run_trace
from loramux.engine.simulation.profile import DeviceProfile

DEFAULT_PROFILE = "nvidia-h100-80gb-hbm3"
# The engine's residency counters, reported per simulated minute.
PER_MINUTE = ("adapter_reloads", "device_evictions", "adapter_room_wait_steps", "preemptions")


class SimulatedRunClock:
    """``run_engine``'s clock on a simulated GPU: its time is the engine's simulated time,
    and a step that ran nothing moves it to the next event."""

    def __init__(self, clock: SimulatedClock):
        self.clock = clock
        self._t0 = clock.now()

    def now(self) -> float:
        return self.clock.now() - self._t0

    def wait_until(self, when: float) -> None:
        self._advance_to(when)

    def stepped(self, began: float, outputs: int, next_arrival: float | None) -> None:
        if outputs or self.now() != began:
            return
        arrival = None if next_arrival is None else self._t0 + next_arrival
        self._advance_to(self.clock.next_event(arrival) - self._t0)

    def _advance_to(self, when: float) -> None:
        """To run time ``when``, and surely not short of it: ``t0 + when - t0`` can round
        below ``when``, and an arrival at ``when`` would then never be due."""
        self.clock.advance_to(self._t0 + when)
        while self.now() < when:
            self.clock.advance_to(math.nextafter(self.clock.now(), math.inf))


@dataclass(frozen=True)
class SimulatedRun:
    summary: dict  # measures.summarize's, over simulated seconds
    traffic: dict[str, float]  # adapter_traffic's counters over the run
    residency: dict[str, int]  # PER_MINUTE's counters over the run
    step_seconds: dict[str, float]  # the executed steps' simulated seconds by part
    real_seconds: float  # what simulating took on this machine
    step_summary: dict  # step_trace.summarize_steps of the run's steps
    # The throughput relative to the base model's that the adapters' bytes allow on these
    # steps (SimulatedSteps.adapter_floor_ratio): what the kernels could reach at best.
    adapter_floor_ratio: float = 1.0

    def figures(self) -> dict:
        """What the reports' rows show of a run."""
        s = self.summary
        return {
            "requests_per_s": s["requests_per_s"],
            "ttft_p50_s": s["ttft_s"]["p50"],
            "ttft_p99_s": s["ttft_s"]["p99"],
            "itl_p50_s": s["itl_s"]["p50"],
            "per_minute": {k: 60 * v / s["duration_s"] for k, v in self.residency.items()},
            "real_s": self.real_seconds,
        }


def model_dir(cache_dir: Path, name: str, hf_config: dict, tokenizer_dir: Path) -> Path:
    """A weightless model folder (config.json and a tokenizer) in ``cache_dir``."""
    return random_model_dir(cache_dir / "random-models" / name, hf_config, lambda: tokenizer_dir)


def engine_config(model: Path, **overrides) -> EngineConfig:
    """The GPU presets' engine settings, on a simulated GPU: bfloat16 KV and adapter rows,
    prompt chunks by tokens (CUDA's default), no speculation."""
    return EngineConfig(
        model=str(model),
        device="cpu",
        dtype="bfloat16",
        prefill_step_target_s=float("inf"),
        **{**H100_ENGINE, **overrides},
    )


def model_of(config: EngineConfig) -> ModelConfig:
    return ModelConfig.from_pretrained(config.model)


def serve(
    config: EngineConfig,
    profile: DeviceProfile,
    requests: list[WorkloadRequest],
    ranks: list[int],
    *,
    vocab_size: int,
    seed: int = 0,
    avoid: frozenset[int] = frozenset(),
    base_model: bool = False,
    preload: bool = False,
    host_resident: bool = False,
) -> SimulatedRun:
    """``requests`` on a fresh simulated engine, adapter ``k`` of rank ``ranks[k]`` on
    q/k/v/o; with ``base_model`` every request goes to the base model (the ceiling).
    ``preload``: every adapter on the device before the run (one token each);
    ``host_resident``: every adapter in host RAM before the run (S-LoRA's setting: its
    adapters are in main memory when its clock starts), the host tier sized to hold them."""
    if host_resident:
        itemsize = config.torch_dtype.itemsize
        nbytes = sum(adapter_bytes(model_of(config), r, QKVO, itemsize) for r in ranks)
        config = dataclasses.replace(config, adapter_host_bytes=max(nbytes, 1))
    started = time.perf_counter()
    if base_model:
        requests = [dataclasses.replace(r, adapter=None) for r in requests]
    prompts = {
        r.index: prompt_token_ids(r, vocab_size=vocab_size, seed=seed, avoid=avoid)
        for r in requests
    }
    engine = simulated_engine(config, profile)
    try:
        names = [f"a{k}" for k in range(len(ranks))]
        for name, rank in zip(names, ranks, strict=True):
            source = SimulatedAdapterSource(name, rank, engine.clock, profile)
            request = engine.register_adapter(name, source)
            if host_resident:
                weights = source.weights(engine.model_config, name=name, dtype=config.torch_dtype)
                engine.tiers.keep_in_host(request.adapter_id, weights)
        if preload:
            warm = [TraceRequest(0.0, f"preload-{n}", [7, 8, 9], 1, adapter=n) for n in names]
            run_trace(engine, warm)
        before, residency_before = read_counters(engine), _residency(engine)
        clock = SimulatedRunClock(engine.clock)
        tracer = StepTracer(engine, clock.now)
        records = run_engine(engine, requests, prompts, names, clock=clock, step=tracer.step)
        totals = engine.executor.totals
        duration = max(r.finish_s or 0.0 for r in records) or 1e-9  # S-LoRA's: to the last finish
        return SimulatedRun(
            summary=summarize(records, duration_s=duration),
            traffic=traffic_between(before, read_counters(engine)),
            residency={k: v - residency_before[k] for k, v in _residency(engine).items()},
            step_seconds=dict(totals.by_part),
            real_seconds=time.perf_counter() - started,
            step_summary=summarize_steps(tracer.records),
            adapter_floor_ratio=totals.adapter_floor_ratio(),
        )
    finally:
        engine.close()


def _residency(engine) -> dict[str, int]:
    tiers = engine.tiers
    return {
        "adapter_reloads": tiers.reloads,
        "device_evictions": tiers.device_evictions,
        "adapter_room_wait_steps": tiers.room_wait_steps,
        "preemptions": engine.num_preemptions,
    }
