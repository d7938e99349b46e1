"""The simulated executor: a step's modelled time added to the simulated clock, and a
deterministic token per sampled row in place of the model's.

Tokens: request ``r``'s ``i``-th output token is a hash of ``(r, i)`` into the vocabulary
above its first ``FIRST_TOKEN`` ids (where the special tokens are), so a sequence never
ends by EOS and runs to its ``max_tokens`` (S-LoRA's workloads fix output lengths), while
stop strings and stop ids still apply, as the scheduler applies them to any token.
Speculative decoding and prompt logprobs are not simulated: such a step is refused.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from loramux.engine.executor.base import StepResult
from loramux.engine.lora.pool import LoRAPool
from loramux.engine.model.llama import LORA_TARGETS
from loramux.engine.simulation.arena import GeometryArena
from loramux.engine.simulation.clock import SimulatedClock
from loramux.engine.simulation.step_time import StepShape, StepTimeModel
from loramux.engine.step_batch import StepBatch

FIRST_TOKEN = 100


def simulated_token(request_id: str, index: int, vocab_size: int) -> int:
    span = vocab_size - FIRST_TOKEN
    return FIRST_TOKEN + zlib.crc32(f"{request_id}:{index}".encode()) % span


@dataclass
class SimulatedSteps:
    """What the simulated steps added up to (for reports)."""

    steps: int = 0
    seconds: float = 0.0
    by_part: dict[str, float] = field(default_factory=dict)
    lora_bytes_s: float = 0.0  # the adapters' bytes at full bandwidth (StepTime's)

    def adapter_floor_ratio(self) -> float:
        """The throughput, relative to the base model's on the same steps, that the
        adapters' bytes allow: the steps' time without their LoRA work and adapter copies,
        over that plus the adapters' bytes at full bandwidth (1.0 without adapters)."""
        base = (
            self.seconds - self.by_part.get("lora", 0.0) - self.by_part.get("adapter_copies", 0.0)
        )
        return base / (base + self.lora_bytes_s) if base > 0 else 1.0


class SimulatedExecutor:
    """The ``Executor`` of a simulated GPU."""

    interruptible = False  # a simulated step takes no real time to cut short

    def __init__(
        self,
        step_time: StepTimeModel,
        clock: SimulatedClock,
        arena: GeometryArena,
        pool: LoRAPool,
        *,
        graph_max_batch: int,
        vocab_size: int,
    ):
        self.step_time, self.clock, self.arena, self.pool = step_time, clock, arena, pool
        self.graph_max_batch, self.vocab_size = graph_max_batch, vocab_size
        self.interrupt: Callable[[], None] | None = None
        self.totals = SimulatedSteps()

    def copy_kv_blocks(self, moves: list[tuple[int, int]]) -> None:
        # Read and written on the device; the next step waits for it.
        self.arena.pending_device_bytes += 2 * len(moves) * self.arena.bytes_per_block

    def execute(self, batch: StepBatch) -> StepResult:
        if batch.verifying.groups:
            raise NotImplementedError("speculative decoding is not simulated")
        if batch.prompt_rows.rows:
            raise NotImplementedError("prompt logprobs are not simulated")
        # The copies since the last step (adapter rows, KV blocks) hold this one up.
        h2d_bytes, device_bytes = self.arena.take_pending()
        time = self.step_time.step(self.shape(batch, h2d_bytes, device_bytes))
        self.clock.advance(time.seconds)
        totals = self.totals
        totals.steps += 1
        totals.seconds += time.seconds
        totals.lora_bytes_s += time.lora_bytes_s
        for part, seconds in time.parts.items():
            totals.by_part[part] = totals.by_part.get(part, 0.0) + seconds
        sampled = {
            seq.request_id: [
                (simulated_token(seq.request_id, len(seq.output_token_ids), self.vocab_size), None)
            ]
            for seq in batch.sampling.sequences
        }
        return StepResult(sampled)

    def shape(self, batch: StepBatch, h2d_bytes: int = 0, device_bytes: int = 0) -> StepShape:
        """What the step's time depends on: its batch, and the copies it waits for."""
        forward = batch.forward
        decodes, chunks = [], []
        for rows, context in zip(forward.query_lens, forward.context_lens, strict=True):
            if rows == 1:
                decodes.append(context)
            else:
                chunks.append((rows, context))
        return StepShape(
            decode_contexts=decodes,
            prefill_chunks=chunks,
            head_rows=len(batch.head_index),
            adapters=_adapters(forward.lora),
            graph=forward.is_decode_only and len(decodes) <= self.graph_max_batch,
            h2d_bytes=h2d_bytes,
            device_copy_bytes=device_bytes,
        )


def _adapters(table) -> list[tuple[int, dict[str, int]]]:
    """Per adapter in the step's LoRA table: its tokens, and its rank per target module."""
    if table is None:
        return []
    tokens = [0] * len(table.adapter_rows)
    for start, end, index in table.spans:
        if index is not None:
            tokens[index] += end - start
    return [
        (
            tokens[a],
            {m: table.ranks[s][a] for s, m in enumerate(LORA_TARGETS) if table.ranks[s][a]},
        )
        for a in range(len(tokens))
    ]
