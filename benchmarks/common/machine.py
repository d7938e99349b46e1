"""The machine a benchmark ran on, and whether other work competed for its cores meanwhile.

``machine_info`` is every report's description of the host (CPU, cores, memory, Python and
library versions) and, given a device, of the accelerator measured (``accelerator``: its
name and memory, CUDA and Triton versions, the kernel backend the engine picks there).
``Clock`` times a block and records this process's CPU seconds and the 1-minute load
average around it; ``contention`` reads a run's clocks: a load above the cores, or fewer
cores used than torch has threads, means other processes took part of the machine.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import platform
import time
from pathlib import Path

import torch


def _proc_field(path: str, name: str) -> str | None:
    """The value after ``name:`` in a /proc file (None where there is none)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(device: torch.device | str | None = None) -> dict:
    """The host, and with ``device`` the accelerator as ``accelerator``."""
    mem_kib = _proc_field("/proc/meminfo", "MemTotal")
    uname = platform.uname()
    info = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "processor": platform.processor() or None,
        "cpu_model": _proc_field("/proc/cpuinfo", "model name"),
        "uname": f"{uname.system} {uname.release} {uname.machine}",
        "nproc": available_cores(),
        "cpu_count": os.cpu_count(),
        "mem_total_gib": round(int(mem_kib.split()[0]) / 1024**2, 1) if mem_kib else None,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "peft": _version("peft"),
    }
    if device is not None:
        info["accelerator"] = accelerator_info(torch.device(device))
    return info


def accelerator_info(device: torch.device) -> dict:
    from loramux.engine.lora.backend import select_backend

    info = {
        "device": "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "kernels": select_backend(device, torch.bfloat16).name,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
        }
    return info


def available_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class Clock:
    """Wall seconds of a block, and how much CPU this process got meanwhile.

    CPU seconds over wall seconds, against torch's thread count, shows whether other
    processes competed for the cores during the measurement.
    """

    def __enter__(self) -> Clock:
        self.load_before = os.getloadavg()[0]
        self._cpu, self._wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._wall
        self.cpu_seconds = time.process_time() - self._cpu
        self.load_after = os.getloadavg()[0]

    def summary(self) -> dict:
        return {
            "cpu_seconds": round(self.cpu_seconds, 2),
            "cores_used": round(self.cpu_seconds / self.seconds, 2),
            "loadavg_1m_before": round(self.load_before, 2),
            "loadavg_1m_after": round(self.load_after, 2),
        }

    def to_json(self) -> dict:
        """Every reading, unrounded (a worker process hands its clock back so)."""
        names = ("seconds", "cpu_seconds", "load_before", "load_after")
        return {name: getattr(self, name) for name in names}

    @classmethod
    def from_json(cls, raw: dict) -> Clock:
        clock = cls()
        for name, value in raw.items():
            setattr(clock, name, float(value))
        return clock


def contention(clocks: list[dict], machine: dict) -> dict:
    """Whether other processes competed for the cores during the runs whose
    ``Clock.summary()`` are ``clocks``: a 1-minute load above the cores (this process's
    threads count in it), or cores used below 3/4 of torch's threads."""
    threads = machine["torch_threads"]
    max_load = max(max(c["loadavg_1m_before"], c["loadavg_1m_after"]) for c in clocks)
    min_cores = min(c["cores_used"] for c in clocks)
    return {
        "max_loadavg_1m": round(max_load, 2),
        "min_cores_used": min_cores,
        "contended": max_load > (machine["nproc"] or threads) + 0.5 or min_cores < 0.75 * threads,
    }


def busy_warning(busy: dict, machine: dict) -> list[str]:
    """The report's warning lines for ``contention``'s answer (none on a quiet machine)."""
    if not busy["contended"]:
        return []
    return [
        "",
        "**Warning: the machine was busy during the runs** (1-minute load average up to "
        f"{busy['max_loadavg_1m']} on {machine['nproc']} cores, this process's own threads "
        f"included; cores used as low as {busy['min_cores_used']}): the figures are noisier "
        "than on an idle machine.",
    ]


def machine_text(machine: dict, libraries: tuple[str, ...] = ("torch",)) -> str:
    """``Machine: [accelerator;] CPU, cores (torch threads), memory, kernel; Python and
    libraries. Date.``"""
    versions = "".join(f", {name} {machine[name]}" for name in libraries)
    gpu, on_gpu = machine.get("accelerator") or {"device": "cpu"}, ""
    if gpu["device"] != "cpu":
        on_gpu = f"{gpu['device']} ({gpu.get('memory_gib')} GiB, CUDA {gpu['cuda']}, "
        on_gpu += f"triton {gpu['triton']}); "
    return (
        f"Machine: {on_gpu}{machine['cpu_model'] or machine['processor']}, {machine['nproc']} "
        f"cores (torch threads {machine['torch_threads']}), {machine['mem_total_gib']} GiB, "
        f"{machine['uname']}; Python {machine['python']}{versions}. Date {machine['date']}."
    )
