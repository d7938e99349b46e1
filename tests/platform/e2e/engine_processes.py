"""``loramux engine`` processes for end-to-end tests: start, wait until ready, kill."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.fixtures.browser import free_port
from tests.platform.tasks.worker_process import REPO_ROOT

STARTUP_TIMEOUT_S = 120.0  # torch import and model load on a busy 2-core machine


@dataclass
class EngineProcess:
    engine_id: str
    url: str
    process: subprocess.Popen
    log: Path

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no shutdown, no withdrawal from the registry (a crash)."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"engine {self.engine_id} exited:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            time.sleep(0.25)
        raise AssertionError(
            f"engine {self.engine_id} not ready in {timeout_s}s:\n{self.log_tail()}"
        )


@contextlib.contextmanager
def engine_processes(
    ids: list[str], env: dict[str, str], log_dir: Path
) -> Iterator[dict[str, EngineProcess]]:
    """``loramux engine`` per id (each its own port and data dir), ready, for the block."""
    engines: dict[str, EngineProcess] = {}
    try:
        for engine_id in ids:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log = log_dir / f"{engine_id}.log"
            process_env = {
                **os.environ,
                **env,
                "LORAMUX_ENGINE_SERVER_ID": engine_id,
                "LORAMUX_ENGINE_SERVER_HOST": "127.0.0.1",
                "LORAMUX_ENGINE_SERVER_PORT": str(port),
                "LORAMUX_ENGINE_SERVER_ADVERTISE_URL": url,
                "LORAMUX_DATA_DIR": str(log_dir / engine_id),
            }
            with log.open("wb") as out:
                process = subprocess.Popen(
                    [sys.executable, "-m", "loramux.platform.cli", "engine"],
                    cwd=REPO_ROOT,
                    env=process_env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                )
            engines[engine_id] = EngineProcess(engine_id, url, process, log)
        for engine in engines.values():
            engine.wait_ready()
        yield engines
    finally:
        for engine in engines.values():
            if engine.process.poll() is None:
                engine.process.terminate()
                try:
                    engine.process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    engine.process.kill()
                    engine.process.wait(timeout=20)
