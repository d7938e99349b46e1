"""The soak's sampling: the server's RSS, fds, threads and CPU time (``/proc``), its data
dir and ``TMPDIR``, ``/admin/engine`` and ``/metrics``, every few seconds.

Part of the soak (``soak.py``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from pathlib import Path

import httpx

from loramux.benchmarks.soak_ledger import Ledger
from loramux.benchmarks.soak_server import Server, expect
from loramux.benchmarks.soak_worker import Worker

MIB = 1 << 20


def proc_status(pid: int) -> dict:
    """RSS, peak RSS and threads from /proc/<pid>/status; open fds; CPU seconds used."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.split()
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


def entries(path: Path) -> int:
    with contextlib.suppress(FileNotFoundError):
        return len(os.listdir(path))
    return 0


def disk_figures(server: Server) -> dict:
    """The data dir by top-level entry (the database and its journal, the store, ...) and
    what the upload workspace and the server's TMPDIR hold now."""
    sizes: Counter = Counter()
    for entry in os.scandir(server.data_dir):
        name = "database" if entry.name.startswith("loramux.db") else entry.name
        path = Path(entry.path)
        sizes[name] += tree_bytes(path) if entry.is_dir() else path.stat().st_size
    return {
        "data_dir_mib": sum(sizes.values()) / MIB,
        "data_dir_parts_mib": {k: round(v / MIB, 3) for k, v in sorted(sizes.items())},
        "upload_tmp_entries": entries(server.data_dir / "tmp" / "uploads"),
        "tmpdir_entries": entries(server.tmp_dir),
        "tmpdir_mib": tree_bytes(server.tmp_dir) / MIB,
    }


def engine_figures(client: httpx.Client, server: Server) -> dict:
    snap = expect(client.get("/admin/engine", headers=server.admin), 200, "/admin/engine")
    tiers = Counter(adapter["tier"] for adapter in snap["adapters"])
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
        "adapters_by_tier": dict(tiers),
        "ttft_p50_ms": snap["ttft"]["p50_ms"],
        "itl_p50_ms": snap["itl"]["p50_ms"],
    }


# Counters and gauges of /metrics worth following over a soak (summed over their labels).
METRICS = (
    "loramux_adapter_loads",
    "loramux_adapter_evictions",
    "loramux_preemptions",
    "loramux_generated_tokens",
    "loramux_step_failures",
    "loramux_requests_failed_in_step",
)


def metric_figures(client: httpx.Client) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get("/metrics").text
    sums: Counter = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name in METRICS and sample.name == f"{family.name}_total":
                sums[family.name.removeprefix("loramux_")] += sample.value
            elif sample.name == "loramux_http_requests_total":
                status = sample.labels.get("status", "")
                sums["http_requests"] += sample.value
                sums["http_5xx"] += sample.value if status.startswith("5") else 0
            elif family.name in METRICS and family.type == "gauge":
                sums[family.name.removeprefix("loramux_")] += sample.value
    return dict(sums)


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


class Sampler(Worker):
    """Takes a sample every ``interval`` seconds until stopped, then one last."""

    def __init__(self, server: Server, ledger: Ledger, interval: float, stop: threading.Event):
        super().__init__("soak-sampler")
        self.server = server
        self.ledger = ledger
        self.interval = interval
        self.stop = stop
        self.samples: list[dict] = []
        self.errors: list[str] = []

    def work(self) -> None:
        with httpx.Client(base_url=self.server.url, timeout=60) as client:
            self.take(client)
            while not self.stop.wait(self.interval):
                self.take(client)

    def take(self, client: httpx.Client) -> None:
        sample = {"t_s": round(self.ledger.now(), 2), "load1": loadavg()}
        try:
            sample |= proc_status(self.server.process.pid)
            sample |= disk_figures(self.server)
            sample |= engine_figures(client, self.server)
            sample |= metric_figures(client)
        except (OSError, httpx.HTTPError, RuntimeError, KeyError) as exc:
            self.errors.append(f"{sample['t_s']} s: {type(exc).__name__}: {exc}"[:300])
        self.samples.append(sample)
