"""``make gpu-check`` (``loramux bench gpu-check``): everything only a GPU can tell about
loramux, in one command (docs/benchmarks.md: how to run it on a lent machine).

Whoever gets a CUDA machine runs this first. Each section (``_sections``: the GPU tests,
the fused LoRA tiles' tuning, ``kernels_gpu --quick``, the ``punica-distinct`` and
``slora-s2`` presets without the PEFT baseline, which outlasts a lent machine's call, and
their simulated replay) is a subprocess with its own time limit inside one budget
(``--budget-s``), so a section that fails or runs long costs only itself. The caps add up
to more than one call: run ``--sections tests,lora-tiles,kernels`` in one, the rest in
another.

Writes ``gpu_check.{json,md}`` (each section's status, seconds and exit code, the device),
``gpu_check.log`` (every section's output) and the sections' results under
``<out>/results`` (``--bundle``: packed into ``gpu_check_results.tar.gz``: a lent machine
hands back files, not folders). Exit status 0 when every section passed, 1 when one
failed, 2 with no GPU. ``--smoke`` runs the sections' CPU forms (the suite does);
``--prepare`` writes what a GPU machine without the SmolLM2 package needs carried
(``.loramux/bench-cache/random-models``). It needs the source checkout (the GPU tests are
in its ``tests/``).

    python -m loramux.benchmarks.gpu_check --prepare    # here, once: the folder to carry
    make gpu-check GPU_CHECK_ARGS="--out $OUT --bundle"   # on the GPU machine
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from loramux.benchmarks.common.files import CHECKOUT, RESULTS_DIR, default_cache_dir
from loramux.benchmarks.common.report import Markdown, write

REPO_ROOT = CHECKOUT or Path.cwd()
CACHE_DIR = default_cache_dir()
BENCH = "loramux.benchmarks.bench"
KERNELS = "loramux.benchmarks.kernels_gpu"
TUNE = "loramux.benchmarks.kernels_gpu.tune"
# The presets' weightless Llama-7B folder: config.json and SmolLM2's tokenizer files.
MODEL_FOLDER = CACHE_DIR / "random-models" / "llama-7b-random"
GPU_TESTS = (
    "tests/engine/test_gpu_engine.py",
    "tests/engine/test_random_weights.py",
    "tests/engine/test_structured_outputs.py",  # the grammar mask on CUDA, graphs replayed
    "tests/engine/structured/test_bitmask.py",
    "tests/engine/speculative/test_speculative_gpu.py",
    "tests/engine/speculative/test_verify.py",  # the rejection rule's distribution on CUDA
    "tests/kernels/test_quant_triton.py",  # the quantized matmul compiled, graphs captured
    "tests/kernels/test_kv_quant.py",  # attention over int8 / fp8 caches, compiled
    "tests/kernels/test_lora_triton_fused.py",  # fused LoRA at real shapes, graphs replayed
)
DEFAULT_BUDGET_S = 540.0  # one call on a lent machine (10 minutes), with a minute spare
# The preset's 2,000 requests outlasted the section's 240 s on an H100 (2026-11-26); 300 took
# under 2 minutes there, model build included, at 3.3 req/s.
S2_REQUESTS = "300"
# The CPU smoke's punica-distinct also sweeps the adapters, so that one run covers the GPU
# runner's sweep for the suite (the GPU section sweeps nothing: its time is the preset's).
PUNICA_SMOKE_SWEEP = ("--sweep", "adapters", "--sweep-values", "2,4")


@dataclass(frozen=True)
class Section:
    name: str
    what: str
    gpu_argv: tuple[str, ...]
    smoke_argv: tuple[str, ...]
    cap_s: float  # the most this section may take on the GPU (the budget may allow less)


def _sections(results: Path) -> list[Section]:
    out = ("--out", str(results))
    python = (sys.executable, "-m")
    bench = (*python, BENCH)
    calibrate = (*bench, "simulate", "calibrate", "--recorded", str(results))
    return [
        Section(
            "tests",
            "GPU-marked tests: Triton compiled, copy stream, CUDA graphs, against PEFT",
            (*python, "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *GPU_TESTS),
            (*python, "pytest", "-m", "gpu", "-q", "--collect-only", *GPU_TESTS),
            240.0,
        ),
        Section(
            "lora-tiles",
            "the fused LoRA kernels' tiles tuned for this GPU, written into its lora_tiles.json",
            (*python, TUNE, "--write-table", *out),
            (*python, TUNE, "--smoke", *out),
            150.0,
        ),
        Section(
            "kernels",
            "LoRA shrink/expand, paged attention and a decode step at Llama-7B shapes",
            (*python, KERNELS, "--quick", *out),
            (*python, KERNELS, "--smoke", *out),
            150.0,
        ),
        Section(
            "punica-distinct",
            "32 requests, each its own rank-16 adapter (Punica's case), loramux only",
            (*bench, "punica-distinct", "--no-baseline", *out),
            # (the smoke's sweep is what tests/benchmarks/test_bench_gpu_smoke.py reads)
            (*bench, "punica-distinct", "--smoke", *PUNICA_SMOKE_SWEEP, *out),
            120.0,
        ),
        Section(
            "slora-s2",
            f"S-LoRA's S2 workload, 1,000 adapters of ranks 8-64, {S2_REQUESTS} requests, loramux",
            (*bench, "slora-s2", "--no-baseline", "--requests", S2_REQUESTS, *out),
            (*bench, "slora-s2", "--smoke", *out),
            240.0,
        ),
        Section(
            "simulation",
            "the runs above replayed on the simulated GPU, side by side with what they measured",
            (*calibrate, "--profile", "auto", *out),
            (*calibrate, "--suffix=-smoke", *out),
            90.0,
        ),
    ]


@dataclass
class SectionResult:
    name: str
    what: str
    status: str  # passed, failed, timed out, not run
    seconds: float = 0.0
    exit_code: int | None = None
    note: str = ""


def _environment(smoke: bool) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    if not smoke and MODEL_FOLDER.is_dir():  # carried here: the tests' tokenizer
        env.setdefault("LORAMUX_TEST_TOKENIZER_DIR", str(MODEL_FOLDER))
    return env


def run_section(
    section: Section, argv: tuple[str, ...], limit_s: float, env: dict[str, str], log
) -> SectionResult:
    """Run one section's command for at most ``limit_s``, its output appended to ``log``."""
    result = SectionResult(section.name, section.what, "not run")
    if limit_s < 10:
        result.note = "the budget was spent before it"
        return result
    log.write(f"\n===== {section.name}: {' '.join(argv)} (limit {limit_s:.0f} s)\n")
    log.flush()
    started = time.monotonic()
    try:
        done = subprocess.run(
            argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit_s
        )
    except subprocess.TimeoutExpired:
        result.status, result.note = "timed out", f"stopped after {limit_s:.0f} s"
    else:
        result.exit_code = done.returncode
        result.status = "passed" if done.returncode == 0 else "failed"
    result.seconds = round(time.monotonic() - started, 1)
    log.write(f"===== {section.name}: {result.status} in {result.seconds} s\n")
    log.flush()
    return result


