"""The scheduler decides each step; it never touches tensors.

Every ``schedule()`` returns a ``SchedulerOutput``: which sequences run, how many of
their tokens are computed (decodes and chunks of prefill share one token budget),
and who was preempted. The runner executes it; ``update()`` then applies the
sampled tokens (stop checks, prefix-cache registration, freeing the finished).
A prompt-only request (``max_tokens`` 0, scoring its prompt's logprobs) never samples:
the update that completes its prompt finishes it, so it never reaches a decode.

Policy, in order:

1. **Running decodes first**, highest priority first, then earliest arrival: each gets
   its next token. When KV blocks run out, a running sequence is *preempted by
   recompute*: its blocks are freed and it goes back to the waiting queue to be computed
   again later. The victim is the lowest priority, then the latest arrival. Running
   sequences still prefilling get their next chunk by policy 8, beside the waiting ones.
2. **Waiting sequences** are admitted in order of priority (higher first), then the
   tenant's *virtual token counter* (lower first; equal counters, the tenant least
   recently served first), then arrival. The counter is the
   VTC fair-share rule (``fair_share.py``): each tenant's counter grows by the tokens served to it divided
   by its weight (prompt tokens count 1, generated tokens 2), and a tenant with nothing
   queued that sends a request starts at the lowest counter among its priority class's
   tenants with requests queued (else running), so neither idling nor asking for less
   than its share banks credit. Within a priority class, tenants thus share token throughput
   in proportion to their weights.

   *The share* is served tokens as VTC counts them: prompt tokens computed (not those
   found in the prefix cache) once and generated tokens twice, each token once however
   often a preemption makes it computed again. That is what the counters equalize
   (weighted), what ``tenant_share`` reports, and, for tenants whose requests have the
   same prompt/output mix, the ratio of the output tokens they receive. A tenant is
   charged when its tokens are scheduled, so the admissions of one step see each other:
   slots freed together go to several tenants, not all to the one lowest at the start.
3. A waiting sequence of a higher priority than some running ones may preempt them
   (lowest priority, latest arrival first) when blocks or sequence slots are short.
4. **Adapter cap** (``max_adapters_per_step``): a step holds at most that many
   distinct adapters (base-model requests don't count). Running sequences' adapters
   are in the step first; a waiting sequence whose adapter would exceed the cap is
   skipped this step and remembers the step it was first skipped. Starvation guard:
   once the longest-skipped sequence has waited ``adapter_wait_steps`` steps, no
   other waiting sequence is admitted (not even for adapters already running) until
   it is. Running sequences finish (each has a finite ``max_tokens``), so its
   adapter's turn comes within a bounded number of steps.
5. **Cold adapters**: a waiting sequence whose adapter is not on the device
   (``adapters.is_ready`` says so; residency loads it in the background) is skipped
   without holding up the sequences behind it. Residency stages adapters only for the
   sequences the next step could admit (``admission_candidates``) and only into memory
   not promised to the KV of running and earlier-staged requests (``lora/staging.py``).
   A sequence whose adapter waits for promised memory (``adapters.waits_for_kv``) counts
   as skipped by the cap: once it has waited ``adapter_wait_steps`` steps, the starvation
   guard of policy 4 admits nothing else until it is, so running requests finish and give
   it the memory, with no preemption. When such an adapter is in host RAM but
   finds no device room because KV blocks are in use where its rows must go, residency
   holds those blocks for it (``KVCacheManager.hold_from``) and says so
   (``adapters.room_wanted``); the scheduler moves the ones in use to free blocks below
   (a copy, not a recompute), and once the adapter has waited
   ``adapter_wait_steps`` steps, if blocks are still in its way for want of free blocks
   below, the running sequences whose blocks are not promised against it (of lower
   priorities, or of other tenants above their KV share; lowest and latest first) are
   preempted until they could all move, so a cold adapter gets its rows within a bounded
   number of steps however long another tenant's running requests are.
6. **Per-tenant KV share**: within a priority class, a tenant is entitled to the share
   of KV blocks and sequence slots its weight gives it among the tenants with requests
   (``weight / sum of their weights``; a slot share rounded up). A waiting sequence of a
   tenant that stays within its share once admitted (for slots: that holds none) may
   preempt running sequences of tenants above theirs whose VTC counter is not below its
   own (the most over-share tenant's latest first), so no tenant can hold all KV memory
   or every slot against the others; when nobody else is waiting, a tenant may use
   everything. Finer slot preemption fought VTC admission (see ``_share_victim``).
7. **A step for a new higher priority**: the step that first schedules a request of a
   higher priority than running ones leaves those lower-priority running sequences out
   (they keep their slots and blocks and lose one step), so the new request's first step
   costs what it does on an idle engine (``_urgent_priority``). With the engine cutting
   the step in flight short when such a request arrives (``step_interrupt.py``), that is
   how priority is protected: by preempting steps, not by reserving slots, which would idle
   capacity whenever the high class is quiet.
8. **Prompt tokens shared fairly**: a step takes at most ``prompt_budget()`` prefill tokens
   (the engine sizes it so that their part of a step lasts about a target time,
   ``prefill_budget.py``)
   and each request at most ``max_prefill_chunk`` of them. They go, a chunk at a time, to
   running prefills and waiting sequences in one order (priority, the tenant's virtual
   counter, the tenant served least recently, arrival), taken afresh after each chunk is
   charged. A tenant's long prompts, prompt lists or ``n`` copies thus hold no other
   tenant's first token for longer than a step: a new request of a tenant with nothing
   queued joins at the lowest counter (policy 2), tied with the busy tenant and served less
   recently, so it is the next in line, and no step lasts long.
9. **A newcomer's first step is short**: when tenants with nothing running have first
   requests waiting (of the highest priority with work), the step's prompt tokens are
   capped at what those requests need, or a quarter of the budget if that is more. They
   are first in the order (policy 8), so they get theirs; the others, a running prefill
   among them, get what is left, a short chunk, and decodes run as always. The newcomer's
   first token then costs about an idle step plus the decodes, not a step full of another
   tenant's long prompt. At most every other step is capped so, so a stream of newcomers
   slows a long prompt's prefill by at most a little over a third; like policy 7 it trades
   a step of throughput for a first token, and only when a tenant starts work. Who is
   admitted, and in what order, is unchanged: the weighted shares hold.
10. **A lone prompt runs at full speed**: when the engine holds one request and it is
    prefilling, nobody's first token waits on it, so its step takes prompt tokens up to
    ``max_num_batched_tokens`` instead of the time budget, and is marked ``solo``: any
    arrival cuts it short (``step_interrupt.py``), not only a higher priority, and the
    next plan shares the budget as policies 8 and 9 say. Small chunks of one prompt cost
    the CPU most of its prefill speed (each chunk re-reads every weight; on the embedded
    default a lone 2,000-token prompt took about twice as long in 0.12 s chunks); the
    arrival that cuts a solo step short waits a layer, not the step, and only the partial
    step's work is lost. Only where the executor can cut a step short (``solo_steps``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from loramux.engine.fair_share import FairShare
from loramux.engine.memory.kv_cache import CachedPrefix, KVCacheManager
from loramux.engine.sequence import ErrorKind, FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens
    # The chunk reaches the last known token, so a new one is sampled (never for a
    # prompt-only request: it finishes there instead).
    samples: bool
    # Speculative decoding: proposed tokens the step computes after the sequence's last one
    # and verifies (a decode only). Not the sequence's tokens until accepted.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_query_tokens(self) -> int:
        """The rows the step computes for it: its tokens and the proposals verified."""
        return self.num_tokens + len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    # In the order the runner lays the batch out: grouped by adapter, so each adapter's
    # tokens form one contiguous segment for the LoRA kernels.
    scheduled: list[ScheduledSequence]
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_prompt_tokens: int = 0  # of those, prefill rows (prompt chunks and recomputes)
    # KV blocks moved out of a waiting adapter's way, (src, dst): the runner copies their
    # contents before anything reads them, whether or not anything is scheduled.
    kv_moves: list[tuple[int, int]] = field(default_factory=list)
    # The step prefills the engine's only request beyond the time budget (policy 10): any
    # arrival must cut it short.
    solo: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class AdapterRoom:
    """A cold adapter waiting for device rows that KV blocks ``[kv_limit, ...)`` stand in."""

    adapter_id: int
    kv_limit: int  # the blocks at and above it must be released for the adapter's rows
    # Running requests that may be preempted for it (lower priorities, tenants above their
    # share); the others' blocks are promised (lora/staging.py) and they are spared.
    preemptible: frozenset[str]
    since_step: int  # the step it started waiting (the starvation bound counts from it)


@dataclass
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_chunk: int | None = None
    max_adapters_per_step: int | None = None
    adapter_wait_steps: int = 16


@dataclass
class _StepDraft:
    """The step being decided: what is scheduled so far and the token budgets left."""

    max_tokens: int  # every row of the step
    max_prompt_tokens: int  # of those, prefill rows (prompt chunks and recomputes)
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    adapters: set[int] = field(default_factory=set)  # distinct adapters in the step
    kv_moves: list[tuple[int, int]] = field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0
    _prefills: set[str] = field(default_factory=set)  # request ids of prefill items

    @property
    def budget(self) -> int:
        return self.max_tokens - self.tokens

    @property
    def prompt_budget(self) -> int:
        return min(self.budget, self.max_prompt_tokens - self.prompt_tokens)

    def add(self, item: ScheduledSequence, prefill: bool) -> None:
        self.scheduled.append(item)
        self.tokens += item.num_query_tokens
        if prefill:
            self.prompt_tokens += item.num_tokens
            self._prefills.add(item.seq.request_id)
        self.adapters.update(item.seq.adapter_ids)

    def drop(self, seq: Sequence) -> None:
        """``seq`` was preempted after it was scheduled: its tokens go back to the budgets."""
        for item in [item for item in self.scheduled if item.seq is seq]:
            self.scheduled.remove(item)
            self.tokens -= item.num_query_tokens
            if item.seq.request_id in self._prefills:
                self.prompt_tokens -= item.num_tokens
        self._prefills.discard(seq.request_id)


# A newcomer's step (policy 9) takes at most this fraction (1/N) of the prompt budget,
# or what the newcomers need if that is more.
NEWCOMER_STEP_SHARE = 4


def _adapter_order(seq: Sequence) -> tuple:
    """Rows of one adapter (or mix) together, the base model's first, so that the runner
    forms LoRA segments."""
    key = seq.lora_key
    if key is None:
        return (0,)
    return (1, key) if isinstance(key, int) else (2, key)


def _preemption_order(seq: Sequence) -> tuple[int, float]:
    """Lowest first: the running sequence preempted first (lowest priority, latest arrival)."""
    return (seq.priority, -seq.metrics.arrival_time)


class AdapterGate(Protocol):
    """What the scheduler asks of adapter residency (``engine/lora/residency.py``)."""

    def is_ready(self, adapter_id: int) -> bool:
        """Whether the adapter is on the device now (else its requests wait)."""
        ...

    def room_wanted(self) -> AdapterRoom | None:
        """The cold adapter whose device rows KV blocks stand in, if one waits (policy 5)."""
        ...

    def waits_for_kv(self, adapter_id: int) -> bool:
        """Whether the adapter waits for device memory promised to requests' KV (policy 5)."""
        ...


