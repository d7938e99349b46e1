"""Reading GGUF checkpoints natively: each block type against gguf-py's own de-quantizer,
the real SmolLM2 GGUF against its HF conversion, round trips through files written as
llama.cpp writes them (q/k rows permuted), and the errors a bad file gets."""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors import safe_open
from safetensors.torch import load_file

from loramux.engine.model.config import ModelConfig
from loramux.engine.model.gguf_weights import expected_shapes, from_gguf_bytes, read_gguf_weights
from loramux.kernels.quant_linear import QuantizedWeight, dequantize
from tests.fixtures.gguf_files import gguf_tensor_name, llama_cpp_permute, write_gguf

QUANTIZED = (T.Q8_0, T.Q5_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K)
INT8_TYPES = {T.Q8_0: 32, T.Q5_0: 32, T.Q6_K: 16}  # those read as int8, with their groups
# Quantization error bound for the tests' weights (N(0, 0.08²)): half a 4-bit step of a
# group's range is about 0.012; a row in the wrong place is off by about 0.1 or more.
NEAR = 0.03


def small_config(**overrides) -> ModelConfig:
    fields = dict(
        vocab_size=48,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    return ModelConfig(**{**fields, **overrides})


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator) * 0.08
        for name, shape in expected_shapes(config).items()
    }


