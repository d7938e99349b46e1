"""The engine loop and its public Python API.

    engine = Engine(EngineConfig(model="path/to/hf-dir"))
    engine.add_adapter("support-bot", "path/to/peft-dir")
    outs = engine.generate(["Hi", [1, 2, 3]], SamplingParams(max_tokens=32, temperature=0),
                           adapters=["support-bot", None])

Low level: ``add_request`` / ``step`` / ``abort``. One ``step()`` is its policy, in order:
adapter residency prepares (finished loads taken in, the waiting requests' adapters put on
the device where there is room: ``lora/residency.py``), the scheduler decides who runs
(``scheduler.py``), the executor runs the step batch (``step_batch.py``,
``executor/``), the scheduler applies the results, and the observer records them
(``observer.py``). What the engine is made of is built once, in ``build.py``.

A request's way to its first token: ``add_request`` checks it whole and makes its
``Sequence`` (``requests.py``) and, for a cold adapter, starts its load; a later step's
``residency.prepare`` makes the adapter device-resident; ``scheduler.schedule`` admits the
sequence and gives it a chunk of prompt tokens (several steps for a long prompt);
``build_step_batch`` lays the chunk out as rows with its block table and adapter span; the
executor runs the forward, and in the step whose chunk reaches the prompt's end, samples
its first token; ``scheduler.update`` appends it and the observer records the time to it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq
from pathlib import Path

from loramux.engine.build import build_parts
from loramux.engine.config import EngineConfig
from loramux.engine.errors import EngineError, UnknownAdapter
from loramux.engine.executor import Devices
from loramux.engine.lora.adapter import LoRARequest
from loramux.engine.lora.mix import LoRAMix
from loramux.engine.lora.source import AdapterSource
from loramux.engine.metrics import EngineMetrics
from loramux.engine.outputs import RequestOutput
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.scheduler import SchedulerOutput
from loramux.engine.sequence import ErrorKind, FinishReason, Sequence
from loramux.engine.stats import EngineStats
from loramux.engine.step_execution import ExecutedStep
from loramux.engine.structured import CompiledGrammar, StructuredSpec


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        metrics: EngineMetrics | None = None,
        devices: Devices | None = None,
    ):
        """``devices``: where it runs, when not where ``config`` says (a simulated GPU:
        ``engine/simulation/devices.simulated_engine``)."""
        self.config = config
        parts = build_parts(config, metrics, devices)
        # The parts (build.EngineParts) are the engine's attributes: engine.kv, .scheduler, ...
        for part in dataclasses.fields(parts):
            setattr(self, part.name, getattr(parts, part.name))
        self._requests: dict[str, Sequence] = {}
        self._request_ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        """The context limit (prompt and output), as the memory plan capped it."""
        return self.memory_plan.max_model_len

    @property
    def tiers(self):
        """The adapter tiers (``lora/tiers.py``), which residency owns."""
        return self.residency.tiers

    # --- adapters ------------------------------------------------------------------
    def add_adapter(self, name: str, path: str | Path) -> LoRARequest:
        """Make the PEFT adapter in folder ``path`` servable under ``name``.

        It is parsed now, into the host tier (so a bad adapter is refused here, with the
        reason); it goes to the device when a request needs it.
        """
        return self.residency.add(name, path)

    def register_adapter(self, name: str, source: AdapterSource) -> LoRARequest:
        """Make an adapter servable under ``name`` without loading it.

        Its first request queues it for the background loader; requests for it wait
        until it is on the device, without stalling the others. With a disk cache
        configured, sources with a content id are cached on local disk.
        """
        return self.residency.register(name, source)

    def remove_adapter(self, name: str) -> None:
        """Unregister ``name``, freeing its device rows and host memory."""
        request = self.residency.get(name)
        users = (
            0 if request is None else sum(request in s.adapters for s in self._requests.values())
        )
        self.residency.remove(name, users)

    def close(self) -> None:
        """Stop the adapter loader threads (queued loads are dropped). The engine can still
        serve adapters already in RAM or on the device, but loads no more. The other
        tensor-parallel ranks stop: the engine serves nothing more then."""
        self.residency.close()
        self.devices.close()

    def keep_adapter(self, name: str, keep: bool = True) -> None:
        """Pin the adapter ``name`` on the device whether requests use it or not (never
        evicted), or unpin it; ``pinned_adapters`` says whether each pin is honoured."""
        self.residency.keep(name, keep)

    def pinned_adapters(self) -> dict[str, str]:
        """Each pinned adapter -> ``pinned`` when on the device, else why not yet."""
        return self.residency.pin_states()

    def list_adapters(self) -> list[str]:
        return self.residency.names()

    def adapter_residency(self) -> dict[str, str]:
        """Adapter name -> the tier holding it: device, host, loading, store or failed."""
        return self.residency.residency()

    def set_tenant_weight(self, tenant: str | None, weight: float) -> None:
        self.scheduler.fair.set_weight(tenant, weight)

    def set_tenant_priority(self, tenant: str | None, priority: int) -> int:
        """Move the tenant's queued and running requests to ``priority``; returns how many."""
        self.observer.tenant_priorities[tenant] = priority
        changed = 0
        for seq in self._requests.values():
            if seq.tenant == tenant and seq.priority != priority:
                seq.priority = priority
                changed += 1
        return changed

    # --- requests ------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        adapter: str | None = None,
        priority: int = 0,
        tenant: str | None = None,
        mix: Seq[tuple[str, float]] | None = None,
    ) -> None:
        """Queue a request, on the base model, one ``adapter`` or a ``mix`` of adapters
        (names and weights: ``lora/mix.py``). Everything is checked before anything
        changes."""
        if request_id in self._requests:
            raise EngineError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise EngineError("params must be a SamplingParams")
        if adapter is not None and mix is not None:
            raise EngineError("a request names one adapter or a mix of them, not both")
        lora = None if adapter is None else self._registered(adapter)
        lora_mix = None
        if mix is not None:
            try:
                lora_mix = LoRAMix(tuple((self._registered(n), float(w)) for n, w in mix))
            except (TypeError, ValueError) as exc:
                raise EngineError(f"mix: {exc}") from None
        seq = self.requests.make(
            request_id, prompt, params, lora=lora, mix=lora_mix, priority=priority, tenant=tenant
        )
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        for used in seq.adapters:
            self.residency.note_request(used)

    def _registered(self, name: str) -> LoRARequest:
        lora = self.residency.get(name)
        if lora is None:
            raise UnknownAdapter(f"unknown adapter {name!r}; add_adapter() it first")
        return lora

    def compile_structured(
        self, spec: StructuredSpec, tenant: str | None = None
    ) -> CompiledGrammar:
        """``spec`` compiled for this engine's tokenizer (cached per spec and tenant, charged
        to the tenant's share of the cache); EngineError naming the problem if it cannot be
        enforced. Thread-safe: ``AsyncEngine`` calls it off the engine thread before it adds
        the request, so that a slow compile stalls no step."""
        return self.requests.compile_structured(spec, tenant)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self._forget(request_id)
        if seq is None:
            return None
        self.scheduler.abort(seq)
        seq.finish_abort(FinishReason.ABORT)
        self.observer.update_gauges()
        return RequestOutput.of(seq)

    def _forget(self, request_id: str) -> Sequence | None:
        """Drop a request that ended (and its draft-model cache, if any)."""
        if self.speculator is not None:
            self.speculator.forget(request_id)
        return self._requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_work(self) -> bool:
        """Whether a step would do anything: requests to run, or pins to put on the device."""
        return bool(self._requests) or self.residency.pins_pending()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def note_arrival(self, priority: int) -> None:
        """A request of ``priority`` is being submitted from another thread: if it outranks
        the running step, the step is cut short for it (step_interrupt.py). Thread-safe."""
        self.step_interrupt.arrived(priority)

    def stats(self) -> EngineStats:
        """What the engine is doing now: load, KV cache, adapter tiers, recent latency."""
        return self.observer.stats()

    # --- the loop ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that got tokens, and
        for every request ended by an adapter that failed to load."""
        if self.governor is not None:
            self.metrics.compute_threads.set(self.governor.adjust())
        scheduler, residency = self.scheduler, self.residency
        outputs = self._fail_waiting(
            residency.take_loads(), "could not be loaded", ErrorKind.ADAPTER_LOAD_FAILED
        )
        never = residency.prepare(
            scheduler.admission_candidates(),
            scheduler.running,
            scheduler.step_count + 1,
            scheduler.fair.weights,
        )
        outputs += self._fail_waiting(never, "cannot be served", ErrorKind.ADAPTER_TOO_LARGE)
        outputs += self._fail_unmixable()
        if self.speculator is not None:
            self.speculator.propose(scheduler.running)
        plan = scheduler.schedule()
        self.executor.copy_kv_blocks(plan.kv_moves)
        residency.pin_running(scheduler.running)
        self.observer.observe_plan(plan)
        if plan.is_empty:
            self.observer.update_gauges()
            if not outputs:  # nothing can run until a load finishes: wait for one, briefly
                self.clock.idle(residency.wait_for_load, 0.01)
            return outputs
        step = self.execution.run(plan)
        if step is not None:
            self.observer.observe_lora_launches(step.decode_lora_launches)
            outputs += self._fail_in_step(step) + self._apply(plan, step)
            residency.pin_running(scheduler.running)  # finished requests release theirs
        self.observer.update_gauges()
        return outputs

    def _apply(self, plan: SchedulerOutput, step: ExecutedStep) -> list[RequestOutput]:
        """The step's tokens appended (the scheduler's update), observed and handed out."""
        sampled = step.run.sampled
        self.observer.observe_served(plan, sampled)
        updates = self.scheduler.update(plan, sampled, self.clock.now(), step.prompt_logprobs)
        outputs = []
        for seq, text, new_ids in updates:
            # A prompt-only request finishes with no token: nothing generated to observe.
            if new_ids:
                self.observer.observe_tokens(seq, len(new_ids))
            outputs.append(RequestOutput.of(seq, text, new_ids))
            if seq.is_finished:
                self._forget(seq.request_id)
        return outputs

    def _fail_in_step(self, executed: ExecutedStep) -> list[RequestOutput]:
        """End the requests found to make the step fail; the others' tokens stand."""
        step = executed.run
        if not step.failed:
            return []
        self.metrics.step_failures.inc()
        self.metrics.step_reruns.inc(step.reruns)
        self.metrics.requests_failed_in_step.inc(len(step.failed))
        outputs = []
        for request_id, (kind, reason) in step.failed.items():
            seq = self._forget(request_id)
            label = seq.adapter_label
            what = "the base model" if label is None else f"adapter {label!r}"
            self.scheduler.fail(seq, f"{what} failed in the engine step: {reason}", kind)
            outputs.append(RequestOutput.of(seq))
        return outputs

    def _fail_waiting(
        self, errors: dict[int, str], what: str, kind: ErrorKind
    ) -> list[RequestOutput]:
        """End the waiting requests whose adapter is in ``errors`` (adapter id -> why). A
        failed load is retried by the next request for that adapter."""
        if not errors:
            return []
        outputs = []
        for seq in list(self.scheduler.waiting):
            failed = [(a, errors[a.adapter_id]) for a in seq.adapters if a.adapter_id in errors]
            if not failed:
                continue
            lora, error = failed[0]
            outputs.append(self._end_waiting(seq, f"adapter {lora.name!r} {what}: {error}", kind))
        return outputs

    def _fail_unmixable(self) -> list[RequestOutput]:
        """End the waiting mixes with a part on the device that is not plain LoRA (DoRA,
        biases, token rows, experts: ``lora/mix.py``), before they are scheduled."""
        outputs = []
        for seq in [s for s in self.scheduler.waiting if s.mix is not None]:
            why = [(a, self.residency.not_mixable(a.adapter_id)) for a in seq.adapters]
            refused = [(a, reason) for a, reason in why if reason is not None]
            if not refused:
                continue
            lora, reason = refused[0]
            message = f"adapter {lora.name!r} cannot be part of a mix: {reason}"
            outputs.append(self._end_waiting(seq, message, ErrorKind.NOT_MIXABLE))
        return outputs

    def _end_waiting(self, seq: Sequence, message: str, kind: ErrorKind) -> RequestOutput:
        self.scheduler.fail(seq, message, kind)
        self._forget(seq.request_id)
        return RequestOutput.of(seq)

    # --- convenience -------------------------------------------------------------
    def generate(
        self,
        prompts: Seq[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        adapters: Seq[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion, batched together; one output per prompt, in order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        count = len(prompts)
        params_list = (
            [params or SamplingParams()] * count
            if params is None or isinstance(params, SamplingParams)
            else list(params)
        )
        adapter_list = [None] * count if adapters is None else list(adapters)
        if len(params_list) != count or len(adapter_list) != count:
            raise EngineError("prompts, params and adapters must have the same length")
        ids = [f"generate-{next(self._request_ids)}" for _ in range(count)]
        added = []
        try:
            for rid, prompt, p, adapter in zip(
                ids, prompts, params_list, adapter_list, strict=True
            ):
                self.add_request(rid, prompt, p, adapter=adapter)
                added.append(rid)
        except Exception:
            for rid in added:  # leave nothing behind
                self.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < count:
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]
