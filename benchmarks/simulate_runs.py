"""What ``loramux bench simulate`` runs: the recorded GPU runs replayed (calibration) and
S-LoRA's table; each a report of simulated figures beside the profile that made them."""

from __future__ import annotations

import json
from pathlib import Path

from loramux.benchmarks.bench_gpu_model import LLAMA_7B
from loramux.benchmarks.files import RESULTS_DIR
from loramux.benchmarks.simulate import SimulatedRun, engine_config, model_dir, serve
from loramux.benchmarks.slora_workloads import SETTINGS, adapter_rank, slora_requests
from loramux.benchmarks.workload import WorkloadSpec, adapter_ranks, generate
from loramux.engine.simulation.calibration import decode_step_table
from loramux.engine.simulation.profile import DeviceProfile

# The recorded H100 runs a profile is calibrated against.
RECORDED = {
    "slora-s2": RESULTS_DIR / "bench_slora-s2.json",
    "punica-distinct": RESULTS_DIR / "bench_punica-distinct.json",
    "kernels": RESULTS_DIR / "kernels_gpu_nvidia-h100-80gb-hbm3-quick.json",
}
PER_MINUTE = ("adapter_reloads", "device_evictions", "adapter_room_wait_steps", "preemptions")


def replay(recorded: Path, profile: DeviceProfile, model: Path) -> tuple[dict, SimulatedRun]:
    """A recorded ``loramux bench`` GPU run's workload served on the simulated GPU: the
    recorded figures and the simulated run."""
    raw = json.loads(recorded.read_text())
    spec = WorkloadSpec.from_json(raw["workload"])
    eos = frozenset(raw["model"]["config"]["eos_token_ids"])
    run = serve(
        engine_config(model),
        profile,
        generate(spec),
        adapter_ranks(spec),
        vocab_size=raw["model"]["config"]["vocab_size"],
        seed=spec.seed,
        avoid=eos,
        preload=spec.popularity == "distinct",  # the punica preset loads them first
    )
    return raw, run


def calibration(profile: DeviceProfile, cache_dir: Path, tokenizer_dir: Path) -> dict:
    """Every recorded figure against its simulation, with the error."""
    model = model_dir(cache_dir, "llama-7b", LLAMA_7B, tokenizer_dir)
    rows = []
    for r in decode_step_table(profile, RECORDED["kernels"]):
        rows.append(_row("kernels_gpu decode step", r.what, "ms", r.measured_ms, r.simulated_ms))
    raw, run = replay(RECORDED["slora-s2"], profile, model)
    measured, simulated = raw["loramux"], run.summary
    rows += [
        _row(
            "slora-s2",
            "requests per second",
            "req/s",
            measured["requests_per_s"],
            simulated["requests_per_s"],
        ),
        _row("slora-s2", "TTFT P50", "s", measured["ttft_s"]["p50"], simulated["ttft_s"]["p50"]),
        _row("slora-s2", "ITL P50", "s", measured["itl_s"]["p50"], simulated["itl_s"]["p50"]),
        _row(
            "slora-s2",
            "preemptions",
            "count",
            measured["adapter_traffic"]["preemptions"],
            run.traffic["preemptions"],
        ),
        _row(
            "slora-s2",
            "device evictions",
            "count",
            measured["adapter_traffic"]["device_evictions"],
            run.traffic["device_evictions"],
        ),
        _row(
            "slora-s2",
            "adapter loads",
            "count",
            measured["adapter_traffic"]["loads"],
            run.traffic["loads"],
        ),
    ]
    raw, run = replay(RECORDED["punica-distinct"], profile, model)
    rows += [
        _row(
            "punica-distinct",
            "output tokens per second",
            "tok/s",
            raw["loramux"]["output_tokens_per_s"],
            run.summary["output_tokens_per_s"],
        ),
        _row(
            "punica-distinct",
            "ITL P50",
            "s",
            raw["loramux"]["itl_s"]["p50"],
            run.summary["itl_s"]["p50"],
        ),
    ]
    return {"profile": profile.name, "label": profile.describe(), "rows": rows}


def _row(run: str, figure: str, unit: str, measured: float, simulated: float) -> dict:
    error = None if not measured else simulated / measured - 1
    return {
        "run": run,
        "figure": figure,
        "unit": unit,
        "measured": measured,
        "simulated": simulated,
        "error": error,
    }


def slora_table(
    setting_name: str,
    profile: DeviceProfile,
    cache_dir: Path,
    tokenizer_dir: Path,
    adapter_counts: list[int],
    rates: list[float],
    duration_s: float | None,
) -> dict:
    """S-LoRA's trace for the setting at each adapter count and offered rate, served with
    adapters and by the base model alone (the ceiling)."""
    setting = SETTINGS[setting_name]
    model = model_dir(cache_dir, f"{setting_name.lower()}-model", setting.model, tokenizer_dir)
    rows = []
    for rate in rates:
        for count in adapter_counts:
            requests = slora_requests(setting, count, rate=rate, duration_s=duration_s)
            ranks = [adapter_rank(setting, k) for k in range(count)]
            for base in (False, True):
                if base and count != adapter_counts[0]:
                    continue  # the base model's run does not depend on the adapters
                run = serve(
                    engine_config(model),
                    profile,
                    requests,
                    ranks,
                    vocab_size=setting.model["vocab_size"],
                    base_model=base,
                )
                rows.append(_table_row(rate, None if base else count, run))
                print(json.dumps(rows[-1]), flush=True)
    return {
        "setting": setting_name,
        "profile": profile.name,
        "label": profile.describe(),
        "rows": rows,
    }


def _table_row(rate: float, adapters: int | None, run: SimulatedRun) -> dict:
    s = run.summary
    return {
        "offered_rate": rate,
        "adapters": adapters,  # None: the base model alone
        "requests": s["requests"]["total"],
        "requests_per_s": s["requests_per_s"],
        "output_tokens_per_s": s["output_tokens_per_s"],
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p99_s": s["ttft_s"]["p99"],
        "itl_p50_s": s["itl_s"]["p50"],
        "per_minute": {k: run.per_minute(k) for k in PER_MINUTE},
        "simulated_s": s["duration_s"],
        "real_s": run.real_seconds,
    }
