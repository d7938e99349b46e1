"""Walking a text through a matcher the way the engine does: mask, check, accept."""

from __future__ import annotations

from dataclasses import dataclass

from loramux.engine.structured import GrammarMatcher, allocate_bitmask, allowed_token_ids


@dataclass
class Walk:
    refused_at: int | None  # the first token the mask did not allow (None: none refused)
    tokens: list[int]
    finished: bool  # only EOS may follow
    allowed_at_end: list[int]


def walk(matcher: GrammarMatcher, tokenizer, text: str) -> Walk:
    """Tokenize ``text`` as the tokenizer does and feed it token by token; stop at the
    first token the mask does not allow."""
    tokens = tokenizer.encode(text, add_special_tokens=False)
    bitmask = allocate_bitmask(1, len(tokenizer))
    for step, token in enumerate(tokens):
        matcher.fill_mask(bitmask, 0)
        if not (int(bitmask[0, token // 32]) >> (token % 32)) & 1:
            return Walk(step, tokens, matcher.is_finished(), allowed_token_ids(bitmask[0]))
        assert matcher.accept(token), f"token {step} allowed by the mask but not accepted"
    matcher.fill_mask(bitmask, 0)
    return Walk(None, tokens, matcher.is_finished(), allowed_token_ids(bitmask[0]))
