"""The loramux platform for the benchmarks: run in-process, and talked to as its admin.

``serve_platform`` runs the embedded default (SQLite and a local store in a temporary data
dir, the in-process engine) under uvicorn in a thread on a free port. On it, or on a
``loramux serve`` subprocess (``serve_process``), the admin creates tenants with an API key
each and uploads their adapters; ``expect`` checks every answer, naming what failed.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loramux.benchmarks.common.workload import WorkloadRequest, WorkloadSpec

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class ServerThread:
    """An ASGI app under uvicorn in a daemon thread on a free port (the test suite's
    in-process servers are these too)."""

    def __init__(self, app) -> None:
        import uvicorn

        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server thread did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@dataclass
class RunningPlatform:
    context: Any  # loramux.platform.context.PlatformContext
    url: str

    @property
    def admin_headers(self) -> dict[str, str]:
        return bearer(self.context.admin_token)

    @property
    def base_model(self) -> str:
        return self.context.base_model.model_id


@contextlib.contextmanager
def serve_platform(model_dir: Path | None, **settings: Any) -> Iterator[RunningPlatform]:
    """The embedded default on ``model_dir`` (None: its own GGUF, as ``loramux serve``
    serves it) over HTTP until the block ends; ``settings`` are extra ``Settings`` fields
    (``kv_cache_bytes``, ``max_num_seqs``...)."""
    from loramux.platform.app import create_app
    from loramux.platform.context import build_context
    from loramux.platform.settings import Settings

    with tempfile.TemporaryDirectory(prefix="loramux-bench-") as data_dir:
        if model_dir is not None:
            settings["model"] = str(model_dir)
        config = Settings(data_dir=Path(data_dir), device="cpu", port=0, **settings)
        context = build_context(config, log=lambda _: None)
        try:
            with ServerThread(create_app(context)) as server:
                yield RunningPlatform(context=context, url=server.url)
        finally:
            context.rate_limiter.close()
            context.sessions.kw["bind"].dispose()


def expect(response: httpx.Response, status: int, what: str) -> dict:
    """``response``'s JSON body ({} when empty or a stream not read yet); a RuntimeError
    naming ``what`` when its status is not ``status``."""
    if response.status_code != status:
        text = response.read().decode(errors="replace")
        raise RuntimeError(f"{what}: HTTP {response.status_code} {text[:500]}")
    with contextlib.suppress(httpx.ResponseNotRead):
        return response.json() if response.content else {}
    return {}


def create_tenant(admin: httpx.Client, body: dict) -> dict:
    """The tenant ``body`` (``name``, ``priority``, ``weight``, prices...) created through
    ``admin`` (a client with the admin's headers), with an API key: ``{id, key, **body}``."""
    name = body["name"]
    tenant = expect(admin.post("/admin/tenants", json=body), 201, f"creating tenant {name!r}")
    key = admin.post(f"/admin/tenants/{tenant['id']}/api-keys")
    return {"id": tenant["id"], "key": expect(key, 201, f"an API key for {name!r}")["key"], **body}


def served_model(client: httpx.Client) -> str:
    """The base model's name (``/v1/models`` lists the caller's adapters after it)."""
    return expect(client.get("/v1/models"), 200, "listing models")["data"][0]["id"]


def upload_adapter(client: httpx.Client, key: str, name: str, folder: Path) -> httpx.Response:
    """The PEFT adapter in ``folder`` uploaded as ``name`` by the tenant of API key ``key``."""
    files = [("files", (f, (folder / f).read_bytes())) for f in ADAPTER_FILES]
    return client.post("/v1/adapters", data={"name": name}, files=files, headers=bearer(key))


def add_adapter(client: httpx.Client, key: str, name: str, folder: Path, what: str) -> dict:
    """``upload_adapter``, which must make a ready version (a RuntimeError naming ``what``
    if not); its JSON body."""
    done = expect(upload_adapter(client, key, name, folder), 201, f"uploading {what}")
    if done.get("status") != "ready":
        raise RuntimeError(f"{what} is {done.get('status')!r}, not ready")
    return done


def setup_workload(
    platform: RunningPlatform,
    spec: WorkloadSpec,
    requests: Sequence[WorkloadRequest],
    adapter_dirs: Sequence[Path],
) -> dict[str, str]:
    """Tenants of ``spec`` with their priority and weight, each with an API key and its own
    copy (``a{k}``) of every adapter its requests use; returns tenant name -> API key."""
    used: dict[str, set[int]] = {t.name: set() for t in spec.tenants}
    for request in requests:
        if request.adapter is not None:
            used[request.tenant].add(request.adapter)
    keys = {}
    with httpx.Client(base_url=platform.url, headers=platform.admin_headers, timeout=120) as c:
        for t in spec.tenants:
            body = {"name": t.name, "priority": t.priority, "weight": t.weight}
            keys[t.name] = create_tenant(c, body)["key"]
            for k in sorted(used[t.name]):
                add_adapter(c, keys[t.name], f"a{k}", adapter_dirs[k], f"a{k} for {t.name!r}")
    return keys


@dataclass(frozen=True)
class Target:
    """The running platform and its tenants, as a client process needs them."""

    url: str
    admin_headers: dict[str, str]
    model: str
    tenants: dict[str, dict]  # name -> {id, key, name, priority, weight}
    vocab_size: int
    avoid: tuple[int, ...]  # token ids never put in a prompt (EOS)


def open_platform(platform: RunningPlatform, tenants: list[dict]) -> Target:
    """The tenants (``{name, priority, weight}``) created, each with an API key."""
    engine = platform.context.engine.engine
    with httpx.Client(base_url=platform.url, headers=platform.admin_headers, timeout=60) as c:
        made = {body["name"]: create_tenant(c, body) for body in tenants}
    return Target(
        platform.url,
        platform.admin_headers,
        platform.base_model,
        made,
        engine.model_config.vocab_size,
        tuple(sorted(engine.eos_token_ids)),
    )


def run_apart(clients, *args) -> dict:
    """``clients(*args)`` in a spawned process of its own, so that the server's engine thread
    and event loop never wait on the clients' interpreter; with this process's (the
    server's) clock over it as ``clock``."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from loramux.benchmarks.common.machine import Clock

    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool, Clock() as clock:
        run = pool.submit(clients, *args).result()
    return run | {"clock": {"seconds": round(clock.seconds, 1), **clock.summary()}}
