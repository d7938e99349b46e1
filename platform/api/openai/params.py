"""OpenAI's request fields read into what the services take, with the 400s of bad values.

The schemas (``openai/schemas.py``) check JSON types only; what a value means is checked here
(or by ``SamplingParams`` and admission), so a wrong value is a 400 naming the field:

- ``prompt``: a string, a token-id list, or a batch of either (a list of strings or of
  token-id lists); :func:`prompts_of` gives the batch.
- ``suffix``: refused when non-empty (no fill-in-the-middle).
- ``best_of``: candidates per prompt of which the ``n`` of highest total log-probability
  are returned; like OpenAI, it cannot be streamed when it asks for more than ``n``.
- ``echo``: the completion starts with its prompt; ``max_tokens: 0`` (score the prompt,
  generate nothing) is allowed only with it.
- ``priority`` (not OpenAI's; vLLM's): refused, since the operator sets each tenant's.
- ``logit_bias``: OpenAI's ``{"token id": bias}``; keys must be token ids, biases in
  [-100, 100] (the engine checks the ids against its vocabulary).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loramux.platform.errors import Invalid
from loramux.platform.services.inference_request import Sampling

MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a bias's magnitude (the engine's too)

Prompts = str | list[int] | list[str] | list[list[int]]


def prompts_of(prompt: Prompts) -> list[str | list[int]]:
    """The batch a ``prompt`` field holds (one prompt for a string or a token-id list; an
    empty list is one empty prompt, refused as such)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt or isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]  # a token-id list
    return list(prompt)  # type: ignore[arg-type]  # strings or token-id lists


def check_suffix(suffix: str | None) -> None:
    if suffix:
        raise Invalid(
            "suffix is not supported: this server does no fill-in-the-middle insertion. "
            "Send the text before the insertion point as the prompt, without suffix.",
            code="invalid_request",
        )


def check_best_of(best_of: int | None, n: int, *, stream: bool) -> None:
    """What only the API knows of ``best_of`` (its range is admission's): it cannot stream."""
    if stream and best_of is not None and best_of > n:
        raise Invalid(
            f"best_of={best_of} cannot be streamed: the best {n} of the candidates are known "
            "only once all have finished. Send stream: false, or best_of equal to n.",
            code="invalid_sampling_parameters",
        )


def completion_max_tokens(max_tokens: int | None, *, echo: bool) -> int | None:
    """``max_tokens`` of a completion: 0 (only the prompt, scored) needs ``echo``."""
    if max_tokens == 0 and not echo:
        raise Invalid(
            "max_tokens must be >= 1; 0 is allowed only with echo: true (the prompt is "
            "returned, with its logprobs when asked, and nothing is generated)",
            code="invalid_sampling_parameters",
        )
    return max_tokens


def check_no_priority(priority: object) -> None:
    """A request cannot choose its priority: the operator sets each tenant's (unknown fields
    are otherwise ignored, but this one would look as if it had worked)."""
    if priority is not None:
        raise Invalid(
            "priority cannot be set per request: every request of a tenant runs at the "
            "tenant's priority, which the operator sets (PATCH /admin/tenants/<tenant id> "
            'with {"priority": 0-9}, or the UI\'s Tenants page). Leave priority out.',
            code="invalid_request",
        )


def logit_bias_of(bias: Mapping[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` as the engine takes it (token id -> bias); None for none."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key.strip()
        if not token.isdecimal() or not token.isascii():
            raise Invalid(
                f"logit_bias key {key!r} is not a token id: keys are token ids written as "
                'decimal strings, such as {"50256": -100}',
                code="invalid_sampling_parameters",
            )
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise Invalid(
                f"logit_bias[{key!r}] is {value}; a bias must be in "
                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                code="invalid_sampling_parameters",
            )
        out[int(token)] = float(value)
    return out


# The engine's sampling fields that completions and chat bodies carry under their own names.
SAMPLING_FIELDS = (
    "stop",
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "speculative",
    "seed",
)


def sampling_of(body, **extra: Any) -> Sampling:
    """The engine's sampling fields of a completions or chat body, plus ``extra``."""
    given = {name: getattr(body, name) for name in SAMPLING_FIELDS}
    return Sampling(**given, logit_bias=logit_bias_of(body.logit_bias), **extra)
