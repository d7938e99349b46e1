"""What rank 0 tells the other ranks to do, and how a rank does it.

Rank 0 owns the scheduler, the KV manager, the adapter pool's decisions and the sampler;
the other ranks own only device state: their shard of the weights and their shard of the
arena (KV blocks and adapter rows). So every change rank 0 makes to its arena, and every
forward it runs, is sent first as one of these commands and then done on rank 0 too: all
ranks' arenas go through the same changes in the same order, and all ranks enter the
model's collectives together. Commands travel pickled over the control group; they come
only from rank 0, a process of the same engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loramux.engine.lora.adapter import LoRAWeights
from loramux.engine.step_batch import ForwardInputs

if TYPE_CHECKING:
    from loramux.engine.parallel.worker import RankWorker


class Command:
    def apply(self, rank: RankWorker) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class BuildArena(Command):
    """Rank 0 sized its arena (from its budget); every rank's is the same size."""

    num_blocks: int
    scratch_blocks: int

    def apply(self, rank: RankWorker) -> None:
        rank.build_arena(self.num_blocks, self.scratch_blocks)


@dataclass(frozen=True)
class WriteAdapter(Command):
    """The whole adapter: each rank keeps its own part (``ShardPlan.shard_adapter``)."""

    start: int
    weights: LoRAWeights

    def apply(self, rank: RankWorker) -> None:
        rank.arena.write_adapter(self.start, rank.plan.shard_adapter(self.weights))
        rank.weights_version += 1


@dataclass(frozen=True)
class ZeroRows(Command):
    start: int
    end: int

    def apply(self, rank: RankWorker) -> None:
        rank.arena.zero_rows(self.start, self.end)
        rank.weights_version += 1


@dataclass(frozen=True)
class MoveRows(Command):
    src: int
    dst: int
    count: int

    def apply(self, rank: RankWorker) -> None:
        rank.arena.move_rows(self.src, self.dst, self.count)
        rank.weights_version += 1


@dataclass(frozen=True)
class CopyKVBlocks(Command):
    moves: list[tuple[int, int]]

    def apply(self, rank: RankWorker) -> None:
        rank.copy_kv_blocks(self.moves)


@dataclass(frozen=True)
class RunStep(Command):
    """One forward over the arena's KV cache, then the LM-head passes rank 0 makes. With
    ``static`` the step is decode-only and runs over the static buffers (each rank replays
    its graph of the same bucket), as rank 0's does."""

    inputs: ForwardInputs
    static: bool

    def apply(self, rank: RankWorker) -> None:
        tokens = rank.step_tokens(self.inputs)
        hidden = rank.forward(self.inputs, static=self.static, tokens=tokens)
        head_passes(rank, hidden, self.inputs.head_rows, tokens)


@dataclass(frozen=True)
class BuildStaticDecode(Command):
    """Rank 0 built its static decode path (``engine/static_decode.py``): every rank builds
    its own over its shard, at the same buckets. With ``capture`` (CUDA) the ranks capture
    their graphs now, together: each warm-up and captured forward enters the same
    all-reduces in the same order on every rank."""

    max_context_len: int
    buckets: list[int]
    max_rank: int
    capture: bool

    def apply(self, rank: RankWorker) -> None:
        rank.build_static_decode(self.max_context_len, self.buckets, self.max_rank, self.capture)


def head_passes(rank: RankWorker, hidden: torch.Tensor, head_rows: list[list[int]], tokens) -> None:
    """Rank 0's LM-head passes over ``hidden``: each gathers the vocabulary from every rank,
    so every rank makes them with it (this rank's logits are not kept; ``tokens``: the
    step's adapters' own head rows, ``lora/tokens.StepTokens``)."""
    for rows in head_rows:
        index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        head = None if tokens is None else tokens.head(rows)
        rank.model.compute_logits(hidden[index], head)


@dataclass(frozen=True)
class Stop(Command):
    def apply(self, rank: RankWorker) -> None:
        rank.running = False
