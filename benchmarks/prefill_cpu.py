"""``loramux bench prefill-cpu``: the embedded default's prefill speed on this CPU, against
another revision's (``--before REV``) and llama.cpp's on the same GGUF file.

Each engine run is a worker process (``revisions.run_in_worker``) that builds the engine as
``loramux serve`` does on the embedded default (SmolLM2-135M-Instruct, its 4-bit GGUF, the
engine's default settings but a KV budget that holds the longest prompt), with
``OMP_NUM_THREADS`` set to the run's thread count and OpenMP waiting passively, and times
``--repeats`` prefills of each length: one request of that many random prompt token ids
(a fresh prompt each time: no prefix-cache hit) and one output token. Before and after
alternate, length by length, so that a busy moment of the machine falls on both. tokens/s
is the prompt's tokens over the request's wall time (its one decode step included).

llama.cpp, where ``llama-cpp-python`` imports (``--llama-cpp-python PY``: the interpreter
of a venv that has it; docs/benchmarks.md says how it was built), prefills the same prompts' token
ids from the same GGUF with ``n_threads`` equal to the run's, ``n_batch`` 2048 and
``n_ubatch`` 512 (its defaults), in a process of its own.

    loramux bench prefill-cpu --before e69dd67 [--lengths 2000 8000] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loramux.benchmarks import revisions
from loramux.benchmarks.common.files import add_output_options, check_output_options, write_report
from loramux.benchmarks.common.machine import machine_info, machine_text

NAME = "prefill_cpu"
KV_BYTES = 1 << 30  # holds an 8,000-token context of SmolLM2 in float32 (368 MiB) with room


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="loramux bench prefill-cpu", description=__doc__.split("\n\n")[0]
    )
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
    args = parser.parse_args(argv)
    check_output_options(parser, args)
    if min(*args.lengths, *args.threads, args.repeats, args.batch) <= 0:
        parser.error("lengths, threads and repeats must be positive")
    args.command = " ".join(["loramux bench prefill-cpu", *argv])
    return args


def _prompts(vocab_size: int, avoid: set[int], length: int, count: int, batch: int):
    """``count`` batches of ``batch`` random prompts of ``length`` token ids."""
    import numpy as np

    ids = np.array([i for i in range(3, vocab_size) if i not in avoid])
    rng = np.random.default_rng(length)
    return [[rng.choice(ids, size=length).tolist() for _ in range(batch)] for _ in range(count)]


def run_job(job: dict) -> dict:
    """In a worker: the engine on the embedded GGUF, ``repeats`` prefills of ``length``."""
    import torch

    from loramux.engine import Engine, EngineConfig, SamplingParams
    from loramux.engine.model.gguf_convert import extract_gguf_metadata
    from loramux.platform.base_model import embedded_gguf_path

    torch.set_num_threads(job["threads"])
    gguf = embedded_gguf_path()
    meta = extract_gguf_metadata(gguf, Path(job["scratch"]) / "meta", log=lambda *a: None)
    engine = Engine(EngineConfig(model=str(meta), gguf_file=str(gguf), kv_cache_bytes=KV_BYTES))
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
    job_path, result_path, script = workdir / "lc.json", workdir / "lc-out.json", workdir / "lc.py"
    job_path.write_text(json.dumps(job))
    script.write_text(LLAMA_CPP)
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"])}
    subprocess.run([str(python), str(script), str(job_path), str(result_path)], env=env, check=True)
    return json.loads(result_path.read_text())


def _summary(seconds: list[float], tokens: int) -> dict:
    median = statistics.median(seconds)
    return {
        "seconds": [round(s, 3) for s in seconds],
        "median_s": round(median, 3),
        "tokens_per_s": round(tokens / median, 1),
    }


HOG = "while True: pass"  # one core's worth of busy work, as another process on the machine


@contextlib.contextmanager
def _neighbour(busy: bool):
    """A busy process beside the measurement while the block runs (nothing when not)."""
    if not busy:
        yield
        return
    hog = subprocess.Popen([sys.executable, "-c", HOG])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def main(argv: list[str] | None = None) -> int:
    from loramux.engine.model.config import ModelConfig
    from loramux.engine.model.gguf_convert import extract_gguf_metadata
    from loramux.platform.base_model import embedded_gguf_path

    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    gguf = embedded_gguf_path()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="loramux-prefill-") as tmp:
        scratch = Path(tmp)
        config = ModelConfig.from_pretrained(
            extract_gguf_metadata(gguf, scratch / "meta", log=lambda *a: None)
        )
        with _checkouts(args.before) as (checkouts, workdir):
            conditions = [
                (hog, wait)
                for hog in (False, True)[: 1 + args.hog]
                for wait in ("default", "passive")[: 1 + args.passive]
            ]
            for threads in args.threads:
                os.environ["OMP_NUM_THREADS"] = str(threads)
                for length in args.lengths:
                    prompts = _prompts(
                        config.vocab_size,
                        set(config.eos_token_ids),
                        length,
                        args.repeats,
                        args.batch,
                    )
                    tokens = length * args.batch
                    job = {
                        "runner": __name__,
                        "threads": threads,
                        "prompts": prompts,
                        "scratch": str(scratch),
                    }
                    shape = {"threads": threads, "length": length, "batch": args.batch}
                    for hog, wait in conditions:
                        _set_wait_policy(wait)
                        for checkout in checkouts:
                            with _neighbour(hog):
                                result = revisions.run_in_worker(checkout, job, workdir)
                            rows.append(
                                {
                                    "engine": f"loramux ({_revision(checkout)})",
                                    **shape,
                                    "hog": hog,
                                    "wait": wait,
                                    **_summary(result["seconds"], tokens),
                                }
                            )
                            print(rows[-1], flush=True)
                    _set_wait_policy("default")
                    if args.llama_cpp_python is not None:
                        lc_job = {
                            "gguf": str(gguf),
                            "n_ctx": length + 128,
                            "threads": threads,
                            "prompts": prompts,
                        }
                        result = run_llama_cpp(args.llama_cpp_python, lc_job, workdir)
                        rows.append(
                            {
                                "engine": f"llama.cpp (llama-cpp-python {result['version']})",
                                **shape,
                                "hog": False,
                                "wait": "default",
                                **_summary(result["seconds"], tokens),
                            }
                        )
                        print(rows[-1], flush=True)
    report = {
        "name": NAME,
        "command": args.command,
        "gguf": gguf.name,
        "machine": machine_info(),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (NAME if args.tag is None else f"{NAME}_{args.tag}")
    plots = write_plot(report, stem)
    write_report(stem, report, render_markdown(report, plots))
    return 0


def _revision(checkout: revisions.Checkout) -> str:
    return checkout.label if checkout.rev is not None else f"after, {checkout.sha[:7]}"


def _set_wait_policy(wait: str) -> None:
    """The workers' OpenMP wait: ``default`` (unset: a short spin, then sleep) or
    ``passive`` (``OMP_WAIT_POLICY=PASSIVE``: sleep at once)."""
    if wait == "passive":
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        os.environ.pop("OMP_WAIT_POLICY", None)


class _checkouts:
    """This working tree's engine, after ``--before REV``'s when given."""

    def __init__(self, before: str | None):
        self.before = before

    def __enter__(self):
        if self.before is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="loramux-after-")
            workdir = Path(self._tmp.name)
            return [revisions.after_checkout(workdir)], workdir
        self._both = revisions.before_and_after(self.before)
        after, before, workdir = self._both.__enter__()
        return [before, after], workdir

    def __exit__(self, *exc):
        if self.before is None:
            self._tmp.cleanup()
            return False
        return self._both.__exit__(*exc)


def write_plot(report: dict, stem: Path) -> list[Path]:
    from loramux.benchmarks.common.files import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return []
    engines = list(dict.fromkeys(_label(row) for row in report["rows"]))
    groups = sorted({(row["threads"], row["length"]) for row in report["rows"]})
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(engines)
    for k, engine in enumerate(engines):
        values = [
            next(
                (
                    r["tokens_per_s"]
                    for r in report["rows"]
                    if _label(r) == engine and (r["threads"], r["length"]) == g
                ),
                0,
            )
            for g in groups
        ]
        xs = [i + (k - (len(engines) - 1) / 2) * width for i in range(len(groups))]
        bars = ax.bar(xs, values, width, label=engine, color=f"C{k}")
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    batch = report["rows"][0]["batch"] if report["rows"] else 1
    labels = [f"{t} thread(s)\n{batch} x {n:,} tokens" for t, n in groups]
    ax.set_xticks(range(len(groups)), labels)
    ax.set_ylabel("prefill tokens/s (higher is better)")
    ax.set_title("Prefill of one prompt on this CPU, SmolLM2-135M-Instruct Q4_1 GGUF")
    ax.legend(fontsize=8)
    return [
        save_figure(
            fig,
            stem.with_name(stem.name + ".png"),
            note=machine_text(report["machine"]).split(" Date")[0],
        )
    ]


def _label(row: dict) -> str:
    extra = [
        x
        for x in (
            "busy neighbour" if row["hog"] else "",
            "passive wait" if row["wait"] == "passive" else "",
        )
        if x
    ]
    return row["engine"] + (f", {', '.join(extra)}" if extra else "")


def render_markdown(report: dict, plots: list[Path]) -> str:
    lines = [
        "# Prefill on the CPU: the embedded default",
        "",
        f"`{report['command']}`: a batch of requests (the prompts x tokens column), each of "
        f"random prompt token ids and one output token, on `{report['gguf']}` (the engine's default settings, as `loramux serve` "
        "builds it); medians of the repeats, each engine in a process of its own with "
        "`OMP_NUM_THREADS` set to the thread count and OpenMP's default wait unless the row "
        "says passive (`OMP_WAIT_POLICY=PASSIVE`); a busy neighbour is a process spinning on "
        "one core beside the run.",
        "",
        "| engine | threads | prompts x tokens | OpenMP wait | busy neighbour | median s "
        "| tokens/s | runs (s) |",
        "|---|---:|---:|---|---|---:|---:|---|",
    ]
    for row in report["rows"]:
        runs = ", ".join(f"{s:.2f}" for s in row["seconds"])
        lines.append(
            f"| {row['engine']} | {row['threads']} | {row['batch']} x {row['length']:,} "
            f"| {row['wait']} | {'yes' if row['hog'] else 'no'} | {row['median_s']:.2f} "
            f"| {row['tokens_per_s']:.0f} | {runs} |"
        )
    lines += [
        "",
        *[f"![{p.stem}]({p.name})" for p in plots],
        "",
        machine_text(report["machine"]),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
