"""The ``serve`` study: loramux and transformers + PEFT serve one preset's workload.

``loramux bench cpu-smoke`` on this CPU, ``slora-s1``, ``slora-s2`` and
``punica-distinct`` on a CUDA GPU (``gpu.py``). Both systems get the same requests
(arrivals, adapters, prompt token ids, output lengths; greedy, EOS suppressed) in one
process: loramux on the engine in-process (``--driver engine``, adapters loaded by its tiers
on demand) or on the whole platform in-process over its OpenAI API (``--driver http``,
each tenant uploading its own copy of the adapters it uses); the baseline as static
mixed-adapter batches. It writes ``<out>/bench_<preset>[-smoke].{json,md}`` and plots;
``--sweep`` (``sweeps.py``) adds loramux-only runs at several adapter counts or loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from loramux.benchmarks.common.adapters import QKVO, cached_adapter
from loramux.benchmarks.common.drivers import run_engine, run_http, run_peft_baseline
from loramux.benchmarks.common.files import add_output_options
from loramux.benchmarks.common.machine import machine_info
from loramux.benchmarks.common.measures import memory_high_water
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.common.report import write
from loramux.benchmarks.common.workload import WorkloadSpec, adapter_ranks, requests_with_prompts
from loramux.benchmarks.serve import gpu, sweeps
from loramux.benchmarks.serve.presets import PRESETS, Preset
from loramux.benchmarks.serve.report import figures, markdown, ratios, write_plots


def add_options(parser: argparse.ArgumentParser) -> None:
    """The options of the preset the study set as the parser's ``preset`` default."""
    preset = PRESETS[parser.get_default("preset")]
    parser.add_argument("--requests", type=int, help="override the preset's request count")
    add_output_options(parser)
    parser.add_argument("--no-baseline", action="store_true", help="loramux only")
    if preset.device == "cuda":
        parser.set_defaults(driver="engine")
        parser.add_argument(
            "--smoke",
            action="store_true",
            help="the GPU runner on the CPU at tiny shapes (a plumbing check; its figures "
            "are not GPU figures)",
        )
        parser.add_argument(
            "--baseline-requests",
            type=int,
            help="how many of the first requests the PEFT baseline serves",
        )
        parser.add_argument(
            "--prepare-only",
            action="store_true",
            help="write the weightless model folder into the cache and exit",
        )
    else:
        parser.set_defaults(smoke=False)
        parser.add_argument(
            "--driver",
            choices=("engine", "http"),
            default="engine",
            help="serve loramux's run on the engine in-process, or on the platform "
            "in-process over its OpenAI HTTP API (default: engine)",
        )
    parser.add_argument(
        "--sweep",
        action="append",
        choices=sorted(sweeps.SWEEPS),
        default=[],
        help="also run loramux (engine driver) over several numbers of adapters "
        "(`adapters`) or offered loads (`load`); repeatable",
    )
    parser.add_argument(
        "--sweep-values",
        type=_values,
        help="comma-separated sweep points: adapter counts for `adapters` (default "
        f"{','.join(map(str, sweeps.SWEEPS['adapters']))}), rate multipliers of the "
        f"preset's rate for `load` (default {','.join(map(str, sweeps.SWEEPS['load']))})",
    )


