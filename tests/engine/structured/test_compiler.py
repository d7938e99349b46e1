import threading

import pytest

from loramux.engine.structured import (
    GrammarCompiler,
    GrammarError,
    JsonObject,
    JsonSchema,
    Regex,
    Tool,
    ToolCalls,
    ToolChoice,
    allocate_bitmask,
    allowed_token_ids,
    check_spec,
)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _with_format(name: str) -> dict:
    return {"type": "object", "properties": {"d": {"type": "string", "format": name}}}


def test_a_spec_compiles_once_and_equal_specs_hit_the_cache(compiler):
    before = compiler.cache_stats()
    first = compiler.compile(JsonSchema(dict(PERSON), strict=True))
    again = compiler.compile(JsonSchema(dict(PERSON), strict=True))
    after = compiler.cache_stats()
    assert again is first
    assert after.hits - before.hits >= 1
    assert after.misses - before.misses <= 1  # another test may have compiled it first


def test_strictness_is_part_of_the_key(compiler):
    assert compiler.compile(JsonSchema(PERSON, strict=False)) is not compiler.compile(
        JsonSchema(PERSON, strict=True)
    )


def test_the_cache_is_bounded_least_recently_used_first(tokenizer):
    a = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), eos_token_ids=[2]).compile(
        Regex("a+")
    )
    # Room for two grammars of a's size, not three (such small regexes measure alike).
    room = a.nbytes * 5 // 2
    small = GrammarCompiler(
        tokenizer,
        vocab_size=len(tokenizer),
        eos_token_ids=[2],
        cache_bytes=room,
        tenant_cache_bytes=room,
    )
    a, b = small.compile(Regex("a+")), small.compile(Regex("b+"))
    small.compile(Regex("a+"))  # a is now the most recent
    small.compile(Regex("c+"))  # evicts b
    assert small.cache_stats().entries == 2
    assert small.compile(Regex("a+")) is a
    assert small.compile(Regex("b+")) is not b


def test_threads_asking_for_one_new_spec_compile_it_once(compiler):
    spec = JsonSchema({**PERSON, "title": "threads"})
    before = compiler.cache_stats().misses
    results, start = [], threading.Barrier(8)

    def ask():
        start.wait()
        results.append(compiler.compile(spec))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(r) for r in results}) == 1
    assert compiler.cache_stats().misses - before == 1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (JsonSchema({"type": "strng"}), "json_schema cannot be enforced: Invalid type: strng"),
        (
            JsonSchema({"type": "string", "format": "colour"}),
            "json_schema cannot be enforced: Unknown format: colour",
        ),
        (
            JsonSchema({**PERSON, "required": ["name", "email"]}),
            "required property 'email' is unsatisfiable",
        ),
        (JsonSchema({"$ref": "#/$defs/missing"}), "'/$defs/missing' does not exist"),
        (JsonSchema({"type": "string", "pattern": "([a-z"}), "unclosed character class"),
        (Regex("([a-z"), "regex cannot be enforced: .*unclosed character class"),
        (
            ToolCalls((Tool("f", _with_format("x"), strict=True),)),
            "tool 'f' parameters cannot be enforced: Unknown format: x",
        ),
    ],
)
def test_a_schema_that_cannot_compile_raises_grammar_error_naming_the_problem(
    compiler, spec, message
):
    with pytest.raises(GrammarError, match=message.replace("$", r"\$").replace("(", r"\(")):
        compiler.compile(spec)
    # The same answer without a tokenizer, for the API's early 400.
    with pytest.raises(GrammarError):
        check_spec(spec)


def test_a_failed_spec_is_not_cached(compiler):
    spec = JsonSchema({"type": "strng", "title": "not cached"})
    for _ in range(2):
        with pytest.raises(GrammarError):
            compiler.compile(spec)
    assert not compiler.cached(spec)


def test_non_strict_ignores_what_it_cannot_enforce(compiler):
    compiler.compile(JsonSchema({"type": "string", "format": "colour"}, strict=False))
    tools = ToolCalls((Tool("f", _with_format("x"), strict=False),))
    compiler.compile(tools)


def test_valid_specs_pass_the_tokenizer_free_check():
    for spec in (JsonObject(), JsonSchema(PERSON), Regex("[0-9]+"), ToolCalls((Tool("f"),))):
        check_spec(spec)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"eos_token_ids": []},
        {"cache_bytes": 0},
        {"cache_bytes": 1 << 20, "tenant_cache_bytes": 2 << 20},
        {"vocab_size": 100},
    ],
)
def test_compiler_arguments_are_checked(tokenizer, kwargs):
    args = {"vocab_size": len(tokenizer), "eos_token_ids": [2], **kwargs}
    with pytest.raises(ValueError):
        GrammarCompiler(tokenizer, **args)


def test_tool_choice_named_and_required_compile(compiler):
    tools = (Tool("a"), Tool("b"))
    compiler.compile(ToolCalls(tools, ToolChoice.REQUIRED))
    compiler.compile(ToolCalls(tools, ToolChoice.NAMED, function="b"))


def test_a_model_vocab_wider_than_the_tokenizer_never_allows_the_extra_ids(tokenizer):
    wide = GrammarCompiler(tokenizer, vocab_size=len(tokenizer) + 40, eos_token_ids=[2])
    matcher = wide.matcher(Regex("[a-z]+"))
    bitmask = allocate_bitmask(1, len(tokenizer) + 40)
    matcher.fill_mask(bitmask, 0)
    allowed = allowed_token_ids(bitmask[0])
    assert allowed and max(allowed) < len(tokenizer)
