"""OpenAI's JSON shapes of a job's results: a response, its stream's events, logprobs.

:class:`CompletionRender` shapes ``/v1/completions`` (``text_completion``) and
:class:`ChatRender` ``/v1/chat/completions`` (``chat.completion`` and its chunks), from
the deltas and the :class:`~loramux.platform.services.inference_job.Tally` of a run;
``responses/render.py`` shapes the Responses API the same way.

A completion with ``echo`` starts with its prompt: the text, and with ``logprobs`` the
prompt's tokens first in the logprobs object (the first one's logprob and top_logprobs null:
it has no context), as OpenAI's legacy API returns them; a stream carries the prompt in
each choice's first chunk.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from loramux.engine import RequestOutput, TokenLogprobs
from loramux.platform.services.inference_job import Choice, Job, Tally, delta_logprobs
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


def completion_logprobs(
    tokenizer,
    logprobs: Sequence[TokenLogprobs],
    offset: int,
    prompt: tuple[Sequence[int], Sequence[TokenLogprobs | None]] | None = None,
) -> dict:
    """The completions API's ``logprobs`` object; ``offset`` is where the generated text
    starts. ``prompt`` (its token ids and their entries, echo) comes first, from offset 0;
    an entry of None (the first token's) is a null logprob and null top_logprobs."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    text_offset: list[int] = []

    def add(token_id: int, entry: TokenLogprobs | None, at: int) -> int:
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(None if entry is None else entry.logprob)
        top.append(None if entry is None else {token_text(tokenizer, t): lp for t, lp in entry.top})
        text_offset.append(at)
        return at + len(text)

    if prompt is not None:
        at = 0
        for token_id, entry in zip(*prompt, strict=True):
            at = add(token_id, entry, at)
    for entry in logprobs:
        offset = add(entry.token_id, entry, offset)
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
    """How one API kind renders choices; subclasses fill in the differences.

    A stream is ``opening()``, then ``chunks()`` for each delta, then ``closing()``, each
    event framed by ``sse()``; a failure mid-stream is ``error()`` before the closing.
    """

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
        choices = [
            self.choice(i, sequence, tally.choices[sequence])
            for i, sequence in enumerate(tally.returned())
        ]
        return {**self._envelope(self.object_name, choices), "usage": openai_usage(tally.usage)}

    # --- a stream -------------------------------------------------------------------------
    def sse(self, event: dict[str, Any] | str) -> str:
        """One server-sent event."""
        data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
        return f"data: {data}\n\n"

    def opening(self) -> list[dict[str, Any]]:
        return []

    def chunks(self, index: int, out: RequestOutput, tally: Tally) -> list[dict[str, Any]]:
        """The events of sequence ``index``'s delta ``out`` (not delivered yet)."""
        return [self._envelope(self.chunk_name, [self.delta(index, out, tally)])]

    def error(self, detail: dict[str, str]) -> dict[str, Any]:
        """The event of a failure after the stream started (``detail``: the error object)."""
        return {"error": detail}

    def closing(self, tally: Tally, *, include_usage: bool, failed: bool) -> list[Any]:
        """The last events: the usage chunk when asked for, then ``[DONE]``."""
        events: list[Any] = []
        if include_usage and tally.usage is not None:
            events.append(
                {**self._envelope(self.chunk_name, []), "usage": openai_usage(tally.usage)}
            )
        return [*events, "[DONE]"]

    def choice(self, index: int, sequence: int, choice: Choice) -> dict[str, Any]:
        """Choice ``index`` of the response: what sequence ``sequence`` delivered."""
        raise NotImplementedError

    def delta(self, index: int, out: RequestOutput, tally: Tally) -> dict[str, Any]:
        raise NotImplementedError


class CompletionRender(Render):
    object_name = chunk_name = "text_completion"

    def __init__(self, tokenizer, job: Job, logprobs: int | None, *, echo: bool = False):
        super().__init__(tokenizer, job)
        self.logprobs = logprobs
        self.echo = echo
        self._echoed: dict[int, str] = {}  # prompt index -> its text (decoded once)

    def _prompt_text(self, sequence: int) -> str:
        prompt = sequence // self.job.per_prompt
        if prompt not in self._echoed:
            source = self.job.prompts[prompt].source
            text = source if isinstance(source, str) else self.tokenizer.decode(source)
            self._echoed[prompt] = text
        return self._echoed[prompt]

    def _prompt_entries(self, ids: Sequence[int] | None, entries) -> tuple | None:
        """The echoed prompt's part of the logprobs object, when there is one to show."""
        if not self.echo or self.logprobs is None or entries is None or ids is None:
            return None
        return (ids, entries)

    def choice(self, index: int, sequence: int, choice: Choice) -> dict[str, Any]:
        echoed = self._prompt_text(sequence) if self.echo else ""
        logprobs = None
        if self.logprobs is not None:
            prompt = self._prompt_entries(choice.prompt_token_ids, choice.prompt_logprobs)
            logprobs = completion_logprobs(self.tokenizer, choice.logprobs, len(echoed), prompt)
        return {
            "index": index,
            "text": echoed + choice.text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
        }

    def delta(self, index: int, out: RequestOutput, tally: Tally) -> dict[str, Any]:
        so_far = tally.choices[index]
        # A sequence's first chunk carries its echoed prompt (and the prompt's logprobs).
        opening = self.echo and not so_far.started
        echoed = self._prompt_text(index) if self.echo else ""
        logprobs = None
        if self.logprobs is not None:
            prompt = None
            if opening:
                prompt = self._prompt_entries(out.prompt_token_ids, out.prompt_logprobs)
            offset = len(echoed) + len(so_far.text)
            logprobs = completion_logprobs(self.tokenizer, delta_logprobs(out), offset, prompt)
        return {
            "index": index,
            "text": (echoed if opening else "") + out.delta_text,
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

    def choice(self, index: int, sequence: int, choice: Choice) -> dict[str, Any]:
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
