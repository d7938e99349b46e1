"""Our Llama-family decoder and its loader, checked against transformers.

Each variant (untied and tied embeddings, Llama-3 and linear RoPE scaling, Qwen2 with
q/k/v bias) is built with transformers, saved as an HF directory, loaded with
``load_model`` and run over a paged KV cache; its last-token logits must match
transformers' own forward pass.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loramux.engine.lora.torch_backend import TorchBackend
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import LlamaForCausalLM
from loramux.engine.model.loader import load_model
from loramux.engine.model.rope import inverse_frequencies, rope_parameters
from tests.fixtures.models import TINY_CONFIG, build_tiny_model

CPU = torch.device("cpu")
BLOCK_SIZE = 16
PROMPT_LEN = 100  # past 64, the llama3 variant's original context, so scaling matters

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
# The original context of 64 is shorter than the prompt, and the attention factor
# (0.1 ln 4 + 1) scales cos and sin.
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN_MSCALE_ROPE = {**YARN_ROPE, "mscale": 0.8, "mscale_all_dim": 0.5, "beta_fast": 16}

LLAMA_VARIANTS = {
    "tied": {"tie_word_embeddings": True},
    "llama3-rope": {"rope_parameters": LLAMA3_ROPE},
    "linear-rope": {"rope_parameters": LINEAR_ROPE},
    "yarn-rope": {"rope_parameters": YARN_ROPE},
}


def build_tiny_with_bias(out_dir: Path, tokenizer_dir: Path, arch: str, *, seed: int = 0) -> Path:
    """A random-weight model with random (non-zero) attention biases and a real vocab.

    ``arch`` "qwen2": Qwen2 (q/k/v bias, no o_proj bias, no ``attention_bias`` key
    in its config); "llama": Llama with ``attention_bias=True`` (q/k/v/o bias).
    """
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.eos_token_id,
        **TINY_CONFIG,
    }
    if arch == "qwen2":
        config, model_cls = Qwen2Config(**common), Qwen2ForCausalLM
    else:
        config, model_cls = LlamaConfig(attention_bias=True, **common), LlamaForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2:
                param.normal_(0, 0.08)
            elif name.endswith("_proj.bias"):  # non-zero, so a dropped bias would show
                param.normal_(0, 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_model_dir, tokenizer_dir) -> dict[str, Path]:
    dirs = {"tiny": tiny_model_dir}
    for name, overrides in LLAMA_VARIANTS.items():
        dirs[name] = build_tiny_model(tmp_path_factory.mktemp(name), tokenizer_dir, **overrides)
    for arch, name in (("qwen2", "qwen2"), ("llama", "llama-attention-bias")):
        dirs[name] = build_tiny_with_bias(tmp_path_factory.mktemp(name), tokenizer_dir, arch)
    return dirs


def _prompt(vocab_size: int, length: int = PROMPT_LEN, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


def _kv_caches(model: LlamaForCausalLM, num_blocks: int):
    c = model.config
    shape = (num_blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(c.num_layers)]


@torch.inference_mode()
def our_last_logits(model: LlamaForCausalLM, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Run ``ids`` through our model in prefill chunks of the given sizes, one sequence.

    The sequence's block table is shuffled physical blocks, as the KV manager hands out.
    Returns the logits of the last token.
    """
    assert sum(chunks) == len(ids)
    num_blocks = math.ceil(len(ids) / BLOCK_SIZE)
    pool = 2 * num_blocks + 1
    gen = torch.Generator().manual_seed(99)
    table = torch.randperm(pool, generator=gen)[:num_blocks].tolist()
    caches = _kv_caches(model, pool)
    backend = TorchBackend(CPU)
    start = 0
    for n in chunks:
        end = start + n
        attention = backend.plan_attention([table], [end], [n], BLOCK_SIZE, CPU)
        expected_slots = [
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)
        ]
        assert attention.positions.tolist() == list(range(start, end))
        assert attention.new_token_slots.tolist() == expected_slots
        hidden = model(torch.tensor(ids[start:end]), attention, caches)
        start = end
    return model.compute_logits(hidden[-1:])[0]


