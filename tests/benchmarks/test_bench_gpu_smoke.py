"""The GPU runner of ``loramux bench`` (``benchmarks/serve/gpu.py``) in its CPU smoke mode.

``bench.py PRESET --smoke`` runs the very code a GPU session runs for ``slora-s2`` and
``punica-distinct`` (engine with random weights and callable adapter sources, PEFT with
swapped adapters on the same weights, the report) at tiny shapes in float32 on the CPU,
so every figure, reference and verdict must be in its JSON, and both systems, holding
identical weights, must produce identical greedy tokens. Times are not asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loramux.benchmarks.gpu_check import runner as gpu_check

REPO_ROOT = Path(__file__).resolve().parents[2]
MODULE = "loramux.benchmarks.bench"
LATENCIES = ("ttft_s", "itl_s", "e2e_s")


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    return subprocess.run(
        [sys.executable, "-m", MODULE, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def smoke(gpu_check_smoke, preset: str) -> tuple[dict, str, Path]:
    """The preset's smoke as the session's ``make gpu-check`` smoke ran it (its sections
    ``slora-s2`` and ``punica-distinct``: tests/benchmarks/conftest.py), read from the
    results it bundled, so the two presets run once per session."""
    done, out = gpu_check_smoke.done, gpu_check_smoke.results
    assert (out / f"bench_{preset}-smoke.json").is_file(), done.stdout[-3000:] + done.stderr
    markdown = (out / f"bench_{preset}-smoke.md").read_text()
    return json.loads((out / f"bench_{preset}-smoke.json").read_text()), markdown, out


@pytest.fixture(scope="module")
def slora(gpu_check_smoke) -> tuple[dict, str, Path]:
    return smoke(gpu_check_smoke, "slora-s2")


@pytest.fixture(scope="module")
def punica(gpu_check_smoke) -> tuple[dict, str, Path]:
    return smoke(gpu_check_smoke, "punica-distinct")


def test_the_gpu_check_runs_the_presets_as_this_module_reads_them():
    """What the fixtures above stand on: gpu_check's smoke runs ``bench.py PRESET --smoke``
    at the smoke's own request count, punica-distinct with the adapters sweep."""
    argv = {s.name: s.smoke_argv for s in gpu_check._sections(Path("results"))}
    assert argv["slora-s2"][2:] == (MODULE, "slora-s2", "--smoke", "--out", "results")
    punica = argv["punica-distinct"][2:]
    assert punica[:3] == (MODULE, "punica-distinct", "--smoke")
    assert punica[3:] == (*gpu_check.PUNICA_SMOKE_SWEEP, "--out", "results")


def test_the_smoke_prints_its_markdown(tmp_path):
    """``bench.py PRESET --smoke`` prints the report it writes (the runs above are read
    from gpu_check's bundle, which keeps only the files)."""
    done = bench("slora-s2", "--smoke", "--requests", "4", "--no-baseline", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "bench_slora-s2-smoke.md").read_text() in done.stdout


def assert_every_figure(figures: dict, served: int) -> None:
    assert figures["requests"] == {"total": served, "ok": served, "failed": 0}
    assert figures["duration_s"] > 0
    assert figures["requests_per_s"] > 0 and figures["output_tokens_per_s"] > 0
    for key in LATENCIES:
        assert all(figures[key][q] is not None for q in ("mean", "p50", "p90", "p99")), key
        assert len(figures["samples"][key]) > 0
    assert "peak_gpu_bytes" in figures and figures["peak_gpu_bytes"] is None  # no GPU here


