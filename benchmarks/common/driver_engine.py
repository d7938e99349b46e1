"""Serve a workload open-loop against an in-process :class:`loramux.engine.Engine`.

Rules (shared by every driver, see ``drivers.py``):

* times are seconds from the run's start (``time.perf_counter() - t0``; on a simulated
  GPU, simulated seconds: ``benchmarks/simulate/serve.py``'s run clock); a request's
  ``arrival_s`` is taken from the workload, never measured;
* every request is greedy and generates exactly ``output_len`` tokens: EOS is suppressed
  (``min_tokens = max_tokens = output_len``), as PEFT's ``min_new_tokens`` suppresses it.
  Not ``ignore_eos``: that lets the engine emit EOS as a token where PEFT must pick the
  next best, and greedy agreement with the baseline fell to 22/32;
* open loop: before each ``step()``, every request whose arrival time has come is added,
  the clock read again after each add, so requests due together (a rate far above what
  adding takes) all enter before the first step (``sent_s`` is when ``add_request`` was
  called, so a late add is visible); when the engine is idle and the next arrival lies in
  the future, the driver sleeps until it;
* each token is stamped with the time ``step()`` returned it; ``finish_s`` is the stamp
  of the step that finished the request;
* a request the engine refuses (``add_request`` raises) or fails (an output with
  ``error``) gets ``error`` set and ``finish_s`` at that moment; the run goes on;
* from the finished request's ``RequestMetrics``: ``scheduled_s`` (``sent_s`` plus the
  engine's queue time) and ``cached_prompt_tokens``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence

from loramux.benchmarks.common.measures import RequestRecord, new_records
from loramux.benchmarks.common.workload import WorkloadRequest


class WallRunClock:
    """A run's time on the wall clock: seconds since it started; waits sleep."""

    def __init__(self):
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def wait_until(self, when: float) -> None:
        time.sleep(max(0.0, when - self.now()))

    def stepped(self, began: float, outputs: int, next_arrival: float | None) -> None:
        """After a step begun at ``began`` that gave ``outputs`` outputs: nothing to do (a
        step with nothing to run waits for a load itself)."""


def exact_length_params(output_len: int):
    """Greedy sampling that produces exactly ``output_len`` tokens (EOS suppressed)."""
    from loramux.engine import SamplingParams

    return SamplingParams(max_tokens=output_len, min_tokens=output_len, temperature=0.0)


def run_engine(
    engine,
    requests: Sequence[WorkloadRequest],
    prompts: dict[int, list[int]],
    adapter_names: list[str],
    *,
    tenants: dict[str, tuple[int, float]] | None = None,
    token_ids: dict[int, list[int]] | None = None,
    step: Callable[[], list] | None = None,
    clock=None,
) -> list[RequestRecord]:
    """Serve ``requests`` on ``engine``; one record per request, in ``requests``' order.

    ``adapter_names[k]`` is the engine's name of workload adapter ``k`` (already added to
    the engine); a request with ``adapter=None`` uses the base model. ``tenants`` maps a
    tenant to ``(priority, weight)``: the weights are set on the engine before the run and
    each request is added with its tenant's priority (0 for a tenant not listed, and for
    all when ``tenants`` is None). ``token_ids``, when given, is filled with each request's
    generated token ids (request index -> ids), for checking outputs. ``step``, when given,
    is called instead of ``engine.step`` (a caller timing or counting each step wraps it).
    ``clock``: the run's time (default ``WallRunClock``; a simulated GPU's run clock moves
    its simulated time).
    """
    tenants = tenants or {}
    for tenant, (_, weight) in tenants.items():
        engine.set_tenant_weight(tenant, weight)
    run_id = uuid.uuid4().hex[:8]
    records = new_records(requests, prompts)
    collected = token_ids if token_ids is not None else {}
    by_id: dict[str, int] = {}
    active: set[int] = set()  # added and not finished
    pending = sorted(requests, key=lambda r: (r.arrival_s, r.index))
    next_pending = 0
    clock = clock or WallRunClock()
    now = clock.now

    def add(request: WorkloadRequest) -> None:
        record = records[request.index]
        request_id = f"bench-{run_id}-{request.index}"
        adapter = None if request.adapter is None else adapter_names[request.adapter]
        priority = tenants.get(request.tenant, (0, 1.0))[0]
        collected[request.index] = []
        record.sent_s = now()
        try:
            engine.add_request(
                request_id,
                prompts[request.index],
                exact_length_params(request.output_len),
                adapter=adapter,
                priority=priority,
                tenant=request.tenant,
            )
        except Exception as exc:  # refused: the run goes on without it
            record.error = f"{type(exc).__name__}: {exc}"
            record.finish_s = now()
            return
        by_id[request_id] = request.index
        active.add(request.index)

    step = step or engine.step
    while True:
        while next_pending < len(pending) and pending[next_pending].arrival_s <= now():
            add(pending[next_pending])
            next_pending += 1
        if not active:
            if next_pending == len(pending):
                break
            clock.wait_until(pending[next_pending].arrival_s)
            continue
        began = now()
        outputs = step()
        stamp = now()
        for out in outputs:
            index = by_id.get(out.request_id)
            if index is None:  # not ours (the caller's own requests)
                continue
            record = records[index]
            record.token_times_s.extend([stamp] * len(out.delta_token_ids))
            collected[index].extend(out.delta_token_ids)
            if out.error:
                record.error = out.error
            if out.finished:
                record.finish_s = stamp
                active.discard(index)
                _engine_figures(record, out.metrics)
        upcoming = pending[next_pending].arrival_s if next_pending < len(pending) else None
        clock.stepped(began, len(outputs), upcoming)
    return [records[r.index] for r in requests]


def _engine_figures(record: RequestRecord, metrics) -> None:
    if metrics is None:
        return
    record.cached_prompt_tokens = metrics.cached_prompt_tokens
    if metrics.queue_time is not None and record.sent_s is not None:
        record.scheduled_s = record.sent_s + metrics.queue_time
