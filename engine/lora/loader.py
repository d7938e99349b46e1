"""Background threads that fetch and parse adapters, so the step loop never waits.

Rules:

- ``workers`` daemon threads (default one), started by the first ``submit`` (nothing
  runs at construction).
- Loads *start* in submission order (arrival order = prefetch order). With one worker
  results come back in that order through ``poll``; with several, in the order they
  finish, so one hung fetch (a store that stopped answering) holds up only its worker.
- An adapter id already queued, in flight, or finished but not yet polled is not
  queued again (``submit`` says False): until ``poll`` hands the result over, the
  engine's host cache does not hold it yet, and a second load would be wasted.
- Every failure (fetch, parse, validation, anything else) becomes a :class:`LoadResult`
  with ``error`` set; the thread keeps serving.
- Weights come back on the CPU, in page-locked memory when ``pin_memory`` is set
  (only with CUDA), so the engine's copy to the device can be asynchronous.
- ``close`` drops queued work and discards the in-flight result; a fetch that hangs
  past the timeout is left behind on its daemon thread.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from loramux.engine.lora.adapter import AdapterError, LoRAWeights, ModuleWeights
from loramux.engine.lora.source import AdapterFetchError, AdapterSource
from loramux.engine.model.config import ModelConfig


@dataclass(frozen=True)
class LoadResult:
    adapter_id: int
    weights: LoRAWeights | None  # on the CPU (pinned if pin_memory); None on failure
    error: str | None  # why it failed, naming the adapter's source and the cause
    seconds: float  # fetch + parse wall time


@dataclass(frozen=True)
class LoaderActivity:
    workers: int  # threads started
    busy: int  # loading a job now
    queued: int  # jobs no thread has taken yet


@dataclass(frozen=True)
class _Job:
    adapter_id: int
    source: AdapterSource
    name: str


class AdapterLoader:
    """Background threads that fetch adapters from their sources and parse them."""

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        dtype: torch.dtype,
        max_rank: int,
        pin_memory: bool = False,
        workers: int = 1,
        name: str = "loramux-adapter-loader",
    ):
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory needs CUDA; this machine has no CUDA device")
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self._workers = workers
        self._config = model_config
        self._dtype = dtype
        self._max_rank = max_rank
        self._pin_memory = pin_memory
        self._name = name
        self._cond = threading.Condition()  # guards every field below
        self._jobs: deque[_Job] = deque()
        self._results: list[LoadResult] = []
        self._pending: set[int] = set()  # queued or in flight
        self._threads: list[threading.Thread] = []
        self._busy = 0  # workers between taking a job and handing its result over
        self._closed = False

    def submit(self, adapter_id: int, source: AdapterSource, *, name: str) -> bool:
        """Queue a load; False if this id is already pending (see :meth:`pending`)."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"adapter loader {self._name} is closed")
            if adapter_id in self._pending:
                return False
            self._pending.add(adapter_id)
            self._jobs.append(_Job(adapter_id, source, name))
            if not self._threads:
                for index in range(self._workers):
                    name = self._name if index == 0 else f"{self._name}-{index}"
                    thread = threading.Thread(target=self._run, name=name, daemon=True)
                    thread.start()
                    self._threads.append(thread)
            self._cond.notify_all()
            return True

    def poll(self) -> list[LoadResult]:
        """Results finished since the last poll, in submission order; never blocks."""
        with self._cond:
            results, self._results = self._results, []
            self._pending.difference_update(r.adapter_id for r in results)
            return results

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a result is ready to poll (or ``timeout`` s pass); True if one is."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._results) or self._closed, timeout)
            return bool(self._results)

    def pending(self) -> set[int]:
        """Adapter ids queued, in flight, or finished but not yet polled."""
        with self._cond:
            return set(self._pending)

    def activity(self) -> LoaderActivity:
        """What the threads are doing now (a simulated clock waits for them to settle)."""
        with self._cond:
            return LoaderActivity(len(self._threads), self._busy, len(self._jobs))

    def close(self, timeout: float = 5.0) -> None:
        """Stop the threads; queued work is dropped and unpolled results discarded."""
        with self._cond:
            self._closed = True
            self._jobs.clear()
            self._pending.clear()
            self._results.clear()
            self._cond.notify_all()
            threads = list(self._threads)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._jobs) or self._closed)
                if self._closed:
                    return
                job = self._jobs.popleft()
                self._busy += 1
            result = self._load(job)
            with self._cond:
                self._busy -= 1
                if self._closed:
                    return
                self._results.append(result)
                self._cond.notify_all()

    def _load(self, job: _Job) -> LoadResult:
        start = time.perf_counter()
        weights, error = None, None
        try:
            weights = job.source.load(
                self._config, name=job.name, max_rank=self._max_rank, dtype=self._dtype
            )
            if self._pin_memory:
                weights = _pinned(weights)
        except AdapterFetchError as exc:
            error = f"adapter {job.name!r}: {exc}"
        except AdapterError as exc:
            error = f"adapter {job.name!r} from {job.source.description} is invalid: {exc}"
        except Exception as exc:  # never kill the thread: the engine fails those requests
            error = (
                f"adapter {job.name!r} from {job.source.description} could not be loaded: "
                f"{type(exc).__name__}: {exc}"
            )
        if error is not None:
            weights = None
        return LoadResult(job.adapter_id, weights, error, time.perf_counter() - start)


def _pinned(weights: LoRAWeights) -> LoRAWeights:
    """A copy of ``weights`` in page-locked host memory."""
    modules = {
        module: ModuleWeights(
            rank=m.rank,
            scale=m.scale,
            a={layer: t.pin_memory() for layer, t in m.a.items()},
            b={layer: t.pin_memory() for layer, t in m.b.items()},
            magnitude={layer: t.pin_memory() for layer, t in m.magnitude.items()},
            bias={layer: t.pin_memory() for layer, t in m.bias.items()},
        )
        for module, m in weights.modules.items()
    }
    tables = {
        id(t): dataclasses.replace(t, rows=t.rows.pin_memory())
        for t in (weights.embed, weights.head)
        if t is not None
    }
    return dataclasses.replace(
        weights,
        modules=modules,
        embed=None if weights.embed is None else tables[id(weights.embed)],
        head=None if weights.head is None else tables[id(weights.head)],
    )
