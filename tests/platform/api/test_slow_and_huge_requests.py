"""The edges of HTTP over real sockets, against uvicorn run as ``loramux serve`` runs it:
over-long URLs (414) and header blocks (431) are answered, not dropped; a body that
trickles or stalls is cut off with 408 (an upload's temporary files removed), while a slow
but steady one goes through."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import uvicorn

from loramux.platform.api.middleware.input_guard import MAX_HEADER_BYTES, MAX_URL_BYTES
from loramux.platform.app import create_app
from loramux.platform.cli import serve_options

BODY_TIMEOUT_S = 1.0
MIN_BYTES_PER_S = 1000


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict:
        payload = json.loads(self.body)
        assert set(payload) == {"error"}, payload
        assert set(payload["error"]) == {"message", "type", "code"}, payload
        return payload["error"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _serve(app, settings) -> Iterator[int]:
    """``app`` under uvicorn with ``loramux serve``'s options, on a free local port."""
    port = _free_port()
    options = {**serve_options(settings), "host": "127.0.0.1", "port": port}
    server = uvicorn.Server(uvicorn.Config(app, **{**options, "log_level": "warning"}))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _read_answer(sock: socket.socket) -> Answer:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(":") for line in lines)
    }
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed inside the answer"
        body += chunk
    return Answer(int(status_line.split()[1]), headers, body)


def _request(port: int, raw: bytes, *, segment: int | None = None) -> Answer:
    """Send ``raw`` at once, or in ``segment``-byte pieces as a slow network delivers them
    (the server then sees an incomplete request head grow)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        if segment is None:
            sock.sendall(raw)
        else:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for start in range(0, len(raw), segment):
                sock.sendall(raw[start : start + segment])
                time.sleep(0.001)
        return _read_answer(sock)


def _head(method: str, target: str, headers: dict[str, str]) -> bytes:
    lines = [
        f"{method} {target} HTTP/1.1",
        "Host: 127.0.0.1",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@pytest.fixture
def slow_clients_context(context):
    """The shared context with a short body deadline, so a test sees it pass."""
    context.settings = context.settings.model_copy(
        update={
            "request_body_timeout_s": BODY_TIMEOUT_S,
            "request_body_min_bytes_per_s": MIN_BYTES_PER_S,
        }
    )
    return context


@pytest.fixture
def port(slow_clients_context) -> Iterator[int]:
    with _serve(create_app(slow_clients_context), slow_clients_context.settings) as port:
        yield port


@pytest.fixture
def admin(context) -> dict[str, str]:
    return {"Authorization": f"Bearer {context.admin_token}"}


# --- the request head ------------------------------------------------------------------------


def test_serve_lets_uvicorn_take_heads_past_the_platforms_own_caps(context):
    options = serve_options(context.settings)
    assert (options["host"], options["port"]) == (context.settings.host, context.settings.port)
    assert options["h11_max_incomplete_event_size"] > MAX_URL_BYTES + MAX_HEADER_BYTES


def test_a_20000_character_url_is_a_414(port, admin):
    answer = _request(port, _head("GET", "/v1/models?q=" + "a" * 20_000, admin), segment=1024)
    assert answer.status == 414, answer
    error = answer.error()
    assert error["code"] == "uri_too_long"
    assert str(MAX_URL_BYTES) in error["message"]


def test_a_url_under_the_limit_is_served(port, admin):
    answer = _request(port, _head("GET", "/v1/models?q=" + "a" * 4_000, admin))
    assert answer.status == 200, answer


def test_huge_headers_are_a_431(port, admin):
    padding = {"X-Padding": "p" * (MAX_HEADER_BYTES + 1)}
    answer = _request(port, _head("GET", "/v1/models", {**admin, **padding}), segment=4096)
    assert answer.status == 431, answer
    assert answer.error()["code"] == "headers_too_large"


# --- slow bodies -----------------------------------------------------------------------------


def _send_slowly(sock: socket.socket, body: bytes, chunk: int, every_s: float) -> None:
    """Send ``body`` ``chunk`` bytes at a time, until done or the server has answered."""
    for start in range(0, len(body), chunk):
        try:
            sock.sendall(body[start : start + chunk])
        except (BrokenPipeError, ConnectionResetError):
            return
        readable, _, _ = select.select([sock], [], [], every_s)
        if readable:
            return  # the server answered (or closed): stop sending


def _timed_post(
    port: int, path: str, headers: dict[str, str], body: bytes, chunk: int, every_s: float
):
    head = _head("POST", path, {**headers, "Content-Length": str(len(body))})
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        started = time.monotonic()
        _send_slowly(sock, body, chunk, every_s)
        answer = _read_answer(sock)
        return answer, time.monotonic() - started


def test_a_trickled_json_body_is_cut_off_with_408(port, admin):
    body = json.dumps({"name": "slowpoke"}).encode() + b" " * 200
    headers = {**admin, "Content-Type": "application/json"}
    answer, took = _timed_post(port, "/admin/tenants", headers, body, chunk=1, every_s=0.2)
    assert answer.status == 408, answer
    assert answer.error()["code"] == "request_timeout"
    assert answer.headers.get("connection") == "close"
    assert took < BODY_TIMEOUT_S + 5
    # The server goes on serving everyone else.
    assert _request(port, _head("GET", "/v1/models", admin)).status == 200


def test_a_slow_but_steady_body_goes_through(port, admin):
    # 2,000 bytes/s for ~1.5 s: past the bare timeout, within what its bytes earn.
    body = json.dumps({"name": "steady"}).encode() + b" " * 3000
    headers = {**admin, "Content-Type": "application/json"}
    answer, took = _timed_post(port, "/admin/tenants", headers, body, chunk=100, every_s=0.05)
    assert answer.status == 201, answer
    assert took > BODY_TIMEOUT_S


def _multipart_head_of_upload(boundary: str) -> bytes:
    return (
        (
            f"--{boundary}\r\n"
            'Content-Disposition: form-data; name="name"\r\n\r\nslow-adapter\r\n'
            f"--{boundary}\r\n"
            'Content-Disposition: form-data; name="files"; filename="adapter.tar.gz"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + b"\x1f\x8b"
        + bytes(range(256)) * 8
    )


def test_a_stalled_upload_is_cut_off_and_leaves_no_files(port, admin, tmp_path, monkeypatch):
    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    tenant = json.loads(_request_json(port, "/admin/tenants", admin, {"name": "uploader"}).body)
    key = json.loads(_request_json(port, f"/admin/tenants/{tenant['id']}/api-keys", admin, {}).body)
    auth = {"Authorization": f"Bearer {key['key']}"}

    boundary = "stalled-upload"
    sent = _multipart_head_of_upload(boundary)
    head = _head(
        "POST",
        "/v1/adapters",
        {
            **auth,
            "Content-Type": f"multipart/form-data; boundary={boundary}",
            "Content-Length": str(len(sent) + 1_000_000),  # the rest never comes
        },
    )
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + sent)
        answer = _read_answer(sock)
    assert answer.status == 408, answer
    assert answer.error()["code"] == "request_timeout"
    assert list(spool.iterdir()) == []  # the upload's folder and the form's spool are gone


def _request_json(port: int, path: str, headers: dict[str, str], payload: dict) -> Answer:
    body = json.dumps(payload).encode()
    head = _head(
        "POST",
        path,
        {**headers, "Content-Type": "application/json", "Content-Length": str(len(body))},
    )
    answer = _request(port, head + body)
    assert answer.status == 201, answer
    return answer
