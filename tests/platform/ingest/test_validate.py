"""Validating an adapter folder: honest adapters pass, every kind of bad one is named."""

from __future__ import annotations

import json
import pickle
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loramux.platform.ingest import AdapterInfo, UploadRejected, validate_adapter_dir
from tests.engine.hostile_configs import HOSTILE_CONFIGS
from tests.platform.ingest.builders import malicious_pickle
from tests.platform.ingest.conftest import GOOD_RANK, GOOD_TARGETS

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
MAX_BYTES = 10 << 20


def validate(adapter_dir: Path, model_config, **overrides) -> AdapterInfo:
    limits = {"base_model_id": None, "max_rank": 64, "max_bytes": MAX_BYTES, **overrides}
    return validate_adapter_dir(adapter_dir, model_config, **limits)


def rewrite_config(adapter_dir: Path, **changes) -> None:
    path = adapter_dir / CONFIG
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def rewrite_tensors(adapter_dir: Path, change) -> None:
    path = adapter_dir / WEIGHTS
    tensors = change(load_file(path))
    save_file(tensors, path, metadata={"format": "pt"})


# --- honest adapters -------------------------------------------------------------------------


def test_good_adapter(good_adapter, model_config):
    info = validate(good_adapter, model_config)
    weights, config = good_adapter / WEIGHTS, good_adapter / CONFIG
    assert info == AdapterInfo(
        rank=GOOD_RANK,
        target_modules=sorted(GOOD_TARGETS),
        size_bytes=weights.stat().st_size + config.stat().st_size,
        dtype="float32",
    )


def test_half_precision_adapter(good_adapter, adapter_copy, model_config):
    adapter = adapter_copy(good_adapter)
    rewrite_tensors(adapter, lambda ts: {k: v.to(torch.bfloat16) for k, v in ts.items()})
    assert validate(adapter, model_config).dtype == "bfloat16"


