"""``loramux bench engine-vs-peft``: the engine's tokens/s against transformers + PEFT's
mixed-adapter ``generate``, on the same requests in the same process.

The preset's workload (``docs/benchmarks.md``): request i with adapter i % 16
(``ADAPTER_SHAPES``), chat prompts, greedy, EOS suppressed on both sides. The engine: per
run a fresh engine, warmed up on other prompts, every request through the engine driver.
The baseline: one ``PeftModel`` holding every adapter, static mixed-adapter batches of each
of ``--peft-batch-sizes``; the faster is the baseline. PEFT's greedy agreement with the
engine is reported, not asserted: left padding can flip a near-tie argmax in its batches.
``--before REV`` runs every engine, this checkout's and REV's, in a worker process
(``common/revisions.py``), the two in alternating order.

Writes ``<out>/engine_vs_peft_cpu[_quick][_<model folder>].{json,md}``; the recorded results
are ``loramux bench engine-vs-peft --repeats 2 --before 932c3a3`` and ``--profile``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import io
import pstats
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loramux.benchmarks.bench import study
from loramux.benchmarks.common import revisions
from loramux.benchmarks.common.adapters import ALL_SEVEN, QKVO, AdapterSpec, prepare_adapters
from loramux.benchmarks.common.driver_peft import (
    adapter_names,
    load_peft_model,
    serve_static_batches,
)
from loramux.benchmarks.common.drivers import run_engine
from loramux.benchmarks.common.files import (
    add_output_options,
    check_sized,
    write_atomic,
)
from loramux.benchmarks.common.machine import Clock, machine_info
from loramux.benchmarks.common.measures import percentiles
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.common.prompts import chat_prompts
from loramux.benchmarks.common.report import write
from loramux.benchmarks.common.workload import WorkloadSpec, generate
from loramux.benchmarks.engine_vs_peft import report
from loramux.benchmarks.serve.presets import PRESETS
from loramux.benchmarks.serve.report import run_duration

PRESET = PRESETS["engine-vs-peft"]
# Adapter i gets ADAPTER_SHAPES[i % 4] and seed 1000 + i.
ADAPTER_SHAPES = ((8, QKVO), (16, QKVO), (8, ALL_SEVEN), (16, ALL_SEVEN))
ADAPTER_SEED = 1000
SIZES = {
    "full": {
        "requests": PRESET.workload.num_requests,
        "adapters": PRESET.workload.num_adapters,
        "max_tokens": PRESET.workload.output_len[0],
    },
    "smoke": {"requests": 8, "adapters": 4, "max_tokens": 16},  # --quick
}


@dataclass
class Work:
    """What every run of one invocation serves."""

    spec: WorkloadSpec
    model_dir: Path
    adapters: list[AdapterSpec]
    prompts: dict[int, list[int]]  # request index -> token ids

    @property
    def requests(self):
        return generate(self.spec)

    def engine_settings(self) -> dict:
        return {**PRESET.engine, "max_num_seqs": max(64, self.spec.num_requests)}


@dataclass
class RunResult:
    label: str
    tokens: dict[int, list[int]]  # request index -> generated token ids
    clock: Clock
    seconds: float  # from the driver's start to the last request's end
    batch: str  # how the requests were batched
    extra: dict = field(default_factory=dict)  # the system's own figures

    @property
    def tokens_per_s(self) -> float:
        return sum(map(len, self.tokens.values())) / self.seconds

    def summary(self) -> dict:
        return {
            "label": self.label,
            "batch": self.batch,
            "requests": len(self.tokens),
            "tokens": sum(map(len, self.tokens.values())),
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            **self.clock.summary(),
            **self.extra,
        }


def serve_engine(work: Work, profiler: cProfile.Profile | None = None) -> RunResult:
    """One timed run of every request on a fresh engine holding the work's adapters, warmed
    up on prompts of its own (under ``profiler`` if given)."""
    from loramux.engine import Engine, EngineConfig, SamplingParams

    config = EngineConfig(
        model=str(work.model_dir), device="cpu", dtype="float32", **work.engine_settings()
    )
    engine = Engine(config)
    names = [a.name for a in work.adapters]
    token_ids: dict[int, list[int]] = {}
    try:
        for spec in work.adapters:
            engine.add_adapter(spec.name, spec.path)
        warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        engine.generate(["Hello there", "Warm up"], warm, adapters=(names * 2)[:2])
        with Clock() as clock, profiler or contextlib.nullcontext():
            records = run_engine(engine, work.requests, work.prompts, names, token_ids=token_ids)
        preemptions = engine.num_preemptions
    finally:
        engine.close()
    ttft = percentiles([r.ttft_s for r in records if r.ttft_s is not None], (50, 100))
    extra = {
        "ttft_median_s": round(ttft["p50"], 3),
        "ttft_max_s": round(ttft["p100"], 3),
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in records),
        "preemptions": preemptions,
    }
    return RunResult("engine", token_ids, clock, run_duration(records), "all at once", extra)


def run_job(job: dict) -> dict:
    """``serve_engine`` in a worker: ``job`` holds the command's arguments and threads."""
    torch.set_num_threads(job["threads"])
    run = serve_engine(prepare(study("engine-vs-peft").parse(job["argv"])))
    return {**dataclasses.asdict(run), "clock": run.clock.to_json()}


