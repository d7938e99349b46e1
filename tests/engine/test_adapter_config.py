"""adapter_config.json is parsed strictly; scales and scaled weights fit the serving dtype.

* Every hostile config (tests/engine/hostile_configs.py) is an ``AdapterError`` naming
  the field, never another exception (those once became HTTP 500s, or, for
  ``lora_alpha: 1e308``, an engine step failing every tenant's requests).
* A, B, the scale and scale·B must be finite in the dtype the adapter is loaded in:
  weights that overflow fp16 only once scaled are refused in fp16, served in fp32/bf16.
* Valid adapters keep PEFT's semantics exactly: the scales equal PEFT's own, patterns
  matched against the full module name as PEFT matches them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loramux.engine.lora.adapter import AdapterConfig, AdapterError, load_adapter
from loramux.engine.model.config import ModelConfig
from tests.engine.hostile_configs import HOSTILE_CONFIGS

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
V_B0 = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"
Q_A1 = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def model_config(tiny_model_dir) -> ModelConfig:
    return ModelConfig.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, make_adapter) -> Path:
    """Rank 4 on q_proj and v_proj, lora_alpha 8: every scale is 2."""
    return make_adapter(tiny_model_dir, rank=4, alpha=8, targets=("q_proj", "v_proj"), seed=21)


def _edit_config(adapter_dir: Path, **changes) -> None:
    path = adapter_dir / CONFIG
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _set_weight(adapter_dir: Path, name: str, value: float) -> None:
    tensors = load_file(adapter_dir / WEIGHTS)
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] = value
    save_file(tensors, adapter_dir / WEIGHTS, metadata={"format": "pt"})


# --- hostile configs -------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(HOSTILE_CONFIGS))
def test_hostile_config_is_refused_naming_the_field(adapter, adapter_copy, model_config, case):
    write, match = HOSTILE_CONFIGS[case]
    path = adapter_copy(adapter)
    config = json.loads((path / CONFIG).read_text())
    (path / CONFIG).write_bytes(write(config))
    with pytest.raises(AdapterError, match=match):
        load_adapter(path, model_config)


def test_pattern_keys_must_be_strings():
    """JSON keys are always strings, but the parse is also reachable with a plain dict."""
    with pytest.raises(AdapterError, match="rank_pattern keys must be non-empty strings"):
        AdapterConfig.parse({"r": 4, "rank_pattern": {1: 4}})


def test_unused_fields_may_hold_anything():
    """Only what loramux reads is checked: PEFT's other fields pass untouched."""
    config = AdapterConfig.parse({"r": 4, "lora_alpha": 8, "layers_pattern": None, "x": [1e400]})
    assert (config.r, config.lora_alpha, config.use_rslora) == (4, 8, False)


# --- scales and scaled weights in the serving dtype -----------------------------------------


def test_weights_overflowing_fp16_only_once_scaled(adapter, adapter_copy, model_config):
    path = adapter_copy(adapter)
    _set_weight(path, V_B0, 40_000.0)  # fits fp16 (65504); times the scale of 2 it does not
    with pytest.raises(
        AdapterError,
        match=r"layers\.0\.v_proj: lora_B times its scale \(lora_alpha/r = 2\) reaches 8e\+04, "
        r"beyond float16's largest value \(65504\)",
    ):
        load_adapter(path, model_config, dtype=torch.float16)
    for dtype in (torch.float32, torch.bfloat16):
        weights = load_adapter(path, model_config, dtype=dtype)
        assert weights.modules["v_proj"].b[0][0, 0] == 40_000.0


def test_scale_beyond_fp16(adapter, adapter_copy, model_config):
    path = adapter_copy(adapter)
    _edit_config(path, lora_alpha=400_000)  # within lora_alpha's range; scale 100000
    with pytest.raises(
        AdapterError, match=r"layers\.0\.q_proj: its scale \(lora_alpha/r = 100000\) is beyond"
    ):
        load_adapter(path, model_config, dtype=torch.float16)
    assert load_adapter(path, model_config).modules["q_proj"].scale == 100_000


def test_lora_a_beyond_fp16(adapter, adapter_copy, model_config):
    path = adapter_copy(adapter)
    _set_weight(path, Q_A1, 1e5)
    with pytest.raises(AdapterError, match=r"layers\.1\.q_proj\.lora_A has values beyond float16"):
        load_adapter(path, model_config, dtype=torch.float16)
    assert load_adapter(path, model_config, dtype=torch.float32).modules["q_proj"].rank == 4


# --- PEFT's semantics for valid adapters -----------------------------------------------------


def _peft_adapter(model_dir: Path, out_dir: Path, **lora_config) -> dict[str, float]:
    """Save a PEFT adapter made with ``lora_config``; its scale per module, as PEFT has it."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_config))
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    scales: dict[str, set[float]] = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            scales.setdefault(name.rsplit(".", 1)[-1], set()).add(module.scaling["default"])
    assert all(len(per_layer) == 1 for per_layer in scales.values())  # same in every layer
    return {module: per_layer.pop() for module, per_layer in scales.items()}


@pytest.mark.parametrize(
    "lora_config",
    [
        {"r": 4, "lora_alpha": 16},
        {"r": 8, "lora_alpha": 5, "use_rslora": True},
        {"r": 4, "lora_alpha": 8, "alpha_pattern": {"v_.*": 3}, "rank_pattern": {"o_proj": 2}},
        {"r": 4, "lora_alpha": 8, "use_rslora": True, "rank_pattern": {"self_attn.v_proj": 8}},
    ],
    ids=["plain", "rslora", "patterns", "rslora-patterns"],
)
def test_scales_and_ranks_are_peft_s(tiny_model_dir, model_config, tmp_path, lora_config):
    targets = ["q_proj", "v_proj", "o_proj"]
    expected = _peft_adapter(tiny_model_dir, tmp_path, target_modules=targets, **lora_config)
    weights = load_adapter(tmp_path, model_config)
    assert {m: w.scale for m, w in weights.modules.items()} == expected
    ranks = {m: w.rank for m, w in weights.modules.items()}
    for module, rank in lora_config.get("rank_pattern", {}).items():
        assert ranks[module.rsplit(".", 1)[-1]] == rank


def test_a_pattern_key_naming_one_layer_applies_to_that_layer_only(
    adapter, adapter_copy, model_config
):
    """PEFT matches keys against the full module name: this key is layer 0's alone, and
    an alpha that differs between layers of one module is refused, not misapplied."""
    path = adapter_copy(adapter)
    _edit_config(path, alpha_pattern={"model.layers.0.self_attn.q_proj": 5})
    with pytest.raises(AdapterError, match=r"layers\.1\.q_proj: ranks or alphas that differ"):
        load_adapter(path, model_config)
    _edit_config(path, alpha_pattern={"model.layers.\\d+.self_attn.q_proj": 5})
    scales = {m: w.scale for m, w in load_adapter(path, model_config).modules.items()}
    assert scales == {"q_proj": 5 / 4, "v_proj": 2.0}


def test_lora_alpha_defaults_to_peft_s_8(adapter, adapter_copy, model_config):
    path = adapter_copy(adapter)
    config = json.loads((path / CONFIG).read_text())
    del config["lora_alpha"]
    (path / CONFIG).write_text(json.dumps(config))
    assert load_adapter(path, model_config).modules["q_proj"].scale == 8 / 4
