"""The loramux platform run in-process for ``loramux bench --driver http``.

``serve_platform(model_dir, ...)`` builds the embedded default (SQLite and a local store in
a temporary data dir, the in-process engine) and runs the app under uvicorn in a thread on
a free port; ``setup_workload(...)`` creates the workload's tenants (priority, weight), one
API key each, and uploads every adapter a tenant uses as ``a{k}`` through
``POST /v1/adapters`` (adapters belong to a tenant, so each gets its own copy).
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

from loramux.benchmarks.common.workload import WorkloadRequest, WorkloadSpec

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
        return {"Authorization": f"Bearer {self.context.admin_token}"}

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


def setup_workload(
    platform: RunningPlatform,
    spec: WorkloadSpec,
    requests: Sequence[WorkloadRequest],
    adapter_dirs: Sequence[Path],
) -> dict[str, str]:
    """Tenants of ``spec`` with their priority and weight, each with an API key and its own
    copy (``a{k}``) of every adapter its requests use; returns tenant name -> API key."""
    import httpx

    used: dict[str, set[int]] = {t.name: set() for t in spec.tenants}
    for request in requests:
        if request.adapter is not None:
            used[request.tenant].add(request.adapter)
    keys = {}
    with httpx.Client(base_url=platform.url, timeout=120) as client:
        for tenant in spec.tenants:
            body = {"name": tenant.name, "priority": tenant.priority, "weight": tenant.weight}
            created = client.post("/admin/tenants", json=body, headers=platform.admin_headers)
            _check(created, 201, f"creating tenant {tenant.name!r}")
            tenant_id = created.json()["id"]
            key = client.post(
                f"/admin/tenants/{tenant_id}/api-keys", headers=platform.admin_headers
            )
            _check(key, 201, f"an API key for {tenant.name!r}")
            keys[tenant.name] = key.json()["key"]
            for k in sorted(used[tenant.name]):
                files = [("files", (f, (adapter_dirs[k] / f).read_bytes())) for f in ADAPTER_FILES]
                uploaded = client.post(
                    "/v1/adapters",
                    data={"name": f"a{k}"},
                    files=files,
                    headers={"Authorization": f"Bearer {keys[tenant.name]}"},
                )
                _check(uploaded, 201, f"uploading a{k} for {tenant.name!r}")
                status = uploaded.json().get("status")
                if status != "ready":
                    raise RuntimeError(f"a{k} for {tenant.name!r} is {status!r}, not ready")
    return keys


def _check(response, status: int, what: str) -> None:
    if response.status_code != status:
        raise RuntimeError(f"{what}: HTTP {response.status_code} {response.text[:500]}")
