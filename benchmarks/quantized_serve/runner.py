"""``loramux bench quantized-serve``: what serving the embedded default from its GGUF's own
4-bit weights saves against float32, as an operator meets it.

Real ``loramux serve`` processes, one at a time, each on a fresh data directory: **gguf**
with no setting at all (the default: SmolLM2's Q4_1 projections and Q8_0 embedding kept
packed, the CPU's native quantized matmul) and **float32** with ``LORAMUX_QUANTIZATION=none``
(the GGUF de-quantized once into a float32 HF folder). The data directories are seeded from
the bench cache, so every run is a later start, not a first one. The modes alternate in
``--repeats`` pairs, the order flipping between pairs, so a drift in the machine's speed
favours neither.

Per run, through the ``openai`` client, greedy ``--tokens``-long requests (``ignore_eos``):
output tokens/s at batch 1 (``--requests`` one after another) and with 4 in flight (twice as
many requests: continuous batching); resident memory (``VmRSS``) once ready and after the
load, and its peak (``VmHWM``); seconds to ready; the model's cache in the data directory.
Every request's text is compared between the modes (the weights are the same values: greedy
outputs should agree). The figures are medians over the pairs.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from loramux.benchmarks.common.bench_server import create_tenant, served_model
from loramux.benchmarks.common.files import (
    add_output_options,
    check_output_options,
    link_or_copy,
    pyplot,
    save_figure,
)
from loramux.benchmarks.common.machine import machine_info
from loramux.benchmarks.common.models import MODEL_NAME, prepare_model
from loramux.benchmarks.common.report import Markdown, write
from loramux.benchmarks.common.serve_process import Server, serve

MODES = {
    "gguf": {},  # no setting: the default
    "float32": {"quantization": "none"},  # LORAMUX_QUANTIZATION=none
}
PROMPTS = (
    "The three primary colors are",
    "Write a short note to a colleague about the meeting tomorrow:",
    "A recipe for pancakes begins with",
    "def fibonacci(n):",
    "The history of the printing press",
    "Five tips for learning a new language:",
    "Once upon a time, in a small village,",
    "Explain photosynthesis to a child:",
)
IN_FLIGHT = 4
MIB = 1 << 20
BATCHES = ("batch1", "batch4")
MEDIANS = ("ready_s", "rss_ready_mib", "rss_loaded_mib", "rss_peak_mib")
# The summary's ratios (gguf over float32) and the figures they divide.
RATIOS = {
    "rss_loaded": "rss_loaded_mib",
    "rss_peak": "rss_peak_mib",
    "batch1_speedup": "batch1_tokens_per_s",
    "batch4_speedup": "batch4_tokens_per_s",
}


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs (default 2)")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--requests", type=int, default=4, help="requests at batch 1")
    parser.add_argument("--smoke", action="store_true", help="one pair, 4 tokens")
    add_output_options(parser)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_output_options(parser, args)
    if args.smoke:
        args.repeats, args.tokens, args.requests = 1, 4, 2


class Api:
    """The served model through the ``openai`` client, with a new tenant's API key."""

    def __init__(self, server: Server):
        from openai import OpenAI

        with httpx.Client(base_url=server.url, headers=server.admin, timeout=60) as admin:
            key = create_tenant(admin, {"name": "bench"})["key"]
            self.model = served_model(admin)
        self.client = OpenAI(base_url=f"{server.url}/v1", api_key=key, timeout=600, max_retries=0)

    def complete(self, prompt: str, tokens: int) -> tuple[str, int]:
        response = self.client.completions.create(
            model=self.model,
            prompt=prompt,
            max_tokens=tokens,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        return response.choices[0].text, response.usage.completion_tokens

    def throughput(self, prompts: list[str], tokens: int, in_flight: int) -> dict:
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=in_flight) as pool:
            results = list(pool.map(lambda p: self.complete(p, tokens), prompts))
        seconds = time.perf_counter() - started
        generated = sum(n for _, n in results)
        return {
            "seconds": round(seconds, 3),
            "tokens": generated,
            "tokens_per_s": round(generated / seconds, 2),
            "texts": [text for text, _ in results],
        }


