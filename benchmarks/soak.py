"""A bounded soak: a real ``loramux serve`` under steady load with adapter churn.

One ``loramux serve`` subprocess on the embedded default (SQLite, local store, the engine
in-process, SmolLM2-135M unless ``--model`` names another HF folder) in a fresh data dir
under a temporary folder, with its own ``TMPDIR`` there. Three tenants (different
priorities, weights and prices; one with a monthly budget and rate limits, so budget holds
and limiter reservations are taken and released all the time) each get an API key and
two stable adapters (never deleted). Then, for ``--duration`` seconds (default 600):

* **steady load**: ``--concurrency`` clients (default 6), each paced to an equal share of
  ``--rate`` requests/s (a client that falls behind sends its next request at once, never
  a burst): completions and chat, non-streamed and streamed (``include_usage``), some
  dropped by the client after a few chunks, some with ``max_tokens`` 1 or 2, over the base
  model, the stable adapters and the churned ones, half of the latter the freshest
  (cold loads);
* **adapter churn**: every ``--churn-interval`` seconds (default 3) one tenant in turn
  uploads a new adapter, uploads a new version of a stable or a churned one, or deletes
  its oldest churned adapter (at most four live; names are reused after a delete), so the
  engine registers, loads, evicts and unloads adapters all along.
  The uploads are PEFT adapters written by ``tests/fixtures/models.build_peft_adapter``
  (ranks 4/8/16; q/v, q/k/v/o or all seven projections), built once and cached; the
  store is content-addressed, so re-uploading them adds no objects and the store stays
  flat: the data dir grows only by the database's rows;
* **sampling** every ``--sample-interval`` seconds (default 10): the server's RSS, peak
  RSS, threads and open fds (``/proc``), its CPU time, the data dir (database, store,
  ``tmp/uploads``) and its ``TMPDIR``, ``/admin/engine`` (running and waiting requests, KV
  blocks, adapters per tier) and ``/metrics`` (adapter loads and evictions, preemptions,
  failed steps, HTTP 5xx).

Every response is counted by status. The soak fails on any 5xx, transport error or
error event in a stream, on a 4xx other than a 404 for an adapter the churn deleted while
the request was under way, and when billing differs from what the API returned:
``/admin/usage?group_by=request`` must hold, for every request, exactly the ``usage`` it
returned (streams: the final ``include_usage`` chunk) and, for a dropped stream, the
tokens the client received (counted from the chunks' logprobs, reading to the end of
what the server sent after the client half-closed), and nothing else (a request that
delivered no token has no row, as documented). After the load the server gets SIGTERM
and must shut down gracefully; then the database is read: no adapter version may be
left ``uploading`` or ``validating`` and no usage row provisional, and nothing may be left
in ``tmp/uploads`` or the server's ``TMPDIR``. The engine may hold at most the latest
version of every adapter that can be live plus one per client (a request still on an
older version) registered: more is versions no request can reach, growing with uploads.

**Memory.** The first ``--warmup`` (20 %) of the run is excluded: the model's first
steps, the allocator's arenas and the adapter tiers filling up. The host-RAM adapter
tier is LRU and byte-bounded (``LORAMUX_ADAPTER_HOST_BYTES``); the soak sets it to
``--adapter-host-bytes`` (32 MiB, about six of these adapters, which are 1-9 MB in
float32) rather than the 1 GiB default, which the churn would take the whole run to fill,
so the bound is reached in the warm-up and growth after it is not that cache. On the CPU
the device tier lives inside the KV cache's budget (``LORAMUX_KV_CACHE_BYTES``, 256 MiB,
allocated at start), so it cannot grow either. Over the rest a least-squares line is
fitted to RSS; the verdict is "no growth" when its rise over the steady part stays
within ``--rss-tolerance-mib`` (32 MiB, 4 MiB/min over eight minutes): glibc's arenas
(one per thread that allocates, up to 8 per core) and their fragmentation, allocations of
sizes first met late (new batch and prompt shapes) and the database's page caches move
RSS by tens of MiB without a leak. The slope over the second half is reported too: a
leak keeps its slope, a cache filling up flattens. fds and threads get the same fit with
8 of slack (connections and files open at a sample; thread pools grow on demand).

The soak is about growth and errors, not speed: on a shared 2-core machine the figures
for latency and throughput are whatever the neighbours left.

    .venv/bin/python benchmarks/soak.py                  # 10 minutes on SmolLM2
    .venv/bin/python benchmarks/soak.py --duration 10 --model DIR --out DIR   # a smoke
    loramux bench soak [--duration S] ...

Writes ``benchmarks/results/soak_<device>.{json,md,png}`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import random
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO_ROOT / "benchmarks"
for _path in (str(BENCH_DIR), str(REPO_ROOT)):  # siblings and tests.fixtures import by name
    if _path not in sys.path:
        sys.path.insert(0, _path)

from adapter_churn import model_key  # noqa: E402
from bench_server import ADAPTER_FILES, free_port  # noqa: E402
from engine_vs_peft import QUESTIONS, machine_info, prepare_model, write_atomic  # noqa: E402

RESULTS_DIR = BENCH_DIR / "results"
CACHE_DIR = REPO_ROOT / ".loramux" / "bench-cache"
MIB = 1 << 20

QV = ("q_proj", "v_proj")
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_SEVEN = (*QKVO, "gate_proj", "up_proj", "down_proj")
# The adapters uploads draw from: small ranks over three target sets.
POOL_SHAPES = ((4, QV), (8, QKVO), (16, QKVO), (4, ALL_SEVEN), (8, ALL_SEVEN), (16, QV))
ADAPTER_STD = 0.02  # visible but not model-destroying (as the other benchmarks)

# Three tenants: priorities, weights and prices differ; silver has a monthly budget and
# rate limits far above what the soak sends, so every request takes and releases a budget
# hold and limiter reservations without ever being refused.
TENANTS = (
    {
        "name": "gold",
        "priority": 7,
        "weight": 2.0,
        "input_price_per_mtok": 1.5,
        "cached_input_price_per_mtok": 0.5,
        "output_price_per_mtok": 6.0,
    },
    {
        "name": "silver",
        "priority": 5,
        "weight": 1.0,
        "input_price_per_mtok": 2.0,
        "output_price_per_mtok": 3.0,
        "monthly_budget_usd": 1000.0,
        "requests_per_minute": 100_000,
        "tokens_per_minute": 10_000_000,
    },
    {
        "name": "bronze",
        "priority": 5,
        "weight": 0.5,
        "input_price_per_mtok": 0.25,
        "output_price_per_mtok": 11.0,
    },
)
STABLE_ADAPTERS = 2  # per tenant: uploaded before the load, never deleted (new versions at times)
MAX_CHURNED = 4  # live churned adapters per tenant; past this the churn deletes the oldest
CHURN_NAMES = 6  # churned names cycle through churn-0..5: a deleted name is uploaded again

# A start converts the model first when its cache is cold (~20 s, slower on a busy machine).
STARTUP_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 300.0  # generous: the soak judges errors, not latency
BILLING_WAIT_S = 60.0  # a dropped stream's row is written once the server sees the client left
STOP_TIMEOUT_S = 90.0  # SIGTERM: running requests get LORAMUX_SHUTDOWN_TIMEOUT_S (30 s), then out
FD_SLACK = 8  # fds may vary by a few connections and files open at a sample
THREAD_SLACK = 8  # thread pools (anyio's, the loader's) grow on demand up to their caps


# --- options ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="loramux bench soak", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=6, help="clients sending at once")
    parser.add_argument("--rate", type=float, default=1.5, help="requests/s offered, in all")
    parser.add_argument(
        "--churn-interval", type=float, default=3.0, help="seconds between adapter churn acts"
    )
    parser.add_argument(
        "--sample-interval", type=float, default=10.0, help="seconds between samples"
    )
    parser.add_argument(
        "--warmup", type=float, default=0.2, help="fraction of the run left out of the fit"
    )
    parser.add_argument(
        "--rss-tolerance-mib",
        type=float,
        default=32.0,
        help="RSS may rise this much over the steady part (fitted) and still be no growth",
    )
    parser.add_argument(
        "--adapter-host-bytes",
        type=int,
        default=32 * MIB,
        help="LORAMUX_ADAPTER_HOST_BYTES of the server (the host tier's bound)",
    )
    parser.add_argument("--model", type=Path, help="HF-format model folder (default SmolLM2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the clients and churn")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="models, adapters")
    args = parser.parse_args(argv)
    if min(args.duration, args.rate, args.churn_interval, args.sample_interval) <= 0:
        parser.error("--duration, --rate, --churn-interval and --sample-interval must be > 0")
    if args.concurrency < 1 or not 0 <= args.warmup < 1:
        parser.error("--concurrency must be >= 1 and --warmup in [0, 1)")
    return args


# --- the server ------------------------------------------------------------------------------


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    data_dir: Path
    tmp_dir: Path  # the server's TMPDIR
    log: Path
    started_s: float  # seconds from launch to a ready /readyz

    @property
    def admin(self) -> dict[str, str]:
        token = (self.data_dir / "admin_token").read_text().strip()
        return {"Authorization": f"Bearer {token}"}

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def public_log_tail(self, chars: int = 3000) -> str:
        return redact(self.log_tail(chars))


def redact(text: str) -> str:
    """``text`` without tokens and keys (the first start prints the admin token; the
    report is committed, and though the server was a throwaway one, still)."""
    return re.sub(r"lmx-[A-Za-z0-9_-]+", "lmx-<redacted>", text)


def server_env(args: argparse.Namespace, model_dir: Path, tmp_dir: Path) -> dict[str, str]:
    """The embedded default, but for the model folder, the host tier's bound and TMPDIR."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAMUX_")}
    env.update(
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        TMPDIR=str(tmp_dir),
        LORAMUX_MODEL=str(model_dir),
        LORAMUX_ADAPTER_HOST_BYTES=str(args.adapter_host_bytes),
    )
    return env


