"""LoRA adapters in PEFT format: ``adapter_config.json`` + ``adapter_model.safetensors``.

Loading validates the adapter against the base model and names the offending tensor
when something does not fit. Pickle files (``adapter_model.bin``) are refused and
never opened: unpickling runs arbitrary code.

``adapter_config.json`` comes from tenants: it is parsed once, strictly, by
``loramux.engine.lora.adapter_config`` (which also holds PEFT's scaling rules). A loaded
adapter's A, B and scale·B are finite in the dtype it is loaded in (fp16's 65504
included): an adapter whose scaled weights overflow is refused, not served.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from loramux.engine.lora.adapter_config import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    AdapterConfig,
    AdapterError,
    read_adapter_config,
)
from loramux.engine.lora.expert_lora import expert_modules, parse_expert_tensor_name
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.fused_modules import split_rows
from loramux.engine.model.llama import LORA_TARGETS

__all__ = [
    "CONFIG_FILE",
    "MAX_CONFIG_BYTES",
    "PICKLE_FILE",
    "WEIGHTS_FILE",
    "AdapterConfig",
    "AdapterError",
    "LoRARequest",
    "LoRATensorName",
    "LoRAWeights",
    "ModuleWeights",
    "load_adapter",
    "parse_lora_tensor_name",
    "read_adapter_config",
]

WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (optionally .default.),
# and DoRA's ...q_proj.lora_magnitude_vector (older PEFT: ...lora_magnitude_vector.default.weight)
# modules_to_save's whole tables (base_model.model.lm_head.weight), trainable_token_indices'
# rows (base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta)
_TOKEN_KEY = re.compile(
    r"^(?:base_model\.model\.)?(model\.embed_tokens|lm_head)\."
    r"(?:(?:modules_to_save\.[\w-]+\.)?(weight)|token_adapter\.(trainable_tokens_delta)(?:\.[\w-]+)?)$"
)
# and lora_bias's ...q_proj.lora_B.bias
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\."
    r"lora_(?:([AB])(?:\.[\w-]+)?\.weight|(B)(?:\.[\w-]+)?\.bias"
    r"|magnitude_vector(?:\.[\w-]+)?(?:\.weight)?)$"
)


@dataclass(frozen=True)
class LoRATensorName:
    layer: int
    module: str  # e.g. "q_proj" (not checked against LORA_TARGETS here)
    which: str  # "A", "B", "bias" (lora_B's, lora_bias) or "M" (DoRA's magnitude vector)
    block: str = "self_attn"  # "self_attn" or "mlp", as the tensor name says

    @property
    def peft_module_name(self) -> str:
        """The module's name in the base model, which PEFT matches patterns against."""
        return f"model.layers.{self.layer}.{self.block}.{self.module}"


def parse_lora_tensor_name(name: str) -> LoRATensorName | None:
    """Where a PEFT tensor name points, or None if it is not a LoRA A/B weight, a LoRA B
    bias or a DoRA magnitude."""
    match = _KEY.match(name)
    if match is None:
        return None
    which = match[4] or ("bias" if match[5] else "M")
    return LoRATensorName(layer=int(match[1]), block=match[2], module=match[3], which=which)


# --- weights -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request uses: a small immutable value."""

    name: str
    adapter_id: int  # unique per loaded adapter; goes into the prefix-cache salt
    source: str  # where it was loaded from (path or store key), for messages


@dataclass
class ModuleWeights:
    """One target module's weights across layers; layers it skips are absent."""

    rank: int
    scale: float
    a: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [r, in]
    b: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [out, r]
    # DoRA (``engine/lora/dora.py``): layer -> [out], PEFT's lora_magnitude_vector as read;
    # once folded for a device, the per-output excess of its scale (g - 1) instead
    magnitude: dict[int, torch.Tensor] = field(default_factory=dict)
    dora_excess: dict[int, torch.Tensor] = field(default_factory=dict)
    # lora_bias: layer -> [out], lora_B's bias as read (the device adds scale · it)
    bias: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class TokenRows:
    """Rows of the embedding or the LM head an adapter replaces (PEFT's modules_to_save:
    the whole table; trainable_token_indices: a few rows)."""

    rows: torch.Tensor  # [k, hidden]
    ids: tuple[int, ...] | None = None  # the token of each row; None: all, in order

    @property
    def count(self) -> int:
        return self.rows.shape[0]


