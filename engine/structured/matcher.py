"""One request's grammar state: which tokens may come next, and the tokens it produced.

A :class:`GrammarMatcher` belongs to one sequence (with ``n > 1`` every sequence has its
own). Per step the engine fills its mask row before sampling, then tells it the sampled
token. Once the grammar is complete and cannot go on, the mask allows EOS alone and
:meth:`GrammarMatcher.is_finished` is true: the engine finishes the sequence (reason stop)
whether or not it has sampled that EOS yet.

A token the mask did not allow (the engine sampled past the mask: a bug, never the model)
puts the matcher in an error state for good: :meth:`accept` returns False, ``error`` says
why, the mask allows EOS alone and ``is_finished`` is true. That request alone fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loramux.engine.structured.grammar import first_lines

if TYPE_CHECKING:
    import llguidance


class GrammarMatcher:
    """The grammar state of one sequence. Not thread-safe: one thread at a time (the mask
    filler's background thread counts as one; see ``MaskFiller.submit``)."""

    __slots__ = ("_llg", "_words")

    def __init__(self, llg: llguidance.LLMatcher, vocab_size: int) -> None:
        self._llg = llg
        self._words = (vocab_size + 31) // 32

    def fill_mask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed next tokens into ``bitmask[row]``: bit ``v % 32`` of word
        ``v // 32`` is 1 if token ``v`` may come next. ``bitmask`` is an int32 CPU tensor
        ``[rows, ceil(vocab / 32)]`` (``allocate_bitmask``); its row is checked, since the
        library writes through a raw pointer."""
        _check_bitmask(bitmask, self._words)
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(f"row {row} is outside a bitmask of {bitmask.shape[0]} rows")
        target = bitmask[row]
        self._llg.unsafe_compute_mask_ptr(target.data_ptr(), self._words * 4)

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar forbids it (then ``error``)."""
        return self._llg.consume_token(int(token_id))

    def is_finished(self) -> bool:
        """True once nothing but EOS may follow: the grammar is complete (or in error)."""
        return self._llg.is_stopped()

    def can_end(self) -> bool:
        """True if the output so far is complete (EOS is allowed now, maybe more too)."""
        return self._llg.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the matcher is in its error state, or None."""
        return first_lines(self._llg.get_error()) if self._llg.is_error() else None

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` accepted tokens.

        Only speculative decoding needs this (draft tokens the target model refused). A
        preempted sequence recomputes its KV but keeps its tokens, and a step cut short
        (StepInterrupted) samples nothing: neither changes what the matcher has accepted.
        """
        if not self._llg.rollback(int(num_tokens)):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.error}")

    @property
    def llg(self) -> llguidance.LLMatcher:
        """The library's matcher (for the batched fill)."""
        return self._llg


def _check_bitmask(bitmask: torch.Tensor, words: int) -> None:
    if (
        bitmask.dtype != torch.int32
        or bitmask.device.type != "cpu"
        or bitmask.dim() != 2
        or bitmask.shape[1] != words
        or not bitmask.is_contiguous()
    ):
        raise ValueError(
            f"the bitmask must be a contiguous int32 CPU tensor [rows, {words}], got "
            f"{bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}"
        )
