"""The engine's own Llama-family decoder, running over the paged KV cache.

Tokens of every sequence in the step are flattened into one ``[T, hidden]`` batch. The
step comes with two objects built by the engine's kernel backend
(``loramux.engine.lora.backend``), which the model uses without knowing their kind:
:class:`StepAttention` (where the new tokens go in the paged cache, and attention over
it) and, when some token uses an adapter, :class:`StepLoRA` (one call per projection
group adds the step's LoRA deltas). The maths follows transformers' Llama (RMSNorm in
float32, RoPE, GQA, SwiGLU) so that logits match it on the CPU.

Under tensor parallelism (``engine/parallel``) the decoder is one rank's shard, built from
that rank's ``ModelConfig`` (its heads, FFN slice and vocabulary range) and joined to the
other ranks by :meth:`LlamaForCausalLM.join`: the row-parallel projections' outputs are
summed over the ranks, and so are the vocabulary-parallel embedding's; the LM head's logits
are gathered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from loramux.engine.model.config import ModelConfig
from loramux.engine.model.moe import MoEMLP
from loramux.engine.model.rope import RotaryEmbedding, apply_rotary
from loramux.kernels.paged_attention import write_kv

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Projections of the same input, consecutive in LORA_TARGETS (the LoRA tables' slices).
QKV = ("q_proj", "k_proj", "v_proj")
O_PROJ = ("o_proj",)
GATE_UP = ("gate_proj", "up_proj")
DOWN = ("down_proj",)
PROJECTION_GROUPS = (QKV, O_PROJ, GATE_UP, DOWN)


class StepAttention(Protocol):
    """A step's attention: its new tokens' positions and cache slots, and the op."""

    positions: torch.Tensor  # [T] int64 absolute positions
    new_token_slots: torch.Tensor  # [T] int64 flat cache slot per token

    def attend(
        self,
        query: torch.Tensor,  # [T, heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        scale: float,
        window: int | None = None,  # a sliding window of keys (None: every key)
    ) -> torch.Tensor: ...  # [T, heads, head_dim]


class OutputTerms(Protocol):
    """What a step's DoRA adapters and adapters with a LoRA bias add to each projection's
    output beyond LoRA's deltas (``engine/lora/output_terms.py``), before them."""

    def add(
        self,
        outs: list[torch.Tensor],  # per module of the group [T, out_m], updated in place
        biases: list[torch.Tensor | None],  # per module, its bias (part of outs)
        layer: int,
        modules: tuple[str, ...],
    ) -> None: ...


class StepLoRA(Protocol):
    """A step's adapters, bound to the pools holding their weights. ``launches`` counts the
    LoRA ops it has started (Triton kernel launches, native op calls, stacked torch op
    calls), so a step's cost in launches can be read after its forward. ``terms``: the
    step's DoRA and LoRA-bias terms, None without such adapters."""

    launches: int
    terms: OutputTerms | None
    experts: object | None  # LoRA on a mixture's experts (engine/lora/expert_lora.py)

    def add(
        self,
        x: torch.Tensor,  # [T, in], the group's shared input
        outs: list[torch.Tensor],  # per module of the group [T, out_m], updated in place
        layer: int,
        modules: tuple[str, ...],  # one of PROJECTION_GROUPS
    ) -> None: ...


class LoRAWeightSource(Protocol):
    """What a backend reads adapters from: per (layer, module) row pools, and a version
    that changes whenever any row's contents change (loads, moves)."""

    weights_version: int

    def a_pool(self, layer: int, module: str) -> torch.Tensor: ...  # [R, in]

    def b_pool(self, layer: int, module: str) -> torch.Tensor: ...  # [R, out]

    # rows [first_row, first_row + rows) as rows of the embedding's width (lora/tokens.py)
    def token_slabs(self, first_row: int, rows: int) -> list[torch.Tensor]: ...


class TokenRowsStep(Protocol):
    """A step's adapters' own embedding rows (``engine/lora/tokens.StepTokens``)."""

    def replace_embeddings(self, rows: torch.Tensor) -> torch.Tensor: ...


