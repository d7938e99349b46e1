"""What one inference request is about, and what it delivered: the values a run carries.

A :class:`Job` is one HTTP request ready to run: who calls (:class:`Caller`), what serves
it (:class:`Target`), its prompts (one, or a batch for the completions API) and one
``SamplingParams`` per *sequence* (an engine request), and what it holds of the tenant's
limits. Sequences are prompt-major: prompt ``p``'s are ``p * per_prompt`` to
``(p + 1) * per_prompt - 1``, where ``per_prompt`` is ``n``, or ``best_of`` when more
candidates are generated than returned. A :class:`Tally` counts, per sequence, what reached
the client, and the prompt tokens the engine prefilled for it: the usage record is made of
it; :meth:`Tally.returned` says which sequences the response shows, in the order of its
choices.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from loramux.engine import (
    FinishReason,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)
from loramux.platform.db.models import Tenant
from loramux.platform.engine_fleet.client import EngineRequest
from loramux.platform.services.deadlines import Deadline
from loramux.platform.services.limit_holds import Holds
from loramux.platform.services.load_shedding import Ticket
from loramux.platform.services.metering import Usage


@dataclass(frozen=True)
class Caller:
    """The tenant's values the run needs, copied out of the ORM row (the session closes)."""

    tenant_id: str
    priority: int
    requests_per_minute: int | None
    tokens_per_minute: int | None
    monthly_budget_micro_usd: int | None = None
    request_timeout_s: float | None = None  # the tenant's default deadline
    max_queued_requests: int | None = None  # the tenant's own queue limit

    @classmethod
    def of(cls, tenant: Tenant) -> Caller:
        return cls(
            tenant.id,
            tenant.priority,
            tenant.requests_per_minute,
            tenant.tokens_per_minute,
            tenant.monthly_budget_micro_usd,
            tenant.request_timeout_s,
            tenant.max_queued_requests,
        )


@dataclass(frozen=True)
class Target:
    """What serves the request: the base model (no adapter), one adapter version, or
    several weighted (``mix``: each version's engine name and its weight)."""

    model: str  # the name the client used (a mix's: its parts' versions); echoed, metered
    engine_adapter: str | None = None
    adapter_id: str | None = None
    adapter_version_id: str | None = None
    mix: tuple[tuple[str, float], ...] | None = None
    # The weights' SHA-256 of the version served (a mix's, joined by "+"): request logs
    adapter_sha256: str | None = None


@dataclass(frozen=True)
class Prompt:
    """One prompt of a job: as the client sent it (text or token ids) and its length."""

    source: str | list[int]
    tokens: int  # as the engine will tokenize it


