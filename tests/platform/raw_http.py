"""A client that sends a request and goes away before the answer: a bare socket."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit


@contextlib.contextmanager
def request_then_leave(
    url: str, path: str, key: str, body: dict, timeout_s: float = 30
) -> Iterator[socket.socket]:
    """POST ``body`` as JSON to ``url + path`` with ``key`` as bearer token and yield the
    socket without reading anything; leaving the block closes it (the client is gone)."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s) as sock:
        sock.sendall(head + payload)
        yield sock