@contextlib.contextmanager
def start_server(args: argparse.Namespace, model_dir: Path, root: Path) -> Iterator[Server]:
    data_dir, tmp_dir = root / "data", root / "tmp"
    tmp_dir.mkdir()
    port = free_port()
    command = [sys.executable, "-m", "loramux.platform.cli", "serve", "--port", str(port)]
    launched = time.monotonic()
    with (root / "serve.log").open("wb") as out:
        process = subprocess.Popen(
            [*command, "--data-dir", str(data_dir)],
            cwd=REPO_ROOT,
            env=server_env(args, model_dir, tmp_dir),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = Server(process, f"http://127.0.0.1:{port}", data_dir, tmp_dir, root / "serve.log", 0)
    try:
        wait_ready(server, launched)
        server.started_s = time.monotonic() - launched
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def wait_ready(server: Server, launched: float) -> None:
    while time.monotonic() - launched < STARTUP_TIMEOUT_S:
        if server.process.poll() is not None:
            raise RuntimeError(f"loramux serve exited at start:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/readyz", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"loramux serve not ready after {STARTUP_TIMEOUT_S:.0f} s")


def stop_server(server: Server) -> dict:
    """SIGTERM, as an orchestrator stops it; how long it took and how it exited.

    uvicorn handles the signal, shuts down gracefully, then raises it again, so a clean
    stop exits with -SIGTERM after uvicorn's "Finished server process" line."""
    sent = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    try:
        code = server.process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.process.kill()
        code = server.process.wait(timeout=30)
        return {"exit_code": code, "seconds": None, "needed_kill": True, "graceful": False}
    return {
        "exit_code": code,
        "seconds": round(time.monotonic() - sent, 2),
        "needed_kill": False,
        "graceful": "Finished server process" in server.log_tail(2000),
    }


def log_errors(server: Server) -> list[str]:
    """Lines of the server's log that report an error or a traceback."""
    lines = server.log.read_text(errors="replace").splitlines()
    return [redact(line) for line in lines if "Traceback" in line or line.startswith("ERROR")]


# --- tenants and adapters --------------------------------------------------------------------


@dataclass
class Tenant:
    name: str
    id: str
    key: str
    stable: list[str] = field(default_factory=list)  # never deleted; new versions at times
    churned: list[str] = field(default_factory=list)  # live churned names, oldest first
    fresh: str | None = None  # the churned name uploaded (or re-versioned) last

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@dataclass(frozen=True)
class PoolAdapter:
    path: Path
    rank: int
    targets: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"r{self.rank} {'/'.join(t.removesuffix('_proj') for t in self.targets)}"


def prepare_pool(model_dir: Path, cache_dir: Path) -> list[PoolAdapter]:
    """One PEFT adapter per ``POOL_SHAPES`` entry for ``model_dir``, built once and cached."""
    from tests.fixtures.models import build_peft_adapter

    folder = cache_dir / "soak-adapters" / model_key(model_dir)
    pool = []
    for i, (rank, targets) in enumerate(POOL_SHAPES):
        tag = "+".join(t.removesuffix("_proj") for t in targets)
        path = folder / f"p{i}-r{rank}-{tag}-std{ADAPTER_STD}-seed{7000 + i}"
        if not (path / "adapter_model.safetensors").is_file():
            print(f"building adapter {path.name} ...", flush=True)
            partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
            build_peft_adapter(
                model_dir, partial, rank=rank, targets=targets, seed=7000 + i, std=ADAPTER_STD
            )
            partial.rename(path)
        pool.append(PoolAdapter(path, rank, targets))
    return pool


def _expect(response: httpx.Response, status: int, what: str) -> dict:
    if response.status_code != status:
        raise RuntimeError(f"{what}: HTTP {response.status_code} {response.text[:500]}")
    return response.json() if response.content else {}


def create_tenants(server: Server) -> list[Tenant]:
    tenants = []
    with httpx.Client(base_url=server.url, headers=server.admin, timeout=60) as client:
        for body in TENANTS:
            made = _expect(client.post("/admin/tenants", json=body), 201, f"tenant {body['name']}")
            key = _expect(client.post(f"/admin/tenants/{made['id']}/api-keys"), 201, "API key")
            tenants.append(Tenant(body["name"], made["id"], key["key"]))
    return tenants


def base_model_id(server: Server) -> str:
    with httpx.Client(base_url=server.url, headers=server.admin, timeout=60) as client:
        models = _expect(client.get("/v1/models"), 200, "listing models")["data"]
    return models[0]["id"]  # an operator sees the base model only


def upload(client: httpx.Client, tenant: Tenant, name: str, adapter: PoolAdapter):
    files = [("files", (f, (adapter.path / f).read_bytes())) for f in ADAPTER_FILES]
    return client.post("/v1/adapters", data={"name": name}, files=files, headers=tenant.headers)


def upload_stable(server: Server, tenants: list[Tenant], pool: list[PoolAdapter]) -> None:
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as client:
        for t, tenant in enumerate(tenants):
            for k in range(STABLE_ADAPTERS):
                name = f"stable-{k}"
                adapter = pool[(t * STABLE_ADAPTERS + k) % len(pool)]
                body = _expect(upload(client, tenant, name, adapter), 201, f"uploading {name}")
                if body.get("status") != "ready":
                    raise RuntimeError(f"{tenant.name}/{name} is {body.get('status')!r}")
                tenant.stable.append(name)


class Catalog:
    """The tenants' live adapter names, shared by the churn (writes) and the clients (reads).

    The churn takes a name out before deleting it, so a client can only pick a deleted
    adapter in the moment between its pick and the delete: such a 404 is expected."""

    def __init__(self, tenants: list[Tenant], base_model: str):
        self.tenants = tenants
        self.base_model = base_model
        self._lock = threading.Lock()

    def pick(self, rng: random.Random, tenant: Tenant, target: str) -> tuple[str, str]:
        """(what was picked: base, stable, fresh or churned; the model name)."""
        with self._lock:
            if target == "churned" and tenant.churned:
                if tenant.fresh in tenant.churned and rng.random() < 0.5:
                    return "fresh", tenant.fresh
                return "churned", rng.choice(tenant.churned)
            if target == "base":
                return "base", self.base_model
            return "stable", rng.choice(tenant.stable)

    def added(self, tenant: Tenant, name: str) -> None:
        """``name`` has a new ready version (a stable name stays stable)."""
        if name in tenant.stable:
            return
        with self._lock:
            if name not in tenant.churned:
                tenant.churned.append(name)
            tenant.fresh = name

    def removed(self, tenant: Tenant, name: str) -> None:
        with self._lock:
            tenant.churned.remove(name)
            if tenant.fresh == name:
                tenant.fresh = None

    def churned(self, tenant: Tenant) -> list[str]:
        with self._lock:
            return list(tenant.churned)


# --- the ledger: every response and churn act ------------------------------------------------


@dataclass
class Outcome:
    """One request as the client saw it."""

    client: int
    kind: str
    tenant: str
    target: str  # base, stable, fresh or churned
    model: str
    picked_s: float  # seconds from the load's start
    finished_s: float = 0.0
    status: str = ""  # the HTTP status, "transport" or "stream_error"
    error: str | None = None  # the error's code or text
    request_id: str | None = None
    usage: dict | None = None  # as returned: prompt, cached prompt, completion tokens, cost
    delivered: int | None = None  # a dropped stream: the tokens the client received


@dataclass
class ChurnEvent:
    action: str  # upload, version or delete
    tenant: str
    name: str
    started_s: float
    finished_s: float = 0.0
    status: str = ""
    version: int | None = None
    adapter: str | None = None  # the pool adapter's shape


class Ledger:
    def __init__(self, t0: float):
        self.t0 = t0
        self.outcomes: list[Outcome] = []
        self.events: list[ChurnEvent] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def record(self, item: Outcome | ChurnEvent) -> None:
        with self._lock:
            (self.outcomes if isinstance(item, Outcome) else self.events).append(item)


# --- requests --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestKind:
    name: str
    api: str  # completion or chat
    stream: bool
    weight: float
    drop: bool = False  # the client leaves after a few chunks
    tiny: bool = False  # max_tokens 1 or 2


KINDS = (
    RequestKind("completion", "completion", stream=False, weight=20),
    RequestKind("completion_stream", "completion", stream=True, weight=15),
    RequestKind("chat", "chat", stream=False, weight=15),
    RequestKind("chat_stream", "chat", stream=True, weight=15),
    RequestKind("completion_dropped", "completion", stream=True, weight=6, drop=True),
    RequestKind("chat_dropped", "chat", stream=True, weight=6, drop=True),
    RequestKind("completion_tiny", "completion", stream=False, weight=8, tiny=True),
    RequestKind("chat_stream_tiny", "chat", stream=True, weight=8, tiny=True),
)
TARGETS = {"base": 25, "stable": 45, "churned": 30}  # churned: half of them the freshest
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
DROPPED_MAX_TOKENS = 64  # with ignore_eos: the stream is still going when the client leaves


def request_body(kind: RequestKind, model: str, rng: random.Random) -> tuple[dict, int]:
    """The JSON body for ``kind`` on ``model``, and after how many chunks to drop it."""
    question = rng.choice(QUESTIONS)
    if kind.tiny:
        max_tokens = rng.choice((1, 2))
    elif kind.drop:
        max_tokens = DROPPED_MAX_TOKENS
    else:
        max_tokens = rng.randint(8, 24)
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0.7}
    if kind.api == "chat":
        body["messages"] = [{"role": "user", "content": question}]
    else:
        body["prompt"] = question
    if kind.stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if kind.drop:
        # Each chunk lists its tokens in logprobs: how the client counts what it received.
        body |= {"ignore_eos": True, "logprobs": 1 if kind.api == "completion" else True}
    return body, rng.randint(1, 4)


