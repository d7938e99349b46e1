"""Billing exactness: several tenants with different prices send a mix of non-streamed,
streamed, dropped and failed requests over HTTP; the billing export then equals, tenant by
tenant, the client-side sums of what the API returned (exact integers).

A dropped stream returns no ``usage``: what it returned is the tokens it delivered before
the client went away. The client counts those itself (each completion chunk asked with
``logprobs`` lists its tokens), half-closing its socket and reading to the end so that it
sees every byte the server sent.
"""

from __future__ import annotations

import csv
import io
import json
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import urlsplit

import h11
import httpx
import openai
import pytest

from loramux.platform.settings import Settings
from tests.platform.e2e.conftest import Platform, Tenant, start_platform

# Prompts shorter than one KV block (16 tokens): never served from the prefix cache, so a
# dropped stream's cost follows from its prompt and delivered tokens alone.
PROMPTS = ("The quick brown fox", "Once upon a time", "In a hole in the ground")
METRICS = ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens")
PRICES = (  # USD per million tokens: (input, cached input, output)
    (1.5, 0.5, 7.0),
    (2.0, 2.0, 3.0),
    (0.25, 0.1, 11.0),
)


@pytest.fixture
def platform(tmp_path, tiny_model_dir, postgres_database_url) -> Platform:
    settings = Settings(
        data_dir=tmp_path, model=str(tiny_model_dir), database_url=postgres_database_url
    )
    with start_platform(settings) as running:
        yield running


@dataclass
class Ledger:
    """What the client saw: usage objects returned, and dropped streams it counted itself."""

    tenant: Tenant
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_micro_usd: int = 0
    requests: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # request id -> tokens delivered

    def add(self, usage) -> None:
        assert usage is not None
        extra = usage.model_extra if hasattr(usage, "model_extra") else {}
        cost = extra["cost_micro_usd"] if extra else usage["cost_micro_usd"]
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        self.requests += 1
        self.prompt_tokens += usage.prompt_tokens
        self.cached_prompt_tokens += cached
        self.completion_tokens += usage.completion_tokens
        self.cost_micro_usd += cost
        assert cost == expected_cost(
            self.tenant, usage.prompt_tokens, cached, usage.completion_tokens
        )

    def add_dropped(self, request_id: str, prompt_tokens: int, delivered: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += delivered
        self.cost_micro_usd += expected_cost(self.tenant, prompt_tokens, 0, delivered)
        self.dropped[request_id] = delivered

    def totals(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cost_micro_usd": self.cost_micro_usd,
        }


def expected_cost(tenant: Tenant, prompt: int, cached: int, completion: int) -> int:
    """The price list's arithmetic, done independently: whole micro-dollars, rounded down."""
    rate = {k: round(v * 1_000_000) for k, v in tenant.prices.items()}
    millionths = (
        (prompt - cached) * rate["input_price_per_mtok"]
        + cached * rate["cached_input_price_per_mtok"]
        + completion * rate["output_price_per_mtok"]
    )
    return millionths // 1_000_000


def dropped_stream(url: str, key: str, body: dict, read_chunks: int) -> tuple[str, int, int]:
    """Stream a completion, go away after ``read_chunks`` chunks; (id, chunks, tokens seen).

    The client half-closes (the server sees it leave) and then reads to the end of what the
    server sent, so it counts every token delivered to it.
    """
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    conn = h11.Connection(our_role=h11.CLIENT)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    events: list[dict] = []
    buffer = b""

    def pump() -> bool:
        nonlocal buffer
        data = sock.recv(65536)
        conn.receive_data(data)
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:  # the body ends early: the server stopped
                return False
            if event in (h11.NEED_DATA, h11.PAUSED) or isinstance(event, h11.EndOfMessage):
                break
            if isinstance(event, h11.Response):
                assert event.status_code == 200, event
            elif isinstance(event, h11.Data):
                buffer += bytes(event.data)
                while b"\n\n" in buffer:
                    raw, buffer = buffer.split(b"\n\n", 1)
                    text = raw.decode().removeprefix("data: ")
                    if text != "[DONE]":
                        events.append(json.loads(text))
            elif isinstance(event, h11.ConnectionClosed):
                return False
        return bool(data)

    try:
        request = h11.Request(
            method="POST",
            target="/v1/completions",
            headers=[
                ("Host", parts.netloc),
                ("Authorization", f"Bearer {key}"),
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(payload))),
            ],
        )
        sock.sendall(conn.send(request) + conn.send(h11.Data(data=payload)))
        sock.sendall(conn.send(h11.EndOfMessage()))
        while len(events) < read_chunks:
            assert pump(), "the stream ended before the client dropped it"
        sock.shutdown(socket.SHUT_WR)  # the client leaves ...
        while pump():  # ... and keeps whatever already reached it
            pass
    finally:
        sock.close()
    assert all("error" not in e for e in events), events
    assert all(e["choices"][0]["finish_reason"] is None for e in events)  # truly cut short
    tokens = sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events)
    return events[0]["id"], len(events), tokens


