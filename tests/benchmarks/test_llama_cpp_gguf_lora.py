"""The GGUF LoRA writer of ``loramux bench llama-cpp``, read back with loramux's own GGUF
reader: llama.cpp's names, dimensions, type and alpha, and q/k's B in llama.cpp's row
order (undone by the engine's own un-permutation, written apart from the writer's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from loramux.benchmarks.common.adapters import ALL_SEVEN, adapter_config, lora_tensors
from loramux.benchmarks.common.adapters import write_adapter as write_peft_adapter
from loramux.benchmarks.llama_cpp.gguf_lora import LLAMA_CPP_NAMES, write_gguf_lora
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.gguf_file import read_gguf
from loramux.engine.model.gguf_weights import rope_unpermute_index

CONFIG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


def _values(tensor) -> np.ndarray:
    """A float32 tensor's values in numpy's order (the file lists ``ne0`` first)."""
    return np.frombuffer(tensor.data.tobytes(), dtype=np.float32).reshape(tensor.shape[::-1]).copy()


def test_a_peft_adapter_reads_back_as_llama_cpp_s_lora(tmp_path):
    rank = 4
    peft = lora_tensors(CONFIG, rank, ALL_SEVEN, seed=7)
    write_peft_adapter(tmp_path / "peft", peft, adapter_config(rank, ALL_SEVEN))
    written = write_gguf_lora(tmp_path / "peft", CONFIG, tmp_path / "lora.gguf")

    gguf = read_gguf(written)
    assert gguf.metadata["general.architecture"] == "llama"
    assert gguf.metadata["general.type"] == "adapter"
    assert gguf.metadata["adapter.type"] == "lora"
    assert gguf.metadata["adapter.lora.alpha"] == pytest.approx(2.0 * rank)
    assert not list(tmp_path.glob("*.partial-*"))

    tensors = {t.name: t for t in gguf.tensors}
    expected = [
        f"blk.{layer}.{LLAMA_CPP_NAMES[module]}.weight.lora_{part}"
        for layer in range(CONFIG.num_layers)
        for module in ALL_SEVEN
        for part in "ab"
    ]
    assert [t.name for t in gguf.tensors] == expected
    heads = {"q_proj": CONFIG.num_heads, "k_proj": CONFIG.num_kv_heads}
    for layer in range(CONFIG.num_layers):
        for module in ALL_SEVEN:
            in_features, out_features = CONFIG.module_shape(module)
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            name = f"blk.{layer}.{LLAMA_CPP_NAMES[module]}.weight"
            a, b = tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"]
            # llama.cpp's loader: A is [in, rank] and B [rank, out], ne0 first.
            assert a.shape == (in_features, rank) and b.shape == (rank, out_features)
            assert a.tensor_type == b.tensor_type == GGMLQuantizationType.F32
            assert np.array_equal(_values(a), peft[f"{prefix}.lora_A.weight"].numpy())
            b_rows = torch.from_numpy(_values(b))
            if module in heads:  # back in HF's order, by the engine's reader's index
                b_rows = b_rows[rope_unpermute_index(out_features, heads[module])]
                assert not torch.equal(torch.from_numpy(_values(b)), b_rows)
            assert torch.equal(b_rows, peft[f"{prefix}.lora_B.weight"])


def test_what_llama_cpp_cannot_take_is_refused(tmp_path):
    peft = lora_tensors(CONFIG, 4, ("q_proj",), seed=1)
    config = adapter_config(4, ("q_proj",)) | {"use_rslora": True}
    write_peft_adapter(tmp_path / "rslora", peft, config)
    with pytest.raises(ValueError, match="rsLoRA"):
        write_gguf_lora(tmp_path / "rslora", CONFIG, tmp_path / "x.gguf")
    embed = {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 64)}
    write_peft_adapter(tmp_path / "embed", embed, adapter_config(4, ("embed_tokens",)))
    with pytest.raises(ValueError, match="not a LoRA tensor"):
        write_gguf_lora(tmp_path / "embed", CONFIG, tmp_path / "y.gguf")