@functools.cache
def _hf_last_logits(model_dir: str, ids: tuple[int, ...]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


def hf_last_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """transformers' own last-token logits (computed once per model and prompt)."""
    return _hf_last_logits(str(model_dir), tuple(ids))


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    # Within 1e-4 of the logits' scale (entries near zero can't be held to 1e-4 of themselves).
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    assert int(ours.argmax()) == int(ref.argmax())


@pytest.mark.parametrize(
    "variant",
    ["tiny", "tied", "llama3-rope", "linear-rope", "yarn-rope", "qwen2", "llama-attention-bias"],
)
def test_last_token_logits_match_transformers(model_dirs, variant):
    model_dir = model_dirs[variant]
    model = load_model(model_dir, dtype=torch.float32, device=CPU)
    ids = _prompt(model.config.vocab_size)

    ours = our_last_logits(model, ids, [len(ids)])

    assert_logits_close(ours, hf_last_logits(model_dir, ids))


@pytest.mark.parametrize("variant", ["tiny", "llama3-rope", "yarn-rope"])
def test_chunked_prefill_and_decode_match_one_pass(model_dirs, variant):
    """Prefill chunks and single-token decodes, each reading the earlier tokens' KV from the
    paged cache, end with the same logits as transformers' one pass."""
    model_dir = model_dirs[variant]
    model = load_model(model_dir, dtype=torch.float32, device=CPU)
    ids = _prompt(model.config.vocab_size)

    ours = our_last_logits(model, ids, [37, 1, 45, 16, 1])

    assert_logits_close(ours, hf_last_logits(model_dir, ids))


def test_variants_load_as_configured(model_dirs):
    tied = load_model(model_dirs["tied"], dtype=torch.float32, device=CPU)
    assert tied.config.tie_word_embeddings
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    untied = load_model(model_dirs["tiny"], dtype=torch.float32, device=CPU)
    assert not untied.config.tie_word_embeddings
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)
    qwen = load_model(model_dirs["qwen2"], dtype=torch.float32, device=CPU)
    assert qwen.config.model_type == "qwen2" and qwen.config.attention_bias
    attn = qwen.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    assert attn.q_proj.bias.abs().sum() > 0
    biased = load_model(model_dirs["llama-attention-bias"], dtype=torch.float32, device=CPU)
    attn = biased.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is not None
    assert attn.o_proj.bias.abs().sum() > 0
    llama3 = load_model(model_dirs["llama3-rope"], dtype=torch.float32, device=CPU)
    assert llama3.config.rope_scaling["rope_type"] == "llama3"