@dataclass
class LoRAWeights:
    name: str
    modules: dict[str, ModuleWeights]  # target module -> weights
    # The embedding's and the LM head's rows it replaces (``engine/lora/tokens.py``)
    embed: TokenRows | None = None
    head: TokenRows | None = None
    # LoRA on a mixture of experts' experts (``engine/lora/expert_lora.py``): each expert's
    # rank; its MLP modules then hold rank·num_experts rows, expert e's from e·rank
    expert_rank: int = 0

    @property
    def token_rows(self) -> int:
        """Rows of the embedding's width it replaces, the embedding's and the head's (once
        when the two are the same rows)."""
        tables = {id(t): t.count for t in (self.embed, self.head) if t is not None}
        return sum(tables.values())

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def dora(self) -> bool:
        """Whether this is a DoRA adapter (its modules have magnitude vectors)."""
        return any(m.magnitude for m in self.modules.values())

    @property
    def lora_bias(self) -> bool:
        """Whether its B matrices have biases (PEFT's ``lora_bias``)."""
        return any(m.bias for m in self.modules.values())

    @property
    def num_rows(self) -> int:
        """Its rank-rows: its rank, one more holding DoRA's scales, one more holding its
        LoRA biases. The rows of its token tables come after them (``LoRAPool.rows_for``
        adds them)."""
        return self.rank + self.dora + self.lora_bias

    @property
    def dora_row(self) -> int | None:
        """Which of its rows holds DoRA's per-output scales (None: not a DoRA adapter)."""
        return self.rank if self.dora else None

    @property
    def bias_row(self) -> int | None:
        """Which of its rows holds its scaled LoRA biases (None: it has none)."""
        return self.rank + self.dora if self.lora_bias else None


def parse_token_tensor_name(name: str) -> tuple[str, str] | None:
    """(``embed_tokens`` or ``lm_head``, ``table`` or ``rows``) of a modules_to_save table or
    a trainable_token_indices tensor; None for any other name."""
    match = _TOKEN_KEY.match(name)
    if match is None:
        return None
    module = "lm_head" if match[1] == "lm_head" else "embed_tokens"
    return module, "table" if match[2] else "rows"


