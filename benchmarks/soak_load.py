"""The soak's load: the paced clients, the adapter churn and the sampler, each a thread;
the ledger they record every response and churn act in; the run of them all."""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from loramux.benchmarks.common.adapters import AdapterSpec
from loramux.benchmarks.common.prompts import QUESTIONS
from loramux.benchmarks.soak_server import REQUEST_TIMEOUT_S, Server, take_sample
from loramux.benchmarks.soak_tenants import Catalog, Tenant, setup_tenants, upload


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


class Worker(threading.Thread):
    """A thread of the load: ``act`` after every ``pause()`` until ``stop`` is set. A crash
    (a bug of the soak, not of the server) is kept and raised again by ``join_all``."""

    timeout_s = REQUEST_TIMEOUT_S

    def __init__(self, name: str, url: str, ledger: Ledger, interval: float, stop):
        super().__init__(name=name, daemon=True)
        self.url = url
        self.ledger = ledger
        self.interval = interval
        self.stop: threading.Event = stop
        self.crash: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=self.timeout_s) as client:
                while not self.stop.wait(self.pause()):
                    self.act(client)
        except BaseException as exc:
            self.crash = exc

    def pause(self) -> float:
        return self.interval

    @contextlib.contextmanager
    def recording(self, item: Outcome | ChurnEvent, *errors: type[Exception]):
        """Around sending ``item``'s request: an error of httpx or of ``errors`` is a
        transport error; then ``item`` is timed and recorded."""
        try:
            yield
        except (httpx.HTTPError, *errors) as exc:
            item.status, item.error = "transport", f"{type(exc).__name__}: {exc}"[:300]
        item.finished_s = self.ledger.now()
        (self.ledger.outcomes if isinstance(item, Outcome) else self.ledger.events).append(item)


class Sampler(Worker):
    """A sample (``take_sample``) at once, then every ``interval`` seconds until stopped."""

    timeout_s = 60.0

    def __init__(self, server: Server, ledger: Ledger, interval: float, stop):
        super().__init__("soak-sampler", server.url, ledger, interval, stop)
        self.server = server
        self.samples: list[dict] = []
        self.errors: list[str] = []

    def pause(self) -> float:
        return self.interval if self.samples else 0.0

    def act(self, client: httpx.Client) -> None:
        self.samples.append(take_sample(client, self.server, self.ledger.now(), self.errors))


def join_all(workers: list[Worker]) -> None:
    for worker in workers:
        worker.join()
    for worker in workers:
        if worker.crash is not None:
            raise RuntimeError(f"the soak's {worker.name} thread crashed") from worker.crash


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
MAX_CHURNED = 4  # live churned adapters per tenant; past this the churn deletes the oldest
CHURN_NAMES = 6  # churned names cycle through churn-0..5: a deleted name is uploaded again


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


def error_code(body: str) -> str:
    """An error response's ``error.code``, or the start of its body."""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return json.loads(body)["error"]["code"]
    return body[:200]


def sse_chunk(line: str | bytes) -> dict | None:
    text = (line.decode() if isinstance(line, bytes) else line).strip()
    if not text.startswith("data: ") or text == "data: [DONE]":
        return None
    return json.loads(text.removeprefix("data: "))


def chunk_tokens(chunk: dict) -> int:
    """Tokens a streamed chunk carries, from its logprobs (completion or chat shape)."""
    logprobs = [choice.get("logprobs") or {} for choice in chunk.get("choices") or []]
    return sum(len(lp.get("tokens") or lp.get("content") or []) for lp in logprobs)


def settle_stream(chunks: list[dict], out: Outcome, dropped: bool) -> None:
    """A stream's outcome from its chunks: an error event, the usage chunk, or for a
    dropped stream that ended before it, the tokens received."""
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
        out.delivered = sum(map(chunk_tokens, chunks))
    else:
        out.status, out.error = "stream_error", "the stream ended without its usage chunk"


