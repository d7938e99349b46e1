"""The GPU kernel benchmark's plumbing, run in its CPU smoke mode.

``python -m loramux.benchmarks.kernels_gpu --smoke`` runs every section at tiny shapes in
float32, the Triton kernels in Triton's interpreter, so CI keeps the script (imports,
shapes, output checks, the report) working for the session that runs it on an H100. Its
times mean nothing and are not asserted.

The run checked is the ``kernels`` section of the session's ``make gpu-check`` smoke
(``gpu_check_smoke``, tests/benchmarks/conftest.py): gpu_check runs exactly
``python -m loramux.benchmarks.kernels_gpu --smoke --out <results>`` there (asserted
below), so the slow interpreted grid runs once for both test modules.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from loramux.benchmarks.common.machine import machine_info
from loramux.benchmarks.kernels_gpu.runner import finish

MODULE = "loramux.benchmarks.kernels_gpu"
SECTIONS = (
    "decode_attention",
    "decode_step",
    "prefill_step",
    "prefill_attention",
    "lora",
    "quant_linear",
)
KERNEL_SECTIONS = ("decode_attention", "prefill_attention", "lora", "quant_linear")
VERDICTS = (
    "Verdict, decode step ≤ 1.25× base with CUDA graphs, ≤ 1.5× eager (4 distinct adapters",
    "Verdict, decode step ≤ 1.10× base with CUDA graphs, ≤ 1.5× eager (one adapter",
    "Verdict, prefill step ≤ 1.15× base",
    "Verdict, paged decode attention ≥ 70% of copy bandwidth",
)


@pytest.fixture(scope="module")
def smoke_run(gpu_check_smoke) -> tuple[dict, str, Path]:
    """The kernels section of the gpu-check smoke: its entry in gpu_check.json, its part of
    gpu_check.log (the command and its output) and the folder of its results."""
    report = json.loads((gpu_check_smoke.out / "gpu_check.json").read_text())
    (section,) = [s for s in report["sections"] if s["name"] == "kernels"]
    log = (gpu_check_smoke.out / "gpu_check.log").read_text()
    start = log.index("===== kernels: ")
    end = log.find("===== kernels: ", start + 1)
    section_log = log[start:] if end < 0 else log[start : log.find("\n", end) + 1]
    return section, section_log, gpu_check_smoke.results


def _only(out: Path, suffix: str) -> Path:
    found = sorted(out.glob(f"kernels_gpu_*-smoke{suffix}"))
    assert len(found) == 1, found
    return found[0]


def test_smoke_run_exits_zero(smoke_run):
    section, log, _ = smoke_run
    command = log.splitlines()[0]
    assert f" -m {MODULE} --smoke --out " in command, command
    assert (section["status"], section["exit_code"]) == ("passed", 0), log[-8000:]


def test_every_section_has_rows_that_match_their_reference(smoke_run):
    _, _, out = smoke_run
    data = json.loads(_only(out, ".json").read_text())
    assert data["complete"] and data["all_match"]
    assert data["rates"]["copy_gbs"] > 0 and data["rates"]["matmul_tflops"] > 0
    for section in SECTIONS:
        rows = data["sections"][section]
        assert rows, section
        for row in rows:
            assert row["matches"] is True and "error" not in row, (section, row)
    for section in KERNEL_SECTIONS:
        for row in data["sections"][section]:
            assert row["triton_ms"] > 0 and row["floor_ms"] > 0, row
            assert row["baseline_ms"] > 0 and row["baseline_rel_err"] is not None, row


def test_lora_rows_cover_both_kernels_and_every_op(smoke_run):
    _, _, out = smoke_run
    rows = json.loads(_only(out, ".json").read_text())["sections"]["lora"]
    assert {(r["kernel"], r["op"]) for r in rows} == {
        *((kernel, op) for kernel in ("sgmv", "bgmv") for op in ("shrink", "expand")),
        ("fused-sgmv", "fused"),
        ("fused-bgmv", "fused"),
    }
    assert {r["projection"] for r in rows} == {"qkv", "gate_up"}
    assert any(r["rank"].startswith("mixed") for r in rows)


def test_quant_rows_cover_every_form_against_the_dense_layer(smoke_run):
    _, _, out = smoke_run
    rows = json.loads(_only(out, ".json").read_text())["sections"]["quant_linear"]
    assert {r["weights"] for r in rows} == {"int8 per-channel", "int4 g32", "int4 g128"}
    assert {r["projection"] for r in rows} == {"q/o"}  # the smoke grid's one shape
    assert {r["tokens"] for r in rows} == {1, 5}
    for row in rows:
        # The packed weights are smaller than the dense ones, so their floor is no higher.
        assert 0 < row["weight_bytes"] < row["dense_weight_bytes"], row
        assert row["floor_speedup"] >= 1 and row["speedup_vs_baseline"] > 0, row
        # Decode rows give the achieved bandwidth of both; the others do not.
        decode = row["tokens"] == 1
        for key in ("achieved_gbs", "copy_fraction", "baseline_gbs"):
            assert (key in row) == decode, (key, row)


def test_decode_step_compares_lora_steps_with_the_base_step(smoke_run):
    _, _, out = smoke_run
    rows = json.loads(_only(out, ".json").read_text())["sections"]["decode_step"]
    assert [r["variant"] for r in rows].count("base") == 1
    lora = [r for r in rows if r["variant"] == "lora"]
    # shared and distinct adapters, each projection group's LoRA in one launch
    assert {r["kernel"] for r in lora} == {"fused-sgmv", "fused-bgmv"}
    assert all(r["base_ms"] > 0 and "overhead_pct" in r for r in lora)
    assert {r["target"] for r in lora} == {
        "decode_step_distinct_adapters",
        "decode_step_one_adapter",
    }
    for row in lora:
        assert row["launches_per_layer"] == row["graph_launches_per_layer"] == 4, row
    # The adapters change the output: the check compares two real LoRA computations.
    assert all(r["lora_effect"] > 1e-2 for r in lora)
    # The engine's static decode path ran each variant over its buffers (no capture on the
    # CPU) and computed the eager step's output.
    for row in rows:
        assert row["graph_ms"] > 0 and row["graph_captured"] is False, row
        assert row["graph_err"] < 1e-3, row
    assert all("graph_overhead_pct" in r for r in lora)


def test_prefill_step_compares_lora_steps_with_the_base_step(smoke_run):
    _, _, out = smoke_run
    rows = json.loads(_only(out, ".json").read_text())["sections"]["prefill_step"]
    assert [(r["variant"], r["adapters"]) for r in rows] == [("base", 0), ("lora", 1), ("lora", 2)]
    lora = rows[1:]
    assert [r["target"] for r in lora] == [None, "prefill_step_adapters"]
    for row in lora:
        assert row["base_ms"] > 0 and row["floor_ms"] > row["base_floor_ms"] > 0, row
        assert row["lora_effect"] > 1e-2 and row["launches_per_layer"] == 4, row


def test_markdown_states_every_target_verdict(smoke_run):
    _, _, out = smoke_run
    markdown = _only(out, ".md").read_text()
    for verdict in VERDICTS:
        assert re.search(re.escape(verdict) + r"[^\n]*\): (PASS|FAIL)", markdown), verdict


def test_a_mismatch_makes_the_exit_code_nonzero(tmp_path):
    results = {
        "sections": {"lora": [{"matches": True}, {"matches": False}]},
        "targets": {},
        "machine": machine_info("cpu"),
        "rates": {"copy_gbs": 1.0, "matmul_tflops": 1.0},
        "config": {
            "grid": "smoke",
            "dtype": "float32",
            "iters": 1,
            "warmup": 0,
            "tolerance": 1e-4,
            "step_tolerance": 1e-3,
        },
        "command": "test",
    }
    assert finish(results, tmp_path / "r") == 1
    assert json.loads((tmp_path / "r.json").read_text())["all_match"] is False
    results["sections"]["lora"].pop()
    assert finish(results, tmp_path / "r") == 0
