"""``loramux serve`` as a real subprocess a test may SIGKILL and start again on its data dir."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.fixtures.engine_budget import budget_env

STARTUP_TIMEOUT_S = 90.0
ADMIN_TOKEN = "lmx-admin-fault-tests"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _loramux_command() -> list[str]:
    """The venv's console script when installed next to this Python, else ``-m``."""
    script = Path(sys.executable).with_name("loramux")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "loramux.platform.cli"]


class ServeProcess:
    """``loramux serve`` on ``data_dir`` with ``settings`` (``LORAMUX_`` names without the
    prefix) and a private system temp dir, started by :meth:`start`."""

    def __init__(self, data_dir: Path, system_tmp: Path, log: Path, **settings: str) -> None:
        self.data_dir = data_dir
        self.system_tmp = system_tmp
        self.log = log
        self.port = _free_port()
        self.settings = {"ADMIN_TOKEN": ADMIN_TOKEN, **settings}
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAMUX_")}
        env.update(budget_env())
        env.update({f"LORAMUX_{name}": value for name, value in self.settings.items()})
        env.update(TMPDIR=str(self.system_tmp), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        return env

    def start(self) -> ServeProcess:
        self.system_tmp.mkdir(parents=True, exist_ok=True)
        command = [*_loramux_command(), "serve", "--port", str(self.port)]
        command += ["--data-dir", str(self.data_dir)]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self._env(),
            )
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"loramux serve exited first:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"loramux serve did not become healthy:\n{self.output()}")

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs, as in a crash or an OOM kill."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=15)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def tenant_headers(self) -> dict[str, str]:
        tenant = httpx.post(f"{self.url}/admin/tenants", json={"name": "t"}, headers=self.admin)
        assert tenant.status_code == 201, tenant.text
        key = httpx.post(
            f"{self.url}/admin/tenants/{tenant.json()['id']}/api-keys", headers=self.admin
        )
        assert key.status_code == 201, key.text
        return {"Authorization": f"Bearer {key.json()['key']}"}
