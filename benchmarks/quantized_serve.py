"""``loramux bench quantized-serve``: what serving the embedded default from its GGUF's own
4-bit weights saves against float32, as an operator meets it.

Two real ``loramux serve`` processes on the embedded default, one at a time, each with a fresh
data directory: **gguf**, with no setting at all (the default: SmolLM2's Q4_1 projections and
Q8_0 embedding kept packed, the CPU's native quantized matmul), and **float32**, with
``LORAMUX_QUANTIZATION=none`` (the GGUF de-quantized once into a float32 HF folder; that
conversion is seeded from the bench cache, as is the gguf run's config and tokenizer, so
every run is a later start, not a first one). They alternate in
``--repeats`` pairs, the order flipping between pairs, so a drift in the machine's speed
favours neither.

Per run, through the official ``openai`` client: output tokens/s at batch 1 (``--requests``
requests one after another) and with 4 in flight (twice as many requests through 4
concurrent clients: continuous batching), each request greedy and ``--tokens`` long
(``ignore_eos``); the server process's resident memory (``VmRSS``) once ready and after the
load, and its peak (``VmHWM``); seconds to ready; what the model's cache in the data
directory holds on disk. Every request's text is compared between the two modes (the
weights are the same values: greedy outputs should agree). The figures are the medians over
the pairs; ``--smoke``: one pair, 4 tokens.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loramux.benchmarks.common.bench_server import free_port
from loramux.benchmarks.common.files import (
    add_output_options,
    check_output_options,
    link_or_copy,
    pyplot,
    save_figure,
    write_report,
)
from loramux.benchmarks.common.machine import machine_info, machine_text
from loramux.benchmarks.common.models import MODEL_NAME, prepare_model
from loramux.benchmarks.soak_server import Server, proc_status, stop_server, tree_bytes, wait_ready

MODES = {
    "gguf": {},  # no setting: the default
    "float32": {"LORAMUX_QUANTIZATION": "none"},
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="loramux bench quantized-serve", description=__doc__)
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs (default 2)")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--requests", type=int, default=4, help="requests at batch 1")
    parser.add_argument("--smoke", action="store_true", help="one pair, 4 tokens")
    add_output_options(parser)
    args = parser.parse_args(argv)
    check_output_options(parser, args)
    if args.smoke:
        args.repeats, args.tokens, args.requests = 1, 4, 2
    return args


class Serve:
    """A ``loramux serve`` subprocess on a fresh data directory, with an API key."""

    def __init__(self, mode: str, root: Path, seeds: dict[str, Path]):
        self.mode, self.data_dir = mode, root / mode / "data"
        # What a first start writes (float32: the de-quantized checkpoint, ~20 s; gguf: the
        # config and tokenizer, a few seconds), seeded: every run is a later start.
        seed = seeds[mode]
        shutil.copytree(seed, self.data_dir / "models" / seed.name, copy_function=link_or_copy)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAMUX_")}
        env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **MODES[mode])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / mode / "serve.log"
        command = [sys.executable, "-m", "loramux.platform.cli", "serve", "--port", str(self.port)]
        launched = time.monotonic()
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [*command, "--data-dir", str(self.data_dir)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.server = Server(self.process, self.url, self.data_dir, root / mode, self.log, 0.0)
        wait_ready(self.server, launched)
        self.ready_s = time.monotonic() - launched
        self.key, self.model = self._api_key()

    def _api_key(self) -> tuple[str, str]:
        import httpx

        token = (self.data_dir / "admin_token").read_text().strip()
        admin = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=self.url, headers=admin, timeout=60) as client:
            tenant = client.post("/admin/tenants", json={"name": "bench"}).raise_for_status()
            key = client.post(f"/admin/tenants/{tenant.json()['id']}/api-keys")
            model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        return key.raise_for_status().json()["key"], model

    def rss_mib(self) -> dict:
        status = proc_status(self.process.pid)
        return {"rss_mib": round(status["rss_mib"], 1), "peak_mib": round(status["hwm_mib"], 1)}

    def stop(self) -> None:
        stop_server(self.server)


def _complete(client, model: str, prompt: str, tokens: int) -> tuple[str, int]:
    response = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return response.choices[0].text, response.usage.completion_tokens


def _throughput(server: Serve, prompts: list[str], tokens: int, in_flight: int) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=server.key, timeout=600, max_retries=0)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=in_flight) as pool:
        results = list(pool.map(lambda p: _complete(client, server.model, p, tokens), prompts))
    seconds = time.perf_counter() - started
    generated = sum(n for _, n in results)
    return {
        "seconds": round(seconds, 3),
        "tokens": generated,
        "tokens_per_s": round(generated / seconds, 2),
        "texts": [text for text, _ in results],
    }


def run_once(mode: str, root: Path, seeds: dict[str, Path], args) -> dict:
    server = Serve(mode, root, seeds)
    try:
        ready = server.rss_mib()
        _complete_warmup(server)
        batch1 = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
        batched = [PROMPTS[i % len(PROMPTS)] for i in range(2 * IN_FLIGHT)]
        b1 = _throughput(server, batch1, args.tokens, 1)
        b4 = _throughput(server, batched, args.tokens, IN_FLIGHT)
        loaded = server.rss_mib()
    finally:
        server.stop()
    return {
        "mode": mode,
        "ready_s": round(server.ready_s, 2),
        "rss_ready_mib": ready["rss_mib"],
        "rss_loaded_mib": loaded["rss_mib"],
        "rss_peak_mib": loaded["peak_mib"],
        "model_cache_mib": round(tree_bytes(server.data_dir / "models") / MIB, 1),
        "batch1": b1,
        "batch4": b4,
    }


def _complete_warmup(server: Serve) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=server.key, timeout=600, max_retries=0)
    _complete(client, server.model, "Hello", 4)


def summarize(runs: list[dict]) -> dict:
    summary = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {
            key: round(statistics.median(r[key] for r in mine), 2)
            for key in ("ready_s", "rss_ready_mib", "rss_loaded_mib", "rss_peak_mib")
        } | {
            "model_cache_mib": mine[-1]["model_cache_mib"],
            "batch1_tokens_per_s": round(
                statistics.median(r["batch1"]["tokens_per_s"] for r in mine), 2
            ),
            "batch4_tokens_per_s": round(
                statistics.median(r["batch4"]["tokens_per_s"] for r in mine), 2
            ),
        }
    gguf, flt = summary["gguf"], summary["float32"]
    summary["ratios"] = {
        "rss_loaded": round(gguf["rss_loaded_mib"] / flt["rss_loaded_mib"], 3),
        "rss_peak": round(gguf["rss_peak_mib"] / flt["rss_peak_mib"], 3),
        "batch1_speedup": round(gguf["batch1_tokens_per_s"] / flt["batch1_tokens_per_s"], 3),
        "batch4_speedup": round(gguf["batch4_tokens_per_s"] / flt["batch4_tokens_per_s"], 3),
    }
    return summary


def agreement(runs: list[dict]) -> dict:
    """Requests whose text is the same in both modes (pairwise per pair of runs)."""
    same = total = 0
    for first, second in zip(runs[::2], runs[1::2], strict=True):
        for batch in ("batch1", "batch4"):
            for a, b in zip(first[batch]["texts"], second[batch]["texts"], strict=True):
                same += a == b
                total += 1
    return {"same_text": same, "requests": total}


def render(report: dict) -> str:
    s, r = report["summary"], report["summary"]["ratios"]
    agree = report["agreement"]
    lines = [
        "# `loramux serve` on the embedded default: GGUF 4-bit weights against float32",
        "",
        f"Command: `{report['command']}`. {machine_text(report['machine'])}",
        "",
        f"Medians over {report['repeats']} alternating pairs of runs; each run a fresh "
        "`loramux serve` (the platform with its in-process engine), requests through the "
        f"`openai` client, greedy, {report['tokens']} tokens each.",
        "",
        "| | gguf (default) | float32 (`LORAMUX_QUANTIZATION=none`) | gguf / float32 |",
        "|---|---|---|---|",
    ]
    rows = [
        ("resident memory once ready (MiB)", "rss_ready_mib", None),
        ("resident memory after the load (MiB)", "rss_loaded_mib", "rss_loaded"),
        ("peak resident memory (MiB)", "rss_peak_mib", "rss_peak"),
        ("output tokens/s, batch 1", "batch1_tokens_per_s", "batch1_speedup"),
        (f"output tokens/s, {IN_FLIGHT} in flight", "batch4_tokens_per_s", "batch4_speedup"),
        ("seconds to ready", "ready_s", None),
        ("model cache in the data dir (MiB)", "model_cache_mib", None),
    ]
    for label, key, ratio in rows:
        g, f = s["gguf"][key], s["float32"][key]
        shown = f"{r[ratio]:.2f}x" if ratio else f"{g / f:.2f}x" if f else "-"
        lines.append(f"| {label} | {g} | {f} | {shown} |")
    lines += [
        "",
        "Memory once ready is before any request: float32's checkpoint is memory-mapped and "
        "counts once the first requests touch its pages; after the load both hold all of "
        "their weights (float32 539 MB, the GGUF's packed ones 106 MiB).",
        "",
        f"Same text in both modes: {agree['same_text']} of {agree['requests']} requests.",
        "",
        "Per run:",
        "",
        "| run | mode | ready s | RSS ready | RSS loaded | peak | b1 tok/s | b4 tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, run in enumerate(report["runs"]):
        lines.append(
            f"| {i} | {run['mode']} | {run['ready_s']} | {run['rss_ready_mib']} | "
            f"{run['rss_loaded_mib']} | {run['rss_peak_mib']} | "
            f"{run['batch1']['tokens_per_s']} | {run['batch4']['tokens_per_s']} |"
        )
    lines += ["", "Plot: `bench_quantized-serve.png`."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    s = report["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    modes = list(MODES)
    colors = ["#2a7", "#888"]
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
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    from loramux.engine import extract_gguf_metadata
    from loramux.platform.base_model import embedded_gguf_path

    args = parse_args(argv)
    seeds = {
        "float32": prepare_model(args.cache_dir),
        "gguf": extract_gguf_metadata(
            embedded_gguf_path(), args.cache_dir / f"{MODEL_NAME}.metadata", log=print
        ),
    }
    runs = []
    with tempfile.TemporaryDirectory(prefix="loramux-quantized-serve-") as tmp:
        for pair in range(args.repeats):
            order = list(MODES) if pair % 2 == 0 else list(reversed(MODES))
            for mode in order:
                run = run_once(mode, Path(tmp) / f"pair{pair}", seeds, args)
                print(
                    f"pair {pair} {mode}: RSS {run['rss_loaded_mib']} MiB, "
                    f"{run['batch1']['tokens_per_s']} / {run['batch4']['tokens_per_s']} tok/s",
                    flush=True,
                )
                runs.append(run)
    # Pairs compared mode against mode: order each pair (gguf, float32).
    ordered = []
    for pair in range(args.repeats):
        two = runs[2 * pair : 2 * pair + 2]
        ordered += sorted(two, key=lambda r: list(MODES).index(r["mode"]))
    report = {
        "command": "loramux bench quantized-serve "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine_info(),
        "repeats": args.repeats,
        "tokens": args.tokens,
        "runs": ordered,
        "summary": summarize(ordered),
        "agreement": agreement(ordered),
    }
    stem = args.out / ("bench_quantized-serve" + ("_smoke" if args.smoke else ""))
    write_report(stem, report, render(report))
    plot(report, stem.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
