"""Chat answers of a request with tools: ``tool_calls`` in the message and in the stream.

The model writes its calls as one ``<tool_call>[...]</tool_call>`` block at the end of its
answer (``loramux.engine.structured.tool_calls``). A response's choice is that answer read
by ``parse_tool_output``: when it holds calls, the message gets ``tool_calls`` (each
``{"id": "call_...", "type": "function", "function": {"name", "arguments"}}``, arguments
as JSON text), ``content`` is the text before the block or null, and ``finish_reason`` is
``tool_calls`` (instead of ``stop``). An answer whose block did not finish (``max_tokens``,
a stop string) is all content, with its own finish reason.

A stream shows the same answer as it comes: content deltas until the block starts, while
text that may be the start of the tag (and the whitespace before it, which the message's
content drops) is held back; then, once the block is complete, one delta per call with its
id, name and whole arguments (valid OpenAI streaming: clients accumulate ``arguments`` by
concatenation, and one piece is a whole), then ``finish_reason: tool_calls``. Whatever was
held back is sent as content when the choice ends without a complete block. A stream's
first chunk says ``content: null``, as OpenAI's do for tool calls, so an answer that is
only calls accumulates to ``content: null`` as its response would (leading whitespace
before content is the one difference: the stream has shown it before it can know a block
follows). Tokens are billed as they are produced, held back or not.
"""

from __future__ import annotations

import uuid
from typing import Any

from loramux.engine import TOOL_CALL_CLOSE as CLOSE
from loramux.engine import TOOL_CALL_OPEN as OPEN
from loramux.engine import (
    FinishReason,
    ParsedToolCall,
    RequestOutput,
    ToolOutput,
    parse_tool_output,
)
from loramux.platform.api.openai.render import ChatRender
from loramux.platform.services.inference_job import Choice, Tally, delta_logprobs

TOOL_CALLS_FINISH = "tool_calls"


def call_id() -> str:
    """A new tool call's id (OpenAI's form: ``call_`` and 24 characters)."""
    return "call_" + uuid.uuid4().hex[:24]


def tool_call_items(calls: tuple[ParsedToolCall, ...], *, indexed: bool) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` entries (a stream's carry their ``index``)."""
    items = []
    for i, call in enumerate(calls):
        item = {
            "id": call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        items.append({"index": i, **item} if indexed else item)
    return items


def finish_reason(reason: str | None, output: ToolOutput) -> str | None:
    """``tool_calls`` when the model ended its answer with calls, else ``reason``."""
    return TOOL_CALLS_FINISH if output.calls and reason == FinishReason.STOP else reason


class ToolCallSplitter:
    """One streamed answer split into content to show now and its tool-call block.

    :meth:`feed` takes each new piece of text and returns the content that can be shown
    and, once the block is complete, its calls; :meth:`end` returns what was held back
    when the answer ended without a complete block. The parts shown are those of
    ``parse_tool_output`` on the whole text (see the module docstring).
    """

    def __init__(self) -> None:
        self._held = ""  # text not shown yet that may precede the block
        self._block: str | None = None  # from the opening tag on, once it came
        self._plain = False  # the block did not parse: the rest is content
        self.calls: tuple[ParsedToolCall, ...] = ()  # the block's calls, once complete

    def feed(self, text: str) -> tuple[str, tuple[ParsedToolCall, ...]]:
        if self.calls:
            return "", ()  # nothing after the block is shown (nor allowed by the grammar)
        if self._plain:
            return text, ()
        if self._block is not None:
            self._block += text
            return self._try_block()
        text = self._held + text
        start = text.find(OPEN)
        if start >= 0:
            shown = text[:start].rstrip()
            self._held, self._block = text[len(shown) : start], text[start:]
            content, calls = self._try_block()
            return shown + content, calls
        keep = _held_back(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], ()

    def end(self) -> str:
        """What is left to show as content when the answer has ended."""
        if self.calls:
            return ""
        rest = self._held + (self._block or "")
        self._held, self._block = "", None
        return rest

    def _try_block(self) -> tuple[str, tuple[ParsedToolCall, ...]]:
        assert self._block is not None
        end = self._block.find(CLOSE)
        if end < 0:
            return "", ()
        output = parse_tool_output(self._block[: end + len(CLOSE)])
        if output.calls:
            self.calls = output.calls
            return "", output.calls
        self._plain = True  # not calls after all: everything is content, as in the response
        rest = self._held + self._block
        self._held, self._block = "", None
        return rest, ()


def _held_back(text: str) -> int:
    """How many characters at the end of ``text`` may belong to a block yet to come: a
    beginning of the opening tag, and the whitespace before it."""
    cut = len(text)
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:size]):
            cut -= size
            break
    while cut > 0 and text[cut - 1].isspace():
        cut -= 1
    return len(text) - cut


class ToolChatRender(ChatRender):
    """:class:`ChatRender` for a request whose answers may hold tool calls."""

    def __init__(self, tokenizer, job, top_logprobs: int | None):
        super().__init__(tokenizer, job, top_logprobs)
        self._splitters = [ToolCallSplitter() for _ in job.params]

    def choice(self, index: int, sequence: int, choice: Choice) -> dict[str, Any]:
        output = parse_tool_output(choice.text)
        message: dict[str, Any] = {"role": "assistant", "content": output.content}
        if output.calls:
            message["tool_calls"] = tool_call_items(output.calls, indexed=False)
        return {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(choice.logprobs),
            "finish_reason": finish_reason(choice.finish_reason, output),
        }

    def opening(self) -> list[dict[str, Any]]:
        events = super().opening()
        for event in events:
            event["choices"][0]["delta"]["content"] = None
        return events

    def chunks(self, index: int, out: RequestOutput, tally: Tally) -> list[dict[str, Any]]:
        delta = self.delta(index, out, tally)
        if delta["delta"] or delta["finish_reason"] or delta["logprobs"]:
            return [self._envelope(self.chunk_name, [delta])]
        return []  # all held back: nothing to say yet

    def delta(self, index: int, out: RequestOutput, tally: Tally) -> dict[str, Any]:
        splitter = self._splitters[index]
        content, calls = splitter.feed(out.delta_text)
        if out.finished:
            content += splitter.end()
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = tool_call_items(calls, indexed=True)
        reason = None
        if out.finished:
            reason = finish_reason(out.finish_reason, ToolOutput(None, splitter.calls))
        return {
            "index": index,
            "delta": delta,
            "logprobs": self._logprobs(delta_logprobs(out)),
            "finish_reason": reason,
        }