def _read_lora_tensors(
    weights_path: Path,
    model_config: ModelConfig,
    tokens: dict[tuple[str, str], torch.Tensor],
    experts: dict[tuple[int, int, str], torch.Tensor],
) -> dict[tuple[str, int, str], tuple[LoRATensorName, torch.Tensor]]:
    """(module, layer, "A" or "B") -> (its name, the tensor as stored), names checked; the
    embedding's and head's tensors go into ``tokens`` (``parse_token_tensor_name``'s key),
    the experts' into ``experts`` (``expert_lora.parse_expert_tensor_name``'s)."""
    raw: dict[tuple[str, int, str], tuple[LoRATensorName, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt", device="cpu") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                token_tensor = parse_token_tensor_name(key)
                if token_tensor is not None:
                    tokens[token_tensor] = handle.get_tensor(key)
                    continue
                expert_tensor = parse_expert_tensor_name(key)
                if expert_tensor is not None:
                    experts[expert_tensor] = handle.get_tensor(key)
                    continue
                parsed = parse_lora_tensor_name(key)
                if parsed is None:
                    raise AdapterError(f"tensor {key!r} is not a LoRA weight of a known module")
                fused = model_config.fused_modules
                if parsed.module not in LORA_TARGETS and parsed.module not in fused:
                    known = ", ".join([*fused, *LORA_TARGETS] if fused else LORA_TARGETS)
                    raise AdapterError(
                        f"tensor {key!r} targets {parsed.module!r}, which the base model has no "
                        f"LoRA slot for (known: {known})"
                    )
                if parsed.layer >= model_config.num_layers:
                    raise AdapterError(
                        f"tensor {key!r} names layer {parsed.layer}, the base model has "
                        f"{model_config.num_layers} layers"
                    )
                tensor = handle.get_tensor(key)
                for module, part in _parts(model_config, key, parsed, tensor):
                    slot = (module, parsed.layer, parsed.which)
                    if slot in raw:
                        raise AdapterError(
                            f"{key} and {raw[slot][0].peft_module_name} both target "
                            f"layers.{parsed.layer}.{module}"
                        )
                    raw[slot] = (parsed, part)
    except AdapterError:
        raise
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise AdapterError(f"{WEIGHTS_FILE} could not be read as safetensors: {exc}") from exc
    if not raw and not experts:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    return raw


def _parts(
    config: ModelConfig, key: str, parsed: LoRATensorName, tensor: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """(module, tensor) of a LoRA weight: itself, or for a fused module (Phi-3's
    ``qkv_proj``) one per part, A shared and B split by rows (``fused_modules``)."""
    if parsed.module not in config.fused_modules:
        return [(parsed.module, tensor)]
    if parsed.which == "A":
        return [(part, tensor) for part in config.fused_modules[parsed.module]]
    # B's rows and a magnitude's entries are output features: split alike
    try:
        return split_rows(config, parsed.module, tensor)
    except ValueError as exc:
        raise AdapterError(f"{key}: {exc}") from exc


def _check_shapes(key: str, a: torch.Tensor, b: torch.Tensor, shape: tuple[int, int]) -> int:
    """The rank of a layer's A [r, in] and B [out, r], after checking both against the base."""
    in_features, out_features = shape
    if a.ndim != 2 or a.shape[1] != in_features or a.shape[0] < 1:
        raise AdapterError(
            f"{key}.lora_A has shape {tuple(a.shape)}; the base model needs [r, {in_features}]"
        )
    rank = a.shape[0]
    if b.ndim != 2 or tuple(b.shape) != (out_features, rank):
        raise AdapterError(
            f"{key}.lora_B has shape {tuple(b.shape)}; the base model needs "
            f"[{out_features}, {rank}]"
        )
    return rank


def _magnitude(
    raw, config: AdapterConfig, key: str, module: str, layer: int, out_features: int, dtype
) -> torch.Tensor | None:
    """DoRA's magnitude vector of a module's layer ([out], finite in ``dtype``), None
    without ``use_dora``; an error when the config and the tensors disagree."""
    entry = raw.get((module, layer, "M"))
    if not config.use_dora:
        if entry is not None:
            raise AdapterError(
                f"{key}.lora_magnitude_vector is a DoRA tensor, but {CONFIG_FILE} does not "
                "say use_dora: true; save the adapter with the config PEFT wrote for it"
            )
        return None
    if entry is None:
        raise AdapterError(
            f"{key} has no lora_magnitude_vector, which a DoRA adapter (use_dora: true) "
            "needs for every module it targets"
        )
    magnitude = entry[1]
    if magnitude.ndim != 1 or magnitude.shape[0] != out_features:
        raise AdapterError(
            f"{key}.lora_magnitude_vector has shape {tuple(magnitude.shape)}; the base model "
            f"needs [{out_features}]"
        )
    peak = float(magnitude.abs().max())
    if not _fits(peak, dtype):
        raise AdapterError(
            f"{key}.lora_magnitude_vector holds NaN, infinite or values beyond "
            f"{str(dtype).removeprefix('torch.')}'s range"
        )
    return magnitude


def _lora_bias(
    raw, config: AdapterConfig, key: str, module: str, layer: int, out_features: int
) -> torch.Tensor | None:
    """lora_B's bias of a module's layer ([out]), None without ``lora_bias``; an error when
    the config and the tensors disagree (its values are checked with B's)."""
    entry = raw.get((module, layer, "bias"))
    if not config.lora_bias:
        if entry is not None:
            raise AdapterError(
                f"{key}.lora_B.bias is a LoRA bias, but {CONFIG_FILE} does not say "
                "lora_bias: true; save the adapter with the config PEFT wrote for it"
            )
        return None
    if entry is None:
        raise AdapterError(
            f"{key} has no lora_B.bias, which an adapter with lora_bias: true needs for every "
            "module it targets"
        )
    bias = entry[1]
    if bias.ndim != 1 or bias.shape[0] != out_features:
        raise AdapterError(
            f"{key}.lora_B.bias has shape {tuple(bias.shape)}; the base model needs "
            f"[{out_features}]"
        )
    return bias


def _fits(value: float, dtype: torch.dtype) -> bool:
    """Whether ``value`` stays finite when rounded to ``dtype``."""
    return math.isfinite(value) and bool(
        torch.isfinite(torch.tensor(value, dtype=torch.float64).to(dtype))
    )


def _check_values(key: str, a: torch.Tensor, b: torch.Tensor, scale: float, dtype) -> None:
    """A and B must be finite, and A, B, the scale and scale·B finite in ``dtype``.

    The engine keeps scales in the serving dtype and multiplies B by them: a value that
    overflows there turns the adapter's outputs into inf/NaN (or makes the step raise).
    Rounding is monotonic, so a tensor fits ``dtype`` when its largest magnitude does: one
    reduction per tensor (NaN and inf propagate through it) instead of a check per element
    kind, since the loader thread runs beside the engine's steps and a load's cost is felt
    there.
    """
    peak_a, peak_b = float(a.abs().max()), float(b.abs().max())
    if not (math.isfinite(peak_a) and math.isfinite(peak_b)):
        raise AdapterError(f"{key} holds NaN or infinite values")
    peak = peak_b * abs(scale)
    if _fits(max(peak_a, peak_b, abs(scale), peak), dtype):
        return
    dtype_name, largest = str(dtype).removeprefix("torch."), torch.finfo(dtype).max
    beyond = f"beyond {dtype_name}'s largest value ({largest:g}), the dtype it is served in"
    for which, value in (("A", peak_a), ("B", peak_b)):
        if not _fits(value, dtype):
            raise AdapterError(f"{key}.lora_{which} has values {beyond}")
    if not _fits(scale, dtype):
        raise AdapterError(f"{key}: its scale (lora_alpha/r = {scale:g}) is {beyond}")
    raise AdapterError(
        f"{key}: lora_B times its scale (lora_alpha/r = {scale:g}) reaches {peak:.4g}, "
        f"{beyond}; lower lora_alpha or the weights"
    )


def load_adapter(
    adapter_dir: str | Path,
    model_config: ModelConfig,
    *,
    name: str | None = None,
    max_rank: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LoRAWeights:
    """The adapter in ``adapter_dir``, checked and in ``dtype``; ``AdapterError`` says why not."""
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise AdapterError(f"adapter directory {adapter_dir} does not exist")
    weights_path = adapter_dir / WEIGHTS_FILE
    if not weights_path.is_file():
        if (adapter_dir / PICKLE_FILE).exists():
            raise AdapterError(
                f"{PICKLE_FILE} is a pickle file and is refused unopened; "
                f"save the adapter with safetensors ({WEIGHTS_FILE})"
            )
        raise AdapterError(f"{WEIGHTS_FILE} is missing from {adapter_dir}")
    config = read_adapter_config(adapter_dir)
    token_tensors: dict[tuple[str, str], torch.Tensor] = {}
    expert_tensors: dict[tuple[int, int, str], torch.Tensor] = {}
    raw = _read_lora_tensors(weights_path, model_config, token_tensors, expert_tensors)
    embed, head = _token_rows(token_tensors, config, model_config, dtype, device)

    modules: dict[str, ModuleWeights] = {}
    for (module, layer, which), (tensor_name, a) in sorted(raw.items()):
        if which != "A":
            continue
        key = f"layers.{layer}.{module}"
        if model_config.is_moe_layer(layer) and module in ("gate_proj", "up_proj", "down_proj"):
            raise AdapterError(
                f"{key}: layer {layer}'s MLP is a mixture of experts, which has no {module}; "
                "LoRA on experts is not served yet: target the attention projections"
            )
        if (module, layer, "B") not in raw:
            raise AdapterError(f"{key} has lora_A but no lora_B")
        b = raw[(module, layer, "B")][1]
        rank = _check_shapes(key, a, b, model_config.module_shape(module))
        magnitude = _magnitude(raw, config, key, module, layer, b.shape[0], dtype)
        bias = _lora_bias(raw, config, key, module, layer, b.shape[0])
        peft_name = tensor_name.peft_module_name
        expected_rank = config.rank_for(peft_name)
        if expected_rank is not None and rank != expected_rank:
            raise AdapterError(f"{key} has rank {rank}, adapter_config says r={expected_rank}")
        if max_rank is not None and rank > max_rank:
            raise AdapterError(f"{key} has rank {rank}, above this engine's maximum of {max_rank}")
        scale = config.scale_for(peft_name, rank)
        _check_values(key, a, b, scale, dtype)
        if bias is not None:
            _check_values(f"{key}.lora_B.bias", a, bias[:, None], scale, dtype)
        weights = modules.get(module)
        if weights is None:
            weights = modules[module] = ModuleWeights(rank=rank, scale=scale)
        elif weights.rank != rank or weights.scale != scale:
            raise AdapterError(
                f"{key}: ranks or alphas that differ between layers of one module are not supported"
            )
        weights.a[layer] = a.to(device=device, dtype=dtype)
        weights.b[layer] = b.to(device=device, dtype=dtype)
        if magnitude is not None:
            weights.magnitude[layer] = magnitude.to(device=device, dtype=dtype)
        if bias is not None:
            weights.bias[layer] = bias.to(device=device, dtype=dtype)
    orphans = [k for k in raw if k[2] != "A" and (k[0], k[1], "A") not in raw]
    if orphans:
        module, layer, which = orphans[0]
        tensor = {"B": "lora_B", "bias": "lora_B.bias"}.get(which, "lora_magnitude_vector")
        raise AdapterError(f"layers.{layer}.{module} has {tensor} but no lora_A")
    expert_rank = 0
    if expert_tensors:
        slots = expert_modules(expert_tensors, config, model_config, dtype, device, _check_values)
        for module, (rank, scale, a, b) in slots.items():
            if module in modules:
                raise AdapterError(
                    f"the adapter puts LoRA on both the experts and a dense {module}; "
                    "train one of them"
                )
            modules[module] = ModuleWeights(rank=rank, scale=scale, a=a, b=b)
            expert_rank = rank // model_config.num_experts
    return LoRAWeights(
        name=name or adapter_dir.name,
        modules=modules,
        embed=embed,
        head=head,
        expert_rank=expert_rank,
    )


def _token_rows(
    tensors: dict[tuple[str, str], torch.Tensor],
    config: AdapterConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device,
) -> tuple[TokenRows | None, TokenRows | None]:
    """The embedding's and the head's rows the adapter replaces, checked against its config
    and the base model. PEFT ties trainable tokens of a tied embedding to the head; a whole
    embedding saved without ``ensure_weight_tying`` leaves the head as it is."""
    vocab, hidden = model_config.vocab_size, model_config.hidden_size
    indices = dict(config.trainable_tokens)
    found: dict[str, TokenRows] = {}
    for (module, kind), tensor in sorted(tensors.items()):
        name = f"{module} ({'modules_to_save' if kind == 'table' else 'trainable_token_indices'})"
        if kind == "table":
            if module not in config.modules_to_save:
                raise AdapterError(
                    f"the weights hold a whole {module} table, but {CONFIG_FILE} does not list "
                    f"it in modules_to_save; save the adapter with the config PEFT wrote for it"
                )
            ids, expected = None, (vocab, hidden)
            if tensor.ndim == 2 and tensor.shape[1] == hidden and tensor.shape[0] != vocab:
                raise AdapterError(
                    f"{name} has {tensor.shape[0]} rows, the base model's vocabulary "
                    f"{vocab}: a resized vocabulary is not served; give new tokens ids "
                    "within the base vocabulary (its reserved tokens) and train them with "
                    "trainable_token_indices"
                )
        else:
            ids = indices.get(module)
            if ids is None:
                raise AdapterError(
                    f"the weights hold trainable token rows of {module}, but {CONFIG_FILE}'s "
                    "trainable_token_indices names none for it"
                )
            if max(ids) >= vocab:
                raise AdapterError(
                    f"trainable_token_indices names token {max(ids)}, beyond the base "
                    f"model's vocabulary of {vocab}"
                )
            expected = (len(ids), hidden)
        if tuple(tensor.shape) != expected:
            raise AdapterError(
                f"{name} has shape {tuple(tensor.shape)}; the base model needs {list(expected)}"
            )
        if module in found:
            raise AdapterError(f"{module} is both saved whole and given trainable tokens")
        if not _fits(float(tensor.abs().max()), dtype):
            raise AdapterError(
                f"{name} holds NaN, infinite or values beyond "
                f"{str(dtype).removeprefix('torch.')}'s range"
            )
        found[module] = TokenRows(rows=tensor.to(device=device, dtype=dtype), ids=ids)
    for module in config.modules_to_save:
        if module not in found:
            raise AdapterError(
                f"modules_to_save lists {module}, but the weights hold no table of it"
            )
    for module in indices:
        if module not in found:
            raise AdapterError(
                f"trainable_token_indices names tokens of {module}, but the weights hold none"
            )
    embed, head = found.get("embed_tokens"), found.get("lm_head")
    if (
        head is None
        and embed is not None
        and embed.ids is not None
        and model_config.tie_word_embeddings
    ):
        head = embed
    return embed, head