def returned_usage(usage: dict) -> dict:
    details = usage.get("prompt_tokens_details") or {}
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "cached_prompt_tokens": details.get("cached_tokens") or 0,
        "completion_tokens": usage["completion_tokens"],
        "cost_micro_usd": usage["cost_micro_usd"],
    }


def _error_code(response: httpx.Response) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return response.json()["error"]["code"]
    return response.text[:200]


def send_plain(client: httpx.Client, tenant: Tenant, path: str, body: dict, out: Outcome) -> None:
    response = client.post(path, json=body, headers=tenant.headers)
    out.status = str(response.status_code)
    if response.status_code != 200:
        out.error = _error_code(response)
        return
    payload = response.json()
    out.request_id, out.usage = payload["id"], returned_usage(payload["usage"])


def send_stream(client: httpx.Client, tenant: Tenant, path: str, body: dict, out: Outcome) -> None:
    with client.stream("POST", path, json=body, headers=tenant.headers) as response:
        out.status = str(response.status_code)
        if response.status_code != 200:
            response.read()
            out.error = _error_code(response)
            return
        for line in response.iter_lines():
            chunk = _sse_chunk(line)
            if chunk is None:
                continue
            if "error" in chunk:
                out.status, out.error = "stream_error", json.dumps(chunk["error"])[:300]
                return
            out.request_id = chunk.get("id", out.request_id)
            if chunk.get("usage"):
                out.usage = returned_usage(chunk["usage"])
    if out.usage is None:
        out.status, out.error = "stream_error", "the stream ended without its usage chunk"


def _sse_chunk(line: str | bytes) -> dict | None:
    text = line.decode() if isinstance(line, bytes) else line
    text = text.strip()
    if not text.startswith("data: ") or text == "data: [DONE]":
        return None
    return json.loads(text.removeprefix("data: "))


def _chunk_tokens(chunk: dict) -> int:
    """Tokens a streamed chunk carries, from its logprobs (completion or chat shape)."""
    tokens = 0
    for choice in chunk.get("choices") or []:
        logprobs = choice.get("logprobs") or {}
        tokens += len(logprobs.get("tokens") or logprobs.get("content") or [])
    return tokens


