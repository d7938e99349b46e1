"""The soak's load: paced clients sending completions and chat (plain, streamed, dropped
mid-stream after a half-close, tiny ``max_tokens``) over the base model, the stable
adapters and the churned ones, each response recorded in the ledger.

Part of the soak (``soak.py``).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from loramux.benchmarks.prompts import QUESTIONS
from loramux.benchmarks.soak_ledger import Ledger, Outcome
from loramux.benchmarks.soak_server import REQUEST_TIMEOUT_S, Server
from loramux.benchmarks.soak_tenants import Catalog, Tenant
from loramux.benchmarks.soak_worker import Worker


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
