"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks ``k`` experts per token.

As transformers computes it: the router's logits ``x Wᵣᵀ`` (in the activations' dtype),
their softmax in float32, the ``k`` largest probabilities and their experts, those weights
renormalized to sum to 1 where the family does (Mixtral always, Qwen3-MoE under
``norm_topk_prob``) and kept in float32 (Mixtral) or cast back (Qwen3-MoE). Each expert is
a SwiGLU MLP of its own; a token's output is the sum over its experts, in expert order, of
weight × expert(x): the same sums in the same order as transformers' loop, so the routing
and the outputs are transformers' own.

Under tensor parallelism each rank holds every expert's slice of the intermediate
dimension (gate and up column-parallel, down row-parallel, as a dense MLP) and the router
whole: every rank routes alike, and the experts' partial outputs are summed over the ranks
with the layer's one all-reduce.

LoRA applies to the attention projections of such a layer and to its experts
(``lora/expert_lora.py``: each expert's gate, up and down outputs gain their adapters'
deltas for the tokens the expert serves).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from loramux.engine.model.config import ModelConfig

# Mixtral's checkpoint names its experts' projections w1 (gate), w3 (up) and w2 (down), under
# block_sparse_moe; the decoder's are Qwen3-MoE's (mlp.experts.E.gate_proj, mlp.gate).
_MIXTRAL = re.compile(
    r"^(model\.layers\.\d+\.)block_sparse_moe\.(gate\.weight|experts\.\d+\.)(w[123])?"
)
_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def decoder_name(config: ModelConfig, name: str) -> str:
    """The decoder's name for checkpoint tensor ``name`` (a Mixtral expert's renamed)."""
    if config.model_type != "mixtral":
        return name
    match = _MIXTRAL.match(name)
    if match is None:
        return name
    prefix, part, projection = match[1], match[2], match[3]
    rest = name[match.end() :]
    if projection is None:
        return f"{prefix}mlp.{part}{rest}"
    return f"{prefix}mlp.{part}{_MIXTRAL_PROJECTIONS[projection]}{rest}"


class Expert(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


class MoEMLP(nn.Module):
    """The routed MLP of one layer (see the module doc), in place of a dense one."""

    def __init__(self, config: ModelConfig, layer: int, activation):
        super().__init__()
        self.layer = layer
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            Expert(config.hidden_size, config.expert_intermediate_size)
            for _ in range(config.num_experts)
        )
        self.top_k = config.experts_per_token
        self.normalize = config.normalize_expert_weights
        self.weights_in_float32 = config.expert_weights_in_float32
        self.act = activation
        self.ranks = None  # set by LlamaForCausalLM.join: the experts' partial sums are added

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], experts [T, k]) of each token, as transformers routes it."""
        logits = self.gate(x)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_in_float32:
            weights = weights.to(logits.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """``lora``: the step's adapters, whose LoRA on the experts (``lora.experts``,
        ``engine/lora/expert_lora.py``) each expert adds for its tokens."""
        adapters = None if lora is None else lora.experts
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        for expert in torch.unique(experts).tolist():  # ascending, as transformers' loop
            tokens, slot = torch.where(experts == expert)
            module = self.experts[expert]
            h = x.index_select(0, tokens)
            gate, up = module.gate_proj(h), module.up_proj(h)
            if adapters is not None:
                adapters.add(h, [gate, up], tokens, self.layer, expert, ("gate_proj", "up_proj"))
            h = self.act(gate) * up
            down = module.down_proj(h)
            if adapters is not None:
                adapters.add(h, [down], tokens, self.layer, expert, ("down_proj",))
            out.index_add_(0, tokens, (down * weights[tokens, slot, None]).to(out.dtype))
        return out if self.ranks is None else self.ranks.all_reduce_(out)
