"""PEFT-format adapters written directly (no PEFT model), for tests that need hundreds.

The files are what ``peft.save_pretrained`` writes for a LoRA on a Llama: one
``adapter_config.json`` and one ``adapter_model.safetensors`` whose tensors are named
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``. The
engine's loader reads them exactly as it reads PEFT's own (tests/engine/test_exactness.py
checks PEFT-made adapters against transformers + PEFT).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from loramux.engine.model.config import ModelConfig

_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}


def write_adapter(
    out_dir: Path,
    config: ModelConfig,
    *,
    rank: int,
    targets: tuple[str, ...],
    seed: int,
    std: float = 0.05,
) -> Path:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in targets:
            block = "self_attn" if module in _ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            in_features, out_features = config.module_shape(module)
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, in_features, generator=generator) * std
            )
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(out_features, rank, generator=generator) * std
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(targets),
        "bias": "none",
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config))
    return out_dir
