"""Cold adapters under a KV flood: time to first token over HTTP, idle and flooded.

One tenant keeps ``--streams`` long streams on the base model, holding nearly every KV
block (those a new adapter's device rows need included). Meanwhile a second tenant uploads
a fresh adapter (in no tier yet) and calls it, and a third calls the base model, all three
at one priority (a higher-priority flood would rightly keep the cold adapter waiting). The
two TTFTs, idle and flooded, show whether a cold adapter waits a bounded time (the engine
holds, moves and at last preempts KV blocks for it) or until the flood drains.

It runs a real ``loramux serve`` on the embedded default in a fresh data dir and writes
``<out>/cold_adapter_flood_cpu.{json,md}``; the recorded result is ``--warmup 90 --probes 5``.

    python -m loramux.benchmarks.cold_adapter_flood            # SmolLM2, 24 streams
    python -m loramux.benchmarks.cold_adapter_flood --model DIR --streams 4 --warmup 5 --probes 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from loramux.benchmarks.common.files import add_output_options, check_output_options, write_report
from loramux.benchmarks.common.machine import machine_info
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.soak_server import expect, start_server
from loramux.benchmarks.soak_tenants import Tenant, prepare_pool, upload

FLOOD_PROMPT = "Tell me a very long story about the sea. " * 40  # ~400 tokens
PROBE_PROMPT = "Hello there"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=24, help="flooding streams at once")
    parser.add_argument("--flood-tokens", type=int, default=600, help="max_tokens per stream")
    parser.add_argument("--warmup", type=float, default=40.0, help="seconds of flood first")
    parser.add_argument("--probes", type=int, default=3, help="cold adapters called in turn")
    parser.add_argument("--model", type=Path, help="HF-format model folder (default SmolLM2)")
    parser.add_argument("--adapter-host-bytes", type=int, default=1 << 30)
    add_output_options(parser)
    args = parser.parse_args(argv)
    check_output_options(parser, args)
    return args


def first_token_s(client: httpx.Client, headers: dict, model: str) -> float:
    """Seconds from sending a streamed completion to its first non-empty text chunk."""
    body = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 8, "stream": True}
    started = time.monotonic()
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        expect_ok(response)
        for line in response.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line:
                return time.monotonic() - started
    raise RuntimeError(f"no token from {model!r}")


def expect_ok(response: httpx.Response) -> None:
    if response.status_code != 200:
        response.read()
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")


class Flood:
    """``streams`` threads, each keeping one long base-model stream running until stopped."""

    def __init__(self, url: str, headers: dict, model: str, streams: int, tokens: int):
        self.stop = threading.Event()
        self.errors: list[str] = []
        body = {"model": model, "prompt": FLOOD_PROMPT, "max_tokens": tokens, "stream": True}
        body["ignore_eos"] = True
        self._threads = [
            threading.Thread(target=self._run, args=(url, headers, body), daemon=True)
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
                        expect_ok(r)
                        for _ in r.iter_lines():
                            if self.stop.is_set():
                                break
                except Exception as exc:  # counted: a flood stream must never fail
                    self.errors.append(repr(exc))


def create_tenants(url: str, admin: dict) -> list[Tenant]:
    """The flooding tenant, the cold adapter's and the base model's: one priority."""
    tenants = []
    with httpx.Client(base_url=url, headers=admin, timeout=60) as client:
        for name in ("flood", "cold", "base"):
            made = expect(client.post("/admin/tenants", json={"name": name}), 201, name)
            key = expect(client.post(f"/admin/tenants/{made['id']}/api-keys"), 201, "key")
            tenants.append(Tenant(name, made["id"], key["key"]))
    return tenants


def kv_state(client: httpx.Client, admin: dict) -> dict:
    engine = expect(client.get("/admin/engine", headers=admin), 200, "engine snapshot")
    return {"running": engine["running_requests"], **engine["kv_cache"]}


def flooded_state(client: httpx.Client, admin: dict, within_s: float = 30.0) -> dict:
    """The engine's state once flood streams are running: a stream that just ended leaves
    a gap before its thread's next one is admitted, and a probe must start under the flood."""
    deadline = time.monotonic() + within_s
    while True:
        state = kv_state(client, admin)
        if state["running"] >= 1:
            return state
        if time.monotonic() > deadline:
            raise RuntimeError(f"no flood stream was running within {within_s:.0f} s")
        time.sleep(0.02)


def measure(args: argparse.Namespace, model_dir: Path, root: Path) -> dict:
    adapter = prepare_pool(model_dir, args.cache_dir)[4]  # rank 8 on all seven modules
    with (
        start_server(args, model_dir, root) as server,
        httpx.Client(base_url=server.url, timeout=600) as client,
    ):
        flooder, caller, base_caller = create_tenants(server.url, server.admin)
        base = expect(client.get("/v1/models", headers=server.admin), 200, "models")["data"][0]
        base = base["id"]

        def cold(name: str) -> float:
            expect(upload(client, caller, name, adapter), 201, f"uploading {name}")
            return first_token_s(client, caller.headers, name)

        idle = {"cold_s": cold("idle"), "base_s": first_token_s(client, base_caller.headers, base)}
        flood = Flood(server.url, flooder.headers, base, args.streams, args.flood_tokens)
        probes = []
        with flood:
            time.sleep(args.warmup)
            before = flooded_state(client, server.admin)
            for i in range(args.probes):
                probes.append(
                    {
                        "cold_s": cold(f"cold-{i}"),
                        "base_s": first_token_s(client, base_caller.headers, base),
                    }
                )
            after = kv_state(client, server.admin)
        if flood.errors:
            raise RuntimeError(f"flood streams failed: {flood.errors[:3]}")
    return {"idle": idle, "flood": probes, "kv_before": before, "kv_after": after}


def render(report: dict) -> str:
    idle, probes = report["idle"], report["flood"]
    cold = [p["cold_s"] for p in probes]
    base = [p["base_s"] for p in probes]
    before, after = report["kv_before"], report["kv_after"]
    rows = "\n".join(
        f"| {i} | {p['cold_s']:.2f} | {p['base_s']:.2f} |" for i, p in enumerate(probes)
    )
    return f"""# Cold adapters under a KV flood

{report["when"]}, {report["machine"]}; model {report["model"]}; {report["args"]["streams"]}
flooding streams of ~400 prompt tokens and up to {report["args"]["flood_tokens"]} output tokens.

Idle: cold adapter first token {idle["cold_s"]:.2f} s, base model {idle["base_s"]:.2f} s.

Under the flood ({before["running"]} running, KV {before["usage"]:.0%} of
{before["blocks_usable"]} blocks):

| probe | cold adapter TTFT (s) | base model TTFT (s) |
|---|---|---|
{rows}

Median {statistics.median(cold):.2f} s for a cold adapter, {statistics.median(base):.2f} s for
the base model. Preemptions during the probes: {after["preemptions"] - before["preemptions"]}.
"""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = args.model if args.model is not None else prepare_model(args.cache_dir)
    with tempfile.TemporaryDirectory(prefix="loramux-flood-") as root:
        report = measure(args, model_dir, Path(root))
    report.update(
        when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine=machine_info().get("cpu_model") or "unknown CPU",
        model=model_dir.name,
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    )
    write_report(args.out / "cold_adapter_flood_cpu", report, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
