"""The soak's load: three tenants and their adapters, the paced clients, the adapter churn and
the sampler, each a thread, and the ledger of every response and churn act they record."""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loramux.benchmarks.common.adapters import ALL_SEVEN, QKVO, AdapterSpec, prepare_adapters
from loramux.benchmarks.common.bench_server import (
    add_adapter,
    bearer,
    create_tenant,
    served_model,
    upload_adapter,
)
from loramux.benchmarks.common.prompts import QUESTIONS
from loramux.benchmarks.common.serve_process import Server
from loramux.benchmarks.soak.server import REQUEST_TIMEOUT_S, take_sample

QV = ("q_proj", "v_proj")
# The adapters uploads draw from: small ranks over three target sets.
POOL_SHAPES = ((4, QV), (8, QKVO), (16, QKVO), (4, ALL_SEVEN), (8, ALL_SEVEN), (16, QV))


def _tenant(name: str, priority: int, weight: float, input_price: float, output_price, **more):
    prices = {"input_price_per_mtok": input_price, "output_price_per_mtok": output_price}
    return {"name": name, "priority": priority, "weight": weight, **prices, **more}


# Three tenants: priorities, weights and prices differ; silver has a monthly budget and
# rate limits far above what the soak sends, so every request takes and releases a budget
# hold and limiter reservations without ever being refused.
LIMITS = {"monthly_budget_usd": 1000.0, "requests_per_minute": 100_000, "tokens_per_minute": 10**7}
TENANTS = (
    _tenant("gold", 7, 2.0, 1.5, 6.0, cached_input_price_per_mtok=0.5),
    _tenant("silver", 5, 1.0, 2.0, 3.0, **LIMITS),
    _tenant("bronze", 5, 0.5, 0.25, 11.0),
)
STABLE_ADAPTERS = 2  # per tenant: uploaded before the load, never deleted (new versions at times)
STABLE = tuple(f"stable-{k}" for k in range(STABLE_ADAPTERS))
MAX_CHURNED = 4  # live churned adapters per tenant; past this the churn deletes the oldest
CHURN_NAMES = 6  # churned names cycle through churn-0..5: a deleted name is uploaded again


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
SAMPLE_TIMEOUT_S = 60.0
DROPPED_MAX_TOKENS = 64  # with ignore_eos: the stream is still going when the client leaves


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
    status: str = ""  # the HTTP status or "transport"
    error: str | None = None  # a transport error
    version: int | None = None
    adapter: str | None = None  # the pool adapter's shape


@dataclass
class Ledger:
    """What the load's threads record (a list's append is atomic: they need no lock)."""

    t0: float  # the load's start, time.monotonic()
    outcomes: list[Outcome] = field(default_factory=list)
    events: list[ChurnEvent] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    @contextlib.contextmanager
    def recording(self, item: Outcome | ChurnEvent, *errors: type[Exception]):
        """Around sending ``item``'s request: an error of httpx or of ``errors`` is a
        transport error; then ``item`` is timed and recorded."""
        try:
            yield
        except (httpx.HTTPError, *errors) as exc:
            item.status, item.error = "transport", f"{type(exc).__name__}: {exc}"[:300]
        item.finished_s = self.now()
        (self.outcomes if isinstance(item, Outcome) else self.events).append(item)


@dataclass
class Tenant:
    name: str
    id: str
    key: str
    # The live churned names, oldest first, and the one uploaded (or re-versioned) last: the
    # churn is their only writer and replaces them whole, so clients read them without a lock.
    churned: tuple[str, ...] = ()
    fresh: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.key)

    def pick(self, rng: random.Random, target: str, base_model: str) -> tuple[str, str]:
        """(what was picked: base, stable, fresh or churned; the model name)."""
        churned, fresh = self.churned, self.fresh
        if target == "churned" and churned:
            if fresh in churned and rng.random() < 0.5:
                return "fresh", fresh
            return "churned", rng.choice(churned)
        if target == "base":
            return "base", base_model
        return "stable", rng.choice(STABLE)


def prepare_pool(model_dir: Path, cache_dir: Path) -> list[AdapterSpec]:
    """One adapter per ``POOL_SHAPES`` entry for ``model_dir``, written once into the cache."""
    return prepare_adapters(cache_dir, model_dir, POOL_SHAPES, len(POOL_SHAPES), seed=7000)


def setup_tenants(server: Server, pool: list[AdapterSpec]) -> tuple[list[Tenant], str]:
    """The tenants, each with an API key and its stable adapters uploaded and ready; the
    base model's name."""
    tenants = []
    with httpx.Client(
        base_url=server.url, headers=server.admin, timeout=REQUEST_TIMEOUT_S
    ) as client:
        for t, body in enumerate(TENANTS):
            made = create_tenant(client, body)
            tenants.append(Tenant(body["name"], made["id"], made["key"]))
            for k, name in enumerate(STABLE):
                adapter = pool[(t * STABLE_ADAPTERS + k) % len(pool)]
                add_adapter(client, made["key"], name, adapter.path, f"{body['name']}/{name}")
        return tenants, served_model(client)  # an operator sees the base model only


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


