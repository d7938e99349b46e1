"""run_isolated: which parts of a failed step are re-run, and what each request gets."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from loramux.engine.executor import NonFiniteOutput
from loramux.engine.isolation import run_isolated
from loramux.engine.scheduler import ScheduledSequence, SchedulerOutput


def plan_of(*adapters, generators=None) -> SchedulerOutput:
    generators = generators or {}
    scheduled = [
        ScheduledSequence(
            SimpleNamespace(request_id=f"r{i}", lora_key=a, generator=generators.get(i)),
            num_tokens=1,
            samples=True,
        )
        for i, a in enumerate(adapters)
    ]
    return SchedulerOutput(scheduled=scheduled, num_batched_tokens=len(scheduled))


def ids(plan: SchedulerOutput) -> list[str]:
    return [item.seq.request_id for item in plan.scheduled]


def test_a_step_that_succeeds_runs_once():
    runs = []
    result = run_isolated(
        lambda p: runs.append(ids(p)) or {r: (1, None) for r in ids(p)}, plan_of(None, 1)
    )
    assert runs == [["r0", "r1"]] and result.failed == {} and result.reruns == 0
    assert set(result.sampled) == {"r0", "r1"}


def test_one_request_at_fault_is_found_by_halving_its_adapters_part():
    runs = []

    def execute(plan):
        runs.append(ids(plan))
        if "r3" in ids(plan):
            raise ValueError("r3 is poison")
        return {r: (7, None) for r in ids(plan)}

    result = run_isolated(execute, plan_of(None, 1, 2, 2, 2, 2))
    assert result.failed.keys() == {"r3"} and "r3 is poison" in result.failed["r3"][1]
    assert set(result.sampled) == {"r0", "r1", "r2", "r4", "r5"}
    # The whole batch, then one part per adapter, then halves of adapter 2's part.
    assert runs[1:4] == [["r0"], ["r1"], ["r2", "r3", "r4", "r5"]]
    assert runs[4:] == [["r2", "r3"], ["r2"], ["r3"], ["r4", "r5"]]
    assert result.reruns == len(runs) - 1


def test_non_finite_rows_within_one_adapter_are_failed_without_rerunning():
    def execute(plan):
        raise NonFiniteOutput(["r1", "r2"], {"r0": (5, None), "r3": (6, None)})

    result = run_isolated(execute, plan_of(None, 1, 1, 2))
    assert result.failed.keys() == {"r1", "r2"} and result.reruns == 0
    assert result.sampled == {"r0": (5, None), "r3": (6, None)}


def test_non_finite_rows_across_adapters_rerun_each_adapter_with_its_generators_restored():
    generator = torch.Generator().manual_seed(3)
    expected = torch.rand(1, generator=torch.Generator().manual_seed(3)).item()
    draws = []

    def execute(plan):
        for item in plan.scheduled:
            if item.seq.generator is not None:
                draws.append(torch.rand(1, generator=item.seq.generator).item())
        if len(plan.scheduled) > 1 or ids(plan) == ["r1"]:  # the mix spreads r1's NaN
            raise NonFiniteOutput(ids(plan), {})
        return {r: (1, None) for r in ids(plan)}

    result = run_isolated(execute, plan_of(None, 1, 2, generators={2: generator}))
    assert result.failed.keys() == {"r1"}
    assert set(result.sampled) == {"r0", "r2"}
    assert draws == [expected, expected]  # the re-run drew what the first run drew
