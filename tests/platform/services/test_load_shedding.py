"""The load-shedding arithmetic: rates from the engine's request metrics, the predicted wait,
the queue limits and their Retry-After (the HTTP behaviour: tests/platform/api/)."""

from __future__ import annotations

import pytest

from loramux.engine import RequestMetrics, RequestOutput
from loramux.platform.errors import Invalid, QuotaExceeded, Unavailable
from loramux.platform.services.deadlines import request_deadline
from loramux.platform.services.load_shedding import (
    MIN_SAMPLES,
    LoadControl,
    QueueLimits,
    ServiceRates,
)


def output(*, scheduled=10.0, first=10.5, finished=12.0, prompt=100, cached=0, reason="stop"):
    metrics = RequestMetrics(arrival_time=9.0, prompt_tokens=prompt, cached_prompt_tokens=cached)
    metrics.first_scheduled_time, metrics.first_token_time = scheduled, first
    metrics.finished_time = finished
    return RequestOutput("r", [], [], "", finished=True, finish_reason=reason, metrics=metrics)


def measured_control(slots: int = 4, **limits) -> LoadControl:
    control = LoadControl(
        QueueLimits(total=limits.get("total", 100), per_tenant=limits.get("per_tenant", 10)),
        ServiceRates(lambda: slots),
        metrics=None,
    )
    for _ in range(MIN_SAMPLES):
        control.observe(output(), first=True)  # 0.5 s to a first token, 2 s in a slot
    return control


def test_nothing_is_predicted_until_enough_requests_were_measured():
    rates = ServiceRates(lambda: 4)
    for _ in range(MIN_SAMPLES - 1):
        rates.observe_first(output())
        rates.observe_finished(output())
    assert not rates.measured
    rates.observe_first(output())
    rates.observe_finished(output(reason="abort"))  # an aborted request says little
    assert not rates.measured
    rates.observe_finished(output())
    assert rates.measured


def test_the_wait_is_the_queue_ahead_over_the_slots_and_prefill_scales_with_the_prompt():
    rates = measured_control(slots=4).rates
    assert rates.seconds_to_start(8) == pytest.approx(8 * 2.0 / 4)
    assert rates.prefill_seconds(50) == pytest.approx(0.5)  # shorter prompts: one step's worth
    assert rates.prefill_seconds(300) == pytest.approx(1.5)  # 3x the measured prompt
    rates.observe_first(output(first=11.0, cached=50))  # 50 uncached tokens took 1 s
    assert rates.first_token_s.value == pytest.approx(0.5 + 0.2 * 0.5)


def test_a_request_that_cannot_start_in_time_is_refused_with_the_figures():
    control = measured_control(slots=1)
    deadline = request_deadline(600, None, 5.0)
    for _ in range(3):  # the last has 2 ahead: 2 x 2 s + 0.5 s prefill = 4.5 s, it fits
        control.admit("a", 0, 1, 100, deadline, None)
    with pytest.raises(Unavailable) as refused:  # 3 ahead: 6.5 s
        control.admit("a", 0, 1, 100, deadline, None)
    assert refused.value.code == "deadline_unattainable"
    assert "predicted time to first token is 6.50 s (3 queued ahead" in refused.value.message
    assert refused.value.retry_after_s == 6
    # A higher priority has nobody ahead of it.
    control.admit("b", 9, 1, 100, deadline, None)


def test_queue_limits_per_tenant_and_in_all_and_tickets_give_places_back():
    control = measured_control(slots=2, total=4, per_tenant=2)
    far = request_deadline(600, None, None)
    first = control.admit("a", 0, 2, 10, far, None)
    with pytest.raises(QuotaExceeded) as full:
        control.admit("a", 0, 1, 10, far, None)
    assert full.value.code == "queue_full"
    assert full.value.retry_after_s == 1  # one choice to start: 1 x 2 s / 2 slots
    control.admit("b", 0, 2, 10, far, 5)  # b's own limit
    with pytest.raises(QuotaExceeded, match="the server's queue holds 4 of at most 4"):
        control.admit("c", 0, 1, 10, far, None)
    with pytest.raises(Invalid):
        control.admit("c", 0, 3, 10, far, None)  # more than a tenant may ever queue
    first.started(0)
    first.started(0)  # twice counts once
    assert control.queued("a") == 1
    first.close()
    first.close()
    assert (control.queued("a"), control.queued()) == (0, 2)