def serve_in_worker(checkout: revisions.Checkout, argv: list[str], workdir: Path) -> RunResult:
    raw = revisions.run_in_worker(
        checkout, {"argv": argv, "threads": torch.get_num_threads()}, workdir
    )
    raw["extra"]["imported_from"] = raw.pop("imported_from")["loramux.engine"]
    raw["clock"] = Clock.from_json(raw["clock"])
    raw["tokens"] = {int(i): ids for i, ids in raw["tokens"].items()}  # JSON keys are strings
    return RunResult(**{**raw, "label": f"engine ({checkout.label})"})


def profile_engine(work: Work, path: Path) -> None:
    """The engine's run once more under cProfile; its top functions into ``path``."""
    profiler = cProfile.Profile()
    run = serve_engine(work, profiler)
    text = io.StringIO()
    text.write(f"engine run under cProfile: {run.seconds:.2f} s (profiling overhead included)\n\n")
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    text.write("=== by total time (self) ===\n")
    stats.sort_stats("tottime").print_stats(30)
    text.write("=== by cumulative time ===\n")
    stats.sort_stats("cumulative").print_stats(40)
    write_atomic(path, text.getvalue())
    print(f"profile written to {path}", flush=True)


def serve_peft(model, work: Work, batch_size: int) -> RunResult:
    """One timed run of every request in static mixed-adapter batches of ``batch_size``."""
    token_ids: dict[int, list[int]] = {}
    with Clock() as clock:
        records = serve_static_batches(
            model,
            work.requests,
            work.prompts,
            batch_size=batch_size,
            device="cpu",
            names_of=adapter_names,
            token_ids=token_ids,
        )
    batches = f"{-(-len(records) // batch_size)} mixed-adapter batch(es) of {batch_size}"
    return RunResult(f"PEFT batch {batch_size}", token_ids, clock, run_duration(records), batches)


def measure(args, work: Work, checkouts=(), workdir: Path | None = None):
    """Per repeat the engine (with ``--before``, each checkout's in a worker, their order
    alternating), then PEFT at each batch size; the runs by label and by batch size."""
    paths = [a.path for a in work.adapters]
    model = load_peft_model(work.model_dir, paths, device="cpu", dtype=torch.float32)
    argv = args.argv
    engine_runs: dict[str, list[RunResult]] = {}
    peft_runs: dict[int, list[RunResult]] = {size: [] for size in args.peft_batch_sizes}
    for repeat in range(args.repeats):
        order = checkouts if repeat % 2 == 0 else checkouts[::-1]
        for run in [serve_in_worker(c, argv, workdir) for c in order] or [serve_engine(work)]:
            engine_runs.setdefault(run.label, []).append(run)
            _print_run(run, repeat)
        for size in args.peft_batch_sizes:
            peft_runs[size].append(serve_peft(model, work, size))
            _print_run(peft_runs[size][-1], repeat)
    return engine_runs, peft_runs