@dataclass(frozen=True)
class Job:
    """One HTTP request, ready to run."""

    request_id: str  # the response id and the usage record's request id
    created: int
    caller: Caller
    target: Target
    prompts: tuple[Prompt, ...]
    params: tuple[SamplingParams, ...]  # one per sequence, prompt-major (module docstring)
    holds: Holds  # tokens/minute reserved and budget held, settled when the run ends
    deadline: Deadline  # when the run is ended wherever it is (deadlines.py)
    ticket: Ticket | None = None  # its place in the queue until each sequence starts
    end_user: str | None = None  # the request's `user`: stored on its usage record
    n: int = 1  # choices returned per prompt (the best of per_prompt when that is more)

    @property
    def per_prompt(self) -> int:
        """Sequences generated per prompt: ``n``, or ``best_of``."""
        return len(self.params) // len(self.prompts)

    def prompt_of(self, index: int) -> Prompt:
        """The prompt of sequence ``index``."""
        return self.prompts[index // self.per_prompt]

    @property
    def reserved_tokens(self) -> int:
        """Debited from the tokens/minute bucket."""
        return self.holds.reserved_tokens

    def engine_request(self, index: int) -> EngineRequest:
        """Sequence ``index`` as the engine client takes it (its id: the job's, then
        ``-index``)."""
        return EngineRequest(
            request_id=f"{self.request_id}-{index}",
            prompt=self.prompt_of(index).source,
            params=self.params[index],
            adapter=self.target.engine_adapter,
            mix=self.target.mix,
            priority=self.caller.priority,
            tenant=self.caller.tenant_id,
        )


@dataclass
class Choice:
    """What one sequence delivered so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    started: bool = False  # an output of it was delivered (a stream's first chunk went out)
    prompt_token_ids: list[int] | None = None  # the prompt as the engine read it
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # when the request asked
    # Prompt tokens whose KV the engine had for it (computed or prefix-cache hits), the
    # most seen, delivered or not: what an abandoned request is billed for.
    prefilled_tokens: int = 0
    prefilled_cached_tokens: int = 0

    @property
    def total_logprob(self) -> float:
        """The sampled tokens' log-probabilities summed (how ``best_of`` ranks candidates)."""
        return sum(entry.logprob for entry in self.logprobs)


class Tally:
    """Per-sequence accounting of what reached the client.

    A streamed tally counts each delta delivered as the client gets it. A non-streamed one
    (``streamed=False``) collects the deltas for the response and counts them delivered
    only once the run has reached its end (``ended``): a response cut short (client gone,
    engine failure) delivers nothing.

    Whatever reached the client, the run also notes how far the engine got with each
    sequence's prompt (:meth:`prefilled`). A run *abandoned* (the client left, or the
    deadline passed) before it delivered anything is billed for those prompt tokens
    (:attr:`bills_prefill_only`), so that abandoning work is never free.
    """

    def __init__(self, job: Job, *, streamed: bool = True):
        self.choices = [
            Choice(prompt_tokens=job.prompt_of(i).tokens) for i in range(len(job.params))
        ]
        self._n = job.n
        self._per_prompt = job.per_prompt
        self.streamed = streamed
        self.ended = False  # set by the run once it reached its end (the response follows)
        self.expired = False  # set by the run when the deadline ended it
        self.abandoned = False  # set by the run when the client left or the deadline passed
        self.usage: Usage | None = None  # set once the run has ended and was metered

    def deliver(self, index: int, out: RequestOutput) -> None:
        """``out``'s delta reached the client (or, non-streamed, is in the response)."""
        choice = self.choices[index]
        choice.started = True
        if choice.prompt_logprobs is None and out.prompt_logprobs is not None:
            choice.prompt_token_ids = list(out.prompt_token_ids)
            choice.prompt_logprobs = list(out.prompt_logprobs)
        choice.text += out.delta_text
        choice.token_ids.extend(out.delta_token_ids)
        choice.logprobs.extend(delta_logprobs(out))
        if out.finished:
            choice.finish_reason = out.finish_reason
        if out.metrics is not None:
            choice.prompt_tokens = out.metrics.prompt_tokens or choice.prompt_tokens
            choice.cached_prompt_tokens = out.metrics.cached_prompt_tokens

    def prefilled(self, index: int, metrics: RequestMetrics | None) -> None:
        """The engine reported ``metrics`` for sequence ``index`` (an output, or the final
        one of its abort): keep the most prompt tokens it had prefilled. An engine from
        before ``computed_prompt_tokens`` reports none."""
        if metrics is None:
            return
        choice = self.choices[index]
        reached = metrics.computed_prompt_tokens
        if reached > choice.prefilled_tokens:
            choice.prefilled_tokens = reached
            choice.prefilled_cached_tokens = min(metrics.cached_prompt_tokens, reached)

    def returned(self) -> list[int]:
        """The sequences the response shows, in its choices' order (choice ``p * n + i``
        is prompt ``p``'s ``i``-th). With ``best_of``, each prompt's ``n`` candidates of
        the highest total log-probability (the sampled tokens' sum, as vLLM ranks them;
        ties keep generation order); every candidate's tokens are billed all the same."""
        if self._per_prompt == self._n:
            return list(range(len(self.choices)))
        chosen: list[int] = []
        for start in range(0, len(self.choices), self._per_prompt):
            candidates = range(start, start + self._per_prompt)
            ranked = sorted(candidates, key=lambda i: -self.choices[i].total_logprob)
            chosen.extend(ranked[: self._n])
        return chosen

    @property
    def prompt_tokens(self) -> int:
        return sum(c.prompt_tokens for c in self.choices)

    @property
    def cached_prompt_tokens(self) -> int:
        return sum(min(c.cached_prompt_tokens, c.prompt_tokens) for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        """Tokens handed over so far (non-streamed: collected for the response)."""
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def delivered_prompt(self) -> bool:
        """Whether the client has (or gets with the response) the prompt's logprobs."""
        scored = any(c.prompt_logprobs is not None for c in self.choices)
        return scored and (self.streamed or self.ended)

    @property
    def delivered_completion_tokens(self) -> int:
        """Tokens the client has (or gets with the response): what is billed."""
        return self.completion_tokens if self.streamed or self.ended else 0

    @property
    def bills_prefill_only(self) -> bool:
        """Abandoned before anything reached the client: billed for the prompt tokens the
        engine prefilled (``prefilled_prompt_tokens``), with no completion token."""
        delivered = self.delivered_completion_tokens or self.delivered_prompt
        return self.abandoned and not delivered

    @property
    def prefilled_prompt_tokens(self) -> int:
        return sum(c.prefilled_tokens for c in self.choices)

    @property
    def prefilled_cached_tokens(self) -> int:
        return sum(c.prefilled_cached_tokens for c in self.choices)


def delta_logprobs(out: RequestOutput) -> list[TokenLogprobs]:
    """The log-probabilities of ``out``'s new tokens (``out.logprobs`` holds them all)."""
    count = len(out.delta_token_ids)
    return list(out.logprobs[-count:]) if count and out.logprobs else []


def new_request_id(prefix: str, *, separator: str = "-") -> str:
    """A new response id (the Responses API's are ``resp_...``, OpenAI's form)."""
    return f"{prefix}{separator}{uuid.uuid4().hex}"


def stopped_output(job: Job, index: int) -> RequestOutput:
    """The last output of a choice stopped before its end: nothing new, reason ``abort``."""
    return RequestOutput(
        request_id=f"{job.request_id}-{index}",
        prompt_token_ids=[],
        token_ids=[],
        text="",
        finished=True,
        finish_reason=FinishReason.ABORT,
    )
