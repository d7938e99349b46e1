"""What the engine hands back for a request: tokens, text, finish reason, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from loramux.engine.sampler import TokenLogprobs
from loramux.engine.sequence import RequestMetrics, Sequence


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

    @classmethod
    def of(cls, seq: Sequence, delta_text: str = "", delta_ids: list[int] | None = None):
        """``seq``'s output now, with what this step added (``delta_*``)."""
        delta_ids = delta_ids or []
        return cls(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=seq.output_text,
            delta_token_ids=list(delta_ids),
            delta_text=delta_text,
            finished=seq.is_finished,
            finish_reason=None if seq.finish_reason is None else seq.finish_reason.value,
            stop_reason=seq.stop_reason,
            error=seq.error,
            error_kind=None if seq.error_kind is None else seq.error_kind.value,
            logprobs=list(seq.output_logprobs),
            prompt_logprobs=_prompt_logprobs(seq, delta_ids),
            adapter=seq.adapter_label,
            metrics=seq.metrics,
        )


def _prompt_logprobs(seq: Sequence, delta_ids: list[int]):
    """The prompt logprobs for an output: on the request's first token and its final
    output, once all were computed (sent twice, not on every streamed delta)."""
    if seq.prompt_logprobs is None or seq.collects_prompt_logprobs:
        return None
    first_token = bool(delta_ids) and len(seq.output_token_ids) == len(delta_ids)
    return list(seq.prompt_logprobs) if first_token or seq.is_finished else None
