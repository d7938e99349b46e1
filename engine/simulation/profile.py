"""A GPU as the simulator sees it: a handful of rates and per-launch costs, each with where
it came from (a recorded ``kernels_gpu`` run, a published spec, or an assumption still
waiting for a measurement).

Profiles are JSON files in ``profiles/``, one per GPU: ``{"name", "label", "calibration",
"constants": {field: {"value", "source"}}}``. ``calibration`` states the error of the
recorded runs replayed on it (or that none has been replayed yet); it is printed beside
every simulated figure.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

PROFILES_DIR = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class DeviceProfile:
    name: str  # the file's stem, e.g. "nvidia-h100-80gb-hbm3"
    label: str  # for people, e.g. "NVIDIA H100 80GB HBM3"
    calibration: str  # the replayed runs' error, in words
    memory_bytes: float  # the device's memory
    hbm_bytes_per_s: float  # device memory bandwidth (a copy's read + write)
    matmul_flops_per_s: float  # dense bf16 matmul rate
    linear_memory_efficiency: float  # of hbm, for the projections at decode sizes
    matmul_efficiency: float  # of matmul_flops_per_s, for large (prefill) projections
    attention_memory_efficiency: float  # of hbm, paged decode attention
    prefill_attention_efficiency: float  # of matmul_flops_per_s, paged prefill attention
    layer_overhead_s: float  # a layer's device time past its bytes and flops (small ops)
    layer_launch_eager_s: float  # the host's time to launch a layer's ops, eager
    lora_launch_eager_s: float  # the host's time to launch one LoRA shrink or expand, eager
    lora_launch_graph_s: float  # one LoRA shrink or expand's device time past its bytes
    host_step_s: float  # the engine's host work per step (schedule, batch, sampling sync)
    host_sequence_s: float  # and per sequence in the step
    h2d_bytes_per_s: float  # pinned host -> device copies (adapter loads)
    store_bytes_per_s: float  # one loader thread fetching and parsing an adapter
    store_latency_s: float  # a fetch's fixed cost
    sources: dict[str, str]  # field -> where its value came from

    @classmethod
    def load(cls, name_or_path: str | Path) -> DeviceProfile:
        """A profile by name (``profiles/<name>.json``) or by path."""
        path = Path(name_or_path)
        if not path.suffix:
            path = PROFILES_DIR / f"{name_or_path}.json"
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
            raise ValueError(f"no device profile {str(name_or_path)!r}; known: {known}")
        raw = json.loads(path.read_text())
        constants = raw["constants"]
        fields = {f.name for f in dataclasses.fields(cls)} - {
            "name",
            "label",
            "calibration",
            "sources",
        }
        missing, unknown = fields - set(constants), set(constants) - fields
        if missing or unknown:
            raise ValueError(
                f"profile {path}: missing {sorted(missing)}, unknown {sorted(unknown)}"
            )
        return cls(
            name=path.stem,
            label=raw["label"],
            calibration=raw["calibration"],
            sources={k: v["source"] for k, v in constants.items()},
            **{k: float(v["value"]) for k, v in constants.items()},
        )

    def scaled(self, **factors: float) -> DeviceProfile:
        """This profile with some rates multiplied (``hbm_bytes_per_s=2.0``): what-ifs and
        the simulator's own tests."""
        changed = {k: getattr(self, k) * f for k, f in factors.items()}
        return dataclasses.replace(self, **changed)

    def describe(self) -> str:
        """The label every simulated figure carries."""
        return f"simulated on profile {self.name} ({self.label}; calibration: {self.calibration})"
