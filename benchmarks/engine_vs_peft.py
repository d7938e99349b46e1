"""``loramux bench engine-vs-peft``: the engine's tokens/s against transformers + PEFT's
mixed-adapter ``generate``, on the same requests in the same process.

The preset's workload: SmolLM2-135M-Instruct (``--model``: another folder) in float32 on
the CPU, 32 requests at once, request i with adapter i % 16 (``ADAPTER_SHAPES``: ranks 8
and 16, q/k/v/o or all seven modules), chat prompts, 128 new tokens each, greedy, EOS
suppressed on both sides. The engine: per run a fresh engine, warmed up on other prompts,
serving every request through the engine driver. The baseline: one ``PeftModel`` holding
every adapter, static mixed-adapter batches of all the requests and of 8
(``--peft-batch-sizes``); the faster is the baseline.

Per run: tokens, seconds to the last request's end, tokens/s, cores used and load average
(``machine.Clock``); for the engine TTFT median and max, cached prompt tokens and
preemptions. ``--repeats N`` interleaves N runs of each and reports the best of each. The
report: engine / baseline against the goal (at least 5x), and each PEFT run's greedy
agreement with the engine (left padding can flip a near-tie argmax in PEFT's batches, so
it is reported, not asserted). ``--before REV`` also measures revision REV's engine
(``revisions``: every engine run a worker process, the two in alternating order) and adds
the after / before ratio; ``--profile`` writes a cProfile of one more engine run;
``--quick``: 8 requests, 4 adapters, 16 tokens.

Writes ``<out>/engine_vs_peft_cpu[_quick][_<model folder>].{json,md}``; the recorded results are
``loramux bench engine-vs-peft --repeats 2 --before 932c3a3`` and ``--profile``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import io
import pstats
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loramux.benchmarks import revisions
from loramux.benchmarks.bench_presets import PRESETS
from loramux.benchmarks.bench_report import run_duration
from loramux.benchmarks.common.adapters import (
    ADAPTER_STD,
    ALL_SEVEN,
    QKVO,
    AdapterSpec,
    prepare_adapters,
)
from loramux.benchmarks.common.driver_peft import (
    adapter_names,
    load_peft_model,
    serve_static_batches,
)
from loramux.benchmarks.common.drivers import run_engine
from loramux.benchmarks.common.files import (
    add_output_options,
    check_output_options,
    write_atomic,
    write_report,
)
from loramux.benchmarks.common.machine import Clock, contention, machine_info
from loramux.benchmarks.common.measures import agreement, percentiles
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.common.prompts import chat_prompts
from loramux.benchmarks.common.workload import WorkloadSpec, generate
from loramux.benchmarks.engine_vs_peft_report import render_markdown

PRESET = PRESETS["engine-vs-peft"]
# Adapter i gets ADAPTER_SHAPES[i % 4] and seed 1000 + i.
ADAPTER_SHAPES = ((8, QKVO), (16, QKVO), (8, ALL_SEVEN), (16, ALL_SEVEN))
ADAPTER_SEED = 1000
QUICK = {"requests": 8, "adapters": 4, "max_tokens": 16}


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


# --- the systems ----------------------------------------------------------------------------


def _engine(work: Work):
    """A fresh engine holding the work's adapters, warmed up on prompts of its own."""
    from loramux.engine import Engine, EngineConfig, SamplingParams

    settings = work.engine_settings()
    config = EngineConfig(model=str(work.model_dir), device="cpu", dtype="float32", **settings)
    engine = Engine(config)
    names = [a.name for a in work.adapters]
    for spec in work.adapters:
        engine.add_adapter(spec.name, spec.path)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate(["Hello there", "Warm up"], warm, adapters=(names * 2)[:2])
    return engine


def serve_engine(work: Work, profiler: cProfile.Profile | None = None) -> RunResult:
    """One timed run of every request on a fresh engine (under ``profiler`` if given)."""
    engine = _engine(work)
    token_ids: dict[int, list[int]] = {}
    names = [a.name for a in work.adapters]
    try:
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
    run = serve_engine(prepare(parse_args(job["argv"])))
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
    engine_runs: dict[str, list[RunResult]] = {}
    peft_runs: dict[int, list[RunResult]] = {size: [] for size in args.peft_batch_sizes}
    for repeat in range(args.repeats):
        order = checkouts if repeat % 2 == 0 else checkouts[::-1]
        for run in [serve_in_worker(c, args.argv, workdir) for c in order] or [serve_engine(work)]:
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


# --- the command ------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="loramux bench engine-vs-peft", description=__doc__.split("\n\n")[0]
    )
    spec = PRESET.workload
    defaults = {"requests": spec.num_requests, "adapters": spec.num_adapters}
    defaults["max_tokens"] = spec.output_len[0]
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    for name, default in defaults.items():
        flag, quick = "--" + name.replace("_", "-"), QUICK[name]
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
    args = parser.parse_args(argv)
    check_output_options(parser, args)
    sizes = {
        name: getattr(args, name) or (QUICK if args.quick else defaults)[name] for name in QUICK
    }
    if min(sizes.values()) < 1:
        parser.error("--requests, --adapters and --max-tokens must be positive")
    tokens = (sizes["max_tokens"],) * 2
    args.spec = dataclasses.replace(
        spec, num_requests=sizes["requests"], num_adapters=sizes["adapters"], output_len=tokens
    )
    if args.peft_batch_sizes is None:
        args.peft_batch_sizes = [sizes["requests"]] + ([8] if sizes["requests"] > 8 else [])
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
    args.argv, args.command = argv, " ".join(["loramux bench engine-vs-peft", *argv])
    return args


