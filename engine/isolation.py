"""Blast radius of a step: a failure is pinned on the requests that cause it.

A step runs every scheduled request in one batch, so without care one request's failure
(an adapter whose LoRA step raises, weights that compute NaN) ends the step, and with it
every tenant's requests. :func:`run_isolated` runs the batch as usual; only if it fails
does it look for the cause, by running the batch again in parts:

1. one part per adapter (the scheduler groups the batch by adapter, base model first), so
   a faulty adapter is found in one more pass;
2. a part that still fails is halved, and so on down to single requests.

Parts that succeed give their requests the tokens the whole batch would have: greedy
decoding depends only on the request's own rows, and each seeded request's generator is
restored to its state before the step ahead of every run that samples it. (Unseeded
sampling draws from the sampler's shared stream; its values were never reproducible.) A
request that fails on its own is reported with the reason, and the caller fails it alone.

Re-running is safe because nothing of a step is committed before the scheduler's update:
the KV slots a step writes belong to the tokens it computes and a re-run overwrites them,
and prefix-cache registration and token appends happen only afterwards.

Non-finite output (:class:`~loramux.engine.executor.base.NonFiniteOutput`) names the requests
whose tokens came out non-finite. When they all use one adapter (or all the base model),
they are failed at once and the others keep their tokens; when they span several, a
masked-dense LoRA op may have spread one adapter's values to the others' rows, so the
parts are run again as above.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from loramux.engine.executor.base import NonFiniteOutput
from loramux.engine.scheduler import ScheduledSequence, SchedulerOutput
from loramux.engine.sequence import ErrorKind
from loramux.engine.step_interrupt import StepInterrupted

logger = logging.getLogger(__name__)

Sampled = dict[str, list]  # request id -> the (token id, logprobs) it emitted


class EngineDown(RuntimeError):
    """The engine itself cannot go on (a tensor-parallel rank died): no request's fault, so
    nothing is re-run to find one; the engine's caller fails every request and stops."""


Execute = Callable[[SchedulerOutput], Sampled]


@dataclass
class IsolatedStep:
    """A step's results: the sampled tokens of the requests that succeeded, and why the
    others failed (request id -> (kind, reason)). ``reruns`` counts the extra runs it took."""

    sampled: Sampled
    failed: dict[str, tuple[ErrorKind, str]] = field(default_factory=dict)
    reruns: int = 0


def _reason(exc: BaseException) -> tuple[ErrorKind, str]:
    if isinstance(exc, NonFiniteOutput):
        return (
            ErrorKind.NON_FINITE,
            "the model computed non-finite values (NaN or infinity) for this request",
        )
    return (
        ErrorKind.STEP_FAILED,
        f"the engine step failed for this request: {type(exc).__name__}: {exc}",
    )


class _GeneratorStates:
    """Each seeded request's generator state before the step, to replay its draws."""

    def __init__(self, scheduled: list[ScheduledSequence]):
        self._states = {
            item.seq.request_id: (item.seq.generator, item.seq.generator.get_state())
            for item in scheduled
            if item.samples and item.seq.generator is not None
        }

    def restore(self, scheduled: list[ScheduledSequence]) -> None:
        for item in scheduled:
            saved = self._states.get(item.seq.request_id)
            if saved is not None:
                generator, state = saved
                generator.set_state(state)


def run_isolated(execute: Execute, plan: SchedulerOutput) -> IsolatedStep:
    """Run ``plan`` with ``execute``; on failure find and report the requests at fault."""
    states = _GeneratorStates(plan.scheduled)
    try:
        return IsolatedStep(execute(plan))
    except StepInterrupted:
        raise  # not a failure: the engine drops the step (step_interrupt.py)
    except EngineDown:
        raise
    except NonFiniteOutput as exc:
        if len({_adapter_key(plan, rid) for rid in exc.request_ids}) == 1:
            return IsolatedStep(exc.sampled, {rid: _reason(exc) for rid in exc.request_ids})
        first_error: BaseException = exc
    except Exception as exc:  # whatever one request brought; found by re-running below
        first_error = exc
    logger.warning(
        "engine step of %d request(s) failed (%r); re-running it in parts to find the cause",
        len(plan.scheduled),
        first_error,
    )
    result = IsolatedStep(sampled={})
    for part in _adapter_groups(plan.scheduled):
        _run_part(execute, plan, part, states, result)
    for rid, (_, reason) in result.failed.items():
        logger.warning("request %s failed alone in the engine step: %s", rid, reason)
    return result


def _run_part(
    execute: Execute,
    plan: SchedulerOutput,
    part: list[ScheduledSequence],
    states: _GeneratorStates,
    result: IsolatedStep,
) -> None:
    """Run ``part``; if it fails, its halves, down to single requests."""
    states.restore(part)
    result.reruns += 1
    try:
        result.sampled.update(execute(_sub_plan(part)))
        return
    except EngineDown:
        raise
    except NonFiniteOutput as exc:
        if len(part) == 1 or _one_adapter(part):
            # Within one adapter no op mixes requests' rows: the named ones are the cause.
            result.sampled.update(exc.sampled)
            result.failed.update({rid: _reason(exc) for rid in exc.request_ids})
            return
        error: BaseException = exc
    except Exception as exc:
        error = exc
    if len(part) == 1:
        result.failed[part[0].seq.request_id] = _reason(error)
        return
    middle = len(part) // 2
    for half in (part[:middle], part[middle:]):
        _run_part(execute, plan, half, states, result)


def _sub_plan(part: list[ScheduledSequence]) -> SchedulerOutput:
    return SchedulerOutput(scheduled=part, num_batched_tokens=sum(i.num_tokens for i in part))


def _adapter_key(plan: SchedulerOutput, request_id: str):
    for item in plan.scheduled:
        if item.seq.request_id == request_id:
            return item.seq.lora_key
    raise KeyError(request_id)


def _one_adapter(part: list[ScheduledSequence]) -> bool:
    return len({item.seq.lora_key for item in part}) == 1


def _adapter_groups(scheduled: list[ScheduledSequence]) -> list[list[ScheduledSequence]]:
    """The batch's runs of one adapter each, in batch order."""
    groups: list[list[ScheduledSequence]] = []
    for item in scheduled:
        if groups and groups[-1][0].seq.lora_key == item.seq.lora_key:
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups
