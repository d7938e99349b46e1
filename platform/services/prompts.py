"""The prompt side of admission: chat messages rendered, prompts counted and checked against
the model (vocabulary, context), and the bounds of one request's batch.

A request runs one prompt (chat, responses, a completion) or a batch of them (the completions
API's list ``prompt``); each prompt gets ``n`` sequences, or ``best_of`` candidates of which
the ``n`` best are returned. Every sequence is one engine request, so a request may run at
most :data:`MAX_SEQUENCES` (``prompts x max(n, best_of)``): a batch over it is a 400 naming
the limit, as is a ``best_of`` below ``n`` or over :data:`MAX_BEST_OF`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loramux.platform.errors import Invalid
from loramux.platform.services.inference_job import Prompt

MAX_SEQUENCES = 128
"""Engine requests one HTTP request may run: prompts x max(n, best_of)."""
MAX_BEST_OF = 16
"""Candidates per prompt (OpenAI's ``n`` bound too)."""


class PromptReader:
    """Reads prompts as the engine will: the base model's tokenizer and context length."""

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int):
        self._tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._vocab_size = vocab_size

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        try:
            return self._tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # a template error is the caller's messages' fault
            raise Invalid(f"messages cannot be rendered: {exc}", code="invalid_messages") from exc

    def read(
        self, prompts: Sequence[str | list[int]], *, generates: bool = True
    ) -> tuple[Prompt, ...]:
        """Each prompt with its length; a batch's errors name the prompt (``prompt[3]``).
        A prompt only scored (``generates`` false: max_tokens 0) may fill the context."""
        if not prompts:
            raise TypeError("read needs at least one prompt")
        names = ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]
        return tuple(
            Prompt(p, self.count(p, name, generates=generates))
            for p, name in zip(prompts, names, strict=True)
        )

    def count(
        self, prompt: str | list[int], name: str = "prompt", *, generates: bool = True
    ) -> int:
        """The prompt's length in tokens; 400 when it is empty, holds ids outside the
        vocabulary, or leaves no room to generate (checked here, before a stream starts)."""
        if isinstance(prompt, list):
            count = len(prompt)
            bad = [t for t in prompt if not 0 <= t < self._vocab_size]
            if bad:
                raise Invalid(
                    f"{name} token ids must be in [0, {self._vocab_size}); got {bad[:3]}",
                    code="invalid_prompt",
                )
        else:
            count = len(self._tokenizer(prompt)["input_ids"])
        if count == 0:
            raise Invalid(f"{name} is empty", code="invalid_prompt")
        if count > self.max_model_len - (1 if generates else 0):
            leaves = ", leaving no room to generate" if generates else ""
            raise Invalid(
                f"{name} has {count} tokens; the context limit is {self.max_model_len}{leaves}",
                code="context_length_exceeded",
            )
        return count

    def check_logit_bias(self, bias: dict[int, float] | None) -> None:
        """400 naming a ``logit_bias`` token id outside the vocabulary."""
        for token in bias or {}:
            if not 0 <= token < self._vocab_size:
                raise Invalid(
                    f"logit_bias key '{token}' is not a token id of this model: ids are in "
                    f"[0, {self._vocab_size})",
                    code="invalid_sampling_parameters",
                )

    def default_max_tokens(self, prompt_tokens: int) -> int:
        """Without max_tokens (chat): as much as the context leaves."""
        return max(1, self.max_model_len - prompt_tokens)

    def check_fits_context(self, prompt_tokens: int, max_tokens: Any) -> None:
        """400 when a given ``max_tokens`` can never fit the context with the prompt."""
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return  # SamplingParams names what is wrong with it
        if prompt_tokens + max_tokens > self.max_model_len:
            raise Invalid(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} "
                f"in the prompt, {max_tokens} in the completion). Please reduce the length "
                "of the prompt or of max_tokens.",
                code="context_length_exceeded",
            )


def sequences_per_prompt(n: int, best_of: int | None) -> int:
    """How many sequences each prompt runs: ``n``, or ``best_of`` (400 unless n <= best_of
    <= MAX_BEST_OF)."""
    if best_of is None:
        return n
    if not n <= best_of <= MAX_BEST_OF:
        raise Invalid(
            f"best_of must be in [n, {MAX_BEST_OF}] (the candidates per prompt of which the n "
            f"best are returned); got best_of={best_of} with n={n}",
            code="invalid_sampling_parameters",
        )
    return best_of


def check_batch(prompts: int, per_prompt: int) -> None:
    """400 when a request would run more than MAX_SEQUENCES engine requests."""
    if prompts * per_prompt > MAX_SEQUENCES:
        raise Invalid(
            f"{prompts} prompts x {per_prompt} sequences each (n, or best_of) is "
            f"{prompts * per_prompt} sequences; a request may run at most {MAX_SEQUENCES}. "
            "Send fewer prompts per request.",
            code="invalid_prompt",
        )
