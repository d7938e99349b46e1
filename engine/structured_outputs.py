"""Structured outputs in the engine: compiling requests' specs, once per spec.

The grammar layer is :mod:`loramux.engine.structured`; this is where the engine plugs it in.

* :class:`Grammars` belongs to the engine: one :class:`GrammarCompiler` for its tokenizer,
  built on the first structured request (building llguidance's view of the tokenizer takes
  0.3-0.8 s, which an engine that never sees one should not pay), and its cache of compiled
  specs. Each sequence gets a matcher of the compiled spec (``n > 1``: one per sequence); a
  spec that does not compile raises GrammarError, which the engine turns into its usual
  refusal. It is thread-safe, so ``AsyncEngine.generate`` can compile off the engine thread
  first and the engine thread's compile at add is a cache hit.

The runner fills each step's masks (``MaskFiller``) and the sampler applies them; see
``runner.py`` for when.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from loramux.engine.structured import CompiledGrammar, GrammarCompiler, StructuredSpec


class Grammars:
    """The engine's compiler, built on first use; see the module docstring."""

    def __init__(self, tokenizer, *, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
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
                )
            return self._compiler

    @property
    def built(self) -> bool:
        return self._compiler is not None

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """``spec`` compiled (cached); GrammarError naming the problem if it cannot be."""
        return self.compiler.compile(spec)
