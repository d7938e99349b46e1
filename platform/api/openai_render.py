"""OpenAI's JSON shapes of a job's results: a response, its stream's chunks, logprobs.

:class:`CompletionRender` shapes ``/v1/completions`` (``text_completion``) and
:class:`ChatRender` ``/v1/chat/completions`` (``chat.completion`` and its chunks), from
the deltas and the :class:`~loramux.platform.services.inference_job.Tally` of a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loramux.engine import RequestOutput, TokenLogprobs
from loramux.platform.services.inference_job import Job, Tally, delta_logprobs
from loramux.platform.services.metering import Usage


def openai_usage(usage: Usage | None) -> dict[str, Any] | None:
    """OpenAI's ``usage`` object, plus ``cost_micro_usd``: the request's billed numbers."""
    if usage is None:  # not metered yet (the database is down): said nothing rather than 0
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
        "cost_micro_usd": usage.cost_micro_usd,
    }


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer, logprobs: Sequence[TokenLogprobs], offset: int) -> dict:
    """The completions API's ``logprobs`` object; ``offset`` is where the text starts."""
    tokens, token_logprobs, top, text_offset = [], [], [], []
    for entry in logprobs:
        text = token_text(tokenizer, entry.token_id)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        top.append({token_text(tokenizer, t): lp for t, lp in entry.top})
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": text_offset,
    }


def chat_logprobs(tokenizer, logprobs: Sequence[TokenLogprobs], top_n: int) -> dict:
    """The chat API's ``logprobs`` object (``{"content": [...]}``)."""

    def item(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for entry in logprobs:
        alternatives = [item(t, lp) for t, lp in entry.top[:top_n]]
        content.append({**item(entry.token_id, entry.logprob), "top_logprobs": alternatives})
    return {"content": content}


class Render:
    """How one API kind renders choices; subclasses fill in the differences."""

    object_name = ""
    chunk_name = ""

    def __init__(self, tokenizer, job: Job):
        self.tokenizer = tokenizer  # decodes each token's text for logprobs
        self.job = job

    def _envelope(self, name: str, choices: list[dict]) -> dict[str, Any]:
        return {
            "id": self.job.request_id,
            "object": name,
            "created": self.job.created,
            "model": self.job.target.model,
            "choices": choices,
        }

    def response(self, tally: Tally) -> dict[str, Any]:
        choices = [self.choice(i, tally) for i in range(len(tally.choices))]
        return {**self._envelope(self.object_name, choices), "usage": openai_usage(tally.usage)}

    def chunk(self, index: int, out: RequestOutput, tally: Tally) -> dict[str, Any]:
        return self._envelope(self.chunk_name, [self.delta(index, out, tally)])

    def usage_chunk(self, tally: Tally) -> dict[str, Any]:
        return {**self._envelope(self.chunk_name, []), "usage": openai_usage(tally.usage)}

    def opening(self) -> list[dict[str, Any]]:
        return []

    def choice(self, index: int, tally: Tally) -> dict[str, Any]:
        raise NotImplementedError

    def delta(self, index: int, out: RequestOutput, tally: Tally) -> dict[str, Any]:
        raise NotImplementedError


class CompletionRender(Render):
    object_name = chunk_name = "text_completion"

    def __init__(self, tokenizer, job: Job, logprobs: int | None):
        super().__init__(tokenizer, job)
        self.logprobs = logprobs

    def choice(self, index: int, tally: Tally) -> dict[str, Any]:
        choice = tally.choices[index]
        logprobs = None
        if self.logprobs is not None:
            logprobs = completion_logprobs(self.tokenizer, choice.logprobs, 0)
        return {
            "index": index,
            "text": choice.text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
        }

    def delta(self, index: int, out: RequestOutput, tally: Tally) -> dict[str, Any]:
        logprobs = None
        if self.logprobs is not None:
            offset = len(tally.choices[index].text)
            logprobs = completion_logprobs(self.tokenizer, delta_logprobs(out), offset)
        return {
            "index": index,
            "text": out.delta_text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason if out.finished else None,
        }


class ChatRender(Render):
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"

    def __init__(self, tokenizer, job: Job, top_logprobs: int | None):
        super().__init__(tokenizer, job)
        self.top_logprobs = top_logprobs  # None: no logprobs asked for

    def _logprobs(self, entries) -> dict | None:
        if self.top_logprobs is None:
            return None
        return chat_logprobs(self.tokenizer, entries, self.top_logprobs)

    def choice(self, index: int, tally: Tally) -> dict[str, Any]:
        choice = tally.choices[index]
        return {
            "index": index,
            "message": {"role": "assistant", "content": choice.text},
            "logprobs": self._logprobs(choice.logprobs),
            "finish_reason": choice.finish_reason,
        }

    def opening(self) -> list[dict[str, Any]]:
        return [
            self._envelope(
                self.chunk_name,
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            for i in range(len(self.job.params))
        ]

    def delta(self, index: int, out: RequestOutput, tally: Tally) -> dict[str, Any]:
        return {
            "index": index,
            "delta": {"content": out.delta_text},
            "logprobs": self._logprobs(delta_logprobs(out)),
            "finish_reason": out.finish_reason if out.finished else None,
        }
