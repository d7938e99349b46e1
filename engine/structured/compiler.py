"""Specs compiled for the engine's tokenizer, each once per tenant: a thread-safe cache
bounded in bytes, for the engine and for each tenant (``grammar_cache.py``).

Compiling is building llguidance's matcher from the spec's grammar (about a millisecond for
the schemas in ``benchmarks/grammar_engines/runner.py``, 50 ms for a 12,000-value enum; the lexer
is then built lazily during the first masks). The compiled form is a *template* matcher
that never advances: every request gets a copy of it (a few microseconds). What the build
kept is measured (``grammar_bytes.py``) and charged to the tenant whose request asked.
Templates are kept keyed by (tenant, the spec's canonical JSON); two threads asking for the
same new spec for one tenant compile it once (the second waits for the first). A spec that
fails to compile raises :class:`GrammarError` and is not cached (so a fixed schema sent
again is compiled anew).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from loramux.engine.structured.errors import GrammarError
from loramux.engine.structured.grammar import (
    check_tool_parameters,
    describe,
    first_lines,
    grammar_for,
)
from loramux.engine.structured.grammar_bytes import HeapMeter
from loramux.engine.structured.grammar_cache import (
    DEFAULT_BUDGET_BYTES,
    GrammarCache,
    GrammarCacheStats,
    Tenant,
)
from loramux.engine.structured.matcher import GrammarMatcher
from loramux.engine.structured.spec import StructuredSpec, ToolCalls, spec_key

if TYPE_CHECKING:
    import llguidance


class CompiledGrammar:
    """One spec's grammar for one tokenizer; :meth:`matcher` starts a request on it.
    ``nbytes``: what its build kept (the template matcher) and its key."""

    __slots__ = ("__weakref__", "_copy_lock", "_template", "_vocab_size", "key", "nbytes")

    def __init__(
        self, key: str, template: llguidance.LLMatcher, vocab_size: int, nbytes: int
    ) -> None:
        self.key = key
        self.nbytes = nbytes
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
    a grammar is complete; ``cache_bytes`` and ``tenant_cache_bytes`` the cache's budgets
    (``grammar_cache.py``; None: a quarter of ``cache_bytes``). Building the library's view
    of the tokenizer takes 0.3-0.8 s on the development machine: build one compiler per
    engine, when the engine starts or at its first structured request.
    """

    def __init__(
        self,
        tokenizer,
        *,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_bytes: int = DEFAULT_BUDGET_BYTES,
        tenant_cache_bytes: int | None = None,
    ) -> None:
        # Imported here: the library (and transformers, which .hf imports) only when a
        # compiler is built, so that specs and parsing work without them.
        import llguidance.hf

        eos = sorted({int(t) for t in eos_token_ids})
        if not eos:
            raise ValueError("eos_token_ids must name at least one token")
        if vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size {vocab_size} < the tokenizer's {len(tokenizer)}")
        self._cache: GrammarCache[CompiledGrammar] = GrammarCache(cache_bytes, tenant_cache_bytes)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos)
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._meter = HeapMeter()
        self._pending: dict[tuple[Tenant, str], Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    def compile(self, spec: StructuredSpec, tenant: Tenant = None) -> CompiledGrammar:
        """``spec`` compiled (from the tenant's cache if it was before); GrammarError if it
        cannot be."""
        key = spec_key(spec)
        slot = (tenant, key)
        with self._lock:
            compiled = self._cache.get(tenant, key)
            if compiled is not None:
                self._hits += 1
                return compiled
            pending = self._pending.get(slot)
            if pending is None:
                pending = self._pending[slot] = Future()
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
                del self._pending[slot]
            pending.set_exception(exc)
            raise
        with self._lock:
            del self._pending[slot]
            self._cache.put(tenant, key, compiled, compiled.nbytes)
        pending.set_result(compiled)
        return compiled

    def matcher(self, spec: StructuredSpec, tenant: Tenant = None) -> GrammarMatcher:
        """A new request's matcher for ``spec``."""
        return self.compile(spec, tenant).matcher()

    def cache_stats(self) -> GrammarCacheStats:
        with self._lock:
            return self._cache.stats(hits=self._hits, misses=self._misses)

    def tenant_usage(self) -> dict[Tenant, tuple[int, int]]:
        """Per tenant with a cached grammar: (bytes, entries)."""
        with self._lock:
            return self._cache.tenant_usage()

    def cached(self, spec: StructuredSpec, tenant: Tenant = None) -> bool:
        """Whether the tenant's compiled ``spec`` is in the cache (no hit counted)."""
        with self._lock:
            return (tenant, spec_key(spec)) in self._cache

    def _build(self, key: str, spec: StructuredSpec) -> CompiledGrammar:
        if isinstance(spec, ToolCalls):
            check_tool_parameters(spec)  # so that an error names the tool
        import llguidance

        # Errors surface as the matcher's error state, never as exceptions (the library's
        # rule); construction releases the GIL while it builds the parser.
        grammar = grammar_for(spec)
        template, nbytes = self._meter.measure(
            lambda: llguidance.LLMatcher(self._tokenizer, grammar, log_level=0), len(grammar)
        )
        if template.is_error():
            message = first_lines(template.get_error())
            raise GrammarError(f"{describe(spec)} cannot be enforced: {message}")
        # The key is kept as long as the entry (a schema's canonical JSON: up to 256 kB).
        return CompiledGrammar(key, template, self.vocab_size, nbytes + sys.getsizeof(key))
