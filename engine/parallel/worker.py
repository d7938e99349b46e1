"""A rank other than 0: its shard of the model and of the arena, doing rank 0's commands.

Started by rank 0 (``ranks.py``) as a process of its own, one per device. It starts its
heartbeat (``heartbeat.py``: rank 0 tells a stopped rank from a busy one by it), loads its
shard of the weights, joins the ranks and then does what each command says until ``Stop``
or until a collective fails: rank 0 gone (killed, crashed) fails the next broadcast, and
the rank exits instead of waiting for a step that will never come.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

import torch

from loramux.engine.config import EngineConfig
from loramux.engine.executor.forward import (
    copy_kv_blocks,
    decode_step,
    forward_step,
    step_tokens,
)
from loramux.engine.lora.backend import select_backend
from loramux.engine.lora.dora import DoRAFold
from loramux.engine.lora.tokens import StepTokens
from loramux.engine.memory.arena import DeviceArena
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.loader import load_engine_model
from loramux.engine.parallel.commands import Command
from loramux.engine.parallel.group import GroupAddress, TensorParallelGroup
from loramux.engine.parallel.heartbeat import beat_interval_s, start_heartbeat
from loramux.engine.parallel.shard import ShardPlan
from loramux.engine.static_decode import StaticDecode
from loramux.engine.step_batch import ForwardInputs
from loramux.kernels.interpreter import use_cpu_interpreter

logger = logging.getLogger("loramux.engine.parallel")


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank ``rank``'s device: GPU ``rank`` on CUDA (each rank one GPU), else the CPU."""
    device = config.torch_device
    return torch.device("cuda", rank) if device.type == "cuda" else device


class RankWorker:
    """What a rank holds, and the operations the commands call (``commands.py``)."""

    def __init__(self, config: EngineConfig, rank: int, group: TensorParallelGroup):
        self.config, self.rank, self.group = config, rank, group
        self.device, self.dtype = group.device, config.torch_dtype
        self.plan = ShardPlan(ModelConfig.from_pretrained(config.model), group.world_size, rank)
        self.backend = select_backend(self.device, self.dtype, config.kernels)
        self.model = load_engine_model(config, self.device, shard=self.plan)
        self.model.join(group, self.plan.vocab_start, self.plan.config.vocab_size)
        self.arena: DeviceArena | None = None
        self.static_decode: StaticDecode | None = None
        self.weights_version = 0  # the LoRA source's version: bumped by every row change
        self.running = True

    # --- LoRAWeightSource, over the arena's rows ----------------------------------
    def a_pool(self, layer: int, module: str) -> torch.Tensor:
        return self.arena.a_pool(layer, module)

    def b_pool(self, layer: int, module: str) -> torch.Tensor:
        return self.arena.b_pool(layer, module)

    # --- what the commands do ------------------------------------------------------
    def build_arena(self, num_blocks: int, scratch_blocks: int) -> None:
        self.arena = DeviceArena(
            self.model.config,
            num_blocks,
            self.config.block_size,
            self.dtype,
            self.device,
            scratch_blocks=scratch_blocks,
            kv_cache_dtype=self.config.kv_cache_dtype,
            fold=DoRAFold(self.model),
        )

    def build_static_decode(
        self, max_context_len: int, buckets: list[int], max_rank: int, capture: bool
    ) -> None:
        self.static_decode = StaticDecode(
            self.model,
            self.arena.kv_caches,
            self,
            self.backend,
            block_size=self.config.block_size,
            max_context_len=max_context_len,
            buckets=buckets,
            max_rank=max_rank,
            scratch_slot=self.arena.scratch_slot,  # the arenas are laid out alike
            capture=capture,
        )

    def copy_kv_blocks(self, moves: list[tuple[int, int]]) -> None:
        copy_kv_blocks(self.arena.kv_caches, moves, self.device)

    def token_slabs(self, first_row: int, rows: int) -> list[torch.Tensor]:
        return self.arena.token_slabs(first_row, rows)

    def step_tokens(self, inputs: ForwardInputs) -> StepTokens | None:
        return step_tokens(self.model, self, inputs, self.device)

    @torch.inference_mode()
    def forward(
        self, inputs: ForwardInputs, *, static: bool, tokens: StepTokens | None = None
    ) -> torch.Tensor:
        if static:
            return self.static_decode.run(decode_step(inputs))
        return forward_step(
            self.model,
            self.backend,
            self.arena.kv_caches,
            self,
            self.config.block_size,
            self.device,
            inputs,
            tokens=tokens,
        )

    def serve(self) -> None:
        """Do rank 0's commands until it says stop."""
        with torch.inference_mode():
            while self.running:
                command = self.group.broadcast()
                assert isinstance(command, Command), type(command)
                command.apply(self)


def rank_command(
    config: EngineConfig, rank: int, address: GroupAddress, threads: int, heartbeat_fd: int
) -> list[str]:
    """The command line of rank ``rank``'s process (``python -m`` this module), which
    inherits ``heartbeat_fd``, the pipe it beats into."""
    return [
        sys.executable,
        "-m",
        "loramux.engine.parallel",  # __main__.py: run_rank
        json.dumps(
            {
                "config": dataclasses.asdict(config),
                "rank": rank,
                "address": dataclasses.asdict(address),
                "threads": threads,
                "heartbeat_fd": heartbeat_fd,
            }
        ),
    ]


def run_rank(
    config: EngineConfig, rank: int, address: GroupAddress, threads: int, heartbeat_fd: int
) -> None:
    """A rank process's main: beat, join, load, serve; any failure ends the process."""
    logging.basicConfig(level=logging.INFO, format=f"rank {rank} %(levelname)s %(message)s")
    start_heartbeat(heartbeat_fd, beat_interval_s(config.tensor_parallel_heartbeat_timeout_s))
    torch.set_num_threads(threads)
    device = rank_device(config, rank)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        # Rank 0 runs the Triton kernels interpreted (tests, smoke runs): so does this rank,
        # with the interpreter's fixes (kernels/interpreter.py), before a kernel is imported.
        use_cpu_interpreter()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        group = TensorParallelGroup(address, rank, device)
        RankWorker(config, rank, group).serve()
    except Exception as exc:  # rank 0 gone, or this rank broken: either way, exit
        logger.error("rank %d of pid %d stops: %s", rank, os.getpid(), exc)
        raise SystemExit(1) from exc
