"""Each engine step of a run, as the run's clock saw it: how long the whole ``step()`` took
and what its batch held. The same record on a GPU (wall time) and on the simulated GPU
(simulated time) is what tells where the simulation's step model is wrong: step time by
batch size, decode-only against mixed steps, and the stalls (steps far longer than any
batch explains, such as a kernel compiled on first use)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

STALL_S = 0.5  # a step this long is a stall at any batch the presets run
BATCH_BINS = ((1, 8), (9, 32), (33, 64), (65, 128), (129, 1 << 30))


@dataclass(frozen=True)
class StepRecord:
    start_s: float
    seconds: float  # the whole step(): residency, scheduling, the executor, the update
    sequences: int
    prefill_tokens: int  # rows of prompt chunks (and recomputes)
    adapters: int  # distinct adapters in the batch
    max_rank: int

    @property
    def decode_only(self) -> bool:
        return self.prefill_tokens == 0


class StepTracer:
    """``step`` (for ``run_engine``) runs ``engine.step`` and records it; steps in which
    nothing ran are not recorded."""

    def __init__(self, engine, now: Callable[[], float]):
        self.engine, self.now = engine, now
        self.records: list[StepRecord] = []
        self._batch = None
        execute = engine.executor.execute

        def traced(batch):
            self._batch = batch
            return execute(batch)

        engine.executor.execute = traced

    def step(self) -> list:
        self._batch = None
        began = self.now()
        outputs = self.engine.step()
        batch = self._batch
        if batch is not None:
            forward = batch.forward
            table = forward.lora
            self.records.append(
                StepRecord(
                    start_s=began,
                    seconds=self.now() - began,
                    sequences=len(forward.query_lens),
                    prefill_tokens=sum(n for n in forward.query_lens if n > 1),
                    adapters=0 if table is None else len(table.adapter_rows),
                    max_rank=0 if table is None else table.max_rank,
                )
            )
        return outputs


def summarize_steps(records: list[StepRecord]) -> dict:
    """Median step milliseconds by batch size, decode-only and mixed; the stalls."""
    bins = []
    for lo, hi in BATCH_BINS:
        for decode_only in (True, False):
            times = [
                r.seconds
                for r in records
                if lo <= r.sequences <= hi and r.decode_only == decode_only
            ]
            if times:
                bins.append(
                    {
                        "sequences": [lo, hi],
                        "decode_only": decode_only,
                        "steps": len(times),
                        "median_ms": 1e3 * statistics.median(times),
                    }
                )
    stalls = [r for r in records if r.seconds >= STALL_S]
    return {
        "steps": len(records),
        "seconds": sum(r.seconds for r in records),
        "bins": bins,
        "stalls": len(stalls),
        "stall_seconds": sum(r.seconds for r in stalls),
        "longest": [asdict(r) for r in sorted(records, key=lambda r: -r.seconds)[:10]],
    }
