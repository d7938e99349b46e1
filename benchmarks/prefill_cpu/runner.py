"""``loramux bench prefill-cpu``: the embedded default's prefill speed on this CPU, against
another revision's (``--before REV``) and llama.cpp's on the same GGUF file.

Each engine run is a worker process (``revisions.run_in_worker``) that builds the engine as
``loramux serve`` does on the embedded default (its 4-bit GGUF, the engine's default
settings but a KV budget that holds the longest prompt), with ``OMP_NUM_THREADS`` set to
the run's thread count, and times ``--repeats`` prefills of each length: one request of
that many random prompt token ids (a fresh prompt each time: no prefix-cache hit) and one
output token. Before and after alternate, length by length, so that a busy moment of the
machine falls on both. tokens/s is the prompt's tokens over the request's wall time (its
one decode step included).

llama.cpp (``--llama-cpp-python PY``: the interpreter of a venv where ``llama-cpp-python``
imports; docs/benchmarks.md says how it was built) prefills the same prompts' token ids
from the same GGUF with ``n_threads`` equal to the run's, ``n_batch`` 2048 and ``n_ubatch``
512 (its defaults), in a process of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loramux.benchmarks.common import revisions
from loramux.benchmarks.common.files import (
    add_output_options,
    check_output_options,
    pyplot,
    save_figure,
)
from loramux.benchmarks.common.llama_cpp_python import run_script
from loramux.benchmarks.common.machine import machine_info, machine_text
from loramux.benchmarks.common.models import LONG_CONTEXT_KV_BYTES, embedded_engine
from loramux.benchmarks.common.prompts import Prompts
from loramux.benchmarks.common.report import Markdown, num, write

NAME = "prefill_cpu"
HOG = "while True: pass"  # one core's worth of busy work, as another process on the machine


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--before", help="a git revision whose engine to measure beside this one")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000, 8000])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tag", help="results named prefill_cpu_TAG (default prefill_cpu)")
    parser.add_argument("--batch", type=int, default=1, help="prompts per timed request batch")
    parser.add_argument(
        "--hog",
        action="store_true",
        help="also measure each with a busy process beside it (one core's worth of work)",
    )
    parser.add_argument(
        "--passive",
        action="store_true",
        help="also measure with OMP_WAIT_POLICY=PASSIVE (OpenMP's threads sleep at once "
        "while they wait; the default spins briefly first)",
    )
    parser.add_argument(
        "--llama-cpp-python", type=Path, help="a Python interpreter that imports llama_cpp"
    )
    add_output_options(parser)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_output_options(parser, args)
    if min(*args.lengths, *args.threads, args.repeats, args.batch) <= 0:
        parser.error("lengths, threads and repeats must be positive")


def run_job(job: dict) -> dict:
    """In a worker: the engine on the embedded GGUF, ``repeats`` prefills of ``length``."""
    import torch

    from loramux.engine import SamplingParams

    torch.set_num_threads(job["threads"])
    engine = embedded_engine(Path(job["scratch"]), kv_cache_bytes=LONG_CONTEXT_KV_BYTES)
    params = SamplingParams(max_tokens=1, temperature=0)
    engine.generate([list(range(100, 164))], params)  # warm-up
    seconds = []
    for batch in job["prompts"]:
        start = time.perf_counter()
        engine.generate(batch, params)
        seconds.append(time.perf_counter() - start)
    return {"seconds": seconds, "torch_threads": torch.get_num_threads()}


LLAMA_CPP = """
import json, sys, time
from llama_cpp import Llama
job = json.load(open(sys.argv[1]))
llm = Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_threads=job["threads"],
            n_threads_batch=job["threads"], n_batch=2048, n_ubatch=512, verbose=False)
llm.eval(list(range(100, 164)))
seconds = []
for batch in job["prompts"]:
    start = time.perf_counter()
    for prompt in batch:
        llm.reset()
        llm.eval(prompt)
    seconds.append(time.perf_counter() - start)
import llama_cpp
json.dump({"seconds": seconds, "version": llama_cpp.__version__}, open(sys.argv[2], "w"))
"""


def run_llama_cpp(python: Path, job: dict, workdir: Path) -> dict:
    script = workdir / "lc.py"
    script.write_text(LLAMA_CPP)
    return run_script(python, script, job, workdir, job["threads"])


@contextlib.contextmanager
def _checkouts(before: str | None):
    """This working tree's engine, after ``--before REV``'s when given; and a scratch folder."""
    if before is None:
        with tempfile.TemporaryDirectory(prefix="loramux-after-") as tmp:
            yield [revisions.after_checkout(Path(tmp))], Path(tmp)
    else:
        with revisions.before_and_after(before) as (after, earlier, workdir):
            yield [earlier, after], workdir


@contextlib.contextmanager
def _conditions(hog: bool, wait: str):
    """A busy process beside the measurement (``hog``) and the workers' OpenMP wait:
    ``default`` (unset: a short spin, then sleep) or ``passive`` (sleep at once)."""
    if wait == "passive":
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        os.environ.pop("OMP_WAIT_POLICY", None)
    neighbour = subprocess.Popen([sys.executable, "-c", HOG]) if hog else None
    try:
        yield
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


def _row(engine: str, shape: dict, seconds: list[float], hog=False, wait="default") -> dict:
    """One engine's timings of one shape (printed as they come)."""
    median = statistics.median(seconds)
    row = {"engine": engine, **shape, "hog": hog, "wait": wait} | {
        "seconds": [round(s, 3) for s in seconds],
        "median_s": round(median, 3),
        "tokens_per_s": round(shape["length"] * shape["batch"] / median, 1),
    }
    print(row, flush=True)
    return row


