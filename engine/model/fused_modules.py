"""Projections a family's checkpoint holds fused (Phi-3's ``qkv_proj`` and
``gate_up_proj``), split into the decoder's own as they load.

The decoder keeps q, k, v, gate and up as separate projections whatever the family, so
every kernel, shard and adapter slot works on them unchanged. A fused weight ``W [Σ n_p,
in]`` stacks its parts' rows in order (``ModelConfig.fused_modules``): part p is rows
``[Σ_{q<p} n_q, Σ_{q≤p} n_q)``. A LoRA adapter on the fused module, ``B A`` with ``A [r,
in]`` and ``B [Σ n_p, r]``, is the same on each part with ``A`` and that part's rows of
``B``: ``x Aᵀ B_pᵀ`` is the fused output's slice p.
"""

from __future__ import annotations

import torch

from loramux.engine.model.config import ModelConfig
from loramux.engine.model.moe import decoder_name


def split_rows(
    config: ModelConfig, fused: str, tensor: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """(part, its rows of ``tensor``) for each part of the fused module ``fused``; a
    ValueError naming the module when the rows are not the parts' widths."""
    parts = config.fused_modules[fused]
    widths = [config.module_shape(p)[1] for p in parts]
    if tensor.ndim < 1 or tensor.shape[0] != sum(widths):
        raise ValueError(
            f"{fused} has {tensor.shape[0] if tensor.ndim else 0} output rows; the config "
            f"implies {sum(widths)} ({' + '.join(f'{p} {w}' for p, w in zip(parts, widths, strict=True))})"
        )
    return list(zip(parts, tensor.split(widths, dim=0), strict=True))


def split_checkpoint_tensor(
    config: ModelConfig, name: str, tensor: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """``[(name, tensor)]`` for an ordinary tensor; a fused projection's weight or bias
    (``model.layers.3.self_attn.qkv_proj.weight``) as its parts' (``...q_proj.weight``,
    ...)."""
    name = decoder_name(config, name)  # Mixtral's experts under the decoder's names
    *prefix, module, kind = name.split(".")
    if module not in config.fused_modules:
        return [(name, tensor)]
    return [
        (".".join([*prefix, part, kind]), rows) for part, rows in split_rows(config, module, tensor)
    ]
