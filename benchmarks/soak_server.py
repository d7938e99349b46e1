"""The soak's server: the ``loramux serve`` subprocess (start, SIGTERM, log, admin token)
and its samples (``/proc``, data dir and ``TMPDIR``, ``/admin/engine``, ``/metrics``)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loramux.benchmarks.common.bench_server import free_port

# A start converts the model first when its cache is cold (~20 s, slower on a busy machine).
STARTUP_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 300.0  # generous: the soak judges errors, not latency
STOP_TIMEOUT_S = 90.0  # SIGTERM: running requests get LORAMUX_SHUTDOWN_TIMEOUT_S (30 s), then out
MIB = 1 << 20


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


def redact(text: str) -> str:
    """``text`` without tokens and keys (the first start prints the admin token; the
    report is committed, and though the server was a throwaway one, still)."""
    return re.sub(r"lmx-[A-Za-z0-9_-]+", "lmx-<redacted>", text)


@contextlib.contextmanager
def start_server(args: argparse.Namespace, model_dir: Path, root: Path) -> Iterator[Server]:
    """The embedded default (no ``LORAMUX_`` setting of ours), but for the model folder,
    the host tier's bound and TMPDIR; killed on the way out if it still runs."""
    data_dir, tmp_dir, log = root / "data", root / "tmp", root / "serve.log"
    tmp_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAMUX_")}
    env.update(
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        TMPDIR=str(tmp_dir),
        LORAMUX_MODEL=str(model_dir),
        LORAMUX_ADAPTER_HOST_BYTES=str(args.adapter_host_bytes),
    )
    port = free_port()
    command = [sys.executable, "-m", "loramux.platform.cli", "serve", "--port", str(port)]
    launched = time.monotonic()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*command, "--data-dir", str(data_dir)],
            cwd=root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = Server(process, f"http://127.0.0.1:{port}", data_dir, tmp_dir, log, 0)
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
        code, killed = server.process.wait(timeout=STOP_TIMEOUT_S), False
    except subprocess.TimeoutExpired:
        server.process.kill()
        code, killed = server.process.wait(timeout=30), True
    return {
        "exit_code": code,
        "seconds": None if killed else round(time.monotonic() - sent, 2),
        "needed_kill": killed,
        "graceful": not killed and "Finished server process" in server.log_tail(2000),
    }


def log_errors(server: Server) -> list[str]:
    """Lines of the server's log that report an error or a traceback."""
    lines = server.log.read_text(errors="replace").splitlines()
    return [redact(line) for line in lines if "Traceback" in line or line.startswith("ERROR")]


def listing(path: Path) -> list[str]:
    """The names in folder ``path``, sorted; none when it is not there."""
    with contextlib.suppress(FileNotFoundError):
        return sorted(os.listdir(path))
    return []


def expect(response: httpx.Response, status: int, what: str) -> dict:
    """``response``'s JSON body ({} when empty); a RuntimeError naming ``what`` when its
    status is not ``status``."""
    if response.status_code != status:
        raise RuntimeError(f"{what}: HTTP {response.status_code} {response.text[:500]}")
    return response.json() if response.content else {}


def proc_status(pid: int) -> dict:
    """RSS, peak RSS and threads from /proc/<pid>/status; open fds; CPU seconds used."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = {key: value.split() for key, _, value in (line.partition(":") for line in lines)}
    # /proc/<pid>/stat: utime and stime are fields 14 and 15, counted after the ")" that
    # closes the command name (which may hold spaces).
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(stat[11]) + int(stat[12])
    return {
        "rss_mib": int(fields["VmRSS"][0]) / 1024,
        "hwm_mib": int(fields["VmHWM"][0]) / 1024,
        "threads": int(fields["Threads"][0]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "cpu_s": ticks / os.sysconf("SC_CLK_TCK"),
    }


def tree_bytes(path: Path) -> int:
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(path):
            with contextlib.suppress(FileNotFoundError):  # removed while we walk
                if entry.is_dir(follow_symlinks=False):
                    total += tree_bytes(Path(entry.path))
                else:
                    total += entry.stat(follow_symlinks=False).st_size
    return total


def disk_figures(server: Server) -> dict:
    """The data dir by top-level entry (the database and its journal, the store, ...) and
    what the upload workspace and the server's TMPDIR hold now."""
    sizes: Counter = Counter()
    for entry in os.scandir(server.data_dir):
        name = "database" if entry.name.startswith("loramux.db") else entry.name
        sizes[name] += tree_bytes(Path(entry.path)) if entry.is_dir() else entry.stat().st_size
    return {
        "data_dir_mib": sum(sizes.values()) / MIB,
        "data_dir_parts_mib": {k: round(v / MIB, 3) for k, v in sorted(sizes.items())},
        "upload_tmp_entries": len(listing(server.data_dir / "tmp" / "uploads")),
        "tmpdir_entries": len(listing(server.tmp_dir)),
        "tmpdir_mib": tree_bytes(server.tmp_dir) / MIB,
    }


def engine_figures(client: httpx.Client, server: Server) -> dict:
    snap = expect(client.get("/admin/engine", headers=server.admin), 200, "/admin/engine")
    return {
        "running": snap["running_requests"],
        "waiting": snap["waiting_requests"],
        "kv_blocks_used": snap["kv_cache"]["blocks_used"],
        "kv_blocks_usable": snap["kv_cache"]["blocks_usable"],
        "device_adapters": snap["device"]["count"],
        "device_mib": snap["device"]["bytes"] / MIB,
        "host_adapters": snap["host"]["count"],
        "host_mib": snap["host"]["bytes"] / MIB,
        "host_capacity_mib": snap["host"]["capacity_bytes"] / MIB,
        "registered_adapters": len(snap["adapters"]),
        "adapters_by_tier": dict(Counter(adapter["tier"] for adapter in snap["adapters"])),
        "ttft_p50_ms": snap["ttft"]["p50_ms"],
        "itl_p50_ms": snap["itl"]["p50_ms"],
    }


# Counters of /metrics worth following over a soak (summed over their labels).
METRICS = (
    "loramux_adapter_loads",
    "loramux_adapter_evictions",
    "loramux_preemptions",
    "loramux_generated_tokens",
    "loramux_step_failures",
    "loramux_requests_failed_in_step",
)


def metric_figures(client: httpx.Client) -> dict:
    sums: Counter = Counter()
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if family.name in METRICS and sample.name == f"{family.name}_total":
                sums[family.name.removeprefix("loramux_")] += sample.value
            elif sample.name == "loramux_http_requests_total":
                sums["http_requests"] += sample.value
                sums["http_5xx"] += sample.value if sample.labels["status"].startswith("5") else 0
    return dict(sums)


def take_sample(client: httpx.Client, server: Server, t_s: float, errors: list[str]) -> dict:
    """Every figure at ``t_s`` s; when one fails, those after it are left out and the
    error is added to ``errors``."""
    sample = {"t_s": round(t_s, 2), "load1": float(Path("/proc/loadavg").read_text().split()[0])}
    try:
        sample |= proc_status(server.process.pid)
        sample |= disk_figures(server)
        sample |= engine_figures(client, server)
        sample |= metric_figures(client)
    except (OSError, httpx.HTTPError, RuntimeError, KeyError) as exc:
        errors.append(f"{sample['t_s']} s: {type(exc).__name__}: {exc}"[:300])
    return sample
