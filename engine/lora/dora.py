"""DoRA adapters (PEFT's ``use_dora``), served as LoRA plus one rank-row.

For a projection with base weight ``W [out, in]``, bias ``b``, LoRA ``A``, ``B``, scale
``s`` and magnitude ``m [out]``, PEFT's DoRA layer computes

    g = m / ‖W + s·B A‖        (each output row's norm, over the inputs)
    y = W x + b + (g − 1) ⊙ W x + g ⊙ s·B A x

``g`` depends only on the adapter and the base weights, so it is computed once per adapter,
when its rows are written into device memory (:class:`DoRAFold`), never per step. It is then
folded in two places:

* ``B' = diag(g) B``: the LoRA kernels, unchanged, add ``g ⊙ s·B A x``;
* ``e = g − 1`` goes into one extra rank-row of the adapter (B's side; A's stays zero), and
  each projection adds ``e ⊙ W x`` for the tokens of DoRA adapters (``output_terms.py``)
  before the LoRA deltas; ``W x`` is the projection's output less its bias.

Modules and layers the adapter leaves alone keep ``e = 0`` (rows are zeroed before a write),
so the term adds exactly nothing there. The extra row is counted wherever an adapter's rows
are (``LoRAWeights.num_rows``): the pool's placement, the budget and the tiers.

Under tensor parallelism a rank holds a slice of each weight: of a column-parallel module
its output rows, whole, so their norms are its own; of a row-parallel one its input columns,
whose squared norms the ranks sum (one all-reduce per adapter written; every rank writes the
same adapters in the same order, ``parallel/commands.py``). The term is linear in ``W x``,
so each rank adds it to its partial output before the projection's all-reduce (the bias is
rank 0's alone, as the base output's).
"""

from __future__ import annotations

import dataclasses

import torch

from loramux.engine.lora.adapter import AdapterError, LoRAWeights
from loramux.engine.model.llama import LlamaForCausalLM
from loramux.engine.model.quantized import QuantizedLinear
from loramux.engine.parallel.shard import ROW_PARALLEL
from loramux.kernels.quant_linear import dequantize


def dense_weight(projection: torch.nn.Module) -> torch.Tensor:
    """A projection's ``W [out, in]`` in float32 (a quantized one de-quantized)."""
    if isinstance(projection, QuantizedLinear):
        return dequantize(projection.qweight).float()
    return projection.weight.float()


class DoRAFold:
    """A DoRA adapter's weights as the device serves them, from this device's base model
    (its shard, under tensor parallelism): B scaled by g and the excess ``g − 1`` per
    module and layer (see the module doc). Other adapters pass through unchanged."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model

    @torch.no_grad()
    def __call__(self, weights: LoRAWeights) -> LoRAWeights:
        if not weights.dora:
            return weights
        ranks = self.model.ranks
        squares = {}  # (module, layer) -> ‖W + s·B A‖² of each output row, this rank's part
        for module, mw in weights.modules.items():
            for layer in mw.magnitude:
                w = dense_weight(self.model.projection(layer, module))
                a = mw.a[layer].to(w.device, torch.float32)
                b = mw.b[layer].to(w.device, torch.float32)
                squares[(module, layer)] = (w + mw.scale * (b @ a)).pow(2).sum(dim=1)
        shared = [key for key in squares if ranks is not None and key[0] in ROW_PARALLEL]
        if shared:  # a row-parallel row's inputs are spread over the ranks: one sum for all
            summed = ranks.all_reduce_(torch.cat([squares[key] for key in shared]))
            sizes = [squares[k].numel() for k in shared]
            squares.update(zip(shared, summed.split(sizes), strict=True))
        modules = {}
        for module, mw in weights.modules.items():
            folded = dataclasses.replace(mw, b={}, dora_excess={})
            for layer, b in mw.b.items():
                norm = squares[(module, layer)].sqrt()
                if not bool((norm > 0).all()):
                    raise AdapterError(
                        f"layers.{layer}.{module}: a row of W + scale·BA has norm 0, so DoRA's "
                        "magnitude cannot scale it; this adapter does not fit this base model"
                    )
                gain = mw.magnitude[layer].to(norm.device, torch.float32) / norm
                folded.b[layer] = (gain[:, None] * b.to(gain.device, torch.float32)).to(b.dtype)
                folded.dora_excess[layer] = gain - 1
            modules[module] = folded
        return dataclasses.replace(weights, modules=modules)
