"""What ``loramux bench simulate`` runs: the recorded GPU runs replayed (calibration) and
S-LoRA's table; each a report of simulated figures beside the profile that made them."""

from __future__ import annotations

import json
from pathlib import Path

from loramux.benchmarks.common.files import RESULTS_DIR
from loramux.benchmarks.common.slora_workloads import SETTINGS, adapter_rank, slora_requests
from loramux.benchmarks.common.workload import WorkloadSpec, adapter_ranks, generate
from loramux.benchmarks.simulate import SimulatedRun, engine_config, model_dir, serve
from loramux.engine.simulation.calibration import decode_step_table
from loramux.engine.simulation.profile import DeviceProfile


def recorded_runs(folder: Path, profile: DeviceProfile, suffix: str = "") -> dict[str, Path]:
    """The recorded GPU runs in ``folder`` a profile is calibrated against: the presets'
    and the kernels' quick run on that profile's GPU (those present). ``suffix``: "-smoke"
    for the CPU smoke's files (a plumbing check of ``make gpu-check --smoke``)."""
    runs = {
        "slora-s2": folder / f"bench_slora-s2{suffix}.json",
        "punica-distinct": folder / f"bench_punica-distinct{suffix}.json",
        "kernels": folder / f"kernels_gpu_{profile.name}-quick.json",
    }
    return {name: path for name, path in runs.items() if path.is_file()}


# The recorded run's own engine settings that the simulation takes (the rest are the GPU
# presets' and the simulation's).
ENGINE_SETTINGS = (
    "kv_cache_bytes",
    "adapter_host_bytes",
    "adapter_load_workers",
    "max_num_seqs",
    "max_num_batched_tokens",
    "cuda_graph_max_batch",
    "block_size",
    "max_lora_rank",
)
PER_MINUTE = ("adapter_reloads", "device_evictions", "adapter_room_wait_steps", "preemptions")


def per_minute_cell(per_minute: dict[str, float]) -> str:
    """The four residency counters per minute, as the reports' tables show them."""
    return " / ".join(f"{per_minute[k]:.0f}" for k in PER_MINUTE)


def replay(
    recorded: Path, profile: DeviceProfile, cache_dir: Path, tokenizer_dir: Path
) -> tuple[dict, SimulatedRun]:
    """A recorded ``loramux bench`` GPU run's workload served on the simulated GPU, at the
    recorded model's shapes: the recorded figures and the simulated run."""
    raw = json.loads(recorded.read_text())
    hf = hf_config(raw["model"]["config"])
    model = model_dir(
        cache_dir, f"recorded-{hf['hidden_size']}x{hf['num_hidden_layers']}", hf, tokenizer_dir
    )
    spec = WorkloadSpec.from_json(raw["workload"])
    eos = frozenset(raw["model"]["config"]["eos_token_ids"])
    settings = {k: raw["engine_config"][k] for k in ENGINE_SETTINGS}
    run = serve(
        engine_config(model, **settings),
        profile,
        generate(spec),
        adapter_ranks(spec),
        vocab_size=raw["model"]["config"]["vocab_size"],
        seed=spec.seed,
        avoid=eos,
        preload=spec.popularity == "distinct",  # the punica preset loads them first
    )
    return raw, run


def hf_config(recorded: dict) -> dict:
    """config.json for a recorded run's model (its report holds the engine's ModelConfig)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": recorded["vocab_size"],
        "hidden_size": recorded["hidden_size"],
        "intermediate_size": recorded["intermediate_size"],
        "num_hidden_layers": recorded["num_layers"],
        "num_attention_heads": recorded["num_heads"],
        "num_key_value_heads": recorded["num_kv_heads"],
        "head_dim": recorded["head_dim"],
        "max_position_embeddings": recorded["max_position_embeddings"],
        "rms_norm_eps": recorded["rms_norm_eps"],
        "rope_theta": recorded["rope_theta"],
        "tie_word_embeddings": recorded["tie_word_embeddings"],
        "bos_token_id": recorded["bos_token_id"],
        "eos_token_id": recorded["eos_token_ids"][0],
        "torch_dtype": "bfloat16",
    }


def calibration(
    profile: DeviceProfile,
    cache_dir: Path,
    tokenizer_dir: Path,
    recorded: Path = RESULTS_DIR,
    suffix: str = "",
) -> dict:
    """Every recorded figure in ``recorded`` against its simulation, with the error; and
    the slora-s2 run's steps, simulated beside measured (when the run recorded them)."""
    runs = recorded_runs(recorded, profile, suffix)
    rows, steps = [], {}
    if "kernels" in runs:
        for r in decode_step_table(profile, runs["kernels"]):
            rows.append(
                _row("kernels_gpu decode step", r.what, "ms", r.measured_ms, r.simulated_ms)
            )
    if "slora-s2" in runs:
        rows += _slora_rows(runs["slora-s2"], profile, cache_dir, tokenizer_dir, steps)
    if "punica-distinct" in runs:
        raw, run = replay(runs["punica-distinct"], profile, cache_dir, tokenizer_dir)
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
    return {
        "profile": profile.name,
        "label": profile.describe(),
        "recorded": {name: str(path) for name, path in runs.items()},
        "rows": rows,
        "steps": steps,
    }


def _slora_rows(
    path: Path, profile: DeviceProfile, cache_dir: Path, tokenizer_dir: Path, steps: dict
) -> list[dict]:
    raw, run = replay(path, profile, cache_dir, tokenizer_dir)
    measured, simulated = raw["loramux"], run.summary
    rows = [
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
    steps["slora-s2"] = {"measured": measured.get("steps"), "simulated": run.step_summary}
    return rows


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
    host_resident: bool = False,
    engine: dict | None = None,
) -> dict:
    """S-LoRA's trace for the setting at each adapter count and offered rate, served with
    adapters and by the base model alone (the ceiling); ``host_resident``: the adapters in
    host RAM when the run starts (S-LoRA's setting), else fetched from the store on demand;
    ``engine``: engine settings over the GPU presets'."""
    engine = engine or {}
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
                    engine_config(model, **engine),
                    profile,
                    requests,
                    ranks,
                    vocab_size=setting.model["vocab_size"],
                    base_model=base,
                    host_resident=host_resident and not base,
                )
                rows.append(_table_row(rate, None if base else count, run))
                print(json.dumps(rows[-1]), flush=True)
    return {
        "setting": setting_name,
        "adapters_start": "in host RAM" if host_resident else "in the store (fetched on demand)",
        "engine": engine,
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
        "step_seconds": run.step_seconds,  # where the simulated steps' time went
        "adapter_floor_ratio": run.adapter_floor_ratio,
    }
