"""``python -m loramux.benchmarks.grammar_engines``: three grammar engines on SmolLM2's tokenizer.

Structured outputs mask, at every decode step, the tokens a request's grammar forbids. This
compares the three libraries that can do it, xgrammar, llguidance and outlines-core, on the
CPU, on the tokenizer this engine serves (SmolLM2-135M-Instruct's, 49152 tokens):

* set-up: building each library's view of the tokenizer (once per engine);
* compile: a grammar for ``json_object`` (any JSON object) and for four realistic strict
  schemas (a profile with nested objects, an enum and a nullable object; an order with
  patterns and an array of objects; a two-tool call; an event with ``$defs``), cold (no
  cache), and a new request's matcher from the compiled grammar;
* per token, along a real JSON output tokenized by the tokenizer: the mask fill (one
  bitmask row) and the accept, median and p99 over every token of every repeat; every
  token must be allowed by the mask, and at the end only EOS;
* a batch step: 16 requests' masks filled one after the other in Python, and by the
  library's own parallel API where it has one, and whether a mask fill releases the GIL
  (a Python loop's progress on the main thread while another thread fills masks);
* JSON-schema features strict ``json_schema`` needs: each a schema, a document it must
  accept and one it must reject;
* errors: what each says for a schema it cannot compile (or whether it compiles it anyway);
* maintenance: version, license, what it requires (from the installed metadata).

An engine that is not installed is skipped and the report says so. The recorded
``benchmarks/results/grammar_engines.json`` is this module run with its defaults on the
2-core development machine (other work may share it: the medians are the figures to read).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from loramux.benchmarks.common.files import add_output_options
from loramux.benchmarks.common.machine import machine_info
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.common.report import Markdown, write


def _obj(properties: dict) -> dict:
    """A strict object: every property required, no others (OpenAI's strict mode)."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


_STR = {"type": "string"}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}

# name -> (schema, a document it accepts); json_object's is any JSON object.
WORKLOADS: dict[str, tuple[dict, object]] = {
    "json_object": (
        {"type": "object"},
        {
            "summary": "Quarterly revenue grew in every region except one.",
            "regions": [
                {"name": "EMEA", "growth": 0.12, "flags": []},
                {"name": "APAC", "growth": -0.03, "flags": ["currency", "supply"]},
            ],
            "confidence": 0.8,
            "final": True,
            "owner": None,
        },
    ),
    "profile": (
        _obj(
            {
                "name": {"type": "string", "minLength": 1},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "status": {"enum": ["active", "suspended", "deleted"]},
                "address": _obj(
                    {
                        "street": _STR,
                        "city": _STR,
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    }
                ),
                "tags": {"type": "array", "items": _STR, "maxItems": 5},
                "manager": {"anyOf": [{"type": "null"}, _obj({"name": _STR, "id": _INT})]},
            }
        ),
        {
            "name": "Ada Lovelace",
            "age": 36,
            "status": "active",
            "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
            "tags": ["mathematics", "poetry", "engines"],
            "manager": {"name": "Charles Babbage", "id": 1791},
        },
    ),
    "order": (
        _obj(
            {
                "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                "customer": _obj({"id": _INT, "name": _STR, "vip": _BOOL}),
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "items": _obj(
                        {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                            "quantity": {"type": "integer", "minimum": 1},
                            "unit_price": _NUM,
                        }
                    ),
                },
                "currency": {"enum": ["EUR", "USD", "GBP"]},
                "notes": {"type": ["string", "null"]},
            }
        ),
        {
            "order_id": "ORD-004217",
            "customer": {"id": 5521, "name": "Grace Hopper", "vip": True},
            "items": [
                {"sku": "CPU-0042", "quantity": 2, "unit_price": 199.99},
                {"sku": "RAM-1600", "quantity": 4, "unit_price": 45.5},
            ],
            "currency": "EUR",
            "notes": None,
        },
    ),
    "tool_call": (
        {
            "anyOf": [
                _obj(
                    {
                        "name": {"const": "get_weather"},
                        "arguments": _obj(
                            {
                                "location": _STR,
                                "unit": {"enum": ["celsius", "fahrenheit"]},
                                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                            }
                        ),
                    }
                ),
                _obj(
                    {
                        "name": {"const": "search_flights"},
                        "arguments": _obj(
                            {
                                "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                "passengers": _INT,
                                "cabin": {"enum": ["economy", "business"]},
                            }
                        ),
                    }
                ),
            ]
        },
        {
            "name": "search_flights",
            "arguments": {
                "origin": "CDG",
                "destination": "SFO",
                "passengers": 2,
                "cabin": "economy",
            },
        },
    ),
    "event_defs": (
        {
            "$defs": {"person": _obj({"name": _STR, "email": _STR, "optional": _BOOL})},
            **_obj(
                {
                    "title": _STR,
                    "organizer": {"$ref": "#/$defs/person"},
                    "attendees": {"type": "array", "items": {"$ref": "#/$defs/person"}},
                    "recurrence": {"enum": ["none", "daily", "weekly", "monthly"]},
                    "reminders_min": {"type": "array", "items": _INT},
                    "room": {"type": ["string", "null"]},
                }
            ),
        },
        {
            "title": "Design review",
            "organizer": {"name": "Alan", "email": "alan@example.org", "optional": False},
            "attendees": [
                {"name": "Barbara", "email": "barbara@example.org", "optional": False},
                {"name": "Edsger", "email": "edsger@example.org", "optional": True},
            ],
            "recurrence": "weekly",
            "reminders_min": [10, 60],
            "room": None,
        },
    ),
}


