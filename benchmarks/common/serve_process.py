"""A real ``loramux serve`` subprocess, as an operator runs it: started on a data dir of its
own with none of this environment's ``LORAMUX_`` settings, ready once ``/readyz`` answers,
stopped with SIGTERM; its memory read from ``/proc``."""

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

from loramux.benchmarks.common.bench_server import bearer, free_port
from loramux.platform.settings_names import env_name

# A start converts the model first when its cache is cold (~20 s, slower on a busy machine).
STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 90.0  # SIGTERM: running requests get LORAMUX_SHUTDOWN_TIMEOUT_S (30 s), then out


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    data_dir: Path
    log: Path
    tmp_dir: Path | None  # the server's own TMPDIR, if it got one
    started_s: float = 0.0  # seconds from launch to a ready /readyz

    @property
    def admin(self) -> dict[str, str]:
        return bearer((self.data_dir / "admin_token").read_text().strip())

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def memory(self) -> dict:
        """Resident memory now and at its peak (``VmRSS``, ``VmHWM``) and threads."""
        lines = Path(f"/proc/{self.process.pid}/status").read_text().splitlines()
        fields = {key: value.split() for key, _, value in (line.partition(":") for line in lines)}
        return {
            "rss_mib": int(fields["VmRSS"][0]) / 1024,
            "hwm_mib": int(fields["VmHWM"][0]) / 1024,
            "threads": int(fields["Threads"][0]),
        }

    def stop(self) -> dict:
        """SIGTERM, as an orchestrator stops it (a kill if it is not out in time); how long
        it took and how it exited.

        uvicorn handles the signal, shuts down gracefully, then raises it again, so a clean
        stop exits with -SIGTERM after uvicorn's "Finished server process" line."""
        sent = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            code, killed = self.process.wait(timeout=STOP_TIMEOUT_S), False
        except subprocess.TimeoutExpired:
            self.process.kill()
            code, killed = self.process.wait(timeout=30), True
        return {
            "exit_code": code,
            "seconds": None if killed else round(time.monotonic() - sent, 2),
            "needed_kill": killed,
            "graceful": not killed and "Finished server process" in self.log_tail(2000),
        }

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"loramux serve exited at start:\n{self.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200
        return False


@contextlib.contextmanager
def serve(root: Path, own_tmp: bool = False, **settings) -> Iterator[Server]:
    """``loramux serve`` in ``root``: its data dir ``root/data``, its log ``root/serve.log``
    and, with ``own_tmp``, its TMPDIR ``root/tmp``; the embedded default but for
    ``settings``, each by its variable (``model=DIR``: ``LORAMUX_MODEL=DIR``;
    ``adapter_host_bytes``: ``LORAMUX_ENGINE_ADAPTER_HOST_BYTES``). Killed on the way out if it still
    runs."""
    tmp_dir = root / "tmp" if own_tmp else None
    (tmp_dir or root).mkdir(parents=True, exist_ok=True)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LORAMUX_")}
    environ |= {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    environ |= {env_name(name): str(value) for name, value in settings.items()}
    if tmp_dir is not None:
        environ["TMPDIR"] = str(tmp_dir)
    port, log = free_port(), root / "serve.log"
    command = [sys.executable, "-m", "loramux.platform.cli", "serve", "--port", str(port)]
    launched = time.monotonic()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*command, "--data-dir", str(root / "data")],
            cwd=root,
            env=environ,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = Server(process, f"http://127.0.0.1:{port}", root / "data", log, tmp_dir)
    try:
        while not server.ready():
            if time.monotonic() - launched > STARTUP_TIMEOUT_S:
                raise RuntimeError(f"loramux serve not ready after {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.5)
        server.started_s = time.monotonic() - launched
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
