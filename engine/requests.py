"""A request as the engine takes it: checked whole before anything changes, then made
into a ``Sequence`` (its token ids, detokenizer, grammar matcher, seeded generator and
speculation state)."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from loramux.engine.clock import Clock, WallClock
from loramux.engine.detokenizer import IncrementalDetokenizer
from loramux.engine.errors import EngineError
from loramux.engine.lora.adapter import LoRARequest
from loramux.engine.lora.mix import LoRAMix
from loramux.engine.sampler import make_generator
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.sequence import Sequence
from loramux.engine.speculative.speculator import Speculator
from loramux.engine.structured import CompiledGrammar, GrammarError, StructuredSpec
from loramux.engine.structured_outputs import Grammars


def _token_id(value) -> int:
    """An int token id; floats, bools and strings are refused, not coerced."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)  # int, numpy / 0-d torch integers
    except TypeError:
        raise EngineError(f"prompt token ids must be integers, got {value!r}") from None


@dataclass
class RequestFactory:
    """Checks requests against the model and the context limit, and makes sequences."""

    tokenizer: object
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_model_len: int
    device: torch.device  # where a seeded request's generator lives
    grammars: Grammars
    speculator: Speculator | None
    clock: Clock = field(default_factory=WallClock)  # arrival and finish times

    def make(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        *,
        lora: LoRARequest | None,
        priority: int,
        tenant: str | None,
        mix: LoRAMix | None = None,
    ) -> Sequence:
        """The request's sequence; ``EngineError`` naming the problem, with nothing made.
        (``Engine.add_request`` has checked the id, that ``params`` is a SamplingParams
        and the adapter's name.)"""
        vocab = self.vocab_size
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:  # the sampler would fail on them mid-step (min_tokens suppression)
            raise EngineError(f"stop_token_ids must be in [0, {vocab}); got {bad_stop[:3]}")
        self._check_logit_bias(params)
        prompt_ids = self.tokenize(prompt)
        self._check_prompt_fits(len(prompt_ids), params)
        grammar = None
        if params.structured is not None:
            grammar = self.compile_structured(params.structured, tenant).matcher()
        generator = None
        if params.seed is not None:
            generator = make_generator(params.seed, self.device)
        speculation = None
        if self.speculator is not None:
            adapters = mix.key if mix is not None else None if lora is None else lora.adapter_id
            key = (tenant, adapters)
            speculation = self.speculator.start(params, key)
        return Sequence(
            request_id,
            prompt_ids,
            params,
            lora=lora,
            mix=mix,
            priority=priority,
            tenant=tenant,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                prompt_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            ),
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            generator=generator,
            grammar=grammar,
            speculation=speculation,
            clock=self.clock.now,
        )

    def compile_structured(
        self, spec: StructuredSpec, tenant: str | None = None
    ) -> CompiledGrammar:
        """``spec`` compiled for this tokenizer (cached per spec and tenant, charged to the
        tenant's share of the cache); EngineError naming the problem if it cannot be
        enforced. Thread-safe."""
        try:
            return self.grammars.compile(spec, tenant)
        except GrammarError as exc:
            raise EngineError(str(exc)) from None

    def tokenize(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt)["input_ids"]
        else:
            if isinstance(prompt, bytes | bytearray) or not isinstance(prompt, Iterable):
                raise EngineError(
                    f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}"
                )
            ids = [_token_id(t) for t in prompt]
            vocab = self.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise EngineError(f"prompt token ids must be in [0, {vocab}); got {bad[:3]}")
        if not ids:
            raise EngineError("prompt is empty")
        return ids

    def _check_logit_bias(self, params: SamplingParams) -> None:
        # SamplingParams does not know the vocab; the sampler would fail mid-step on these.
        vocab = self.vocab_size
        bad = [t for t in params.logit_bias or () if t >= vocab]
        if bad:
            raise EngineError(
                f"logit_bias token id {bad[0]} is out of range: the model's vocab size is "
                f"{vocab} (ids 0 to {vocab - 1})"
            )

    def _check_prompt_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        # A prompt-only request (max_tokens 0) may fill the context: it generates nothing.
        room = 0 if params.max_tokens == 0 else 1
        if num_prompt_tokens + room > self.max_model_len:
            raise EngineError(
                f"prompt has {num_prompt_tokens} tokens; the context limit is "
                f"{self.max_model_len}, leaving no room to generate"
            )
