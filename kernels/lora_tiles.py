"""Launch tiles of the Triton LoRA kernels, chosen per phase from one table.

Decode (a few tokens, each maybe its own adapter) and prefill (thousands of tokens in a
few long segments) want different tiles: decode is a handful of rank-wide dot products
per token, bound by reading the adapters' rows, so its tiles are wide in ``in`` (few
sequential loop steps per program) and its grid is widened by splitting the output
columns (``target_programs``); prefill is two matmuls per segment, tiled for ``tl.dot``.

``lora_tiles.json`` maps a device name (``torch.cuda.get_device_name``) to its tiles;
"default" serves any other device and Triton's CPU interpreter. The table is data,
written by the tuning run of ``loramux.benchmarks.kernels_gpu.tune`` on the
device and committed; nothing is autotuned when the engine starts, so a step's launches
(and a CUDA graph's) are the same on every run. Each entry says where it came from.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True)
class FusedTiles:
    """Tiles of a fused shrink+expand launch (``lora_triton_fused``).

    One program computes a token's (or a segment tile's) rank-wide intermediate over
    ``in`` in steps of ``block_k``, then adds it into ``tiles_per_split × block_n`` of a
    slice's output columns. The columns of each slice are split so the grid has about
    ``target_programs`` programs (each split recomputes the small shrink, from L2).
    ``rank_budget`` caps ``block_r × block_k`` and ``block_r × block_n`` (fp32 registers
    per program) so large ranks shrink the other tile instead of spilling.
    """

    block_k: int
    block_n: int
    target_programs: int
    num_warps: int
    rank_budget: int = 8192
    block_m: int = 16  # tokens per tile in the segment form (tl.dot needs ≥ 16)

    def __post_init__(self) -> None:
        for name in ("block_k", "block_n", "rank_budget", "block_m"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two ≥ 16, got {value}")
        if self.target_programs < 1 or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError("target_programs ≥ 1 and num_warps a power of two ≤ 16")


@dataclass(frozen=True)
class PhaseTiles:
    """Which form a step's LoRA takes, and the tiles of each.

    A step of at most ``fused_max_tokens`` tokens (decode, and small mixed steps) runs one
    fused launch per projection group: per token when every segment is one token, per
    segment tile otherwise. Larger steps (prefill) run a shrink and an expand launch per
    group, SGMV-tiled with ``prefill_block_m`` tokens.
    """

    decode: FusedTiles
    segments: FusedTiles
    fused_max_tokens: int
    prefill_block_m: int = 64
    source: str = ""  # where these tiles came from (a tuning run, or why untuned)

    def __post_init__(self) -> None:
        if self.fused_max_tokens < 1:
            raise ValueError("fused_max_tokens must be ≥ 1")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> PhaseTiles:
        return cls(
            decode=FusedTiles(**data["decode"]),
            segments=FusedTiles(**data["segments"]),
            fused_max_tokens=data["fused_max_tokens"],
            prefill_block_m=data.get("prefill_block_m", 64),
            source=data.get("source", ""),
        )


TILES_FILE = "lora_tiles.json"


@functools.lru_cache(maxsize=1)
def _table() -> dict[str, PhaseTiles]:
    text = resources.files("loramux.kernels").joinpath(TILES_FILE).read_text()
    return {name: PhaseTiles.from_json(entry) for name, entry in json.loads(text).items()}


def tiles_for(device_name: str | None) -> PhaseTiles:
    """The table's tiles for ``device_name``, else its "default" entry."""
    table = _table()
    return table.get(device_name or "default", table["default"])
