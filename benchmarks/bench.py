"""``loramux bench PRESET``: one workload served by loramux and by transformers + PEFT.

Both systems get the same requests (same arrivals, adapters, prompt token ids and output
lengths, greedy, EOS suppressed so every request generates exactly its output length) in
the same process, one after the other:

* **loramux**: with ``--driver engine`` (the default) the engine in-process
  (``drivers.run_engine``), every adapter registered from its folder and loaded by the
  engine's tiers on demand; with ``--driver http`` the whole platform in-process
  (``bench_server``: the embedded default, SQLite in a temporary data dir, uvicorn on a
  free port), the workload's tenants created with their priority and weight, each tenant
  uploading its own copy of every adapter it uses as ``a{k}``, and the requests streamed
  over the OpenAI API (``drivers.run_http``); the report's ``loramux.driver`` says which;
* **baseline**: transformers + PEFT with static batches and PEFT's mixed-adapter batching
  (``drivers.run_peft_baseline``).

Each run writes ``<out>/bench_<preset>.json`` (workload spec and seed, machine, versions,
every figure of both systems) and PNG plots (latency CDFs, per-tenant token share), and
prints a markdown summary with the loramux / baseline ratios.

``--sweep adapters`` / ``--sweep load`` (``bench_sweeps``) also run the preset's workload,
loramux only, on the engine driver, at several numbers of adapters / offered loads, and add
``sweeps`` to the JSON, a plot per sweep and a table per sweep to the markdown.

Presets (``PRESETS``): ``cpu-smoke`` runs on this 2-core CPU in a few minutes; the
``slora-*`` and ``punica-distinct`` presets need a CUDA GPU (Llama-7B shapes with random
bf16 weights) and say so when there is none: their figures are not measured yet.

    python benchmarks/bench.py cpu-smoke [--out DIR] [--requests N] [--driver http]
        [--sweep adapters|load [--sweep-values 1,4,16]]
    loramux bench cpu-smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:  # siblings import as top-level modules
    sys.path.insert(0, str(BENCH_DIR))

import bench_sweeps  # noqa: E402
from adapter_churn import write_adapter  # noqa: E402
from drivers import run_engine, run_http, run_peft_baseline  # noqa: E402
from engine_vs_peft import machine_info, prepare_model, write_atomic  # noqa: E402
from measures import memory_high_water, summarize  # noqa: E402
from workload import (  # noqa: E402
    TenantSpec,
    WorkloadSpec,
    adapter_ranks,
    generate,
    prompt_token_ids,
)

RESULTS_DIR = BENCH_DIR / "results"
CACHE_DIR = BENCH_DIR.parent / ".loramux" / "bench-cache"


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    workload: WorkloadSpec
    device: str = "cpu"  # "cpu" or "cuda"
    baseline_batch: int = 8  # PEFT's static batch size
    slo_ttft_s: float | None = None
    slo_itl_s: float | None = None
    engine: dict = field(default_factory=dict)  # EngineConfig overrides


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            name="cpu-smoke",
            description="SmolLM2-135M on this CPU: 48 requests, Poisson arrivals at 2/s, "
            "8 adapters (Zipf 1.0, ranks 8 and 16), two tenants of weights 2 and 1",
            workload=WorkloadSpec(
                num_requests=48,
                rate=2.0,
                cv=1.0,
                num_adapters=8,
                popularity="zipf",
                popularity_param=1.0,
                ranks=(8, 16),
                input_len=(16, 96),
                output_len=(8, 32),
                base_fraction=0.125,
                tenants=(
                    TenantSpec("gold", priority=5, weight=2.0, share=1.0),
                    TenantSpec("silver", priority=5, weight=1.0, share=1.0),
                ),
                seed=0,
            ),
            baseline_batch=8,
            slo_ttft_s=2.0,
            slo_itl_s=0.5,
            engine={"kv_cache_bytes": 256 << 20, "max_num_seqs": 32},
        ),
        Preset(
            name="slora-s1",
            description="S-LoRA S1 on Llama-7B shapes (random bf16 weights): saturating "
            "arrivals, lengths uniform in [8, 512], rank 8, 1,000 adapters (power 0.3)",
            workload=WorkloadSpec(
                num_requests=2000,
                rate=20.0,
                num_adapters=1000,
                popularity="power",
                popularity_param=0.3,
                ranks=(8,),
                input_len=(8, 512),
                output_len=(8, 512),
            ),
            device="cuda",
            baseline_batch=32,
            slo_ttft_s=6.0,
        ),
        Preset(
            name="slora-s2",
            description="S-LoRA S2 on Llama-7B shapes (random bf16 weights): ranks "
            "{64, 32, 16, 8}, 1,000 adapters; S-LoRA reports 6.69 req/s on an A100-80GB",
            workload=WorkloadSpec(
                num_requests=2000,
                rate=20.0,
                num_adapters=1000,
                popularity="power",
                popularity_param=0.3,
                ranks=(64, 32, 16, 8),
                input_len=(8, 512),
                output_len=(8, 512),
            ),
            device="cuda",
            baseline_batch=32,
            slo_ttft_s=6.0,
        ),
        Preset(
            name="punica-distinct",
            description="Punica's distinct case: batch 32, every request its own rank-16 "
            "adapter, tokens/s; Punica reports 1,053 tok/s on Llama2-7B",
            workload=WorkloadSpec(
                num_requests=32,
                rate=1e6,
                num_adapters=32,
                popularity="uniform",
                ranks=(16,),
                input_len=(128, 128),
                output_len=(128, 128),
            ),
            device="cuda",
            baseline_batch=32,
        ),
    )
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="loramux bench",
        description="Serve one preset workload with loramux and with transformers + PEFT, "
        "in the same run, and report both.",
    )
    parser.add_argument("preset", choices=sorted(PRESETS), help="the workload to run")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--requests", type=int, help="override the preset's request count")
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="models, adapters")
    parser.add_argument("--no-baseline", action="store_true", help="loramux only")
    parser.add_argument(
        "--driver",
        choices=("engine", "http"),
        default="engine",
        help="serve loramux's run on the engine in-process, or on the platform in-process "
        "over its OpenAI HTTP API (default: engine)",
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
    return parser.parse_args(argv)


def _values(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"sweep values must be > 0, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    if args.requests is not None:
        preset = dataclasses.replace(
            preset, workload=dataclasses.replace(preset.workload, num_requests=args.requests)
        )
    if preset.device == "cuda" and not torch.cuda.is_available():
        print(
            f"preset {preset.name!r} needs a CUDA GPU (the recorded figures are for an H100); "
            "none here, so its figures are not measured yet.",
            file=sys.stderr,
        )
        return 2
    if preset.device == "cuda":
        print(f"preset {preset.name!r}: the GPU runner is not written yet", file=sys.stderr)
        return 2
    report = run_cpu_preset(preset, args)
    if args.sweep:
        report["sweeps"] = run_sweeps(preset, args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"bench_{preset.name}"
    write_atomic(stem.with_suffix(".json"), json.dumps(report, indent=2) + "\n")
    plots = write_plots(report, stem)
    plots += bench_sweeps.write_plots(report.get("sweeps") or {}, report["preset"], stem)
    markdown = render_markdown(report, plots)
    write_atomic(stem.with_suffix(".md"), markdown)
    print(markdown)
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
        requests = generate(spec)
        avoid = frozenset(self.model_config.eos_token_ids)
        prompts = {
            r.index: prompt_token_ids(
                r, vocab_size=self.model_config.vocab_size, seed=spec.seed, avoid=avoid
            )
            for r in requests
        }
        return requests, prompts


def prepare(cache_dir: Path) -> Prepared:
    from loramux.engine.model.config import ModelConfig

    model_dir = prepare_model(cache_dir)
    return Prepared(model_dir, ModelConfig.from_pretrained(model_dir), cache_dir)


def serve_engine(preset: Preset, spec: WorkloadSpec, prepared: Prepared) -> dict:
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
        started = time.perf_counter()
        records = run_engine(engine, requests, prompts, names, tenants=tenants)
        duration = time.perf_counter() - started
    finally:
        engine.close()
    return _figures(records, duration, preset, _weights(spec))


def serve_http(preset: Preset, spec: WorkloadSpec, prepared: Prepared) -> dict:
    """loramux's figures for ``spec`` on the platform in-process, over its OpenAI API."""
    from bench_server import serve_platform, setup_workload

    adapter_dirs = prepared.adapter_dirs(spec)
    requests, prompts = prepared.workload(spec)
    with serve_platform(prepared.model_dir, **preset.engine) as platform:
        keys = setup_workload(platform, spec, requests, adapter_dirs)
        started = time.perf_counter()
        records = run_http(
            platform.url,
            keys,
            requests,
            prompts,
            [f"a{k}" for k in range(spec.num_adapters)],
            base_model=platform.base_model,
        )
        duration = time.perf_counter() - started
    return _figures(records, duration, preset, _weights(spec))


