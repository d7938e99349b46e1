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

Only requests that opted in (``SamplingParams.speculative``, the default) and have no
structured output speculate: a grammar would have to be advanced over proposals and
rolled back on rejection, for requests whose output is short anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from loramux.engine.speculative.draft_length import DraftLength
from loramux.engine.speculative.ngram import NgramIndex

if TYPE_CHECKING:
    from collections.abc import Iterable

    from loramux.engine.sampling_params import SamplingParams
    from loramux.engine.sequence import Sequence


@dataclass
class RequestSpeculation:
    """One request's proposer state: its n-gram index and its draft length."""

    index: NgramIndex
    length: DraftLength


class Speculator:
    """Proposes tokens for the running requests; ``method`` is ``"ngram"``."""

    def __init__(self, *, max_k: int, ngram_max_n: int, ngram_min_n: int, max_model_len: int):
        self.max_k = max_k
        self.ngram_max_n = ngram_max_n
        self.ngram_min_n = ngram_min_n
        self.max_model_len = max_model_len

    def start(self, params: SamplingParams) -> RequestSpeculation | None:
        """A new request's state, or None when it does not speculate."""
        if not params.speculative or params.structured is not None or params.max_tokens < 2:
            return None
        return RequestSpeculation(
            NgramIndex(max_n=self.ngram_max_n, min_n=self.ngram_min_n), DraftLength(self.max_k)
        )

    def propose(self, running: Iterable[Sequence]) -> None:
        """Set ``draft_token_ids`` of every running sequence (empty where none)."""
        for seq in running:
            seq.draft_token_ids = []
            spec = seq.speculation
            if spec is None or seq.num_uncomputed_tokens != 1 or not seq.output_token_ids:
                continue  # prefilling (or recomputing after a preemption): nothing to verify
            room = min(
                seq.params.max_tokens - len(seq.output_token_ids),
                self.max_model_len - seq.num_tokens,
            )
            k = min(spec.length.next_k(), room - 1)
            if k <= 0:
                continue
            spec.index.sync(seq.all_token_ids)
            seq.draft_token_ids = spec.index.propose(k)

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A step verified ``proposed`` of ``seq``'s tokens and accepted ``accepted``."""
        spec = seq.speculation
        spec.length.record(proposed, accepted)
        seq.metrics.spec_proposed_tokens += proposed
        seq.metrics.spec_accepted_tokens += accepted
