"""The decoder's quantized modules: projections and embeddings whose weights stay packed.

``QUANTIZATIONS`` (``engine/config.py``) names what a float checkpoint can be quantized to
when the engine loads it (round to nearest, ``loramux.kernels.quant_linear``):

* ``int8``: every projection of the layers int8 per output channel;
* ``int4``: every projection int4 in groups of ``group_size`` inputs (asymmetric).

In both, the embedding (and an untied LM head) become int8 per row: the LM head decides
every token, and GGUF's 4-bit files keep it at 8 bits for that reason. A GGUF's quantized
tensors arrive already packed (``gguf_weights``) and take the same modules.

LoRA is untouched: it stays in the activations' dtype and the adapters' deltas are added to
the quantized projection's output (``llama._project``), as QLoRA adapters are trained.
The op computing ``x @ W^T`` is the kernel backend's (``KernelBackend.quant_linear``),
chosen once where the engine is built.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator

import torch
from torch import nn

from loramux.kernels.quant_linear import (
    QuantizedWeight,
    dequantize,
    quantize_int4,
    quantize_int8,
)

DEFAULT_INT4_GROUP_SIZE = 32

# (x [T, K], weight, bias [N] or None) -> y [T, N] in x's dtype
QuantLinearOp = Callable[[torch.Tensor, QuantizedWeight, torch.Tensor | None], torch.Tensor]

# The layers' projections: what ``int8`` / ``int4`` quantize.
PROJECTION_WEIGHT = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$"
)
EMBEDDING_WEIGHTS = ("model.embed_tokens.weight", "lm_head.weight")


class QuantizedLinear(nn.Module):
    """``y = x @ W^T + bias`` with ``W`` packed; in place of an ``nn.Linear``."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, op: QuantLinearOp):
        super().__init__()
        self.qweight = weight
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.op = op

    @property
    def in_features(self) -> int:
        return self.qweight.in_features

    @property
    def out_features(self) -> int:
        return self.qweight.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.qweight, self.bias)

    def extra_repr(self) -> str:
        w = self.qweight
        return f"{w.in_features} -> {w.out_features}, {w.kind}, group {w.group_size}"


class QuantizedEmbedding(nn.Module):
    """Rows of a packed ``[vocab, hidden]`` matrix, de-quantized as they are looked up."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        super().__init__()
        self.qweight = weight
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.qweight.rows(input_ids)).to(self.dtype)

    def extra_repr(self) -> str:
        w = self.qweight
        return f"{w.out_features} x {w.in_features}, {w.kind}, group {w.group_size}"


def quantize_tensor(
    name: str, tensor: torch.Tensor, quantization: str, group_size: int
) -> QuantizedWeight | None:
    """``tensor`` (the checkpoint's ``name``) packed as ``quantization`` says, or None when
    that quantization keeps it in floats (norms, biases, and everything under ``none``)."""
    if quantization == "none":
        return None
    if PROJECTION_WEIGHT.match(name):
        if quantization == "int8":
            return quantize_int8(tensor)
        return quantize_int4(tensor, group_size)
    if name in EMBEDDING_WEIGHTS:
        return quantize_int8(tensor)
    return None


def install_quantized(
    model: nn.Module,
    weights: dict[str, QuantizedWeight],
    biases: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    op: QuantLinearOp,
    tie_word_embeddings: bool,
) -> None:
    """Replace each module whose ``<module>.weight`` is in ``weights`` by its quantized form
    (its bias taken out of ``biases``); a tied LM head shares the embedding's."""
    for name, weight in weights.items():
        module_name = name.removesuffix(".weight")
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        current = getattr(parent, attr)
        if isinstance(current, nn.Embedding):
            replacement: nn.Module = QuantizedEmbedding(weight, dtype)
        elif isinstance(current, nn.Linear):
            bias = biases.pop(f"{module_name}.bias", None)
            replacement = QuantizedLinear(weight, bias, op)
        else:
            raise ValueError(f"{name} belongs to a {type(current).__name__}, not a linear layer")
        setattr(parent, attr, replacement)
    if tie_word_embeddings and "model.embed_tokens.weight" in weights:
        model.lm_head = QuantizedLinear(weights["model.embed_tokens.weight"], None, op)


def quantize_model_(
    model: nn.Module, quantization: str, group_size: int, *, op: QuantLinearOp
) -> None:
    """Quantize a float decoder in place (random weights for benchmarks at real shapes). A
    tied LM head is the embedding's parameter, which ``named_parameters`` yields once, under
    the embedding's name."""
    weights, biases = {}, {}
    for name, param in model.named_parameters():
        packed = quantize_tensor(name, param.data, quantization, group_size)
        if packed is None:
            continue
        weights[name] = packed
        module = model.get_submodule(name.removesuffix(".weight"))
        if isinstance(module, nn.Linear) and module.bias is not None:
            biases[f"{name.removesuffix('.weight')}.bias"] = module.bias.data
    tied = model.config.tie_word_embeddings
    dtype = next(model.parameters()).dtype
    install_quantized(model, weights, biases, dtype=dtype, op=op, tie_word_embeddings=tied)


def quantized_modules(model: nn.Module) -> list[QuantizedLinear | QuantizedEmbedding]:
    return [m for m in model.modules() if isinstance(m, QuantizedLinear | QuantizedEmbedding)]


def _packed_weights(model: nn.Module) -> Iterator[QuantizedWeight]:
    """Each packed weight once (a tied LM head shares the embedding's)."""
    seen: set[int] = set()
    for module in quantized_modules(model):
        if id(module.qweight) not in seen:
            seen.add(id(module.qweight))
            yield module.qweight


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights: float parameters plus packed ones."""
    packed = sum(w.nbytes for w in _packed_weights(model))
    return packed + sum(p.numel() * p.element_size() for p in model.parameters())


def parameter_count(model: nn.Module) -> int:
    """The model's parameters, packed ones counted as the floats they stand for."""
    packed = sum(w.out_features * w.in_features for w in _packed_weights(model))
    return packed + sum(p.numel() for p in model.parameters())


def describe_weights(model: nn.Module, config) -> str:
    """One line for the engine's start log: what the base weights take and in which forms."""
    forms = Counter(f"{m.qweight.kind}/g{m.qweight.group_size}" for m in quantized_modules(model))
    source = f" from {config.gguf_file}" if config.gguf_file else ""
    if not forms:
        return f"base weights: {weight_bytes(model) / 2**20:,.0f} MiB in floats{source}"
    shown = ", ".join(f"{count} {form}" for form, count in sorted(forms.items()))
    return (
        f"base weights: {weight_bytes(model) / 2**20:,.0f} MiB, packed modules {shown} "
        f"(the rest in floats){source}"
    )
