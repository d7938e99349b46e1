"""The Tally's billing rule: what reached the client is billed; a request abandoned (its
client gone, its deadline passed) before anything reached it is billed for the prompt
tokens the engine prefilled; one that failed before delivering anything, for nothing."""

from __future__ import annotations

from loramux.engine import RequestMetrics, RequestOutput, SamplingParams
from loramux.platform.services.inference_job import Caller, Job, Prompt, Tally, Target

PROMPT_TOKENS = 300


def _job(prompts: int = 2) -> Job:
    return Job(
        request_id="cmpl-test",
        created=0,
        caller=Caller("tenant", 0, None, None),
        target=Target("base"),
        prompts=tuple(Prompt([7] * PROMPT_TOKENS, PROMPT_TOKENS) for _ in range(prompts)),
        params=tuple(SamplingParams(max_tokens=8) for _ in range(prompts)),
        holds=None,  # a Tally reads only the prompts and params
        deadline=None,
    )


def _metrics(computed: int, cached: int = 0) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=0.0,
        prompt_tokens=PROMPT_TOKENS,
        cached_prompt_tokens=cached,
        computed_prompt_tokens=computed,
    )


def _token(index: int, computed: int = PROMPT_TOKENS) -> RequestOutput:
    return RequestOutput(
        request_id=f"cmpl-test-{index}",
        prompt_token_ids=[7] * PROMPT_TOKENS,
        token_ids=[5],
        text="x",
        delta_token_ids=[5],
        delta_text="x",
        metrics=_metrics(computed),
    )


def test_an_abandoned_request_that_delivered_nothing_bills_its_prefill():
    tally = Tally(_job(), streamed=False)
    tally.deliver(0, _token(0))  # collected for a response that is never sent
    tally.prefilled(0, _metrics(PROMPT_TOKENS))
    tally.prefilled(1, _metrics(128, cached=64))  # its abort's final output
    tally.prefilled(1, None)  # an output without metrics changes nothing
    tally.prefilled(1, _metrics(64))  # nor does an earlier, smaller count
    tally.abandoned = True
    assert tally.delivered_completion_tokens == 0
    assert tally.bills_prefill_only
    assert (tally.prefilled_prompt_tokens, tally.prefilled_cached_tokens) == (428, 64)


def test_an_abandoned_request_that_delivered_tokens_is_billed_as_delivered():
    tally = Tally(_job(), streamed=True)
    tally.deliver(0, _token(0))
    tally.prefilled(1, _metrics(128))
    tally.abandoned = True
    assert not tally.bills_prefill_only
    assert (tally.prompt_tokens, tally.delivered_completion_tokens) == (2 * PROMPT_TOKENS, 1)


def test_a_request_that_failed_before_delivering_is_not_billed_for_its_prefill():
    tally = Tally(_job(), streamed=False)
    tally.prefilled(0, _metrics(PROMPT_TOKENS))
    assert not tally.abandoned and not tally.bills_prefill_only
    assert tally.delivered_completion_tokens == 0
