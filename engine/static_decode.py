"""The static decode path: decode-only steps over fixed buffers, replayed from CUDA graphs.

A decode-only step of ``b`` sequences (one new token each, ``b <= max_batch``) runs padded
to the smallest bucket ``B >= b`` (:func:`decode_buckets`) over device buffers allocated
once, ``B_max`` rows each:

    tokens         [3, B_max] int64      token id, position, KV slot of each row's new token
    block_tables   [B_max, max_blocks] int32
    seqs           [2, B_max] int32      L_s (0 for a padding row); adapter index or -1
    lora_rows      [B_max, max_rank] int32   pool rows of step adapter a (a < b)
    lora_rank      [7, B_max] int32      rank of adapter a in target module (slice) s
    lora_scale     [7, B_max] float32    its scaling

Padding rows (``b .. B-1``) attend to nothing (``L = 0`` gives zeros), use no adapter and
write their keys and values to the arena's scratch slot, which no sequence owns; their
outputs are dropped. Table entries past a row's context and rows past an adapter's rank are
never read, so a step rewrites only what it uses. Every launch of the forward then has the
same shapes and arguments whatever the step holds (the kernels read the step from the
buffers), so on CUDA the forward is captured once per (bucket, with or without LoRA) when
the engine starts and replayed: a small model is otherwise bound by its ~15 launches per
layer. Without CUDA (Triton's interpreter, in tests) the same forward runs eagerly over
the same buffers.

Only the Triton backend can be static (its decode attention reads block tables and
lengths on the device; the torch one sizes its work on the host), so the engine builds
this only with that backend, which binds the buffers into the model's step objects.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loramux.engine.model.llama import LORA_TARGETS, LlamaForCausalLM, LoRAWeightSource
from loramux.kernels.lora_batch import LoRABatch, LoRATable
from loramux.kernels.paged_attention import static_decode_plan

if TYPE_CHECKING:  # the engine builds this only with the Triton backend, which imports triton
    from loramux.engine.lora.triton_backend import TritonBackend

STATIC_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every 16 below ``max_batch``, and it.

    Padding a step to the next bucket wastes at most 15 rows' work (the weights are read
    once per step whatever the batch), while each bucket costs a capture and its graph.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return [*small, *range(16, max_batch, 16), max_batch]


@dataclass(frozen=True)
class DecodeStep:
    """One decode-only step as the runner hands it over, rows in batch order."""

    token_ids: list[int]  # the new token of each row
    context_lens: list[int]  # L_s, the new token included
    block_tables: list[list[int]]
    lora: LoRATable | None  # the step's adapters (``LoRAPool.step_table``), None if none


class StaticDecode:
    """Runs :class:`DecodeStep` s over fixed buffers; on CUDA, by replaying CUDA graphs."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        pools: LoRAWeightSource,
        backend: TritonBackend,
        *,
        block_size: int,
        max_context_len: int,
        buckets: list[int],  # batch sizes to serve (``decode_buckets``), ascending
        max_rank: int,
        scratch_slot: int,
        capture: bool,
    ):
        self.model, self.kv_caches, self.pools = model, kv_caches, pools
        self.backend = backend
        self.block_size = block_size
        self.max_context_len = max_context_len
        self.max_rank = max_rank
        self.scratch_slot = scratch_slot
        if not buckets or buckets != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be distinct positive sizes, ascending: {buckets}")
        self.buckets = list(buckets)
        self.max_batch = self.buckets[-1]
        device = kv_caches[0][0].device
        rows, max_blocks = self.max_batch, -(-max_context_len // block_size)
        int32 = {"dtype": torch.int32, "device": device}
        self._tokens = torch.zeros(3, rows, dtype=torch.long, device=device)
        self._tokens[2] = scratch_slot  # every row is padding until a step fills it
        self._tables = torch.zeros(rows, max_blocks, **int32)
        self._seqs = torch.zeros(2, rows, **int32)
        self._seqs[1] = -1
        self._lora_rows = torch.zeros(rows, max_rank, **int32)
        self._lora_rank = torch.zeros(len(LORA_TARGETS), rows, **int32)
        self._lora_scale = torch.zeros(len(LORA_TARGETS), rows, dtype=torch.float32, device=device)
        # (bucket, with LoRA) -> (graph, its output buffer [bucket, hidden])
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # static steps run, per (bucket, with LoRA)
        self.steps_run: Counter[tuple[int, bool]] = Counter()
        # LoRA launches of one forward, per (bucket, with LoRA): a replay makes its capture's
        self._lora_launches: dict[tuple[int, bool], int] = {}
        if capture:
            self._capture_all()

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def bucket_for(self, batch: int) -> int | None:
        """The smallest bucket holding ``batch`` rows, or None past the largest."""
        return next((b for b in self.buckets if b >= batch), None)

    @torch.inference_mode()
    def run(self, step: DecodeStep) -> torch.Tensor:
        """Hidden states ``[b, hidden]`` of the step's rows (valid until the next run)."""
        batch = len(step.token_ids)
        bucket = self.bucket_for(batch)
        if bucket is None or batch == 0:
            raise ValueError(f"a static decode step holds 1 to {self.max_batch} rows, not {batch}")
        self._fill(step, bucket)
        with_lora = step.lora is not None
        self.steps_run[(bucket, with_lora)] += 1
        if self._graphs:
            graph, out = self._graphs[(bucket, with_lora)]
            graph.replay()
            self.backend.lora_launches.add(self._lora_launches[(bucket, with_lora)])
            return out[:batch]
        return self._forward(bucket, with_lora)[:batch]

    # --- filling the buffers -------------------------------------------------------
    def _fill(self, step: DecodeStep, bucket: int) -> None:
        batch = len(step.token_ids)
        padding = bucket - batch
        positions = [length - 1 for length in step.context_lens]
        bs = self.block_size
        slots = [
            table[p // bs] * bs + p % bs
            for table, p in zip(step.block_tables, positions, strict=True)
        ]
        token_adapter = [-1] * bucket
        if step.lora is not None:
            for start, end, adapter in step.lora.spans:
                if adapter is not None:
                    token_adapter[start:end] = [adapter] * (end - start)
        self._tokens[:, :bucket].copy_(
            torch.tensor(
                [
                    step.token_ids + [0] * padding,
                    positions + [0] * padding,
                    slots + [self.scratch_slot] * padding,
                ]
            )
        )
        self._seqs[:, :bucket].copy_(
            torch.tensor([step.context_lens + [0] * padding, token_adapter], dtype=torch.int32)
        )
        # Only the blocks holding each context are read (a table may run further ahead).
        needed = [
            t[: -(-length // bs)]
            for t, length in zip(step.block_tables, step.context_lens, strict=True)
        ]
        width = max(map(len, needed))
        tables = [t + [0] * (width - len(t)) for t in needed]
        self._tables[:batch, :width].copy_(torch.tensor(tables, dtype=torch.int32))
        if step.lora is not None:
            self._fill_lora(step.lora)

    def _fill_lora(self, table: LoRATable) -> None:
        rank = table.max_rank
        if rank > self.max_rank:
            raise ValueError(f"an adapter of rank {rank} exceeds the buffers' {self.max_rank}")
        adapters = len(table.adapter_rows)
        if rank == 0 or adapters == 0:
            return
        rows = [(list(r) + [0] * rank)[:rank] for r in table.adapter_rows]
        self._lora_rows[:adapters, :rank].copy_(torch.tensor(rows, dtype=torch.int32))
        self._lora_rank[:, :adapters].copy_(torch.tensor(table.ranks, dtype=torch.int32))
        self._lora_scale[:, :adapters].copy_(torch.tensor(table.scales, dtype=torch.float32))

    # --- the forward over the buffers -----------------------------------------------
    def _forward(self, bucket: int, with_lora: bool) -> torch.Tensor:
        plan = static_decode_plan(
            self._tokens[1, :bucket],
            self._tokens[2, :bucket],
            self._tables[:bucket],
            self._seqs[0, :bucket],
            self.max_context_len,
        )
        attention = self.backend.bind_attention(plan)
        lora = None
        if with_lora:
            batch = LoRABatch.per_token(
                self._seqs[1, :bucket],
                self._lora_rows[:bucket],
                self._lora_rank[:, :bucket],
                self._lora_scale[:, :bucket],
            )
            lora = self.backend.bind_lora(batch, self.pools)
        hidden = self.model(self._tokens[0, :bucket], attention, self.kv_caches, lora)
        self._lora_launches[(bucket, with_lora)] = 0 if lora is None else lora.launches
        return hidden

    def _capture_all(self) -> None:
        """One graph per (bucket, with LoRA or not), largest first, sharing one memory pool.

        Each is run twice before its capture (the Triton kernels compile, the LoRA launch
        tables are cached, RoPE's tables are made) with every row padding: the scratch slot
        takes the writes.
        """
        device = self._tokens.device
        pool = None
        with torch.inference_mode():
            for bucket in reversed(self.buckets):
                for with_lora in (True, False):
                    for _ in range(2):
                        self._forward(bucket, with_lora)
                    torch.cuda.synchronize(device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self._forward(bucket, with_lora)
                    pool = graph.pool()
                    self._graphs[(bucket, with_lora)] = (graph, out)
        torch.cuda.synchronize(device)