@pytest.mark.parametrize(
    "rope",
    [
        pytest.param(LLAMA3_ROPE, id="llama3"),
        pytest.param(LINEAR_ROPE, id="linear"),
        pytest.param(YARN_ROPE, id="yarn"),
        pytest.param(YARN_MSCALE_ROPE, id="yarn-mscale"),
        pytest.param({"rope_type": "default", "rope_theta": 100000.0}, id="default"),
    ],
)
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_inverse_frequencies_match_transformers(rope, head_dim):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(
        **{**TINY_CONFIG, "hidden_size": 4 * head_dim, "head_dim": head_dim},
        rope_parameters=dict(rope),
    )
    if rope["rope_type"] == "default":
        # transformers computes the unscaled frequencies inside the model class.
        base = float(rope["rope_theta"])
        expected = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    else:
        expected, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, CPU)

    ours, our_factor = rope_parameters(ModelConfig.from_hf_dict(hf_config.to_dict()))
    if rope["rope_type"] != "default":
        assert our_factor == pytest.approx(attention_factor, rel=1e-12)
        assert (our_factor != 1.0) == (rope["rope_type"] == "yarn")

    assert ours.shape == (head_dim // 2,)
    torch.testing.assert_close(ours.double(), expected.double(), rtol=1e-6, atol=0)


def test_llama3_scaling_touches_all_three_bands():
    """The llama3 test config keeps high frequencies, divides low ones, smooths the middle."""
    config = ModelConfig.from_hf_dict(
        {**TINY_CONFIG, "model_type": "llama", "vocab_size": 10, "rope_parameters": LLAMA3_ROPE}
    )
    unscaled = ModelConfig.from_hf_dict(
        {**TINY_CONFIG, "model_type": "llama", "vocab_size": 10, "rope_theta": 500000.0}
    )
    ratio = inverse_frequencies(unscaled) / inverse_frequencies(config)
    assert ratio[0] == 1.0
    assert torch.isclose(ratio[-1], torch.tensor(8.0))
    assert ((ratio > 1.0) & (ratio < 8.0)).any()


def test_sharded_checkpoint_loads_like_single_file(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    hf.save_pretrained(sharded, max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1

    single = load_model(tiny_model_dir, dtype=torch.float32, device=CPU)
    multi = load_model(sharded, dtype=torch.float32, device=CPU)

    single_state, multi_state = single.state_dict(), multi.state_dict()
    assert single_state.keys() == multi_state.keys()
    for name, tensor in single_state.items():
        assert torch.equal(tensor, multi_state[name]), name


def _copy_config(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def test_pickle_only_checkpoint_is_refused(tmp_path, tiny_model_dir):
    model_dir = _copy_config(tiny_model_dir, tmp_path / "bin-only")
    (model_dir / "pytorch_model.bin").write_bytes(b"not unpickled")

    with pytest.raises(ValueError, match="safetensors only"):
        load_model(model_dir, dtype=torch.float32, device=CPU)


def test_missing_weights_are_a_clear_error(tmp_path, tiny_model_dir):
    model_dir = _copy_config(tiny_model_dir, tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_model(model_dir, dtype=torch.float32, device=CPU)


def test_wrong_tensor_shape_names_the_tensor(tmp_path, tiny_model_dir):
    model_dir = _copy_config(tiny_model_dir, tmp_path / "bad-shape")
    state = load_file(str(tiny_model_dir / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    state[name] = torch.zeros(state[name].shape[0] + 1, state[name].shape[1])
    save_file(state, str(model_dir / "model.safetensors"))

    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_model(model_dir, dtype=torch.float32, device=CPU)


def test_missing_tensor_names_it(tmp_path, tiny_model_dir):
    model_dir = _copy_config(tiny_model_dir, tmp_path / "missing-tensor")
    state = load_file(str(tiny_model_dir / "model.safetensors"))
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, str(model_dir / "model.safetensors"))

    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        load_model(model_dir, dtype=torch.float32, device=CPU)


def test_unsupported_model_type_is_a_clear_error(tmp_path, tiny_model_dir):
    model_dir = _copy_config(tiny_model_dir, tmp_path / "gpt2")
    raw = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))

    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'"):
        ModelConfig.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'"):
        load_model(model_dir, dtype=torch.float32, device=CPU)


def test_missing_config_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        ModelConfig.from_pretrained(tmp_path)


def _write_model_config(model_dir: Path, **fields) -> Path:
    raw = {
        **TINY_CONFIG,
        "model_type": "llama",
        "vocab_size": 100,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **fields,
    }
    (model_dir / "config.json").write_text(json.dumps(raw))
    return model_dir


@pytest.mark.parametrize(
    ("config_eos", "generation_eos", "expected"),
    [
        pytest.param(2, [2, 7], (2, 7), id="list-in-generation-config"),
        pytest.param(3, [2, 7], (2, 3, 7), id="union-with-config"),
        pytest.param([2, 5], 9, (2, 5, 9), id="int-in-generation-config"),
        pytest.param(2, None, (2,), id="generation-config-without-eos"),
    ],
)
def test_from_pretrained_merges_generation_config_eos(
    tmp_path, config_eos, generation_eos, expected
):
    _write_model_config(tmp_path, eos_token_id=config_eos)
    generation = {"bos_token_id": 1}
    if generation_eos is not None:
        generation["eos_token_id"] = generation_eos
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))

    config = ModelConfig.from_pretrained(tmp_path)

    assert config.eos_token_ids == expected
    assert config.bos_token_id == 1


def test_from_pretrained_without_generation_config(tmp_path):
    _write_model_config(tmp_path, eos_token_id=2)
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (2,)


def test_config_reads_rope_in_old_and_new_layouts():
    # transformers 4 layout: top-level rope_theta, rope_scaling keyed by "type".
    old_scaling = {k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_type", "rope_theta")}
    old = ModelConfig.from_hf_dict(
        {
            **TINY_CONFIG,
            "vocab_size": 10,
            "rope_theta": 500000.0,
            "rope_scaling": {**old_scaling, "type": "llama3"},
        }
    )
    new = ModelConfig.from_hf_dict(
        {**TINY_CONFIG, "vocab_size": 10, "rope_parameters": LLAMA3_ROPE}
    )
    assert old.rope_theta == new.rope_theta == 500000.0
    assert old.rope_scaling["rope_type"] == new.rope_scaling["rope_type"] == "llama3"
    torch.testing.assert_close(inverse_frequencies(old), inverse_frequencies(new))
    default = ModelConfig.from_hf_dict(
        {**TINY_CONFIG, "vocab_size": 10, "rope_parameters": {"rope_type": "default"}}
    )
    assert default.rope_scaling is None and default.rope_theta == 10000.0
