"""Rank 0 of a tensor-parallel engine: it starts the other ranks and tells them what to do.

``EngineRanks`` spawns one process per other rank (``worker.run_rank``), joins them in a
``TensorParallelGroup`` and sends commands (``commands.py``). It is the engine's
``Devices`` (``engine/executor/base.py``): it builds rank 0's arena, adapter rows, static
decode path and executor (``executor.py``), through which each operation that changes
device state or runs the model is sent to the other ranks first and then done here, so
the engine above them (scheduler, pool, tiers, sampler) is the single-device engine,
unchanged.

A rank that dies makes rank 0's next collective fail (gloo and NCCL see the closed
connection): that error, raised in a step, is the engine's failure (:class:`RankFailed`
names the rank and its exit code), and ``close`` stops whatever is left of the others. A
rank that hangs (stopped, frozen) keeps its connections open, and rank 0 would wait in the
collective for its whole timeout: the heartbeat watch (``heartbeat.py``) finds it instead,
once it has been silent for ``tensor_parallel_heartbeat_timeout_s``, and kills it, which
fails the collective at once and names the rank that stopped answering.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loramux.engine.clock import WallClock
from loramux.engine.compute_threads import default_compute_threads
from loramux.engine.config import EngineConfig
from loramux.engine.executor.base import Devices
from loramux.engine.executor.local import LocalExecutor, OneDevice
from loramux.engine.isolation import EngineDown
from loramux.engine.memory.arena import DeviceArena
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import LlamaForCausalLM
from loramux.engine.model.loader import load_engine_model
from loramux.engine.parallel.commands import BuildArena, BuildStaticDecode, Command, Stop
from loramux.engine.parallel.executor import MirroredRows, TensorParallelExecutor
from loramux.engine.parallel.group import (
    CollectiveError,
    GroupAddress,
    TensorParallelGroup,
    free_port,
)
from loramux.engine.parallel.heartbeat import HeartbeatWatch
from loramux.engine.parallel.shard import ShardPlan
from loramux.engine.parallel.worker import rank_command, rank_device
from loramux.engine.static_decode import StaticDecode

__all__ = ["EngineRanks", "RankFailed", "start_devices"]

logger = logging.getLogger("loramux.engine.parallel")
STOP_WAIT_S = 10.0
DEATH_WAIT_S = 2.0  # after a failed collective, how long a dying rank may take to be seen


class RankFailed(EngineDown):
    """A rank of the engine died or stopped answering: the engine cannot go on."""


@dataclass
class _Rank:
    rank: int
    process: subprocess.Popen

    def is_alive(self) -> bool:
        return self.process.poll() is None


def start_devices(config: EngineConfig) -> Devices:
    """Where the engine runs: its one device, or its ranks, the others started now (they
    load their shards meanwhile; this process is rank 0 and holds its own)."""
    if config.tensor_parallel_size == 1:
        return OneDevice(config.torch_device, config.compute_threads)
    return EngineRanks(config, ModelConfig.from_pretrained(config.model))


class EngineRanks:
    """The engine's ranks, seen from rank 0."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self.world_size = config.tensor_parallel_size
        self.plan = ShardPlan(model_config, self.world_size, 0)  # checks the split first
        self.device = rank_device(config, 0)
        self.clock = WallClock()
        address = GroupAddress(
            "127.0.0.1", free_port(), self.world_size, config.tensor_parallel_timeout_s
        )
        threads = threads_per_rank(config, self.device)
        self.threads = threads  # each rank's, rank 0's too
        self._watch = HeartbeatWatch(
            config.tensor_parallel_heartbeat_timeout_s, self._stopped_answering
        )
        self._silent: dict[int, float] = {}  # rank -> its silence (s) when the watch killed it
        self._ranks: list[_Rank] = []
        try:
            for rank in range(1, self.world_size):
                self._ranks.append(_Rank(rank, self._start_rank(config, rank, address, threads)))
            self._watch.start()
            self.group = TensorParallelGroup(address, 0, self.device)
        except Exception as exc:
            self._terminate()
            raise RankFailed(f"the engine's {self.world_size} ranks did not join: {exc}") from exc
        self._closed = False
        self.out_of_step = False  # rank 0 left a step midway: the others may be stuck in it
        logger.info(
            "tensor parallel: %d ranks (pids %s), %d heads and %d KV heads per rank",
            self.world_size,
            ", ".join(str(r.process.pid) for r in self._ranks),
            self.plan.local_heads,
            self.plan.local_kv_heads,
        )

    def _start_rank(
        self, config: EngineConfig, rank: int, address: GroupAddress, threads: int
    ) -> subprocess.Popen:
        heartbeat_fd = self._watch.pipe(rank)
        try:
            # A fresh interpreter (no forked torch or CUDA state, and unlike
            # multiprocessing's spawn, no re-import of whatever script started rank 0).
            command = rank_command(config, rank, address, threads, heartbeat_fd)
            return subprocess.Popen(command, pass_fds=(heartbeat_fd,))
        finally:
            os.close(heartbeat_fd)  # the rank's end now: its exit closes the pipe

    # --- Devices: rank 0's device side ---------------------------------------------
    governs_threads = False  # each rank has its fixed part of the threads

    @property
    def shard(self) -> ShardPlan:
        return self.plan

    @property
    def compute_threads(self) -> int:
        return self.threads

    def load_model(self, config: EngineConfig, *, quant_op) -> LlamaForCausalLM:
        """Rank 0's shard of the model, joined to the others' collectives."""
        model = load_engine_model(config, self.device, shard=self.plan, quant_op=quant_op)
        model.join(self.group, self.plan.vocab_start, self.plan.config.vocab_size)
        return model

    def arena(self, *args, **kwargs) -> DeviceArena:
        """Rank 0's arena (``DeviceArena``'s arguments); every rank builds one alike."""
        arena = DeviceArena(*args, **kwargs)
        self.send(BuildArena(arena.layout.num_blocks, arena.scratch_blocks))
        return arena

    def adapter_rows(self, arena: DeviceArena) -> MirroredRows:
        return MirroredRows(self, arena)

    def static_decode(self, *args, capture: bool, **kwargs) -> StaticDecode:
        """Rank 0's static decode path (``StaticDecode``'s arguments); the other ranks
        build theirs first, so that with ``capture`` all of them capture together."""
        self.send(
            BuildStaticDecode(
                kwargs["max_context_len"], list(kwargs["buckets"]), kwargs["max_rank"], capture
            )
        )
        return StaticDecode(*args, capture=capture, **kwargs)

    def executor(self, local: Callable[[], LocalExecutor], pool) -> TensorParallelExecutor:
        return TensorParallelExecutor(self, local())

    def send(self, command: Command) -> None:
        """Send ``command`` to every other rank (before rank 0 does its own part)."""
        try:
            self.group.broadcast(command)
        except Exception as exc:
            raise self.failure(exc) from exc

    def failure(self, exc: BaseException, *, in_step: bool = False) -> RankFailed:
        """Why the engine cannot go on after ``exc`` (raised sending a command, or inside
        a step when ``in_step``): a rank is gone, if one is (dead, or killed by the watch
        for its silence). A killed rank's connections close while its process is still
        being torn down, so its death may be seen a moment after the error: it is waited
        for, briefly. With no rank gone, the ranks are out of step: rank 0 left a step, or
        a collective, that the others may still be waiting in."""
        deadline = time.monotonic() + DEATH_WAIT_S
        while not (dead := self._dead()) and time.monotonic() < deadline:
            time.sleep(0.02)
        if dead:
            names = ", ".join(self._why_gone(rank) for rank in dead)
            return RankFailed(f"tensor-parallel {names}: {exc}")
        self.out_of_step = True
        if in_step and not isinstance(exc, CollectiveError):
            return RankFailed(
                f"rank 0 failed inside a step ({type(exc).__name__}: {exc}); the other "
                "tensor-parallel ranks cannot be brought back in step, so the engine stops"
            )
        return RankFailed(
            "a tensor-parallel collective failed with every rank alive and beating (one "
            f"stuck, or the ranks out of step): {exc}"
        )

    def _why_gone(self, rank: _Rank) -> str:
        silent_s = self._silent.get(rank.rank)
        if silent_s is None:
            return f"rank {rank.rank} (exit code {rank.process.returncode}) of the engine stopped"
        return (
            f"rank {rank.rank} stopped answering (no heartbeat for {silent_s:.1f} s) and was killed"
        )

    def _stopped_answering(self, rank: int, silent_s: float) -> None:
        """The watch's report: ``rank`` is silent. Rank 0 may be waiting for it in a
        collective, for the collective's whole timeout: killing it closes its connections,
        which ends that wait at once (and the engine cannot go on without it anyway)."""
        logger.error(
            "tensor-parallel rank %d stopped answering (no heartbeat for %.1f s): killing it",
            rank,
            silent_s,
        )
        self._silent[rank] = silent_s  # before the kill: whoever sees it dead sees why
        next(r for r in self._ranks if r.rank == rank).process.kill()

    def dead_ranks(self) -> list[int]:
        return [r.rank for r in self._dead()]

    def _dead(self) -> list[_Rank]:
        return [r for r in self._ranks if not r.is_alive()]

    def close(self) -> None:
        """Stop the other ranks: ``Stop`` if they are all there and in step, else
        terminate them."""
        if self._closed:
            return
        self._closed = True
        self._watch.stop()  # a rank leaving now is not a rank gone silent
        if not self.out_of_step:  # else they may wait in a collective: no Stop reaches them
            if not self.dead_ranks():
                try:
                    self.group.broadcast(Stop())
                except Exception as exc:  # closing anyway
                    logger.warning("stopping the ranks: %s", exc)
            for rank in self._ranks:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    rank.process.wait(STOP_WAIT_S)
        self._terminate()

    def _terminate(self) -> None:
        self._watch.stop()
        for rank in self._ranks:
            if rank.is_alive():
                rank.process.kill()
                rank.process.wait(STOP_WAIT_S)


def threads_per_rank(config: EngineConfig, device: torch.device) -> int:
    """On the CPU the ranks share the engine's compute threads (its setting, or the cores
    available: compute_threads.py): each rank gets its part; on GPUs one thread each is
    enough to launch."""
    if device.type == "cuda":
        return 1
    threads = config.compute_threads or default_compute_threads()
    return max(1, threads // config.tensor_parallel_size)