def _measure(args, gguf: Path, shape: dict, prompts, checkouts, workdir: Path, scratch: Path):
    """Every engine's rows for one shape: this tree's (and ``--before``'s, alternating) under
    each condition, then llama.cpp's."""
    rows = []
    job = {"runner": __name__, "threads": shape["threads"], "prompts": prompts}
    job["scratch"] = str(scratch)
    hogs, waits = (False, True)[: 1 + args.hog], ("default", "passive")[: 1 + args.passive]
    for hog, wait in itertools.product(hogs, waits):
        for checkout in checkouts:
            with _conditions(hog, wait):
                result = revisions.run_in_worker(checkout, job, workdir)
            label = checkout.label if checkout.rev is not None else f"after, {checkout.sha[:7]}"
            rows.append(_row(f"loramux ({label})", shape, result["seconds"], hog, wait))
    if args.llama_cpp_python is not None:
        lc_job = {"gguf": str(gguf), "n_ctx": shape["length"] + 128} | job
        result = run_llama_cpp(args.llama_cpp_python, lc_job, workdir)
        engine = f"llama.cpp (llama-cpp-python {result['version']})"
        rows.append(_row(engine, shape, result["seconds"]))
    return rows


def run(args: argparse.Namespace) -> int:
    from loramux.engine.model.config import ModelConfig
    from loramux.engine.model.gguf_convert import extract_gguf_metadata
    from loramux.platform.base_model import embedded_gguf_path

    gguf, rows = embedded_gguf_path(), []
    with (
        tempfile.TemporaryDirectory(prefix="loramux-prefill-") as tmp,
        _checkouts(args.before) as (checkouts, workdir),
    ):
        meta = extract_gguf_metadata(gguf, Path(tmp) / "meta", log=lambda *a: None)
        config = ModelConfig.from_pretrained(meta)
        for threads, length in itertools.product(args.threads, args.lengths):
            os.environ["OMP_NUM_THREADS"] = str(threads)
            prompt = Prompts(config.vocab_size, config.eos_token_ids, seed=length)
            prompts = [[prompt(length) for _ in range(args.batch)] for _ in range(args.repeats)]
            shape = {"threads": threads, "length": length, "batch": args.batch}
            rows += _measure(args, gguf, shape, prompts, checkouts, workdir, Path(tmp))
    report = {
        "name": NAME,
        "command": args.command_line,
        "gguf": gguf.name,
        "machine": machine_info(),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (NAME if args.tag is None else f"{NAME}_{args.tag}")
    write(stem, report, render_markdown(report, write_plot(report, stem)))
    return 0


def _label(row: dict) -> str:
    extra = ["busy neighbour"] * row["hog"] + ["passive wait"] * (row["wait"] == "passive")
    return ", ".join([row["engine"], *extra])


def write_plot(report: dict, stem: Path) -> list[Path]:
    plt = pyplot()
    if plt is None:
        return []
    rows = report["rows"]
    engines = list(dict.fromkeys(_label(row) for row in rows))
    groups = sorted({(row["threads"], row["length"]) for row in rows})
    speed = {(_label(r), r["threads"], r["length"]): r["tokens_per_s"] for r in rows}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(engines)
    for k, engine in enumerate(engines):
        values = [speed.get((engine, *group), 0) for group in groups]
        xs = [i + (k - (len(engines) - 1) / 2) * width for i in range(len(groups))]
        bars = ax.bar(xs, values, width, label=engine, color=f"C{k}")
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    batch = rows[0]["batch"] if rows else 1
    ax.set_xticks(range(len(groups)), [f"{t} thread(s)\n{batch} x {n:,} tokens" for t, n in groups])
    ax.set_ylabel("prefill tokens/s (higher is better)")
    ax.set_title("Prefill of one prompt on this CPU, SmolLM2-135M-Instruct Q4_1 GGUF")
    ax.legend(fontsize=8)
    note = machine_text(report["machine"]).split(" Date")[0]
    return [save_figure(fig, stem.with_name(stem.name + ".png"), note=note)]


def render_markdown(report: dict, plots: list[Path]) -> Markdown:
    md = Markdown("Prefill on the CPU: the embedded default")
    md.text(
        f"`{report['command']}`: a batch of requests (the prompts x tokens column), each of "
        f"random prompt token ids and one output token, on `{report['gguf']}` (the engine's "
        "default settings, as `loramux serve` builds it); medians of the repeats, each engine "
        "in a process of its own with `OMP_NUM_THREADS` set to the thread count and OpenMP's "
        "default wait unless the row says passive (`OMP_WAIT_POLICY=PASSIVE`); a busy "
        "neighbour is a process spinning on one core beside the run."
    )
    md.table(
        (
            "engine",
            "threads",
            "prompts x tokens",
            "OpenMP wait",
            "busy neighbour",
            "median s",
            "tokens/s",
            "runs (s)",
        ),
        [
            (
                row["engine"],
                row["threads"],
                f"{row['batch']} x {row['length']:,}",
                row["wait"],
                "yes" if row["hog"] else "no",
                num(row["median_s"], 2),
                num(row["tokens_per_s"], 0),
                ", ".join(f"{s:.2f}" for s in row["seconds"]),
            )
            for row in report["rows"]
        ],
        "lrrllrrl",
    )
    return md.plots(plots).machine(report["machine"])
