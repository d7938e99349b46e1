"""Composing adapters in one request: its parts and their weights, as the client asked.

Two ways to ask, to the same effect:

- the extension field ``adapters``: ``[{"name": "support", "weight": 0.7}, {"name":
  "acme/style@2", "weight": 0.3}]``, with ``model`` naming the base model;
- for clients that can set only ``model``: the parts joined by ``+``, each
  ``<adapter>*<weight>``: ``"support*0.7+acme/style@2*0.3"``.

Each part names an adapter as ``model`` does alone (``adapter_refs``: the caller's own or
one granted to it, a version by number or digest). The engine adds the parts' LoRA deltas,
each times its weight (``engine/lora/mix.py``): PEFT's ``add_weighted_adapter`` with
``combination_type="cat"``. A tenant whose name holds ``+`` or ``*`` cannot be named in the
``model`` form; the ``adapters`` field can name it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loramux.platform.errors import Invalid

MAX_ABS_WEIGHT = 100.0  # the engine's bound (engine/lora/mix.py)
MODEL_FORM = "`<adapter>*<weight>` parts joined by `+`, such as `support*0.7+style*0.3`"


@dataclass(frozen=True)
class MixPart:
    ref: str  # the adapter as ``model`` would name it alone
    weight: float


def _invalid(message: str) -> Invalid:
    return Invalid(message, code="invalid_adapters")


def parse_mixed_model(model: str) -> list[MixPart] | None:
    """The parts of a ``model`` that composes adapters (it holds a ``*``); None for any
    other ``model``. A 400 naming the form for a malformed one."""
    if "*" not in model:
        return None
    parts = []
    for term in model.split("+"):
        ref, star, weight = term.rpartition("*")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not star or not ref or not math.isfinite(value):
            raise _invalid(
                f"The model {model!r} composes adapters in a form this server does not read: "
                f"use {MODEL_FORM}, each weight a finite number."
            )
        parts.append(MixPart(ref, value))
    return parts


def check_parts(parts: list[MixPart], limit: int) -> None:
    """A 400 for a composition this server does not run: none, too many parts, or a
    weight beyond ``MAX_ABS_WEIGHT``."""
    if not parts:
        raise _invalid("`adapters` is empty: name at least one adapter, or leave it out.")
    if len(parts) > limit:
        raise _invalid(
            f"The request composes {len(parts)} adapters; this server composes at most "
            f"{limit} (LORAMUX_MAX_MIXED_ADAPTERS)."
        )
    for part in parts:
        if not abs(part.weight) <= MAX_ABS_WEIGHT:
            raise _invalid(
                f"Adapter {part.ref!r}'s weight {part.weight:g} is beyond ±{MAX_ABS_WEIGHT:g}."
            )
