"""The benchmarks' one random-adapter writer (``loramux.benchmarks.common.adapters``).

Its draws must equal those of an adapter built through PEFT from the same seed (the
recorded engine-vs-PEFT results were made with such adapters), and a cached adapter is
written once and then found again under its name.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from loramux.benchmarks.common.adapters import ALL_SEVEN, QKVO, cached_adapter, lora_tensors
from loramux.engine.lora.adapter import load_adapter
from loramux.engine.model.config import ModelConfig
from tests.fixtures.models import build_peft_adapter


def test_the_draws_are_those_of_an_adapter_built_through_peft(tmp_path, tiny_model_dir):
    config = ModelConfig.from_pretrained(tiny_model_dir)
    for rank, targets, seed in ((8, ALL_SEVEN, 1002), (16, ("q_proj", "v_proj"), 7005)):
        peft_dir = build_peft_adapter(
            tiny_model_dir,
            tmp_path / f"peft-{seed}",
            rank=rank,
            targets=targets,
            seed=seed,
            std=0.02,
        )
        built = load_file(str(peft_dir / "adapter_model.safetensors"))
        drawn = lora_tensors(config, rank, targets, seed=seed)
        assert set(drawn) == set(built)
        assert all(torch.equal(drawn[name], built[name]) for name in built)


def test_a_cached_adapter_is_written_once_and_parses(tmp_path, tiny_model_dir):
    config = ModelConfig.from_pretrained(tiny_model_dir)
    path = cached_adapter(tmp_path, tiny_model_dir, config, 8, QKVO, seed=3, dtype=torch.bfloat16)
    weights = load_adapter(path, config, name="a", dtype=torch.float32)
    assert set(weights.modules) == set(QKVO) and weights.modules["q_proj"].scale == 2.0
    assert {t.dtype for t in load_file(str(path / "adapter_model.safetensors")).values()} == {
        torch.bfloat16
    }
    written = (path / "adapter_model.safetensors").stat().st_mtime_ns
    again = cached_adapter(tmp_path, tiny_model_dir, config, 8, QKVO, seed=3, dtype=torch.bfloat16)
    assert again == path and (path / "adapter_model.safetensors").stat().st_mtime_ns == written
    other = cached_adapter(tmp_path, tiny_model_dir, config, 8, QKVO, seed=4, dtype=torch.bfloat16)
    assert other != path