def run_once(mode: str, root: Path, seeds: dict[str, Path], args) -> dict:
    """A ``loramux serve`` on a fresh data dir in ``root/mode``, its memory and speed."""
    # What a first start writes (float32: the de-quantized checkpoint, ~20 s; gguf: the
    # config and tokenizer, a few seconds), seeded: every run is a later start.
    root, seed = root / mode, seeds[mode]
    shutil.copytree(seed, root / "data" / "models" / seed.name, copy_function=link_or_copy)
    with serve(root, **MODES[mode]) as server:
        ready, api = server.memory(), Api(server)
        api.complete("Hello", 4)  # warm-up
        batch1 = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
        batched = [PROMPTS[i % len(PROMPTS)] for i in range(2 * IN_FLIGHT)]
        b1 = api.throughput(batch1, args.tokens, 1)
        b4 = api.throughput(batched, args.tokens, IN_FLIGHT)
        loaded = server.memory()
        server.stop()
    cache = sum(f.stat().st_size for f in (server.data_dir / "models").rglob("*") if f.is_file())
    return {
        "mode": mode,
        "ready_s": round(server.started_s, 2),
        "rss_ready_mib": round(ready["rss_mib"], 1),
        "rss_loaded_mib": round(loaded["rss_mib"], 1),
        "rss_peak_mib": round(loaded["hwm_mib"], 1),
        "model_cache_mib": round(cache / MIB, 1),
        "batch1": b1,
        "batch4": b4,
    }


def summarize(runs: list[dict]) -> dict:
    summary = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {key: round(statistics.median(r[key] for r in mine), 2) for key in MEDIANS}
        summary[mode]["model_cache_mib"] = mine[-1]["model_cache_mib"]
        for batch in BATCHES:
            speed = statistics.median(r[batch]["tokens_per_s"] for r in mine)
            summary[mode][f"{batch}_tokens_per_s"] = round(speed, 2)
    gguf, flt = summary["gguf"], summary["float32"]
    summary["ratios"] = {name: round(gguf[key] / flt[key], 3) for name, key in RATIOS.items()}
    return summary


def agreement(runs: list[dict]) -> dict:
    """Requests whose text is the same in both modes (pairwise per pair of runs)."""
    same = total = 0
    for first, second in zip(runs[::2], runs[1::2], strict=True):
        for batch in BATCHES:
            for a, b in zip(first[batch]["texts"], second[batch]["texts"], strict=True):
                same += a == b
                total += 1
    return {"same_text": same, "requests": total}


def render(report: dict) -> str:
    s, r = report["summary"], report["summary"]["ratios"]
    agree = report["agreement"]
    md = Markdown("`loramux serve` on the embedded default: GGUF 4-bit weights against float32")
    md.command(report["command"]).machine(report["machine"])
    md.text(
        f"Medians over {report['repeats']} alternating pairs of runs; each run a fresh "
        "`loramux serve` (the platform with its in-process engine), requests through the "
        f"`openai` client, greedy, {report['tokens']} tokens each."
    )
    rows = []
    for label, key, ratio in (
        ("resident memory once ready (MiB)", "rss_ready_mib", None),
        ("resident memory after the load (MiB)", "rss_loaded_mib", "rss_loaded"),
        ("peak resident memory (MiB)", "rss_peak_mib", "rss_peak"),
        ("output tokens/s, batch 1", "batch1_tokens_per_s", "batch1_speedup"),
        (f"output tokens/s, {IN_FLIGHT} in flight", "batch4_tokens_per_s", "batch4_speedup"),
        ("seconds to ready", "ready_s", None),
        ("model cache in the data dir (MiB)", "model_cache_mib", None),
    ):
        g, f = s["gguf"][key], s["float32"][key]
        shown = f"{r[ratio]:.2f}x" if ratio else f"{g / f:.2f}x" if f else "-"
        rows.append((label, g, f, shown))
    columns = ("", "gguf (default)", "float32 (`LORAMUX_QUANTIZATION=none`)", "gguf / float32")
    md.table(columns, rows, "llll")
    md.text(
        "Memory once ready is before any request: float32's checkpoint is memory-mapped and "
        "counts once the first requests touch its pages; after the load both hold all of "
        "their weights (float32 539 MB, the GGUF's packed ones 106 MiB).",
        f"Same text in both modes: {agree['same_text']} of {agree['requests']} requests.",
        "Per run:",
    )
    md.table(
        ("run", "mode", "ready s", "RSS ready", "RSS loaded", "peak", "b1 tok/s", "b4 tok/s"),
        [
            (i, run["mode"], *(run[k] for k in MEDIANS), *(run[b]["tokens_per_s"] for b in BATCHES))
            for i, run in enumerate(report["runs"])
        ],
        "llllllll",
    )
    return md.text("Plot: `bench_quantized-serve.png`.").render()


