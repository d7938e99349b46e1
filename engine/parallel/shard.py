"""How a tensor-parallel engine splits the base model and each adapter over its ranks.

Megatron's partitioning of a Llama layer over N ranks (each rank one device):

* q/k/v and gate/up are *column-parallel*: a rank holds its slice of the output features
  (its attention heads; its part of the FFN's intermediate dimension) and computes them
  from the whole hidden state, so attention and SwiGLU run per rank with no communication.
* o_proj and down_proj are *row-parallel*: a rank holds the input features its column-
  parallel partner produced and computes a partial sum of the whole output; one
  all-reduce per projection adds the ranks' partials (two per layer). A row-parallel bias
  is added by rank 0 only, so the sum counts it once.
* A mixture-of-experts MLP (``model/moe.py``): every expert as a dense MLP (its slice of
  its intermediate size), the router whole on every rank.
* The embedding and the LM head are split over the vocabulary: a rank looks up (or scores)
  only its range of token ids, the embedding's partials are summed (the other ranks
  contribute zeros), and the head's logits are gathered for sampling.

KV heads follow the query heads they serve. When ``N`` does not divide the number of KV
heads, each KV head is *replicated*: repeated ``c`` times (``c = N / gcd(kv_heads, N)``, as
if the model had ``c·kv_heads`` KV heads, each of its queries' groups split ``c`` ways)
so that the copies split evenly; a rank then holds the copies its query heads read.
``c`` always divides the query group once ``N`` divides the query heads (with
``g = gcd(kv_heads, N)``, ``N = g·c`` and ``c`` coprime to ``kv_heads / g``, ``N | heads =
kv_heads · group`` leaves ``c | group``), so that is the only condition.

Adapters follow the base weights (S-LoRA's partitioning, its Section 5): with
``y = x W^T + s · (x A^T) B^T``,

* column-parallel modules: a rank holds all of A (its input, the hidden state, is whole
  on every rank) and its output slice of B (the same rows as its slice of W). The
  shrink ``x A^T`` is computed on every rank (``[T, r]``, tiny) and the expand gives the
  rank's own output features: **no collective**.
* row-parallel modules: a rank holds its input slice of A (the columns of W it holds) and
  all of B. Its partial shrink ``x_k A_k^T`` sums over ranks to ``x A^T``, and because the
  expand is linear, ``Σ_k (x_k A_k^T) B^T = (x A^T) B^T``: each rank adds its partial
  delta to its partial base output *before* the projection's all-reduce, which then sums
  both. **No collective of its own** either (S-LoRA gathers the shrink's output instead;
  riding the base all-reduce saves that gather).

So the LoRA kernels run unchanged on every rank over per-rank pools whose shapes come from
:meth:`ShardPlan.local_config`, and an adapter costs no communication beyond the base
model's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from loramux.engine.lora.adapter import LoRAWeights, ModuleWeights
from loramux.engine.model.config import ModelConfig

__all__ = ["ShardPlan", "TensorParallelError"]

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


class TensorParallelError(ValueError):
    """The model cannot be split over this many ranks; the message says why."""


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank``'s share of ``config`` over ``world_size`` ranks (see the module doc)."""

    config: ModelConfig  # the whole model's
    world_size: int
    rank: int

    def __post_init__(self) -> None:
        n, c = self.world_size, self.config
        if n < 1 or not 0 <= self.rank < n:
            raise TensorParallelError(f"rank {self.rank} of {n} ranks")
        if c.num_heads % n:
            raise TensorParallelError(
                f"tensor_parallel_size={n} must divide the model's {c.num_heads} attention heads"
            )
        if c.intermediate_size % n:
            raise TensorParallelError(
                f"tensor_parallel_size={n} must divide the model's intermediate size "
                f"{c.intermediate_size}"
            )
        if c.expert_intermediate_size % n:
            raise TensorParallelError(
                f"tensor_parallel_size={n} must divide the experts' intermediate size "
                f"{c.expert_intermediate_size}"
            )

    # --- sizes -----------------------------------------------------------------
    @property
    def kv_copies(self) -> int:
        """How many times each KV head is repeated (1: the heads split evenly)."""
        return self.world_size // math.gcd(self.config.num_kv_heads, self.world_size)

    @property
    def local_heads(self) -> int:
        return self.config.num_heads // self.world_size

    @property
    def local_kv_heads(self) -> int:
        return self.config.num_kv_heads * self.kv_copies // self.world_size

    @property
    def local_intermediate(self) -> int:
        return self.config.intermediate_size // self.world_size

    @property
    def local_vocab(self) -> int:
        """Token ids per rank (the last rank's range is padded when N does not divide)."""
        return -(-self.config.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.local_vocab

    def local_config(self) -> ModelConfig:
        """The model this rank holds: what its decoder, KV cache and adapter pools are
        built from (the hidden size, layers and head size are every rank's)."""
        return dataclasses.replace(
            self.config,
            vocab_size=self.local_vocab,
            intermediate_size=self.local_intermediate,
            num_heads=self.local_heads,
            num_kv_heads=self.local_kv_heads,
            expert_intermediate_size=self.config.expert_intermediate_size // self.world_size,
        )

    # --- which features a rank holds -------------------------------------------
    def _head_features(self, heads: torch.Tensor) -> torch.Tensor:
        """The feature indices of ``heads`` (each ``head_dim`` wide)."""
        d = self.config.head_dim
        return (heads[:, None] * d + torch.arange(d)).reshape(-1)

    def _q_features(self) -> torch.Tensor:
        first = self.rank * self.local_heads
        return self._head_features(torch.arange(first, first + self.local_heads))

    def _kv_features(self) -> torch.Tensor:
        # Copy e of the repeated heads is head e // kv_copies.
        first = self.rank * self.local_kv_heads
        copies = torch.arange(first, first + self.local_kv_heads)
        return self._head_features(copies // self.kv_copies)

    def _ffn_features(self) -> torch.Tensor:
        first = self.rank * self.local_intermediate
        return torch.arange(first, first + self.local_intermediate)

    def out_features(self, module: str) -> torch.Tensor | None:
        """The output features of ``module`` this rank holds (None: all of them)."""
        return {
            "q_proj": self._q_features,
            "k_proj": self._kv_features,
            "v_proj": self._kv_features,
            "gate_proj": self._ffn_features,
            "up_proj": self._ffn_features,
        }.get(module, lambda: None)()

    def in_features(self, module: str) -> torch.Tensor | None:
        """The input features of ``module`` this rank holds (None: all of them)."""
        if module == "o_proj":
            return self._q_features()
        if module == "down_proj":
            return self._ffn_features()
        return None

    # --- slicing ---------------------------------------------------------------
    def shard_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor ``name`` (HF names), whole model's
        shape in, ``local_config``'s shape out. Norms are every rank's."""
        if self.world_size == 1:
            return tensor
        if name in VOCAB_PARALLEL:
            return self._vocab_rows(tensor)
        *_, module, kind = name.split(".")  # model.layers.3.self_attn.q_proj.weight
        out, inp = self.out_features(module), self.in_features(module)
        if ".experts." in name:  # an expert's MLP: its slice of the expert's intermediate size
            local = self.config.expert_intermediate_size // self.world_size
            features = torch.arange(self.rank * local, (self.rank + 1) * local)
            out, inp = (None, features) if module == "down_proj" else (features, None)
        if kind == "bias":
            if module in ROW_PARALLEL:  # added once, by rank 0, to the summed output
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            return tensor if out is None else tensor.index_select(0, out)
        if out is not None:
            tensor = tensor.index_select(0, out)
        if inp is not None:
            tensor = tensor.index_select(1, inp)
        return tensor

    def _vocab_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        start = self.vocab_start
        rows = tensor[start : start + self.local_vocab]
        if rows.shape[0] < self.local_vocab:  # the last rank's padding: never sampled
            pad = rows.new_zeros(self.local_vocab - rows.shape[0], *rows.shape[1:])
            rows = torch.cat([rows, pad])
        return rows

    def _expert_features(self) -> torch.Tensor:
        local = self.config.expert_intermediate_size // self.world_size
        return torch.arange(self.rank * local, (self.rank + 1) * local)

    def _routed(self, module: str, layer: int | None) -> bool:
        """Whether ``module`` of ``layer`` is an expert's (a routed layer's MLP slots)."""
        return (
            layer is not None
            and self.config.is_moe_layer(layer)
            and module in ("gate_proj", "up_proj", "down_proj")
        )

    def shard_lora_a(self, module: str, a: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """This rank's part of a LoRA A (``[r, in]``): its input slice when row-parallel (of
        an expert's intermediate size in a routed layer)."""
        if self.world_size == 1:
            return a
        inp = self.in_features(module)
        if self._routed(module, layer):
            inp = self._expert_features() if module == "down_proj" else None
        return a if inp is None else a.index_select(1, inp)

    def shard_lora_b(self, module: str, b: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """This rank's part of a LoRA B (``[out, r]``), or of anything else indexed by the
        output features first: its output slice when column-parallel (of an expert's
        intermediate size in a routed layer)."""
        if self.world_size == 1:
            return b
        out = self.out_features(module)
        if self._routed(module, layer):
            out = None if module == "down_proj" else self._expert_features()
        return b if out is None else b.index_select(0, out)

    def shard_lora_bias(self, module: str, bias: torch.Tensor) -> torch.Tensor:
        """This rank's part of a LoRA B's bias: its output slice when column-parallel; a
        row-parallel one is added once, by rank 0 (as the base bias is)."""
        if module in ROW_PARALLEL and self.world_size > 1:
            return bias if self.rank == 0 else torch.zeros_like(bias)
        return self.shard_lora_b(module, bias)

    def shard_adapter(self, weights: LoRAWeights) -> LoRAWeights:
        """This rank's part of every module of an adapter (A and B as PEFT stores them)."""
        if self.world_size == 1:
            return weights
        modules = {
            module: ModuleWeights(
                rank=mw.rank,
                scale=mw.scale,
                a={layer: self.shard_lora_a(module, a, layer) for layer, a in mw.a.items()},
                b={layer: self.shard_lora_b(module, b, layer) for layer, b in mw.b.items()},
                # DoRA's magnitude is per output feature, as B's rows are
                magnitude={
                    layer: self.shard_lora_b(module, m) for layer, m in mw.magnitude.items()
                },
                bias={layer: self.shard_lora_bias(module, b) for layer, b in mw.bias.items()},
            )
            for module, mw in weights.modules.items()
        }
        # The embedding's and head's rows: every rank keeps them all, and replaces only the
        # tokens of its vocabulary range (engine/lora/tokens.py)
        return dataclasses.replace(weights, modules=modules)