def test_slora_smoke_reports_both_systems_on_the_same_weights(slora):
    report = slora[0]
    assert report["mode"] == "smoke" and report["preset"] == "slora-s2"
    workload = report["workload"]
    assert (workload["num_requests"], workload["num_adapters"]) == (12, 8)
    assert workload["ranks"] == [64, 32, 16, 8] and workload["popularity"] == "power"
    assert_every_figure(report["loramux"], 12)
    assert_every_figure(report["baseline"], 8)  # the baseline serves the first 8
    assert report["loramux"]["adapter_traffic"]["loads"] >= 1  # fetched by the loader
    swaps = report["baseline"]["adapter_traffic"]
    assert swaps["adapter_loads"] >= 3 and swaps["adapter_evictions"] >= 1
    assert "deletes the least recently used beyond 2" in report["baseline"]["policy"]
    assert report["ratios"]["requests_per_s"] > 0
    assert "the baseline over the first 8" in report["ratio_note"]
    # identical random weights in both, float32: token for token the same
    assert report["agreement"]["requests"] == 8
    assert report["agreement"]["identical_requests"] == 8, report["agreement"]
    engine = report["engine_config"]
    assert engine["load_format"] == "random" and engine["device"] == "cpu"
    assert engine["kv_cache_bytes"] == 16 << 20 and engine["adapter_host_bytes"] == 64 << 20
    assert report["model"]["config"]["hidden_size"] == 64 and report["model"]["dtype"] == "float32"
    machine = report["machine"]
    assert all(machine[k] for k in ("torch", "transformers", "peft", "python"))
    assert machine["accelerator"]["device"] == "cpu" and machine["accelerator"]["triton"]
    assert report["gpu_figures"].startswith("not measured yet")


def test_slora_smoke_puts_the_published_figure_and_goal_next_to_its_own(slora):
    report, markdown, out = slora
    (reference,) = report["references"]
    assert (reference["system"], reference["value"]) == ("S-LoRA", 6.69)
    assert reference["loramux"] == report["loramux"]["requests_per_s"]
    (goal,) = report["goals"]
    assert (goal["metric"], goal["value"], goal["strict"]) == ("requests_per_s", 12.0, False)
    assert goal["met"] is None and goal["verdict"].startswith("not judged: the CPU smoke")
    assert "| S-LoRA | A100-80GB, Llama-7B, S2, 1,000 adapters | 6.69 req/s |" in markdown
    assert "**Goal: loramux req/s ≥ 12" in markdown and "not judged" in markdown
    assert "Greedy agreement (same weights in both): 8/8" in markdown
    for plot in ("latency_cdf", "tenant_share"):
        assert (out / f"bench_slora-s2-smoke_{plot}.png").stat().st_size > 10_000


def test_punica_smoke_preloads_adapters_and_sweeps(punica):
    report, markdown, out = punica
    assert report["workload"]["popularity"] == "distinct"
    assert_every_figure(report["loramux"], 12)
    assert_every_figure(report["baseline"], 8)
    # every adapter on the device before the clock: the timed run never missed one
    traffic = report["loramux"]["adapter_traffic"]
    assert traffic["device_misses"] == 0 and traffic["loads"] == 0
    swaps = report["baseline"]["adapter_traffic"]
    assert swaps["preloaded"] == 8 and swaps["adapter_loads"] == 8  # none inside batches
    assert report["agreement"]["identical_requests"] == report["agreement"]["requests"] == 8
    (goal,) = report["goals"]
    assert (goal["metric"], goal["value"], goal["strict"]) == ("output_tokens_per_s", 1053.0, True)
    assert "| Punica | Llama2-7B, distinct adapters, batch 32 | 1053 output tok/s |" in markdown
    sweep = report["sweeps"]["adapters"]
    assert [p["num_adapters"] for p in sweep["points"]] == [2, 4]
    assert all(p["figures"]["requests"]["ok"] == 12 for p in sweep["points"])
    plot = out / "bench_punica-distinct-smoke_throughput_vs_adapters.png"
    assert plot.stat().st_size > 10_000


def test_prepare_only_writes_the_llama_7b_folder_without_weights():
    done = bench("slora-s2", "--prepare-only", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    folder = Path(done.stdout.strip().splitlines()[-1])
    config = json.loads((folder / "config.json").read_text())
    shape = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers")
    assert [config[k] for k in shape] == [4096, 32, 32, 32]
    assert (config["intermediate_size"], config["vocab_size"]) == (11008, 32000)
    assert (folder / "tokenizer.json").is_file()
    assert not list(folder.glob("*.safetensors")) and not list(folder.glob("*.bin"))
