"""Random PEFT LoRA adapters for the benchmarks: drawn from a seed, written without PEFT.

Every benchmark's adapters come from ``lora_tensors``: for each layer, each targeted module
in the model's order (q, k, v, o, gate, up, down), A then B, ``torch.randn`` from one
generator seeded for the adapter, scaled by the standard deviation (A's may be
1/sqrt(in_features)), then cast to the dtype on disk. That is the order in which PEFT's
``get_peft_model`` lists its LoRA parameters, so an adapter drawn here in float32 holds
the values of one built through PEFT and filled from the same generator. Tensors carry
PEFT's names and ``adapter_config.json`` says ``lora_alpha = 2r``.

``cached_adapter`` writes one into the cache once, under a name that holds everything
that decides its contents (model, rank, targets, dtype, standard deviation, seed), and
publishes the folder whole (a rename), so concurrent runs never see a partial one.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.benchmarks.common.files import publish_folder
from loramux.benchmarks.common.models import model_key

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_SEVEN = (*QKVO, *MLP)
ADAPTER_STD = 0.02  # A and B: a visible change of the outputs that keeps them sensible


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: Path
    rank: int
    targets: tuple[str, ...]

    @property
    def label(self) -> str:
        """``r8 q/k/v/o``: the rank and the modules."""
        return f"r{self.rank} {'/'.join(t.removesuffix('_proj') for t in self.targets)}"


def adapter_config(rank: int, targets: tuple[str, ...]) -> dict:
    """PEFT's ``adapter_config.json`` for a random adapter."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "use_rslora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }


def lora_tensors(
    model_config,
    rank: int,
    targets: tuple[str, ...],
    *,
    seed: int,
    b_std: float = ADAPTER_STD,
    a_std: float | None = ADAPTER_STD,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """PEFT-named A and B of every targeted module (``a_std`` None: 1/sqrt(in_features))."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_layers):
        for module in (m for m in ALL_SEVEN if m in targets):
            in_features, out_features = model_config.module_shape(module)
            part = "mlp" if module in MLP else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            a_scale = in_features**-0.5 if a_std is None else a_std
            a = torch.randn(rank, in_features, generator=generator) * a_scale
            b = torch.randn(out_features, rank, generator=generator) * b_std
            tensors[f"{prefix}.lora_A.weight"] = a.to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = b.to(dtype)
    return tensors


def write_adapter(dest: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """The two PEFT files into the folder ``dest``."""
    from safetensors.torch import save_file

    from loramux.engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE

    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / WEIGHTS_FILE), metadata={"format": "pt"})
    (dest / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def cached_adapter(
    cache_dir: Path,
    model_dir: Path,
    model_config,
    rank: int,
    targets: tuple[str, ...],
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """The folder of a random adapter for ``model_dir``, written on first use."""
    from loramux.engine.lora.adapter import WEIGHTS_FILE

    tag = "qkvo" if targets == QKVO else "all7" if targets == ALL_SEVEN else "+".join(targets)
    kind = str(dtype).removeprefix("torch.")
    name = f"r{rank}-{tag}-{kind}-std{ADAPTER_STD}-seed{seed}"
    path = cache_dir / "adapters" / model_key(model_dir) / name
    if (path / WEIGHTS_FILE).is_file():
        return path
    tensors = lora_tensors(model_config, rank, targets, seed=seed, dtype=dtype)
    staging = path.with_name(f"{name}.partial-{uuid.uuid4().hex[:8]}")
    write_adapter(staging, tensors, adapter_config(rank, targets))
    publish_folder(staging, path, (path / WEIGHTS_FILE).is_file)
    return path


def prepare_adapters(
    cache_dir: Path,
    model_dir: Path,
    shapes: tuple[tuple[int, tuple[str, ...]], ...],
    count: int,
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> list[AdapterSpec]:
    """``count`` adapters ``a0, a1, ...``: adapter i has ``shapes[i % len(shapes)]``
    (rank, targets) and seed ``seed + i``."""
    from loramux.engine.model.config import ModelConfig

    config = ModelConfig.from_pretrained(model_dir)
    specs = []
    for i in range(count):
        rank, targets = shapes[i % len(shapes)]
        path = cached_adapter(
            cache_dir, model_dir, config, rank, targets, seed=seed + i, dtype=dtype
        )
        specs.append(AdapterSpec(f"a{i}", path, rank, targets))
    return specs