def send(client: httpx.Client, tenant: Tenant, path: str, body: dict, out: Outcome) -> None:
    """A request, streamed or not, read to its end."""
    with client.stream("POST", path, json=body, headers=tenant.headers) as response:
        out.status = str(response.status_code)
        if response.status_code != 200:
            out.error = error_code(response.read().decode(errors="replace"))
        elif body.get("stream"):
            chunks = [c for line in response.iter_lines() if (c := sse_chunk(line)) is not None]
            settle_stream(chunks, out, dropped=False)
        else:
            payload = json.loads(response.read())
            out.request_id, out.usage = payload["id"], returned_usage(payload["usage"])


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
            out.error = error_code(response.read().decode(errors="replace"))
            return
        chunks = []
        with contextlib.suppress(http.client.HTTPException, OSError):  # the body ends early
            while line := response.readline():
                chunk = sse_chunk(line)
                if chunk is not None:
                    chunks.append(chunk)
                    if len(chunks) == drop_after:
                        sock.shutdown(socket.SHUT_WR)
        settle_stream(chunks, out, dropped=True)
    finally:
        conn.close()


class LoadClient(Worker):
    """One client: a request every ``interval`` seconds (the next at once when late)."""

    def __init__(self, index: int, server: Server, catalog: Catalog, ledger: Ledger, args, stop):
        interval = args.concurrency / args.rate
        super().__init__(f"soak-client-{index}", server.url, ledger, interval, stop)
        self.index = index
        self.catalog = catalog
        self.rng = random.Random(args.seed * 1_000 + index)
        # When the last request was due: the clients' first ones are spread evenly.
        self.due = ledger.t0 + index * interval / args.concurrency - interval

    def pause(self) -> float:
        now = time.monotonic()
        self.due = max(self.due + self.interval, now)
        return self.due - now

    def act(self, client: httpx.Client) -> None:
        kind = self.rng.choices(KINDS, weights=[k.weight for k in KINDS])[0]
        tenant = self.rng.choice(self.catalog.tenants)
        target = self.rng.choices(list(TARGETS), weights=list(TARGETS.values()))[0]
        target, model = self.catalog.pick(self.rng, tenant, target)
        body, drop_after = request_body(kind, model, self.rng)
        out = Outcome(self.index, kind.name, tenant.name, target, model, self.ledger.now())
        with self.recording(out, http.client.HTTPException, OSError, ValueError):
            if kind.drop:
                send_dropped(self.url, tenant, PATHS[kind.api], body, drop_after, out)
            else:
                send(client, tenant, PATHS[kind.api], body, out)


class Churner(Worker):
    """Every ``interval`` seconds the next tenant in turn uploads a new adapter, uploads a
    new version of one, or deletes its oldest churned one."""

    def __init__(self, server: Server, catalog: Catalog, ledger: Ledger, pool, args, stop):
        super().__init__("soak-churn", server.url, ledger, args.churn_interval, stop)
        self.catalog = catalog
        self.pool = pool
        self.rng = random.Random(args.seed * 1_000 + 999)
        self.acts = 0
        self.next_name = Counter()  # tenant -> index of its next churned name

    def act(self, client: httpx.Client) -> None:
        tenants = self.catalog.tenants
        tenant = tenants[self.acts % len(tenants)]
        live = list(tenant.churned)  # the churn is its only writer: no lock to read
        turn = ("upload", "version", "delete")[(self.acts // len(tenants)) % 3]
        action = "delete" if len(live) >= MAX_CHURNED else turn if live else "upload"
        self.acts += 1
        if action == "upload":
            name = self.new_name(tenant, live)
        elif action == "version":  # of a stable adapter or a churned one, half and half
            name = self.rng.choice(tenant.stable if self.rng.random() < 0.5 else live)
        else:  # a delete takes the oldest churned one
            name = live[0]
        event = ChurnEvent(action, tenant.name, name, self.ledger.now())
        with self.recording(event):
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

    def new_name(self, tenant: Tenant, live: list[str]) -> str:
        while True:  # the next of churn-0..CHURN_NAMES-1 not live (MAX_CHURNED < CHURN_NAMES)
            k = self.next_name[tenant.name] % CHURN_NAMES
            self.next_name[tenant.name] += 1
            if f"churn-{k}" not in live:
                return f"churn-{k}"


def run_load(args, server: Server, pool: list[AdapterSpec]) -> tuple[Ledger, Sampler]:
    """The tenants, then the clients, the churn and the sampler for ``args.duration`` s."""
    catalog = setup_tenants(server, pool)
    print(f"load: {args.duration:.0f} s, {args.concurrency} clients, {args.rate}/s", flush=True)
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
    with httpx.Client(base_url=server.url, timeout=sampler.timeout_s) as client:
        sampler.act(client)  # after the load: everything idle again
    return ledger, sampler