class HeadRowsPass(Protocol):
    """An LM-head pass's adapters' own head rows (``engine/lora/tokens.HeadRows``)."""

    def apply(self, logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor: ...


class Collectives(Protocol):
    """What a shard needs of its ranks (``engine/parallel/group.py``)."""

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...


def _summed(x: torch.Tensor, ranks: Collectives | None) -> torch.Tensor:
    """A row-parallel output: the ranks' partial sums added (as it is with one rank)."""
    return x if ranks is None else ranks.all_reduce_(x)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        # The CPU's native row ops (kernels/rows_native.py) for long steps, where installed.
        self.native = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dim() == 2 and x.shape[0] >= NATIVE_MIN_ROWS:
            return self.native.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's: the weight is an offset from 1, and the product is taken in float32 before
    the cast (Llama casts first)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(config: ModelConfig, size: int) -> RMSNorm:
    norm = GemmaRMSNorm if config.gemma_norms else RMSNorm
    return norm(size, config.rms_norm_eps)


# Rows from which a float32 CPU step takes the native row ops (RMSNorm, SiLU times up) where
# installed (install_native_rows); fewer rows are torch's, whose dispatch is then the cost.
NATIVE_MIN_ROWS = 64

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _project(
    x: torch.Tensor,
    linears: tuple[nn.Module, ...],
    layer: int,
    modules: tuple[str, ...],
    lora: StepLoRA | None,
) -> list[torch.Tensor]:
    """``linear(x)`` of each projection of the group, plus its LoRA deltas. A projection is
    an ``nn.Linear`` or a ``QuantizedLinear`` (``model/quantized.py``); ``forward`` directly:
    no hooks are registered, and a step makes hundreds of these calls."""
    outs = [linear.forward(x) for linear in linears]
    if lora is not None:
        if lora.terms is not None:
            lora.terms.add(outs, [linear.bias for linear in linears], layer, modules)
        lora.add(x, outs, layer, modules)
    return outs


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale or config.head_dim**-0.5
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, config.q_size, bias=bias)
        self.k_proj = nn.Linear(h, config.kv_size, bias=bias)
        self.v_proj = nn.Linear(h, config.kv_size, bias=bias)
        self.o_proj = nn.Linear(config.q_size, h, bias=config.o_proj_bias)
        if config.qk_norm:  # Qwen3, Gemma 3: one RMSNorm over head_dim, shared by the heads
            self.q_norm = make_norm(config, config.head_dim)
            self.k_norm = make_norm(config, config.head_dim)
        self.qk_norm = config.qk_norm
        self.window = config.window_of(layer)  # a sliding window of keys, or None
        self.native = None  # the CPU's native row ops for long steps (RoPE), where installed
        self.ranks: Collectives | None = None  # set by LlamaForCausalLM.join

    def forward(self, x, cos, sin, attention: StepAttention, kv_cache, lora):
        tokens = x.shape[0]
        q, k, v = _project(x, (self.q_proj, self.k_proj, self.v_proj), self.layer, QKV, lora)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.native is not None and tokens >= NATIVE_MIN_ROWS:  # in place: fresh tensors
            q, k = self.native.rope_(q, cos, sin), self.native.rope_(k, cos, sin)
        else:
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, attention.new_token_slots)
        attn = attention.attend(q, k_cache, v_cache, self.scale, self.window)  # [T, H, D]
        out = _project(attn.reshape(tokens, -1), (self.o_proj,), self.layer, O_PROJ, lora)[0]
        return _summed(out, self.ranks)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.act = ACTIVATIONS[config.hidden_act]
        self.silu = config.hidden_act == "silu"
        self.native = None  # the CPU's native row ops for long steps, where installed
        self.ranks: Collectives | None = None  # set by LlamaForCausalLM.join

    def forward(self, x, lora):
        gate, up = _project(x, (self.gate_proj, self.up_proj), self.layer, GATE_UP, lora)
        if self.native is not None and self.silu and gate.shape[0] >= NATIVE_MIN_ROWS:
            hidden = self.native.silu_mul(gate, up)
        else:
            hidden = self.act(gate) * up
        out = _project(hidden, (self.down_proj,), self.layer, DOWN, lora)[0]
        return _summed(out, self.ranks)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer)
        if config.is_moe_layer(layer):
            self.mlp = MoEMLP(config, layer, ACTIVATIONS[config.hidden_act])
        else:
            self.mlp = LlamaMLP(config, layer)
        h = config.hidden_size
        self.input_layernorm = make_norm(config, h)
        # Llama's norm before the MLP; Gemma's after attention, with two around the MLP.
        self.post_attention_layernorm = make_norm(config, h)
        self.gemma_norms = config.gemma_norms
        if config.gemma_norms:
            self.pre_feedforward_layernorm = make_norm(config, h)
            self.post_feedforward_layernorm = make_norm(config, h)
        types = config.layer_types
        self.rope_kind = types[layer] if types else "full_attention"  # its RoPE tables

    def forward(self, x, cos, sin, attention, kv_cache, lora):
        attended = self.self_attn(self.input_layernorm(x), cos, sin, attention, kv_cache, lora)
        if not self.gemma_norms:
            x = x + attended
            return x + self.mlp(self.post_attention_layernorm(x), lora)  # (MoE: its experts')
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(
            self.mlp(self.pre_feedforward_layernorm(x), lora)
        )