def as_float(weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    return dequantize(weight) if isinstance(weight, QuantizedWeight) else weight


def gguf_py_values(path: Path, config: ModelConfig, *, permuted=True) -> dict[str, np.ndarray]:
    """Every tensor of ``path`` as gguf-py de-quantizes it, q/k rows put back in HF order
    by inverting the converter's permutation (not by the reader under test) when the
    architecture has one (``permuted``)."""
    reader = gguf.GGUFReader(path)
    by_gguf_name = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    values = {}
    for name in expected_shapes(config):
        value = by_gguf_name[gguf_tensor_name(name)]
        heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(name.split(".")[-2])
        if heads is not None and permuted:
            order = llama_cpp_permute(np.arange(value.shape[0]), heads)  # gguf[r] = hf[order[r]]
            unpermuted = np.empty_like(value)
            unpermuted[order] = value
            value = unpermuted
        values[name] = np.array(value)  # owned, writable: gguf-py may return file views
    return values


# --- each block type ----------------------------------------------------------------------


def random_raw(tensor_type: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw data of ``tensor_type`` for a ``[rows, cols]`` matrix: float types from
    normal values, quantized ones from random bytes whose fp16 fields (d, m, dmin) are
    made finite (subnormals and negative scales included)."""
    if tensor_type in (T.F32, T.F16, T.BF16):
        return gguf.quants.quantize(
            rng.standard_normal((rows, cols), dtype=np.float32), tensor_type
        )
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    raw = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    # where each block's fp16 fields lie: (first byte, count)
    first, count = {T.Q8_0: (0, 1), T.Q5_0: (0, 1), T.Q4_0: (0, 1), T.Q4_1: (0, 2)}.get(
        tensor_type, (208, 1) if tensor_type == T.Q6_K else (0, 2)
    )
    fields = slice(first, first + 2 * count)
    halves = np.ascontiguousarray(raw[..., fields]).view(np.uint16)
    all_ones_exponent = (halves & 0x7C00) == 0x7C00  # inf or NaN
    halves[all_ones_exponent] &= ~np.uint16(0x4000)
    raw[..., fields] = halves.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("tensor_type", [*QUANTIZED, T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_each_type_converts_to_gguf_py_values(tensor_type):
    rng = np.random.default_rng(int(tensor_type))
    rows, cols = 12, 512
    raw = random_raw(tensor_type, rows, cols, rng)
    converted = from_gguf_bytes(raw, tensor_type, (rows, cols))
    reference = torch.from_numpy(gguf.quants.dequantize(raw, tensor_type))
    if tensor_type in QUANTIZED:
        assert isinstance(converted, QuantizedWeight)
        assert converted.kind == ("int8" if tensor_type in INT8_TYPES else "int4")
        assert converted.group_size == INT8_TYPES.get(tensor_type, 32)
        assert converted.scales.dtype == torch.float32
    else:
        assert converted.dtype == torch.float32
    # Value equality: the same float32 operations on exact products. Only the sign of a
    # zero may differ (Q4_0: d q + (-8 d) is +0 where gguf-py's d (q - 8) is -0 for d < 0).
    assert torch.equal(as_float(converted), reference)


# --- the real SmolLM2 GGUF ------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_gguf_reads_natively_like_its_hf_conversion(smollm2_dir):
    from loramux.platform.base_model import embedded_gguf_path

    path = embedded_gguf_path()
    config = ModelConfig.from_pretrained(smollm2_dir)
    start = time.perf_counter()
    weights = read_gguf_weights(path, config)
    seconds = time.perf_counter() - start
    quantized_bytes = sum(w.nbytes for w in weights.values() if isinstance(w, QuantizedWeight))
    file_bytes = path.stat().st_size
    print(
        f"read {len(weights)} tensors of {path.name} in {seconds:.2f} s; quantized ones hold "
        f"{quantized_bytes / 2**20:.1f} MiB, the file is {file_bytes / 2**20:.1f} MiB"
    )
    # About 0.2 s here (engine/model/gguf_file.py skips the tokenizer's 49,152 strings
    # rather than building them; gguf-py's reader took 2-3 s). Timed only for the log.
    # Q4_1 takes 24 bytes per 32 values here against 20 in the file, Q8_0 36 against 34;
    # a float copy would be over 6 times the file.
    assert quantized_bytes < 1.25 * file_bytes
    assert isinstance(weights["model.embed_tokens.weight"], QuantizedWeight)
    assert weights["model.embed_tokens.weight"].kind == "int8"
    assert weights["model.layers.0.self_attn.q_proj.weight"].kind == "int4"
    assert "lm_head.weight" not in weights  # tied

    checkpoint = smollm2_dir / "model.safetensors"
    with safe_open(str(checkpoint), framework="pt") as handle:
        names = set(handle.keys()) - {"lm_head.weight"}
        assert set(weights) == names
        for name in sorted(names):
            assert torch.equal(as_float(weights[name]), handle.get_tensor(name)), name


# --- round trips through written files ---------------------------------------------------


def _tiny_model_types(name: str) -> T:
    """A mix over the tiny model: layer 0 keeps q/k in F32 (compared exactly), layer 1
    quantizes them, and every supported type appears."""
    if name == "model.embed_tokens.weight":
        return T.Q8_0
    if name == "lm_head.weight":
        return T.Q4_1
    if name == "model.layers.1.input_layernorm.weight":
        return T.F16
    if not name.startswith("model.layers."):
        return T.F32  # the final norm
    by_module = {
        0: {"v_proj": T.F16, "o_proj": T.BF16, "gate_proj": T.Q4_0, "up_proj": T.Q4_1},
        1: {"q_proj": T.Q4_0, "k_proj": T.Q4_1, "v_proj": T.Q8_0, "o_proj": T.Q4_0},
    }
    layer, module = int(name.split(".")[2]), name.split(".")[-2]
    if module == "down_proj":
        return T.Q8_0
    return by_module[layer].get(module, T.F32)


def test_tiny_model_round_trip_mixed_types(tmp_path, tiny_model_dir):
    config = ModelConfig.from_pretrained(tiny_model_dir)
    originals = load_file(str(tiny_model_dir / "model.safetensors"))
    path = write_gguf(tmp_path / "tiny.gguf", originals, config, _tiny_model_types)

    weights = read_gguf_weights(path, config)

    assert set(weights) == set(originals)
    reference = gguf_py_values(path, config)
    for name, weight in weights.items():
        quantized = _tiny_model_types(name) in QUANTIZED
        assert isinstance(weight, QuantizedWeight) == quantized, name
        assert torch.equal(as_float(weight), torch.from_numpy(reference[name])), name
        assert (as_float(weight) - originals[name]).abs().max() < NEAR, name
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    ):
        assert torch.equal(weights[name], originals[name])  # F32: HF's row order exactly


def test_q4_k_round_trip(tmp_path):
    # Q4_K's super-blocks need rows of a multiple of 256 inputs.
    config = small_config(hidden_size=256, intermediate_size=512, head_dim=64, num_layers=1)
    originals = random_weights(config, seed=3)

    def q4_k_matrices(name: str) -> T:
        return T.Q4_K if originals[name].dim() == 2 else T.F32

    path = write_gguf(tmp_path / "q4k.gguf", originals, config, q4_k_matrices)
    weights = read_gguf_weights(path, config)

    reference = gguf_py_values(path, config)
    for name, weight in weights.items():
        assert torch.equal(as_float(weight), torch.from_numpy(reference[name])), name
        assert (as_float(weight) - originals[name]).abs().max() < NEAR, name
    assert weights["model.layers.0.mlp.down_proj.weight"].kind == "int4"


def test_qwen2_rows_are_not_permuted_and_biases_load(tmp_path):
    # llama.cpp leaves Qwen2's q/k rows as HF has them (its RoPE there is NeoX-style).
    config = small_config(model_type="qwen2", attention_bias=True)
    originals = random_weights(config)
    assert "model.layers.0.self_attn.q_proj.bias" in originals
    path = write_gguf(tmp_path / "qwen2.gguf", originals, config)

    weights = read_gguf_weights(path, config)

    assert set(weights) == set(originals)
    for name, tensor in originals.items():
        assert torch.equal(weights[name], tensor), name


def test_qwen3_head_norms_load_and_rows_are_not_permuted(tmp_path):
    config = small_config(model_type="qwen3", qk_norm=True)
    originals = random_weights(config)
    assert originals["model.layers.1.self_attn.k_norm.weight"].shape == (16,)
    path = write_gguf(
        tmp_path / "qwen3.gguf",
        originals,
        config,
        {name: T.Q8_0 for name in originals if name.endswith("proj.weight")},
    )

    weights = read_gguf_weights(path, config)

    assert set(weights) == set(originals)
    reference = gguf_py_values(path, config, permuted=False)
    for name, tensor in originals.items():
        assert torch.equal(as_float(weights[name]), torch.from_numpy(reference[name])), name
        assert (as_float(weights[name]) - tensor).abs().max() < NEAR, name


def test_gemma3_names_its_norms_its_way_and_stores_them_plus_one(tmp_path):
    """llama.cpp's Gemma: ffn_norm is the norm before the MLP, post_attention_norm and
    post_ffw_norm the ones after; every norm stored as 1 + w (read back as (1 + w) - 1 in
    float32, as transformers reads it)."""
    config = small_config(
        model_type="gemma3_text", qk_norm=True, gemma_norms=True, tie_word_embeddings=True
    )
    originals = random_weights(config)
    assert "model.layers.0.pre_feedforward_layernorm.weight" in originals
    path = write_gguf(tmp_path / "gemma3.gguf", originals, config)

    weights = read_gguf_weights(path, config)

    assert set(weights) == set(originals)
    for name, tensor in originals.items():
        expected = (tensor + 1.0) - 1.0 if name.endswith("norm.weight") else tensor
        assert torch.equal(weights[name], expected), name
    norm = "model.layers.1.post_feedforward_layernorm.weight"
    assert (weights[norm] - originals[norm]).abs().max() < 1e-7


def test_llama_q_k_biases_are_unpermuted_too(tmp_path):
    config = small_config(attention_bias=True)
    originals = random_weights(config)
    path = write_gguf(tmp_path / "llama-bias.gguf", originals, config)

    weights = read_gguf_weights(path, config)

    for name, tensor in originals.items():
        assert torch.equal(weights[name], tensor), name


def test_tied_embeddings_have_no_lm_head_and_ignore_an_output_tensor(tmp_path):
    untied = small_config()
    originals = random_weights(untied)  # with an lm_head, written as output.weight
    path = write_gguf(tmp_path / "tied.gguf", originals, untied)

    weights = read_gguf_weights(path, small_config(tie_word_embeddings=True))

    assert "lm_head.weight" not in weights
    assert set(weights) == set(originals) - {"lm_head.weight"}


# --- errors ----------------------------------------------------------------------------------


def test_unsupported_type_names_tensor_type_and_supported_ones(tmp_path):
    config = small_config()
    types = {"model.layers.1.mlp.up_proj.weight": T.Q5_1}
    path = write_gguf(tmp_path / "q5_1.gguf", random_weights(config), config, types)

    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight.*Q5_1") as error:
        read_gguf_weights(path, config)
    assert "Q4_K" in str(error.value) and "Q8_0" in str(error.value)


def test_wrong_shape_is_named(tmp_path):
    config = small_config()
    tensors = random_weights(config)
    tensors["model.layers.0.mlp.gate_proj.weight"] = tensors["model.layers.0.mlp.gate_proj.weight"][
        :64
    ]
    path = write_gguf(tmp_path / "shape.gguf", tensors, config)

    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate\.weight.*\(64, 64\).*\(96, 64\)"):
        read_gguf_weights(path, config)


def test_missing_tensor_is_named(tmp_path):
    config = small_config()
    tensors = random_weights(config)
    del tensors["model.layers.1.post_attention_layernorm.weight"]
    path = write_gguf(tmp_path / "missing.gguf", tensors, config)

    with pytest.raises(ValueError, match=r"lacks .*model\.layers\.1\.post_attention_layernorm"):
        read_gguf_weights(path, config)


def test_tensor_of_a_layer_beyond_the_config_is_unexpected(tmp_path):
    config = small_config()
    tensors = random_weights(small_config(num_layers=3))
    path = write_gguf(tmp_path / "extra.gguf", tensors, config)  # block_count says 2

    with pytest.raises(ValueError, match=r"unexpected tensor 'blk\.2\."):
        read_gguf_weights(path, config)


def test_quantized_vector_is_refused(tmp_path):
    config = small_config()
    types = {"model.norm.weight": T.Q8_0}
    path = write_gguf(tmp_path / "qnorm.gguf", random_weights(config), config, types)

    with pytest.raises(ValueError, match=r"output_norm\.weight.*only matrices"):
        read_gguf_weights(path, config)


def test_head_layout_differing_from_the_config_is_refused(tmp_path):
    # Same shapes (8 heads of 8 is 4 of 16), different q/k permutation: must not load.
    config = small_config()
    path = write_gguf(tmp_path / "heads.gguf", random_weights(config), config)

    with pytest.raises(ValueError, match=r"head_count = 4, the config 8"):
        read_gguf_weights(path, small_config(num_heads=8, num_kv_heads=4, head_dim=8))


def test_other_architecture_is_refused(tmp_path):
    config = small_config()
    path = write_gguf(tmp_path / "gpt2.gguf", random_weights(config), config, architecture="gpt2")

    with pytest.raises(ValueError, match=r"'gpt2'.*llama, qwen2, qwen3, gemma3"):
        read_gguf_weights(path, config)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"this is not a GGUF file, only some text\n" * 4)

    with pytest.raises(ValueError, match=r"model\.gguf is not a readable GGUF file"):
        read_gguf_weights(path, small_config())


def test_truncated_gguf_file(tmp_path):
    config = small_config()
    whole = write_gguf(tmp_path / "whole.gguf", random_weights(config), config).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[:200])

    with pytest.raises(ValueError, match=r"cut\.gguf is not a readable GGUF file"):
        read_gguf_weights(path, config)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere\.gguf"):
        read_gguf_weights(tmp_path / "nowhere.gguf", small_config())
