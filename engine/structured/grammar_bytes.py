"""How many bytes a compiled grammar holds: measured around its build, since llguidance
does not say.

A compiled grammar is llguidance's ``LLMatcher``: a Rust object (the grammar, its lexer's
regexes and the lexer states built so far, the parser's tables) allocated with the C
library's malloc, out of Python's sight. :class:`HeapMeter` reads glibc's ``mallinfo2()``
(bytes malloc has handed out and not had back: ``uordblks`` in its arenas plus ``hblkhd``
in its own mmaps) before and after the build: what the build kept is the difference. One
build is measured at a time (a lock), so two compiles never count each other's bytes.
``benchmarks/results/grammar_cache_memory.md``: 4.81 MiB measured for each 12,000-value
enum schema, against 4.68 MiB of RSS per schema over 100 kept.

What the figure leaves out, and where it errs:

* lexer states llguidance adds later, as masks walk the grammar (shared by the template and
  its requests' copies): +0.6 MB (11%) on a 12,000-value enum's 5.3 MB after 150 requests
  had each walked to a value, up to llguidance's own cap on lexer states;
* another thread's allocations during the build count too (an engine step's CPU tensors on
  a CPU engine): the figure may be high for that one grammar, which is then evicted sooner.
  A low reading (another thread freed memory meanwhile) is raised to :func:`lower_bound`.

``mallinfo2`` walks malloc's free lists under each arena's lock, two reads per compile
(misses only): 1.3-1.5 ms a read in the benchmark's engine process with the default
budgets, 7.6 ms with 475 MiB of grammars held.

Without glibc (macOS, musl) there is nothing to read: :func:`estimate_bytes` stands in, a
bound from the grammar's length above every grammar measured on SmolLM2's tokenizer (11 to
200 bytes per character of grammar for large ones, up to 940 for the smallest, whose fixed
30-175 kB dominates).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Floor: the smallest grammars measured kept 30-40 kB; the sparsest, 11 B per character.
MIN_GRAMMAR_BYTES = 32 << 10
MIN_BYTES_PER_CHAR = 8
# Without glibc: above every grammar measured (see the module docstring).
ESTIMATE_BASE_BYTES = 256 << 10
ESTIMATE_BYTES_PER_CHAR = 256


class _MallInfo2(ctypes.Structure):
    # glibc's struct mallinfo2 (2.33+): every field a size_t.
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def lower_bound(grammar_chars: int) -> int:
    """The least a grammar of ``grammar_chars`` characters is counted as."""
    return MIN_GRAMMAR_BYTES + MIN_BYTES_PER_CHAR * grammar_chars


def estimate_bytes(grammar_chars: int) -> int:
    """A grammar's bytes from its length alone (no malloc statistics to read)."""
    return ESTIMATE_BASE_BYTES + ESTIMATE_BYTES_PER_CHAR * grammar_chars


class HeapMeter:
    """Measures the malloc bytes a call keeps (glibc), or estimates them (elsewhere)."""

    def __init__(self) -> None:
        self._mallinfo2 = _load_mallinfo2()
        self._lock = threading.Lock()  # one measured build at a time

    @property
    def measures(self) -> bool:
        """Whether figures are measured (glibc) rather than estimated from the length."""
        return self._mallinfo2 is not None

    def in_use(self) -> int | None:
        """Bytes malloc has handed out and not had back (None without glibc)."""
        if self._mallinfo2 is None:
            return None
        info = self._mallinfo2()
        return info.uordblks + info.hblkhd

    def measure(self, build: Callable[[], T], grammar_chars: int) -> tuple[T, int]:
        """``build()``'s result and the bytes it kept (at least ``lower_bound``)."""
        if self._mallinfo2 is None:
            return build(), estimate_bytes(grammar_chars)
        with self._lock:
            before = self.in_use()
            result = build()
            kept = self.in_use() - before
        return result, max(kept, lower_bound(grammar_chars))


def _load_mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        function = ctypes.CDLL(None).mallinfo2  # the process's own symbols: its C library
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return None
    function.restype = _MallInfo2
    function.argtypes = []
    return function
