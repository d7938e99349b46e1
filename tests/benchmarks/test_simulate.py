"""S-LoRA's traces as S-LoRA draws them, and ``run_engine`` on a simulated GPU."""

from __future__ import annotations

import numpy as np
import pytest

from loramux.benchmarks.bench import study
from loramux.benchmarks.common.slora_workloads import SETTINGS, adapter_rank, slora_requests
from loramux.benchmarks.common.workload import WorkloadRequest
from loramux.benchmarks.simulate.churn import churn_markdown, churn_plot, churn_sweep
from loramux.benchmarks.simulate.runs import calibration_markdown, slora_markdown
from loramux.benchmarks.simulate.serve import SimulatedRunClock, engine_config, serve
from loramux.engine.simulation.clock import EngineStuck, SimulatedClock
from loramux.engine.simulation.profile import DeviceProfile


def test_s2_trace_is_s_lora_s_draws_in_s_lora_s_order():
    requests = slora_requests(SETTINGS["S2"], 1000)
    assert len(requests) == 1200  # 10 req/s for 120 s
    # Pinned from S-LoRA's generate_requests (np.random.seed(42); power, randint, randint,
    # gamma): a change of order or distribution shows here.
    first = requests[0]
    assert (first.adapter, first.prompt_len, first.output_len) == (374, 388, 268)
    assert first.arrival_s == pytest.approx(0.0503244877027261)
    assert requests[-1].arrival_s == pytest.approx(124.98691596483738)
    lens = np.array([r.prompt_len for r in requests] + [r.output_len for r in requests])
    assert lens.min() >= 8 and lens.max() <= 511  # randint's upper bound is excluded
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    # alpha 1: uniform popularity, so every quarter of the adapters draws about a quarter
    quarters = np.bincount([r.adapter * 4 // 1000 for r in requests], minlength=4)
    assert quarters.min() > 240


def test_settings_follow_s_lora_s_suite():
    s1, s2, s4 = SETTINGS["S1"], SETTINGS["S2"], SETTINGS["S4"]
    assert [adapter_rank(s2, k) for k in range(5)] == [64, 32, 16, 8, 64]
    assert s1.ranks == (8,) and s4.ranks == (64, 32, 16)
    assert s4.model["num_hidden_layers"] == 40 and s4.rate == 6.0
    assert len(slora_requests(s4, 100)) == 1800  # 6 req/s for 300 s


def test_the_run_clock_jumps_an_idle_engine_to_its_next_event():
    clock = SimulatedClock()
    run = SimulatedRunClock(clock)
    run.wait_until(1.5)
    assert run.now() == 1.5
    run.stepped(began=1.5, outputs=0, next_arrival=4.0)  # nothing ran: to the arrival
    assert run.now() == 4.0
    run.stepped(began=3.0, outputs=0, next_arrival=9.0)  # the step took time: stay
    assert run.now() == 4.0
    with pytest.raises(EngineStuck):
        run.stepped(began=4.0, outputs=0, next_arrival=None)


def test_an_arrival_waited_for_is_due_however_the_start_rounds():
    # 13.436... + 0.000847... - 13.436... rounds below 0.000847...: the driver would wait
    # for that arrival forever (it did, replaying punica-distinct's all-at-once arrivals).
    start, arrival = 13.436424411240122, 0.0008474337369372327
    assert (start + arrival) - start < arrival
    run = SimulatedRunClock(SimulatedClock(start))
    run.wait_until(arrival)
    assert run.now() >= arrival
    run.stepped(began=run.now(), outputs=0, next_arrival=2 * arrival)
    assert run.now() >= 2 * arrival


def test_a_simulated_bench_run_serves_every_request_at_its_length(tiny_model_dir):
    profile = DeviceProfile.load("nvidia-h100-80gb-hbm3")
    config = engine_config(
        tiny_model_dir, kv_cache_bytes=2 << 20, max_num_seqs=8, max_num_batched_tokens=128
    )
    requests = [WorkloadRequest(i, 0.01 * i, i % 3, 5 + i, 3 + i % 4, "default") for i in range(12)]
    run = serve(config, profile, requests, [8, 16, 8], vocab_size=1000)
    summary = run.summary
    assert summary["requests"] == {"total": 12, "ok": 12, "failed": 0}
    assert summary["output_tokens_per_s"] * summary["duration_s"] == pytest.approx(
        sum(r.output_len for r in requests)
    )
    assert run.traffic["loads"] == 3
    # The clock moved by exactly the executed steps' modelled time while they ran, and the
    # run took that plus the gaps in which nothing could run.
    steps = run.step_summary
    assert steps["steps"] > 0
    assert sum(run.step_seconds.values()) == pytest.approx(steps["seconds"], rel=1e-9)
    assert steps["seconds"] <= summary["duration_s"]
    # The base model alone is the ceiling: no adapter bytes, no fetch to wait for.
    base = serve(config, profile, requests, [8, 16, 8], vocab_size=1000, base_model=True)
    assert base.traffic["loads"] == 0
    assert base.summary["ttft_s"]["p50"] < summary["ttft_s"]["p50"]
    # What the adapters' bytes allow: below the base model's throughput, above nothing.
    assert base.adapter_floor_ratio == 1.0
    assert 0.5 < run.adapter_floor_ratio < 1.0


def test_reports_say_every_figure_is_simulated_and_on_which_profile():
    label = DeviceProfile.load("nvidia-h100-80gb-hbm3").describe()
    row = {
        "run": "slora-s2",
        "figure": "req/s",
        "unit": "req/s",
        "measured": 3.3,
        "simulated": 4.0,
        "error": 4.0 / 3.3 - 1,
    }
    text = calibration_markdown({"profile": "nvidia-h100-80gb-hbm3", "label": label, "rows": [row]})
    assert "simulated on profile nvidia-h100-80gb-hbm3" in text and "+21%" in text
    table = {
        "setting": "S2",
        "profile": "nvidia-h100-80gb-hbm3",
        "label": label,
        "rows": [
            {
                "offered_rate": 10,
                "adapters": None,
                "requests_per_s": 9.0,
                "output_tokens_per_s": 2400,
                "ttft_p50_s": 0.1,
                "ttft_p99_s": 0.4,
                "itl_p50_s": 0.02,
                "per_minute": dict.fromkeys(
                    (
                        "adapter_reloads",
                        "device_evictions",
                        "adapter_room_wait_steps",
                        "preemptions",
                    ),
                    0.0,
                ),
            }
        ],
    }
    text = slora_markdown(table)
    assert "**Simulated: simulated on profile nvidia-h100-80gb-hbm3" in text
    assert "| base model |" in text


def test_host_resident_adapters_are_fetched_by_no_request(tiny_model_dir):
    # S-LoRA's setting: every adapter in host RAM when the clock starts.
    profile = DeviceProfile.load("nvidia-h100-80gb-hbm3").scaled(store_bytes_per_s=0.01)
    config = engine_config(
        tiny_model_dir, kv_cache_bytes=2 << 20, max_num_seqs=8, max_num_batched_tokens=128
    )
    requests = [WorkloadRequest(i, 0.01 * i, i % 4, 6, 4, "default") for i in range(8)]
    cold = serve(config, profile, requests, [8, 16, 8, 16], vocab_size=1000)
    warm = serve(config, profile, requests, [8, 16, 8, 16], vocab_size=1000, host_resident=True)
    assert cold.traffic["loads"] == 4 and cold.traffic["host_misses"] == 4
    assert warm.traffic["loads"] == 0 and warm.traffic["host_misses"] == 0
    assert warm.summary["ttft_s"]["p50"] < cold.summary["ttft_s"]["p50"]


def test_the_churn_sweep_runs_each_working_set_capped_and_all_resident(tmp_path, tokenizer_dir):
    profile = DeviceProfile.load("nvidia-h100-80gb-hbm3")
    report = churn_sweep(
        "S2", profile, tmp_path, tokenizer_dir, capacity=4, factors=(0.5, 2.0), duration_s=1.0
    )
    small, large = report["rows"]
    assert (small["working_set"], large["working_set"]) == (2, 8)
    # Past the capacity the capped run churns; the all-resident one never does.
    assert large["capped"]["per_minute"]["device_evictions"] > 0
    assert all(r["all_resident"]["per_minute"]["device_evictions"] == 0 for r in report["rows"])
    assert small["capped"]["per_minute"]["device_evictions"] == 0
    assert report["verdict"]["ttft_p50_ratio"] == large["ttft_p50_ratio"]
    plot = churn_plot(report, tmp_path / "churn.png")
    assert plot is not None and plot.stat().st_size > 0
    text = churn_markdown(report, plot)
    assert f"**Simulated: {profile.describe()}.**" in text
    assert "| 2x | 8 |" in text and "churn.png" in text


def test_engine_settings_over_the_presets_are_checked_by_name_and_number():
    args = study("simulate").parse(
        ["slora", "--set", "max_num_seqs=256", "--set", "kv_cache_bytes=6e10"]
    )
    assert args.engine == [("max_num_seqs", 256), ("kv_cache_bytes", 60_000_000_000)]
    for bad in ("max_seqs=256", "max_num_seqs=many"):
        with pytest.raises(SystemExit):
            study("simulate").parse(["slora", "--set", bad])
