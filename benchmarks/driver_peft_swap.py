"""PEFT holding a bounded set of adapters, swapped per static batch: the GPU baseline.

With 1,000 adapters of Llama-7B shape (up to 134 MB each) one ``PeftModel`` cannot hold
them all, so :class:`AdapterSwapper` is ``driver_peft.serve_static_batches``'s
``before_batch`` hook:

* before each static batch, PEFT loads the batch's adapters it does not hold:
  ``add_adapter`` with the adapter's ``LoraConfig`` (in the base model's dtype, no
  upcast), then ``set_peft_model_state_dict`` with its host tensors (the copy to the
  device); that time delays the batch's first tokens, as a server would pay it;
* the host tensors come from ``make_state(k)`` (seconds of host work at 7B shapes, what
  a fetch from a store costs). ``workers`` threads make them one batch ahead: while a
  batch generates, the next batch's missing adapters are prepared, as loramux's loader
  threads prepare adapters while its steps run. A batch whose tensors are not ready
  waits for them (``wait_s``);
* before loading, the least recently used adapters the batch does not use are deleted
  until the batch's missing ones fit within ``resident``, but never the last one (PEFT
  breaks without an adapter); so PEFT holds at most ``max(resident, the batch's
  distinct adapters + 1)`` at any time;
* ``preload(indices)`` loads adapters before the clock starts (Punica's setting).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from loramux.benchmarks.driver_peft import peft_adapter_name
from loramux.benchmarks.workload import WorkloadRequest

# make_state(k) -> (PEFT LoraConfig, PEFT-named host tensors) of workload adapter k
MakeState = Callable[[int], tuple[object, dict]]


def _adapters_of(batch: Iterable[WorkloadRequest]) -> list[int]:
    """The batch's adapter indices, each once, in request order (base requests skipped)."""
    return list(dict.fromkeys(r.adapter for r in batch if r.adapter is not None))


class AdapterSwapper:
    """The adapters a ``PeftModel`` holds, loaded per batch and evicted least recently used."""

    def __init__(
        self,
        model,
        make_state: MakeState,
        *,
        resident: int,
        workers: int,
        held: Sequence[str] = (),
    ):
        if resident < 1 or workers < 1:
            raise ValueError(f"resident and workers must be >= 1, got {resident}, {workers}")
        self.model = model
        self._make_state = make_state
        self._resident = resident
        self._held: OrderedDict[str, None] = OrderedDict.fromkeys(held)  # least recent first
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="peft-prefetch")
        self._pending: dict[int, Future] = {}  # adapter index -> its host tensors
        self.loads = 0
        self.evictions = 0
        self.max_held = len(self._held)
        self.wait_s = 0.0  # waiting for host tensors inside batches
        self.load_s = 0.0  # add_adapter + copying the tensors in

    def before_batch(
        self, batch: Sequence[WorkloadRequest], next_batch: Sequence[WorkloadRequest]
    ) -> None:
        self._hold(_adapters_of(batch))
        for k in _adapters_of(next_batch):
            if peft_adapter_name(k) not in self._held and k not in self._pending:
                self._pending[k] = self._pool.submit(self._make_state, k)

    def preload(self, indices: Iterable[int]) -> None:
        """Load these adapters now (outside any timed batch)."""
        self._hold(list(dict.fromkeys(indices)))

    def _hold(self, indices: list[int]) -> None:
        """Make PEFT hold adapters ``indices``, evicting others first to make room."""
        missing = []
        for k in indices:
            name = peft_adapter_name(k)
            if name in self._held:
                self._held.move_to_end(name)
            else:
                missing.append(k)
        self._evict(keep={peft_adapter_name(k) for k in indices}, room=len(missing))
        for k in missing:
            self._load(k, peft_adapter_name(k))

    def stats(self) -> dict:
        return {
            "adapter_loads": self.loads,
            "adapter_evictions": self.evictions,
            "max_adapters_held": self.max_held,
            "wait_for_host_tensors_s": self.wait_s,
            "load_into_peft_s": self.load_s,
        }

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()

    def _load(self, k: int, name: str) -> None:
        from peft import set_peft_model_state_dict

        started = time.perf_counter()
        future = self._pending.pop(k, None)
        config, state = future.result() if future is not None else self._make_state(k)
        ready = time.perf_counter()
        self.model.add_adapter(name, config, autocast_adapter_dtype=False)
        result = set_peft_model_state_dict(self.model, state, adapter_name=name)
        if result.unexpected_keys:  # a naming mismatch would leave PEFT's own init in place
            raise RuntimeError(f"PEFT ignored tensors of {name}: {result.unexpected_keys[:3]}")
        self._held[name] = None
        self.max_held = max(self.max_held, len(self._held))
        self.loads += 1
        self.wait_s += ready - started
        self.load_s += time.perf_counter() - ready

    def _evict(self, keep: set[str], room: int) -> None:
        """Delete unkept adapters, least recently used first, until ``room`` more fit."""
        for name in list(self._held):
            if len(self._held) + room <= self._resident or len(self._held) == 1:
                return
            if name not in keep:
                self.model.delete_adapter(name)
                del self._held[name]
                self.evictions += 1