def _markdown(report: dict) -> Markdown:
    device = report["device"]
    doc = Markdown(f"GPU check ({'smoke, on the CPU' if report['smoke'] else device['device']})")
    doc.text(
        f"{report['started']}; torch {device['torch']}, triton {device['triton']}, CUDA "
        f"{device['cuda']}; budget {report['budget_s']:.0f} s, {report['seconds']:.0f} s used."
    )
    rows = [
        (s["name"], s["what"], s["status"], f"{s['seconds']:.1f}", s["note"])
        for s in report["sections"]
    ]
    doc.table(("section", "what", "status", "seconds", "note"), rows, "lllrl")
    return doc.text("Each section's output is in gpu_check.log; its results under results/.")


def prepare() -> int:
    """Write the weightless model folder (with the tokenizer) into the cache, to carry."""
    done = subprocess.run(
        [sys.executable, "-m", BENCH, "slora-s2", "--prepare-only"],
        cwd=REPO_ROOT,
        env=_environment(smoke=True),
    )
    if done.returncode != 0:
        return done.returncode
    size = sum(p.stat().st_size for p in MODEL_FOLDER.rglob("*") if p.is_file())
    print(
        f"{MODEL_FOLDER} ({size / 1e6:.1f} MB) is ready: carry "
        f"{MODEL_FOLDER.parent.relative_to(REPO_ROOT)} to the GPU machine"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    if args.prepare:
        return prepare()
    import torch

    from loramux.benchmarks.common.machine import accelerator_info

    if not args.smoke and not torch.cuda.is_available():
        print("gpu-check needs a CUDA GPU; `--smoke` runs its CPU form.", file=sys.stderr)
        return 2
    out: Path = args.out
    results = out / "results"
    results.mkdir(parents=True, exist_ok=True)
    env = _environment(args.smoke)
    chosen = [s for s in _sections(results) if s.name in args.sections]
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    started, budget = time.monotonic(), args.budget_s
    outcomes = []
    with (out / "gpu_check.log").open("a", encoding="utf-8") as log:
        for section in chosen:
            left = budget - (time.monotonic() - started)
            argv = section.smoke_argv if args.smoke else section.gpu_argv
            limit = left if args.smoke else min(section.cap_s, left)
            outcomes.append(run_section(section, argv, limit, env, log))
            print(f"{section.name}: {outcomes[-1].status} ({outcomes[-1].seconds} s)", flush=True)
    report = {
        "smoke": args.smoke,
        "started": started_at,
        "budget_s": budget,
        "seconds": round(time.monotonic() - started, 1),
        "device": accelerator_info(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        "sections": [dataclasses.asdict(o) for o in outcomes],
    }
    if args.bundle:
        with tarfile.open(out / "gpu_check_results.tar.gz", "w:gz") as bundle:
            bundle.add(results, arcname="results")
        shutil.rmtree(results)
    write(out / "gpu_check", report, _markdown(report))
    return 0 if all(o.status == "passed" for o in outcomes) else 1


def add_options(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="the sections' CPU forms")
    mode.add_argument(
        "--prepare", action="store_true", help="write the folder a GPU machine needs carried"
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu_check", help="results")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"seconds for all sections together (default {DEFAULT_BUDGET_S:.0f})",
    )
    parser.add_argument(
        "--sections",
        default=",".join(SECTION_NAMES),
        help=f"comma-separated subset of {', '.join(SECTION_NAMES)}",
    )
    parser.add_argument(
        "--bundle", action="store_true", help="pack results/ into gpu_check_results.tar.gz"
    )


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTION_NAMES))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTION_NAMES)}")
    if args.budget_s <= 0:
        parser.error("--budget-s must be positive")


SECTION_NAMES = [s.name for s in _sections(RESULTS_DIR)]