def _one(schema: dict) -> dict:
    """A feature's schema as the value ``v`` of a strict object (the API's root is one)."""
    return _obj({"v": schema})


# name -> (schema, document it must accept, document it must reject)
FEATURES: dict[str, tuple[dict, object, object]] = {
    "required": (_obj({"a": _STR, "b": _INT}), {"a": "x", "b": 1}, {"a": "x"}),
    "additionalProperties false": (_obj({"a": _STR}), {"a": "x"}, {"a": "x", "b": 2}),
    "enum": (_one({"enum": ["red", "green"]}), {"v": "red"}, {"v": "blue"}),
    "const": (_one({"const": "fixed"}), {"v": "fixed"}, {"v": "other"}),
    "nested object": (
        _one(_obj({"w": _obj({"x": _INT})})),
        {"v": {"w": {"x": 1}}},
        {"v": {"w": 1}},
    ),
    "array items": (_one({"type": "array", "items": _INT}), {"v": [1, 2]}, {"v": [1, "2"]}),
    "minItems/maxItems": (
        _one({"type": "array", "items": _INT, "minItems": 1, "maxItems": 2}),
        {"v": [1, 2]},
        {"v": [1, 2, 3]},
    ),
    "nullable (type list)": (_one({"type": ["integer", "null"]}), {"v": None}, {"v": "x"}),
    "anyOf": (_one({"anyOf": [_INT, _obj({"k": _STR})]}), {"v": {"k": "a"}}, {"v": [1]}),
    "$defs/$ref": (
        {"$defs": {"p": _obj({"x": _INT})}, **_one({"$ref": "#/$defs/p"})},
        {"v": {"x": 1}},
        {"v": {"y": 1}},
    ),
    "recursive $ref": (
        {
            "$defs": {
                "node": _obj(
                    {
                        "label": _STR,
                        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    }
                )
            },
            **_one({"$ref": "#/$defs/node"}),
        },
        {"v": {"label": "a", "children": [{"label": "b", "children": []}]}},
        {"v": {"label": "a", "children": [{"label": 1, "children": []}]}},
    ),
    "string pattern": (
        _one({"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}),
        {"v": "ABC-12"},
        {"v": "AB-123"},
    ),
    "minLength/maxLength": (
        _one({"type": "string", "minLength": 2, "maxLength": 3}),
        {"v": "abc"},
        {"v": "abcd"},
    ),
    "integer minimum/maximum": (
        _one({"type": "integer", "minimum": 1, "maximum": 10}),
        {"v": 10},
        {"v": 11},
    ),
    "format date-time": (
        _one({"type": "string", "format": "date-time"}),
        {"v": "2024-05-01T10:00:00Z"},
        {"v": "yesterday"},
    ),
}

# name -> a schema no engine should compile: each should say what is wrong.
BAD_SCHEMAS: dict[str, dict] = {
    "unknown type": {"type": "object", "properties": {"a": {"type": "strng"}}},
    "broken pattern": _one({"type": "string", "pattern": "([a-z"}),
    "dangling $ref": _one({"$ref": "#/$defs/missing"}),
    "unknown format": _one({"type": "string", "format": "colour"}),
    "minimum > maximum": _one({"type": "integer", "minimum": 5, "maximum": 1}),
    "required key not allowed": {
        "type": "object",
        "properties": {"a": _STR},
        "required": ["b"],
        "additionalProperties": False,
    },
}


# --- one small adapter per library: setup, compile, matcher, and a matcher's three calls.
# ``wheels``: checked with `pip download --only-binary=:all: --platform ... --python-version
# ...` (the package index as mirrored here): every engine has wheels for these four.


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable stand-in character -> the byte it stands for."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    decoder, shifted = {}, 0
    for byte in range(256):
        if byte in kept:
            decoder[chr(byte)] = byte
        else:  # bytes with no printable form were moved past 255, in order
            decoder[chr(256 + shifted)] = byte
            shifted += 1
    return decoder


class XgrammarEngine:
    name = module = "xgrammar"
    wheels = "cp311/cp312 manylinux_2_28 x86_64 and aarch64 (+ apache-tvm-ffi, same tags)"

    def setup(self, tokenizer) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        # Its cache off, so that every compile is cold.
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, schema: dict):
        # strict_mode=False keeps JSON-schema semantics (extra keys only where
        # additionalProperties allows them); the strict schemas here say false themselves.
        return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def complete(self, matcher) -> bool:
        return matcher.is_completed()

    def batch_fill(self, matchers: list, bitmask: torch.Tensor, threads: int) -> None:
        batches = self.__dict__.setdefault("batches", {})
        if threads not in batches:
            batches[threads] = self.xgr.BatchGrammarMatcher(max_threads=threads)
        batches[threads].batch_fill_next_token_bitmask(matchers, bitmask)


class LlguidanceEngine:
    name = module = "llguidance"
    wheels = "one abi3 wheel per platform (cp39+): manylinux_2_31 x86_64 and aarch64"

    def setup(self, tokenizer) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))

    def compile(self, schema: dict):
        # The grammar is checked and its parser built when the matcher is made; the lexer is
        # built lazily during the first masks. A compiled template is copied per request.
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        template = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(template.get_error())
        return template

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        view = bitmask[row]
        matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * 4)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def complete(self, matcher) -> bool:
        return matcher.is_accepting()

    def batch_fill(self, matchers: list, bitmask: torch.Tensor, threads: int) -> None:
        import llguidance.torch

        executors = self.__dict__.setdefault("executors", {})
        if threads not in executors:
            executors[threads] = self.llg.LLExecutor(num_threads=threads)
        pairs = [(m, row) for row, m in enumerate(matchers)]
        llguidance.torch.fill_next_token_bitmask_par(executors[threads], pairs, bitmask)


