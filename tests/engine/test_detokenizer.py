"""Tests for loramux.engine.detokenizer (incremental detokenization, stop strings)."""

from __future__ import annotations

import time
from typing import ClassVar

import pytest

from loramux.engine.detokenizer import IncrementalDetokenizer, TextDelta

IM_START, IM_END, ENDOFTEXT = 1, 2, 0

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing spaces  ",
    "Café, naïve, façade, Ångström, jalapeño, über, señor.",
    "日本語のテキストと中文文本，还有한국어 문장。",
    "Emoji: 🎉🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽 done",
    "def f(x):\n    return x * 2\n\n\tif True:\n\t\tpass  # tabs\n",
    "```python\nprint('hi')\n```\n\n- item 1\n- item 2\r\n",
    "Mixed: résumé 東京 🙂 a\u00a0b \u200b zero-width, math ∑∫√∞ ≠ ≤",
    "Ünïcödé everywhere: ǅ ﬁ ẞ ₿ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀",
    "",
    "x",
    "\n\n\n",
]


def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")


def stream(tokenizer, ids, *, prompt=None, **kwargs):
    """Feed ``ids`` one by one; return (detokenizer, deltas, finish() or None if stopped)."""
    det = IncrementalDetokenizer(
        tokenizer, prompt if prompt is not None else prompt_ids(tokenizer), **kwargs
    )
    deltas: list[TextDelta] = []
    for token_id in ids:
        delta = det.add_token(token_id)
        deltas.append(delta)
        if delta.stop_string is not None:
            return det, deltas, None
    return det, deltas, det.finish()


def split_char_ids(tokenizer, text: str) -> list[int]:
    """ids of ``text``, asserting some token holds only part of a UTF-8 character."""
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "no split character in " + text
    return ids


# -- decode equivalence ---------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("with_prompt", [True, False], ids=["prompt", "no-prompt"])
def test_stream_equals_full_decode(tokenizer, text, with_prompt):
    ids = tokenizer.encode(text)
    det, deltas, rest = stream(tokenizer, ids, prompt=None if with_prompt else [])
    streamed = "".join(d.text for d in deltas) + rest
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert det.output_text == streamed
    assert all(d.stop_string is None for d in deltas)


@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_no_delta_contains_replacement_char_for_valid_utf8(tokenizer, text):
    _, deltas, rest = stream(tokenizer, tokenizer.encode(text))
    for d in [*(d.text for d in deltas), rest]:
        assert "\ufffd" not in d


def test_split_multibyte_char_held_until_complete(tokenizer):
    # "🎉" is four bytes split over byte-level tokens: nothing of it may show until
    # the last byte arrives, and then the whole character shows at once.
    ids = split_char_ids(tokenizer, "ok 🎉")
    det = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer))
    texts = [det.add_token(i).text for i in ids]
    assert texts[-1].endswith("🎉")
    assert "".join(texts) == "ok 🎉"
    assert det.finish() == ""


def test_incomplete_char_at_end_released_as_replacement_by_finish(tokenizer):
    ids = split_char_ids(tokenizer, "abc 世")
    # Cut off the last byte(s) of 世: the sequence ends on an incomplete character.
    ids = ids[:-1]
    expected = tokenizer.decode(ids)
    assert expected.endswith("\ufffd")
    det = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer))
    shown = "".join(det.add_token(i).text for i in ids)
    assert "\ufffd" not in shown
    rest = det.finish()
    assert rest.endswith("\ufffd")
    assert shown + rest == expected


def test_invalid_bytes_in_the_middle_emitted_as_in_decode(tokenizer):
    head = split_char_ids(tokenizer, "世")[:-1]  # an incomplete character ...
    ids = tokenizer.encode("a") + head + tokenizer.encode(" and more text")  # ... never completed
    expected = tokenizer.decode(ids)
    assert "\ufffd" in expected
    _, deltas, rest = stream(tokenizer, ids)
    assert rest == ""  # released once later text showed the character would never complete
    assert "".join(d.text for d in deltas) == expected


