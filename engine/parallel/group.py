"""The ranks of one tensor-parallel engine, joined by ``torch.distributed``.

Two process groups over one ``TCPStore`` on rank 0's host: the *device* group carries the
model's collectives (NCCL between GPUs, gloo on the CPU) and the *control* group (gloo,
always on the CPU) carries rank 0's commands to the other ranks as pickled bytes, so that
a command never waits behind device work. The groups are c10d objects of this engine's
own, not ``torch.distributed``'s process-wide default group: several engines (a test
session's, a benchmark's two sides) can each have theirs in one process.

A rank that died fails the others' next collective at once (its connections close); every
collective also has the engine's timeout, so that one alive but stuck fails them too, with
a :class:`CollectiveError`, instead of blocking them for ever (a rank that stopped is found
sooner, by its heartbeat: ``heartbeat.py``). The one wait without it is a rank's wait for
rank 0's next command, which lasts as long as the engine is idle (rank 0's death closes its
connections and ends it at once).
"""

from __future__ import annotations

import datetime
import pickle
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["CollectiveError", "GroupAddress", "TensorParallelGroup", "free_port"]

DEFAULT_TIMEOUT_S = 60.0
# How long a rank waits for rank 0's next command: unbounded in practice (an idle engine
# sends none), finite for gloo's clocks.
COMMAND_WAIT = datetime.timedelta(days=365)


class CollectiveError(RuntimeError):
    """A collective failed or timed out (gloo raises a plain ``RuntimeError``): the ranks'
    link failed, as opposed to this rank's own code."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class GroupAddress:
    """Where the ranks meet: rank 0's store (what the other ranks are started with)."""

    host: str
    port: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S


class TensorParallelGroup:
    """This rank's handle on the engine's ranks: the model's collectives and the commands."""

    def __init__(self, address: GroupAddress, rank: int, device: torch.device):
        self.rank, self.world_size = rank, address.world_size
        self.device = device
        timeout = datetime.timedelta(seconds=address.timeout_s)
        self._store = dist.TCPStore(
            address.host,
            address.port,
            address.world_size,
            is_master=rank == 0,
            timeout=timeout,
        )
        self._control = dist.ProcessGroupGloo(
            dist.PrefixStore("control", self._store), rank, self.world_size, timeout
        )
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._device_group = dist.ProcessGroupNCCL(
                dist.PrefixStore("device", self._store), rank, self.world_size, options
            )
        else:
            self._device_group = self._control
        # Seconds this rank spent in collectives (sending, and waiting for the slowest rank):
        # the communication share of a step (benchmarks/tensor_parallel/runner.py). On CUDA a
        # collective is timed to its launch unless the caller synchronizes.
        self.collective_s = 0.0
        self.command_s = 0.0  # ...and in sending (or waiting for) rank 0's commands
        self._awaiting_command = dist.BroadcastOptions()  # root 0, no timeout to speak of
        self._awaiting_command.timeout = COMMAND_WAIT

    def _timed(self, collective: Callable[[], dist.Work]) -> None:
        started = time.perf_counter()
        _wait(collective)
        self.collective_s += time.perf_counter() - started

    # --- the model's collectives ------------------------------------------------
    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place."""
        self._timed(lambda: self._device_group.allreduce([tensor]))
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on each), in rank order."""
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._timed(lambda: self._device_group.allgather([parts], [tensor.contiguous()]))
        return parts

    # --- rank 0's commands --------------------------------------------------------
    def broadcast(self, message: object = None) -> object:
        """Rank 0 sends ``message`` (any picklable value); every rank returns it."""
        started = time.perf_counter()
        try:
            return self._broadcast(message)
        finally:
            self.command_s += time.perf_counter() - started

    def _broadcast(self, message: object) -> object:
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.long)
            _wait(lambda: self._control.broadcast(size, 0))
            _wait(lambda: self._control.broadcast(payload, 0))
            return message
        size = torch.zeros(1, dtype=torch.long)
        _wait(lambda: self._control.broadcast([size], self._awaiting_command))
        payload = torch.empty(int(size), dtype=torch.uint8)
        _wait(lambda: self._control.broadcast(payload, 0))
        return pickle.loads(payload.numpy().tobytes())


def _wait(collective: Callable[[], dist.Work]) -> None:
    try:
        collective().wait()
    except RuntimeError as exc:  # gloo's and NCCL's errors, DistError among them
        raise CollectiveError(str(exc)) from exc