class OutlinesCoreEngine:
    name, module = "outlines-core", "outlines_core"
    wheels = "cp311/cp312 manylinux_2_17 x86_64, manylinux_2_28 aarch64"

    def setup(self, tokenizer) -> None:
        import outlines_core

        self.oc = outlines_core
        # Vocabulary.from_pretrained downloads from the hub: build it from the local tokenizer,
        # each token as the bytes it stands for; special tokens are not text.
        decoder = _byte_decoder()
        special = set(tokenizer.added_tokens_decoder)
        tokens: dict[bytes, list[int]] = {}
        for text, token_id in tokenizer.get_vocab().items():
            if token_id not in special:
                tokens.setdefault(bytes(decoder[c] for c in text), []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, tokens)

    def compile(self, schema: dict):
        # outlines-core is regular: a JSON-schema becomes a regex, then an index over the
        # vocabulary. Any JSON object is only reachable as a bounded-depth regex.
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        view = bitmask[row]
        matcher.write_mask_into(view.data_ptr(), view.numel(), 4)

    def accept(self, matcher, token: int) -> bool:
        try:
            matcher.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def complete(self, matcher) -> bool:
        return matcher.is_finished()

    batch_fill = None


ADAPTERS = {cls.name: cls for cls in (XgrammarEngine, LlguidanceEngine, OutlinesCoreEngine)}
ENGINES = tuple(ADAPTERS)


# --- measurements ---


def _encode(tokenizer, document) -> list[int]:
    return tokenizer.encode(json.dumps(document), add_special_tokens=False)


def _bitmask(rows: int, vocab: int) -> torch.Tensor:
    return torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int32)


def _allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def _allowed_ids(bitmask: torch.Tensor, row: int) -> list[int]:
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten().nonzero().flatten().tolist()


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _median_us(samples_ns: list[int]) -> float | None:
    return round(statistics.median(samples_ns) / 1e3, 1) if samples_ns else None


def _us(samples_ns: list[int], q: float) -> float:
    ordered = sorted(samples_ns)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3, 1)


