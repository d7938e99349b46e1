"""What one more verified token costs, measured from the engine's own decode steps.

``DraftLength`` weighs a proposal's expected tokens against ``c``, the cost of verifying
one more token relative to what a request pays for a step. A fixed ``c`` is wrong on most
machines and batch sizes: on this CPU a verified token cost about 0.2 of a batch-1 step
(the fixed model assumed 0.1), and in a batch the whole step slows for every request.

The model. A decode step with ``n`` query tokens (one per request plus the proposals)
takes ``T(n) = a + b·n`` seconds: ``a`` is what does not grow with tokens (reading the
weights, launching the ops), ``b`` the cost per token. ``StepCost`` fits ``a`` and ``b``
by least squares over recent decode-only steps (each step's weight decays by ``decay``
per later step, so it follows a machine whose load changes). Prefill steps are left out:
their cost per token is attention over long contexts, not a verified token's.

From the fit, the cost of a proposal. With ``N`` requests decoding, the engine emits
``Σ E_i`` tokens in ``a + b·(N + Σ k_i)`` seconds. One more proposal of request ``i``
adds ``b`` seconds to a step shared by all ``N``, and is worth it when its extra expected
tokens per extra second beat the step's current rate, ``N / T(N)`` with no one
speculating: ``ΔE / b ≥ N / T(N)``, that is ``ΔE ≥ c`` with::

    c = N·b / (a + b·N)

which is what ``DraftLength`` compares with (at ``N = 1``, ``b / T(1)``: the fraction of
a step one more token costs). ``c`` rises with the batch toward 1: at batch 4 on this CPU
it is about 0.5, so only requests whose proposals are mostly right keep speculating.

Until the fit has seen steps of different sizes (speculation itself varies ``n``) the
prior ``default`` is used; ``c`` is kept within ``[floor, 1]``.
"""

from __future__ import annotations

# A decode step's weight halves after about 35 later steps.
DECAY = 0.98
# Below this weighted variance of the steps' token counts the slope is not identified.
MIN_TOKEN_VARIANCE = 0.25
# Weighted steps the fit needs before it is used.
MIN_WEIGHT = 8.0


class StepCost:
    """A decayed least-squares fit of decode step seconds on query tokens."""

    def __init__(self, *, default: float = 0.1, floor: float = 0.02, decay: float = DECAY):
        if not 0 < floor <= default <= 1:
            raise ValueError(f"StepCost needs 0 < floor <= default <= 1, got {floor}, {default}")
        if not 0 < decay < 1:
            raise ValueError(f"StepCost needs 0 < decay < 1, got {decay}")
        self.default = default
        self.floor = floor
        self.decay = decay
        # Decayed sums: weight, tokens, tokens², seconds, tokens·seconds.
        self._w = self._n = self._nn = self._t = self._nt = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """A decode step of ``tokens`` query tokens took ``seconds``."""
        if tokens <= 0 or not seconds > 0:
            return
        d = self.decay
        self._w = d * self._w + 1.0
        self._n = d * self._n + tokens
        self._nn = d * self._nn + tokens * tokens
        self._t = d * self._t + seconds
        self._nt = d * self._nt + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)`` seconds, or None while the steps seen cannot separate them."""
        if self._w < MIN_WEIGHT:
            return None
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var_n = self._nn / self._w - mean_n * mean_n
        if var_n < MIN_TOKEN_VARIANCE:
            return None
        b = max(0.0, (self._nt / self._w - mean_n * mean_t) / var_n)
        a = mean_t - b * mean_n
        if a <= 0:  # all of the step in the tokens: as costly as it gets
            return 0.0, b
        return a, b

    def verify_cost(self, decoding: int) -> float:
        """``c`` with ``decoding`` requests in the step: see the module docstring."""
        fitted = self.fit()
        if fitted is None or decoding < 1:
            return self.default
        a, b = fitted
        step = a + b * decoding
        if step <= 0:
            return self.default
        return min(1.0, max(self.floor, decoding * b / step))
