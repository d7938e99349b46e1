"""``make gpu-check``'s CPU form: every section runs, its results are packed, and a budget
too small for the sections says so (the GPU form cannot run here). The smoke run is the
session's ``gpu_check_smoke`` (tests/benchmarks/conftest.py), whose kernels section the
kernel benchmark's tests read too."""

from __future__ import annotations

import json
import tarfile

import pytest
import torch

from tests.benchmarks.commands import gpu_check

SECTIONS = ["tests", "lora-tiles", "kernels", "punica-distinct", "slora-s2", "simulation"]


def test_the_smoke_runs_every_section_and_bundles_their_results(gpu_check_smoke):
    done, out = gpu_check_smoke.done, gpu_check_smoke.out
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    assert [s["name"] for s in report["sections"]] == SECTIONS
    assert {s["status"] for s in report["sections"]} == {"passed"}, report["sections"]
    assert report["smoke"] is True and report["device"]["device"] == "cpu"

    # What a lent machine hands back: a few files, the sections' results packed.
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_check.json",
        "gpu_check.log",
        "gpu_check.md",
        "gpu_check_results.tar.gz",
    ]
    with tarfile.open(out / "gpu_check_results.tar.gz") as bundle:
        names = set(bundle.getnames())
    for expected in (
        "results/kernels_gpu_cpu-smoke.json",
        "results/lora_tiles_cpu-interpreter-smoke.json",
        "results/bench_punica-distinct-smoke.json",
        "results/bench_slora-s2-smoke.json",
        "results/simulation_calibration_nvidia-h100-80gb-hbm3-smoke.json",
    ):
        assert expected in names, sorted(names)
    log = (out / "gpu_check.log").read_text()
    assert "test_cuda_graphs_replay_peft_tokens" in log  # the GPU tests were collected
    assert "test_lora_triton_fused.py::test_real_shapes_on_gpu" in log
    assert '"fused_max_tokens"' in log  # the tuning chose tiles (never written in a smoke)
    markdown = (out / "gpu_check.md").read_text()
    assert markdown.count("| passed |") == len(SECTIONS)


def test_a_spent_budget_runs_nothing_more_and_fails(tmp_path):
    done = gpu_check("--smoke", "--out", str(tmp_path), "--budget-s", "5")
    assert done.returncode == 1
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert [s["status"] for s in sections] == ["not run"] * len(SECTIONS)
    assert all(s["note"] == "the budget was spent before it" for s in sections)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the real check would run")
def test_without_a_gpu_only_the_smoke_runs(tmp_path):
    done = gpu_check("--out", str(tmp_path))
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr and "--smoke" in done.stderr