def install_native_rows(model: nn.Module, native) -> None:
    """Hand the CPU's native row ops (``kernels/rows_native.NativeRows``) to the model's
    Llama norms, SiLU MLPs and attention's RoPE (not Gemma's norms, whose maths differs)."""
    for module in model.modules():
        if type(module) is RMSNorm or isinstance(module, LlamaMLP | LlamaAttention):
            module.native = native


# Fewer rows than this (but more than one) go through the LM head padded (compute_logits).
CPU_HEAD_MIN_ROWS = 4


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
        self.model.norm = make_norm(config, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary: dict[str, RotaryEmbedding] | None = None  # per layer kind (rope_kind)
        # One rank's shard (join): the ranks, its first token id and the whole vocabulary.
        self.ranks: Collectives | None = None
        self.vocab_start = 0
        self.vocab_size = config.vocab_size

    def join(self, ranks: Collectives, vocab_start: int, vocab_size: int) -> None:
        """Make this decoder one rank's shard of a model of ``vocab_size`` token ids whose
        range from ``vocab_start`` it holds (``engine/parallel/shard.py``)."""
        self.ranks, self.vocab_start, self.vocab_size = ranks, vocab_start, vocab_size
        for layer in self.model.layers:
            layer.self_attn.ranks = layer.mlp.ranks = ranks

    def projection(self, layer: int, module: str) -> nn.Module:
        """Layer ``layer``'s projection ``module`` (a name in LORA_TARGETS)."""
        block = self.model.layers[layer]
        return getattr(block.self_attn if module in QKV + O_PROJ else block.mlp, module)

    def embed(
        self, input_ids: torch.Tensor, tokens: TokenRowsStep | None = None
    ) -> torch.Tensor:  # [T, hidden]
        """The tokens' embeddings, adapters' own rows (``tokens``) in place of the base's."""
        if self.ranks is None:
            rows = self.model.embed_tokens(input_ids)
            if tokens is not None:
                rows = tokens.replace_embeddings(rows)
        else:
            # Vocabulary-parallel: this rank's rows for its ids, zeros for the others', summed.
            local = input_ids - self.vocab_start
            mine = (local >= 0) & (local < self.config.vocab_size)
            rows = self.model.embed_tokens(torch.where(mine, local, 0))
            if tokens is not None:  # only its own ids' rows
                rows = tokens.replace_embeddings(rows)
            rows = self.ranks.all_reduce_(torch.where(mine[:, None], rows, 0.0))
        scale = self.config.embed_scale
        if scale is None:
            return rows
        # Gemma: the scale rounded to the embeddings' dtype first, as transformers does.
        return rows * torch.tensor(scale, dtype=torch.float32).to(rows.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        attention: StepAttention,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer
        lora: StepLoRA | None = None,
        interrupt: Callable[[], None] | None = None,  # raises to abandon the step
        tokens: TokenRowsStep | None = None,  # adapters' own embedding rows
    ) -> torch.Tensor:  # hidden states [T, hidden]
        if self.rotary is None:
            kinds = {layer.rope_kind for layer in self.model.layers}
            self.rotary = {
                k: RotaryEmbedding(self.config.for_layer_kind(k), input_ids.device) for k in kinds
            }
        x = self.embed(input_ids, tokens)
        tables = {k: r.cos_sin(attention.positions, x.dtype) for k, r in self.rotary.items()}
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            if interrupt is not None:
                interrupt()  # between layers: see engine/step_interrupt.py
            x = layer(x, *tables[layer.rope_kind], attention, kv_cache, lora)
        return self.model.norm(x)

    def compute_logits(
        self, hidden: torch.Tensor, head: HeadRowsPass | None = None
    ) -> torch.Tensor:  # [N, vocab]
        """Logits of ``hidden``'s rows; ``head``: the adapters' own head rows among them."""
        logits = self._head(hidden)
        if head is not None:
            logits = head.apply(logits, hidden)
        if self.ranks is None:
            return logits
        # Vocabulary-parallel: every rank's range, in order, less the last one's padding.
        return torch.cat(self.ranks.all_gather(logits), dim=-1)[:, : self.vocab_size]

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        if hidden.device.type == "cpu" and 1 < rows < CPU_HEAD_MIN_ROWS:
            # Padded with zero rows: the CPU's BLAS multiplies 2 or 3 rows by the wide head
            # slower than 4 (SmolLM2's [49152, 576] head, one thread: 25 and 36 ms against
            # 17). Identical rows of one call still get identical logits.
            pad = hidden.new_zeros(CPU_HEAD_MIN_ROWS - rows, hidden.shape[1])
            return self.lm_head(torch.cat([hidden, pad]))[:rows]
        return self.lm_head(hidden)