def test_prompt_ending_mid_character(tokenizer):
    # The prompt's last token is the first part of a character and the output holds
    # the rest: the output alone decodes to replacement chars, and so must the stream.
    ids = split_char_ids(tokenizer, "hi 🎉 there")
    cut = next(k for k, i in enumerate(ids) if "\ufffd" in tokenizer.decode([i])) + 1
    prompt, output = ids[:cut], ids[cut:]
    _, deltas, rest = stream(tokenizer, output, prompt=prompt)
    assert "".join(d.text for d in deltas) + rest == tokenizer.decode(output)


class _SentencePieceLike:
    """Decodes like SentencePiece: "▁" is a space, and a text's leading space is dropped."""

    pieces: ClassVar[dict[int, str]] = {0: "▁Hello", 1: "▁world", 2: "!"}

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(self.pieces[i] for i in ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text


def test_prompt_context_keeps_first_output_token_leading_space():
    det = IncrementalDetokenizer(_SentencePieceLike(), [0])
    assert det.add_token(1).text == " world"
    assert det.add_token(2).text == "!"
    # Without a prompt there is no context and the first token starts the text.
    det = IncrementalDetokenizer(_SentencePieceLike(), [])
    assert det.add_token(1).text == "world"


# -- special tokens -------------------------------------------------------------


def test_special_tokens_skipped(tokenizer):
    ids = [IM_START, *tokenizer.encode("Hello"), IM_END, *tokenizer.encode(" there"), ENDOFTEXT]
    _, deltas, rest = stream(tokenizer, ids, skip_special_tokens=True)
    streamed = "".join(d.text for d in deltas) + rest
    assert streamed == "Hello there" == tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_kept(tokenizer):
    ids = [IM_START, *tokenizer.encode("Hello"), IM_END, *tokenizer.encode(" there"), ENDOFTEXT]
    _, deltas, rest = stream(tokenizer, ids, skip_special_tokens=False)
    streamed = "".join(d.text for d in deltas) + rest
    assert streamed == "<|im_start|>Hello<|im_end|> there<|endoftext|>"
    assert streamed == tokenizer.decode(ids, skip_special_tokens=False)


# -- stop strings ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("The answer is 42. Done here, nothing more.", "42. Done"),
        ("Party time 🎉🎉 and then more words", "time 🎉🎉 and"),
        ("Look: ###END### trailing", "###END###"),
    ],
)
def test_stop_string_spanning_tokens(tokenizer, text, stop):
    ids = tokenizer.encode(text)
    # The stop string must really span tokens for this test to mean anything.
    assert not any(stop in tokenizer.decode([i]) for i in ids)
    det, deltas, rest = stream(tokenizer, ids, stop=[stop])
    assert rest is None  # stopped
    assert deltas[-1].stop_string == stop
    assert len(deltas) < len(ids)  # it stopped at the token completing the stop string
    before = text[: text.index(stop)]
    assert det.output_text == before == "".join(d.text for d in deltas)
    assert det.stop_string == stop


def test_stop_string_at_first_token(tokenizer):
    ids = tokenizer.encode("Hello world")
    det = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer), stop=["Hello"])
    delta = det.add_token(ids[0])
    assert delta == TextDelta("", "Hello")
    assert det.output_text == ""

    det = IncrementalDetokenizer(
        tokenizer, prompt_ids(tokenizer), stop=["Hello"], include_stop_str_in_output=True
    )
    assert det.add_token(ids[0]) == TextDelta("Hello", "Hello")
    assert det.output_text == "Hello"


@pytest.mark.parametrize(
    "stops", [["delta", "beta", "gamma"], ["gamma", "beta", "delta"], ["beta", "delta"]]
)
def test_earliest_stop_string_wins(tokenizer, stops):
    text = "alpha beta gamma delta epsilon"
    det, deltas, rest = stream(tokenizer, tokenizer.encode(text), stop=stops)
    assert rest is None
    assert deltas[-1].stop_string == "beta"
    assert det.output_text == "alpha "


