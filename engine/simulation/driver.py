"""Serving a trace on an engine whose clock is simulated: requests added at their arrival
times, steps run, and the clock moved to the next event whenever nothing can run (the next
arrival, or the next adapter fetch to finish)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loramux.engine.engine import Engine
from loramux.engine.outputs import RequestOutput
from loramux.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # simulated seconds from the run's start
    request_id: str
    prompt: list[int]
    max_tokens: int
    adapter: str | None = None
    tenant: str | None = None


def run_trace(engine: Engine, trace: Sequence[TraceRequest]) -> dict[str, RequestOutput]:
    """Serve ``trace`` (sorted by arrival) to its end; each request's final output, whose
    ``metrics`` carry its simulated arrival, first-token and finish times."""
    clock = engine.clock
    start = clock.now()
    pending = sorted(trace, key=lambda r: r.arrival)
    finished: dict[str, RequestOutput] = {}
    index = 0
    while index < len(pending) or engine.has_unfinished_requests():
        while index < len(pending) and start + pending[index].arrival <= clock.now():
            request = pending[index]
            params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True, temperature=0)
            engine.add_request(
                request.request_id,
                request.prompt,
                params,
                adapter=request.adapter,
                tenant=request.tenant,
            )
            index += 1
        before = clock.now()
        outputs = engine.step() if engine.has_unfinished_requests() else []
        for output in outputs:
            if output.finished:
                finished[output.request_id] = output
        if clock.now() == before and not outputs:
            arrival = start + pending[index].arrival if index < len(pending) else None
            clock.advance_to(clock.next_event(arrival))
    return finished
