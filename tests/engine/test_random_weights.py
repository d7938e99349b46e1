"""Random weights (``load_format="random"``): a model from ``config.json`` alone.

The engine must serve from a folder holding only ``config.json`` and tokenizer files;
the weights depend only on the seed, each parameter on its own name, so transformers'
Llama filled with the same seed holds exactly the engine's values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from loramux.engine import Engine, EngineConfig, SamplingParams
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.loader import RANDOM_WEIGHT_STD, fill_random_, load_model, random_model
from tests.fixtures.models import TINY_CONFIG

HF_CONFIG = {
    **TINY_CONFIG,
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def config_only_dir(folder: Path, tokenizer_dir: Path, **overrides) -> Path:
    """``config.json`` and the tokenizer's files: no weights at all."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**HF_CONFIG, **overrides}))
    for path in tokenizer_dir.iterdir():
        if path.name.startswith("tokenizer") or path.name == "chat_template.jinja":
            shutil.copy(path, folder / path.name)
    return folder


def random_engine(model_dir: Path, seed: int) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model_dir),
            load_format="random",
            seed=seed,
            device="cpu",
            kv_cache_bytes=4 << 20,
            max_num_seqs=4,
        )
    )


def greedy(engine: Engine) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0, ignore_eos=True)
    outs = engine.generate([[5, 17, 300, 4000], [31999, 8, 9]], params)
    return [list(o.token_ids) for o in outs]


def test_engine_serves_a_folder_without_weights(tmp_path, tokenizer_dir):
    model_dir = config_only_dir(tmp_path / "model", tokenizer_dir)
    assert not list(model_dir.glob("*.safetensors")) and not list(model_dir.glob("*.bin"))
    first = greedy(random_engine(model_dir, seed=7))
    assert [len(tokens) for tokens in first] == [6, 6]
    assert all(0 <= t < HF_CONFIG["vocab_size"] for tokens in first for t in tokens)
    assert greedy(random_engine(model_dir, seed=7)) == first  # the seed decides
    assert greedy(random_engine(model_dir, seed=8)) != first
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        Engine(EngineConfig(model=str(model_dir), device="cpu", kv_cache_bytes=4 << 20))


def test_same_seed_same_weights_other_seed_other_weights():
    config = ModelConfig.from_hf_dict(HF_CONFIG)
    a = random_model(config, dtype=torch.float32, device="cpu", seed=3).state_dict()
    b = random_model(config, dtype=torch.float32, device="cpu", seed=3).state_dict()
    c = random_model(config, dtype=torch.float32, device="cpu", seed=4).state_dict()
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(a[name], c[name]), name
    # each parameter has its own stream: two same-shaped projections differ
    assert not torch.equal(
        a["model.layers.0.self_attn.k_proj.weight"], a["model.layers.0.self_attn.v_proj.weight"]
    )


def test_values_made_in_the_dtype_at_a_sensible_scale():
    config = ModelConfig.from_hf_dict({**HF_CONFIG, "model_type": "qwen2"})  # q/k/v biases
    model = random_model(config, dtype=torch.bfloat16, device="cpu", seed=0)
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    norms = [p for name, p in params.items() if name.endswith("norm.weight")]
    assert len(norms) == 2 * config.num_layers + 1 and all(bool((p == 1).all()) for p in norms)
    biases = [p for name, p in params.items() if name.endswith(".bias")]
    assert len(biases) == 3 * config.num_layers and all(not p.any() for p in biases)
    weights = torch.cat([p.float().flatten() for p in params.values() if p.ndim == 2])
    assert abs(weights.std().item() - RANDOM_WEIGHT_STD) < 0.02 * RANDOM_WEIGHT_STD
    assert abs(weights.mean().item()) < 0.05 * RANDOM_WEIGHT_STD


def test_tied_embeddings_stay_tied():
    config = ModelConfig.from_hf_dict({**HF_CONFIG, "tie_word_embeddings": True})
    model = random_model(config, dtype=torch.float32, device="cpu", seed=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.std().item() > 0.5 * RANDOM_WEIGHT_STD


def test_transformers_llama_filled_with_the_seed_holds_the_same_values():
    from transformers import LlamaConfig, LlamaForCausalLM

    ours = random_model(
        ModelConfig.from_hf_dict(HF_CONFIG), dtype=torch.float32, device="cpu", seed=5
    )
    theirs = LlamaForCausalLM(LlamaConfig(**HF_CONFIG))
    fill_random_(theirs, seed=5)
    expected, actual = ours.state_dict(), theirs.state_dict()
    assert set(expected) == set(actual)
    for name, tensor in expected.items():
        assert torch.equal(tensor, actual[name]), name


def test_unknown_load_format_is_refused(tmp_path, tokenizer_dir):
    model_dir = config_only_dir(tmp_path / "model", tokenizer_dir)
    with pytest.raises(ValueError, match="load_format"):
        load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"), load_format="npz")


@pytest.mark.gpu
def test_cuda_weights_are_made_on_the_device_in_bf16_and_match_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = ModelConfig.from_hf_dict(HF_CONFIG)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ours = random_model(config, dtype=torch.bfloat16, device="cuda", seed=5)
    params = list(ours.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    assert {(p.device.type, p.dtype) for p in params} == {("cuda", torch.bfloat16)}
    # nothing larger than the bf16 weights themselves was ever on the device (no fp32 copy)
    assert torch.cuda.max_memory_allocated() - before <= param_bytes + (1 << 20)

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            theirs = LlamaForCausalLM(LlamaConfig(**HF_CONFIG))
    finally:
        torch.set_default_dtype(previous)
    fill_random_(theirs, seed=5)
    actual = theirs.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, actual[name]), name