def test_stop_strings_completing_in_one_token_first_to_end_wins(tokenizer):
    # Both stop strings complete on the same token; "ab" ends first, so a reader
    # would have seen it before "xabc" was complete.
    det = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer), stop=["xabc", "ab"])
    ids = tokenizer.encode("zz xabc")
    deltas = [det.add_token(i) for i in ids]
    assert deltas[-1].stop_string == "ab"
    assert det.output_text == "zz x"


def test_include_stop_str_in_output(tokenizer):
    text = "The answer is 42. Done here, nothing more."
    det, deltas, rest = stream(
        tokenizer, tokenizer.encode(text), stop=["42. Done"], include_stop_str_in_output=True
    )
    assert rest is None
    assert deltas[-1].stop_string == "42. Done"
    assert det.output_text == "The answer is 42. Done"
    assert "".join(d.text for d in deltas) == "The answer is 42. Done"


def test_partial_stop_match_held_back_then_released_by_finish(tokenizer):
    text = "wait for it ###"
    ids = tokenizer.encode(text)
    det = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer), stop=["####"])
    shown = "".join(det.add_token(i).text for i in ids)
    assert shown == "wait for it "  # "###" might still become "####"
    assert det.output_text == shown
    rest = det.finish()
    assert rest == "###"
    assert det.output_text == text
    assert det.stop_string is None


def test_partial_stop_match_released_when_it_diverges(tokenizer):
    _, deltas, rest = stream(tokenizer, tokenizer.encode("a ## b ## c"), stop=["###"])
    assert rest == ""
    assert "".join(d.text for d in deltas) == "a ## b ## c"


def test_stop_string_completed_by_text_released_at_finish(tokenizer):
    # The last token is " " plus the first bytes of an emoji that never completes, so
    # it is held back as incomplete; at finish() its " " completes the stop "x ".
    partial = next(i for i in tokenizer.encode(" 🎉") if tokenizer.decode([i]) == " \ufffd")
    det = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer), stop=["x "])
    assert det.add_token(tokenizer.encode("x")[0]).text == ""
    assert det.add_token(partial) == TextDelta("", None)
    assert det.finish() == ""
    assert det.stop_string == "x "


def test_add_token_after_stop_raises(tokenizer):
    ids = tokenizer.encode("one two three four")
    det, deltas, rest = stream(tokenizer, ids, stop=["two"])
    assert rest is None and deltas[-1].stop_string == "two"
    with pytest.raises(RuntimeError):
        det.add_token(ids[-1])
    assert det.finish() == ""  # nothing held back after a stop


def test_add_token_after_finish_raises(tokenizer):
    det = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer))
    det.add_token(tokenizer.encode("hi")[0])
    det.finish()
    with pytest.raises(RuntimeError):
        det.add_token(tokenizer.encode("hi")[0])


# -- cost -----------------------------------------------------------------------


class _CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode() call was given."""

    def __init__(self, inner):
        self.inner = inner
        self.decode_lengths: list[int] = []

    def decode(self, ids, **kwargs):
        self.decode_lengths.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def test_long_output_decodes_constant_window(tokenizer):
    text = " ".join(TEXTS[:10]) * 20
    ids = tokenizer.encode(text)[:2000]
    assert len(ids) == 2000
    counting = _CountingTokenizer(tokenizer)
    start = time.perf_counter()
    _, deltas, rest = stream(
        counting, ids, prompt=prompt_ids(tokenizer), stop=["<never appears>", "STOP"]
    )
    elapsed = time.perf_counter() - start
    assert "".join(d.text for d in deltas) + rest == tokenizer.decode(ids)
    # Each decode sees a small window, never the whole output: O(1) work per token.
    assert max(counting.decode_lengths) <= 16
    assert sum(counting.decode_lengths) <= 20 * len(ids)
    assert elapsed < 1.0, f"2000 tokens took {elapsed:.2f}s"
