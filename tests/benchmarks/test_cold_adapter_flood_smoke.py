"""``python -m loramux.benchmarks.cold_adapter_flood``'s plumbing for a few seconds on the
tiny model: a real ``loramux serve``, a small flood, one cold probe. The times mean nothing
here; what is asserted is that every part ran and wrote its files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_flood_benchmark_runs_and_reports(tmp_path, tiny_model_dir):
    command = [
        sys.executable,
        *("-m", "loramux.benchmarks.cold_adapter_flood"),
        *("--streams", "2", "--flood-tokens", "40", "--warmup", "2", "--probes", "1"),
        *("--model", str(tiny_model_dir), "--cache-dir", str(tmp_path / "cache")),
        *("--out", str(tmp_path)),
    ]
    done = subprocess.run(
        command,
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "cold_adapter_flood_cpu.json").read_text())
    assert report["idle"]["cold_s"] > 0 and report["idle"]["base_s"] > 0
    [probe] = report["flood"]
    assert probe["cold_s"] > 0 and probe["base_s"] > 0
    assert report["kv_before"]["running"] >= 1  # the flood was running when it probed
    markdown = (tmp_path / "cold_adapter_flood_cpu.md").read_text()
    assert "cold adapter TTFT" in markdown