def plot(report: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    s = report["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    modes, colors = list(MODES), ["#2a7", "#888"]
    memory = [s[m]["rss_loaded_mib"] for m in modes]
    axes[0].bar(modes, memory, color=colors)
    axes[0].set_ylabel("MiB")
    axes[0].set_title("resident memory after the load")
    for x, value in enumerate(memory):
        axes[0].text(x, value, f"{value:.0f}", ha="center", va="bottom")
    width = 0.38
    for i, mode in enumerate(modes):
        values = [s[mode]["batch1_tokens_per_s"], s[mode]["batch4_tokens_per_s"]]
        xs = [j + (i - 0.5) * width for j in range(2)]
        axes[1].bar(xs, values, width, label=mode, color=colors[i])
        for x, value in zip(xs, values, strict=True):
            axes[1].text(x, value, f"{value:.1f}", ha="center", va="bottom", fontsize=8)
    axes[1].set_xticks([0, 1], ["batch 1", f"{IN_FLIGHT} in flight"])
    axes[1].set_ylabel("output tokens/s")
    axes[1].set_title("decode speed")
    axes[1].legend()
    fig.suptitle("loramux serve, SmolLM2-135M on the CPU: GGUF 4-bit vs float32")
    return save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    from loramux.engine import extract_gguf_metadata
    from loramux.platform.base_model import embedded_gguf_path

    seeds = {
        "float32": prepare_model(args.cache_dir),
        "gguf": extract_gguf_metadata(
            embedded_gguf_path(), args.cache_dir / f"{MODEL_NAME}.metadata", log=print
        ),
    }
    runs = []  # each pair's runs in MODES' order, whichever ran first
    with tempfile.TemporaryDirectory(prefix="loramux-quantized-serve-") as tmp:
        for pair in range(args.repeats):
            done = {}
            for mode in list(MODES) if pair % 2 == 0 else list(reversed(MODES)):
                done[mode] = run_once(mode, Path(tmp) / f"pair{pair}", seeds, args)
                print(
                    f"pair {pair} {mode}: RSS {done[mode]['rss_loaded_mib']} MiB, "
                    f"{done[mode]['batch1']['tokens_per_s']} / "
                    f"{done[mode]['batch4']['tokens_per_s']} tok/s",
                    flush=True,
                )
            runs += [done[mode] for mode in MODES]
    report = {
        "command": args.command_line,
        "machine": machine_info(),
        "repeats": args.repeats,
        "tokens": args.tokens,
        "runs": runs,
        "summary": summarize(runs),
        "agreement": agreement(runs),
    }
    stem = args.out / ("bench_quantized-serve" + ("_smoke" if args.smoke else ""))
    write(stem, report, render(report))
    plot(report, stem.with_suffix(".png"))
    return 0
