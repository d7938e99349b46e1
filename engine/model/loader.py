"""Build the decoder and load an HF-format safetensors checkpoint (single or sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import LlamaForCausalLM

# Checkpoint names we accept but don't need (rotary caches saved by old exports).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    if any(model_dir.glob("*.bin")):
        raise ValueError(
            f"{model_dir} holds only pickle (.bin) weights; loramux loads safetensors only "
            "(never unpickles). Convert the checkpoint to safetensors first."
        )
    raise FileNotFoundError(f"no model.safetensors (or index) in {model_dir}")


def load_model(
    model_dir: str | Path, *, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name not in expected:
                    raise ValueError(f"unexpected tensor {name!r} in {path.name}")
                tensor = handle.get_tensor(name)
                if tuple(tensor.shape) != tuple(expected[name].shape):
                    raise ValueError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"the config implies {tuple(expected[name].shape)}"
                    )
                state[name] = tensor.to(device=device, dtype=dtype)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks tensors: {', '.join(missing[:5])}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    return model
