"""Structured outputs: grammars that constrain a request's tokens, inside the batch.

A request may ask for any JSON object, JSON valid against a schema, text matching a
regex, or tool calls (:mod:`.spec`). The engine compiles the spec once per distinct spec
(:class:`GrammarCompiler`, an LRU cache), gives each sequence a :class:`GrammarMatcher`,
and at every step masks the logits of the rows that have one (:class:`MaskFiller`,
:func:`apply_token_bitmask`) before sampling, then advances each matcher by its token.

Why llguidance (pinned in pyproject), from ``benchmarks/results/grammar_engines.json``
(SmolLM2's tokenizer, 49152 tokens, the 2-core development CPU, other work on it):

* Masks are cheap in all three candidates next to a decode step: per token, llguidance
  7-10 µs median and 49-59 µs p99 on four strict schemas (xgrammar 1.2-1.8 / 3-22 µs,
  outlines-core 1.6-2.1 / 5-110 µs); a step of 16 grammar rows costs 0.09 ms in
  llguidance's parallel call. xgrammar's masks are faster, but a few microseconds per row
  are not what limits a step that takes milliseconds.
* Compiling a new schema, which a multi-tenant server does often (every tenant brings its
  own), takes llguidance 0.75-0.95 ms cold, xgrammar 5-24 ms, outlines-core 0.2-0.4 s per
  schema and 14 s for any JSON object (its regex index over the vocabulary), which also
  has a bounded depth and refused the nested test document.
* Errors: llguidance refuses every bad schema of the benchmark with a message naming the
  problem (``Unknown format: colour``, ``required property 'b' is unsatisfiable``,
  ``Pointer '/$defs/missing' does not exist``). xgrammar compiles an unknown format and an
  unsatisfiable ``required`` without a word and prefixes its messages with C++ file and
  line; outlines-core compiles ``minimum > maximum`` and does not enforce integer bounds.
* It requires nothing and ships one abi3 wheel per platform (manylinux_2_31 x86_64 and
  aarch64, every CPython from 3.9), MIT. xgrammar (Apache-2.0) requires torch,
  transformers, pydantic, numpy, apache-tvm-ffi and an unpinned ``triton`` on Linux x86_64,
  which a CPU install would then download.
* It releases the GIL while it computes masks (a Python loop on the main thread ran at
  0.86-0.95 of its speed while another thread filled 64 masks per call), so masks can be
  filled while the forward runs; its Lark grammars with inline ``%json`` express the
  ``auto`` tool-call format (free text, or text then a forced valid call) directly.

How the engine plugs it in (see each module for details):

* Requests carry ``StructuredSpec | None``. The API layer may call :func:`check_spec` for an
  early 400; the engine compiles with :meth:`GrammarCompiler.compile` when the request is
  added (GrammarError -> the request is refused, nothing else is affected) and gives each
  sequence its own matcher (``n > 1``: one per sequence, from the same compiled grammar).
* Mask point: in the sampler, on the logits of the rows that sample, after logit bias and
  penalties and before temperature, top-k/p and min-p (so those filters and the greedy
  argmax see only allowed tokens); log-probabilities stay those of the raw logits.
* Off the critical path: ``MaskFiller.submit(matchers of the rows that will sample)`` after
  scheduling, before the forward; the sampler calls ``future.result().apply(logits)``.
* After sampling: ``matcher.accept(token)`` for each constrained row, before the next
  step's submit. False (the sampled token was forbidden: an engine bug) fails that request.
* Finish rules: when ``matcher.is_finished()`` the mask allows EOS alone; the engine
  finishes the sequence with reason stop as soon as that holds, even before it samples the
  EOS, and a grammar overrides ``min_tokens`` and ``ignore_eos`` (suppressing the only
  allowed token would leave nothing to sample). Stop strings and ``stop_token_ids`` still
  end a request early, leaving an incomplete document (finish reason stop); ``max_tokens``
  likewise (reason length). A preempted or interrupted step changes no matcher: the
  tokens a matcher has accepted are exactly the sequence's output tokens.
"""

from loramux.engine.structured.bitmask import (
    allocate_bitmask,
    allowed_token_ids,
    apply_token_bitmask,
    bitmask_width,
    token_bias,
    unpack_bitmask,
)
from loramux.engine.structured.compiler import CacheStats, CompiledGrammar, GrammarCompiler
from loramux.engine.structured.errors import GrammarError
from loramux.engine.structured.grammar import check_spec
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
    "CacheStats",
    "CompiledGrammar",
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
