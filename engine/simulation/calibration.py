"""Recorded GPU runs replayed on a device profile: the simulator's error against them.

``decode_step_table`` replays the full-decode-step table of a recorded ``kernels_gpu``
run (Llama-7B shapes, batch and context as recorded, LoRA on all seven modules): each row's
measured eager and CUDA-graph milliseconds against the step-time model's, forward only (the
benchmark times the model, not the engine's host work).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import LORA_TARGETS
from loramux.engine.simulation.profile import DeviceProfile
from loramux.engine.simulation.step_time import StepShape, StepTimeModel

HOST_PARTS = ("host", "adapter_copies", "device_copies")  # outside a kernels_gpu step


def llama_7b(num_kv_heads: int = 32) -> ModelConfig:
    """Llama-7B's geometry (``benchmarks/bench_gpu_model.LLAMA_7B``), with ``num_kv_heads``."""
    return ModelConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=32,
        num_heads=32,
        num_kv_heads=num_kv_heads,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )


@dataclass(frozen=True)
class Replayed:
    what: str  # the recorded row, in words
    measured_ms: float
    simulated_ms: float

    @property
    def error(self) -> float:
        """Simulated over measured, less one (+0.10: the simulation 10% slow)."""
        return self.simulated_ms / self.measured_ms - 1


def forward_ms(model: StepTimeModel, shape: StepShape) -> float:
    parts = model.step(shape).parts
    return 1e3 * sum(v for k, v in parts.items() if k not in HOST_PARTS)


def decode_step_table(profile: DeviceProfile, recorded: Path) -> list[Replayed]:
    """Every row of ``recorded``'s decode-step section, eager and graph, replayed."""
    rows = json.loads(Path(recorded).read_text())["sections"]["decode_step"]
    replayed = []
    for row in rows:
        model = StepTimeModel(profile, llama_7b(row["kv_heads"]), dtype_bytes=2)
        adapters = []
        if row["adapters"]:
            per_adapter = row["batch"] // row["adapters"]
            ranks = dict.fromkeys(LORA_TARGETS, row["rank"])
            adapters = [(per_adapter, ranks)] * row["adapters"]
        what = (
            f"{row['variant']} step, batch {row['batch']}, context {row['context']}, "
            f"{row['kv_heads']} KV heads, {row['adapters']} adapters of rank {row['rank']}"
        )
        for graph, key in ((False, "step_ms"), (True, "graph_ms")):
            shape = StepShape(
                decode_contexts=[row["context"]] * row["batch"],
                prefill_chunks=[],
                head_rows=row["batch"],
                adapters=adapters,
                graph=graph,
            )
            mode = "CUDA graph" if graph else "eager"
            replayed.append(Replayed(f"{what}, {mode}", row[key], forward_ms(model, shape)))
    return replayed