def walk(engine, compiled, tokens: list[int], eos: int, vocab: int) -> dict:
    """One request along ``tokens``: each step's mask and accept timed; whether every token
    was allowed, and whether at the end the grammar was complete with only EOS allowed."""
    bitmask = _bitmask(1, vocab)
    started = time.perf_counter_ns()
    matcher = engine.matcher(compiled)
    new_ns = time.perf_counter_ns() - started
    fill_ns, accept_ns = [], []
    for step, token in enumerate(tokens):
        t0 = time.perf_counter_ns()
        engine.fill(matcher, bitmask, 0)
        t1 = time.perf_counter_ns()
        ok = _allowed(bitmask, 0, token) and engine.accept(matcher, token)
        t2 = time.perf_counter_ns()
        if not ok:
            return {"ok": False, "rejected_at": step, "fill_ns": fill_ns, "accept_ns": accept_ns}
        fill_ns.append(t1 - t0)
        accept_ns.append(t2 - t1)
    engine.fill(matcher, bitmask, 0)
    return {
        "ok": engine.complete(matcher) and _allowed_ids(bitmask, 0) == [eos],
        "rejected_at": None,
        "new_matcher_ns": new_ns,
        "fill_ns": fill_ns,
        "accept_ns": accept_ns,
    }


def measure_workload(engine, schema, document, tokenizer, repeats: int) -> dict:
    tokens = _encode(tokenizer, document)
    eos, vocab = tokenizer.eos_token_id, len(tokenizer)
    # A cold request's time to its first mask: compile + matcher + one fill.
    started = time.perf_counter()
    compiled = engine.compile(schema)
    compile_s = [time.perf_counter() - started]
    engine.fill(engine.matcher(compiled), _bitmask(1, vocab), 0)
    first_mask_s = time.perf_counter() - started
    # More compiles where one is quick (outlines-core's any-object index takes seconds).
    for _ in range(repeats - 1 if compile_s[0] < 1.0 else 0):
        started = time.perf_counter()
        compiled = engine.compile(schema)
        compile_s.append(time.perf_counter() - started)
    walks = [walk(engine, compiled, tokens, eos, vocab) for _ in range(repeats)]
    fills = [ns for w in walks for ns in w["fill_ns"]]
    accepts = [ns for w in walks for ns in w["accept_ns"]]
    row = {
        "tokens": len(tokens),
        "compile_ms_median": _ms(statistics.median(compile_s)),
        "compile_ms_max": _ms(max(compile_s)),
        "first_mask_ms": _ms(first_mask_s),
        "valid_walk_ok": all(w["ok"] for w in walks),
        "rejected_at": next((w["rejected_at"] for w in walks if not w["ok"]), None),
    }
    if fills:
        row |= {
            "new_matcher_us": _median_us([w["new_matcher_ns"] for w in walks if w["ok"]]),
            "fill_us_p50": _us(fills, 0.5),
            "fill_us_p99": _us(fills, 0.99),
            "fill_us_max": _us(fills, 1.0),
            "first_walk_fill_us_mean": round(statistics.fmean(walks[0]["fill_ns"]) / 1e3, 1),
            "accept_us_p50": _us(accepts, 0.5),
            "accept_us_p99": _us(accepts, 0.99),
        }
    return row


def measure_batch(engine, compiled_docs: list, tokenizer, rows: int, steps: int) -> dict:
    """``rows`` requests (cycling over the workloads) advanced together; per step the masks
    of all rows, serially in Python, by the library's batch API and by a 2-thread pool."""
    vocab = len(tokenizer)
    jobs = []
    for i in range(rows):
        compiled, document = compiled_docs[i % len(compiled_docs)]
        jobs.append((engine.matcher(compiled), _encode(tokenizer, document)))
    steps = min(steps, min(len(t) for _, t in jobs))
    bitmask = _bitmask(rows, vocab)
    pool = ThreadPoolExecutor(max_workers=2)
    serial, batched, pooled = [], [], []
    for step in range(steps):
        matchers = [m for m, _ in jobs]
        t0 = time.perf_counter()
        for row, m in enumerate(matchers):
            engine.fill(m, bitmask, row)
        t1 = time.perf_counter()
        if engine.batch_fill is not None:
            engine.batch_fill(matchers, bitmask, threads=2)
        t2 = time.perf_counter()
        list(pool.map(lambda pair: engine.fill(pair[1], bitmask, pair[0]), enumerate(matchers)))
        t3 = time.perf_counter()
        serial.append(t1 - t0)
        batched.append(t2 - t1)
        pooled.append(t3 - t2)
        for m, tokens in jobs:
            engine.accept(m, tokens[step])
    pool.shutdown()
    return {
        "rows": rows,
        "steps": steps,
        "serial_ms_median": _ms(statistics.median(serial)),
        "batch_api_ms_median": _ms(statistics.median(batched)) if engine.batch_fill else None,
        "thread_pool_ms_median": _ms(statistics.median(pooled)),
    }