def _print_run(run: RunResult, repeat: int) -> None:
    s = run.summary()
    print(
        f"[{repeat}] {run.label}: {s['tokens']} tokens in {run.seconds:.2f} s = "
        f"{run.tokens_per_s:.1f} tok/s (cores used {s['cores_used']}, load "
        f"{s['loadavg_1m_before']} -> {s['loadavg_1m_after']})",
        flush=True,
    )


def add_options(parser: argparse.ArgumentParser) -> None:
    # --quick takes SIZES["smoke"] (``fill_sizes`` reads ``args.smoke``)
    parser.add_argument("--quick", dest="smoke", action="store_true", help="a small smoke run")
    for name, default in SIZES["full"].items():
        quick = SIZES["smoke"][name]
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, help=f"default {default} ({quick} with --quick)")
    parser.add_argument(
        "--peft-batch-sizes",
        help="comma-separated PEFT batch sizes; the fastest is the baseline (default: all "
        "requests in one batch, and 8)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="interleaved runs of each")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--profile", action="store_true", help="also a cProfile of the engine")
    parser.add_argument(
        "--before",
        metavar="REV",
        help="also the engine of git revision REV (from a temporary worktree), interleaved "
        "with this checkout's; both then run in worker processes",
    )
    parser.add_argument("--model", type=Path, help="HF-format model folder (default SmolLM2)")
    add_output_options(parser)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_sized(parser, args, SIZES, ("requests", "adapters", "max_tokens"))
    if args.peft_batch_sizes is None:
        args.peft_batch_sizes = [args.requests] + ([8] if args.requests > 8 else [])
    else:
        try:
            args.peft_batch_sizes = [int(s) for s in args.peft_batch_sizes.split(",")]
        except ValueError:
            parser.error("--peft-batch-sizes needs comma-separated integers")
    if min(args.peft_batch_sizes) < 1 or args.repeats < 1 or (args.threads or 1) < 1:
        parser.error("--peft-batch-sizes, --repeats and --threads must be positive")
    try:
        if args.before is not None:
            revisions.resolve_commit(args.before)
    except RuntimeError as exc:
        parser.error(str(exc))


def prepare(args) -> Work:
    from transformers import AutoTokenizer

    model_dir = args.model or prepare_model(args.cache_dir)
    tokens = (args.max_tokens, args.max_tokens)
    spec = dataclasses.replace(
        PRESET.workload, num_requests=args.requests, num_adapters=args.adapters, output_len=tokens
    )
    adapters = prepare_adapters(
        args.cache_dir, model_dir, ADAPTER_SHAPES, spec.num_adapters, seed=ADAPTER_SEED
    )
    prompts = chat_prompts(AutoTokenizer.from_pretrained(model_dir), spec.num_requests)
    return Work(spec, model_dir, adapters, dict(enumerate(prompts)))


def run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.before is None:
        return _run(args)
    with revisions.before_and_after(args.before) as (after, before, workdir):
        changes = " with uncommitted changes in engine/ or kernels/" if after.modified else ""
        print(f"before: {args.before} = {before.sha}; after: {after.sha}{changes}", flush=True)
        return _run(args, (after, before), workdir)


def _run(args, checkouts: tuple = (), workdir: Path | None = None) -> int:
    """Prepare, measure, write the report; ``checkouts`` (after, before) with ``--before``."""
    machine = machine_info()
    print(f"machine: {machine}", flush=True)
    work = prepare(args)
    lengths = [len(p) for p in work.prompts.values()]
    print(f"{work.spec}; prompts of {min(lengths)} to {max(lengths)} tokens", flush=True)
    engine_runs, peft_runs = measure(args, work, checkouts, workdir)
    results = report.build(args, work, machine, engine_runs, peft_runs, checkouts)
    name = "engine_vs_peft_cpu" + ("_quick" if args.smoke else "")
    if args.model is not None:  # another model's results beside the preset's, not over them
        name += "_" + re.sub(r"[^a-z0-9]+", "-", args.model.name.lower()).strip("-")
    stem = args.out / name
    if args.profile:
        profile = stem.with_name(stem.name + "_engine_profile.txt")
        profile_engine(work, profile)
        results["engine_profile"] = profile.name
    write(stem, results, report.markdown(results))
    return 0