def send_dropped(url: str, tenant: Tenant, path: str, body: dict, drop_after: int, out: Outcome):
    """Stream, leave after ``drop_after`` chunks, then read what the server still sent.

    The client half-closes its socket (the server sees it leave and stops the request) and
    keeps reading to the end, so it counts every token that reached it: what the request
    must be billed for. A plain HTTP client could not half-close."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT_S)
    try:
        headers = {**tenant.headers, "Content-Type": "application/json"}
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        sock = conn.sock  # held here: http.client may forget it once the response starts
        response = conn.getresponse()
        out.status = str(response.status)
        if response.status != 200:
            out.error = response.read().decode(errors="replace")[:200]
            return
        chunks, left = [], False
        with contextlib.suppress(http.client.HTTPException, OSError):  # the body ends early
            while line := response.readline():
                chunk = _sse_chunk(line)
                if chunk is None:
                    continue
                chunks.append(chunk)
                if not left and len(chunks) >= drop_after:
                    sock.shutdown(socket.SHUT_WR)
                    left = True
        settle_dropped(chunks, out)
    finally:
        conn.close()


def settle_dropped(chunks: list[dict], out: Outcome) -> None:
    errors = [c["error"] for c in chunks if "error" in c]
    if errors:
        out.status, out.error = "stream_error", json.dumps(errors[0])[:300]
        return
    if not chunks:
        out.status, out.error = "stream_error", "no chunk arrived"
        return
    out.request_id = chunks[0]["id"]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    if usage:  # it finished before the client left: an ordinary stream
        out.usage = returned_usage(usage[0])
    else:
        out.delivered = sum(_chunk_tokens(c) for c in chunks)


class Worker(threading.Thread):
    """A thread of the soak whose crash (a bug of the soak, not of the server) is kept and
    raised again by ``join_all``."""

    def __init__(self, name: str):
        super().__init__(name=name, daemon=True)
        self.crash: BaseException | None = None

    def run(self) -> None:
        try:
            self.work()
        except BaseException as exc:
            self.crash = exc

    def work(self) -> None:
        raise NotImplementedError


def join_all(workers: list[Worker]) -> None:
    for worker in workers:
        worker.join()
    for worker in workers:
        if worker.crash is not None:
            raise RuntimeError(f"the soak's {worker.name} thread crashed") from worker.crash


class LoadClient(Worker):
    """One client: a request every ``interval`` seconds (the next at once when late)."""

    def __init__(self, index: int, server: Server, catalog: Catalog, ledger: Ledger, args, stop):
        super().__init__(f"soak-client-{index}")
        self.index = index
        self.url = server.url
        self.catalog = catalog
        self.ledger = ledger
        self.stop = stop
        self.interval = args.concurrency / args.rate
        self.offset = index * self.interval / args.concurrency  # clients spread evenly
        self.rng = random.Random(args.seed * 1_000 + index)

    def work(self) -> None:
        next_at = self.ledger.t0 + self.offset
        with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S) as client:
            while not self.stop.wait(max(0.0, next_at - time.monotonic())):
                self.ledger.record(self.serve_one(client))
                next_at = max(next_at + self.interval, time.monotonic())

    def serve_one(self, client: httpx.Client) -> Outcome:
        kind = self.rng.choices(KINDS, weights=[k.weight for k in KINDS])[0]
        tenant = self.rng.choice(self.catalog.tenants)
        target = self.rng.choices(list(TARGETS), weights=list(TARGETS.values()))[0]
        target, model = self.catalog.pick(self.rng, tenant, target)
        body, drop_after = request_body(kind, model, self.rng)
        out = Outcome(self.index, kind.name, tenant.name, target, model, self.ledger.now())
        path = PATHS[kind.api]
        try:
            if kind.drop:
                send_dropped(self.url, tenant, path, body, drop_after, out)
            elif kind.stream:
                send_stream(client, tenant, path, body, out)
            else:
                send_plain(client, tenant, path, body, out)
        except (httpx.HTTPError, http.client.HTTPException, OSError, ValueError) as exc:
            out.status, out.error = "transport", f"{type(exc).__name__}: {exc}"[:300]
        out.finished_s = self.ledger.now()
        return out


class Churner(Worker):
    """Every ``interval`` seconds the next tenant in turn uploads a new adapter, uploads a
    new version of one, or deletes its oldest churned one."""

    def __init__(self, server: Server, catalog: Catalog, ledger: Ledger, pool, args, stop):
        super().__init__("soak-churn")
        self.url = server.url
        self.catalog = catalog
        self.ledger = ledger
        self.pool = pool
        self.stop = stop
        self.interval = args.churn_interval
        self.rng = random.Random(args.seed * 1_000 + 999)
        self.acts = 0
        self.next_name = Counter()  # tenant -> index of its next churned name

    def work(self) -> None:
        with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S) as client:
            while not self.stop.wait(self.interval):
                tenant = self.catalog.tenants[self.acts % len(self.catalog.tenants)]
                action = self.choose(tenant)
                self.ledger.record(self.act(client, tenant, action))
                self.acts += 1

    def choose(self, tenant: Tenant) -> str:
        live = self.catalog.churned(tenant)
        if len(live) >= MAX_CHURNED:
            return "delete"
        if not live:
            return "upload"
        return ("upload", "version", "delete")[(self.acts // len(self.catalog.tenants)) % 3]

    def act(self, client: httpx.Client, tenant: Tenant, action: str) -> ChurnEvent:
        live = self.catalog.churned(tenant)
        if action == "upload":
            name = self.new_name(tenant, live)
        elif action == "version":  # of a stable adapter or a churned one, half and half
            name = self.rng.choice(tenant.stable if self.rng.random() < 0.5 else live)
        else:  # a delete takes the oldest churned one
            name = live[0]
        event = ChurnEvent(action, tenant.name, name, self.ledger.now())
        try:
            if action == "delete":
                self.catalog.removed(tenant, name)  # no client picks it from now on
                response = client.delete(f"/v1/adapters/{name}", headers=tenant.headers)
            else:
                adapter = self.rng.choice(self.pool)
                event.adapter = adapter.label
                response = upload(client, tenant, name, adapter)
                if response.status_code == 201 and response.json().get("status") == "ready":
                    event.version = response.json().get("version")
                    self.catalog.added(tenant, name)
            event.status = str(response.status_code)
        except httpx.HTTPError as exc:
            event.status = f"transport: {type(exc).__name__}: {exc}"[:300]
        event.finished_s = self.ledger.now()
        return event

    def new_name(self, tenant: Tenant, live: list[str]) -> str:
        while True:  # the next of churn-0..CHURN_NAMES-1 not live (MAX_CHURNED < CHURN_NAMES)
            k = self.next_name[tenant.name] % CHURN_NAMES
            self.next_name[tenant.name] += 1
            if f"churn-{k}" not in live:
                return f"churn-{k}"


# --- sampling --------------------------------------------------------------------------------


def proc_status(pid: int) -> dict:
    """RSS, peak RSS and threads from /proc/<pid>/status; open fds; CPU seconds used."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.split()
    # /proc/<pid>/stat: utime and stime are fields 14 and 15, counted after the ")" that
    # closes the command name (which may hold spaces).
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(stat[11]) + int(stat[12])
    return {
        "rss_mib": int(fields["VmRSS"][0]) / 1024,
        "hwm_mib": int(fields["VmHWM"][0]) / 1024,
        "threads": int(fields["Threads"][0]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "cpu_s": ticks / os.sysconf("SC_CLK_TCK"),
    }


def tree_bytes(path: Path) -> int:
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(path):
            with contextlib.suppress(FileNotFoundError):  # removed while we walk
                if entry.is_dir(follow_symlinks=False):
                    total += tree_bytes(Path(entry.path))
                else:
                    total += entry.stat(follow_symlinks=False).st_size
    return total


def entries(path: Path) -> int:
    with contextlib.suppress(FileNotFoundError):
        return len(os.listdir(path))
    return 0


def disk_figures(server: Server) -> dict:
    """The data dir by top-level entry (the database and its journal, the store, ...) and
    what the upload workspace and the server's TMPDIR hold now."""
    sizes: Counter = Counter()
    for entry in os.scandir(server.data_dir):
        name = "database" if entry.name.startswith("loramux.db") else entry.name
        path = Path(entry.path)
        sizes[name] += tree_bytes(path) if entry.is_dir() else path.stat().st_size
    return {
        "data_dir_mib": sum(sizes.values()) / MIB,
        "data_dir_parts_mib": {k: round(v / MIB, 3) for k, v in sorted(sizes.items())},
        "upload_tmp_entries": entries(server.data_dir / "tmp" / "uploads"),
        "tmpdir_entries": entries(server.tmp_dir),
        "tmpdir_mib": tree_bytes(server.tmp_dir) / MIB,
    }


def engine_figures(client: httpx.Client, server: Server) -> dict:
    snap = _expect(client.get("/admin/engine", headers=server.admin), 200, "/admin/engine")
    tiers = Counter(adapter["tier"] for adapter in snap["adapters"])
    return {
        "running": snap["running_requests"],
        "waiting": snap["waiting_requests"],
        "kv_blocks_used": snap["kv_cache"]["blocks_used"],
        "kv_blocks_usable": snap["kv_cache"]["blocks_usable"],
        "device_adapters": snap["device"]["count"],
        "device_mib": snap["device"]["bytes"] / MIB,
        "host_adapters": snap["host"]["count"],
        "host_mib": snap["host"]["bytes"] / MIB,
        "host_capacity_mib": snap["host"]["capacity_bytes"] / MIB,
        "registered_adapters": len(snap["adapters"]),
        "adapters_by_tier": dict(tiers),
        "ttft_p50_ms": snap["ttft"]["p50_ms"],
        "itl_p50_ms": snap["itl"]["p50_ms"],
    }


# Counters and gauges of /metrics worth following over a soak (summed over their labels).
METRICS = (
    "loramux_adapter_loads",
    "loramux_adapter_evictions",
    "loramux_preemptions",
    "loramux_generated_tokens",
    "loramux_step_failures",
    "loramux_requests_failed_in_step",
)


def metric_figures(client: httpx.Client) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get("/metrics").text
    sums: Counter = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name in METRICS and sample.name == f"{family.name}_total":
                sums[family.name.removeprefix("loramux_")] += sample.value
            elif sample.name == "loramux_http_requests_total":
                status = sample.labels.get("status", "")
                sums["http_requests"] += sample.value
                sums["http_5xx"] += sample.value if status.startswith("5") else 0
            elif family.name in METRICS and family.type == "gauge":
                sums[family.name.removeprefix("loramux_")] += sample.value
    return dict(sums)


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


class Sampler(Worker):
    """Takes a sample every ``interval`` seconds until stopped, then one last."""

    def __init__(self, server: Server, ledger: Ledger, interval: float, stop: threading.Event):
        super().__init__("soak-sampler")
        self.server = server
        self.ledger = ledger
        self.interval = interval
        self.stop = stop
        self.samples: list[dict] = []
        self.errors: list[str] = []

    def work(self) -> None:
        with httpx.Client(base_url=self.server.url, timeout=60) as client:
            self.take(client)
            while not self.stop.wait(self.interval):
                self.take(client)

    def take(self, client: httpx.Client) -> None:
        sample = {"t_s": round(self.ledger.now(), 2), "load1": loadavg()}
        try:
            sample |= proc_status(self.server.process.pid)
            sample |= disk_figures(self.server)
            sample |= engine_figures(client, self.server)
            sample |= metric_figures(client)
        except (OSError, httpx.HTTPError, RuntimeError, KeyError) as exc:
            self.errors.append(f"{sample['t_s']} s: {type(exc).__name__}: {exc}"[:300])
        self.samples.append(sample)


# --- checks after the load -------------------------------------------------------------------

USAGE_FIELDS = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "cost_micro_usd")


