"""``loramux serve`` (embedded default: SQLite, local store, inline validation) SIGKILLed in
the middle of an upload, then started again on the same data directory.

Killed while a large body is still arriving, or while the adapter is being validated: after
the restart no version is stuck in uploading/validating, no adapter row is left, the store
holds no object that no version names, and neither the upload scratch folder
(``<data dir>/tmp/uploads``) nor the system temp dir holds anything of the upload. The
restarted replica removes the versions it held at once (they carry its id), without
waiting for their leases to run out.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy import select

from loramux.platform.db.models import Adapter, AdapterVersion
from loramux.platform.db.session import create_engine_for, session_factory
from loramux.platform.services.upload_workspace import SCRATCH_DIR
from tests.fixtures.models import ALL_TARGETS
from tests.fixtures.polling import eventually
from tests.platform.e2e.serve_process import ServeProcess

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# Rank 512 on every module of the tiny model: a 4 MB adapter that takes the validator a good
# fraction of a second, a window the kill lands in reliably.
BIG_RANK = 512


@pytest.fixture(scope="module")
def big_adapter(make_adapter, tiny_model_dir) -> Path:
    return make_adapter(tiny_model_dir, rank=BIG_RANK, targets=ALL_TARGETS, seed=4)


@pytest.fixture
def server(tmp_path, tiny_model_dir) -> Iterator[ServeProcess]:
    serve = ServeProcess(
        tmp_path / "data",
        tmp_path / "system-tmp",
        tmp_path / "serve.log",
        MODEL=str(tiny_model_dir),
        MAX_ADAPTER_RANK=str(BIG_RANK),
    )
    try:
        yield serve.start()
    finally:
        serve.stop()


def _upload_request(server: ServeProcess, headers: dict, adapter_dir: Path) -> httpx.Request:
    files = [("files", (f, (adapter_dir / f).read_bytes())) for f in ADAPTER_FILES]
    request = httpx.Request(
        "POST", f"{server.url}/v1/adapters", data={"name": "big"}, files=files, headers=headers
    )
    request.read()
    return request


def _send_part_of(request: httpx.Request, fraction: float) -> socket.socket:
    """Send the request's head and the first ``fraction`` of its body, then nothing more."""
    url = urlsplit(str(request.url))
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    head = [f"POST {url.path} HTTP/1.1", f"Host: {url.netloc}"]
    head += [f"{name}: {value}" for name, value in request.headers.items() if name != "host"]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    body = request.content
    sock.sendall(body[: int(len(body) * fraction)])
    return sock


def _scratch(server: ServeProcess) -> list[Path]:
    folder = server.data_dir / SCRATCH_DIR
    return list(folder.iterdir()) if folder.is_dir() else []


def _loramux_temp_files(server: ServeProcess) -> list[Path]:
    return [p for p in server.system_tmp.iterdir() if p.name.startswith("loramux-")]


def _database(server: ServeProcess):
    return session_factory(create_engine_for(f"sqlite:///{server.data_dir / 'loramux.db'}"))


def _versions(sessions) -> list[tuple[str, str | None]]:
    with sessions() as session:
        return list(session.execute(select(AdapterVersion.status, AdapterVersion.lease_owner)))


def _assert_nothing_left(server: ServeProcess, sessions) -> None:
    with sessions() as session:
        assert session.scalars(select(AdapterVersion)).all() == []
        assert session.scalars(select(Adapter)).all() == []
    store = server.data_dir / "store" / "sha256"
    assert not store.exists() or [p for p in store.rglob("*") if p.is_file()] == []
    assert _scratch(server) == []
    assert _loramux_temp_files(server) == []


def test_killed_while_the_body_arrives(server, big_adapter):
    headers = server.tenant_headers()
    request = _upload_request(server, headers, big_adapter)
    assert len(request.content) > 4 << 20
    sock = _send_part_of(request, 0.5)
    try:
        eventually(lambda: _scratch(server), "the upload's scratch folder", timeout_s=30)
        server.kill()
    finally:
        sock.close()
    assert _scratch(server), "the kill should leave the upload's folder behind"

    server.start()
    sessions = _database(server)
    try:
        _assert_nothing_left(server, sessions)
        again = httpx.post(
            f"{server.url}/v1/adapters",
            data={"name": "big"},
            files=[("files", (f, (big_adapter / f).read_bytes())) for f in ADAPTER_FILES],
            headers=headers,
            timeout=60,
        )
        assert again.status_code == 201, again.text
        assert again.json()["version"] == 1
    finally:
        sessions.kw["bind"].dispose()


def test_killed_during_inline_validation(server, big_adapter):
    headers = server.tenant_headers()
    request = _upload_request(server, headers, big_adapter)
    sessions = _database(server)
    try:
        client = threading.Thread(target=_send_and_ignore, args=(request,), daemon=True)
        client.start()
        deadline = time.monotonic() + 60
        while [status for status, _ in _versions(sessions)] in ([], ["uploading"]):
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.005)  # the validator's window is a fraction of a second
        server.kill()
        client.join(timeout=30)

        [(status, owner)] = _versions(sessions)
        assert status == "validating", "the kill came too late to test anything"
        assert owner.startswith("platform:")
        assert _scratch(server)  # the received files, left behind by the kill

        server.start()
        _assert_nothing_left(server, sessions)
    finally:
        sessions.kw["bind"].dispose()


def _send_and_ignore(request: httpx.Request) -> None:
    try:
        with httpx.Client(timeout=60) as client:
            client.send(request)
    except httpx.HTTPError:
        pass  # the server was killed under it
