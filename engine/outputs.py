"""What the engine hands back for a request: tokens, text, finish reason, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from loramux.engine.sampler import TokenLogprobs
from loramux.engine.sequence import RequestMetrics


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated so far
    text: str  # all text so far
    delta_token_ids: list[int] = field(default_factory=list)  # new in this step
    delta_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None
    error_kind: str | None = None  # an ErrorKind when finish_reason is "error"
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # One entry per prompt token (the first None: it has no context) when the request asked
    # for prompt_logprobs: on its first output and its final one, None on the others (and
    # on every output until the whole prompt was computed).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    adapter: str | None = None
    metrics: RequestMetrics | None = None
