"""The engine's own Llama-family decoder, running over the paged KV cache.

Tokens of every sequence in the step are flattened into one ``[T, hidden]`` batch;
attention reads and writes the paged cache through ``loramux.kernels``; every
projection can carry LoRA deltas for the step's adapters (``LoRAStep``). The maths
follows transformers' Llama (RMSNorm in float32, RoPE, GQA, SwiGLU) so that logits
match it on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from loramux.engine.model.config import ModelConfig
from loramux.engine.model.rope import RotaryEmbedding, apply_rotary
from loramux.kernels.lora import (
    LoRADenseBatch,
    LoRASegment,
    lora_dense,
    lora_expand,
    lora_expand_slices,
    lora_shrink,
    lora_shrink_slices,
)
from loramux.kernels.lora_batch import LoRABatch
from loramux.kernels.paged_attention import AttentionPlan, paged_attention, write_kv

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QKV = ("q_proj", "k_proj", "v_proj")  # projections of the same input, consecutive slices
GATE_UP = ("gate_proj", "up_proj")


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged cache (built by the runner)."""

    positions: torch.Tensor  # [T] int64 absolute positions
    slot_mapping: torch.Tensor  # [T] int64 flat cache slot per token
    block_tables: list[list[int]]  # per sequence
    context_lens: list[int]  # per sequence: tokens of context after this step
    query_lens: list[int]  # per sequence: tokens computed in this step
    plan: AttentionPlan | None = None  # gather indices shared by all layers (built once)


class LoRAWeightSource:
    """What the model needs from the adapter pool: per (layer, module) row pools."""

    def a_pool(self, layer: int, module: str) -> torch.Tensor:  # [R, in]
        raise NotImplementedError

    def b_pool(self, layer: int, module: str) -> torch.Tensor:  # [R, out]
        raise NotImplementedError


@dataclass
class LoRAStep:
    """This step's adapters: segments per target module, and the pools to read."""

    pools: LoRAWeightSource
    segments: dict[str, list[LoRASegment]]  # module -> segments whose adapter targets it
    max_rank: dict[str, int]  # module -> largest rank among its segments
    # module -> the same batch in masked-dense form, where that is cheaper (CPU)
    dense: dict[str, LoRADenseBatch] = field(default_factory=dict)
    # The Triton path: the whole step as one table whose slices are LORA_TARGETS in order
    # (then ``segments`` and ``dense`` are empty).
    batch: LoRABatch | None = None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _project(
    x: torch.Tensor, linear: nn.Linear, layer: int, module: str, lora: LoRAStep | None
) -> torch.Tensor:
    """``linear(x)`` plus, per segment, ``scale * (x @ A^T) @ B^T`` of its adapter."""
    return _project_group(x, (linear,), layer, (module,), lora)[0]


def _project_group(
    x: torch.Tensor,
    linears: tuple[nn.Linear, ...],
    layer: int,
    modules: tuple[str, ...],
    lora: LoRAStep | None,
) -> list[torch.Tensor]:
    """``_project`` of several projections of the same ``x`` (q/k/v, gate/up).

    On the Triton path their LoRA shrinks are one launch over all slices (x is read once);
    each output then takes its own expand. Elsewhere, one ``_project_one`` each.
    """
    if lora is None or lora.batch is None:
        return [
            _project_one(x, lin, layer, m, lora) for lin, m in zip(linears, modules, strict=True)
        ]
    outs = [F.linear(x, linear.weight, linear.bias) for linear in linears]
    first = LORA_TARGETS.index(modules[0])
    pools = lora.pools
    y = lora_shrink_slices(
        x, [pools.a_pool(layer, m) for m in modules], lora.batch, first_slice=first
    )
    for s, (out, module) in enumerate(zip(outs, modules, strict=True)):
        b_pool = pools.b_pool(layer, module)
        lora_expand_slices(out, y[s : s + 1], [b_pool], [0], lora.batch, first_slice=first + s)
    return outs


def _project_one(
    x: torch.Tensor, linear: nn.Linear, layer: int, module: str, lora: LoRAStep | None
) -> torch.Tensor:
    out = F.linear(x, linear.weight, linear.bias)
    if lora is not None:
        dense = lora.dense.get(module)
        if dense is not None:
            a_pool, b_pool = lora.pools.a_pool(layer, module), lora.pools.b_pool(layer, module)
            lora_dense(x, out, a_pool, b_pool, dense)
            return out
        segments = lora.segments.get(module)
        if segments:
            y = lora_shrink(x, lora.pools.a_pool(layer, module), segments, lora.max_rank[module])
            lora_expand(out, y, lora.pools.b_pool(layer, module), segments)
    return out


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, config.q_size, bias=bias)
        self.k_proj = nn.Linear(h, config.kv_size, bias=bias)
        self.v_proj = nn.Linear(h, config.kv_size, bias=bias)
        self.o_proj = nn.Linear(config.q_size, h, bias=config.o_proj_bias)

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv_cache, lora):
        tokens = x.shape[0]
        q, k, v = _project_group(x, (self.q_proj, self.k_proj, self.v_proj), self.layer, QKV, lora)
        q = apply_rotary(q.view(tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        attn = paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.query_lens,
            self.scale,
            meta.plan,
        )  # [T, heads, head_dim]
        return _project(attn.reshape(tokens, -1), self.o_proj, self.layer, "o_proj", lora)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x, lora):
        gate, up = _project_group(x, (self.gate_proj, self.up_proj), self.layer, GATE_UP, lora)
        return _project(F.silu(gate) * up, self.down_proj, self.layer, "down_proj", lora)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer)
        self.mlp = LlamaMLP(config, layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, meta, kv_cache, lora):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class LlamaForCausalLM(nn.Module):
    """Parameter names follow HF's checkpoints (``model.layers.N...``, ``lm_head``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_layers)
        )
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary: RotaryEmbedding | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer
        lora: LoRAStep | None = None,
    ) -> torch.Tensor:  # hidden states [T, hidden]
        if self.rotary is None:
            self.rotary = RotaryEmbedding(self.config, input_ids.device)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(meta.positions, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, meta, kv_cache, lora)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab]
        return self.lm_head(hidden)
