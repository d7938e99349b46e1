"""The engine's side of speculative decoding: proposals before a step, learning after it.

Before each step the engine asks the :class:`Speculator` for the proposals of the running
requests that are decoding (one uncomputed token: the one sampled last). A request's
proposal is at most ``DraftLength.next_k()`` tokens (its recent acceptance decides), and
never more than it could emit: a step emits the accepted proposals plus one token, so
``k <= remaining max_tokens - 1`` and ``k <= context room - 1``. The scheduler then
decides how many of them the step verifies (it drops them, never preempts for them,
when the token budget or KV blocks run short); the runner verifies them
(``verify.py``); the scheduler's update appends the emitted tokens and calls
:meth:`Speculator.record` with what was proposed and accepted.

Two proposers: ``ngram`` looks the request's last tokens up in its own text
(``ngram.py``, no model); ``draft`` runs a smaller model over a KV cache of its own
(``draft_model.py``), for all the proposing requests at once. A draft model's proposals
cost its forward passes too, so each proposed token counts that cost (the draft's share of
the target's parameters) on top of verifying it when the draft length is chosen.

Only requests that opted in (``SamplingParams.speculative``, the default) and have no
structured output speculate: a grammar would have to be advanced over proposals and
rolled back on rejection, for requests whose output is short anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from loramux.engine.speculative.draft_length import DraftLength
from loramux.engine.speculative.ngram import NgramIndex
from loramux.engine.speculative.step_cost import StepCost

if TYPE_CHECKING:
    from collections.abc import Iterable

    from loramux.engine.sampling_params import SamplingParams
    from loramux.engine.scheduler import SchedulerOutput
    from loramux.engine.sequence import Sequence
    from loramux.engine.speculative.draft_model import DraftModelProposer


# Whose requests' acceptance is pooled: (tenant, adapter id); None for no tenant, the base.
Pool = tuple[str | None, int | None]
# The pooled acceptance evidence of a pool's requests (the prior of its new ones) ages
# by this much per verify step: a memory of about a hundred steps.
POOL_DECAY = 0.99
# Pooled evidence (judged steps, discounted) below which a new request starts optimistic.
MIN_POOLED_EVIDENCE = 4.0

# What verifying one more query token adds to a step, relative to the step, until the
# engine's own decode steps have measured it (step_cost.py).
VERIFY_COST = 0.1


@dataclass
class RequestSpeculation:
    """One request's proposer state: its n-gram index (None with a draft model, whose
    state is the proposer's) and its draft length."""

    index: NgramIndex | None
    length: DraftLength
    pool: Pool = (None, None)  # whose pooled acceptance it adds to


class Speculator:
    """Proposes tokens for the running requests: by n-gram lookup, or with ``draft``."""

    def __init__(
        self,
        *,
        max_k: int,
        ngram_max_n: int,
        ngram_min_n: int,
        max_model_len: int,
        draft: DraftModelProposer | None = None,
    ):
        self.max_k = max_k
        self.ngram_max_n = ngram_max_n
        self.ngram_min_n = ngram_min_n
        self.max_model_len = max_model_len
        self.draft = draft
        self.step_cost = StepCost(default=VERIFY_COST)
        # Fixed by tests that exercise speculation whatever it costs; None: measured.
        self.fixed_cost: float | None = None
        self.proposal_cost = self._cost(1)
        # (tenant, adapter id) -> [accepted, rejected], discounted
        self._pooled: dict[Pool, list[float]] = {}

    def start(self, params: SamplingParams, pool: Pool = (None, None)) -> RequestSpeculation | None:
        """A new request's state, or None when it does not speculate; its draft length
        starts at the recent acceptance of the requests of its ``pool``: the same tenant's
        on the same adapter (never another tenant's, which could slow it)."""
        if not params.speculative or params.structured is not None or params.max_tokens < 2:
            return None
        index = (
            None
            if self.draft is not None
            else NgramIndex(max_n=self.ngram_max_n, min_n=self.ngram_min_n)
        )
        length = DraftLength(
            self.max_k,
            verify_cost=self.proposal_cost,
            prior_acceptance=self.pooled_acceptance(pool),
        )
        return RequestSpeculation(index, length, pool)

    def pooled_acceptance(self, pool: Pool) -> float:
        """The recent acceptance of ``pool``'s requests (1 without enough of it)."""
        accepted, rejected = self._pooled.get(pool, (0.0, 0.0))
        if accepted + rejected < MIN_POOLED_EVIDENCE:
            return 1.0
        return accepted / (accepted + rejected)

    def _cost(self, decoding: int) -> float:
        """A proposed token's cost with ``decoding`` requests in the step: verifying it
        (measured) and, with a draft model, drafting it."""
        if self.fixed_cost is not None:
            return self.fixed_cost
        drafting = 0.0 if self.draft is None else self.draft.relative_cost
        return self.step_cost.verify_cost(decoding) + drafting

    def observe_step(self, plan: SchedulerOutput, seconds: float) -> None:
        """A step ran in ``seconds``: a decode-only one teaches the cost model."""
        if all(item.num_tokens == 1 and item.samples for item in plan.scheduled):
            self.step_cost.observe(sum(item.num_query_tokens for item in plan.scheduled), seconds)

    def propose(self, running: Iterable[Sequence]) -> None:
        """Set ``draft_token_ids`` of every running sequence (empty where none)."""
        running = list(running)
        decoding = sum(1 for seq in running if seq.num_uncomputed_tokens == 1)
        self.proposal_cost = self._cost(decoding)
        wants: list[tuple[Sequence, int]] = []
        for seq in running:
            seq.draft_token_ids, seq.draft_probs = [], None
            spec = seq.speculation
            if spec is None or seq.num_uncomputed_tokens != 1 or not seq.output_token_ids:
                continue  # prefilling (or recomputing after a preemption): nothing to verify
            room = min(
                seq.params.max_tokens - len(seq.output_token_ids),
                self.max_model_len - seq.num_tokens,
            )
            spec.length.verify_cost = self.proposal_cost
            k = min(spec.length.next_k(), room - 1)
            if k <= 0:
                continue
            if spec.index is None:
                wants.append((seq, k))
            else:
                spec.index.sync(seq.all_token_ids)
                seq.draft_token_ids = spec.index.propose(k)
        if self.draft is not None:
            self.draft.forget_all_but(seq.request_id for seq in running)
            if wants:
                self.draft.propose(wants)

    def forget(self, request_id: str) -> None:
        """The request ended: free what the proposer held for it."""
        if self.draft is not None:
            self.draft.forget(request_id)

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A step verified ``proposed`` of ``seq``'s tokens and accepted ``accepted``."""
        spec = seq.speculation
        spec.length.record(proposed, accepted)
        if proposed:
            pooled = self._pooled.setdefault(spec.pool, [0.0, 0.0])
            pooled[0] = POOL_DECAY * pooled[0] + accepted
            pooled[1] = POOL_DECAY * pooled[1] + (accepted < proposed)
        seq.metrics.spec_proposed_tokens += proposed
        seq.metrics.spec_accepted_tokens += accepted
