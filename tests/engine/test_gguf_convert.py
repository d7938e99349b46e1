"""The SmolLM2 GGUF → HF conversion: what it writes, its once-only behaviour, and that
the converted model still talks sense."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loramux.engine.model.config import ModelConfig
from loramux.engine.model.gguf_convert import (
    COMPLETE_MARKER,
    _write_atomically,
    convert_gguf_to_hf,
    is_converted,
)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_config_is_plain_smollm2(smollm2_dir):
    raw = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in raw
    assert raw["model_type"] == "llama"
    assert raw["hidden_size"] == 576
    assert raw["num_hidden_layers"] == 30
    assert raw["num_attention_heads"] == 9
    assert raw["num_key_value_heads"] == 3
    assert raw["vocab_size"] == 49152
    assert raw["tie_word_embeddings"] is True
    theta = (raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta"))
    assert theta == 100000.0

    config = ModelConfig.from_pretrained(smollm2_dir)
    assert (config.hidden_size, config.num_layers) == (576, 30)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings
    assert config.rope_theta == 100000.0
    assert config.rope_scaling is None
    assert not config.attention_bias
    assert config.eos_token_ids  # from config.json / generation_config.json


def test_weights_are_safetensors_only(smollm2_dir):
    assert (smollm2_dir / "model.safetensors").is_file()
    assert not list(smollm2_dir.glob("*.bin"))
    assert (smollm2_dir / "generation_config.json").is_file()


def test_tokenizer_has_chatml_template(smollm2_tokenizer):
    assert len(smollm2_tokenizer) == 49152
    assert smollm2_tokenizer.chat_template
    text = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>" in text
    assert text.rstrip().endswith("<|im_start|>assistant")


def test_complete_marker_exists(smollm2_dir):
    assert (smollm2_dir / COMPLETE_MARKER).is_file()
    assert is_converted(smollm2_dir)


def test_existing_conversion_is_reused_without_transformers(smollm2_dir, monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("convert_gguf_to_hf loaded a model for an existing conversion")

    for name in ("AutoModelForCausalLM", "AutoTokenizer", "AutoConfig"):
        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", refuse)
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}
    logged: list[str] = []

    result = convert_gguf_to_hf(Path("/nonexistent/model.gguf"), smollm2_dir, log=logged.append)

    assert result == smollm2_dir
    assert logged == []
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == before


def test_missing_gguf_file_raises(tmp_path):
    out_dir = tmp_path / "out"
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf"):
        convert_gguf_to_hf(tmp_path / "missing.gguf", out_dir, log=lambda _: None)
    assert not out_dir.exists()


def test_incomplete_directory_is_not_taken_as_converted(tmp_path):
    """A directory without the marker (an interrupted conversion) is converted again."""
    out_dir = tmp_path / "half"
    out_dir.mkdir()
    (out_dir / "config.json").write_text("{}")
    assert not is_converted(out_dir)
    with pytest.raises(FileNotFoundError):
        convert_gguf_to_hf(tmp_path / "missing.gguf", out_dir, log=lambda _: None)


def test_a_writer_finishing_second_keeps_the_first_ones_folder(tmp_path):
    """Two processes converting into one cache at once (servers, or test workers): the one
    finishing second drops its copy and leaves the folder the first may be reading; a
    stale, incomplete folder is still replaced."""
    out_dir = tmp_path / "model"

    def writer(text: str):
        return lambda folder: (folder / "weights").write_text(text)

    _write_atomically(out_dir, COMPLETE_MARKER, Path("m.gguf"), writer("first"))
    reading = (out_dir / "weights").open()
    _write_atomically(out_dir, COMPLETE_MARKER, Path("m.gguf"), writer("second"))
    assert (out_dir / "weights").read_text() == "first" == reading.read()
    reading.close()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # the second copy is gone

    (out_dir / COMPLETE_MARKER).unlink()  # as if a conversion died before marking it
    _write_atomically(out_dir, COMPLETE_MARKER, Path("m.gguf"), writer("again"))
    assert (out_dir / "weights").read_text() == "again" and is_converted(out_dir)


@torch.inference_mode()
def test_converted_model_answers_sensibly(smollm2_dir, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompt = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    inputs = smollm2_tokenizer(prompt, return_tensors="pt", add_special_tokens=False)

    output = model.generate(
        **inputs,
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=smollm2_tokenizer.eos_token_id,
    )

    answer = smollm2_tokenizer.decode(
        output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True
    )
    assert "Paris" in answer, answer
