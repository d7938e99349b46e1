"""How many tokens a request proposes each step, from how many of its proposals were accepted.

Speculation is a bet. Verifying ``k`` proposals makes a step longer (each proposal is one
more query token), and pays off only in the tokens it lets the step emit. A request that
copies its prompt wins it almost every time; one whose proposals are wrong only pays.
:class:`DraftLength` keeps one request's odds and picks the ``k`` that maximises its
expected tokens per unit of step cost.

The model
---------
A draft token is accepted with probability ``α`` given that the ones before it were
(per-token acceptance: verification stops at the first rejection). With ``k`` drafts a
step emits the accepted prefix plus one token from the target, so its expected tokens
are::

    E(k) = 1 + α + α² + … + α^k = (1 − α^(k+1)) / (1 − α)          (E(k) = k + 1 at α = 1)

and its cost, in decode steps, is ``C(k) = 1 + c·k``: ``c`` is what one more verified
token adds to a step relative to the step itself (``verify_cost``). On the CPU an extra
query token in a batch-1 step costs about 5–20% of the step; on a GPU, where decode is
memory-bound, much less; in a batch the whole step slows for every request. The engine
measures it from its own decode steps and sets it before each step (``step_cost.py``,
through the ``Speculator``; a draft model adds its own forward passes); the default 0.1
holds until then. The next ``k`` is::

    k* = argmax over k in 0..max_k of  E(k) / C(k)                  (ties: the smaller k)

``k = 0`` scores 1 (plain decoding), so speculation runs only where it is expected to
beat it; ``k = 1`` beats it exactly when ``α > c``. ``E`` is concave in ``k`` and ``C``
affine, so the score rises to one peak and falls; ``max_k`` is small, so all of it is
scored.

The estimate of α
-----------------
A step that verified ``p`` drafts and accepted ``a`` of them saw ``a`` acceptances and,
when ``a < p``, one rejection; the drafts after the first rejection were never judged.
Under the model above the likelihood of the step is ``α^a (1 − α)^[a<p]``, so the
maximum-likelihood estimate over steps is::

    α̂ = Σ a / (Σ a + Σ [a < p])

— not ``Σ a / Σ p``, which counts the unjudged tail as rejections and, with
``p = 4`` and ``α = 0.5``, reads about 0.23. To follow a request whose text changes
(free prose, then a quoted block), both sums are discounted: each step multiplies the
older evidence by ``decay`` (default 0.9, a memory of about ``1/(1 − decay)`` = 10
steps). That is the mean of a Beta posterior whose counts age.

The memory is long on purpose: the two mistakes cost differently. Speculating on text
that stopped matching wastes ``c·k`` of a step (0.4 at ``k = 4``); not speculating on
text that matches forgoes up to ``k`` tokens. So after a long copied span (whose steps
each add ``k`` acceptances) the estimate takes some 35 rejected steps, at falling ``k``,
to back off; in simulations of alternating copied and free spans a shorter memory
(decay 0.6 to 0.8) did worse, not better.

The prior is one pseudo-observation split as ``prior_acceptance`` acceptances and the rest
rejections, so a new request starts at ``α̂ = prior_acceptance``. The ``Speculator`` sets
it from the recent acceptance of the same tenant's requests on the same adapter (their
verify steps' evidence, pooled and discounted), so a new request of a workload that copies
starts proposing ``max_k`` and one of a workload whose proposals fail starts backed off
instead of paying for a few optimistic steps; with no such evidence yet it is 1, the
optimistic start. The pseudo-observation weighs as much as one judged draft and decays
like real evidence, so a few steps of the request's own outweigh it.

Backing off, and probing
------------------------
When ``k* = 0`` nothing is verified and nothing is learned, so on its own ``α̂`` would
never rise again. Every ``probe_interval`` steps without speculation the request probes
with ``k = 1``. A probe that is rejected doubles the interval, up to
``max_probe_interval``; one that is accepted resets it, so a request whose text has
turned copy-heavy gets its next probe within ``max_probe_interval`` steps and, from
then on, probes every ``probe_interval`` steps until the acceptances bring ``k*`` back
above 0 (at the defaults one or two accepted probes do; ``k`` then climbs to ``max_k``
in about ten steps). A probe stays offered until a step records it: a step that proposed
nothing (no n-gram match, or the scheduler had no room) tells nothing.

What it costs where speculation never pays (``α = 0``): until backing off, a few steps
of shrinking ``k`` (about one decode step's worth in all at the defaults); after, one
probe of cost ``c`` per interval, at most ``c / probe_interval`` of throughput (2.5% at
the defaults) and falling to ``c / max_probe_interval`` (0.16%).

The clock is :meth:`DraftLength.next_k`: the engine calls it once per decode step of the
request (and :meth:`DraftLength.record` after each step that verified something).
Everything is deterministic.
"""

