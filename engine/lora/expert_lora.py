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
fused projection's (``model/fused_modules.py``). A step adds, for the tokens an expert
serves, each of their adapters' ``s·(x A_eᵀ) B_eᵀ`` to that expert's gate, up and down
outputs: :class:`StepExpertLoRA` with torch ops per expert and adapter (the torch backend's
form), ``triton_backend.TritonStepExpertLoRA`` with the per-token shrink and expand kernels
over the expert's rank-rows of every adapter at once (one launch pair per expert and
projection group, whatever the adapters). Both are the multi-slice LoRA of
``kernels/lora.py`` over an expert's rows (:func:`expert_batch` builds that batch).

Under tensor parallelism an expert's gate and up are column-parallel and its down
row-parallel over its intermediate size, as a dense MLP's (``parallel/shard.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from loramux.engine.lora.adapter_config import AdapterConfig, AdapterError
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import LORA_TARGETS
from loramux.kernels.lora_batch import LoRABatch

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


@dataclass(frozen=True)
class ExpertAdapter:
    """A step adapter with LoRA on the experts."""

    index: int  # in the step's table
    first_row: int  # its first pool row (its rows are one contiguous run)
    rank: int  # each expert's
    scales: dict[str, float]  # per MLP module


def expert_adapters(table) -> list[ExpertAdapter]:
    """The step's adapters with LoRA on the experts (``LoRATable.expert_ranks``)."""
    slots = {m: LORA_TARGETS.index(m) for m in MLP_MODULES}
    firsts = table.first_rows()  # (checked consecutive: expert e's rows are first + e·r ..)
    return [
        ExpertAdapter(a, firsts[a], rank, {m: table.scales[s][a] for m, s in slots.items()})
        for a, rank in enumerate(table.expert_ranks or ())
        if rank
    ]


def token_owners(table, adapters: list[ExpertAdapter]) -> list[int]:
    """Each token's position in ``adapters``, -1 for a token whose adapter has none."""
    position = {adapter.index: i for i, adapter in enumerate(adapters)}
    owners = [-1] * table.num_tokens
    for start, end, adapter in table.spans:
        if adapter in position:
            owners[start:end] = [position[adapter]] * (end - start)
    return owners


def expert_batch(
    owners: torch.Tensor, tokens: torch.Tensor, adapters: list[ExpertAdapter], expert: int
) -> LoRABatch:
    """The multi-slice LoRA batch (``kernels/lora_batch.py``) of expert ``expert``'s
    ``tokens``: slices gate, up and down; adapter i's rows are its expert's rank-rows.
    ``owners``: each step token's position in ``adapters`` (:func:`token_owners`). Built on
    the host (the reference and the tests); the Triton form builds it on the device."""
    max_rank = max(adapter.rank for adapter in adapters)
    rows = torch.zeros(len(adapters), max_rank, dtype=torch.int32)
    for i, adapter in enumerate(adapters):
        first = adapter.first_row + expert * adapter.rank
        rows[i, : adapter.rank] = torch.arange(first, first + adapter.rank)
    device = owners.device
    return LoRABatch.per_token(
        owners.index_select(0, tokens).to(torch.int32),
        rows.to(device),
        torch.tensor([[a.rank for a in adapters]] * len(MLP_MODULES), dtype=torch.int32).to(device),
        torch.tensor([[a.scales[m] for a in adapters] for m in MLP_MODULES]).to(device),
    )


class StepExpertLoRA:
    """A step's adapters with LoRA on the experts: what each expert's projections gain
    for the tokens of those adapters (see the module doc); torch ops."""

    def __init__(self, owners: torch.Tensor, adapters: list[ExpertAdapter], pools):
        self.owners = owners  # [T] int64, each token's position in ``adapters``, or -1
        self.adapters = adapters
        self.pools = pools

    @classmethod
    def for_step(cls, table, pools, device: torch.device) -> StepExpertLoRA | None:
        adapters = expert_adapters(table)
        if not adapters:
            return None
        owners = torch.tensor(token_owners(table, adapters), dtype=torch.long)
        return cls(owners.to(device), adapters, pools)

    def add(self, x, outs, tokens, layer: int, expert: int, modules: tuple[str, ...]) -> None:
        """``outs`` (expert ``expert``'s outputs of ``modules`` for the step's ``tokens``,
        whose inputs are ``x``) plus their adapters' deltas."""
        owners = self.owners.index_select(0, tokens)
        a_pools, b_pools = expert_pools(self.pools, layer, modules, x, outs)
        for position, adapter in enumerate(self.adapters):
            rows = (owners == position).nonzero()[:, 0]
            if rows.numel() == 0:
                continue
            lo = adapter.first_row + expert * adapter.rank
            hi = lo + adapter.rank
            h = x.index_select(0, rows)
            for out, module, a, b in zip(outs, modules, a_pools, b_pools, strict=True):
                delta = (h @ a[lo:hi].T) @ b[lo:hi]
                out.index_add_(0, rows, delta * adapter.scales[module])


def expert_pools(pools, layer: int, modules, x: torch.Tensor, outs) -> tuple[list, list]:
    """The MLP slots' A and B pools of ``modules`` cut to an expert's widths (the slots are
    as wide as the dense MLP, which may be wider: the experts' rows fill their start)."""
    a_pools = [pools.a_pool(layer, m)[:, : x.shape[1]] for m in modules]
    b_pools = [
        pools.b_pool(layer, m)[:, : out.shape[1]] for m, out in zip(modules, outs, strict=True)
    ]
    return a_pools, b_pools
