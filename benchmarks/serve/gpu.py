"""The GPU runner of ``loramux bench``: ``slora-s1``, ``slora-s2`` and ``punica-distinct``.

Both systems serve the preset's requests on one CUDA GPU at Llama-7B shapes with the
same random bf16 weights (``bench_gpu_model``), one after the other in the same process:

* **loramux**: the engine in-process with ``load_format="random"`` and the preset's
  ``engine`` settings; its loader threads fetch each adapter on demand from a
  ``CallableSource``, bounded by the host tier, like a store fetch. Before the clock
  starts, a warm-up runs one request per rank of the mix (kernel compilation, CUDA
  graphs) on adapters outside the workload; with ``preload_adapters`` every workload
  adapter is then brought onto the device (Punica's setting);
* **baseline**: transformers + PEFT, static mixed-adapter batches over the first
  ``baseline_requests`` requests, holding at most ``baseline_resident`` adapters,
  swapped per batch with host tensors made one batch ahead by as many threads as the
  engine's loader has (``driver_peft.AdapterSwapper``).

Each system's clock starts after its warm-up; its duration ends with its last request.
The report adds to ``bench``'s: the model and adapter settings, the engine's
configuration, the device and versions, each system's peak GPU memory
(``torch.cuda.max_memory_allocated`` over its timed run), adapter traffic, the greedy
agreement of the requests both served (identical weights, so identical tokens up to
bf16 rounding in different kernels; the CPU smoke is float32 and must agree exactly),
and the preset's published references and goals with a met / not met verdict.

``--smoke`` runs all of this on the CPU at tiny shapes (``SMOKE_MODEL``, at most 12
requests and 8 adapters, short lengths, float32), so the test suite runs every line;
its figures are not GPU figures and its goals are not judged.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.benchmarks.common.adapter_traffic import read_counters, traffic_between
from loramux.benchmarks.common.adapters import ADAPTER_STD, QKVO
from loramux.benchmarks.common.driver_engine import exact_length_params, run_engine
from loramux.benchmarks.common.driver_peft import (
    AdapterSwapper,
    adapter_names,
    serve_static_batches,
)
from loramux.benchmarks.common.machine import machine_info
from loramux.benchmarks.common.measures import agreement, memory_high_water
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.common.step_trace import StepTracer, summarize_steps
from loramux.benchmarks.common.workload import (
    WorkloadRequest,
    WorkloadSpec,
    adapter_ranks,
    requests_with_prompts,
)
from loramux.benchmarks.kernels_gpu.timing import free_device_memory
from loramux.benchmarks.serve.gpu_model import (
    LLAMA_7B,
    SMOKE_MODEL,
    WARM_ADAPTER,
    baseline_model,
    lora_config,
    random_adapter_source,
    random_adapter_state,
    random_model_dir,
)
from loramux.benchmarks.serve.presets import PRESETS, Preset, judge_goals
from loramux.benchmarks.serve.report import figures, ratios

SMOKE_ENGINE = {
    "kv_cache_bytes": 16 << 20,
    "adapter_host_bytes": 64 << 20,
    "adapter_load_workers": 2,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 256,
}
# The smoke's caps: enough to batch, mix ranks, evict in the baseline and sweep.
SMOKE_REQUESTS, SMOKE_ADAPTERS, SMOKE_INPUT, SMOKE_OUTPUT = 12, 8, 24, 8
SMOKE_BASELINE = {"baseline_batch": 4, "baseline_requests": 8}
SMOKE_RESIDENT = 2  # fewer than a batch's adapters: the baseline evicts (unless preloading)
WARM_PROMPT_LEN = 40  # spans several KV blocks
ADAPTER_SOURCE = (
    "PEFT LoRA on q/k/v/o generated from (seed, adapter index) by a CallableSource's "
    "fetch, which writes the two PEFT files; the engine's loader threads fetch and parse "
    "each on demand, bounded by the host tier"
)
PRELOAD = "every workload adapter brought onto the device before the clock starts"


@dataclass(frozen=True)
class GpuSetup:
    """What every run of one invocation shares."""

    preset: Preset  # the smoke's caps already applied
    smoke: bool
    device: str  # "cuda", or "cpu" for the smoke
    model_dir: Path
    model_config: object  # loramux.engine.model.config.ModelConfig
    seed: int  # the model's weights; each adapter's generator derives from it too

    def engine_config(self):
        from loramux.engine import EngineConfig

        return EngineConfig(
            model=str(self.model_dir),
            device=self.device,
            load_format="random",
            seed=self.seed,
            **self.preset.engine,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.engine_config().torch_dtype

    def adapter_source(self, rank: int, index: int):
        return random_adapter_source(
            self.model_config, rank, seed=self.seed, index=index, dtype=self.dtype
        )

    def adapter_state(self, rank: int, index: int) -> dict[str, torch.Tensor]:
        return random_adapter_state(
            self.model_config, rank, seed=self.seed, index=index, dtype=self.dtype
        )

    def workload(self, spec: WorkloadSpec) -> tuple[list[WorkloadRequest], dict[int, list[int]]]:
        avoid = frozenset(self.model_config.eos_token_ids)
        return requests_with_prompts(spec, vocab_size=self.model_config.vocab_size, avoid=avoid)


def model_folder(cache_dir: Path, *, smoke: bool) -> Path:
    """The weightless model folder (config.json + SmolLM2's tokenizer files), made once."""
    name = "llama-tiny-random-smoke" if smoke else "llama-7b-random"
    return random_model_dir(
        cache_dir / "random-models" / name,
        SMOKE_MODEL if smoke else LLAMA_7B,
        lambda: prepare_model(cache_dir),
    )


def smoke_preset(preset: Preset) -> Preset:
    """``preset`` at the smoke's sizes, on the smoke's engine settings."""
    spec = preset.workload
    workload = dataclasses.replace(
        spec,
        num_requests=min(spec.num_requests, SMOKE_REQUESTS),
        num_adapters=min(spec.num_adapters, SMOKE_ADAPTERS),
        input_len=tuple(min(n, SMOKE_INPUT) for n in spec.input_len),
        output_len=tuple(min(n, SMOKE_OUTPUT) for n in spec.output_len),
    )
    return dataclasses.replace(
        preset,
        workload=workload,
        engine=SMOKE_ENGINE,
        baseline_resident=None if preset.preload_adapters else SMOKE_RESIDENT,
        **SMOKE_BASELINE,
    )


def make_setup(
    preset: Preset, cache_dir: Path, *, smoke: bool, baseline_requests: int | None = None
) -> GpuSetup:
    """The shared set-up; ``baseline_requests`` overrides the preset's (the smoke's too)."""
    from loramux.engine.model.config import ModelConfig

    folder = model_folder(cache_dir, smoke=smoke)
    preset = smoke_preset(preset) if smoke else preset
    if baseline_requests is not None:
        preset = dataclasses.replace(preset, baseline_requests=baseline_requests)
    return GpuSetup(
        preset=preset,
        smoke=smoke,
        device="cpu" if smoke else "cuda",
        model_dir=folder,
        model_config=ModelConfig.from_pretrained(folder),
        seed=preset.workload.seed,
    )


def serve_loramux(
    setup: GpuSetup, spec: WorkloadSpec, token_ids: dict[int, list[int]] | None = None
) -> dict:
    """loramux's figures for ``spec`` on a fresh engine with random weights."""
    from loramux.engine import Engine

    requests, prompts = setup.workload(spec)
    names = [f"a{k}" for k in range(spec.num_adapters)]
    tenants = {t.name: (t.priority, t.weight) for t in spec.tenants}
    # warm-up adapters: one per rank of the mix, indices after the workload's
    warm_ranks = list(dict.fromkeys(spec.ranks))
    warm = [f"warm-r{rank}" for rank in warm_ranks]
    engine = Engine(setup.engine_config())
    try:
        ranks = adapter_ranks(spec) + warm_ranks
        for k, (name, rank) in enumerate(zip(names + warm, ranks, strict=True)):
            engine.register_adapter(name, setup.adapter_source(rank, k))
        warm_prompts = [
            [10 + (7 * i + j) % 1000 for j in range(WARM_PROMPT_LEN)] for i in range(len(warm) + 1)
        ]
        engine.generate(warm_prompts, exact_length_params(4), adapters=[*warm, None])
        for name in warm:
            engine.remove_adapter(name)
        if setup.preset.preload_adapters and names:  # onto the device: one token each
            engine.generate([[7, 8, 9]] * len(names), exact_length_params(1), adapters=names)
        before = read_counters(engine)
        _reset_peak_memory(setup.device)
        # Each step's time and batch: what the simulator's calibration compares step by step.
        tracer = StepTracer(engine, time.perf_counter)
        records = run_engine(
            engine,
            requests,
            prompts,
            names,
            tenants=tenants,
            token_ids=token_ids,
            step=tracer.step,
        )
        result = figures(records, setup.preset, spec)
        result["steps"] = summarize_steps(tracer.records)
        result["peak_gpu_bytes"] = _peak_memory(setup.device)
        result["adapter_traffic"] = traffic_between(before, read_counters(engine))
    finally:
        engine.close()
        del engine
        free_device_memory()
    return {"driver": "engine", **result}


def serve_baseline(setup: GpuSetup, spec: WorkloadSpec, token_ids: dict[int, list[int]]) -> dict:
    """The baseline's figures over the first ``baseline_requests`` requests of ``spec``."""
    p = setup.preset
    requests, prompts = setup.workload(spec)
    # what loramux's run left on the device
    held_before = int(torch.cuda.memory_allocated()) if setup.device.startswith("cuda") else None
    served = sorted(requests, key=lambda r: (r.arrival_s, r.index))[: p.baseline_requests]
    ranks = adapter_ranks(spec)
    resident = p.baseline_resident or spec.num_adapters
    workers = setup.engine_config().adapter_load_workers
    model = baseline_model(
        setup.model_dir,
        seed=setup.seed,
        dtype=setup.dtype,
        device=setup.device,
        warm_rank=spec.ranks[0],
    )
    swapper = AdapterSwapper(
        model,
        lambda k: (lora_config(ranks[k]), setup.adapter_state(ranks[k], k)),
        resident=resident,
        workers=workers,
        held=[WARM_ADAPTER],
    )
    try:
        if p.preload_adapters:  # every adapter loaded before the clock starts
            swapper.before_batch(served, [])
        preloaded = swapper.stats["adapter_loads"]
        _reset_peak_memory(setup.device)
        records = serve_static_batches(
            model,
            served,
            prompts,
            batch_size=p.baseline_batch,
            device=setup.device,
            names_of=adapter_names,
            before_batch=swapper.before_batch,
            token_ids=token_ids,
        )
        result = figures(records, p, spec)
        result["peak_gpu_bytes"] = _peak_memory(setup.device)
        result["adapter_traffic"] = {**swapper.stats, "preloaded": preloaded}
    finally:
        swapper.close()
        del model, swapper
        free_device_memory()
    result["gpu_bytes_held_before"] = held_before
    result["policy"] = (
        f"transformers + PEFT, static mixed-adapter batches of {p.baseline_batch} "
        f"(adapter_names=) in arrival order over the first {len(served)} of the "
        f"{len(requests)} requests; before each batch PEFT loads the batch's adapters it "
        f"does not hold (add_adapter + set_peft_model_state_dict, host tensors made one "
        f"batch ahead by {workers} threads) and deletes the least recently used beyond "
        f"{resident}; that time counts against the batch"
        + ("; every adapter loaded before the clock starts" if p.preload_adapters else "")
    )
    result["batch_size"] = p.baseline_batch
    return result


def _reset_peak_memory(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_memory(device: str) -> int | None:
    """``torch.cuda.max_memory_allocated`` since the reset (None on the CPU)."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def run_gpu_preset(setup: GpuSetup, args) -> dict:
    """Both systems on ``setup``'s workload; the report ``bench.main`` writes and prints."""
    p, spec = setup.preset, setup.preset.workload
    loramux_ids: dict[int, list[int]] = {}
    print(
        f"loramux (engine, random {_dtype_name(setup.dtype)} weights on {setup.device}): "
        f"{spec.num_requests} requests over {spec.num_adapters} adapters ...",
        flush=True,
    )
    loramux = serve_loramux(setup, spec, loramux_ids)
    baseline, baseline_ids = None, {}
    if not args.no_baseline:
        print(f"transformers + PEFT: the first {p.baseline_requests} requests ...", flush=True)
        baseline = serve_baseline(setup, spec, baseline_ids)
    return {
        "preset": p.name,
        "description": p.description,
        "mode": "smoke" if setup.smoke else "gpu",
        "workload": spec.to_json(),
        "adapter_ranks": adapter_ranks(spec),
        "machine": machine_info(setup.device),
        "model": _model_facts(setup),
        "adapters": {
            "targets": list(QKVO),
            "a_std": "1/sqrt(in_features)",
            "b_std": ADAPTER_STD,
            "lora_alpha": "2 * rank",
            "source": ADAPTER_SOURCE + (f"; {PRELOAD}" if p.preload_adapters else ""),
        },
        "engine_config": dataclasses.asdict(setup.engine_config()),
        "memory_high_water": memory_high_water(),
        "slo": {"ttft_s": p.slo_ttft_s, "itl_s": p.slo_itl_s},
        "loramux": loramux,
        "baseline": baseline,
        "ratios": ratios(loramux, baseline),
        "ratio_note": _ratio_note(baseline, spec),
        "agreement": None if baseline is None else agreement(loramux_ids, baseline_ids),
        **judge(p, loramux, unjudged_reason(PRESETS[p.name], spec.num_adapters, setup.smoke)),
        "gpu_figures": "not measured yet (this run is the CPU smoke of the GPU runner)"
        if setup.smoke
        else f"measured on {torch.cuda.get_device_name()}",
    }


def judge(preset: Preset, loramux: dict, unjudged: str | None) -> dict:
    """``{"references": [...], "goals": [...]}`` for loramux's figures of this run."""
    references = [
        {
            **dataclasses.asdict(ref),
            "loramux": loramux[ref.metric],
            "ratio": loramux[ref.metric] / ref.value,
        }
        for ref in preset.references
    ]
    failed = loramux["requests"]["failed"]
    failures = f"{failed} request(s) failed" if failed else None
    goals = judge_goals(preset.goals, loramux, unjudged=unjudged, failed=failures)
    return {"references": references, "goals": goals}


def unjudged_reason(preset: Preset, spec_adapters: int, smoke: bool) -> str | None:
    """Why this run's figures cannot be held against the goals, or None."""
    if smoke:
        return "the CPU smoke of the GPU runner (tiny shapes), not a GPU figure"
    if spec_adapters != preset.workload.num_adapters:
        return f"{spec_adapters} adapters, not the preset's {preset.workload.num_adapters}"
    return None


def _ratio_note(baseline: dict | None, spec: WorkloadSpec) -> str:
    if baseline is None or baseline["requests"]["total"] == spec.num_requests:
        return "same workload, same run"
    return (
        f"loramux over all {spec.num_requests} requests, the baseline over the first "
        f"{baseline['requests']['total']}, both saturated; same run"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _model_facts(setup: GpuSetup) -> dict:
    from loramux.engine.model.loader import RANDOM_WEIGHT_STD

    c = setup.model_config
    shape = "Llama-7B shapes" if not setup.smoke else "tiny smoke shapes"
    return {
        "shape": f"{shape} (hidden {c.hidden_size}, {c.num_layers} layers, {c.num_heads} "
        f"heads, {c.num_kv_heads} KV heads, intermediate {c.intermediate_size}, vocab "
        f"{c.vocab_size})",
        "config": dataclasses.asdict(c),
        "load_format": "random",
        "seed": setup.seed,
        "weight_std": RANDOM_WEIGHT_STD,
        "dtype": _dtype_name(setup.dtype),
        "device": setup.device,
        "folder": str(setup.model_dir),
    }