def _weights(spec: WorkloadSpec) -> dict[str, float]:
    return {t.name: t.weight for t in spec.tenants}


def run_cpu_preset(preset: Preset, args: argparse.Namespace) -> dict:
    spec = preset.workload
    prepared = prepare(args.cache_dir)
    driver = getattr(args, "driver", "engine")
    print(f"loramux ({driver} driver): {spec.num_requests} requests ...", flush=True)
    serve = serve_http if driver == "http" else serve_engine
    loramux = {"driver": driver, **serve(preset, spec, prepared)}

    baseline = None
    if not args.no_baseline:
        adapter_dirs = prepared.adapter_dirs(spec)
        requests, prompts = prepared.workload(spec)
        print(f"transformers + PEFT: {len(requests)} requests ...", flush=True)
        started = time.perf_counter()
        records = run_peft_baseline(
            prepared.model_dir, adapter_dirs, requests, prompts, batch_size=preset.baseline_batch
        )
        baseline = _figures(records, time.perf_counter() - started, preset, _weights(spec))
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
        "ratios": _ratios(loramux, baseline),
        "gpu_figures": "not measured yet",
    }


def run_sweeps(preset: Preset, args: argparse.Namespace) -> dict:
    """Each ``--sweep`` over its points, loramux only on the engine driver."""
    prepared = prepare(args.cache_dir)

    def run_once(spec: WorkloadSpec) -> dict:
        return serve_engine(preset, spec, prepared)

    return {
        kind: bench_sweeps.run_sweep(kind, preset.workload, run_once, args.sweep_values)
        for kind in dict.fromkeys(args.sweep)
    }