def gil_probe(engine, compiled_docs: list, tokenizer, rows: int = 64, seconds: float = 0.4) -> dict:
    """A Python loop's speed on the main thread while a second thread fills masks, over its
    speed alone: near 1 means the fill releases the GIL, near 0 that it holds it.

    The second thread makes long native calls (one call fills ``rows`` masks on one library
    thread), so that the Python between calls is a small part of its time; outlines-core has
    no batch call, and its per-row calls are as much Python as native work.
    """
    vocab = len(tokenizer)
    matchers = [engine.matcher(compiled_docs[i % len(compiled_docs)][0]) for i in range(rows)]
    bitmask = _bitmask(rows, vocab)

    def spin() -> float:
        count, deadline = 0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            count += 1
        return count / seconds

    alone = spin()
    stop, calls = threading.Event(), [0]

    def filler() -> None:
        while not stop.is_set():
            if engine.batch_fill is not None:
                engine.batch_fill(matchers, bitmask, threads=1)
            else:
                for row, matcher in enumerate(matchers):
                    engine.fill(matcher, bitmask, row)
            calls[0] += 1

    worker = threading.Thread(target=filler)
    worker.start()
    shared = spin()
    stop.set()
    worker.join()
    return {
        "python_progress_while_filling": round(shared / alone, 2),
        "call": f"{rows} rows per call" if engine.batch_fill else "one row per call",
        "fill_calls": calls[0],
    }


def measure_features(engine, tokenizer) -> dict:
    eos, vocab = tokenizer.eos_token_id, len(tokenizer)
    out = {}
    for name, (schema, good, bad) in FEATURES.items():
        try:
            compiled = engine.compile(schema)
        except Exception as exc:
            out[name] = {"supported": False, "note": f"compile error: {_first_line(exc)}"}
            continue
        valid, invalid = (
            walk(engine, compiled, _encode(tokenizer, doc), eos, vocab)["ok"] for doc in (good, bad)
        )
        if not valid:
            note = "rejects a valid document"
        else:
            note = "accepts an invalid document" if invalid else ""
        out[name] = {"supported": valid and not invalid, "note": note}
    return out


def _first_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' / '.join(lines)[:160]}"


def measure_errors(engine) -> dict:
    out = {}
    for name, schema in BAD_SCHEMAS.items():
        try:
            engine.compile(schema)
        except Exception as exc:
            out[name] = {"raises": True, "message": _first_line(exc)}
        else:
            out[name] = {"raises": False, "message": "compiled without an error"}
    return out


def maintenance(engine) -> dict:
    meta = importlib.metadata.metadata(engine.name)
    requires = [r for r in (meta.get_all("Requires-Dist") or []) if "extra ==" not in r]
    return {
        "version": meta["Version"],
        "license": meta.get("License-Expression") or meta.get("License"),
        "requires": requires,
        "wheels": engine.wheels,
    }