def prepare(args) -> Work:
    from transformers import AutoTokenizer

    model_dir = args.model or prepare_model(args.cache_dir)
    count = args.spec.num_adapters
    adapters = prepare_adapters(args.cache_dir, model_dir, ADAPTER_SHAPES, count, seed=ADAPTER_SEED)
    prompts = chat_prompts(AutoTokenizer.from_pretrained(model_dir), args.spec.num_requests)
    return Work(args.spec, model_dir, adapters, dict(enumerate(prompts)))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.before is None:
        return run(args)
    with revisions.before_and_after(args.before) as (after, before, workdir):
        changes = " with uncommitted changes in engine/ or kernels/" if after.modified else ""
        print(f"before: {args.before} = {before.sha}; after: {after.sha}{changes}", flush=True)
        return run(args, (after, before), workdir)


def run(args, checkouts: tuple = (), workdir: Path | None = None) -> int:
    """Prepare, measure, report; ``checkouts`` (after, before) with ``--before``."""
    machine = machine_info()
    print(f"machine: {machine}", flush=True)
    work = prepare(args)
    lengths = [len(p) for p in work.prompts.values()]
    print(f"{args.spec}; prompts of {min(lengths)} to {max(lengths)} tokens", flush=True)
    engine_runs, peft_runs = measure(args, work, checkouts, workdir)
    report = build_report(args, work, machine, engine_runs, peft_runs, checkouts)
    name = "engine_vs_peft_cpu" + ("_quick" if args.quick else "")
    if args.model is not None:  # another model's results beside the preset's, not over them
        name += "_" + re.sub(r"[^a-z0-9]+", "-", args.model.name.lower()).strip("-")
    stem = args.out / name
    if args.profile:
        profile = stem.with_name(stem.name + "_engine_profile.txt")
        profile_engine(work, profile)
        report["engine_profile"] = profile.name
    write_report(stem, report, render_markdown(report))
    return 0


def _entry(runs: list[RunResult], best: RunResult | None = None, **extra) -> dict:
    """The best of ``runs`` with every run's tokens/s and cores used."""
    best = best or max(runs, key=lambda r: r.tokens_per_s)
    brief = [{"tokens_per_s": round(r.tokens_per_s, 2), **r.clock.summary()} for r in runs]
    return {**best.summary(), "all_runs": brief, **extra}


def build_report(args, work: Work, machine: dict, engine_runs, peft_runs, checkouts) -> dict:
    labels = [f"engine ({c.label})" for c in checkouts] or ["engine"]
    after_runs, *before = (engine_runs[label] for label in labels)
    eng = max(after_runs, key=lambda r: r.tokens_per_s)
    best_peft = [max(runs, key=lambda r: r.tokens_per_s) for runs in peft_runs.values()]
    baseline = max(best_peft, key=lambda r: r.tokens_per_s)
    old = max(before[0], key=lambda r: r.tokens_per_s) if before else None
    busy = contention([r.clock.summary() for r in [eng, *best_peft, *filter(None, [old])]], machine)
    ratio = round(eng.tokens_per_s / baseline.tokens_per_s, 3)
    spec, goal = work.spec, PRESET.goals[0]
    report = {
        "benchmark": "engine_vs_peft",
        "config": {
            "model": work.model_dir.name,
            "requests": spec.num_requests,
            "adapters": spec.num_adapters,
            "adapter_ranks": [a.rank for a in work.adapters],
            "adapter_targets": [list(a.targets) for a in work.adapters],
            "adapter_init_std": ADAPTER_STD,
            "max_tokens": spec.output_len[0],
            "dtype": "float32",
            "greedy": True,
            "fixed_length": "engine min_tokens=max_tokens; PEFT min_new_tokens=max_new_tokens",
            "prompt_tokens": [len(work.prompts[i]) for i in range(spec.num_requests)],
            "engine_config": work.engine_settings(),
            "peft_batch_sizes": args.peft_batch_sizes,
            "repeats": args.repeats,
            "workload": spec.to_json(),
        },
        "machine": machine,
        "engine": _entry(
            after_runs, runs_identical=all(r.tokens == eng.tokens for r in after_runs)
        ),
        "peft_runs": [
            _entry(runs, best, agreement_with_engine=agreement(eng.tokens, best.tokens))
            for best, runs in zip(best_peft, peft_runs.values(), strict=True)
        ],
        "baseline": baseline.label,
        "ratio_engine_over_peft": ratio,
        "target_ratio": goal.value,
        "target_met": goal.met_by(ratio),
        "greedy_agreement": agreement(eng.tokens, baseline.tokens),
        "reported_runs_max_loadavg_1m": busy["max_loadavg_1m"],
        "min_cores_used": busy["min_cores_used"],
        "contended": busy["contended"],
        "command": args.command,
    }
    if old is not None:
        after, before_checkout = checkouts
        report["engine"]["checkout"] = {
            "head": after.sha,
            "engine_or_kernels_modified": after.modified,
        }
        report["engine_before"] = _entry(
            before[0],
            old,
            runs_identical=all(r.tokens == old.tokens for r in before[0]),
            rev=before_checkout.rev,
            sha=before_checkout.sha,
            agreement_with_after=agreement(eng.tokens, old.tokens),
        )
        report["ratio_after_over_before"] = round(eng.tokens_per_s / old.tokens_per_s, 3)
        report["engines_in"] = (
            "worker processes (python -m loramux.benchmarks.revisions), one per run"
        )
    return report


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