def _adapters(cache_dir: Path, model_dir: Path, model_config, spec: WorkloadSpec) -> list[Path]:
    folder = cache_dir / "bench-adapters" / model_dir.name
    paths = []
    for k, rank in enumerate(adapter_ranks(spec)):
        path = folder / f"a{k}-r{rank}-seed{spec.seed}"
        if not (path / "adapter_model.safetensors").is_file():
            write_adapter(path, model_dir, model_config, rank, seed=spec.seed * 100_003 + k)
        paths.append(path)
    return paths


def _figures(records, duration_s: float, preset: Preset, weights: dict[str, float]) -> dict:
    summary = summarize(
        records,
        duration_s=duration_s,
        slo_ttft_s=preset.slo_ttft_s,
        slo_itl_s=preset.slo_itl_s,
        tenant_weights=weights,
    )
    served = [r for r in records if r.ok]
    summary["samples"] = {
        "ttft_s": [r.ttft_s for r in served if r.ttft_s is not None],
        "itl_s": [gap for r in served for gap in r.itls_s],
        "e2e_s": [r.e2e_s for r in served if r.e2e_s is not None],
    }
    return summary


def _ratios(loramux: dict, baseline: dict | None) -> dict:
    if baseline is None:
        return {}

    def ratio(key: str) -> float | None:
        a, b = loramux.get(key), baseline.get(key)
        return None if not a or not b else a / b

    return {
        "output_tokens_per_s": ratio("output_tokens_per_s"),
        "requests_per_s": ratio("requests_per_s"),
    }


