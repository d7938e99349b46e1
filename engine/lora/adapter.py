"""LoRA adapters in PEFT format: ``adapter_config.json`` + ``adapter_model.safetensors``.

Loading validates the adapter against the base model and names the offending tensor
when something does not fit. Pickle files (``adapter_model.bin``) are refused and
never opened: unpickling runs arbitrary code.

Scaling follows PEFT: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``;
``rank_pattern`` / ``alpha_pattern`` entries keyed by a module name override them.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import LORA_TARGETS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (optionally .default.)
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


@dataclass(frozen=True)
class LoRATensorName:
    layer: int
    module: str  # e.g. "q_proj" (not checked against LORA_TARGETS here)
    which: str  # "A" or "B"


def parse_lora_tensor_name(name: str) -> LoRATensorName | None:
    """Where a PEFT tensor name points, or None if it is not a LoRA A/B weight."""
    match = _KEY.match(name)
    if match is None:
        return None
    return LoRATensorName(layer=int(match[1]), module=match[2], which=match[3])


class AdapterError(ValueError):
    """An adapter that cannot be served on this base model; the message says why."""


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


@dataclass
class LoRAWeights:
    name: str
    modules: dict[str, ModuleWeights]  # target module -> weights

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())


def _pattern_value(pattern: dict, module: str, default):
    for key, value in (pattern or {}).items():
        if key == module or key.endswith("." + module) or re.fullmatch(key, module):
            return value
    return default


def read_adapter_config(adapter_dir: Path) -> dict:
    path = adapter_dir / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{CONFIG_FILE} is missing from {adapter_dir}")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"peft_type {peft_type!r} is not supported (only LORA)")
    for flag, what in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save")):
        if config.get(flag):
            raise AdapterError(f"{what} adapters are not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"adapters with bias={config['bias']!r} are not supported")
    if "r" in config and (not isinstance(config["r"], int) or config["r"] < 1):
        raise AdapterError(f"adapter_config r must be a positive integer, got {config['r']!r}")
    return config


def load_adapter(
    adapter_dir: str | Path,
    model_config: ModelConfig,
    *,
    name: str | None = None,
    max_rank: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LoRAWeights:
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
    alpha = config.get("lora_alpha", config.get("r", 8))
    rslora = bool(config.get("use_rslora", False))

    raw: dict[tuple[str, int, str], torch.Tensor] = {}
    try:
        with safe_open(str(weights_path), framework="pt", device="cpu") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                parsed = parse_lora_tensor_name(key)
                if parsed is None:
                    raise AdapterError(f"tensor {key!r} is not a LoRA weight of a known module")
                layer, module, which = parsed.layer, parsed.module, parsed.which
                if module not in LORA_TARGETS:
                    raise AdapterError(
                        f"tensor {key!r} targets {module!r}, which the base model has no "
                        f"LoRA slot for (known: {', '.join(LORA_TARGETS)})"
                    )
                if layer >= model_config.num_layers:
                    raise AdapterError(
                        f"tensor {key!r} names layer {layer}, the base model has "
                        f"{model_config.num_layers} layers"
                    )
                raw[(module, layer, which)] = handle.get_tensor(key)
    except AdapterError:
        raise
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise AdapterError(f"{WEIGHTS_FILE} could not be read as safetensors: {exc}") from exc
    if not raw:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")

    modules: dict[str, ModuleWeights] = {}
    for (module, layer, which), tensor in sorted(raw.items()):
        if which == "B":
            continue
        key = f"layers.{layer}.{module}"
        b = raw.get((module, layer, "B"))
        if b is None:
            raise AdapterError(f"{key} has lora_A but no lora_B")
        in_features, out_features = model_config.module_shape(module)
        rank = tensor.shape[0]
        if tensor.ndim != 2 or tensor.shape[1] != in_features:
            raise AdapterError(
                f"{key}.lora_A has shape {tuple(tensor.shape)}; the base model needs "
                f"[r, {in_features}]"
            )
        if b.ndim != 2 or tuple(b.shape) != (out_features, rank):
            raise AdapterError(
                f"{key}.lora_B has shape {tuple(b.shape)}; the base model needs "
                f"[{out_features}, {rank}]"
            )
        expected_rank = _pattern_value(config.get("rank_pattern"), module, config.get("r", rank))
        if rank != expected_rank:
            raise AdapterError(f"{key} has rank {rank}, adapter_config says r={expected_rank}")
        if max_rank is not None and rank > max_rank:
            raise AdapterError(f"{key} has rank {rank}, above this engine's maximum of {max_rank}")
        if not (torch.isfinite(tensor).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{key} holds NaN or infinite values")
        module_alpha = _pattern_value(config.get("alpha_pattern"), module, alpha)
        scale = module_alpha / math.sqrt(rank) if rslora else module_alpha / rank
        weights = modules.get(module)
        if weights is None:
            weights = modules[module] = ModuleWeights(rank=rank, scale=float(scale))
        elif weights.rank != rank or weights.scale != float(scale):
            raise AdapterError(
                f"{key}: ranks or alphas that differ between layers of one module are not supported"
            )
        weights.a[layer] = tensor.to(device=device, dtype=dtype)
        weights.b[layer] = b.to(device=device, dtype=dtype)
    orphans = [k for k in raw if k[2] == "B" and (k[0], k[1], "A") not in raw]
    if orphans:
        module, layer, _ = orphans[0]
        raise AdapterError(f"layers.{layer}.{module} has lora_B but no lora_A")
    return LoRAWeights(name=name or adapter_dir.name, modules=modules)
