"""LoRA adapters in PEFT format: ``adapter_config.json`` + ``adapter_model.safetensors``.

Loading validates the adapter against the base model and names the offending tensor
when something does not fit. Pickle files (``adapter_model.bin``) are refused and
never opened: unpickling runs arbitrary code.

``adapter_config.json`` comes from tenants: it is parsed once, strictly, by
``loramux.engine.lora.adapter_config`` (which also holds PEFT's scaling rules). A loaded
adapter's A, B and scale·B are finite in the dtype it is loaded in (fp16's 65504
included): an adapter whose scaled weights overflow is refused, not served
(``adapter_checks.py``).

Beyond A and B an adapter may hold DoRA's magnitudes and LoRA biases (checked here, served
by ``dora.py`` and ``output_terms.py``), its own embedding and LM-head rows
(``token_rows.py``, ``tokens.py``) and LoRA on a mixture's experts (``expert_lora.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from loramux.engine.lora.adapter_checks import (
    check_shapes,
    check_values,
    lora_bias_of,
    magnitude_of,
)
from loramux.engine.lora.adapter_config import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    AdapterConfig,
    AdapterError,
    read_adapter_config,
)
from loramux.engine.lora.expert_lora import expert_modules, parse_expert_tensor_name
from loramux.engine.lora.token_rows import TokenRows, parse_token_tensor_name, token_rows_of
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
# DoRA's ...q_proj.lora_magnitude_vector (older PEFT: ...lora_magnitude_vector.default.weight)
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
    embed, head = token_rows_of(token_tensors, config, model_config, dtype, device)

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
        rank = check_shapes(key, a, b, model_config.module_shape(module))
        magnitude = magnitude_of(raw, config, key, module, layer, b.shape[0], dtype)
        bias = lora_bias_of(raw, config, key, module, layer, b.shape[0])
        peft_name = tensor_name.peft_module_name
        expected_rank = config.rank_for(peft_name)
        if expected_rank is not None and rank != expected_rank:
            raise AdapterError(f"{key} has rank {rank}, adapter_config says r={expected_rank}")
        if max_rank is not None and rank > max_rank:
            raise AdapterError(f"{key} has rank {rank}, above this engine's maximum of {max_rank}")
        scale = config.scale_for(peft_name, rank)
        check_values(key, a, b, scale, dtype)
        if bias is not None:
            check_values(f"{key}.lora_B.bias", a, bias[:, None], scale, dtype)
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
        slots = expert_modules(expert_tensors, config, model_config, dtype, device, check_values)
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
