"""Prompt-lookup proposals: guess the next tokens by copying the request's own text.

Text that quotes its prompt (code edits, summaries with citations, extraction) or repeats
itself (lists, tables, loops of a small model) continues the way an earlier occurrence
of its last few tokens continued. :class:`NgramIndex` finds that occurrence without a
model, and the engine verifies the copied tokens in one step (``verify.py``).

The rule, for a sequence ``t`` of length ``L`` and a proposal of up to ``k`` tokens:

* for ``n`` from ``max_n`` down to ``min_n`` (longest first: a longer match is more
  specific, so its continuation is likelier to be right), the key is the suffix
  ``t[L-n:L]``;
* find the most recent *earlier* occurrence of the key: the largest ``p < L - n`` with
  ``t[p:p+n] == t[L-n:L]`` (every such occurrence has at least one token after it; the
  suffix itself has none and never matches);
* propose ``t[p+n : p+n+k]``: fewer than ``k`` tokens when the history ends first. A
  continuation may run into the suffix and copy the tokens just generated, which is
  what makes a repeating span fast;
* the first ``n`` with an occurrence wins; with none, the proposal is ``[]``.

Cost. Tokens are only ever appended, so the index is built incrementally: when token
``t[i]`` arrives, the n-grams ending just before it (``t[i-n:i]`` for each ``n``) have a
continuation starting at ``i``, and each is now the most recent occurrence of its
n-gram that has one: one dict store per ``n``. A proposal is one dict lookup per ``n``
and a copy of at most ``k`` tokens. Neither ever scans the history. (Building and
hashing an ``n``-token key costs ``n``; with ``max_n`` a small constant, around 4, that
is the O(max_n) per appended token and O(max_n + k) per proposal that matter.)
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """One sequence's n-gram index: fed its tokens as they grow, proposes continuations."""

    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"NgramIndex needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}"
            )
        self.max_n = max_n
        self.min_n = min_n
        # Our own copy of the tokens indexed so far: the caller's list may be rebuilt or
        # grow between calls, and proposals slice from it.
        self._tokens: list[int] = []
        # n-gram (a tuple of min_n..max_n tokens; tuples of different lengths never
        # collide, so one dict serves every n) -> the position where the continuation of
        # its most recent occurrence that has one starts.
        self._continuation_at: dict[tuple[int, ...], int] = {}

    @property
    def num_tokens(self) -> int:
        """How many tokens of the sequence have been indexed."""
        return len(self._tokens)

    def sync(self, token_ids: Sequence[int]) -> None:
        """Index the tokens appended to ``token_ids`` (the whole sequence) since the last call.

        Only the new tail is read. Tokens are never removed, so a shorter list than the
        one indexed is a caller's error.
        """
        start = len(self._tokens)
        if len(token_ids) < start:
            raise ValueError(
                f"NgramIndex.sync got {len(token_ids)} tokens after indexing {start}: "
                "a sequence's tokens are only ever appended"
            )
        tokens = self._tokens
        for token in token_ids[start:]:
            i = len(tokens)  # the position of `token`
            # Each n-gram ending at i-1 now has a continuation starting at i, and no
            # occurrence of it with a continuation is more recent.
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self._continuation_at[tuple(tokens[i - n : i])] = i
            tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that copy the continuation of the suffix's latest earlier match."""
        if k < 0:
            raise ValueError(f"NgramIndex.propose needs k >= 0, got {k}")
        tokens = self._tokens
        length = len(tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            start = self._continuation_at.get(tuple(tokens[length - n :]))
            if start is not None:
                return tokens[start : start + k]
        return []
