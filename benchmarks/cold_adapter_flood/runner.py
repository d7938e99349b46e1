"""Cold adapters under a KV flood: time to first token over HTTP, idle and flooded.

One tenant keeps ``--streams`` long streams on the base model, holding nearly every KV
block (those a new adapter's device rows need included). Meanwhile a second tenant uploads
a fresh adapter (in no tier yet) and calls it, and a third calls the base model, all three
at one priority (a higher-priority flood would rightly keep the cold adapter waiting). The
two TTFTs, idle and flooded, show whether a cold adapter waits a bounded time (the engine
holds, moves and at last preempts KV blocks for it) or until the flood drains.

It runs a real ``loramux serve`` on the embedded default in a fresh data dir and writes
``<out>/cold_adapter_flood_cpu.{json,md}``; the recorded result is
``python -m loramux.benchmarks.cold_adapter_flood --warmup 90 --probes 5``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from loramux.benchmarks.common.adapters import ALL_SEVEN, prepare_adapters
from loramux.benchmarks.common.bench_server import (
    add_adapter,
    bearer,
    create_tenant,
    expect,
    served_model,
)
from loramux.benchmarks.common.files import add_output_options
from loramux.benchmarks.common.machine import machine_info
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.common.report import Markdown, write
from loramux.benchmarks.common.serve_process import serve

FLOOD_PROMPT = "Tell me a very long story about the sea. " * 40  # ~400 tokens
PROBE_PROMPT = "Hello there"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, default=24, help="flooding streams at once")
    parser.add_argument("--flood-tokens", type=int, default=600, help="max_tokens per stream")
    parser.add_argument("--warmup", type=float, default=40.0, help="seconds of flood first")
    parser.add_argument("--probes", type=int, default=3, help="cold adapters called in turn")
    parser.add_argument("--model", type=Path, help="HF-format model folder (default SmolLM2)")
    parser.add_argument("--adapter-host-bytes", type=int, default=1 << 30)
    add_output_options(parser)


def first_token_s(client: httpx.Client, key: str, model: str) -> float:
    """Seconds from sending a streamed completion to its first non-empty text chunk."""
    body = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 8, "stream": True}
    started = time.monotonic()
    with client.stream("POST", "/v1/completions", json=body, headers=bearer(key)) as response:
        expect(response, 200, f"a completion of {model!r}")
        for line in response.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line:
                return time.monotonic() - started
    raise RuntimeError(f"no token from {model!r}")


class Flood:
    """``streams`` threads, each keeping one long base-model stream running until stopped."""

    def __init__(self, url: str, key: str, model: str, streams: int, tokens: int):
        self.stop = threading.Event()
        self.errors: list[str] = []
        body = {"model": model, "prompt": FLOOD_PROMPT, "max_tokens": tokens, "stream": True}
        body["ignore_eos"] = True
        self._threads = [
            threading.Thread(target=self._run, args=(url, bearer(key), body), daemon=True)
            for _ in range(streams)
        ]

    def __enter__(self) -> Flood:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def _run(self, url: str, headers: dict, body: dict) -> None:
        with httpx.Client(base_url=url, timeout=600) as client:
            while not self.stop.is_set():
                try:
                    with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                        expect(r, 200, "a flood stream")
                        for _ in r.iter_lines():
                            if self.stop.is_set():
                                break
                except Exception as exc:  # counted: a flood stream must never fail
                    self.errors.append(repr(exc))


def kv_state(client: httpx.Client) -> dict:
    engine = expect(client.get("/admin/engine"), 200, "engine snapshot")
    return {"running": engine["running_requests"], **engine["kv_cache"]}


def flooded_state(client: httpx.Client, within_s: float = 30.0) -> dict:
    """The engine's state once flood streams are running: a stream that just ended leaves
    a gap before its thread's next one is admitted, and a probe must start under the flood."""
    deadline = time.monotonic() + within_s
    while True:
        state = kv_state(client)
        if state["running"] >= 1:
            return state
        if time.monotonic() > deadline:
            raise RuntimeError(f"no flood stream was running within {within_s:.0f} s")
        time.sleep(0.02)


def measure(args: argparse.Namespace, model_dir: Path, root: Path) -> dict:
    # Rank 8 on all seven modules (the soak's pool's fifth adapter).
    (adapter,) = prepare_adapters(args.cache_dir, model_dir, ((8, ALL_SEVEN),), 1, seed=7004)
    settings = {"model": model_dir, "adapter_host_bytes": args.adapter_host_bytes}
    with (
        serve(root, own_tmp=True, **settings) as server,
        httpx.Client(base_url=server.url, headers=server.admin, timeout=600) as client,
    ):
        # The flooding tenant, the cold adapter's and the base model's: one priority.
        flooder, caller, base_caller = (
            create_tenant(client, {"name": name})["key"] for name in ("flood", "cold", "base")
        )
        base = served_model(client)

        def probe(name: str) -> dict:
            """A fresh adapter's first token, then the base model's."""
            add_adapter(client, caller, name, adapter.path, name)
            cold_s = first_token_s(client, caller, name)
            return {"cold_s": cold_s, "base_s": first_token_s(client, base_caller, base)}

        idle = probe("idle")
        flood = Flood(server.url, flooder, base, args.streams, args.flood_tokens)
        with flood:
            time.sleep(args.warmup)
            before = flooded_state(client)
            probes = [probe(f"cold-{i}") for i in range(args.probes)]
            after = kv_state(client)
        if flood.errors:
            raise RuntimeError(f"flood streams failed: {flood.errors[:3]}")
    return {"idle": idle, "flood": probes, "kv_before": before, "kv_after": after}


def markdown(report: dict) -> Markdown:
    idle, probes = report["idle"], report["flood"]
    before, after = report["kv_before"], report["kv_after"]
    md = Markdown("Cold adapters under a KV flood")
    md.text(
        f"{report['when']}, {report['machine']}; model {report['model']}; "
        f"{report['args']['streams']} flooding streams of ~400 prompt tokens and up to "
        f"{report['args']['flood_tokens']} output tokens.",
        f"Idle: cold adapter first token {idle['cold_s']:.2f} s, base model "
        f"{idle['base_s']:.2f} s.",
        f"Under the flood ({before['running']} running, KV {before['usage']:.0%} of "
        f"{before['blocks_usable']} blocks):",
    )
    rows = [(i, f"{p['cold_s']:.2f}", f"{p['base_s']:.2f}") for i, p in enumerate(probes)]
    md.table(("probe", "cold adapter TTFT (s)", "base model TTFT (s)"), rows)
    cold, base = (statistics.median(p[k] for p in probes) for k in ("cold_s", "base_s"))
    md.text(
        f"Median {cold:.2f} s for a cold adapter, {base:.2f} s for the base model. "
        f"Preemptions during the probes: {after['preemptions'] - before['preemptions']}."
    )
    return md.command(report["command"])


def run(args: argparse.Namespace) -> int:
    model_dir = args.model if args.model is not None else prepare_model(args.cache_dir)
    with tempfile.TemporaryDirectory(prefix="loramux-flood-") as root:
        report = measure(args, model_dir, Path(root))
    options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    command = options.pop("command_line")
    report.update(
        when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine=machine_info().get("cpu_model") or "unknown CPU",
        model=model_dir.name,
        args=options,
        command=command,
    )
    write(args.out / "cold_adapter_flood_cpu", report, markdown(report))
    return 0
