"""LoRA on a mixture-of-experts model's experts (PEFT's ``target_parameters``).

PEFT trains it on the stacked expert weights (``mlp.experts.gate_up_proj [E, 2I, H]``,
``mlp.experts.down_proj [E, H, I]``, transformers' layout) with one A and one B per
parameter: ``A [r·E, in]`` holds expert e's ``A_e`` in rows ``e·r .. e·r + r - 1``; ``B
[out, r·E]`` holds its ``B_e`` in columns ``e, e + E, e + 2E, ...``; expert e's weight becomes
``W_e + s·B_e A_e`` (``s = lora_alpha / r``). Nested wrappers (``experts.base_layer.lora_A``
when both parameters are targeted) are told apart by their shapes.

On the device the experts' LoRA takes the adapter's rows of the MLP's own slots (``gate_proj``,
``up_proj``, ``down_proj``), which a routed layer's MLP never uses otherwise: ``r·E`` rows,
expert e's rank-rows at ``e·r``; gate_up's B split into gate's rows and up's, A shared, as a
fused projection's (``model/fused_modules.py``). A step (:class:`StepExpertLoRA`) adds, for
the tokens an expert serves, each of their adapters' ``s·(x A_eᵀ) B_eᵀ`` to that expert's
gate, up and down outputs (torch ops per expert and adapter: the reference form).

Under tensor parallelism an expert's gate and up are column-parallel and its down
row-parallel over its intermediate size, as a dense MLP's (``parallel/shard.py``).
"""

from __future__ import annotations

import re

import torch

from loramux.engine.lora.adapter_config import AdapterConfig, AdapterError
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import LORA_TARGETS

# base_model.model.model.layers.3.mlp.experts[.base_layer]*.lora_A[.default].weight
_EXPERT_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)*)"
    r"lora_([AB])(?:\.[\w-]+)?\.weight$"
)
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


def parse_expert_tensor_name(name: str) -> tuple[int, int, str] | None:
    """(layer, wrapper depth, "A" or "B") of an expert LoRA tensor; None for other names."""
    match = _EXPERT_KEY.match(name)
    if match is None:
        return None
    return int(match[1]), match[2].count("base_layer."), match[3]


def expert_modules(
    tensors: dict[tuple[int, int, str], torch.Tensor],
    config: AdapterConfig,
    model: ModelConfig,
    dtype: torch.dtype,
    device,
    check_values,
) -> dict[str, tuple[int, float, dict[int, torch.Tensor], dict[int, torch.Tensor]]]:
    """The MLP slots' (rank r·E, scale, A per layer, B per layer) of the experts' LoRA
    (see the module doc); ``check_values(key, a, b, scale, dtype)`` checks each pair."""
    experts, inter, hidden = model.num_experts, model.expert_intermediate_size, model.hidden_size
    slots: dict[str, tuple[int, float, dict, dict]] = {}
    for layer, depth in sorted({(layer, depth) for layer, depth, _ in tensors}):
        key = f"layers.{layer}.mlp.experts"
        if not model.is_moe_layer(layer):
            raise AdapterError(f"{key}: layer {layer} of the base model has no experts")
        if (layer, depth, "A") not in tensors or (layer, depth, "B") not in tensors:
            raise AdapterError(f"{key} has a lora_A without its lora_B, or the reverse")
        a, b = tensors[(layer, depth, "A")], tensors[(layer, depth, "B")]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] % experts or b.shape[1] != a.shape[0]:
            raise AdapterError(
                f"{key}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not the "
                f"[r·{experts}, in] and [out, r·{experts}] of LoRA on {experts} experts"
            )
        if b.shape[0] == 2 * inter and a.shape[1] == hidden:
            parameter, parts = "gate_up_proj", (("gate_proj", 0), ("up_proj", inter))
        elif b.shape[0] == hidden and a.shape[1] == inter:
            parameter, parts = "down_proj", (("down_proj", 0),)
        else:
            raise AdapterError(
                f"{key}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} fit neither "
                f"gate_up_proj [{2 * inter}, {hidden}] nor down_proj [{hidden}, {inter}]"
            )
        rank = a.shape[0] // experts
        scale = config.scale_for(f"model.layers.{layer}.mlp.experts", rank)
        check_values(f"{key}.{parameter}", a, b, scale, dtype)
        # B's columns expert-major: column e·r + i is expert e's i-th
        b = b.reshape(b.shape[0], rank, experts).permute(0, 2, 1).reshape(b.shape[0], -1)
        a = a.to(device=device, dtype=dtype)
        for module, first in parts:
            rows = b[first : first + (hidden if module == "down_proj" else inter)]
            total, old_scale, a_of, b_of = slots.setdefault(module, (rank * experts, scale, {}, {}))
            if (total, old_scale) != (rank * experts, scale) or layer in a_of:
                raise AdapterError(
                    f"{key}: experts' ranks or alphas that differ between layers are not supported"
                )
            # (narrower than the slot where the dense MLP is wider: written into its start)
            a_of[layer] = a
            b_of[layer] = rows.to(device=device, dtype=dtype).contiguous()
    return slots


class StepExpertLoRA:
    """A step's adapters with LoRA on the experts: what each expert's projections gain
    for the tokens of those adapters (see the module doc)."""

    def __init__(self, adapter_of: torch.Tensor, adapters, pools):
        self.adapter_of = adapter_of  # [T] int64, each token's adapter index, -1 for none
        self.adapters = adapters  # (index, first row, rank per expert, scales per module)
        self.pools = pools

    @classmethod
    def for_step(cls, table, pools, device: torch.device) -> StepExpertLoRA | None:
        ranks = table.expert_ranks
        if ranks is None:
            return None
        adapter_of = [-1] * table.num_tokens
        for start, end, adapter in table.spans:
            if adapter is not None and ranks[adapter]:
                adapter_of[start:end] = [adapter] * (end - start)
        slots = {m: LORA_TARGETS.index(m) for m in MLP_MODULES}
        adapters = [
            (a, table.adapter_rows[a][0], rank, {m: table.scales[s][a] for m, s in slots.items()})
            for a, rank in enumerate(ranks)
            if rank
        ]
        return cls(torch.tensor(adapter_of, dtype=torch.long).to(device), adapters, pools)

    def add(self, x, outs, tokens, layer: int, expert: int, modules: tuple[str, ...]) -> None:
        """``outs`` (expert ``expert``'s outputs of ``modules`` for the step's ``tokens``,
        whose inputs are ``x``) plus their adapters' deltas."""
        owners = self.adapter_of.index_select(0, tokens)
        for adapter, first_row, rank, scales in self.adapters:
            rows = (owners == adapter).nonzero()[:, 0]
            if rows.numel() == 0:
                continue
            lo = first_row + expert * rank
            h = x.index_select(0, rows)
            for out, module in zip(outs, modules, strict=True):
                a = self.pools.a_pool(layer, module)[lo : lo + rank, : x.shape[1]]
                b = self.pools.b_pool(layer, module)[lo : lo + rank, : out.shape[1]]
                out.index_add_(0, rows, ((h @ a.T) @ b) * scales[module])