def run_mix(platform: Platform, ledger: Ledger, client: openai.OpenAI, turn: int) -> None:
    """One tenant's traffic; every usage the API returns goes into the ledger."""
    base = platform.base_model
    prompt = PROMPTS[turn % len(PROMPTS)]

    # non-streamed: completions (n=1 and n=2) and chat
    ledger.add(client.completions.create(model=base, prompt=prompt, max_tokens=5 + turn).usage)
    ledger.add(client.completions.create(model=base, prompt=prompt, max_tokens=3, n=2).usage)
    chat = client.chat.completions.create(
        model=base, messages=[{"role": "user", "content": prompt}], max_tokens=6
    )
    ledger.add(chat.usage)

    # streamed with include_usage: the final chunk's usage
    for kind in ("completion", "chat"):
        if kind == "completion":
            stream = client.completions.create(
                model=base,
                prompt=prompt,
                max_tokens=7,
                stream=True,
                stream_options={"include_usage": True},
            )
        else:
            stream = client.chat.completions.create(
                model=base,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=4 + turn,
                stream=True,
                stream_options={"include_usage": True},
            )
        usages = [chunk.usage for chunk in stream if chunk.usage is not None]
        assert len(usages) == 1
        ledger.add(usages[0])

    # dropped streams: billed for the delivered tokens only
    prompt_tokens = client.completions.create(model=base, prompt=prompt, max_tokens=1).usage
    ledger.add(prompt_tokens)
    for read_chunks in (1, 3 + turn):
        body = {
            "model": base,
            "prompt": prompt,
            "max_tokens": 400,
            "stream": True,
            "logprobs": 1,
            "temperature": 1.0,
        }
        request_id, _, delivered = dropped_stream(
            platform.url, ledger.tenant.key, body, read_chunks
        )
        assert 1 <= delivered < 400
        ledger.add_dropped(request_id, prompt_tokens.prompt_tokens, delivered)

    # failed requests add nothing
    with pytest.raises((openai.BadRequestError, openai.UnprocessableEntityError)):
        client.completions.create(model=base, prompt=prompt, max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=base, prompt="word " * 2000, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=prompt, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-adapter", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )


def rate_limited(platform: Platform, ledger: Ledger, client: openai.OpenAI) -> None:
    """Throttle the tenant to one request a minute: the request after is a 429, unbilled."""
    patched = httpx.patch(
        f"{platform.url}/admin/tenants/{ledger.tenant.id}",
        json={"requests_per_minute": 1},
        headers=platform.admin,
    )
    assert patched.status_code == 200, patched.text
    refused = 0
    for _ in range(3):
        try:
            ledger.add(
                client.completions.create(
                    model=platform.base_model, prompt=PROMPTS[0], max_tokens=3
                ).usage
            )
        except openai.RateLimitError:
            refused += 1
    assert refused == 2  # a full bucket of one lets the first through, then refuses


def wait_for_records(platform: Platform, ledger: Ledger) -> dict[str, dict]:
    """Dropped streams are recorded when the server notices the client left: wait for them."""
    deadline = time.monotonic() + 30
    while True:
        rows = platform.admin_usage(tenant_id=ledger.tenant.id, group_by="request").json()["rows"]
        by_id = {row["request_id"]: row for row in rows}
        missing = [rid for rid in ledger.dropped if rid not in by_id]
        if not missing:
            return by_id
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out waiting for usage records of dropped streams {missing} "
                f"(tenant {ledger.tenant.id})"
            )
        time.sleep(0.1)


def parse_csv(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def same_row(json_row: dict, csv_row: dict[str, str]) -> bool:
    for name, value in json_row.items():
        cell = csv_row[name]
        if value is None:
            ok = cell == ""
        elif name == "created_at":
            ok = datetime.fromisoformat(cell) == datetime.fromisoformat(value)
        else:
            ok = cell == str(value)
        if not ok:
            return False
    return set(csv_row) == set(json_row)


def test_the_export_equals_what_the_api_returned_tenant_by_tenant(platform):
    ledgers = []
    for input_price, cached_price, output_price in PRICES:
        tenant = platform.new_tenant(
            input_price_per_mtok=input_price,
            cached_input_price_per_mtok=cached_price,
            output_price_per_mtok=output_price,
        )
        ledgers.append(Ledger(tenant))
    clients = [platform.client(ledger.tenant) for ledger in ledgers]

    for turn in range(2):  # interleave the tenants
        for ledger, client in zip(ledgers, clients, strict=True):
            run_mix(platform, ledger, client, turn)
    for ledger, client in zip(ledgers, clients, strict=True):
        rate_limited(platform, ledger, client)

    grand = dict.fromkeys((*METRICS, "cost_micro_usd"), 0)
    for ledger in ledgers:
        expected = ledger.totals()
        assert expected["cost_micro_usd"] > 0

        by_request = wait_for_records(platform, ledger)
        for request_id, delivered in ledger.dropped.items():  # billed what was delivered
            assert by_request[request_id]["completion_tokens"] == delivered, request_id
            assert by_request[request_id]["finish_reason"] == "abort"

        day = platform.admin_usage(tenant_id=ledger.tenant.id, group_by="day").json()
        assert day["totals"] == expected
        assert {k: sum(r[k] for r in day["rows"]) for k in expected} == expected
        for name in expected:
            grand[name] += expected[name]

        mine = httpx.get(f"{platform.url}/v1/usage", headers=ledger.tenant.headers)
        assert mine.status_code == 200, mine.text
        assert mine.json()["totals"] == expected
        assert mine.json()["rows"] == day["rows"]

        for group_by in ("day", "request"):
            rows = platform.admin_usage(tenant_id=ledger.tenant.id, group_by=group_by).json()
            exported = platform.admin_usage(
                tenant_id=ledger.tenant.id, group_by=group_by, format="csv"
            )
            assert exported.headers["content-type"].startswith("text/csv")
            parsed = parse_csv(exported.text)
            assert len(parsed) == len(rows["rows"])
            assert all(same_row(j, c) for j, c in zip(rows["rows"], parsed, strict=True))
        assert len(by_request) == expected["requests"]

    everyone = platform.admin_usage(group_by="day").json()
    assert everyone["totals"] == grand
