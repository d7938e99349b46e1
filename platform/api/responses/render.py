"""The Responses API's JSON: the ``response`` object and its stream's typed events.

One message item with one ``output_text`` part holds the answer. ``status`` is
``completed`` when the model stopped, ``incomplete`` (``incomplete_details.reason``
``max_output_tokens``) when it ran out of tokens, ``incomplete`` without a reason when a
shutdown stopped it, ``failed`` (with ``error``) when the run failed mid-stream.

A stream is ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, one ``response.output_text.delta`` per delta, then
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``
and ``response.completed`` (``response.incomplete`` when incomplete); a failure is an
``error`` event then ``response.failed``. Each event names its ``type`` in the SSE
``event:`` line and in its data, and carries a ``sequence_number`` from 0. There is no
``[DONE]``.
"""

from __future__ import annotations

import json
from typing import Any

from loramux.engine import FinishReason, RequestOutput
from loramux.platform.api.openai.render import Render
from loramux.platform.services.inference_job import Choice, Job, Tally
from loramux.platform.services.metering import Usage

OUTPUT_INDEX = 0  # the one message item
CONTENT_INDEX = 0  # its one output_text part


def responses_usage(usage: Usage | None) -> dict[str, Any] | None:
    """The Responses API's ``usage``, plus ``cost_micro_usd``: the request's billed numbers."""
    if usage is None:  # not metered yet (the database is down)
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "cost_micro_usd": usage.cost_micro_usd,
    }


class ResponsesRender(Render):
    """Renders a one-choice job as a Responses API ``response`` (``settings`` are the
    request's fields a response echoes: instructions, max_output_tokens, temperature,
    top_p, user, metadata, and text when it asks for JSON)."""

    def __init__(self, tokenizer, job: Job, settings: dict[str, Any]):
        super().__init__(tokenizer, job)
        self.settings = settings
        self.item_id = "msg_" + job.request_id.removeprefix("resp_")
        self._sequence = 0  # the next event's sequence_number
        self._error: dict[str, str] | None = None  # a mid-stream failure, for response.failed

    # --- the response object ----------------------------------------------------------
    def _response(
        self, status: str, output: list[dict], usage: Usage | None, **extra: Any
    ) -> dict[str, Any]:
        return {
            "id": self.job.request_id,
            "object": "response",
            "created_at": self.job.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.job.target.model,
            "output": output,
            "parallel_tool_calls": False,
            "previous_response_id": None,
            "store": False,
            "text": self.settings.get("text") or {"format": {"type": "text"}},
            "tool_choice": "none",
            "tools": [],
            "truncation": "disabled",
            "usage": responses_usage(usage),
            **{key: self.settings.get(key) for key in _ECHOED},
            "metadata": self.settings.get("metadata") or {},
            **extra,
        }

    def _item(self, status: str, content: list[dict]) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _finished(self, choice: Choice, usage: Usage | None) -> dict[str, Any]:
        """The whole response of a run that ended (or was cut short: incomplete)."""
        status, details = _status(choice.finish_reason)
        item = self._item(status, [self._part(choice.text)])
        return self._response(status, [item], usage, incomplete_details=details)

    def response(self, tally: Tally) -> dict[str, Any]:
        return self._finished(tally.choices[0], tally.usage)

    # --- the stream -----------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": OUTPUT_INDEX}

    def sse(self, event: dict[str, Any] | str) -> str:
        assert isinstance(event, dict)
        data = json.dumps(event, separators=(",", ":"))
        return f"event: {event['type']}\ndata: {data}\n\n"

    def opening(self) -> list[dict[str, Any]]:
        started = self._response("in_progress", [], None)
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
            self._event(
                "response.output_item.added",
                output_index=OUTPUT_INDEX,
                item=self._item("in_progress", []),
            ),
            self._event(
                "response.content_part.added",
                **self._at(),
                content_index=CONTENT_INDEX,
                part=self._part(""),
            ),
        ]

    def chunks(self, index: int, out: RequestOutput, tally: Tally) -> list[dict[str, Any]]:
        if not out.delta_text:
            return []  # a last output with no new text: the done events say it ended
        return [
            self._event(
                "response.output_text.delta",
                **self._at(),
                content_index=CONTENT_INDEX,
                delta=out.delta_text,
                logprobs=[],
            )
        ]

    def error(self, detail: dict[str, str]) -> dict[str, Any]:
        self._error = detail
        return self._event("error", code=detail["code"], message=detail["message"], param=None)

    def closing(self, tally: Tally, *, include_usage: bool, failed: bool) -> list[Any]:
        choice = tally.choices[0]
        if failed:
            error = {"code": self._error["code"], "message": self._error["message"]}
            item = self._item("incomplete", [self._part(choice.text)])
            failure = self._response("failed", [item], tally.usage, error=error)
            return [self._event("response.failed", response=failure)]
        final = self._finished(choice, tally.usage)
        item = final["output"][0]
        part = item["content"][CONTENT_INDEX]
        ended = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [
            self._event(
                "response.output_text.done",
                **self._at(),
                content_index=CONTENT_INDEX,
                text=choice.text,
                logprobs=[],
            ),
            self._event(
                "response.content_part.done", **self._at(), content_index=CONTENT_INDEX, part=part
            ),
            self._event("response.output_item.done", output_index=OUTPUT_INDEX, item=item),
            self._event(ended, response=final),
        ]


# The request's fields a response object repeats.
_ECHOED = ("instructions", "max_output_tokens", "temperature", "top_p", "user")


def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """A response's status and incomplete_details, from how its one sequence ended."""
    if finish_reason == FinishReason.STOP:
        return "completed", None
    if finish_reason == FinishReason.LENGTH:
        return "incomplete", {"reason": "max_output_tokens"}
    return "incomplete", None  # stopped by a shutdown, or cut short by the deadline
