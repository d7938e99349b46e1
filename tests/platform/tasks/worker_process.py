"""Real Celery processes for tests: worker and beat (`celery -A loramux.platform.tasks.worker`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


def worker_env(*, broker_url: str, database_url: str, data_dir: Path) -> dict[str, str]:
    """The environment of a worker sharing the platform's broker, database and local store."""
    return {
        **os.environ,
        "LORAMUX_CELERY_BROKER_URL": broker_url,
        "LORAMUX_DATABASE_URL": database_url,
        "LORAMUX_DATA_DIR": str(data_dir),
        "LORAMUX_STORE_BACKEND": "local",
    }


def celery_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "loramux.platform.tasks.worker", *args]


@contextlib.contextmanager
def running(command: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """Run ``command`` (output to ``log``) for the block, then stop it."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=15)


def running_worker(env: dict[str, str], log: Path, *, pool: str = "solo"):
    """A worker on the default queue, for the block: ``solo`` runs tasks in the worker
    process itself; ``prefork`` in one child process the worker replaces if it dies."""
    command = celery_command(
        "worker",
        f"--pool={pool}",
        "--concurrency=1",
        "-Q",
        "celery",
        "--loglevel=INFO",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    )
    return running(command, env, log)


def running_beat(env: dict[str, str], log: Path, schedule_path: Path):
    """Celery beat sending the app's schedule for the block; its state kept in ``schedule_path``
    (a file of the test's own, never the default ``celerybeat-schedule`` in the checkout)."""
    command = celery_command("beat", "--schedule", str(schedule_path), "--loglevel=INFO")
    return running(command, env, log)


def wait_until(check, process: subprocess.Popen, log: Path, what: str, timeout_s: float = 30.0):
    """Poll ``check()`` until it returns something truthy (returned); fail loudly with the log
    if ``process`` exits or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        exited = process.poll()
        assert exited is None, f"the process exited ({exited}) first; log:\n{log.read_text()}"
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout_s:.0f}s; log:\n{log.read_text()}")
