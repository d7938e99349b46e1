"""``python -m loramux.benchmarks.tensor_parallel --smoke`` on the tiny model: one engine in
one process and one over two (gloo), the same requests, the report written. Times mean
nothing here and are not asserted; what is: the report's shape, that both engines gave the
same token ids, and that the tensor-parallel run spent some, not all, of its step time in
collectives (timed by the ranks' group)."""

from __future__ import annotations

import json

import pytest
import torch

from loramux.benchmarks.bench import study


def test_the_smoke_compares_one_process_with_two_ranks(tiny_model_dir, tmp_path):
    status = study("tensor-parallel").main(
        [
            "--smoke",
            "--model",
            str(tiny_model_dir),
            "--out",
            str(tmp_path),
            "--cache-dir",
            str(tmp_path),
        ]
    )
    assert status == 0
    report = json.loads((tmp_path / "tensor_parallel_cpu.json").read_text())
    assert report["same_tokens"] is True
    one, split = report["one_process"], report["tensor_parallel"]
    assert (one["tensor_parallel_size"], split["tensor_parallel_size"]) == (1, 2)
    assert one["output_tokens"] == split["output_tokens"] == 2 * 4
    assert 0 < split["communication_share"] < 1 and 0 < split["command_share"] < 1
    assert split["all_reduce_ms"] > 0  # the probe's two ranks reduced
    assert "communication share" in (tmp_path / "tensor_parallel_cpu.md").read_text()


def test_the_gpu_form_without_two_gpus_says_so(tmp_path, capsys):
    if torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs here: the GPU form would run")
    status = study("tensor-parallel").main(["--device", "cuda", "--out", str(tmp_path)])
    assert status == 2
    assert "needs two GPUs" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written
