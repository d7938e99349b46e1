"""The soak's server (a ``loramux serve`` subprocess, ``common.serve_process``): its samples
(``/proc``, data dir and ``TMPDIR``, ``/admin/engine``, ``/metrics``) and what it left
behind once stopped (files, database rows, log errors)."""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
from collections import Counter
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loramux.benchmarks.common.bench_server import expect
from loramux.benchmarks.common.serve_process import Server

REQUEST_TIMEOUT_S = 300.0  # generous: the soak judges errors, not latency
MIB = 1 << 20
TORCH_CACHE_PREFIX = "torchinductor_"  # torch's per-user cache folder in TMPDIR, kept by design
# Counters of /metrics worth following over a soak (summed over their labels).
METRICS = (
    "loramux_adapter_loads",
    "loramux_adapter_evictions",
    "loramux_preemptions",
    "loramux_generated_tokens",
    "loramux_step_failures",
    "loramux_requests_failed_in_step",
)


def redact(text: str) -> str:
    """``text`` without tokens and keys (the first start prints the admin token; the
    report is committed, and though the server was a throwaway one, still)."""
    return re.sub(r"lmx-[A-Za-z0-9_-]+", "lmx-<redacted>", text)


def listing(path: Path) -> list[str]:
    """The names in folder ``path``, sorted; none when it is not there."""
    with contextlib.suppress(FileNotFoundError):
        return sorted(os.listdir(path))
    return []


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


def take_sample(client: httpx.Client, server: Server, t_s: float, errors: list[str]) -> dict:
    """Every figure at ``t_s`` s; when one fails, those after it are left out and the
    error is added to ``errors``."""
    sample = {"t_s": round(t_s, 2), "load1": float(Path("/proc/loadavg").read_text().split()[0])}
    try:
        sample |= _process_figures(server)
        sample |= _disk_figures(server)
        sample |= _engine_figures(client, server)
        sample |= _metric_figures(client)
    except (OSError, httpx.HTTPError, RuntimeError, KeyError) as exc:
        errors.append(f"{sample['t_s']} s: {type(exc).__name__}: {exc}"[:300])
    return sample


def _process_figures(server: Server) -> dict:
    """RSS, peak RSS and threads; open fds; CPU seconds used."""
    pid = server.process.pid
    # /proc/<pid>/stat: utime and stime are fields 14 and 15, counted after the ")" that
    # closes the command name (which may hold spaces).
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return server.memory() | {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "cpu_s": (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK"),
    }


def _disk_figures(server: Server) -> dict:
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


def _engine_figures(client: httpx.Client, server: Server) -> dict:
    snap = expect(client.get("/admin/engine", headers=server.admin), 200, "/admin/engine")
    device, host, adapters = snap["device"], snap["host"], snap["adapters"]
    return {
        "running": snap["running_requests"],
        "waiting": snap["waiting_requests"],
        "kv_blocks_used": snap["kv_cache"]["blocks_used"],
        "kv_blocks_usable": snap["kv_cache"]["blocks_usable"],
        "device_adapters": device["count"],
        "device_mib": device["bytes"] / MIB,
        "host_adapters": host["count"],
        "host_mib": host["bytes"] / MIB,
        "host_capacity_mib": host["capacity_bytes"] / MIB,
        "registered_adapters": len(adapters),
        "adapters_by_tier": dict(Counter(adapter["tier"] for adapter in adapters)),
        "ttft_p50_ms": snap["ttft"]["p50_ms"],
        "itl_p50_ms": snap["itl"]["p50_ms"],
    }


def _metric_figures(client: httpx.Client) -> dict:
    sums: Counter = Counter()
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if family.name in METRICS and sample.name == f"{family.name}_total":
                sums[family.name.removeprefix("loramux_")] += sample.value
            elif sample.name == "loramux_http_requests_total":
                sums["http_requests"] += sample.value
                sums["http_5xx"] += sample.value if sample.labels["status"].startswith("5") else 0
    return dict(sums)


def stop_and_inspect(server: Server) -> dict:
    """SIGTERM, then what the server left: files, database rows, its log's errors."""
    ending = {"shutdown": server.stop(), "leftovers": leftovers(server)}
    return {
        "database": read_database(server.data_dir),
        "ending": ending,
        "server_log_errors": log_errors(server)[:50],
        "server_log_tail": redact(server.log_tail(3000)),
    }


def leftovers(server: Server) -> list[str]:
    """What uploads and requests left behind: anything in the upload workspace, anything
    in the server's TMPDIR but torch's cache folder."""
    uploads = [f"tmp/uploads/{name}" for name in listing(server.data_dir / "tmp" / "uploads")]
    tmpdir = [name for name in listing(server.tmp_dir) if not name.startswith(TORCH_CACHE_PREFIX)]
    return uploads + [f"TMPDIR/{name}" for name in tmpdir]


def read_database(data_dir: Path) -> dict:
    """After the server exited: adapter versions by status, provisional usage rows."""
    db = sqlite3.connect(f"file:{data_dir / 'loramux.db'}?mode=ro", uri=True)
    try:
        versions = dict(db.execute("SELECT status, COUNT(*) FROM adapter_versions GROUP BY status"))
        live, deleted = db.execute(
            "SELECT SUM(deleted_at IS NULL), SUM(deleted_at IS NOT NULL) FROM adapters"
        ).fetchone()
        (provisional,) = db.execute("SELECT COUNT(*) FROM usage_records WHERE NOT final").fetchone()
    finally:
        db.close()
    return {
        "versions_by_status": versions,
        "stuck_versions": versions.get("uploading", 0) + versions.get("validating", 0),
        "adapters_live": live or 0,
        "adapters_deleted": deleted or 0,
        "provisional_usage_rows": provisional,
    }


def log_errors(server: Server) -> list[str]:
    """Lines of the server's log that report an error or a traceback."""
    lines = server.log.read_text(errors="replace").splitlines()
    return [redact(line) for line in lines if "Traceback" in line or line.startswith("ERROR")]