def billed_rows(server: Server, dropped: set[str]) -> dict[str, dict]:
    """``/admin/usage`` by request, once every dropped stream's row is there (or timed out)."""
    deadline = time.monotonic() + BILLING_WAIT_S
    with httpx.Client(base_url=server.url, headers=server.admin, timeout=120) as client:
        while True:
            report = _expect(
                client.get("/admin/usage", params={"group_by": "request"}), 200, "usage"
            )
            rows = {row["request_id"]: row for row in report["rows"]}
            if dropped <= rows.keys() or time.monotonic() > deadline:
                return rows
            time.sleep(1.0)


def check_billing(server: Server, ledger: Ledger) -> dict:
    """Billing against what the API returned, request by request (see the module)."""
    returned = {
        o.request_id: o
        for o in ledger.outcomes
        if o.request_id and (o.usage is not None or o.delivered is not None)
    }
    dropped = {rid for rid, o in returned.items() if o.usage is None and o.delivered}
    rows = billed_rows(server, dropped)
    mismatches = [m for rid, o in returned.items() if (m := _mismatch(o, rows.get(rid)))]
    empty = [rid for rid, o in returned.items() if _tokens(o) == 0]
    completed = [o for o in returned.values() if o.usage is not None]
    cut = [o for o in returned.values() if o.usage is None]
    return {
        "requests_returned": len(returned) - len(empty),  # those that delivered a token
        "requests_without_tokens": len(empty),  # not billed, by design
        "requests_billed": len(rows),
        "billed_but_not_returned": sorted(set(rows) - set(returned))[:20],
        "completed": {
            "requests": len(completed),
            "returned": {f: sum(o.usage[f] for o in completed) for f in USAGE_FIELDS},
            "billed": {
                f: sum(rows[o.request_id][f] for o in completed if o.request_id in rows)
                for f in USAGE_FIELDS
            },
        },
        "dropped": {
            "requests": len(cut),
            "tokens_received": sum(o.delivered for o in cut),
            "tokens_billed": sum(
                rows[o.request_id]["completion_tokens"] for o in cut if o.request_id in rows
            ),
        },
        "mismatches": mismatches[:20],
        "mismatch_count": len(mismatches),
    }


def _tokens(outcome: Outcome) -> int:
    """Completion tokens the client got: its usage's, or those a dropped stream received."""
    return outcome.delivered if outcome.usage is None else outcome.usage["completion_tokens"]


def _mismatch(outcome: Outcome, row: dict | None) -> dict | None:
    if row is None:  # a request that delivered no token is not billed (by design)
        return (
            None
            if _tokens(outcome) == 0
            else {"request_id": outcome.request_id, "why": "not billed"}
        )
    if outcome.usage is not None:
        billed = {f: row[f] for f in USAGE_FIELDS}
        if billed != outcome.usage:
            return {"request_id": outcome.request_id, "returned": outcome.usage, "billed": billed}
        return None
    if row["completion_tokens"] != outcome.delivered or row["finish_reason"] != "abort":
        return {
            "request_id": outcome.request_id,
            "received": outcome.delivered,
            "billed": row["completion_tokens"],
            "finish_reason": row["finish_reason"],
        }
    return None


def read_database(data_dir: Path) -> dict:
    """After the server exited: adapter versions by status, provisional usage rows."""
    db = sqlite3.connect(f"file:{data_dir / 'loramux.db'}?mode=ro", uri=True)
    try:
        versions = dict(db.execute("SELECT status, COUNT(*) FROM adapter_versions GROUP BY status"))
        adapters = db.execute(
            "SELECT SUM(deleted_at IS NULL), SUM(deleted_at IS NOT NULL) FROM adapters"
        ).fetchone()
        provisional = db.execute("SELECT COUNT(*) FROM usage_records WHERE NOT final").fetchone()
    finally:
        db.close()
    return {
        "versions_by_status": versions,
        "stuck_versions": versions.get("uploading", 0) + versions.get("validating", 0),
        "adapters_live": adapters[0] or 0,
        "adapters_deleted": adapters[1] or 0,
        "provisional_usage_rows": provisional[0],
    }


# --- judging ---------------------------------------------------------------------------------


def is_failure(outcome: Outcome) -> bool:
    return outcome.status in ("transport", "stream_error") or outcome.status.startswith("5")


def classify(ledger: Ledger) -> dict:
    """Responses by status; which count against the soak (see the module)."""
    deletes = [e for e in ledger.events if e.action == "delete"]

    def deleted_meanwhile(o: Outcome) -> bool:
        return any(
            e.tenant == o.tenant
            and e.name == o.model
            and e.started_s <= o.finished_s
            and e.finished_s >= o.picked_s
            for e in deletes
        )

    failures, expected_404, unexpected_4xx = [], 0, []
    for o in ledger.outcomes:
        if is_failure(o):
            failures.append(o)
        elif o.status == "404" and deleted_meanwhile(o):
            expected_404 += 1
        elif o.status.startswith("4"):
            unexpected_4xx.append(o)
    churn_failures = [e for e in ledger.events if not e.status.startswith("2")]
    by_kind: dict[str, Counter] = {}
    for o in ledger.outcomes:
        by_kind.setdefault(o.kind, Counter())[o.status] += 1
    return {
        "requests": len(ledger.outcomes),
        "by_status": dict(Counter(o.status for o in ledger.outcomes)),
        "by_kind": {kind: dict(counts) for kind, counts in sorted(by_kind.items())},
        "by_target": dict(Counter(o.target for o in ledger.outcomes)),
        "expected_404": expected_404,
        "failures": [asdict(o) for o in failures],
        "unexpected_4xx": [asdict(o) for o in unexpected_4xx],
        "churn": dict(Counter(f"{e.action} {e.status}" for e in ledger.events)),
        "churn_failures": [asdict(e) for e in churn_failures],
    }


