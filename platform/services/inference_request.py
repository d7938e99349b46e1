"""One inference request as the routes read it, typed, before admission.

Every OpenAI API (completions, chat, responses) turns its body into an
:class:`InferenceRequest` once (``platform/api/openai/params.py`` and each API's router):
what to generate from (a batch of prompts, or chat messages rendered with the template),
how many choices (``n``, and ``best_of`` candidates ranked by their log-probabilities),
the engine's sampling fields (:class:`Sampling`), the deadline the client asks for and its
end user. Admission (``admission.py``) reads nothing else: it checks it against the model,
the tenant's limits and the queue, and turns it into a ``Job``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loramux.engine import StructuredSpec


@dataclass(frozen=True)
class Sampling:
    """The engine's sampling fields of a request; None leaves the engine's default.

    Each sequence's ``SamplingParams`` is made of these (``admission.build_params``),
    which checks the values (a 400 naming the bad one).
    """

    max_tokens: int | None = None  # None: as many as the context and the limits allow
    stop: str | Sequence[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    speculative: bool | None = None
    seed: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> bias, read and checked
    logprobs: int | None = None  # top log-probabilities per generated token
    prompt_logprobs: int | None = None  # the same per prompt token (echo, scoring)
    structured: StructuredSpec | None = None  # response_format, text.format or tools

    def given(self) -> dict[str, Any]:
        """The fields set, by ``SamplingParams``' names."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return {name: value for name, value in values.items() if value is not None}

    def with_max_tokens(self, max_tokens: int) -> Sampling:
        return dataclasses.replace(self, max_tokens=max_tokens)


@dataclass(frozen=True)
class InferenceRequest:
    """What a client asked for, read from its body by the route (see the module doc).

    Exactly one of ``prompts`` (the completions API's batch: each prompt gets ``n``
    choices) and ``messages`` (chat and responses: rendered with the chat template into
    one prompt).
    """

    request_id: str  # the response's id, the usage record's request id
    sampling: Sampling
    prompts: tuple[str | list[int], ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    n: int = 1
    best_of: int | None = None  # candidates per prompt when more than n (ranked)
    default_max_tokens: int | None = None  # the API's default (completions: 16)
    timeout: float | None = None  # seconds; can only shorten the tenant's and server's
    end_user: str | None = None  # OpenAI's ``user``: kept in the usage record

    def __post_init__(self) -> None:
        if (self.prompts is None) == (self.messages is None):
            raise TypeError("an InferenceRequest has prompts or messages, not both or neither")
