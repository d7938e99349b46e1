"""The soak's server: one ``loramux serve`` subprocess on the embedded default in a fresh
data dir, started, waited for, stopped with SIGTERM; its log and its admin token.

Part of the soak (``soak.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from loramux.benchmarks.bench_server import free_port

# A start converts the model first when its cache is cold (~20 s, slower on a busy machine).
STARTUP_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 300.0  # generous: the soak judges errors, not latency
STOP_TIMEOUT_S = 90.0  # SIGTERM: running requests get LORAMUX_SHUTDOWN_TIMEOUT_S (30 s), then out


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    data_dir: Path
    tmp_dir: Path  # the server's TMPDIR
    log: Path
    started_s: float  # seconds from launch to a ready /readyz

    @property
    def admin(self) -> dict[str, str]:
        token = (self.data_dir / "admin_token").read_text().strip()
        return {"Authorization": f"Bearer {token}"}

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def public_log_tail(self, chars: int = 3000) -> str:
        return redact(self.log_tail(chars))


def redact(text: str) -> str:
    """``text`` without tokens and keys (the first start prints the admin token; the
    report is committed, and though the server was a throwaway one, still)."""
    return re.sub(r"lmx-[A-Za-z0-9_-]+", "lmx-<redacted>", text)


def server_env(args: argparse.Namespace, model_dir: Path, tmp_dir: Path) -> dict[str, str]:
    """The embedded default, but for the model folder, the host tier's bound and TMPDIR."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAMUX_")}
    env.update(
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        TMPDIR=str(tmp_dir),
        LORAMUX_MODEL=str(model_dir),
        LORAMUX_ADAPTER_HOST_BYTES=str(args.adapter_host_bytes),
    )
    return env


@contextlib.contextmanager
def start_server(args: argparse.Namespace, model_dir: Path, root: Path) -> Iterator[Server]:
    data_dir, tmp_dir = root / "data", root / "tmp"
    tmp_dir.mkdir()
    port = free_port()
    command = [sys.executable, "-m", "loramux.platform.cli", "serve", "--port", str(port)]
    launched = time.monotonic()
    with (root / "serve.log").open("wb") as out:
        process = subprocess.Popen(
            [*command, "--data-dir", str(data_dir)],
            cwd=root,
            env=server_env(args, model_dir, tmp_dir),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = Server(process, f"http://127.0.0.1:{port}", data_dir, tmp_dir, root / "serve.log", 0)
    try:
        wait_ready(server, launched)
        server.started_s = time.monotonic() - launched
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def wait_ready(server: Server, launched: float) -> None:
    while time.monotonic() - launched < STARTUP_TIMEOUT_S:
        if server.process.poll() is not None:
            raise RuntimeError(f"loramux serve exited at start:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/readyz", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"loramux serve not ready after {STARTUP_TIMEOUT_S:.0f} s")


def stop_server(server: Server) -> dict:
    """SIGTERM, as an orchestrator stops it; how long it took and how it exited.

    uvicorn handles the signal, shuts down gracefully, then raises it again, so a clean
    stop exits with -SIGTERM after uvicorn's "Finished server process" line."""
    sent = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    try:
        code = server.process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.process.kill()
        code = server.process.wait(timeout=30)
        return {"exit_code": code, "seconds": None, "needed_kill": True, "graceful": False}
    return {
        "exit_code": code,
        "seconds": round(time.monotonic() - sent, 2),
        "needed_kill": False,
        "graceful": "Finished server process" in server.log_tail(2000),
    }


def log_errors(server: Server) -> list[str]:
    """Lines of the server's log that report an error or a traceback."""
    lines = server.log.read_text(errors="replace").splitlines()
    return [redact(line) for line in lines if "Traceback" in line or line.startswith("ERROR")]


def expect(response: httpx.Response, status: int, what: str) -> dict:
    """``response``'s JSON body ({} when empty); a RuntimeError naming ``what`` when its
    status is not ``status``."""
    if response.status_code != status:
        raise RuntimeError(f"{what}: HTTP {response.status_code} {response.text[:500]}")
    return response.json() if response.content else {}
