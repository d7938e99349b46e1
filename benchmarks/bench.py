"""``loramux bench PRESET``: the command, and the runner of the CPU workload presets.

``bench_presets`` defines the presets and what each is judged by. The GPU presets run in
``bench_gpu``, ``lora-overhead`` in ``lora_overhead``; ``engine-vs-peft``,
``adapter-churn``, ``fairness-slo``, ``soak`` and ``speculative`` take options of their own
(``loramux bench NAME -h``). This module runs the others (``cpu-smoke``): loramux and
transformers + PEFT serve the same requests (arrivals, adapters, prompt token ids, output
lengths; greedy, EOS suppressed) in one process:

* **loramux**, ``--driver engine`` (default): the engine in-process, every adapter loaded
  by its tiers on demand; ``--driver http``: the whole platform in-process
  (``bench_server``), each tenant uploading its own copy of the adapters it uses and
  streaming over the OpenAI API; the report's ``loramux.driver`` says which;
* **baseline**: transformers + PEFT, static mixed-adapter batches.

It writes ``<out>/bench_<preset>.{json,md}`` and plots (``bench_report``); ``--sweep``
(``bench_sweeps``) adds loramux-only runs at several adapter counts or loads.

    loramux bench cpu-smoke [--requests N] [--driver http] [--sweep adapters|load]
    loramux bench slora-s2 [--no-baseline] [--smoke] [--prepare-only]
    loramux bench lora-overhead [--repeats N] [--smoke]
    python -m loramux.benchmarks.bench PRESET ...     # the same
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from loramux.benchmarks import (
    adapter_churn,
    bench_gpu,
    bench_sweeps,
    engine_vs_peft,
    fairness_slo,
    lora_overhead,
    prefill_cpu,
    prefill_flood,
    quant_quality,
    quantized_serve,
    simulate_cli,
    soak,
    speculative,
)
from loramux.benchmarks.bench_gpu_report import markdown_lines
from loramux.benchmarks.bench_presets import PRESETS, Baseline, Preset
from loramux.benchmarks.bench_report import figures, ratios, render_markdown, write_plots
from loramux.benchmarks.common.adapters import QKVO, cached_adapter
from loramux.benchmarks.common.drivers import run_engine, run_http, run_peft_baseline
from loramux.benchmarks.common.files import add_output_options, check_output_options, write_report
from loramux.benchmarks.common.machine import machine_info
from loramux.benchmarks.common.measures import memory_high_water
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.common.workload import WorkloadSpec, adapter_ranks, requests_with_prompts

# Runs with options of their own: ``loramux bench NAME [their options]``.
OWN_OPTIONS = {
    "engine-vs-peft": engine_vs_peft.main,
    "adapter-churn": adapter_churn.main,
    "fairness-slo": fairness_slo.main,
    "prefill-flood": prefill_flood.main,
    "prefill-cpu": prefill_cpu.main,
    "soak": soak.main,
    "speculative": speculative.main,
    "quantized-serve": quantized_serve.main,
    "quant-quality": quant_quality.main,
    "simulate": simulate_cli.main,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="loramux bench",
        description="Serve one preset workload with loramux and with transformers + PEFT, "
        "in the same run, and report both (lora-overhead: one loramux engine with 16 "
        "adapters against itself with none).",
        epilog=f"{', '.join(OWN_OPTIONS)} take options of their own: `loramux bench NAME -h`.",
    )
    presets = sorted(set(PRESETS) - set(OWN_OPTIONS))
    parser.add_argument("preset", choices=presets, help="the workload to run")
    parser.add_argument("--requests", type=int, help="override the preset's request count")
    add_output_options(parser)
    parser.add_argument("--no-baseline", action="store_true", help="loramux only")
    parser.add_argument(
        "--driver",
        choices=("engine", "http"),
        default="engine",
        help="serve loramux's run on the engine in-process, or on the platform in-process "
        "over its OpenAI HTTP API (default: engine; the GPU presets use the engine)",
    )
    parser.add_argument(
        "--sweep",
        action="append",
        choices=sorted(bench_sweeps.SWEEPS),
        default=[],
        help="also run loramux (engine driver) over several numbers of adapters "
        "(`adapters`) or offered loads (`load`); repeatable",
    )
    parser.add_argument(
        "--sweep-values",
        type=_values,
        help="comma-separated sweep points: adapter counts for `adapters` (default "
        f"{','.join(map(str, bench_sweeps.SWEEPS['adapters']))}), rate multipliers of the "
        f"preset's rate for `load` (default {','.join(map(str, bench_sweeps.SWEEPS['load']))})",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a GPU preset's runner on the CPU at tiny shapes (a plumbing check; its "
        "figures are not GPU figures); lora-overhead at 4 requests, 4 adapters, 8 tokens, "
        "1 repeat",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        help="lora-overhead: interleaved (base, lora) pairs of runs (default "
        f"{lora_overhead.DEFAULT_REPEATS}, 1 with --smoke)",
    )
    parser.add_argument(
        "--baseline-requests",
        type=int,
        help="GPU presets: how many of the first requests the PEFT baseline serves",
    )
    parser.add_argument(
        "--prepare-only",
        action="store_true",
        help="GPU presets: write the weightless model folder into the cache and exit",
    )
    args = parser.parse_args(argv)
    check_output_options(parser, args)
    preset = PRESETS[args.preset]
    gpu_preset = preset.device == "cuda"
    if preset.baseline is Baseline.BASE_MODEL:
        if args.no_baseline or args.driver != "engine" or args.sweep:
            parser.error(
                f"{preset.name} runs the engine against itself: no --no-baseline, "
                "--driver or --sweep"
            )
        if args.prepare_only or args.baseline_requests:
            parser.error("--prepare-only and --baseline-requests are for the GPU presets")
        if args.repeats is not None and args.repeats < 1:
            parser.error("--repeats must be positive")
        return args
    if args.repeats is not None:
        parser.error("--repeats is for lora-overhead")
    if not gpu_preset and (args.smoke or args.prepare_only or args.baseline_requests):
        parser.error("--smoke, --prepare-only and --baseline-requests are for the GPU presets")
    if gpu_preset and args.driver != "engine":
        parser.error("the GPU presets run on the engine driver")
    return args


def _values(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"sweep values must be > 0, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in OWN_OPTIONS:
        return OWN_OPTIONS[argv[0]](argv[1:])
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    if preset.baseline is Baseline.BASE_MODEL:  # the engine against itself: its own runner
        return lora_overhead.main(preset, args, command=" ".join(["loramux bench", *argv]))
    if args.requests is not None:
        preset = dataclasses.replace(
            preset, workload=dataclasses.replace(preset.workload, num_requests=args.requests)
        )
    gpu_runner = preset.device == "cuda"
    if gpu_runner and args.prepare_only:
        print(bench_gpu.model_folder(args.cache_dir, smoke=args.smoke))
        return 0
    if gpu_runner and not args.smoke and not torch.cuda.is_available():
        print(
            f"preset {preset.name!r} needs a CUDA GPU (the recorded figures are for an H100); "
            "none here, so its figures are not measured yet. `--smoke` runs its runner on "
            "the CPU at tiny shapes.",
            file=sys.stderr,
        )
        return 2
    if gpu_runner:
        setup = bench_gpu.make_setup(
            preset, args.cache_dir, smoke=args.smoke, baseline_requests=args.baseline_requests
        )
        report = bench_gpu.run_gpu_preset(setup, args)
        sweep_spec, run_once = setup.preset.workload, partial(bench_gpu.serve_loramux, setup)
        extra = markdown_lines(report)
    else:
        prepared = prepare(args.cache_dir)
        report = run_cpu_preset(preset, prepared, args)
        sweep_spec, run_once = preset.workload, partial(serve_engine, preset, prepared=prepared)
        extra = []
    if args.sweep:
        report["sweeps"] = {
            kind: bench_sweeps.run_sweep(kind, sweep_spec, run_once, args.sweep_values)
            for kind in dict.fromkeys(args.sweep)
        }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"bench_{preset.name}{'-smoke' if args.smoke else ''}"
    plots = write_plots(report, stem)
    plots += bench_sweeps.write_plots(report.get("sweeps") or {}, report["preset"], stem)
    write_report(stem, report, render_markdown(report, plots, extra))
    return 0


# --- running ----------------------------------------------------------------------------------


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


if __name__ == "__main__":
    sys.exit(main())
