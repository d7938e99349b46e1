"""A worker's validation scratch in the data directory: a folder per worker process, and
what killed workers of the same host left removed by the next worker process."""

from __future__ import annotations

import os
import subprocess
import sys

from loramux.platform.services.upload_workspace import WorkerScratch
from loramux.platform.settings import Settings
from loramux.platform.tasks.resources import TaskResources


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_workers_folder_is_its_own_and_dead_workers_folders_of_this_host_go(tmp_path):
    scratch = WorkerScratch.in_data_dir(tmp_path)
    mine = scratch.folder()
    assert mine == tmp_path / "tmp" / "validate" / f"{scratch.host}-{os.getpid()}"
    dead = scratch.root / f"{scratch.host}-{dead_pid()}"
    other_host = scratch.root / f"another-host-{dead_pid()}"
    for folder in (dead, other_host):
        (folder / "loramux-validate-x").mkdir(parents=True)
        (folder / "loramux-validate-x" / "adapter_model.safetensors").write_bytes(b"w")
    assert scratch.remove_dead() == 1
    assert not dead.exists()
    assert mine.is_dir() and other_host.is_dir()  # alive, or not this host's to judge


def test_a_worker_process_clears_what_dead_workers_left_when_it_starts(tmp_path):
    scratch = WorkerScratch.in_data_dir(tmp_path)
    dead = scratch.root / f"{scratch.host}-{dead_pid()}"
    (dead / "loramux-validate-y").mkdir(parents=True)
    resources = TaskResources(Settings(data_dir=tmp_path, admin_token=None))
    context = resources.get()
    try:
        assert not dead.exists()
        assert context.scratch.root == scratch.root
    finally:
        context.sessions.kw["bind"].dispose()
