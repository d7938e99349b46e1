import json

import pytest
import torch

from loramux.engine.structured import (
    JsonObject,
    JsonSchema,
    Regex,
    allocate_bitmask,
    allowed_token_ids,
)

from .walk import walk

ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                },
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
        },
        "currency": {"enum": ["EUR", "USD"]},
        "gift": {"type": ["boolean", "null"]},
    },
    "required": ["order_id", "items", "currency", "gift"],
    "additionalProperties": False,
}
GOOD = {
    "order_id": "ORD-0042",
    "items": [{"sku": "cpu-x", "quantity": 2}, {"sku": "ram", "quantity": 4}],
    "currency": "EUR",
    "gift": None,
}


@pytest.mark.parametrize(
    "text",
    [
        json.dumps(GOOD),
        json.dumps(GOOD, separators=(",", ":")),
        json.dumps(GOOD, indent=2),
    ],
    ids=["default", "compact", "indented"],
)
def test_a_valid_document_walks_through_and_then_only_eos_is_allowed(compiler, tokenizer, text):
    result = walk(compiler.matcher(JsonSchema(ORDER)), tokenizer, text)
    assert result.refused_at is None
    assert result.finished
    assert result.allowed_at_end == [tokenizer.eos_token_id]


@pytest.mark.parametrize(
    ("document", "refused_text"),
    [
        ({**GOOD, "currency": "GBP"}, '"G'),
        ({**GOOD, "order_id": "ORD-42x"}, "x"),
        ({**GOOD, "items": []}, "]"),
        ({**GOOD, "items": [{"sku": "a", "quantity": 0}]}, "0"),
        ({"order_id": "ORD-0042", "extra": 1}, "extra"),
    ],
    ids=["enum", "pattern", "minItems", "minimum", "additional property"],
)
def test_an_invalid_document_is_refused_where_it_goes_wrong(
    compiler, tokenizer, document, refused_text
):
    text = json.dumps(document)
    result = walk(compiler.matcher(JsonSchema(ORDER)), tokenizer, text)
    assert result.refused_at is not None
    before = tokenizer.decode(result.tokens[: result.refused_at])
    refused = tokenizer.decode(result.tokens[result.refused_at : result.refused_at + 1])
    assert text.startswith(before + refused)
    assert refused_text in before + refused


def test_an_unfinished_document_is_not_finished_and_eos_is_not_allowed(compiler, tokenizer):
    result = walk(compiler.matcher(JsonSchema(ORDER)), tokenizer, json.dumps(GOOD)[:-1])
    assert result.refused_at is None
    assert not result.finished
    assert tokenizer.eos_token_id not in result.allowed_at_end


def test_json_object_takes_any_object_but_not_other_json(compiler, tokenizer):
    nested = json.dumps({"a": [1, {"b": None}], "c": "d", "e": {"f": [True, 2.5]}})
    assert walk(compiler.matcher(JsonObject()), tokenizer, nested).finished
    assert walk(compiler.matcher(JsonObject()), tokenizer, "[1, 2]").refused_at == 0
    assert walk(compiler.matcher(JsonObject()), tokenizer, ' {"a": 1}').refused_at == 0


def test_whitespace_is_bounded_so_a_model_cannot_loop_on_it(compiler, tokenizer):
    spaced = '{"a":' + " " * 17 + "1}"
    assert walk(compiler.matcher(JsonObject()), tokenizer, spaced).refused_at is not None
    assert walk(compiler.matcher(JsonObject()), tokenizer, '{"a":\n\n1}').refused_at is not None


def test_a_regex_spec_matches_the_whole_output(compiler, tokenizer):
    spec = Regex(r"(yes|no), because [a-z ]{1,40}\.")
    assert walk(compiler.matcher(spec), tokenizer, "yes, because it rains.").finished
    assert walk(compiler.matcher(spec), tokenizer, "maybe").refused_at == 0


def test_accepting_a_forbidden_token_fails_this_matcher_only(compiler, tokenizer):
    compiled = compiler.compile(JsonSchema(ORDER))
    bad, good = compiled.matcher(), compiled.matcher()
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    assert not bad.accept(letter)
    assert bad.error is not None and "doesn't satisfy the grammar" in bad.error
    assert bad.is_finished()
    bitmask = allocate_bitmask(1, len(tokenizer))
    bad.fill_mask(bitmask, 0)
    assert walk(good, tokenizer, json.dumps(GOOD)).finished  # the other sequence goes on
    assert allowed_token_ids(bitmask[0]) == [tokenizer.eos_token_id]


def test_sequences_of_one_request_have_independent_matchers(compiler, tokenizer):
    compiled = compiler.compile(JsonSchema(ORDER))
    first, second = compiled.matcher(), compiled.matcher()
    walk(first, tokenizer, json.dumps(GOOD))
    assert first.is_finished() and not second.is_finished()
    assert walk(second, tokenizer, json.dumps(GOOD)).finished


def test_rollback_forgets_the_last_tokens(compiler, tokenizer):
    matcher = compiler.matcher(JsonSchema(ORDER))
    text = json.dumps(GOOD)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    for token in tokens:
        assert matcher.accept(token)
    assert matcher.is_finished()
    matcher.rollback(3)
    assert not matcher.is_finished()
    for token in tokens[-3:]:
        assert matcher.accept(token)
    assert matcher.is_finished()


@pytest.mark.parametrize(
    "bitmask",
    [
        torch.zeros(1, 10, dtype=torch.int32),
        torch.zeros(1, 1536, dtype=torch.int64),
        torch.zeros(1536, 2, dtype=torch.int32).t(),
    ],
    ids=["width", "dtype", "not contiguous"],
)
def test_a_wrong_bitmask_is_refused_before_the_library_writes_to_it(compiler, tokenizer, bitmask):
    with pytest.raises(ValueError, match="contiguous int32 CPU tensor"):
        compiler.matcher(JsonObject()).fill_mask(bitmask, 0)


def test_a_row_outside_the_bitmask_is_refused(compiler, tokenizer):
    with pytest.raises(IndexError):
        compiler.matcher(JsonObject()).fill_mask(allocate_bitmask(2, len(tokenizer)), 2)
