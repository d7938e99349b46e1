"""Structured outputs in the engine: compiling requests' specs, once per spec and tenant.

The grammar layer is :mod:`loramux.engine.structured`; this is where the engine plugs it in.

* :class:`Grammars` belongs to the engine: one :class:`GrammarCompiler` for its tokenizer,
  built on the first structured request (building llguidance's view of the tokenizer takes
  0.3-0.8 s, which an engine that never sees one should not pay), and its cache of compiled
  specs, bounded in bytes for the engine and for each tenant (EngineConfig's
  ``grammar_cache_bytes`` and ``grammar_cache_tenant_bytes``; ``structured/grammar_cache.py``).
  Each sequence gets a matcher of the compiled spec (``n > 1``: one per sequence); a spec
  that does not compile raises GrammarError, which the engine turns into its usual refusal.
  It is thread-safe, so ``AsyncEngine.generate`` can compile off the engine thread first and
  the engine thread's compile at add is a cache hit.

The runner fills each step's masks (``MaskFiller``) and the sampler applies them; see
``executor/local.py`` for when.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from loramux.engine.structured import (
    CompiledGrammar,
    GrammarCacheStats,
    GrammarCompiler,
    StructuredSpec,
)
from loramux.engine.structured.grammar_cache import GrammarCache


class Grammars:
    """The engine's compiler, built on first use; see the module docstring."""

    def __init__(
        self,
        tokenizer,
        *,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_bytes: int,
        tenant_cache_bytes: int | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        # Checked now, not at the first structured request; what the stats say until then.
        self._empty = GrammarCache(cache_bytes, tenant_cache_bytes)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()  # one build, whichever thread asks first

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(
                    self._tokenizer,
                    vocab_size=self._vocab_size,
                    eos_token_ids=self._eos_token_ids,
                    cache_bytes=self._empty.budget_bytes,
                    tenant_cache_bytes=self._empty.tenant_budget_bytes,
                )
            return self._compiler

    @property
    def built(self) -> bool:
        return self._compiler is not None

    def compile(self, spec: StructuredSpec, tenant: str | None = None) -> CompiledGrammar:
        """``spec`` compiled (cached for ``tenant``); GrammarError naming the problem if it
        cannot be."""
        return self.compiler.compile(spec, tenant)

    def cache_stats(self) -> GrammarCacheStats:
        """The compiled-grammar cache's figures (its budgets alone before the first build)."""
        compiler = self._compiler
        return self._empty.stats() if compiler is None else compiler.cache_stats()

    def tenant_usage(self) -> dict[str | None, tuple[int, int]]:
        """Per tenant with a cached grammar: (bytes, entries)."""
        compiler = self._compiler
        return {} if compiler is None else compiler.tenant_usage()

    def describe(self) -> str:
        """What the cache may hold, for the engine's start-up log."""
        stats = self._empty.stats()
        return (
            f"compiled grammars: up to {stats.budget_bytes / 2**20:.0f} MiB of host RAM, "
            f"{stats.tenant_budget_bytes / 2**20:.0f} MiB per tenant (least recently used go)"
        )
