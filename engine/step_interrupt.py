"""Cutting a running step short for a request of higher priority.

A step runs for tens of milliseconds on a CPU (more with long prefills). A request of a
higher priority than everything in the running step would otherwise wait for that step to
end and then share the next one: under a flood of lower-priority streams its time to first
token grows by about half a step on average, and by a whole one at worst. So the engine
*preempts the step itself*: an arrival of higher priority (``arrived``, called from the
thread that submits the request, before the engine thread adds it) raises a flag, and the
model checks it between decoder layers (``check``), abandoning the step. Nothing of it is
applied: the scheduler's plan is dropped before ``update``, so every sequence keeps its
computed tokens, and its next step recomputes the same positions (writing the same KV
values) with the same sampler state; outputs are unchanged, only the partial step's work
is lost (at most one step per urgent arrival). The engine adds the new request, and the
next plan puts it first (preempting a lower-priority sequence if slots are short).

A *solo* step (the scheduler's policy 10: the engine's only request prefilling, sized by
tokens alone) is cut short by any arrival, whatever its priority: it was sized on the promise
that nobody waits on it.

Only eager steps check the flag: a CUDA graph replays without Python in between.
An arrival is pending until the engine has taken it (``taken``), or for ``PENDING_S`` at
most, so that a request that never reaches the engine cannot interrupt steps forever.
"""

from __future__ import annotations

import threading
import time

PENDING_S = 1.0


class StepInterrupted(Exception):
    """The running step was abandoned for a request of higher priority."""


class StepInterrupt:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flag = threading.Event()
        self._step_priority: int | None = None  # highest priority in the running step
        self._solo = False  # the running step is solo: any arrival cuts it short
        self._pending: list[tuple[int, float]] = []  # (priority, when) not yet taken

    def arrived(self, priority: int) -> None:
        """A request of ``priority`` is on its way to the engine (any thread)."""
        with self._lock:
            self._pending.append((priority, time.monotonic()))
            if self._step_priority is not None and (self._solo or priority > self._step_priority):
                self._flag.set()

    def taken(self, priority: int) -> None:
        """The engine has added (or refused) the request announced as ``priority``."""
        with self._lock:
            for i, (pending, _) in enumerate(self._pending):
                if pending == priority:
                    del self._pending[i]
                    break

    def begin(self, step_priority: int, solo: bool = False) -> None:
        """A step whose highest priority is ``step_priority`` starts (engine thread);
        ``solo``: any arrival cuts it short."""
        with self._lock:
            oldest = time.monotonic() - PENDING_S
            self._pending = [(p, t) for p, t in self._pending if t >= oldest]
            self._step_priority, self._solo = step_priority, solo
            self._flag.clear()
            if any(solo or p > step_priority for p, _ in self._pending):
                self._flag.set()  # announced, not added yet: it goes first

    def end(self) -> None:
        with self._lock:
            self._step_priority, self._solo = None, False
            self._flag.clear()

    @property
    def solo(self) -> bool:
        """Whether the running step is solo (any arrival cuts it short)."""
        return self._solo

    def check(self) -> None:
        """Between layers: abandon the step if a higher priority is waiting."""
        if self._flag.is_set():
            raise StepInterrupted
