"""Several adapters on one request: a weighted sum of their LoRA deltas.

A request composed of adapters ``a_1 .. a_n`` with weights ``w_1 .. w_n`` computes, on every
target module,

    y = W x + Σ_i w_i · c_i · B_i (A_i x)

(``c_i`` the adapter's own scaling), the same sum PEFT's ``add_weighted_adapter(...,
combination_type="cat")`` builds into one adapter of rank ``Σ r_i``; here nothing is
merged or copied: each part reads its own pool rows.

A step runs it through the same batched LoRA ops as every other request, in *passes*: the
step's table gets one entry per (adapter, weight) used, its scales multiplied by the
weight, and pass ``k`` gives each mixed request's tokens its ``k``-th part (the first pass
also carries every plain request). A step without mixes is one pass, as before.
:class:`SummedStepLoRA` adds the passes' deltas together.

Only plain LoRA mixes: DoRA, LoRA biases, an adapter's own embedding or head rows and LoRA
on a mixture's experts are not weighted sums of deltas (``not_mixable`` says which).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from loramux.engine.lora.adapter import LoRARequest

MixKey = tuple[tuple[int, float], ...]  # ((adapter id, weight), ...): a step span's key
# A step's rows [start, end) and what they use: an adapter id, a mix's key, or None.
AdapterSpans = list[tuple[int, int, int | MixKey | None]]
MAX_ABS_WEIGHT = 100.0


@dataclass(frozen=True)
class LoRAMix:
    """The adapters a request composes, each with its weight, in the order given."""

    parts: tuple[tuple[LoRARequest, float], ...]

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("a mix needs at least one adapter")
        names = [lora.name for lora, _ in self.parts]
        if len(set(names)) != len(names):
            raise ValueError(f"a mix names an adapter twice: {names}")
        for lora, weight in self.parts:
            if not (math.isfinite(weight) and abs(weight) <= MAX_ABS_WEIGHT):
                raise ValueError(
                    f"adapter {lora.name!r}'s weight {weight} is not a finite number within "
                    f"±{MAX_ABS_WEIGHT:g}"
                )

    # Read every step for each request that uses the mix: made once.
    @functools.cached_property
    def adapters(self) -> tuple[LoRARequest, ...]:
        return tuple(lora for lora, _ in self.parts)

    @functools.cached_property
    def key(self) -> MixKey:
        """What the step's spans and speculation know it by."""
        return tuple((lora.adapter_id, weight) for lora, weight in self.parts)

    @functools.cached_property
    def salt(self) -> tuple:
        """Its key as the prefix cache hashes it (each weight exactly, as hex)."""
        return tuple((lora.adapter_id, float(weight).hex()) for lora, weight in self.parts)

    @property
    def label(self) -> str:
        return "+".join(f"{lora.name}*{weight:g}" for lora, weight in self.parts)


def adapter_ids_of(key: int | MixKey) -> tuple[int, ...]:
    """The adapter ids a span's key uses."""
    return tuple(adapter_id for adapter_id, _ in key) if isinstance(key, tuple) else (key,)


def not_mixable(resident) -> str | None:
    """Why a resident adapter (``pool.ResidentAdapter``) cannot be part of a mix, if not."""
    if resident.dora_offset is not None:
        return "it is a DoRA adapter"
    if resident.bias_offset is not None:
        return "it has LoRA biases (lora_bias)"
    if resident.token_rows:
        return "it replaces rows of the embedding or the LM head"
    if resident.expert_rank:
        return "it has LoRA on a mixture's experts"
    return None


def split_passes(
    spans: AdapterSpans,
) -> tuple[list[tuple[int, float]], list[list[tuple[int, int, int | None]]]]:
    """The step's table entries, (adapter id, weight) each, and its passes' spans over
    indices into them: pass 0 has every plain span's adapter (weight 1) and each mix's first
    part, pass ``k`` each mix's ``k``-th part; a span without a part in a pass has None."""
    entries: dict[tuple[int, float], int] = {}
    num_passes = max((len(key) for _, _, key in spans if isinstance(key, tuple)), default=1)
    passes: list[list[tuple[int, int, int | None]]] = [[] for _ in range(num_passes)]
    for start, end, key in spans:
        if key is None:
            parts: MixKey = ()
        elif isinstance(key, tuple):
            parts = key
        else:
            parts = ((key, 1.0),)
        for k in range(num_passes):
            index = entries.setdefault(parts[k], len(entries)) if k < len(parts) else None
            passes[k].append((start, end, index))
    return list(entries), passes


class SummedStepLoRA:
    """A step's LoRA over several passes: each pass's delta added to the outputs in turn.
    The first pass carries the step's DoRA and bias terms and experts (the mixes' parts,
    in any pass, have none)."""

    def __init__(self, first, more: list):
        self._first, self._more = first, more

    @property
    def launches(self) -> int:
        return self._first.launches + sum(step.launches for step in self._more)

    @property
    def terms(self):
        return self._first.terms

    @property
    def experts(self):
        return self._first.experts

    def add(
        self, x: torch.Tensor, outs: list[torch.Tensor], layer: int, modules: tuple[str, ...]
    ) -> None:
        self._first.add(x, outs, layer, modules)
        for step in self._more:
            step.add(x, outs, layer, modules)
