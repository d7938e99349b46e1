"""A dropped stream bills the tokens that went out on the connection, not those handed to a
server that had already lost it.

uvicorn (ASGI spec 2.3) ignores a send once the client has gone, and Starlette's disconnect
listener, which ends the stream, wakes on a later turn of the event loop, so chunks can be
"sent" into the void. A real socket makes that a race (the soak saw 21 tokens billed for 19
received); here the app runs on a scripted connection that makes it certain: the client
leaves right after a chunk is written, later sends are dropped as uvicorn drops them, and
the listener hears of it only some sends later."""

from __future__ import annotations

import asyncio
import json

from loramux.platform.services.metering import Meter

PROMPT = "The quick brown fox"


class ScriptedConnection:
    """One HTTP request as uvicorn serves it: the client leaves once ``written`` body chunks
    with data were written (the server learns so on the next turn of its event loop); every
    send after that is dropped; a ``receive`` made after the
    leaving answers ``http.disconnect`` at once (uvicorn reads its flag), while one already
    waiting wakes only ``wake_after`` dropped sends later."""

    def __init__(self, body: bytes, written: int, wake_after: int):
        self.body = body
        self.written_limit = written
        self.wake_after = wake_after
        self.body_read = False
        self.gone = False
        self.woken = asyncio.Event()
        self.status: int | None = None
        self.chunks: list[bytes] = []  # what reached the client
        self.dropped = 0

    async def receive(self) -> dict:
        if not self.body_read:
            self.body_read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        if not self.gone:
            await self.woken.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            return
        if self.gone:
            self.dropped += 1
            if self.dropped >= self.wake_after:
                self.woken.set()
            return
        if message.get("body"):
            self.chunks.append(message["body"])
            if len(self.chunks) == self.written_limit:
                # the client reads it and leaves: uvicorn learns so in a callback, on a
                # later turn of the event loop (connection_lost)
                asyncio.get_running_loop().call_soon(self._leave)
        if not message.get("more_body", False):
            self.woken.set()

    def _leave(self) -> None:
        self.gone = True

    def events(self) -> list[dict]:
        text = b"".join(self.chunks).decode()
        return [
            json.loads(line[len("data: ") :])
            for line in text.splitlines()
            if line.startswith("data: {")
        ]


def _scope(path: str, headers: dict[str, str], body: bytes) -> dict:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    raw += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": raw,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


def test_chunks_sent_after_the_client_left_are_not_billed(client, context, tenant_key):
    headers = tenant_key()
    body = json.dumps(
        {
            "model": context.base_model.model_id,
            "prompt": PROMPT,
            "max_tokens": 200,
            "min_tokens": 200,
            "logprobs": 1,
            "stream": True,
        }
    ).encode()
    connection = ScriptedConnection(body, written=3, wake_after=5)

    async def serve() -> None:
        await client.app(
            _scope("/v1/completions", headers, body), connection.receive, connection.send
        )

    client.portal.call(serve)

    assert connection.status == 200
    events = connection.events()
    assert events and all("error" not in e for e in events)
    received = sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events)
    assert connection.dropped >= 1  # the server did send after the client left
    record = Meter(context.sessions).stored(events[0]["id"])
    assert record is not None, "a stream that delivered tokens must be billed"
    assert record.finish_reason == "abort"
    assert record.completion_tokens == received
