"""Running one step's plan: what happens between the scheduler's decision and its update.

The plan is laid out as a step batch (``step_batch.py``) and run by the executor. A failure
is pinned on the requests that cause it (``isolation.py`` runs parts again); a request of
higher priority arriving mid-step cuts the first run short (``step_interrupt.py``: nothing
of it is applied, and the next plan runs that request first). A step run once feeds its
time to the prefill budget (``prefill_budget.py``) and to speculation's cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loramux.engine.clock import Clock
from loramux.engine.executor import Executor, NonFiniteOutput, PromptLogprobs
from loramux.engine.isolation import IsolatedStep, run_isolated
from loramux.engine.lora.pool import LoRAPool
from loramux.engine.memory.kv_cache import KVCacheManager
from loramux.engine.metrics import EngineMetrics
from loramux.engine.prefill_budget import PrefillBudget
from loramux.engine.scheduler import SchedulerOutput
from loramux.engine.speculative.speculator import Speculator
from loramux.engine.step_batch import build_step_batch
from loramux.engine.step_interrupt import StepInterrupt, StepInterrupted


@dataclass
class ExecutedStep:
    """A step's results: the isolated run's tokens and failures, and the prompt logprobs
    of every run (or part) that got that far."""

    run: IsolatedStep
    prompt_logprobs: PromptLogprobs = field(default_factory=dict)
    # LoRA op launches of a decode-only step run whole with adapters (the figure the
    # engine reports); None for any other step
    decode_lora_launches: int | None = None


class StepExecution:
    def __init__(
        self,
        executor: Executor,
        kv: KVCacheManager,
        pool: LoRAPool,
        interrupt: StepInterrupt,
        prefill_budget: PrefillBudget,
        speculator: Speculator | None,
        metrics: EngineMetrics,
        clock: Clock,
    ):
        self.executor, self.kv, self.pool = executor, kv, pool
        self.interrupt, self.prefill_budget = interrupt, prefill_budget
        self.speculator, self.metrics = speculator, metrics
        self.clock = clock  # a step's seconds feed the prefill budget: simulated ones in simulation

    def run(self, plan: SchedulerOutput) -> ExecutedStep | None:
        """The plan's results; None when a higher-priority arrival cut it short."""
        self.interrupt.begin(max(item.seq.priority for item in plan.scheduled), solo=plan.solo)
        prompt_logprobs: PromptLogprobs = {}
        launches: list[int] = []
        started = self.clock.now()
        try:
            run = run_isolated(self._execute_interruptible(prompt_logprobs, launches), plan)
        except StepInterrupted:
            self.metrics.steps_interrupted.inc()
            return None
        finally:
            self.interrupt.end()
        if not run.reruns:
            seconds = self.clock.now() - started
            decodes = plan.num_batched_tokens - plan.num_prompt_tokens
            if not plan.solo:  # a solo step's tokens cost what a big chunk's do, not a budget's
                self.prefill_budget.observe(plan.num_prompt_tokens, decodes, seconds)
            if self.speculator is not None:
                self.speculator.observe_step(plan, seconds)
                self.metrics.spec_proposal_cost.set(self.speculator.proposal_cost)
        decode_launches = launches[0] if launches and not run.reruns else None
        return ExecutedStep(run, prompt_logprobs, decode_launches)

    def _execute_interruptible(self, prompt_logprobs: PromptLogprobs, launches: list[int]):
        """The executor's execute, interruptible by a higher-priority arrival on its first
        run only (a re-run that isolates a failure must finish: its parts sample).

        It returns the sampled tokens, as ``run_isolated`` takes them; the prompt logprobs
        of every run (or part) that got that far are collected into ``prompt_logprobs``
        (a part run again overwrites its requests' with the same values), and the LoRA
        launches of a decode-only run with adapters into ``launches``.
        """
        runs = 0

        def execute(part: SchedulerOutput):
            nonlocal runs
            interruptible = runs == 0 and self.executor.interruptible
            self.executor.interrupt = self.interrupt.check if interruptible else None
            runs += 1
            batch = build_step_batch(part, self.kv.block_table, self.pool.step_table)
            try:
                result = self.executor.execute(batch)
            except NonFiniteOutput as exc:  # the others' results stand
                prompt_logprobs.update(exc.prompt_logprobs)
                raise
            prompt_logprobs.update(result.prompt_logprobs)
            counted = result.lora_launches is not None and batch.forward.lora is not None
            if counted and batch.forward.is_decode_only:
                launches.append(result.lora_launches)
            return result.sampled

        return execute