def fit(samples: list[dict], key: str, since_s: float) -> dict | None:
    """A least-squares line through ``key`` over the samples from ``since_s`` on."""
    import numpy as np

    points = [(s["t_s"], s[key]) for s in samples if key in s and s["t_s"] >= since_s]
    if len(points) < 3:
        return None
    t, y = np.array(points, dtype=float).T
    slope, intercept = np.polyfit(t, y, 1)
    residual = y - (slope * t + intercept)
    late = t >= (t[0] + t[-1]) / 2  # a leak keeps its slope; a cache filling up flattens
    late_slope = np.polyfit(t[late], y[late], 1)[0] if late.sum() >= 3 else None
    return {
        "samples": len(points),
        "from_s": t[0],
        "to_s": t[-1],
        "first": y[0],
        "last": y[-1],
        "min": y.min(),
        "max": y.max(),
        "slope_per_min": slope * 60,
        "intercept": intercept,  # at 0 s, in minutes: y = intercept + slope_per_min * min
        "second_half_slope_per_min": None if late_slope is None else late_slope * 60,
        "fitted_rise": slope * (t[-1] - t[0]),
        "residual_std": residual.std(),
    }


def registration_bound(args) -> int:
    """Adapter versions the engine may hold registered at once: every live adapter's latest
    version, plus a superseded or deleted one for each request still using it, plus the
    versions superseded within the platform's grace period (one per churn act at most)."""
    from loramux.platform.services.adapter_runtime import SUPERSEDED_GRACE_S

    in_grace = math.ceil(SUPERSEDED_GRACE_S / args.churn_interval) + 1
    return len(TENANTS) * (STABLE_ADAPTERS + MAX_CHURNED) + args.concurrency + in_grace


def judge(args, samples: list[dict], counts: dict, billing: dict, db: dict, ending: dict) -> dict:
    since = args.warmup * args.duration
    registered = max((s.get("registered_adapters", 0) for s in samples), default=0)
    fits = {key: fit(samples, key, since) for key in ("rss_mib", "fds", "threads")}
    tolerances = {"rss_mib": args.rss_tolerance_mib, "fds": FD_SLACK, "threads": THREAD_SLACK}
    growth = {
        key: fits[key] is not None and fits[key]["fitted_rise"] > tolerances[key] for key in fits
    }
    checks = {
        "no 5xx, transport or stream errors": not counts["failures"],
        "no unexpected 4xx": not counts["unexpected_4xx"],
        "churn acts all succeeded": not counts["churn_failures"],
        "billing equals what the API returned": billing["mismatch_count"] == 0
        and not billing["billed_but_not_returned"]
        and billing["requests_billed"] == billing["requests_returned"],
        "no adapter version stuck uploading/validating": db["stuck_versions"] == 0,
        "no provisional usage row left": db["provisional_usage_rows"] == 0,
        "RSS: no growth": not growth["rss_mib"],
        "fds: no growth": not growth["fds"],
        "threads: no growth": not growth["threads"],
        "engine registrations within live adapters + requests": registered
        <= registration_bound(args),
        "nothing left in tmp/uploads or TMPDIR": not ending["leftovers"],
        "SIGTERM: graceful exit": ending["shutdown"]["graceful"]
        and ending["shutdown"]["exit_code"] in (0, -signal.SIGTERM),
    }
    return {
        "warmup_s": since,
        "registered_max": registered,
        "registered_bound": registration_bound(args),
        "fits": fits,
        "tolerances": tolerances,
        "checks": checks,
        "passed": all(checks.values()),
    }


# --- the report ------------------------------------------------------------------------------


