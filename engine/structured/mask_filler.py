"""One step's token masks for the rows that have a grammar, now or while the forward runs.

The rows of a step that sample (decodes, and prefills that finish their prompt) may each
have a :class:`GrammarMatcher`. :meth:`MaskFiller.fill` writes all their masks in one call
into llguidance's own thread pool, which releases the GIL; the result names which batch row
each mask row is for. Unconstrained rows cost nothing, and a step with none returns None.

Off the critical path: a row's next mask depends only on the tokens it has accepted, which
are known as soon as the previous step's sampling ends. So the engine can call
:meth:`MaskFiller.submit` right after it schedules a step (the matchers listed in the order
of the rows that will sample) and before it launches the forward; a background thread fills
the masks while the model runs (the fill releases the GIL, so the main thread keeps
launching kernels: ``benchmarks/grammar_engines/runner.py`` measured a Python loop on the main
thread at 0.86-0.95 of its speed while another thread filled 64 masks per call), and the
sampler waits on the future only when it needs the masks. Until that future is done, the
step's matchers must not accept tokens (the engine accepts after sampling, so they don't).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from loramux.engine.structured.bitmask import allocate_bitmask, apply_token_bitmask, bitmask_width
from loramux.engine.structured.matcher import GrammarMatcher


@dataclass(frozen=True)
class StepMasks:
    """One step's masks: ``bitmask[k]`` masks the logits of batch row ``rows[k]``."""

    bitmask: torch.Tensor  # int32 [k, ceil(V / 32)], CPU
    rows: torch.Tensor  # int64 [k], CPU

    def apply(self, logits: torch.Tensor) -> None:
        """Forbidden tokens' logits to ``-inf``, in place (``logits`` ``[rows, V]``)."""
        apply_token_bitmask(logits, self.bitmask, self.rows)


class MaskFiller:
    """Fills steps' masks into two buffers used in turn: a step's :class:`StepMasks` stays
    valid until the second fill after it, so the next step's fill never overwrites masks
    still being copied to the device. ``threads``: llguidance's pool (None: its default,
    80% of the cores up to 32); ``pin_memory`` on CUDA, for asynchronous copies."""

    def __init__(
        self,
        vocab_size: int,
        *,
        threads: int | None = None,
        pin_memory: bool = False,
        rows: int = 64,
    ) -> None:
        self._vocab_size = vocab_size
        self._words = bitmask_width(vocab_size)
        self._pin_memory = pin_memory
        self._buffers = [self._allocate(rows), self._allocate(rows)]
        self._turn = 0
        import llguidance  # on first use, as in the compiler

        self._executor = llguidance.LLExecutor(num_threads=threads)
        self._background: ThreadPoolExecutor | None = None

    def fill(self, matchers: Sequence[GrammarMatcher | None]) -> StepMasks | None:
        """The masks of the rows with a matcher (``matchers[i]`` is batch row i's, None for
        an unconstrained row), or None when no row has one."""
        constrained = [(row, m) for row, m in enumerate(matchers) if m is not None]
        if not constrained:
            return None
        buffer = self._next_buffer(len(constrained))
        if len(constrained) == 1:
            constrained[0][1].fill_mask(buffer, 0)
        else:
            pairs = [(m.llg, k) for k, (_, m) in enumerate(constrained)]
            self._executor.unsafe_compute_mask_ptr(
                pairs, buffer.data_ptr(), self._words * 4, buffer.shape[0]
            )
        rows = torch.tensor([row for row, _ in constrained], dtype=torch.int64)
        return StepMasks(buffer[: len(constrained)], rows)

    def submit(self, matchers: Sequence[GrammarMatcher | None]) -> Future[StepMasks | None]:
        """``fill`` on a background thread; see the module docstring for when to call it."""
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix="loramux-masks")
        return self._background.submit(self.fill, list(matchers))

    def close(self) -> None:
        """Stop the background thread (after the fill in flight, if any)."""
        if self._background is not None:
            self._background.shutdown(wait=True)
            self._background = None

    def _allocate(self, rows: int) -> torch.Tensor:
        return allocate_bitmask(rows, self._vocab_size, pin_memory=self._pin_memory)

    def _next_buffer(self, rows: int) -> torch.Tensor:
        self._turn ^= 1
        if self._buffers[self._turn].shape[0] < rows:
            grown = max(rows, 2 * self._buffers[self._turn].shape[0])
            self._buffers[self._turn] = self._allocate(grown)
        return self._buffers[self._turn]
