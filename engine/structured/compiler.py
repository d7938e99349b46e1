"""Specs compiled for the engine's tokenizer, each once: a bounded, thread-safe cache.

Compiling is building llguidance's matcher from the spec's grammar (about a millisecond for
the schemas in ``benchmarks/grammar_engines.py``; the lexer is then built lazily during the
first masks). The compiled form is a *template* matcher that never advances: every request
gets a copy of it (a few microseconds). Templates are kept in an LRU cache keyed by the
spec's canonical JSON; two threads asking for the same new spec compile it once (the second
waits for the first). A spec that fails to compile raises :class:`GrammarError` and is not
cached (so a fixed schema sent again is compiled anew).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loramux.engine.structured.errors import GrammarError
from loramux.engine.structured.grammar import (
    check_tool_parameters,
    describe,
    first_lines,
    grammar_for,
)
from loramux.engine.structured.matcher import GrammarMatcher
from loramux.engine.structured.spec import StructuredSpec, ToolCalls, spec_key

if TYPE_CHECKING:
    import llguidance

DEFAULT_CACHE_SIZE = 512


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int  # compiles started (failed ones included)
    size: int
    capacity: int


class CompiledGrammar:
    """One spec's grammar for one tokenizer; :meth:`matcher` starts a request on it."""

    __slots__ = ("_copy_lock", "_template", "_vocab_size", "key")

    def __init__(self, key: str, template: llguidance.LLMatcher, vocab_size: int) -> None:
        self.key = key
        self._template = template
        self._vocab_size = vocab_size
        self._copy_lock = threading.Lock()  # copies of one template from several threads

    def matcher(self) -> GrammarMatcher:
        with self._copy_lock:
            copy = self._template.deep_copy()
        return GrammarMatcher(copy, self._vocab_size)


class GrammarCompiler:
    """Compiles specs for one tokenizer and caches the results (least recently used go).

    ``tokenizer`` is the engine's Hugging Face fast tokenizer; ``vocab_size`` the width of
    the model's logits (at least the tokenizer's; ids past the tokenizer's are never
    allowed); ``eos_token_ids`` the tokens that end a sequence, the only ones allowed once
    a grammar is complete. Building the library's view of the tokenizer takes 0.3-0.8 s
    on the development machine: build one compiler per engine, when the engine starts or at
    its first structured request.
    """

    def __init__(
        self,
        tokenizer,
        *,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        # Imported here: the library (and transformers, which .hf imports) only when a
        # compiler is built, so that specs and parsing work without them.
        import llguidance.hf

        eos = sorted({int(t) for t in eos_token_ids})
        if not eos:
            raise ValueError("eos_token_ids must name at least one token")
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        if vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size {vocab_size} < the tokenizer's {len(tokenizer)}")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos)
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._capacity = cache_size
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._pending: dict[str, Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """``spec`` compiled (from the cache if it was before); GrammarError if it cannot be."""
        key = spec_key(spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self._hits += 1
                return compiled
            pending = self._pending.get(key)
            if pending is None:
                pending = self._pending[key] = Future()
                self._misses += 1
                mine = True
            else:
                self._hits += 1  # compiled once, by the thread already at it
                mine = False
        if not mine:
            return pending.result()
        try:
            compiled = self._build(key, spec)
        except BaseException as exc:
            with self._lock:
                del self._pending[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            del self._pending[key]
            self._cache[key] = compiled
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        pending.set_result(compiled)
        return compiled

    def matcher(self, spec: StructuredSpec) -> GrammarMatcher:
        """A new request's matcher for ``spec``."""
        return self.compile(spec).matcher()

    def cache_stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, len(self._cache), self._capacity)

    def _build(self, key: str, spec: StructuredSpec) -> CompiledGrammar:
        if isinstance(spec, ToolCalls):
            check_tool_parameters(spec)  # so that an error names the tool
        import llguidance

        # Errors surface as the matcher's error state, never as exceptions (the library's
        # rule); construction releases the GIL while it builds the parser.
        template = llguidance.LLMatcher(self._tokenizer, grammar_for(spec), log_level=0)
        if template.is_error():
            message = first_lines(template.get_error())
            raise GrammarError(f"{describe(spec)} cannot be enforced: {message}")
        return CompiledGrammar(key, template, self.vocab_size)