def error_code(body: bytes) -> str:
    """An error response's ``error.code``, or the start of its body."""
    text = body.decode(errors="replace")
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return json.loads(text)["error"]["code"]
    return text[:200]


def sse_chunk(line: str | bytes) -> dict | None:
    text = (line.decode() if isinstance(line, bytes) else line).strip()
    if not text.startswith("data: ") or text == "data: [DONE]":
        return None
    return json.loads(text.removeprefix("data: "))


def settle_stream(chunks: list[dict], out: Outcome, dropped: bool) -> None:
    """A stream's outcome from its chunks: an error event, the usage chunk, or for a
    dropped stream that ended before it, the tokens received (counted from the chunks'
    logprobs, completion or chat shape)."""
    errors = [c["error"] for c in chunks if "error" in c]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    if errors or not chunks:
        out.status = "stream_error"
        out.error = json.dumps(errors[0])[:300] if errors else "no chunk arrived"
        return
    out.request_id = chunks[0]["id"]
    if usage:  # a dropped stream that finished before the client left is an ordinary one
        out.usage = returned_usage(usage[0])
    elif dropped:
        logprobs = [ch.get("logprobs") or {} for c in chunks for ch in c.get("choices") or []]
        out.delivered = sum(len(lp.get("tokens") or lp.get("content") or []) for lp in logprobs)
    else:
        out.status, out.error = "stream_error", "the stream ended without its usage chunk"


def send(client: httpx.Client, tenant: Tenant, path: str, body: dict, out: Outcome) -> None:
    """A request, streamed or not, read to its end."""
    with client.stream("POST", path, json=body, headers=tenant.headers) as response:
        out.status = str(response.status_code)
        if response.status_code != 200:
            out.error = error_code(response.read())
        elif body.get("stream"):
            chunks = [c for line in response.iter_lines() if (c := sse_chunk(line)) is not None]
            settle_stream(chunks, out, dropped=False)
        else:
            payload = json.loads(response.read())
            out.request_id, out.usage = payload["id"], returned_usage(payload["usage"])


def send_dropped(url: httpx.URL, tenant: Tenant, path: str, body: dict, drop_after: int, out):
    """Stream, leave after ``drop_after`` chunks, then read what the server still sent.

    The client half-closes its socket (the server sees it leave and stops the request) and
    keeps reading to the end, so it counts every token that reached it: what the request
    must be billed for. A plain HTTP client could not half-close."""
    conn = http.client.HTTPConnection(url.host, url.port, timeout=REQUEST_TIMEOUT_S)
    try:
        headers = {**tenant.headers, "Content-Type": "application/json"}
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        sock = conn.sock  # held here: http.client may forget it once the response starts
        response = conn.getresponse()
        out.status = str(response.status)
        if response.status != 200:
            out.error = error_code(response.read())
            return
        chunks = []
        with contextlib.suppress(http.client.HTTPException, OSError):  # the body ends early
            while line := response.readline():
                if (chunk := sse_chunk(line)) is not None:
                    chunks.append(chunk)
                    if len(chunks) == drop_after:
                        sock.shutdown(socket.SHUT_WR)
        settle_stream(chunks, out, dropped=True)
    finally:
        conn.close()


class LoadClient:
    """One client: a request every ``interval`` seconds (the next at once when late)."""

    def __init__(self, index: int, tenants: list[Tenant], base_model: str, ledger: Ledger, args):
        self.index, self.tenants, self.base_model, self.ledger = index, tenants, base_model, ledger
        self.interval = args.concurrency / args.rate
        self.rng = random.Random(args.seed * 1_000 + index)
        # When the last request was due: the clients' first ones are spread evenly.
        self.due = ledger.t0 + index * self.interval / args.concurrency - self.interval

    def pause(self) -> float:
        now = time.monotonic()
        self.due = max(self.due + self.interval, now)
        return self.due - now

    def act(self, client: httpx.Client) -> None:
        kind = self.rng.choices(KINDS, weights=[k.weight for k in KINDS])[0]
        tenant = self.rng.choice(self.tenants)
        target = self.rng.choices(list(TARGETS), weights=list(TARGETS.values()))[0]
        target, model = tenant.pick(self.rng, target, self.base_model)
        body, drop_after = request_body(kind, model, self.rng)
        out = Outcome(self.index, kind.name, tenant.name, target, model, self.ledger.now())
        with self.ledger.recording(out, http.client.HTTPException, OSError, ValueError):
            if kind.drop:
                send_dropped(client.base_url, tenant, PATHS[kind.api], body, drop_after, out)
            else:
                send(client, tenant, PATHS[kind.api], body, out)


