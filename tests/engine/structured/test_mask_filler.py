import json

import torch

from loramux.engine.structured import (
    JsonObject,
    JsonSchema,
    MaskFiller,
    Regex,
    allocate_bitmask,
    apply_token_bitmask,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["n", "tags"],
    "additionalProperties": False,
}


def _advanced(compiler, tokenizer, spec, text: str):
    """A matcher that has accepted ``text``."""
    matcher = compiler.matcher(spec)
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept(token)
    return matcher


def _batch(compiler, tokenizer):
    """Six rows: four at different grammar states, two unconstrained."""
    doc = json.dumps({"n": 12, "tags": ["a", "b"]})
    return [
        _advanced(compiler, tokenizer, JsonSchema(SCHEMA), doc[:7]),
        None,
        _advanced(compiler, tokenizer, JsonObject(), ""),
        _advanced(compiler, tokenizer, JsonSchema(SCHEMA), doc),  # finished: EOS alone
        None,
        _advanced(compiler, tokenizer, Regex("[0-9]{2}x"), "4"),
    ]


def test_fill_writes_each_constrained_rows_own_mask(compiler, tokenizer):
    matchers = _batch(compiler, tokenizer)
    filler = MaskFiller(len(tokenizer), threads=2, rows=2)  # grows past 2 rows
    masks = filler.fill(matchers)
    assert masks.rows.tolist() == [0, 2, 3, 5]
    expected = allocate_bitmask(4, len(tokenizer))
    for k, row in enumerate(masks.rows.tolist()):
        matchers[row].fill_mask(expected, k)
    assert torch.equal(masks.bitmask, expected)


def test_a_step_without_grammars_costs_nothing(tokenizer):
    assert MaskFiller(len(tokenizer)).fill([None, None]) is None


def test_apply_masks_only_the_constrained_rows(compiler, tokenizer):
    matchers = _batch(compiler, tokenizer)
    masks = MaskFiller(len(tokenizer)).fill(matchers)
    logits = torch.randn(len(matchers), len(tokenizer))
    before = logits.clone()
    masks.apply(logits)
    assert torch.equal(logits[[1, 4]], before[[1, 4]])
    finished = logits[3]
    assert torch.isfinite(finished).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    expected = before.clone()
    apply_token_bitmask(expected, masks.bitmask, masks.rows)
    assert torch.equal(logits, expected)


def test_background_fill_gives_the_same_masks(compiler, tokenizer):
    matchers = _batch(compiler, tokenizer)
    filler = MaskFiller(len(tokenizer))
    try:
        background = filler.submit(matchers).result(timeout=30)
        now = filler.fill(matchers)
        assert torch.equal(background.bitmask, now.bitmask)
        assert torch.equal(background.rows, now.rows)
    finally:
        filler.close()


def test_a_steps_masks_survive_the_next_fill(compiler, tokenizer):
    matchers = _batch(compiler, tokenizer)
    filler = MaskFiller(len(tokenizer))
    first = filler.fill(matchers)
    kept = first.bitmask.clone()
    filler.fill([matchers[2], None, matchers[0]])  # the other buffer
    assert torch.equal(first.bitmask, kept)


def test_one_constrained_row_is_filled_directly(compiler, tokenizer):
    matcher = _advanced(compiler, tokenizer, JsonObject(), '{"a":')
    masks = MaskFiller(len(tokenizer)).fill([None, matcher])
    expected = allocate_bitmask(1, len(tokenizer))
    matcher.fill_mask(expected, 0)
    assert masks.rows.tolist() == [1]
    assert torch.equal(masks.bitmask, expected)
