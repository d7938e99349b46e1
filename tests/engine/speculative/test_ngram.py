"""NgramIndex: the prompt-lookup rule, checked against a brute-force scan of the history."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loramux.engine.speculative.ngram import NgramIndex


def reference_proposal(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The rule as written in ngram.py's docstring, by scanning the history backwards."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if length < n:
            continue
        suffix = tokens[length - n :]
        for p in range(length - n - 1, -1, -1):  # earlier occurrences only, latest first
            if tokens[p] == suffix[0] and tokens[p : p + n] == suffix:
                return tokens[p + n : p + n + k]
    return []


def indexed(tokens: list[int], max_n: int = 4, min_n: int = 2) -> NgramIndex:
    index = NgramIndex(max_n=max_n, min_n=min_n)
    index.sync(tokens)
    return index


class ReadCounter(Sequence[int]):
    """A token list that counts how many elements its readers fetched."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.elements_read = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, key):
        got = self.tokens[key]
        self.elements_read += len(got) if isinstance(key, slice) else 1
        return got


@pytest.mark.parametrize(("max_n", "min_n"), [(4, 0), (2, 3), (0, 0)])
def test_rejects_an_empty_range_of_n(max_n, min_n):
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(max_n=max_n, min_n=min_n)


def test_proposes_what_followed_the_suffix_before():
    index = indexed([5, 6, 7, 8, 9, 1, 5, 6, 7])
    assert index.propose(3) == [8, 9, 1]
    assert index.propose(1) == [8]
    assert index.propose(0) == []


def test_the_longest_matching_suffix_wins_over_a_more_recent_shorter_one():
    #         (9 1 2) -> 5     (1 2) -> 6, more recent        suffix
    tokens = [9, 1, 2, 5, 8, 1, 2, 6, 9, 1, 2]
    assert indexed(tokens, max_n=3).propose(2) == [5, 8]
    assert indexed(tokens, max_n=2).propose(2) == [6, 9]


def test_the_most_recent_occurrence_wins():
    assert indexed([1, 2, 3, 1, 2, 4, 0, 1, 2]).propose(2) == [4, 0]


def test_a_continuation_may_run_into_the_suffix_and_stops_at_the_end_of_the_history():
    # The latest earlier (4, 5) is at 3; what followed it runs to the end of the history.
    assert indexed([4, 5, 6, 4, 5, 4, 5]).propose(10) == [4, 5]
    # A repeating token: the earlier (7, 7) overlaps the suffix.
    assert indexed([7, 7, 7]).propose(4) == [7]


def test_no_match_proposes_nothing():
    assert indexed([]).propose(3) == []
    assert indexed([1]).propose(3) == []
    assert indexed([1, 2, 3, 4, 5]).propose(3) == []
    # min_n = 2: a single repeated token is not enough ...
    assert indexed([3, 1, 2, 3]).propose(3) == []
    # ... but min_n = 1 takes it.
    assert indexed([3, 1, 2, 3], max_n=4, min_n=1).propose(3) == [1, 2, 3]


def test_rejects_a_negative_k():
    with pytest.raises(ValueError, match="k >= 0"):
        indexed([1, 2, 1, 2]).propose(-1)


def test_sync_rejects_a_sequence_that_shrank():
    index = indexed([1, 2, 3])
    with pytest.raises(ValueError, match="only ever appended"):
        index.sync([1, 2])


def test_sync_reads_only_the_new_tail():
    rng = random.Random(3)
    tokens = ReadCounter([rng.randrange(5) for _ in range(500)])
    index = NgramIndex()
    index.sync(tokens)
    for _ in range(300):
        tokens.tokens.append(rng.randrange(5))
        index.sync(tokens)
        index.sync(tokens)  # nothing new: reads nothing
    assert tokens.elements_read == len(tokens) == index.num_tokens == 800
    assert index.propose(4) == reference_proposal(tokens.tokens, 4, 4, 2)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    alphabet=st.integers(1, 4),
    max_n=st.integers(1, 5),
    min_n_offset=st.integers(0, 4),
    data=st.data(),
)
def test_matches_the_brute_force_rule_on_random_sequences(alphabet, max_n, min_n_offset, data):
    min_n = max(1, max_n - min_n_offset)
    tokens = data.draw(st.lists(st.integers(0, alphabet - 1), max_size=40), label="tokens")
    # Fed in random chunks, as a prompt and then one or a few tokens per step would be.
    cuts = sorted(data.draw(st.lists(st.integers(0, len(tokens)), max_size=6), label="cuts"))
    index = NgramIndex(max_n=max_n, min_n=min_n)
    for end in [*cuts, len(tokens)]:
        seen = tokens[:end]
        index.sync(seen)
        for k in range(len(seen) + 2):
            assert index.propose(k) == reference_proposal(seen, k, max_n, min_n), (seen, k)


def long_history(length: int, seed: int) -> list[int]:
    """Random tokens from a 1000-token vocabulary, with earlier spans copied in every so
    often (what a quoting answer looks like), so that every n finds matches."""
    rng = random.Random(seed)
    tokens: list[int] = []
    while len(tokens) < length:
        if len(tokens) > 100 and rng.random() < 0.02:
            start = rng.randrange(len(tokens) - 50)
            tokens.extend(tokens[start : start + rng.randrange(5, 50)])
        else:
            tokens.append(rng.randrange(1000))
    return tokens[:length]


def test_a_100k_token_history_is_indexed_incrementally_and_proposes_right():
    tokens = long_history(100_000, seed=7)
    index = NgramIndex(max_n=4, min_n=2)
    index.sync(tokens[:60_000])  # the prompt, in one call
    checkpoints = set(range(60_000, 100_001, 677)) | {100_000}
    matched = 0
    for end in range(60_001, 100_001):  # then one token per step
        index.sync(tokens[:end] if end in checkpoints else _Prefix(tokens, end))
        if end in checkpoints:
            expected = reference_proposal(tokens[:end], 8, 4, 2)
            assert index.propose(8) == expected, end
            matched += bool(expected)
    assert index.num_tokens == 100_000
    assert matched >= 10  # the copied spans were found, not only misses checked


class _Prefix(Sequence[int]):
    """The first ``end`` tokens of a list, without copying them (what a growing list is)."""

    def __init__(self, tokens: list[int], end: int):
        self.tokens, self.end = tokens, end

    def __len__(self) -> int:
        return self.end

    def __getitem__(self, key):
        assert isinstance(key, slice) and key.stop is None
        return self.tokens[key.start : self.end]


def test_appending_and_proposing_cost_the_same_on_a_100k_history_as_on_a_short_one():
    # 2,000 appends and proposals take milliseconds either way; a scan of the history
    # would make the long case take seconds. The bound leaves room for a larger dict's
    # cache misses and for other processes on the machine.
    def seconds_for_2000_steps_after(history_length: int) -> float:
        history = long_history(history_length + 2_000, seed=11)
        index = indexed(history[:history_length])
        start = time.perf_counter()
        for end in range(history_length + 1, history_length + 2_001):
            index.sync(_Prefix(history, end))
            index.propose(4)
        return time.perf_counter() - start

    short = seconds_for_2000_steps_after(200)
    long = seconds_for_2000_steps_after(100_000)
    assert long < 10 * short + 0.05, (long, short)