from __future__ import annotations


def expected_tokens(acceptance: float, k: int) -> float:
    """``E(k) = 1 + α + … + α^k``: a step's expected tokens with ``k`` drafts."""
    # The sum, not the closed form, which divides by zero at α = 1.
    total, term = 0.0, 1.0
    for _ in range(k + 1):
        total += term
        term *= acceptance
    return total


def tokens_per_cost(acceptance: float, k: int, verify_cost: float) -> float:
    """``E(k) / (1 + c·k)``: expected tokens per decode step's worth of work."""
    return expected_tokens(acceptance, k) / (1.0 + verify_cost * k)


def best_draft_length(acceptance: float, max_k: int, verify_cost: float) -> int:
    """The ``k`` in ``0..max_k`` with the most tokens per cost (the smallest on a tie)."""
    best_k, best_score = 0, 1.0  # k = 0: one token for one step
    for k in range(1, max_k + 1):
        score = tokens_per_cost(acceptance, k, verify_cost)
        if score > best_score:
            best_k, best_score = k, score
    return best_k


class DraftLength:
    """One request's draft length: ``next_k()`` before a step, ``record()`` after it."""

    def __init__(
        self,
        max_k: int,
        *,
        verify_cost: float = 0.1,
        decay: float = 0.9,
        probe_interval: int = 4,
        max_probe_interval: int = 64,
        prior_acceptance: float = 1.0,
    ):
        if max_k < 1:
            raise ValueError(f"DraftLength needs max_k >= 1, got {max_k}")
        if verify_cost <= 0:
            raise ValueError(f"DraftLength needs verify_cost > 0, got {verify_cost}")
        if not 0 < decay < 1:
            raise ValueError(f"DraftLength needs 0 < decay < 1, got {decay}")
        if not 0 <= prior_acceptance <= 1:
            raise ValueError(
                f"DraftLength needs 0 <= prior_acceptance <= 1, got {prior_acceptance}"
            )
        if not 1 <= probe_interval <= max_probe_interval:
            raise ValueError(
                "DraftLength needs 1 <= probe_interval <= max_probe_interval, "
                f"got {probe_interval} and {max_probe_interval}"
            )
        self.max_k = max_k
        self.verify_cost = verify_cost
        self.decay = decay
        self.first_probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        # Discounted evidence: acceptances, and steps that ended in a rejection. The
        # prior is one pseudo-observation at prior_acceptance (1: propose max_k at once).
        self._accepted = prior_acceptance
        self._rejected = 1.0 - prior_acceptance
        # While backed off: steps backed off since the last recorded probe, the current
        # spacing of probes, and whether a probe is offered and not yet recorded.
        self._steps_since_probe = 0
        self._probe_interval = probe_interval
        self._probe_offered = False

    @property
    def acceptance(self) -> float:
        """α̂: the estimated probability that a draft is accepted, given the ones before it."""
        # The prior's two counts sum to 1 and every record adds at least 1 to one of them
        # (an acceptance or a rejection), so the sum is always at least 1 times the decay.
        return self._accepted / (self._accepted + self._rejected)

    @property
    def probe_interval(self) -> int:
        """Steps between probes while backed off (grows while probes fail)."""
        return self._probe_interval

    def next_k(self) -> int:
        """How many tokens to propose this step; 0: verify nothing. Call once per step."""
        k = best_draft_length(self.acceptance, self.max_k, self.verify_cost)
        if k > 0:
            return k
        # Only a recorded probe resets the count, so an offered probe stays offered.
        self._steps_since_probe += 1
        if self._steps_since_probe >= self._probe_interval:
            self._probe_offered = True
            return 1
        return 0

    def record(self, proposed: int, accepted: int) -> None:
        """A step verified ``proposed`` drafts and accepted the first ``accepted`` of them."""
        if not 0 <= accepted <= proposed:
            raise ValueError(
                f"DraftLength.record needs 0 <= accepted <= proposed, got {accepted} of {proposed}"
            )
        if proposed == 0:
            return  # nothing was judged
        rejected = accepted < proposed
        self._accepted = self.decay * self._accepted + accepted
        self._rejected = self.decay * self._rejected + rejected
        if self._probe_offered:
            self._probe_offered = False
            self._steps_since_probe = 0
            if rejected:
                self._probe_interval = min(2 * self._probe_interval, self.max_probe_interval)
            else:
                self._probe_interval = self.first_probe_interval
