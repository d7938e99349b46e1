"""The step-time model follows its device profile, and replays the recorded H100 decode
steps within the issue's ±25 %."""

from __future__ import annotations

from pathlib import Path

import pytest

from loramux.engine.simulation.calibration import decode_step_table, llama_7b
from loramux.engine.simulation.profile import DeviceProfile
from loramux.engine.simulation.step_time import StepShape, StepTimeModel

RESULTS = Path(__file__).parents[3] / "benchmarks" / "results"
H100_KERNELS = RESULTS / "kernels_gpu_nvidia-h100-80gb-hbm3-quick.json"
QKVO = {"q_proj": 16, "k_proj": 16, "v_proj": 16, "o_proj": 16}


@pytest.fixture(scope="module")
def h100() -> DeviceProfile:
    return DeviceProfile.load("nvidia-h100-80gb-hbm3")


def no_fixed_costs(profile: DeviceProfile) -> DeviceProfile:
    """Only the bandwidth and flops terms left: what the roofline alone says."""
    zero = dict.fromkeys(
        (
            "layer_overhead_s",
            "layer_launch_eager_s",
            "lora_launch_eager_s",
            "lora_launch_graph_s",
            "host_step_s",
            "host_sequence_s",
        ),
        0.0,
    )
    return profile.scaled(**zero)


def decode(batch: int = 64, context: int = 1024, graph: bool = True, **kw) -> StepShape:
    return StepShape([context] * batch, [], head_rows=batch, graph=graph, **kw)


def seconds(profile, shape) -> float:
    return StepTimeModel(profile, llama_7b(), dtype_bytes=2).step(shape).seconds


def test_doubled_bandwidth_halves_a_memory_bound_step(h100):
    bare = no_fixed_costs(h100)
    shape = decode(adapters=[(1, QKVO)] * 64)
    assert seconds(bare.scaled(hbm_bytes_per_s=2.0), shape) == pytest.approx(
        seconds(bare, shape) / 2, rel=1e-9
    )
    # ...and doubled flops change it not at all: a decode step reads, it hardly computes.
    assert seconds(bare.scaled(matmul_flops_per_s=2.0), shape) == seconds(bare, shape)


def test_the_adapters_floor_is_their_bytes_at_full_bandwidth(h100):
    model = StepTimeModel(h100, llama_7b(), dtype_bytes=2)
    # 64 rank-16 q/k/v/o adapters: each module's A and B, 16 x (4096 + 4096), 2 bytes, 32 layers.
    step = model.step(decode(adapters=[(1, QKVO)] * 64))
    nbytes = 64 * 4 * 16 * (4096 + 4096) * 2 * 32
    assert step.lora_bytes_s == pytest.approx(nbytes / h100.hbm_bytes_per_s, rel=1e-12)
    # Below the modelled LoRA time (launches, efficiency), and none without adapters.
    assert 0 < step.lora_bytes_s < step.parts["lora"]
    assert model.step(decode()).lora_bytes_s == 0


def test_doubled_flops_halve_a_compute_bound_prefill(h100):
    bare = no_fixed_costs(h100)
    shape = StepShape([], [(2048, 2048), (2048, 2048)], head_rows=2)

    def layers(profile) -> float:  # the LM head over 2 rows reads more than it computes
        parts = StepTimeModel(profile, llama_7b(), dtype_bytes=2).step(shape).parts
        return parts["projections"] + parts["attention"]

    assert layers(bare.scaled(matmul_flops_per_s=2.0)) == pytest.approx(layers(bare) / 2, rel=1e-9)
    assert layers(bare.scaled(hbm_bytes_per_s=2.0)) == layers(bare)


def test_an_eager_step_takes_at_least_its_launches_a_graph_only_the_device(h100):
    graph = seconds(h100, decode(batch=8, context=64))
    eager = seconds(h100, decode(batch=8, context=64, graph=False))
    layers = llama_7b().num_layers
    assert eager > graph
    assert eager >= layers * h100.layer_launch_eager_s


def test_adapter_copies_and_host_work_add_their_time(h100):
    base = seconds(h100, decode())
    copied = seconds(h100, decode(h2d_bytes=4 * 10**9))
    assert copied - base == pytest.approx(4e9 / h100.h2d_bytes_per_s)
    more_adapters = seconds(h100, decode(adapters=[(1, QKVO)] * 64))
    one_adapter = seconds(h100, decode(adapters=[(64, QKVO)]))
    assert more_adapters > one_adapter > base  # 64 adapters' rows read, not one's


def test_the_recorded_h100_decode_steps_replay_within_25_percent(h100):
    replayed = decode_step_table(h100, H100_KERNELS)
    assert len(replayed) == 12  # 6 recorded rows, eager and CUDA graph
    worst = max(replayed, key=lambda r: abs(r.error))
    assert abs(worst.error) <= 0.25, worst


def test_every_profile_loads_with_a_source_for_each_constant():
    for name in ("nvidia-h100-80gb-hbm3", "nvidia-h200", "nvidia-a100-80gb"):
        profile = DeviceProfile.load(name)
        assert all(profile.sources[k] for k in profile.sources)
        assert "simulated on profile" in profile.describe()
    with pytest.raises(ValueError, match="known: nvidia-a100-80gb"):
        DeviceProfile.load("tpu-v9")