def _series(samples: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(s["t_s"] / 60, s[key]) for s in samples if s.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def write_plot(report: dict, path: Path) -> None:
    """RSS (with the fit and the warm-up), requests/s by class, fds / threads / adapters,
    and the churn acts, over the same minutes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, verdict = report["samples"], report["verdict"]
    fig, axes = plt.subplots(
        4, 1, figsize=(11, 11), sharex=True, gridspec_kw={"height_ratios": [3, 2, 2, 1]}
    )
    _plot_memory(axes[0], samples, verdict)
    _plot_rates(axes[1], report["rate_bins"], report["config"]["rate"])
    _plot_resources(axes[2], samples, verdict["registered_bound"])
    _plot_churn(axes[3], report["churn_events"])
    for ax in axes:
        ax.axvspan(0, verdict["warmup_s"] / 60, color="0.92", zorder=0)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes since the load started (grey: warm-up, left out of the fits)")
    status = "passed" if verdict["passed"] else "FAILED"
    fig.suptitle(
        f"loramux serve soak: {report['config']['duration'] / 60:.1f} min, "
        f"{report['counts']['requests']} requests, {len(report['churn_events'])} churn acts "
        f"({status})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_memory(ax, samples: list[dict], verdict: dict) -> None:
    """RSS and the fit; the y axis zooms on the steady level, the start (model loaded,
    nothing served yet) is written in the corner; the host tier on its own axis."""
    t, rss_mib = _series(samples, "rss_mib")
    ax.plot(t, rss_mib, color="tab:blue", marker=".", label="server RSS")
    fit_rss = verdict["fits"]["rss_mib"]
    if fit_rss is not None:
        slope = fit_rss["slope_per_min"]
        ends = [fit_rss["from_s"] / 60, fit_rss["to_s"] / 60]
        ax.plot(
            ends,
            [fit_rss["intercept"] + fit_rss["slope_per_min"] * m for m in ends],
            color="black",
            linestyle="--",
            label=f"fit after warm-up: {slope:+.2f} MiB/min",
        )
        ax.set_ylim(fit_rss["min"] - 80, max(rss_mib) + 40)
        ax.text(
            0.01,
            0.03,
            f"at 0 s: {rss_mib[0]:,.0f} MiB (before the first request)",
            transform=ax.transAxes,
            fontsize=8,
        )
    ax.set_ylabel("RSS (MiB)")
    host = ax.twinx()
    host.step(*_series(samples, "host_mib"), where="post", color="tab:orange", alpha=0.5, lw=1)
    host.plot(*_series(samples, "host_capacity_mib"), color="tab:orange", linestyle=":")
    host.set_ylabel("host adapter tier (MiB; dotted: its bound)", color="tab:orange")
    host.set_ylim(0, 4 * max(s.get("host_capacity_mib", 1) for s in samples))  # lower quarter
    ax.legend(loc="upper left", fontsize=8)


def _plot_rates(ax, bins: list[dict], offered: float) -> None:
    t = [b["t_s"] / 60 for b in bins]
    width = (t[1] - t[0]) * 0.9 if len(t) > 1 else 0.1
    bottom = [0.0] * len(bins)
    for cls, color in (("ok", "tab:green"), ("4xx", "tab:olive"), ("failed", "tab:red")):
        values = [b.get(cls, 0.0) for b in bins]
        ax.bar(t, values, width=width, bottom=bottom, color=color, label=cls)
        bottom = [a + b for a, b in zip(bottom, values, strict=True)]
    ax.axhline(offered, color="0.4", linestyle=":", label=f"offered {offered}/s")
    ax.set_ylabel("responses/s")
    ax.legend(loc="lower right", fontsize=8, ncol=4)


def _plot_resources(ax, samples: list[dict], bound: int) -> None:
    ax.plot(*_series(samples, "fds"), color="tab:purple", marker=".", label="open fds")
    ax.plot(*_series(samples, "threads"), color="tab:brown", marker=".", label="threads")
    ax.set_ylabel("fds, threads")
    adapters = ax.twinx()
    adapters.plot(*_series(samples, "registered_adapters"), color="tab:cyan", label="registered")
    adapters.plot(*_series(samples, "host_adapters"), color="tab:orange", label="in host RAM")
    adapters.plot(*_series(samples, "device_adapters"), color="tab:green", label="on device")
    adapters.axhline(bound, color="tab:cyan", linestyle=":", label="registration bound")
    adapters.set_ylabel("adapter versions in the engine")
    top = max([bound, *(s.get("registered_adapters", 0) for s in samples)])
    adapters.set_ylim(0, top * 1.4)  # headroom for the legend
    ax.set_ylim(0, max(s.get("fds", 0) for s in samples) * 1.4)
    lines = ax.get_legend_handles_labels()[0] + adapters.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + adapters.get_legend_handles_labels()[1]
    ax.legend(lines, labels, loc="upper left", fontsize=8, ncol=3)


CHURN_COLORS = {"upload": "tab:green", "version": "tab:blue", "delete": "tab:red"}


def _plot_churn(ax, events: list[dict]) -> None:
    actions = list(CHURN_COLORS)
    ax.eventplot(
        [[e["started_s"] / 60 for e in events if e["action"] == a] for a in actions],
        colors=list(CHURN_COLORS.values()),
        lineoffsets=range(len(actions)),
        linelengths=0.8,
    )
    ax.set_yticks(range(len(actions)), ["new adapter", "new version", "delete"])
    ax.set_ylabel("churn")


def _mark(ok: bool) -> str:
    return "ok" if ok else "**FAILED**"


def _fmt(value, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def render_markdown(report: dict, plot_name: str) -> str:
    sections = (
        _md_header(report),
        _md_requests(report),
        _md_churn(report),
        _md_resources(report),
        _md_billing(report),
        _md_ending(report),
        [f"![RSS, responses/s, fds and threads, churn acts over the run]({plot_name})", ""],
    )
    return "\n".join(line for section in sections for line in section)


def _md_header(report: dict) -> list[str]:
    c, m, v = report["config"], report["machine"], report["verdict"]
    loads = [s["load1"] for s in report["samples"]]
    lines = [
        "# Soak: loramux serve under steady load with adapter churn",
        "",
        f"{m['date']}, {m['cpu_model']} ({m['nproc']} cores), {m['mem_total_gib']} GiB; "
        f"commit {report['code']['commit']} (working tree: {report['code']['changed_files']} "
        f"files changed or new); model `{Path(c['model']).name}`; server ready in "
        f"{report['server_start_s']} s. "
        f"{c['duration']:.0f} s of load: {c['concurrency']} clients at {c['rate']} requests/s "
        f"offered, a churn act every {c['churn_interval']} s, a sample every "
        f"{c['sample_interval']} s; host adapter tier bound (`LORAMUX_ADAPTER_HOST_BYTES`) "
        f"{c['adapter_host_bytes'] / MIB:.0f} MiB, everything else the embedded default.",
        "",
        "The soak is about growth and errors, not speed: the machine was shared with other "
        f"work (1-minute load average during the run {min(loads):.1f} to {max(loads):.1f} "
        f"on {m['nproc']} cores), so latencies and throughput are whatever was left.",
        "",
        f"**Verdict: {'passed' if v['passed'] else 'FAILED'}.**",
        "",
        "| check | result |",
        "|---|---|",
    ]
    lines += [f"| {name} | {_mark(ok)} |" for name, ok in v["checks"].items()]
    return [*lines, ""]


def _md_requests(report: dict) -> list[str]:
    counts, c = report["counts"], report["config"]
    statuses = sorted(counts["by_status"])
    lines = [
        "## Requests",
        "",
        f"{counts['requests']} requests in {c['duration']:.0f} s "
        f"({counts['requests'] / c['duration']:.2f}/s achieved); by target: "
        + ", ".join(f"{k} {n}" for k, n in sorted(counts["by_target"].items()))
        + f". 404s for an adapter the churn deleted while the request was under way "
        f"(expected): {counts['expected_404']}; 5xx, transport and stream errors: "
        f"{len(counts['failures'])}; other 4xx: {len(counts['unexpected_4xx'])}.",
        "",
        "| kind | " + " | ".join(statuses) + " |",
        "|---|" + "---|" * len(statuses),
    ]
    for kind, by_status in counts["by_kind"].items():
        lines.append(f"| {kind} | " + " | ".join(str(by_status.get(s, 0)) for s in statuses) + " |")
    lines.append("| **all** | " + " | ".join(str(counts["by_status"][s]) for s in statuses) + " |")
    for o in (counts["failures"] + counts["unexpected_4xx"])[:10]:
        lines.append(
            f"- at {o['picked_s']:.1f} s: {o['kind']} on {o['tenant']}/{o['model']}: "
            f"{o['status']} {o['error']}"
        )
    return [*lines, ""]


def _md_churn(report: dict) -> list[str]:
    samples, v = report["samples"], report["verdict"]
    first, last = samples[0], samples[-1]
    acts = ", ".join(f"{k}: {n}" for k, n in sorted(report["counts"]["churn"].items()))
    tiers = ", ".join(f"{k} {n}" for k, n in sorted(last.get("adapters_by_tier", {}).items()))
    return [
        "## Adapter churn",
        "",
        f"Acts (action status: count): {acts}. Over the run the engine loaded adapters "
        f"{_fmt(last.get('adapter_loads', 0) - first.get('adapter_loads', 0), 0)} times and "
        f"evicted {_fmt(last.get('adapter_evictions', 0) - first.get('adapter_evictions', 0), 0)} "
        f"(both tiers); the host tier held at most "
        f"{_fmt(max(s.get('host_mib', 0) for s in samples))} MiB of its "
        f"{_fmt(last.get('host_capacity_mib'), 0)} MiB bound. Adapter versions registered in "
        f"the engine: at most {v['registered_max']} (bound {v['registered_bound']}: the "
        "latest version of every adapter that can be live, plus one per client for a request "
        f"still on an older one), {last.get('registered_adapters')} at the end ({tiers}; "
        "`store`: registered, resident nowhere)."
        + (
            " Above the bound, versions no request can reach any more (superseded by a new "
            "version) stay registered in the engine: they grow with the uploads."
            if v["registered_max"] > v["registered_bound"]
            else ""
        ),
        "",
    ]


def _md_resources(report: dict) -> list[str]:
    v, samples = report["verdict"], report["samples"]
    first, last = samples[0], samples[-1]
    lines = [
        f"## Memory and resources (steady part: from {v['warmup_s']:.0f} s)",
        "",
        "| figure | at 0 s | steady start | end | min | max | slope /min | 2nd-half slope "
        "/min | fitted rise | tolerance | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, label in (("rss_mib", "RSS (MiB)"), ("fds", "open fds"), ("threads", "threads")):
        f = v["fits"][key]
        if f is None:
            continue
        ok = f["fitted_rise"] <= v["tolerances"][key]
        lines.append(
            f"| {label} | {_fmt(first.get(key))} | {_fmt(f['first'])} | {_fmt(f['last'])} "
            f"| {_fmt(f['min'])} | {_fmt(f['max'])} | {f['slope_per_min']:+.2f} "
            f"| {_fmt(f['second_half_slope_per_min'], 2)} | {f['fitted_rise']:+.1f} "
            f"| {v['tolerances'][key]:g} | {_mark(ok)} |"
        )
    rss = v["fits"]["rss_mib"]
    parts = last.get("data_dir_parts_mib", {})
    lines += [
        "",
        f"Peak RSS (VmHWM) {_fmt(last.get('hwm_mib'))} MiB. RSS scatter around the fit: "
        f"{_fmt(rss and rss['residual_std'], 2)} MiB (std). Server CPU time "
        f"{_fmt(last.get('cpu_s', 0) - first.get('cpu_s', 0), 0)} s over the load. Data dir "
        f"{_fmt(first.get('data_dir_mib'), 2)} MiB at the start, {_fmt(last.get('data_dir_mib'), 2)} "
        "at the end (" + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()) + " MiB): the "
        "database grows by one usage row per request (by design); the store is "
        "content-addressed and the churn re-uploads the same pool of adapters.",
        "",
    ]
    return lines


def _md_billing(report: dict) -> list[str]:
    b = report["billing"]
    done, cut = b["completed"], b["dropped"]
    lines = [
        "## Billing",
        "",
        f"`/admin/usage?group_by=request` against what the API returned: {b['requests_billed']} "
        f"requests billed, {b['requests_returned']} returned usage; "
        f"{b['mismatch_count']} requests differ, {len(b['billed_but_not_returned'])} billed "
        f"that no client saw; {b['requests_without_tokens']} delivered no token (a stream "
        "dropped after its first, empty chat chunk) and are not billed, as documented.",
        "",
        f"| completed requests ({done['requests']}) | returned | billed |",
        "|---|---|---|",
    ]
    lines += [f"| {f} | {done['returned'][f]:,} | {done['billed'][f]:,} |" for f in USAGE_FIELDS]
    lines += [
        f"| dropped streams ({cut['requests']}): completion tokens received / billed "
        f"| {cut['tokens_received']:,} | {cut['tokens_billed']:,} |",
        "",
    ]
    return lines


def _md_ending(report: dict) -> list[str]:
    end, db = report["ending"], report["database"]
    shutdown = end["shutdown"]
    return [
        "## Shutdown and what is left",
        "",
        f"SIGTERM after the load: exit status {shutdown['exit_code']} after "
        f"{_fmt(shutdown['seconds'], 2)} s, "
        f"{'graceful (uvicorn finished, then re-raised the signal)' if shutdown['graceful'] else 'NOT graceful'}"
        f"{' (killed)' if shutdown['needed_kill'] else ''}. "
        f"Adapter versions by status: {db['versions_by_status']}; adapters live "
        f"{db['adapters_live']}, deleted {db['adapters_deleted']}; provisional usage rows "
        f"{db['provisional_usage_rows']}; left in tmp/uploads or TMPDIR: "
        f"{end['leftovers'] or 'nothing'}. Error lines in the server log: "
        f"{len(report['server_log_errors'])}; failed samples: {len(report['sample_errors'])}.",
        "",
    ]


# --- the run ---------------------------------------------------------------------------------


def resolve_model(args: argparse.Namespace) -> Path:
    return args.model if args.model is not None else prepare_model(args.cache_dir)


def run_load(args, server: Server, catalog: Catalog, pool: list[PoolAdapter]) -> tuple:
    """The clients, the churn and the sampler for ``args.duration`` seconds."""
    ledger, stop, sampling = Ledger(time.monotonic()), threading.Event(), threading.Event()
    sampler = Sampler(server, ledger, args.sample_interval, sampling)
    workers = [LoadClient(i, server, catalog, ledger, args, stop) for i in range(args.concurrency)]
    workers.append(Churner(server, catalog, ledger, pool, args, stop))
    for thread in (sampler, *workers):
        thread.start()
    stop.wait(args.duration)
    stop.set()
    join_all(workers)  # requests under way finish; nothing new starts
    sampling.set()
    join_all([sampler])
    with httpx.Client(base_url=server.url, timeout=60) as client:
        sampler.take(client)  # after the load: everything idle again
    return ledger, sampler


TORCH_CACHE_PREFIX = "torchinductor_"  # torch's per-user cache folder in TMPDIR, kept by design


def leftovers(server: Server) -> list[str]:
    """What uploads and requests left behind: anything in the upload workspace, anything
    in the server's TMPDIR but torch's cache folder."""
    uploads = server.data_dir / "tmp" / "uploads"
    found = (
        [f"tmp/uploads/{name}" for name in sorted(os.listdir(uploads))] if uploads.is_dir() else []
    )
    return found + [
        f"TMPDIR/{name}"
        for name in sorted(os.listdir(server.tmp_dir))
        if not name.startswith(TORCH_CACHE_PREFIX)
    ]


def run_soak(args, model_dir: Path, pool: list[PoolAdapter], root: Path) -> dict:
    code = code_version()  # what the server is started from
    with start_server(args, model_dir, root) as server:
        print(f"loramux serve ready in {server.started_s:.1f} s at {server.url}", flush=True)
        tenants = create_tenants(server)
        catalog = Catalog(tenants, base_model_id(server))
        upload_stable(server, tenants, pool)
        print(f"load: {args.duration:.0f} s, {args.concurrency} clients, {args.rate}/s", flush=True)
        ledger, sampler = run_load(args, server, catalog, pool)
        billing = check_billing(server, ledger)
        shutdown = stop_server(server)
        ending = {"shutdown": shutdown, "leftovers": leftovers(server)}
        errors, log_tail = log_errors(server), server.public_log_tail()
        db = read_database(server.data_dir)
        started_s = server.started_s
    counts = classify(ledger)
    verdict = judge(args, sampler.samples, counts, billing, db, ending)
    return {
        "benchmark": "soak",
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": str(model_dir),
            "tenants": TENANTS,
            "stable_adapters_per_tenant": STABLE_ADAPTERS,
            "max_churned_per_tenant": MAX_CHURNED,
            "pool": [{"rank": a.rank, "targets": list(a.targets)} for a in pool],
            "kinds": {k.name: k.weight for k in KINDS},
            "targets": TARGETS,
        },
        "machine": machine_info(),
        "code": code,
        "server_start_s": round(started_s, 2),
        "samples": sampler.samples,
        "sample_errors": sampler.errors,
        "churn_events": [asdict(e) for e in ledger.events],
        "rate_bins": rate_bins(ledger, args.sample_interval),
        "counts": counts,
        "billing": billing,
        "database": db,
        "ending": ending,
        "server_log_errors": errors[:50],
        "server_log_tail": log_tail,
        "verdict": verdict,
    }


def rate_bins(ledger: Ledger, width: float) -> list[dict]:
    """Requests finished per second in each ``width``-second bin, by class (the last bin
    over the time it covers)."""
    bins: dict[int, Counter] = {}
    for o in ledger.outcomes:
        cls = "failed" if is_failure(o) else "ok" if o.status == "200" else "4xx"
        bins.setdefault(int(o.finished_s // width), Counter())[cls] += 1
    end_s = max((o.finished_s for o in ledger.outcomes), default=0.0)
    spans = {k: max(min(width, end_s - k * width), 1e-3) for k in bins}
    return [
        {"t_s": (k + 0.5) * width, **{c: n / spans[k] for c, n in sorted(bins[k].items())}}
        for k in sorted(bins)
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = resolve_model(args)
    pool = prepare_pool(model_dir, args.cache_dir)
    with tempfile.TemporaryDirectory(prefix="loramux-soak-") as root:
        report = run_soak(args, model_dir, pool, Path(root))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"soak_{device_name()}"
    write_atomic(stem.with_suffix(".json"), json.dumps(report, indent=2, default=float) + "\n")
    write_plot(report, stem.with_suffix(".png"))
    markdown = render_markdown(report, stem.with_suffix(".png").name)
    write_atomic(stem.with_suffix(".md"), markdown)
    print(markdown)
    return 0 if report["verdict"]["passed"] else 1


def code_version() -> dict:
    """The commit the server ran and how many files of the working tree differed from it
    (other work in progress is served too)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "changed_files": len(git("status", "--porcelain").splitlines()),
    }


def device_name() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    sys.exit(main())