# --- reporting --------------------------------------------------------------------------------


def write_plots(report: dict, stem: Path) -> list[Path]:
    """Latency CDFs of both systems, and each tenant's token share against its weight."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = {"loramux": report["loramux"], "transformers + PEFT": report["baseline"]}
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, title) in zip(
        axes,
        (
            ("ttft_s", "time to first token"),
            ("itl_s", "inter-token latency"),
            ("e2e_s", "end to end"),
        ),
        strict=True,
    ):
        for label, figures in systems.items():
            if not figures:
                continue
            values = sorted(figures["samples"][key])
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=label)
        ax.set_title(title)
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of requests" if key != "itl_s" else "fraction of gaps")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{report['preset']}: latency CDFs")
    fig.tight_layout()
    path = stem.with_name(stem.name + "_latency_cdf.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)

    shares = report["loramux"].get("tenants") or {}
    if shares:
        fig, ax = plt.subplots(figsize=(6, 4))
        names = sorted(shares)
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [shares[n]["share"] for n in names], 0.4, label="tokens")
        ax.bar(
            [x + 0.2 for x in xs], [shares[n]["weight_share"] for n in names], 0.4, label="weight"
        )
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("share")
        ax.set_title(f"{report['preset']}: loramux token share per tenant")
        ax.legend()
        fig.tight_layout()
        path = stem.with_name(stem.name + "_tenant_share.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _ms(value) -> str:
    return "—" if value is None else f"{value * 1000:.0f}"


def render_markdown(report: dict, plots: list[Path]) -> str:
    rows = [
        "| system | req/s | output tok/s | TTFT P50 / P99 ms | ITL P50 / P99 ms "
        "| E2E P50 / P99 ms | SLO attainment | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, figures in (
        (f"loramux ({report['loramux'].get('driver', 'engine')})", report["loramux"]),
        ("transformers + PEFT", report["baseline"]),
    ):
        if not figures:
            continue
        ttft, itl, e2e = figures["ttft_s"], figures["itl_s"], figures["e2e_s"]
        slo = figures.get("slo_attainment")
        rows.append(
            f"| {label} | {figures['requests_per_s']:.2f} | {figures['output_tokens_per_s']:.1f} "
            f"| {_ms(ttft['p50'])} / {_ms(ttft['p99'])} | {_ms(itl['p50'])} / {_ms(itl['p99'])} "
            f"| {_ms(e2e['p50'])} / {_ms(e2e['p99'])} "
            f"| {'—' if slo is None else f'{slo:.0%}'} | {figures['requests']['failed']} |"
        )
    ratios = report["ratios"]
    lines = [
        f"# loramux bench {report['preset']}",
        "",
        report["description"] + ".",
        "",
        *rows,
        "",
    ]
    if ratios.get("output_tokens_per_s") is not None:
        lines.append(
            f"**loramux / transformers + PEFT: {ratios['output_tokens_per_s']:.2f}x output "
            f"tokens/s, {ratios['requests_per_s']:.2f}x requests/s** (same workload, same run)."
        )
    tenants = report["loramux"].get("tenants") or {}
    if tenants:
        shares = ", ".join(
            f"{name} {t['share']:.0%} of tokens (weight {t['weight_share']:.0%})"
            for name, t in sorted(tenants.items())
        )
        lines += ["", f"Per-tenant share on loramux: {shares}."]
    machine = report["machine"]
    lines += [
        "",
        f"Machine: {machine.get('cpu_model')}, {machine.get('nproc')} cores; torch "
        f"{machine.get('torch')}, transformers {machine.get('transformers')}, peft "
        f"{machine.get('peft')}; {machine.get('date')}. GPU figures: not measured yet.",
        "",
        "Plots: " + ", ".join(p.name for p in plots),
    ]
    for kind, sweep in (report.get("sweeps") or {}).items():
        lines += ["", *bench_sweeps.render_markdown(kind, sweep)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