def _values(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"sweep values must be > 0, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    preset = PRESETS[args.preset]
    if args.requests is not None:
        preset = dataclasses.replace(
            preset, workload=dataclasses.replace(preset.workload, num_requests=args.requests)
        )
    on_gpu = preset.device == "cuda"
    if on_gpu and args.prepare_only:
        print(gpu.model_folder(args.cache_dir, smoke=args.smoke))
        return 0
    if on_gpu and not args.smoke and not torch.cuda.is_available():
        print(
            f"preset {preset.name!r} needs a CUDA GPU (the recorded figures are for an H100); "
            "none here, so its figures are not measured yet. `--smoke` runs its runner on "
            "the CPU at tiny shapes.",
            file=sys.stderr,
        )
        return 2
    if on_gpu:
        setup = gpu.make_setup(
            preset, args.cache_dir, smoke=args.smoke, baseline_requests=args.baseline_requests
        )
        report = gpu.run_gpu_preset(setup, args)
        sweep_spec, run_once = setup.preset.workload, partial(gpu.serve_loramux, setup)
    else:
        prepared = prepare(args.cache_dir)
        report = run_cpu_preset(preset, prepared, args)
        sweep_spec, run_once = preset.workload, partial(serve_engine, preset, prepared=prepared)
    if args.sweep:
        report["sweeps"] = {
            kind: sweeps.run_sweep(kind, sweep_spec, run_once, args.sweep_values)
            for kind in dict.fromkeys(args.sweep)
        }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"bench_{preset.name}{'-smoke' if args.smoke else ''}"
    plots = write_plots(report, stem)
    plots += sweeps.write_plots(report.get("sweeps") or {}, report["preset"], stem)
    write(stem, report, markdown(report, plots))
    return 0


@dataclass
class Prepared:
    """What a preset's runs share: the model, its adapters' folders, and the tokenizer ids."""

    model_dir: Path
    model_config: object  # loramux.engine.model.config.ModelConfig
    cache_dir: Path

    def adapter_dirs(self, spec: WorkloadSpec) -> list[Path]:
        return _adapters(self.cache_dir, self.model_dir, self.model_config, spec)

    def workload(self, spec: WorkloadSpec) -> tuple[list, dict[int, list[int]]]:
        """The requests of ``spec`` and their prompt token ids (EOS avoided)."""
        avoid = frozenset(self.model_config.eos_token_ids)
        return requests_with_prompts(spec, vocab_size=self.model_config.vocab_size, avoid=avoid)


def prepare(cache_dir: Path) -> Prepared:
    from loramux.engine.model.config import ModelConfig

    model_dir = prepare_model(cache_dir)
    return Prepared(model_dir, ModelConfig.from_pretrained(model_dir), cache_dir)


def serve_engine(preset: Preset, spec: WorkloadSpec, *, prepared: Prepared) -> dict:
    """loramux's figures for ``spec`` on a fresh in-process engine."""
    from loramux.engine import Engine, EngineConfig
    from loramux.engine.lora.source import LocalDirectorySource

    adapter_dirs = prepared.adapter_dirs(spec)
    requests, prompts = prepared.workload(spec)
    names = [f"a{k}" for k in range(spec.num_adapters)]
    tenants = {t.name: (t.priority, t.weight) for t in spec.tenants}
    engine = Engine(EngineConfig(model=str(prepared.model_dir), device="cpu", **preset.engine))
    try:
        for name, path in zip(names, adapter_dirs, strict=True):
            engine.register_adapter(name, LocalDirectorySource(path))
        records = run_engine(engine, requests, prompts, names, tenants=tenants)
    finally:
        engine.close()
    return figures(records, preset, spec)


def serve_http(preset: Preset, spec: WorkloadSpec, *, prepared: Prepared) -> dict:
    """loramux's figures for ``spec`` on the platform in-process, over its OpenAI API."""
    from loramux.benchmarks.common.bench_server import serve_platform, setup_workload

    adapter_dirs = prepared.adapter_dirs(spec)
    requests, prompts = prepared.workload(spec)
    with serve_platform(prepared.model_dir, **preset.engine) as platform:
        keys = setup_workload(platform, spec, requests, adapter_dirs)
        records = run_http(
            platform.url,
            keys,
            requests,
            prompts,
            [f"a{k}" for k in range(spec.num_adapters)],
            base_model=platform.base_model,
        )
    return figures(records, preset, spec)


def run_cpu_preset(preset: Preset, prepared: Prepared, args: argparse.Namespace) -> dict:
    spec = preset.workload
    driver = getattr(args, "driver", "engine")
    print(f"loramux ({driver} driver): {spec.num_requests} requests ...", flush=True)
    serve = serve_http if driver == "http" else serve_engine
    loramux = {"driver": driver, **serve(preset, spec, prepared=prepared)}

    baseline = None
    if not args.no_baseline:
        adapter_dirs = prepared.adapter_dirs(spec)
        requests, prompts = prepared.workload(spec)
        print(f"transformers + PEFT: {len(requests)} requests ...", flush=True)
        records = run_peft_baseline(
            prepared.model_dir, adapter_dirs, requests, prompts, batch_size=preset.baseline_batch
        )
        baseline = figures(records, preset, spec)
    return {
        "preset": preset.name,
        "description": preset.description,
        "workload": spec.to_json(),
        "adapter_ranks": adapter_ranks(spec),
        "machine": machine_info(),
        "memory_high_water": memory_high_water(),
        "slo": {"ttft_s": preset.slo_ttft_s, "itl_s": preset.slo_itl_s},
        "loramux": loramux,
        "baseline": baseline,
        "ratios": ratios(loramux, baseline),
        "gpu_figures": "not measured yet",
    }


def _adapters(cache_dir: Path, model_dir: Path, model_config, spec: WorkloadSpec) -> list[Path]:
    """Workload adapter k: its rank on q/k/v/o, bf16 on disk, seed ``seed * 100003 + k``."""
    return [
        cached_adapter(
            cache_dir,
            model_dir,
            model_config,
            rank,
            QKVO,
            seed=spec.seed * 100_003 + k,
            dtype=torch.bfloat16,
        )
        for k, rank in enumerate(adapter_ranks(spec))
    ]
