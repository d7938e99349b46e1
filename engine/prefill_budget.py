"""How many prompt tokens a step may take: as many as fit in a target step time.

A step that prefills thousands of prompt tokens holds everything else for its whole
length: on a CPU, a 2,048-token step lasts seconds, and a request that arrives meanwhile
(another tenant's first token) waits for it, then for its own step. Bounding the prompt
tokens per step by a count (``max_num_batched_tokens``) bounds the step's length only on
the machine and model that count was tuned for. So the engine sizes the prompt budget by
time: it keeps the cost of a prompt token as its recent steps measured it and gives the
next step ``target_s / cost`` of them, within ``[min_tokens, max_tokens]``.

The cost is measured as a step's whole duration over its prompt tokens, fixed costs
included (decodes beside the chunk, the per-layer dispatch). If ``a`` is the fixed part and
``c`` the cost of one more token, a step of ``n`` tokens gives ``n' = target n / (a + n c)``
next, whose fixed point is ``a + n c = target``: the step converges to the target whatever
``a`` (the map's slope there is ``a / target < 1``). Only steps that used at least half
their budget are measured, so that a short prompt beside nothing (all fixed cost) does not
shrink the budget for the long ones. Long contexts make a token dearer (attention), and
the budget follows.

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
        self._budget = (
            max_tokens if target_s is None else _clamp(INITIAL_TOKENS, min_tokens, max_tokens)
        )

    def tokens(self) -> int:
        """The most prompt tokens the next step takes."""
        return self._budget

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        """A step that computed ``prompt_tokens`` prompt tokens (with whatever else it ran)
        took ``seconds``."""
        if self.target_s is None or prompt_tokens < MEASURED_FRACTION * self._budget:
            return
        cost = seconds / prompt_tokens
        if self.seconds_per_token is None:
            self.seconds_per_token = cost
        else:
            self.seconds_per_token += SMOOTHING * (cost - self.seconds_per_token)
        fitting = int(self.target_s / self.seconds_per_token)
        self._budget = _clamp(fitting, self.min_tokens, self.max_tokens)


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))
