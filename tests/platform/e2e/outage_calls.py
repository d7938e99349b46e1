"""Completions sent through an outage, what each client received, and what was billed.

The fault tests (Redis outage, PostgreSQL restart) send completions before, during and
after an outage, some of them running while it starts. A :class:`Call` records what its
client got: the status, the JSON error, and, counted on the client's side, the completion
tokens it received (each response or chunk lists its tokens with ``logprobs``). Every
call ignores EOS, so a served call always delivers tokens and is billed.
:func:`assert_billed_as_delivered` then checks the usage rows against those counts,
request by request.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field

import httpx
from sqlalchemy import select

from loramux.platform.db.models import UsageRecord
from tests.fixtures.polling import eventually
from tests.platform.e2e.conftest import Platform, Tenant

PROMPT = "Once upon a time"
TIMEOUT_S = 120  # a call that hangs fails the test, it does not hang it (a loaded 2-core machine took over 60 s for a 480-token call across a database restart)


@dataclass
class Call:
    """One completion over HTTP, streamed or not; :meth:`run` sends it."""

    platform: Platform = field(repr=False)
    tenant: Tenant = field(repr=False)
    stream: bool = False
    max_tokens: int = 8
    status: int | None = None
    content_type: str | None = None
    body: dict | None = None  # the JSON answer: a completion or an error
    request_id: str | None = None
    delivered: int = 0  # completion tokens the client received
    finish_reason: str | None = None
    done: bool = False  # a response arrived, or a stream reached "data: [DONE]"
    events: list[dict] = field(default_factory=list, repr=False)  # a stream's chunks, errors
    broken: BaseException | None = None  # the connection broke under it

    def run(self) -> Call:
        request = {
            "model": self.platform.base_model,
            "prompt": PROMPT,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "logprobs": 1,  # every response and chunk lists its tokens
            "stream": self.stream,
        }
        try:
            with httpx.stream(
                "POST",
                f"{self.platform.url}/v1/completions",
                json=request,
                headers=self.tenant.headers,
                timeout=TIMEOUT_S,
            ) as response:
                self.status = response.status_code
                self.content_type = response.headers.get("content-type", "")
                if self.status == 200 and self.stream:
                    self._read_stream(response)
                else:
                    self._read_body(response)
        except httpx.HTTPError as exc:
            self.broken = exc
        return self

    def start(self) -> threading.Thread:
        """Run the call in a thread (to be joined)."""
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        return thread

    @property
    def error(self) -> dict | None:
        """The ``error`` object of a refused call, or of a stream's error event."""
        if self.body is not None and "error" in self.body:
            return self.body["error"]
        errors = [event["error"] for event in self.events if "error" in event]
        return errors[0] if errors else None

    def _read_body(self, response: httpx.Response) -> None:
        response.read()
        self.body = response.json()  # a plain-text answer fails the test here
        self.done = True
        if self.status == 200:
            choice = self.body["choices"][0]
            self.request_id = self.body["id"]
            self.delivered = len(choice["logprobs"]["tokens"])
            self.finish_reason = choice["finish_reason"]

    def _read_stream(self, response: httpx.Response) -> None:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                self.done = True
                continue
            event = json.loads(data)
            self.events.append(event)
            self.request_id = event.get("id", self.request_id)
            for choice in event.get("choices", []):
                self.delivered += len(choice["logprobs"]["tokens"])
                self.finish_reason = choice["finish_reason"] or self.finish_reason


def start_running(calls: list[Call]) -> list[threading.Thread]:
    """Start ``calls`` in threads (to be joined); return once every one of them runs in
    the platform's engine, past its checks (so an outage from now on finds it running)."""
    platform = calls[0].platform
    threads = [call.start() for call in calls]

    def running() -> bool:
        return asyncio.run(platform.context.engine.stats()).running_requests == len(calls)

    eventually(running, f"{len(calls)} calls to run in the engine", TIMEOUT_S, 0.01)
    return threads


def usage_rows(platform: Platform, tenant: Tenant) -> list[UsageRecord]:
    with platform.context.sessions() as session:
        query = select(UsageRecord).where(UsageRecord.tenant_id == tenant.id)
        return list(session.scalars(query))


def assert_billed_as_delivered(platform: Platform, tenant: Tenant, calls: list[Call]) -> None:
    """The tenant's usage rows are exactly its served calls, each final and billed for
    the tokens its client received: none missing, none twice, none for a refused call."""
    served = {
        call.request_id: call.delivered
        for call in calls
        if call.tenant is tenant and call.status == 200
    }
    rows = usage_rows(platform, tenant)
    billed = {row.request_id: row.completion_tokens for row in rows}
    assert billed == served, f"billed {billed}\nvs delivered {served}"
    assert all(row.final for row in rows), [row.request_id for row in rows if not row.final]
