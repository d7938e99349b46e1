"""Rank 0's device side: its executor and its adapter rows, each sending every change and
every forward to the other ranks first (``commands.py``), then doing rank 0's own part.

So the engine above them (scheduler, KV manager, adapter pool and tiers, sampler) is the
single-device engine, unchanged: it holds an ``Executor`` and an ``AdapterRows`` and does
not know they span ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loramux.engine.executor.base import NonFiniteOutput, StepResult
from loramux.engine.executor.local import LocalExecutor
from loramux.engine.isolation import EngineDown
from loramux.engine.lora.adapter import LoRAWeights
from loramux.engine.memory.arena import DeviceArena, RowLayout
from loramux.engine.parallel.commands import CopyKVBlocks, MoveRows, RunStep, WriteAdapter, ZeroRows
from loramux.engine.static_decode import StaticDecode
from loramux.engine.step_batch import StepBatch

if TYPE_CHECKING:
    from loramux.engine.parallel.ranks import EngineRanks


class TensorParallelExecutor:
    """The step on every rank (the ``Executor`` interface, over ``LocalExecutor``).

    ``NonFiniteOutput`` is raised once every rank made every pass, so the engine isolates
    it as on one device. Any other failure may leave the other ranks inside a collective
    that rank 0 will not enter (or, re-run, would enter with other shapes): they cannot be
    brought back in step, so it ends the engine (``RankFailed``) rather than letting
    ``isolation.py`` re-run parts of it. For the same reason no step is cut short.
    """

    interruptible = False

    def __init__(self, ranks: EngineRanks, local: LocalExecutor):
        self.ranks = ranks
        self.local = local
        self.interrupt = None  # never read: a step here always finishes

    @property
    def static_decode(self) -> StaticDecode | None:
        return self.local.static_decode

    def execute(self, batch: StepBatch) -> StepResult:
        self.ranks.send(RunStep(batch.forward, static=self.local.runs_static(batch)))
        try:
            return self.local.execute(batch)
        except (EngineDown, NonFiniteOutput):  # RankFailed is an EngineDown
            raise
        except Exception as exc:
            raise self.ranks.failure(exc, in_step=True) from exc

    def copy_kv_blocks(self, moves: list[tuple[int, int]]) -> None:
        if moves:
            self.ranks.send(CopyKVBlocks(list(moves)))
        self.local.copy_kv_blocks(moves)


class MirroredRows:
    """Rank 0's adapter rows (the pool's ``AdapterRows``): each change is sent to the
    other ranks first, then made in rank 0's arena, which keeps rank 0's shard."""

    def __init__(self, ranks: EngineRanks, arena: DeviceArena):
        self.ranks = ranks
        self.arena = arena

    @property
    def layout(self) -> RowLayout:
        return self.arena.layout

    @property
    def num_layers(self) -> int:
        return self.arena.num_layers

    @property
    def device(self) -> torch.device:
        return self.arena.device

    @property
    def bytes_per_row(self) -> int:
        return self.arena.bytes_per_row

    @property
    def bytes_per_block(self) -> int:
        return self.arena.bytes_per_block

    def a_pool(self, layer: int, module: str) -> torch.Tensor:
        return self.arena.a_pool(layer, module)

    def b_pool(self, layer: int, module: str) -> torch.Tensor:
        return self.arena.b_pool(layer, module)

    def token_slabs(self, first_row: int, rows: int) -> list[torch.Tensor]:
        return self.arena.token_slabs(first_row, rows)

    def write_adapter(self, start: int, weights: LoRAWeights) -> None:
        self.ranks.send(WriteAdapter(start, weights))
        self.arena.write_adapter(start, self.ranks.plan.shard_adapter(weights))

    def zero_rows(self, start: int, end: int) -> None:
        self.ranks.send(ZeroRows(start, end))
        self.arena.zero_rows(start, end)

    def move_rows(self, src: int, dst: int, count: int) -> None:
        self.ranks.send(MoveRows(src, dst, count))
        self.arena.move_rows(src, dst, count)
