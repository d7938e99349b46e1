"""Build the decoder and fill its weights: an HF-format safetensors checkpoint (single or
sharded), or seeded random values (``load_format="random"``: benchmarks at real shapes when
only ``config.json`` is at hand; the cost of serving does not depend on the values).

Random weights are made where they live: the decoder is built on the meta device, given
storage on the target device in the target dtype, and each parameter is drawn there by
its own generator, seeded from the seed and the parameter's name. So no host copy or
float32 copy ever exists, and any module using HF's parameter names (transformers'
``LlamaForCausalLM``) filled by :func:`fill_random_` with the same seed holds exactly the
same values on the same device.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from loramux.engine.config import LOAD_FORMATS, QUANTIZATIONS, EngineConfig
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.fused_modules import split_checkpoint_tensor
from loramux.engine.model.llama import LlamaForCausalLM
from loramux.engine.model.quantized import (
    DEFAULT_INT4_GROUP_SIZE,
    QuantLinearOp,
    install_quantized,
    quantize_model_,
    quantize_tensor,
)
from loramux.engine.parallel.shard import ShardPlan, TensorParallelError
from loramux.kernels.quant_linear import QuantizedWeight

# Checkpoint names we accept but don't need (rotary caches saved by old exports).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Random weights: projections and embeddings ~ N(0, 0.02²) (the usual init scale of Llama
# checkpoints), norm weights 1, biases 0.
RANDOM_WEIGHT_STD = 0.02


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
    model_dir: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "safetensors",
    seed: int = 0,
    quantization: str = "none",
    group_size: int = DEFAULT_INT4_GROUP_SIZE,
    gguf_file: str | Path | None = None,
    quant_op: QuantLinearOp | None = None,
    shard: ShardPlan | None = None,
) -> LlamaForCausalLM:
    """The decoder of ``model_dir``: its checkpoint, or random weights drawn from ``seed``.

    ``gguf_file``: the weights are that file's tensors, served in their own packed forms
    (``model_dir`` then holds only the config and tokenizer). ``quantization`` (``int8``,
    ``int4``): a float checkpoint's projections are packed as they are read, one tensor at
    a time, so no float copy of the whole model is ever made. Both need ``quant_op``, the
    kernel backend's quantized matmul.

    ``shard``: only that rank's part of each tensor is kept (``engine/parallel/shard.py``),
    as it is read; the decoder is built from the rank's config. The caller joins it to the
    other ranks (``LlamaForCausalLM.join``).
    """
    _check_load(load_format, quantization, gguf_file, quant_op, shard)
    model_dir = Path(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    if load_format == "random":
        model = random_model(config, dtype=dtype, device=device, seed=seed, shard=shard)
        if quantization != "none":
            quantize_model_(model, quantization, group_size, op=quant_op)
        return model
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if shard is not None:
        with torch.device("meta"):
            model = LlamaForCausalLM(shard.local_config())
    if gguf_file is not None:
        state, packed_weights = _gguf_state(Path(gguf_file), config, expected, dtype, device)
    else:
        state, packed_weights = _safetensors_state(
            model_dir, config, expected, dtype, device, quantization, group_size, shard
        )
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        packed_weights.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state) - set(packed_weights))
    if missing:
        source = gguf_file or model_dir
        raise ValueError(f"checkpoint in {source} lacks tensors: {', '.join(missing[:5])}")
    if packed_weights:
        biases = {name: state.pop(name) for name in list(state) if name.endswith(".bias")}
        install_quantized(
            model,
            packed_weights,
            biases,
            dtype=dtype,
            op=quant_op,
            tie_word_embeddings=config.tie_word_embeddings,
        )
        state.update(biases)  # those of projections kept in floats
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings and isinstance(model.model.embed_tokens, nn.Embedding):
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    return model


def load_engine_model(
    config: EngineConfig,
    device: torch.device,
    *,
    shard: ShardPlan | None = None,
    quant_op: QuantLinearOp | None = None,
) -> LlamaForCausalLM:
    """``config``'s model on ``device`` (this rank's ``shard`` of it): its weights' format,
    dtype, seed, quantization and GGUF file as the config says (``load_model``)."""
    return load_model(
        config.model,
        dtype=config.torch_dtype,
        device=device,
        load_format=config.load_format,
        seed=config.seed,
        quantization=config.quantization,
        group_size=config.quantization_group_size,
        gguf_file=config.gguf_file,
        quant_op=quant_op,
        shard=shard,
    )


def _check_load(load_format, quantization, gguf_file, quant_op, shard) -> None:
    """ValueError (or TensorParallelError) naming a load ``load_model`` cannot do."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    packed = quantization != "none" or gguf_file is not None
    if packed and quant_op is None:
        raise ValueError("a quantized or GGUF model needs the backend's quant_op")
    if shard is not None and packed:
        raise TensorParallelError(
            "tensor parallelism serves float weights only for now: serve the model without "
            "quantization and without a GGUF file, or with tensor_parallel_size=1"
        )


