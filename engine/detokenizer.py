"""Incremental detokenization with stop strings, one sequence at a time.

The engine produces one token id per step and wants to stream text. Decoding the
whole output again at every step would cost O(n) per token (O(n²) per
sequence), and decoding each token on its own is wrong: byte-level BPE tokens
can carry a fraction of a UTF-8 character, and SentencePiece tokenizers drop the
leading space of the first token they decode.

The approach is a sliding window over the token ids with two offsets:

* ``prefix_offset``: where the window starts. Tokens before it are done.
* ``read_offset``: tokens in ``[prefix_offset, read_offset)`` have already been
  turned into emitted text.

At each token we decode ``ids[prefix_offset:]`` and take what follows the text
of ``ids[prefix_offset:read_offset]`` (decoded once, when the window last
slid). Decoding a window that starts one "emission" back, rather than at the new
token, gives the tokenizer the context it needs to place spaces and join bytes. If the window's text ends in U+FFFD the last character
is still incomplete, so nothing is emitted and the offsets stay put until a
later token completes it (or ``finish()`` releases it as U+FFFD, exactly as
``tokenizer.decode`` would). Once text is emitted the window slides forward
(``prefix_offset`` to the old ``read_offset``, ``read_offset`` to the end) and
the ids behind it are dropped, so each step decodes only a handful of tokens:
O(1) per token.

The window starts on a few prompt tokens, so the first output token is decoded
as a continuation (its leading space kept) rather than as the start of a text.

Stop strings are matched on top of that, in the text not yet shown ("pending").
The longest suffix of the pending text that is a prefix of some stop string is
held back, since the next token could complete it; therefore a stop string can
never be partially streamed, and any occurrence lies wholly inside the pending
text when it completes. If several stop strings occur, the one that completes
first wins (the one a reader going left to right would see end first; ties go
to the one that starts earlier). That choice does not depend on how the text
happens to be split into tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["IncrementalDetokenizer", "TextDelta"]

# How many prompt tokens to decode ahead of the output as context. A few are
# enough for the tokenizer to treat the first output token as a continuation.
PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


@dataclass
class TextDelta:
    text: str  # new text safe to show now (may be "")
    stop_string: str | None  # the stop string that ended the output, if one matched on this token


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas for one sequence."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # An empty stop string would match everywhere; it can only be a caller mistake.
        self._stop = tuple(dict.fromkeys(s for s in stop if s))
        self._include_stop = include_stop_str_in_output

        context = [int(t) for t in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]]
        # A prompt cut in the middle of a UTF-8 character would make its tail bytes
        # merge with the output's first bytes; decode(output_ids) would show those as
        # U+FFFD instead. Drop the context rather than change the output text.
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context = []

        # The window: the ids from prefix_offset on (prompt context first, then output
        # ids). Ids before it are deleted as the window slides, so memory, like time,
        # stays O(1) per token and prefix_offset is always 0 in this list.
        self._window: list[int] = context
        self._read_offset = len(context)
        # decode(window[:read_offset]), kept so a step that emits nothing decodes once.
        self._prefix_text = self._decode(context) if context else ""

        self._pending = ""  # decoded but held back: could be the start of a stop string
        self._output_text = ""  # everything emitted so far
        self._stop_string: str | None = None
        self._finished = False

    # -- public API -----------------------------------------------------------

    @property
    def output_text(self) -> str:
        """All text emitted so far (the sum of the deltas, and of finish())."""
        return self._output_text

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stop_string

    @property
    def finished(self) -> bool:
        """True once a stop string matched or finish() was called."""
        return self._finished

    def add_token(self, token_id: int) -> TextDelta:
        """Feed the next output token; return the text that can be shown now."""
        if self._finished:
            reason = (
                f"stop string {self._stop_string!r} already matched"
                if self._stop_string is not None
                else "finish() already called"
            )
            raise RuntimeError(f"add_token after the output ended: {reason}")
        self._window.append(int(token_id))
        return self._push(self._advance())

    def finish(self) -> str:
        """End the sequence (EOS, length limit, abort): return the held-back remainder.

        This releases text withheld because its last character looked incomplete
        (a byte sequence that never completed comes out as U+FFFD, as
        ``tokenizer.decode`` shows it) and text withheld because it could have
        begun a stop string. The remainder is still checked for stop strings: if
        one completes inside it, the output is cut there and ``stop_string`` set.
        Calling it again, or after a stop string ended the output, returns "".
        """
        if self._finished:
            return ""
        full_text = self._decode(self._window)
        self._pending += full_text[len(self._prefix_text) :]
        delta = self._push("", final=True)
        self._finished = True
        return delta.text

    # -- internals ------------------------------------------------------------

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _advance(self) -> str:
        """Decode the window; return new complete text and slide the window past it."""
        full_text = self._decode(self._window)
        # Hold back while the text ends in an incomplete character, and when the new
        # token added no text (a skipped special token, or a piece the tokenizer only
        # renders together with what follows): the window just grows until it does.
        if len(full_text) <= len(self._prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        # The window's text begins with the prefix text (the same ids, decoded
        # with nothing after them, on a character boundary), so the new text is
        # simply what follows it.
        new_text = full_text[len(self._prefix_text) :]
        # Slide: the tokens just read become the context for the next step. Keeping
        # them (rather than starting the window at the next token) is what lets the
        # tokenizer decode the next token as a continuation. The new window starts
        # on a character boundary because the old read offset was one (text there
        # did not end in U+FFFD), so its text never starts mid-character.
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        return new_text

    def _push(self, text: str, *, final: bool = False) -> TextDelta:
        """Run new text through stop-string matching; return what may be shown."""
        pending = self._pending + text
        if not self._stop:
            self._pending = ""
            self._output_text += pending
            return TextDelta(pending, None)

        match = self._find_stop(pending)
        if match is not None:
            start, stop = match
            end = start + len(stop) if self._include_stop else start
            shown = pending[:end]
            self._pending = ""
            self._output_text += shown
            self._stop_string = stop
            self._finished = True
            return TextDelta(shown, stop)

        # No stop string yet: keep back the longest tail that could still grow into
        # one. At the end of the sequence nothing can grow any more, so release all.
        keep = 0 if final else self._partial_stop_len(pending)
        shown = pending[: len(pending) - keep]
        self._pending = pending[len(pending) - keep :]
        self._output_text += shown
        return TextDelta(shown, None)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string occurrence in ``text`` that ends first (ties: starts first)."""
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stop:
            # The first occurrence of a given string is also its earliest-ending one.
            start = text.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        return best[1], best[2]

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            # Only suffixes shorter than the stop string can be proper prefixes of it,
            # so this inspects at most len(stop) - 1 characters: O(1) in the output length.
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
