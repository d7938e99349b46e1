"""Structured outputs: grammars that constrain a request's tokens, inside the batch.

A request may ask for any JSON object, JSON valid against a schema, text matching a
regex, or tool calls (:mod:`.spec`). The engine compiles the spec once per distinct spec
and tenant (:class:`GrammarCompiler`, an LRU cache bounded in bytes for the engine and for
each tenant), gives each sequence a :class:`GrammarMatcher`, and at every step masks the
logits of the rows that have one (:class:`MaskFiller`, :func:`apply_token_bitmask`) before
sampling, then advances each matcher by its token.

Why llguidance (pinned in pyproject): ``benchmarks/results/grammar_engines.json``, SmolLM2's
tokenizer (49152 tokens) on the 2-core development CPU with other work on it (load 4.3):

* Masks are cheap in all three next to a decode step. Per token along real JSON outputs of
  four strict schemas, llguidance fills a mask in 9.6-14 µs median, 60-86 µs p99 (xgrammar
  1.2-2.0 / 4-23 µs, outlines-core 1.7-2.9 / 10-97 µs); 16 rows of a step take 0.10 ms in
  its parallel call. xgrammar's masks are faster, but tens of microseconds per row do not
  limit a step that takes milliseconds, and they can be filled while the forward runs.
* Compiling a new schema, which a multi-tenant server does often (every tenant brings its
  own), takes llguidance 1.0-1.2 ms cold and 0.4 ms for any JSON object; xgrammar 5-36 ms
  and 11 ms; outlines-core 150-220 ms and 8.4 s (a regex index over the vocabulary, of
  bounded depth: it refused the nested json_object document).
* Errors: llguidance refuses every bad schema of the benchmark with a message naming the
  problem (``Unknown format: colour``, ``required property 'b' is unsatisfiable``,
  ``Pointer '/$defs/missing' does not exist``). xgrammar compiles an unknown format and an
  unsatisfiable ``required`` without a word and prefixes its messages with C++ file and
  line; outlines-core compiles ``minimum > maximum`` and does not enforce integer bounds.
  All three pass the 15 JSON-schema features strict mode needs, but for that last one.
* It requires nothing and ships one abi3 wheel per platform (manylinux_2_31 x86_64 and
  aarch64, every CPython from 3.9), MIT. xgrammar (Apache-2.0) requires torch,
  transformers, pydantic, numpy, apache-tvm-ffi and an unpinned ``triton`` on Linux x86_64,
  which a CPU install would then download.
* It releases the GIL while it computes masks (a Python loop on the main thread kept 0.89
  of its speed while another thread filled 64 masks per call; xgrammar's batch call 0.69),
  so masks can be filled while the forward runs; and its Lark grammars with inline
  ``%json`` express the ``auto`` tool-call format (free text, or text then a forced valid
  call) directly.

How the engine plugs it in (see each module for details):

* Requests carry ``StructuredSpec | None``. The API layer may call :func:`check_spec` for an
  early 400; the engine compiles with :meth:`GrammarCompiler.compile` when the request is
  added (GrammarError -> the request is refused, nothing else is affected) and gives each
  sequence its own matcher (``n > 1``: one per sequence, from the same compiled grammar).
* Mask point: in the sampler, on the logits of the rows that sample, after logit bias and
  penalties and before temperature, top-k/p and min-p (so those filters and the greedy
  argmax see only allowed tokens); log-probabilities stay those of the raw logits. Applying
  16 rows' masks to SmolLM2's logits takes 0.4 ms on one CPU thread.
* Off the critical path: ``MaskFiller.submit(matchers of the rows that will sample)`` after
  scheduling, before the forward; the sampler calls ``future.result().apply(logits)``.
  The rows that sample include a prefill that ends its prompt (its first token is
  constrained too); a chunk that does not end it samples nothing and needs no mask.
* After sampling: ``matcher.accept(token)`` for each constrained row, before the next
  step's submit. False (the sampled token was forbidden: an engine bug) fails that request.
* Finish rules: when ``matcher.is_finished()`` the mask allows EOS alone; the engine
  finishes the sequence with reason stop as soon as that holds, even before it samples the
  EOS, and a grammar overrides ``min_tokens`` and ``ignore_eos`` (suppressing the only
  allowed token would leave nothing to sample). A stop string in the text still ends the
  request early, leaving an incomplete document (reason stop), and ``max_tokens`` likewise
  (reason length); ``stop_token_ids`` other than the EOS ids given to the compiler are
  never allowed by a mask, so they end nothing. A preempted or interrupted step changes no
  matcher: the tokens a matcher has accepted are exactly the sequence's output tokens.
"""

from loramux.engine.structured.bitmask import (
    allocate_bitmask,
    allowed_token_ids,
    apply_token_bitmask,
    bitmask_width,
    token_bias,
    unpack_bitmask,
)
from loramux.engine.structured.compiler import CompiledGrammar, GrammarCompiler
from loramux.engine.structured.errors import GrammarError
from loramux.engine.structured.grammar import check_spec
from loramux.engine.structured.grammar_cache import GrammarCacheStats
from loramux.engine.structured.mask_filler import MaskFiller, StepMasks
from loramux.engine.structured.matcher import GrammarMatcher
from loramux.engine.structured.spec import (
    JsonObject,
    JsonSchema,
    Regex,
    StructuredSpec,
    Tool,
    ToolCalls,
    ToolChoice,
    spec_from_json,
    spec_key,
    spec_to_json,
)
from loramux.engine.structured.tool_calls import (
    ParsedToolCall,
    ToolOutput,
    format_instructions,
    parse_tool_output,
)

__all__ = [
    "CompiledGrammar",
    "GrammarCacheStats",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "JsonObject",
    "JsonSchema",
    "MaskFiller",
    "ParsedToolCall",
    "Regex",
    "StepMasks",
    "StructuredSpec",
    "Tool",
    "ToolCalls",
    "ToolChoice",
    "ToolOutput",
    "allocate_bitmask",
    "allowed_token_ids",
    "apply_token_bitmask",
    "bitmask_width",
    "check_spec",
    "format_instructions",
    "parse_tool_output",
    "spec_from_json",
    "spec_key",
    "spec_to_json",
    "token_bias",
    "unpack_bitmask",
]