class Churner:
    """Every ``interval`` seconds the next tenant in turn uploads a new adapter, uploads a
    new version of one, or deletes its oldest churned one.

    A name is taken out of the tenant's live ones before its delete is sent, so a client
    can only pick a deleted adapter between its pick and the delete: such a 404 is
    expected."""

    def __init__(self, tenants: list[Tenant], ledger: Ledger, pool: list[AdapterSpec], args):
        self.tenants, self.ledger, self.pool = tenants, ledger, pool
        self.interval = args.churn_interval
        self.rng = random.Random(args.seed * 1_000 + 999)
        self.acts = 0
        self.next_name = Counter()  # tenant -> index of its next churned name

    def pause(self) -> float:
        return self.interval

    def act(self, client: httpx.Client) -> None:
        tenant = self.tenants[self.acts % len(self.tenants)]
        live = tenant.churned
        turn = ("upload", "version", "delete")[(self.acts // len(self.tenants)) % 3]
        action = "delete" if len(live) >= MAX_CHURNED else turn if live else "upload"
        self.acts += 1
        if action == "upload":
            name = self.new_name(tenant, live)
        elif action == "version":  # of a stable adapter or a churned one, half and half
            name = self.rng.choice(STABLE if self.rng.random() < 0.5 else live)
        else:  # a delete takes the oldest churned one
            name = live[0]
        event = ChurnEvent(action, tenant.name, name, self.ledger.now())
        with self.ledger.recording(event):
            if action == "delete":
                tenant.churned = tuple(n for n in live if n != name)
                response = client.delete(f"/v1/adapters/{name}", headers=tenant.headers)
            else:
                adapter = self.rng.choice(self.pool)
                event.adapter = adapter.label
                response = upload_adapter(client, tenant.key, name, adapter.path)
                # 200: the same bytes as a ready version, which is then that version
                ready = response.status_code in (200, 201)
                if ready and response.json().get("status") == "ready":
                    event.version = response.json().get("version")
                    if name not in STABLE:  # the freshest (a stable name stays stable)
                        tenant.churned = live if name in live else (*live, name)
                        tenant.fresh = name
            event.status = str(response.status_code)

    def new_name(self, tenant: Tenant, live: tuple[str, ...]) -> str:
        while True:  # the next of churn-0..CHURN_NAMES-1 not live (MAX_CHURNED < CHURN_NAMES)
            k = self.next_name[tenant.name] % CHURN_NAMES
            self.next_name[tenant.name] += 1
            if f"churn-{k}" not in live:
                return f"churn-{k}"


class Sampler:
    """A sample (``take_sample``) at once, then every ``interval`` seconds."""

    def __init__(self, server: Server, ledger: Ledger, interval: float):
        self.server, self.ledger, self.interval = server, ledger, interval
        self.samples: list[dict] = []
        self.errors: list[str] = []

    def pause(self) -> float:
        return self.interval if self.samples else 0.0

    def act(self, client: httpx.Client) -> None:
        self.samples.append(take_sample(client, self.server, self.ledger.now(), self.errors))


def repeat(worker, url: str, stop: threading.Event, timeout_s: float = REQUEST_TIMEOUT_S):
    """A thread of the load: ``worker.act`` after every ``worker.pause()`` until ``stop``."""
    with httpx.Client(base_url=url, timeout=timeout_s) as client:
        while not stop.wait(worker.pause()):
            worker.act(client)


def run_load(args, server: Server, pool: list[AdapterSpec]) -> tuple[Ledger, Sampler]:
    """The tenants, then the clients, the churn and the sampler for ``args.duration`` s.

    A thread that crashed (a bug of the soak, not of the server) raises its error again
    once the load is over."""
    tenants, base_model = setup_tenants(server, pool)
    print(f"load: {args.duration:.0f} s, {args.concurrency} clients, {args.rate}/s", flush=True)
    ledger, stop, sampling = Ledger(time.monotonic()), threading.Event(), threading.Event()
    sampler = Sampler(server, ledger, args.sample_interval)
    workers = [LoadClient(i, tenants, base_model, ledger, args) for i in range(args.concurrency)]
    workers.append(Churner(tenants, ledger, pool, args))
    with ThreadPoolExecutor(len(workers) + 1, thread_name_prefix="soak") as threads:
        sampled = threads.submit(repeat, sampler, server.url, sampling, SAMPLE_TIMEOUT_S)
        loads = [threads.submit(repeat, worker, server.url, stop) for worker in workers]
        stop.wait(args.duration)
        stop.set()
        try:
            for load in loads:  # requests under way finish; nothing new starts
                load.result()
        finally:
            sampling.set()
        sampled.result()
    with httpx.Client(base_url=server.url, timeout=SAMPLE_TIMEOUT_S) as client:
        sampler.act(client)  # after the load: everything idle again
    return ledger, sampler