class _EveryAdapterReady:
    """The gate of a scheduler without adapter residency (tests of the policy alone)."""

    def is_ready(self, adapter_id: int) -> bool:
        return True

    def room_wanted(self) -> AdapterRoom | None:
        return None

    def waits_for_kv(self, adapter_id: int) -> bool:
        return False


def _no_prompt_cap() -> int:
    return 1 << 62


class Scheduler:
    def __init__(
        self,
        limits: SchedulerLimits,
        kv: KVCacheManager,
        adapters: AdapterGate | None = None,
        prompt_budget: Callable[[], int] = _no_prompt_cap,
        solo_steps: bool = False,
    ):
        self.limits = limits
        # Whether a lone prefilling request may take a step sized by tokens alone (policy
        # 10): only where the executor cuts a step short for an arrival.
        self.solo_steps = solo_steps
        self.kv = kv
        self.adapters = adapters or _EveryAdapterReady()
        # The most prompt (prefill) tokens the next step may take: the engine sizes it so
        # that a step lasts about its target time (prefill_budget.py); capped by the limits.
        self.prompt_budget = prompt_budget
        self.fair = FairShare()
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.step_count = 0
        self.num_preemptions = 0
        self._urgent_seen: set[str] = set()  # request ids policy 7 already made room for
        self._newcomer_step = 0  # the last step that went to newcomers alone (policy 9)

    # --- queue -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        # VTC's lift, within the priority class: a tenant with nothing queued (idle, or
        # only running what it had) joins at the lowest counter among the tenants with
        # requests queued, else among those running. A tenant whose demand stayed below
        # its share would otherwise have banked the difference and then taken more than
        # its weight (a 1:2:4 run: the weight-4 tenant, queued 84% of the time, got 1.07x).
        waiting = {s.tenant for s in self.waiting if s.priority == seq.priority}
        if seq.tenant not in waiting:
            running = {s.tenant for s in self.running if s.priority == seq.priority}
            self.fair.activate(seq.tenant, waiting or running)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.request_id)
        self.fair.forget(seq.request_id)
        self._urgent_seen.discard(seq.request_id)

    def waiting_in_order(self) -> list[Sequence]:
        """The waiting sequences in the order they would be admitted."""
        return sorted(self.waiting, key=self._waiting_order)

    def admission_candidates(self) -> list[Sequence]:
        """The waiting sequences the next step could admit, in admission order: the starving
        one alone (policy 4), else the first as many as there are free slots, and beyond
        them those that may preempt for a slot: of a priority above a running sequence's
        (policy 3), or their tenant's first (policy 6). Adapters are staged for these only."""
        starving = self._starving_sequence()
        if starving is not None:
            return [starving]
        free = self.limits.max_num_seqs - len(self.running)
        lowest = min((s.priority for s in self.running), default=None)
        tenants: set[str | None] = set()
        candidates = []
        for seq in self.waiting_in_order():
            first_of_tenant = seq.tenant not in tenants
            tenants.add(seq.tenant)
            if free > 0:
                free -= 1
            elif not first_of_tenant and (lowest is None or seq.priority <= lowest):
                continue
            candidates.append(seq)
        return candidates

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- decide ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        prompt_budget = max(1, self.prompt_budget())
        lone = self.solo_steps and len(self.waiting) + len(self.running) == 1
        solo = lone and prompt_budget < self.limits.max_num_batched_tokens
        step = _StepDraft(
            max_tokens=self.limits.max_num_batched_tokens,
            max_prompt_tokens=self.limits.max_num_batched_tokens if solo else prompt_budget,
        )
        step.kv_moves = self._make_adapter_room(step.preempted)

        # 1. Running decodes, most important first; the least important running sequences
        #    are preempted when blocks run short. Those below a newly arrived higher
        #    priority sit this step out (policy 7).
        self.running.sort(key=lambda s: (-s.priority, s.metrics.arrival_time))
        urgent = self._urgent_priority()
        queue = [s for s in self.running if urgent is None or s.priority >= urgent]
        # Every running sequence holds its adapter, in the step or not (sitting out, or left
        # for want of budget): the cap counts what runs now and next.
        step.adapters.update(a for s in self.running for a in s.adapter_ids)
        decodes = [s for s in queue if s.num_uncomputed_tokens == 1]
        prefilling = [s for s in queue if s.num_uncomputed_tokens > 1]
        self._schedule_running(decodes, [*decodes, *prefilling], step)
        # 2. Prompt tokens, shared by the fair share (policy 8): running prefills and
        #    waiting sequences in one order.
        self._schedule_prompts(prefilling, step)
        for seq in step.admitted:
            self.waiting.remove(seq)
            self.running.append(seq)

        # Group by adapter (base model first) so the runner can form LoRA segments.
        scheduled = step.scheduled
        scheduled.sort(key=lambda item: _adapter_order(item.seq))
        tokens = sum(item.num_query_tokens for item in scheduled)
        return SchedulerOutput(
            scheduled=scheduled,
            preempted=step.preempted,
            num_batched_tokens=tokens,
            num_prompt_tokens=step.prompt_tokens,
            kv_moves=step.kv_moves,
            solo=solo and step.prompt_tokens > 0,
        )

    def _schedule_running(
        self, order: list[Sequence], unscheduled: list[Sequence], step: _StepDraft
    ) -> None:
        """Schedule each of ``order`` (running sequences) for its next chunk, preempting the
        least important of ``unscheduled`` (or the sequence itself) when blocks run short."""
        for seq in order:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted for an earlier one's blocks
            prefill = seq.num_uncomputed_tokens > 1
            n = self._chunk(seq, step.prompt_budget if prefill else step.budget)
            if n <= 0:
                continue
            unscheduled.remove(seq)
            while not self.kv.can_allocate(seq.request_id, seq.num_computed_tokens + n):
                victim = min(unscheduled, key=_preemption_order, default=seq)
                if _preemption_order(victim) > _preemption_order(seq):
                    victim = seq  # everything left outranks it: it goes itself
                if victim is not seq:
                    unscheduled.remove(victim)
                self._preempt(victim, step.preempted)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            drafts = self._drafts(seq, n, step.budget)
            self.kv.allocate(seq.request_id, seq.num_computed_tokens + n + len(drafts))
            item = self._scheduled(seq, n)
            item.draft_token_ids = drafts
            step.add(item, prefill)

    def _schedule_prompts(self, prefilling: list[Sequence], step: _StepDraft) -> None:
        """Policy 8: the step's prompt tokens go, a chunk at a time, to running prefills and
        waiting sequences in one order: priority, then the tenant's virtual counter (equal
        counters: the tenant served least recently), then arrival. Each chunk is charged as
        it is scheduled and the order taken afresh, so a tenant that has had its share
        yields the rest of the step to the others. Waiting sequences are admitted by
        policies 2-6. A newcomer's step is capped first (policy 9)."""
        self.waiting.sort(key=self._waiting_order)
        newcomers = self._newcomers()
        if newcomers:  # their step is short: the newcomers' tokens and a quarter budget
            needed = sum(seq.num_uncomputed_tokens for seq in newcomers)
            short = max(needed, step.max_prompt_tokens // NEWCOMER_STEP_SHARE)
            step.max_prompt_tokens = min(step.max_prompt_tokens, short)
            self._newcomer_step = self.step_count
        pending = [*((seq, True) for seq in prefilling), *((seq, False) for seq in self.waiting)]
        self._fill_prompts(pending, step)

    def _newcomers(self) -> list[Sequence]:
        """Policy 9: the waiting first requests of tenants with nothing running, of the
        highest priority waiting or running; none if the last step was capped for them."""
        if self._newcomer_step == self.step_count - 1 or not self.waiting:
            return []
        top = max(s.priority for s in (*self.running, *self.waiting))
        busy = {s.tenant for s in self.running}
        return [
            s
            for s in self.waiting
            if s.priority == top and s.tenant not in busy and s.metrics.first_scheduled_time is None
        ]

    def _fill_prompts(self, pending: list[tuple[Sequence, bool]], step: _StepDraft) -> None:
        """Give ``pending`` ((sequence, is running) pairs) prompt tokens in the fair order
        until the step's prompt budget is spent."""
        starving = self._starving_sequence()
        # The first waiting sequence that finds no room stops admission for its priority
        # class's tenant (arrival order within a tenant) and for lower classes; other
        # tenants of its class may still be admitted by their share (policy 6). Running
        # prefills go on: they hold their slots and blocks already.
        stopped_class: int | None = None
        stopped_tenants: set[str | None] = set()
        pending.sort(key=lambda entry: self._waiting_order(entry[0]))
        while pending and step.prompt_budget > 0:
            seq, is_running = pending.pop(0)
            if is_running:
                others = [s for s, r in pending if r and s.status is SequenceStatus.RUNNING]
                self._schedule_running([seq], [seq, *others], step)
                pending.sort(key=lambda entry: self._waiting_order(entry[0]))
                continue
            if seq.status is not SequenceStatus.WAITING or seq in step.admitted:
                continue
            if stopped_class is not None and seq.priority != stopped_class:
                continue
            if seq in step.preempted or (starving is not None and seq is not starving):
                continue
            if seq.tenant in stopped_tenants:
                continue
            if not self._adapters_ready(seq):
                waits = any(self.adapters.waits_for_kv(a) for a in seq.adapter_ids)
                if seq.adapter_blocked_since is None and waits:
                    seq.adapter_blocked_since = self.step_count  # the guard bounds its wait
                continue
            if not self._adapters_fit(seq.adapter_ids, step.adapters):
                if seq.adapter_blocked_since is None:
                    seq.adapter_blocked_since = self.step_count
                continue
            room = self._make_room(seq, step)
            if room is None:
                stopped_class = seq.priority
                stopped_tenants.add(seq.tenant)
                continue
            n, prefix = room, seq.cached_prefix
            self.kv.allocate(seq.request_id, seq.num_computed_tokens + n, prefix)
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.cached_prompt_tokens = seq.num_computed_tokens
            seq.cached_prefix = None
            seq.adapter_blocked_since = None
            seq.status = SequenceStatus.RUNNING
            step.admitted.append(seq)
            step.add(self._scheduled(seq, n), prefill=True)
            # Its tenant was charged for the chunk: the next tokens may be another's.
            pending.sort(key=lambda entry: self._waiting_order(entry[0]))

    def _urgent_priority(self) -> int | None:
        """Policy 7: the priority of a new arrival that outranks running sequences, if any.

        A request of a higher priority than running ones, never scheduled yet and ready to
        run (its adapter on the device, not capped out), gets a step of its own class: the
        lower-priority running sequences sit that one step out (they keep their slots and
        blocks). Its first step then costs what it costs on an idle engine instead of
        carrying every lower-priority decode, which is most of what a flood adds to its
        time to first token. Each request gets this once (``_urgent_seen``), so one that
        cannot be admitted never stalls the others twice.
        """
        if not self.running:
            return None
        lowest = min(s.priority for s in self.running)
        urgent = [
            s
            for s in self.waiting
            if s.priority > lowest
            and s.request_id not in self._urgent_seen
            and s.metrics.first_scheduled_time is None
            and s.adapter_blocked_since is None
            and self._adapters_ready(s)
        ]
        if not urgent:
            return None
        self._urgent_seen.update(s.request_id for s in urgent)
        return max(s.priority for s in urgent)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_uncomputed_tokens, budget)
        if self.limits.max_prefill_chunk is not None and seq.num_uncomputed_tokens > 1:
            n = min(n, self.limits.max_prefill_chunk)
        return n

    def _drafts(self, seq: Sequence, n: int, budget: int) -> list[int]:
        """The proposals a decode verifies this step: as many of ``seq.draft_token_ids`` as
        the token budget and free KV blocks allow (proposals never preempt anything)."""
        proposed = seq.draft_token_ids
        if not proposed or n != 1 or seq.num_uncomputed_tokens != 1:
            return []
        drafts = proposed[: max(0, budget - n)]
        while drafts and not self.kv.can_allocate(
            seq.request_id, seq.num_computed_tokens + n + len(drafts)
        ):
            drafts = drafts[: len(drafts) // 2]
        return list(drafts)

    def _scheduled(self, seq: Sequence, n: int) -> ScheduledSequence:
        reaches_end = seq.num_computed_tokens + n == seq.num_tokens
        item = ScheduledSequence(seq, n, samples=reaches_end and not seq.prompt_only)
        self.fair.charge_scheduled(
            seq.tenant, seq.request_id, seq.num_computed_tokens, n, item.samples
        )
        return item

    def _waiting_order(self, seq: Sequence):
        fair = self.fair
        return (
            -seq.priority,
            fair.counter(seq.tenant),
            fair.recency(seq.tenant),  # equal counters: the least recently served first
            seq.metrics.arrival_time,
        )

    def _adapters_ready(self, seq: Sequence) -> bool:
        return all(self.adapters.is_ready(a) for a in seq.adapter_ids)

    def _adapters_fit(self, adapter_ids: tuple[int, ...], adapters: set[int]) -> bool:
        cap = self.limits.max_adapters_per_step
        new = set(adapter_ids) - adapters
        return cap is None or not new or len(adapters) + len(new) <= cap

    def _starving_sequence(self) -> Sequence | None:
        blocked = [s for s in self.waiting if s.adapter_blocked_since is not None]
        if not blocked:
            return None
        oldest = min(blocked, key=lambda s: s.adapter_blocked_since)
        waited = self.step_count - oldest.adapter_blocked_since
        return oldest if waited >= self.limits.adapter_wait_steps else None

    def _make_adapter_room(self, preempted: list[Sequence]) -> list[tuple[int, int]]:
        """Clear a cold adapter's way (policy 5): move the blocks in use in its hold to free
        blocks below, before anything else takes them; once it has waited long enough,
        preempt the least important of the running sequences residency allows
        (``room.preemptible``) until the rest can move too. Returns the moves for the
        runner to copy."""
        room = self.adapters.room_wanted()
        if room is None:
            return []
        moves = self.kv.move_out_of_hold()
        if self.kv.hold_shortfall <= 0:
            return moves
        if self.step_count - room.since_step < self.limits.adapter_wait_steps:
            return moves
        victims = sorted(
            (s for s in self.running if s.request_id in room.preemptible),
            key=lambda s: (s.priority, -s.metrics.arrival_time),
        )
        for seq in victims:
            if self.kv.hold_shortfall <= 0:
                break
            self._preempt(seq, preempted)
        return moves + self.kv.move_out_of_hold()

    def _share_victim(
        self, seq: Sequence, admitted: list[Sequence], *, blocks_short: bool
    ) -> Sequence | None:
        """A running sequence ``seq`` may preempt by the per-tenant share (policy 6), or None.

        ``seq``'s tenant must stay within its share of what is short (KV blocks, or else
        sequence slots) once admitted; the victim is the latest of the tenant most above its
        share, among the running sequences of ``seq``'s priority and other tenants whose
        virtual counter is not below ``seq``'s tenant's (preempting against the VTC order
        would only give the slot back to the tenant that is behind).

        Slots are whole: a tenant's slot share is rounded up (one slot at least) and only a
        tenant holding none preempts for one. Over time VTC admission divides the slots by
        weight; finer preemption only churned: a tenant of weight 1 among 1:2:4:8 holds a
        slot above its 0.53, was preempted by each freed-slot race and recomputed.
        """
        holders = [*self.running, *admitted]  # admitted this step hold blocks and slots too
        active = {s.tenant for s in (*self.waiting, *holders)}
        weights = {t: self.fair.weights.get(t, 1.0) for t in active}
        capacity = self.kv.limit if blocks_short else self.limits.max_num_seqs
        share = {t: capacity * w / sum(weights.values()) for t, w in weights.items()}
        if not blocks_short:
            share = {t: math.ceil(x) for t, x in share.items()}
        held = dict.fromkeys(active, 0)
        for s in holders:
            held[s.tenant] += len(self.kv.block_table(s.request_id)) if blocks_short else 1
        if blocks_short:
            needed = -(-seq.num_tokens // self.kv.block_size)
            if held[seq.tenant] + needed > share[seq.tenant]:
                return None
        elif held[seq.tenant] > 0:
            return None
        counter = self.fair.counter(seq.tenant)
        candidates = [
            s
            for s in self.running
            if s.priority == seq.priority
            and s.tenant != seq.tenant
            and held[s.tenant] > share[s.tenant]
            and self.fair.counter(s.tenant) >= counter
        ]
        if not candidates:
            return None
        return max(
            candidates,
            key=lambda s: (held[s.tenant] / share[s.tenant], s.metrics.arrival_time),
        )

    def _make_room(self, seq: Sequence, step: _StepDraft) -> int | None:
        """Find a prefix hit and blocks for ``seq``'s next chunk, preempting lower
        priorities if needed. Returns the chunk size, or None if it can't run now."""
        while True:
            if seq.cached_prefix is None:
                seq.cached_prefix = self._find_cached_prefix(seq)
                seq.num_computed_tokens = seq.cached_prefix.num_tokens
            n = self._chunk(seq, step.prompt_budget)
            total = seq.num_computed_tokens + n
            fits_blocks = self.kv.can_allocate(seq.request_id, total, seq.cached_prefix)
            fits_slots = len(self.running) + len(step.admitted) < self.limits.max_num_seqs
            if fits_blocks and fits_slots:
                return n
            victims = [s for s in self.running if s.priority < seq.priority]
            if victims:
                victim = min(victims, key=_preemption_order)
            else:
                victim = self._share_victim(seq, step.admitted, blocks_short=not fits_blocks)
            if victim is None:
                seq.cached_prefix = None  # the handle goes stale; look up afresh next step
                seq.num_computed_tokens = 0
                return None
            step.drop(victim)
            self._preempt(victim, step.preempted)
            # The freed blocks may have been our cached prefix: look it up again.
            seq.cached_prefix = None

    def _find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        # Cached tokens are not computed, so they have no logits: a request still collecting
        # prompt logprobs computes its whole prompt (and is no prefix-cache query). Its blocks
        # are still registered for others, and once its prompt logprobs are complete a
        # recompute after preemption uses the cache again.
        if seq.collects_prompt_logprobs:
            return CachedPrefix()
        return self.kv.find_cached_prefix(seq.all_token_ids, seq.cache_salt)

    def _preempt(self, seq: Sequence, preempted: list[Sequence]) -> None:
        self.running.remove(seq)
        self.kv.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.cached_prefix = None
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)
        preempted.append(seq)

    # --- apply results -------------------------------------------------------------
    def update(
        self,
        output: SchedulerOutput,
        sampled: dict[str, list[tuple[int, object]]],
        now: float,
        prompt_logprobs: dict[str, list] | None = None,
    ) -> list[tuple[Sequence, str, list[int]]]:
        """Advance the scheduled sequences by their computed tokens and emitted tokens.

        ``sampled`` maps request id -> the (token id, logprobs) the step emitted for each
        sequence that sampled: one, or with speculation the accepted proposals and one more;
        ``prompt_logprobs`` request id -> the logprobs of the prompt tokens the step computed
        them for (the runner leaves out those a sequence already has). Tokens are appended
        until one ends the sequence (a stop inside an accepted run ends it there).
        Returns (sequence, new text, new token ids) for every sequence that got tokens, and
        for every prompt-only sequence whose prompt is done (it finishes with none);
        finished ones are released.
        """
        prompt_logprobs = prompt_logprobs or {}
        updates = []
        for item in output.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            emitted = sampled[seq.request_id] if item.samples else []
            text, new = "", []
            for token_id, logprobs in emitted:
                text += seq.append_token(token_id, logprobs, now)
                new.append(token_id)
                if seq.is_finished:
                    break
            # Emitted tokens but the last are accepted proposals: the step computed their KV.
            accepted = min(len(new), len(emitted) - 1) if emitted else 0
            seq.num_computed_tokens += item.num_tokens + accepted
            m = seq.metrics
            m.computed_prompt_tokens = max(
                m.computed_prompt_tokens, min(seq.num_computed_tokens, m.prompt_tokens)
            )
            self.kv.commit(
                seq.request_id, seq.all_token_ids, seq.num_computed_tokens, seq.cache_salt
            )
            if accepted:
                self.fair.charge_accepted(
                    seq.tenant, seq.request_id, accepted, seq.num_computed_tokens
                )
            if item.draft_token_ids and not seq.is_finished:
                self.kv.trim(seq.request_id, seq.num_tokens)  # the rejected proposals' slots
            seq.add_prompt_logprobs(prompt_logprobs.get(seq.request_id, []))
            if new:
                seq.metrics.decode_steps += 1
                updates.append((seq, text, new))
            elif seq.prompt_only and seq.num_computed_tokens == seq.num_tokens:
                updates.append((seq, seq.finish_prompt_only(), []))
            if seq.is_finished:
                self._release(seq)
        return updates

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.request_id)
        self.fair.forget(seq.request_id)
        self._urgent_seen.discard(seq.request_id)

    def fail(self, seq: Sequence, error: str, kind: ErrorKind) -> None:
        """End a sequence the engine cannot serve, releasing whatever it held."""
        self.abort(seq)
        seq.finish_abort(FinishReason.ERROR, error, kind)