@pytest.mark.parametrize(
    ("trained_on", "served"),
    [
        ("/home/me/models/SmolLM2-135M-Instruct/", "HuggingFaceTB/SmolLM2-135M-Instruct"),
        ("HuggingFaceTB/smollm2-135m-instruct", "/srv/models/SmolLM2-135M-Instruct"),
        (None, "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ],
)
def test_base_model_matches_on_last_component(
    good_adapter, adapter_copy, model_config, trained_on, served
):
    adapter = adapter_copy(good_adapter)
    rewrite_config(adapter, base_model_name_or_path=trained_on)
    assert validate(adapter, model_config, base_model_id=served).rank == GOOD_RANK


# --- hostile or broken adapters --------------------------------------------------------------


def test_missing_weights(good_adapter, adapter_copy, model_config):
    adapter = adapter_copy(good_adapter)
    (adapter / WEIGHTS).unlink()
    with pytest.raises(UploadRejected, match=r"adapter_model\.safetensors is missing"):
        validate(adapter, model_config)


def test_missing_config(good_adapter, adapter_copy, model_config):
    adapter = adapter_copy(good_adapter)
    (adapter / CONFIG).unlink()
    with pytest.raises(UploadRejected, match=r"adapter_config\.json is missing"):
        validate(adapter, model_config)


def test_pickle_in_folder_is_refused_unopened(good_adapter, adapter_copy, model_config, tmp_path):
    adapter = adapter_copy(good_adapter)
    marker = tmp_path / "pwned"
    (adapter / WEIGHTS).unlink()
    (adapter / "adapter_model.bin").write_bytes(malicious_pickle(marker))
    with pytest.raises(UploadRejected, match=r"adapter_model\.bin is a pickle file"):
        validate(adapter, model_config)
    assert not marker.exists()
    pickle.loads((adapter / "adapter_model.bin").read_bytes())  # the payload is real
    assert marker.exists()


def test_header_claiming_a_terabyte(good_adapter, adapter_copy, model_config):
    adapter = adapter_copy(good_adapter)
    (adapter / WEIGHTS).write_bytes(struct.pack("<Q", 1 << 40) + b'{"a": 1}')
    with pytest.raises(UploadRejected, match="header claims 1099511627776 bytes"):
        validate(adapter, model_config)


def test_header_longer_than_the_file(good_adapter, adapter_copy, model_config):
    adapter = adapter_copy(good_adapter)
    (adapter / WEIGHTS).write_bytes(struct.pack("<Q", 4096) + b"{}")
    with pytest.raises(UploadRejected, match="the file holds only 2"):
        validate(adapter, model_config)


def test_header_not_json(good_adapter, adapter_copy, model_config):
    adapter = adapter_copy(good_adapter)
    header = b"this is not json"
    (adapter / WEIGHTS).write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(UploadRejected, match="header is not valid JSON"):
        validate(adapter, model_config)


def test_header_offsets_past_the_data(good_adapter, adapter_copy, model_config):
    adapter = adapter_copy(good_adapter)
    header = json.dumps({Q_A: {"dtype": "F32", "shape": [8, 64], "data_offsets": [0, 2048]}})
    (adapter / WEIGHTS).write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(16))
    with pytest.raises(UploadRejected, match="cover 2048 bytes of data, the file holds 16"):
        validate(adapter, model_config)


def test_int32_tensor(good_adapter, adapter_copy, model_config):
    adapter = adapter_copy(good_adapter)
    rewrite_tensors(adapter, lambda ts: {**ts, Q_A: ts[Q_A].to(torch.int32)})
    with pytest.raises(UploadRejected, match=f"'{re.escape(Q_A)}' has dtype I32"):
        validate(adapter, model_config)


def test_wrong_shape_for_the_base(narrow_base_adapter, model_config):
    with pytest.raises(UploadRejected, match=r"has shape \[4, 32\]; the base model's q_proj"):
        validate(narrow_base_adapter, model_config)


def test_unknown_module_tensor(good_adapter, adapter_copy, model_config):
    adapter = adapter_copy(good_adapter)
    rewrite_tensors(
        adapter, lambda ts: {k.replace("q_proj", "rotary_proj"): v for k, v in ts.items()}
    )
    with pytest.raises(UploadRejected, match="targets unknown module 'rotary_proj'"):
        validate(adapter, model_config)


def test_unknown_module_in_config(good_adapter, adapter_copy, model_config):
    adapter = adapter_copy(good_adapter)
    rewrite_config(adapter, target_modules=["q_proj", "lm_head"])
    with pytest.raises(UploadRejected, match="target module 'lm_head' is not known"):
        validate(adapter, model_config)


def test_tensor_that_is_not_lora(good_adapter, adapter_copy, model_config):
    adapter = adapter_copy(good_adapter)
    rewrite_tensors(adapter, lambda ts: {**ts, "model.norm.weight": torch.zeros(64)})
    with pytest.raises(UploadRejected, match=r"'model\.norm\.weight' is not a LoRA"):
        validate(adapter, model_config)


def test_an_embedding_table_the_config_does_not_name(good_adapter, adapter_copy, model_config):
    adapter = adapter_copy(good_adapter)
    rewrite_tensors(adapter, lambda ts: {**ts, "model.embed_tokens.weight": torch.zeros(4, 64)})
    with pytest.raises(
        UploadRejected, match=r"whole embed_tokens table, but adapter_config\.json does not list"
    ):
        validate(adapter, model_config)


def test_layer_beyond_the_base(good_adapter, adapter_copy, model_config):
    adapter = adapter_copy(good_adapter)
    rewrite_tensors(
        adapter, lambda ts: {k.replace("layers.1.", "layers.7."): v for k, v in ts.items()}
    )
    with pytest.raises(UploadRejected, match="names layer 7; the base model has 2 layers"):
        validate(adapter, model_config)


def test_rank_over_max_in_config(good_adapter, model_config):
    with pytest.raises(UploadRejected, match=r"rank 8 \(r\) is above the maximum rank of 4"):
        validate(good_adapter, model_config, max_rank=4)


def test_rank_over_max_in_tensors(good_adapter, adapter_copy, model_config):
    adapter = adapter_copy(good_adapter)
    rewrite_config(adapter, r=None)
    with pytest.raises(UploadRejected, match="has rank 8, above the maximum rank of 4"):
        validate(adapter, model_config, max_rank=4)


def test_size_over_max(good_adapter, model_config):
    with pytest.raises(UploadRejected, match="above the size limit of 1000"):
        validate(good_adapter, model_config, max_bytes=1000)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values(good_adapter, adapter_copy, model_config, bad):
    adapter = adapter_copy(good_adapter)

    def poison(tensors):
        tensors[Q_A][0, 0] = bad
        return tensors

    rewrite_tensors(adapter, poison)
    with pytest.raises(UploadRejected, match=r"layers\.0\.q_proj holds NaN or infinite values"):
        validate(adapter, model_config)


def test_base_model_mismatch(good_adapter, adapter_copy, model_config):
    adapter = adapter_copy(good_adapter)
    rewrite_config(adapter, base_model_name_or_path="meta-llama/Llama-2-7b-hf")
    with pytest.raises(UploadRejected, match="trained for base model 'meta-llama/Llama-2-7b-hf'"):
        validate(adapter, model_config, base_model_id="HuggingFaceTB/SmolLM2-135M-Instruct")


def test_missing_lora_b(good_adapter, adapter_copy, model_config):
    adapter = adapter_copy(good_adapter)
    rewrite_tensors(
        adapter, lambda ts: {k: v for k, v in ts.items() if k != Q_A.replace("lora_A", "lora_B")}
    )
    with pytest.raises(UploadRejected, match=r"layers\.0\.q_proj has no lora_B"):
        validate(adapter, model_config)


def test_engine_check_is_reused(good_adapter, adapter_copy, model_config):
    """What only the engine's loader checks (rank vs rank_pattern) still refuses."""
    adapter = adapter_copy(good_adapter)
    rewrite_config(adapter, rank_pattern={"q_proj": 4})
    with pytest.raises(UploadRejected, match="adapter_config says r=4"):
        validate(adapter, model_config)


def test_unsupported_peft_type(good_adapter, adapter_copy, model_config):
    adapter = adapter_copy(good_adapter)
    rewrite_config(adapter, peft_type="IA3")
    with pytest.raises(UploadRejected, match="peft_type 'IA3' is not supported"):
        validate(adapter, model_config)


@pytest.mark.parametrize("case", list(HOSTILE_CONFIGS))
def test_hostile_config_is_rejected_naming_the_field(
    good_adapter, adapter_copy, model_config, case
):
    """Each once passed as ready or escaped as another exception (an HTTP 500)."""
    write, match = HOSTILE_CONFIGS[case]
    adapter = adapter_copy(good_adapter)
    (adapter / CONFIG).write_bytes(write(json.loads((adapter / CONFIG).read_text())))
    with pytest.raises(UploadRejected, match=match):
        validate(adapter, model_config)


def test_weights_header_with_a_5000_digit_number(good_adapter, adapter_copy, model_config):
    adapter = adapter_copy(good_adapter)
    header = b'{"x": {"dtype": "F32", "shape": [' + b"7" * 5000 + b'], "data_offsets": [0, 0]}}'
    (adapter / WEIGHTS).write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(UploadRejected, match="header is not valid JSON"):
        validate(adapter, model_config)


def test_weights_that_overflow_fp16_once_scaled(good_adapter, adapter_copy, model_config):
    """The platform cannot know an engine's dtype, so fp16's range decides, even for an
    fp32 adapter an fp32 engine would serve (tests/engine/test_adapter_config.py)."""
    adapter = adapter_copy(good_adapter)
    rewrite_config(adapter, lora_alpha=2 * GOOD_RANK)  # scale 2
    v_b = Q_A.replace("q_proj.lora_A", "v_proj.lora_B")

    def enlarge(tensors):
        tensors[v_b][0, 0] = 40_000.0  # fits fp16 (65504), twice that does not
        return tensors

    rewrite_tensors(adapter, enlarge)
    with pytest.raises(
        UploadRejected, match=r"layers\.0\.v_proj: lora_B times its scale .* beyond float16's"
    ):
        validate(adapter, model_config)