def _safetensors_state(model_dir, config, expected, dtype, device, quantization, group_size, shard):
    """(float tensors, packed weights) of a safetensors checkpoint, packing (or keeping
    ``shard``'s part of each tensor) as they come."""
    state: dict[str, torch.Tensor] = {}
    packed: dict[str, QuantizedWeight] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for stored in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                if stored.endswith(_IGNORED_SUFFIXES):
                    continue
                # A fused projection (Phi-3's qkv_proj) becomes its parts, as it is read.
                tensor = handle.get_tensor(stored)
                for name, part in split_checkpoint_tensor(config, stored, tensor):
                    if name not in expected:
                        raise ValueError(f"unexpected tensor {stored!r} in {path.name}")
                    if tuple(part.shape) != expected[name]:
                        raise ValueError(
                            f"tensor {name!r} has shape {tuple(part.shape)}, "
                            f"the config implies {expected[name]}"
                        )
                    if shard is not None:
                        part = shard.shard_weight(name, part)
                    weight = quantize_tensor(name, part.contiguous(), quantization, group_size)
                    if weight is not None:
                        packed[name] = weight.to(device)
                    else:
                        state[name] = part.to(device=device, dtype=dtype)
    return state, packed


def _gguf_state(gguf_file: Path, config, expected, dtype, device):
    """(float tensors, packed weights) of a GGUF file, each in the form the file holds."""
    from loramux.engine.model.gguf_weights import read_gguf_weights

    state: dict[str, torch.Tensor] = {}
    packed: dict[str, QuantizedWeight] = {}
    for name, weight in read_gguf_weights(gguf_file, config).items():
        if name not in expected:
            raise ValueError(f"unexpected tensor {name!r} in {gguf_file.name}")
        if isinstance(weight, QuantizedWeight):
            packed[name] = weight.to(device)
        else:
            state[name] = weight.to(device=device, dtype=dtype)
    return state, packed


def random_model(
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int,
    shard: ShardPlan | None = None,
) -> LlamaForCausalLM:
    """The decoder of ``config`` with random weights made on ``device`` in ``dtype``
    (``shard``: that rank's part of the same values, one whole tensor drawn at a time)."""
    with torch.device("meta"):  # no storage yet: 13 GB at Llama-7B must not touch the host
        model = LlamaForCausalLM(config if shard is None else shard.local_config())
        whole = None if shard is None else dict(LlamaForCausalLM(config).named_parameters())
    model = model.to(dtype=dtype).to_empty(device=device)  # storage on the device, in dtype
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if whole is None:
        fill_random_(model, seed=seed)
        return model.eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            drawn = torch.empty(whole[name].shape, dtype=dtype, device=param.device)
            _fill_one(drawn, name, seed, RANDOM_WEIGHT_STD)
            param.copy_(shard.shard_weight(name, drawn))
    return model.eval()


def fill_random_(module: nn.Module, *, seed: int, std: float = RANDOM_WEIGHT_STD) -> None:
    """Overwrite every parameter of ``module`` in place, each by its name (see the module
    docstring): names ending in ``norm.weight`` get 1, biases 0, the rest N(0, std²)."""
    with torch.no_grad():
        for name, param in module.named_parameters():  # a tied weight comes once
            _fill_one(param, name, seed, std)


def _fill_one(param: torch.Tensor, name: str, seed: int, std: float) -> None:
    if name.endswith("norm.weight"):
        param.fill_(1.0)
    elif name.endswith(".bias"):
        param.zero_()
    else:
        param.normal_(0.0, std, generator=_generator(seed, name, param.device))


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    # One stream per parameter: its values depend on (seed, name) only, not on the order
    # or the set of parameters the module has.
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8]) >> 1)