def run_engine(name: str, tokenizer, repeats: int) -> dict:
    engine = ADAPTERS[name]()
    setup_s = []
    for _ in range(max(1, repeats // 2)):
        started = time.perf_counter()
        engine.setup(tokenizer)
        setup_s.append(time.perf_counter() - started)
    result = {"setup_ms_median": _ms(statistics.median(setup_s)), "workloads": {}}
    compiled_docs = []
    for wname, (schema, document) in WORKLOADS.items():
        print(f"  {name}: {wname}", flush=True)
        result["workloads"][wname] = measure_workload(engine, schema, document, tokenizer, repeats)
        if wname != "json_object":
            compiled_docs.append((engine.compile(schema), document))
    result["batch"] = measure_batch(engine, compiled_docs, tokenizer, rows=16, steps=24)
    result["gil"] = gil_probe(engine, compiled_docs, tokenizer)
    result["features"] = measure_features(engine, tokenizer)
    result["errors"] = measure_errors(engine)
    result["maintenance"] = maintenance(engine)
    return result


def _pair(workload: dict, key: str) -> str:
    if f"{key}_p50" not in workload:
        return f"walk failed at token {workload['rejected_at']}"
    return f"{workload[f'{key}_p50']} / {workload[f'{key}_p99']}"


def _walked(workload: dict) -> str:
    if workload["valid_walk_ok"]:
        return "yes"
    where = workload["rejected_at"]
    end = "not complete at the end" if where is None else f"token {where} refused"
    return f"no ({end} of {workload['tokens']})"


def _column(engine: dict) -> dict:
    """One engine's cells in the report's table, by row."""
    cells = {"tokenizer set-up ms": engine["setup_ms_median"]}
    for w, r in engine["workloads"].items():
        cells |= {
            f"{w}: compile ms (cold)": r["compile_ms_median"],
            f"{w}: first mask ms (compile+matcher+fill)": r["first_mask_ms"],
            f"{w}: fill µs p50 / p99 ({r['tokens']} tok)": _pair(r, "fill_us"),
            f"{w}: fill µs mean, first request": r.get("first_walk_fill_us_mean"),
            f"{w}: accept µs p50 / p99": _pair(r, "accept_us"),
            f"{w}: new matcher µs": r.get("new_matcher_us"),
            f"{w}: valid walk, only EOS at end": _walked(r),
        }
    batch, gil, meta = engine["batch"], engine["gil"], engine["maintenance"]
    cells |= {
        f"{batch['rows']} rows, one step: serial ms": batch["serial_ms_median"],
        f"{batch['rows']} rows: library batch API ms": batch["batch_api_ms_median"],
        f"{batch['rows']} rows: 2-thread pool ms": batch["thread_pool_ms_median"],
        "Python progress while another thread fills (1 = GIL released)": (
            f"{gil['python_progress_while_filling']} ({gil['call']})"
        ),
    }
    for f, r in engine["features"].items():
        cells[f"feature: {f}"] = "yes" if r["supported"] else f"no ({r['note']})"
    for b, r in engine["errors"].items():
        cells[f"bad schema: {b}"] = r["message"].replace("|", "/")
    requires = ", ".join(meta["requires"]) or "nothing"
    return cells | {"license": meta["license"], "requires": requires, "wheels": meta["wheels"]}


def render(report: dict) -> Markdown:
    engines = report["engines"]
    md = Markdown(f"Grammar engines on {report['tokenizer']} (vocab {report['vocab']}, CPU)")
    skipped = [f"{n}: skipped ({e['skipped']})" for n, e in engines.items() if "skipped" in e]
    md.text("\n".join(skipped))
    columns = {n: _column(e) for n, e in engines.items() if "skipped" not in e}
    if columns:
        labels = next(iter(columns.values()))
        rows = [(label, *(c[label] for c in columns.values())) for label in labels]
        md.table(("", *columns), rows, "l" * (len(columns) + 1))
    load, cores = report["loadavg_1m"], report["machine"]["nproc"]
    busy = (
        ": other work shared the machine (medians are the figures to read; the thread-pool "
        "and batch rows suffer most)."
    )
    md.machine(report["machine"])
    return md.text(
        f"1-minute load average {load['before']} before, {load['after']} after, on {cores} "
        f"cores{busy if max(load.values()) > cores else '.'}"
    )


def add_options(parser: argparse.ArgumentParser) -> None:
    add_output_options(parser)
    parser.add_argument("--tokenizer", type=Path, help="an HF tokenizer folder (default: SmolLM2)")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--repeats", type=int, default=5, help="compiles and walks per workload")


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    folder = args.tokenizer or prepare_model(args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    torch.set_num_threads(1)  # the engine's masks are CPU work beside the model, not torch's
    load_before = round(os.getloadavg()[0], 2)
    report = {
        "tokenizer": Path(folder).name,
        "vocab": len(tokenizer),
        "repeats": args.repeats,
        "machine": machine_info(),
        "engines": {},
    }
    for name, adapter in ADAPTERS.items():
        if name not in args.engines:
            report["engines"][name] = {"skipped": "not asked for (--engines)"}
            continue
        try:
            importlib.import_module(adapter.module)
        except ImportError:
            report["engines"][name] = {"skipped": f"not installed (pip install {name})"}
            continue
        print(f"measuring {name}", flush=True)
        report["engines"][name] = run_engine(name, tokenizer, args.repeats)
    report["loadavg_1m"] = {"before": load_before, "after": round(os.getloadavg()[0], 2)}
    write(args.out / "grammar_engines", report, render(report))
    return 0
