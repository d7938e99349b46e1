"""The base model's architecture, read from an HF ``config.json``.

Llama-family decoders: Llama (SmolLM2, Llama 3.x with its rope scaling), Mistral-style,
Qwen2 (q/k/v bias), Qwen3 (an RMSNorm over each head's queries and keys before RoPE) and
Phi-3/Phi-4 (q/k/v and gate/up fused in the checkpoint, split as they load), the
mixture-of-experts Mixtral and Qwen3-MoE (routed expert MLPs, ``moe.py``) and Gemma 3's
text decoder (embeddings scaled by √hidden, RMSNorms of (1 + w) computed in float32, norms
after attention and around the MLP too, GeGLU, q/k norms, ``query_pre_attn_scalar``, and
local layers with their own RoPE base between global ones): the fields the decoder needs,
checked once here so the model code can trust them.

A model whose attention looks back a window of keys (``sliding_window``) attends over it in
its sliding layers (``window_of``): every layer of a Mistral-style model, Gemma 3's local
layers between its global ones.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = {
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma3_text",
    "mixtral",
    "qwen3_moe",
}
# Mixture-of-experts families (``engine/model/moe.py``): the MLP of some or all layers is
# a router choosing ``experts_per_token`` of ``num_experts`` expert MLPs per token.
MOE_MODEL_TYPES = {"mixtral", "qwen3_moe"}
GEMMA_MODEL_TYPES = {"gemma3_text"}
ACTIVATIONS = {"silu", "gelu_pytorch_tanh"}
# Families whose attention normalizes each head's queries and keys (RMSNorm over
# head_dim, one weight shared by the heads) before RoPE.
QK_NORM_MODEL_TYPES = {"qwen3", "gemma3_text", "qwen3_moe"}
# Families whose checkpoints (and PEFT adapters) hold some projections fused: the fused
# module's output rows are its parts' outputs, in order.
FUSED_MODULES = {
    "phi3": {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
}
# Families that apply ``sliding_window`` only under ``use_sliding_window``.
OPT_IN_WINDOW_MODEL_TYPES = {"qwen2", "qwen3", "qwen3_moe"}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2); q/k/v/o bias (Llama)
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3)
    attention_window: int | None = None  # keys a query sees (sliding window), None: all
    hidden_act: str = "silu"  # the MLP's gate activation (Gemma: gelu_pytorch_tanh)
    gemma_norms: bool = False  # RMSNorm of (1 + w) in float32, and norms after attention/MLP
    embed_scale: float | None = None  # embeddings times this (Gemma: √hidden)
    attention_scale: float | None = None  # scores' scale (Gemma: query_pre_attn_scalar^-½)
    # Per layer, "full_attention" or "sliding_attention" (empty: all full); sliding layers
    # take their own RoPE base and scaling (Gemma 3's local layers).
    layer_types: tuple[str, ...] = ()
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict | None = None
    # Mixture of experts (``engine/model/moe.py``): per layer whether its MLP is routed
    # (empty: none is), the experts, how many a token takes, each one's intermediate size,
    # whether the chosen experts' weights are renormalized to sum to 1, and whether they
    # stay in float32 (Mixtral) or take the activations' dtype (Qwen3-MoE)
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    normalize_expert_weights: bool = True
    expert_weights_in_float32: bool = True
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config {name} must be positive")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_context(self) -> int:
        """The longest context served: the model's positions (a sliding window's layers
        attend to their window, ``window_of``)."""
        return self.max_position_embeddings

    @property
    def kv_window(self) -> int | None:
        """The window every layer attends over (a Mistral-style model), None when some
        layer sees every key: keys older than it may be dropped from the KV cache."""
        windows = {self.window_of(layer) for layer in range(self.num_layers)}
        return None if None in windows else windows.pop()

    def window_of(self, layer: int) -> int | None:
        """The keys layer ``layer`` looks back over (a sliding window), None for all: a
        windowed model's every layer, or its sliding layers where it has ``layer_types``
        (Gemma 3's local layers)."""
        if self.attention_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.attention_window

    def for_layer_kind(self, kind: str) -> ModelConfig:
        """This config as a layer of ``kind`` sees it: a sliding layer's own RoPE base and
        scaling where the family gives it one."""
        if kind != "sliding_attention" or self.sliding_rope_theta is None:
            return self
        return dataclasses.replace(
            self, rope_theta=self.sliding_rope_theta, rope_scaling=self.sliding_rope_scaling
        )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is routed to experts (``engine/model/moe.py``)."""
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def fused_modules(self) -> dict[str, tuple[str, ...]]:
        """Fused checkpoint module -> the projections it holds, in row order."""
        return FUSED_MODULES.get(self.model_type, {})

    @property
    def o_proj_bias(self) -> bool:
        # Llama's `attention_bias` puts a bias on o_proj too; Qwen2's o_proj never has one.
        return self.attention_bias and self.model_type != "qwen2"

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a projection, by its PEFT/HF short name."""
        h, i = self.hidden_size, self.intermediate_size
        shapes = {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        parts = self.fused_modules.get(module)
        if parts is not None:  # its parts' outputs side by side
            return (shapes[parts[0]][0], sum(shapes[p][1] for p in parts))
        return shapes[module]

    @classmethod
    def from_hf_dict(cls, raw: dict) -> ModelConfig:
        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; loramux serves Llama-family "
                f"decoders ({', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
            )
        window = raw.get("sliding_window")
        if model_type in OPT_IN_WINDOW_MODEL_TYPES and not raw.get("use_sliding_window"):
            window = None
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        # transformers 5 moved rope settings into `rope_parameters`; older files keep
        # `rope_theta` and `rope_scaling` at the top level.
        rope = dict(raw.get("rope_parameters") or {})
        if "full_attention" in rope:  # per layer type (Gemma 3): the global layers' here
            rope = dict(rope["full_attention"] or {})
        theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
        partial = rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(
                f"partial_rotary_factor {partial} is not served yet (RoPE over part of each "
                "head, as in Phi-4-mini); only 1.0"
            )
        scaling = rope or raw.get("rope_scaling") or None
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            scaling["rope_type"] = kind
            if kind == "default":
                scaling = None
            elif kind == "dynamic":
                raise ValueError(
                    "rope scaling 'dynamic' is not served: its frequencies change with the "
                    "longest sequence seen, so a request's tokens would depend on its batch; "
                    "use 'yarn' or 'linear' (supported: default, linear, llama3, yarn)"
                )
            elif kind not in {"linear", "llama3", "yarn"}:
                raise ValueError(
                    f"unsupported rope scaling type {kind!r} (supported: default, linear, "
                    "llama3, yarn)"
                )
            if kind == "yarn":  # the pretraining context and factor, as transformers reads them
                positions = raw.get("max_position_embeddings", 4096)
                old = scaling.get("original_max_position_embeddings")
                old = old or raw.get("original_max_position_embeddings") or positions
                scaling["original_max_position_embeddings"] = old
                scaling["factor"] = scaling.get("factor") or positions / old
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        gemma = model_type in GEMMA_MODEL_TYPES
        family = _gemma_fields(raw, hidden) if gemma else {}
        if model_type in MOE_MODEL_TYPES:
            family = _moe_fields(raw, model_type)
        if not gemma and raw.get("layer_types"):  # which layers slide (Qwen's first ones don't)
            family["layer_types"] = _layer_types(raw)
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(
                f"hidden activation {act!r} is not served (supported: {', '.join(sorted(ACTIVATIONS))})"
            )
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type in QK_NORM_MODEL_TYPES,
            attention_window=int(window) if window else None,
            hidden_act=act,
            **family,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            model_type=model_type,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the model must be an HF-format directory")
        raw = json.loads(path.read_text())
        # generation_config.json may list extra end-of-turn ids (Llama 3's <|eot_id|>).
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.is_file():
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            if gen_eos is not None:
                ids = set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
                base = raw.get("eos_token_id")
                ids |= set(base if isinstance(base, list) else ([] if base is None else [base]))
                raw = {**raw, "eos_token_id": sorted(ids)}
        return cls.from_hf_dict(raw)


def _layer_types(raw: dict) -> tuple[str, ...]:
    """Per layer, ``full_attention`` or ``sliding_attention``, checked."""
    types = raw["layer_types"]
    if len(types) != raw["num_hidden_layers"] or set(types) - {
        "full_attention",
        "sliding_attention",
    }:
        raise ValueError("layer_types must name one of full_attention/sliding_attention per layer")
    return tuple(types)


def _moe_fields(raw: dict, model_type: str) -> dict:
    """Mixtral's and Qwen3-MoE's routers and experts, from their configs."""
    layers = raw["num_hidden_layers"]
    if model_type == "mixtral":
        return {
            "moe_layers": (True,) * layers,
            "num_experts": raw["num_local_experts"],
            "experts_per_token": raw["num_experts_per_tok"],
            "expert_intermediate_size": raw["intermediate_size"],
        }
    dense = set(raw.get("mlp_only_layers") or ())
    step = raw.get("decoder_sparse_step", 1) or 1
    experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
    return {
        "moe_layers": tuple(
            experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers)
        ),
        "num_experts": experts,
        "experts_per_token": raw["num_experts_per_tok"],
        "expert_intermediate_size": raw["moe_intermediate_size"],
        "normalize_expert_weights": bool(raw.get("norm_topk_prob", False)),
        "expert_weights_in_float32": False,
    }


def _gemma_fields(raw: dict, hidden: int) -> dict:
    """Gemma 3's departures from Llama, from its config (transformers 5's per-layer-type
    ``rope_parameters``, or the older ``rope_local_base_freq``)."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(name):
            raise ValueError(f"{name} is not served (Gemma 2's logit soft-capping)")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not served (decoders only)")
    layers = raw["num_hidden_layers"]
    if raw.get("layer_types"):
        types = _layer_types(raw)
    else:
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
        types = tuple(
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        )
    local = (raw.get("rope_parameters") or {}).get("sliding_attention")
    if local is not None:
        local = dict(local)
        theta = float(local.pop("rope_theta", 10000.0))
    else:
        local, theta = {}, float(raw.get("rope_local_base_freq", 10000.0))
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"the local layers' rope scaling {local['rope_type']!r} is not served")
    scalar = (
        raw.get("query_pre_attn_scalar")
        or raw.get("head_dim")
        or hidden // raw["num_attention_heads"]
    )
    return {
        "gemma_norms": True,
        "embed_scale": hidden**0.5,
        "attention_scale": float(scalar) ** -0.5,
        "layer_types": tuple(types),
        "sliding_rope_theta": theta,
    }
