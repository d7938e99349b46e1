"""How many prompt tokens a step may take: as many as fit in a target time.

A step that prefills thousands of prompt tokens holds everything else for its whole
length: on a CPU, a 2,048-token step lasts seconds, and a request that arrives meanwhile
(another tenant's first token) waits for it, then for its own step. Bounding the prompt
tokens per step by a count (``max_num_batched_tokens``) bounds the step's length only on
the machine and model that count was tuned for. So the engine sizes the prompt budget by
time: the prompt part of a step should last about ``target_s``. It keeps the cost of a
prompt token as its recent steps measured it and gives the next step ``target_s / cost``
of them, within ``[min_tokens, max_tokens]``.

What a step's decodes cost is known from the steps that ran decodes alone: a line
``a + b * rows`` fitted to them (least squares, recent steps weighted most), so that a step
with decodes and a prompt chunk charges the chunk only the rest. The decodes' own time is
not the prompt's to give up: with 64 decodes taking most of the target, prefill would
otherwise crawl at the minimum chunk. A step's length is thus about its decodes' time plus
the target.

The prompt part's cost per token includes what a step costs whatever it holds (the
per-layer dispatch), where the fit has not already counted it. If ``f`` is that fixed part
and ``c`` the cost of one more token, a chunk of ``n`` tokens gives ``n' = target n /
(f + n c)`` next, whose fixed point is ``f + n c = target``: the prompt part converges to
the target whatever ``f`` (the map's slope there is ``f / target < 1``). Only steps that
used at least half their budget are measured, so that a short prompt beside nothing (all
fixed cost) does not shrink the budget for the long ones. Long contexts make a token dearer
(attention), and the budget follows.

The scheduler shares the budget among tenants (its policy 8); this class only sizes it.
"""

from __future__ import annotations

# Weight of the newest measurement in the running cost.
SMOOTHING = 0.3
# Steps that used less than this fraction of their budget are not measured.
MEASURED_FRACTION = 0.5
# The budget before any step was measured: the first long prompt's first step is about this
# long, then the measured cost takes over.
INITIAL_TOKENS = 128
# The prompt part is at least this fraction of a step's time, whatever the decode fit says
# (a fit from other conditions must not make a chunk look free).
MIN_PROMPT_FRACTION = 0.25


class DecodeCost:
    """Seconds of a step of decodes alone as ``a + b * rows``: least squares over the steps
    seen, each older one weighing ``DECAY`` times the next."""

    DECAY = 0.9

    def __init__(self) -> None:
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.DECAY
        self._n = d * self._n + 1
        self._x = d * self._x + rows
        self._y = d * self._y + seconds
        self._xx = d * self._xx + rows * rows
        self._xy = d * self._xy + rows * seconds

    def seconds(self, rows: int) -> float:
        """The fitted time of ``rows`` decode rows (0 before any step was seen)."""
        if rows <= 0 or self._n == 0:
            return 0.0
        spread = self._n * self._xx - self._x * self._x
        if spread <= 1e-9 * max(1.0, self._n * self._xx):  # one batch size seen: a ratio
            return rows * self._y / self._x
        slope = max(0.0, (self._n * self._xy - self._x * self._y) / spread)
        intercept = max(0.0, (self._y - slope * self._x) / self._n)
        return intercept + slope * rows


class PrefillBudget:
    """The prompt tokens of the next step: ``target_s`` over the measured cost of one."""

    def __init__(self, target_s: float | None, max_tokens: int, min_tokens: int):
        if target_s is not None and target_s <= 0:
            raise ValueError(f"a step's target time must be positive, got {target_s}")
        if not 0 < min_tokens <= max_tokens:
            raise ValueError(f"need 0 < min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
        self.target_s = target_s  # None: no time target; max_tokens alone bounds a step
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.seconds_per_token: float | None = None  # measured; None until a step is
        self.decodes = DecodeCost()
        self._budget = (
            max_tokens if target_s is None else _clamp(INITIAL_TOKENS, min_tokens, max_tokens)
        )

    def tokens(self) -> int:
        """The most prompt tokens the next step takes."""
        return self._budget

    def observe(self, prompt_tokens: int, other_rows: int, seconds: float) -> None:
        """A step computed ``prompt_tokens`` prompt tokens and ``other_rows`` decode rows
        (speculative proposals included) in ``seconds``."""
        if self.target_s is None:
            return
        if prompt_tokens == 0:
            if other_rows > 0:
                self.decodes.observe(other_rows, seconds)
            return
        if prompt_tokens < MEASURED_FRACTION * self._budget:
            return
        prompt_part = max(seconds - self.decodes.seconds(other_rows), MIN_PROMPT_FRACTION * seconds)
        cost = prompt_part / prompt_tokens
        if self.seconds_per_token is None:
            self.seconds_per_token = cost
        else:
            self.seconds_per_token += SMOOTHING * (cost - self.seconds_per_token)
        fitting = int(self.target_s / self.seconds_per_token)
        self._budget = _clamp(fitting, self.min_tokens, self.max_tokens)


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))
