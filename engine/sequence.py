"""One request's state inside the engine: tokens, progress, stop checks, text, metrics."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from loramux.engine.detokenizer import IncrementalDetokenizer
from loramux.engine.lora.adapter import LoRARequest
from loramux.engine.lora.mix import LoRAMix, MixKey
from loramux.engine.sampler import TokenLogprobs
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.speculative.speculator import RequestSpeculation
from loramux.engine.structured import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the engine could not serve it (e.g. its adapter failed)


class ErrorKind(enum.StrEnum):
    """Why the engine ended a request it could not serve (finish reason ``error``)."""

    ADAPTER_LOAD_FAILED = "adapter_load_failed"  # its adapter could not be fetched or parsed
    ADAPTER_TOO_LARGE = "adapter_too_large"  # its adapter can never fit device memory
    STEP_FAILED = "step_failed"  # the step raised for this request alone
    NON_FINITE = "non_finite"  # the model computed NaN or infinity for this request
    GRAMMAR_FAILED = "grammar_failed"  # its grammar refused a sampled token (an engine bug)
    NOT_MIXABLE = "not_mixable"  # a mix's adapter is not plain LoRA (lora/mix.py)


@dataclass
class RequestMetrics:
    arrival_time: float
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    # Prompt tokens whose KV the engine has had for this request (computed, or found in
    # the prefix cache: cached_prompt_tokens of them), the most it reached: what a request
    # abandoned during its prefill cost the engine.
    computed_prompt_tokens: int = 0
    completion_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    # Speculative decoding: tokens proposed and verified, how many the target accepted, and
    # the steps that emitted tokens (completion_tokens / decode_steps: tokens per step).
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    decode_steps: int = 0

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        lora: LoRARequest | None,
        priority: int,
        tenant: str | None,
        detokenizer: IncrementalDetokenizer,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        generator: torch.Generator | None,
        grammar: GrammarMatcher | None = None,
        speculation: RequestSpeculation | None = None,
        arrival_time: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        mix: LoRAMix | None = None,
    ):
        if lora is not None and mix is not None:
            raise ValueError("a request uses one adapter or a mix of them, not both")
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        # prompt + output in one list, extended as tokens arrive (read every step: no copies)
        self._token_ids: list[int] = list(prompt_token_ids)
        self.output_logprobs: list[TokenLogprobs] = []
        # Entry i is prompt token i's (the first has no context); grown chunk by chunk as the
        # prompt is computed. None when the request did not ask for prompt logprobs.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            None if params.prompt_logprobs is None else [None]
        )
        self.params = params
        self.lora = lora
        self.mix = mix  # several adapters, weighted (lora/mix.py); then ``lora`` is None
        # What the scheduler, residency and the step batch read of them every step, made
        # once (a request's adapters never change):
        # every adapter it uses (none, its one, or its mix's parts)...
        self.adapters: tuple[LoRARequest, ...] = (
            mix.adapters if mix is not None else () if lora is None else (lora,)
        )
        # ...what must be on the device before it runs...
        self.adapter_ids: tuple[int, ...] = tuple(a.adapter_id for a in self.adapters)
        # ...and what its rows use in a step: its adapter's id, its mix's key, or None.
        self.lora_key: int | MixKey | None = (
            mix.key if mix is not None else None if lora is None else lora.adapter_id
        )
        self.priority = priority
        self.tenant = tenant
        self.detokenizer = detokenizer
        self.generator = generator
        # Its structured output's state: it has accepted exactly the output tokens (each on
        # append_token; a preemption's recompute or a dropped step samples nothing).
        self.grammar = grammar
        # Speculative decoding's state for this request (None: it does not speculate), and
        # the tokens proposed for its next step: set before each step, verified by it.
        self.speculation = speculation
        self.draft_token_ids: list[int] = []
        # [k, vocab]: the distributions a draft model drew them from (None: point masses,
        # as n-gram proposals and a greedy request's drafts are).
        self.draft_probs: torch.Tensor | None = None
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None  # the stop string or token that ended it
        self.error: str | None = None
        self.error_kind: ErrorKind | None = None
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.cached_prefix = None  # the prefix-cache hit chosen at admission
        self.adapter_blocked_since: int | None = None  # step it first lost to the adapter cap
        # Tokens that end the output (and are suppressed until min_tokens): the request's
        # stop ids, plus the model's end-of-sequence ids unless ignore_eos (a grammar wins
        # over ignore_eos: EOS, when it allows it, ends the document).
        keeps_eos = params.ignore_eos and grammar is None
        self._stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if keeps_eos else eos_token_ids
        )
        self._max_model_len = max_model_len
        self._clock = clock  # the engine's (simulated time in simulation)
        self.metrics = RequestMetrics(
            arrival_time=clock() if arrival_time is None else arrival_time,
            prompt_tokens=len(prompt_token_ids),
        )

    # --- token views -------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens. The engine's own list: read it, don't modify it."""
        return self._token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_num_tokens(self) -> int:
        """The most tokens it can ever hold: its prompt and ``max_tokens`` more, within the
        model's context (what admission that must never preempt would reserve for it)."""
        return min(len(self.prompt_token_ids) + self.params.max_tokens, self._max_model_len)

    @property
    def adapter_id(self) -> int | None:
        """Its one adapter's id; None for the base model and for a mix."""
        return None if self.lora is None else self.lora.adapter_id

    @property
    def adapter_label(self) -> str | None:
        """Its adapter's name, its mix as ``a*0.7+b*0.3``, or None for the base model."""
        if self.mix is not None:
            return self.mix.label
        return None if self.lora is None else self.lora.name

    @property
    def cache_salt(self) -> tuple:
        # Identical prompts on different adapters (or mixes, or weights), or from different
        # tenants, never share KV blocks: both go into every block hash.
        adapters = self.mix.salt if self.mix is not None else self.adapter_id
        return (adapters, self.tenant)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def prompt_only(self) -> bool:
        """A request that scores its prompt and generates nothing (max_tokens 0)."""
        return self.params.max_tokens == 0

    @property
    def collects_prompt_logprobs(self) -> bool:
        """Whether some prompt tokens' logprobs are still to be computed."""
        collected = self.prompt_logprobs
        return collected is not None and len(collected) < len(self.prompt_token_ids)

    def suppressed_token_ids(self, num_more: int = 0) -> list[int]:
        """Ids the sampler must not pick yet (EOS and stop tokens before min_tokens), for the
        token after ``num_more`` more outputs (speculative proposals). None with a grammar:
        it wins over min_tokens (EOS may be the only token it allows)."""
        produced = len(self.output_token_ids) + num_more
        if self.grammar is not None or produced >= self.params.min_tokens:
            return []
        return sorted(self._stop_ids)

    # --- progress ----------------------------------------------------------------
    def append_token(self, token_id: int, logprobs: TokenLogprobs | None, now: float) -> str:
        """Add a sampled token, run the stop checks; returns the new text to stream."""
        self.output_token_ids.append(token_id)
        self._token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        m = self.metrics
        m.completion_tokens = len(self.output_token_ids)
        if m.first_token_time is None:
            m.first_token_time = now
        else:
            m.inter_token_times.append(now - m.last_token_time)
        m.last_token_time = now
        if self.grammar is not None and not self.grammar.accept(token_id):
            self._fail_grammar(token_id)
            return ""

        params = self.params
        # The token just appended is output number len(...); EOS counts from min_tokens + 1.
        past_min = len(self.output_token_ids) > params.min_tokens
        if token_id in self._stop_ids and past_min:
            self._finish(FinishReason.STOP, token_id)
            return self.detokenizer.finish()
        delta = self.detokenizer.add_token(token_id)
        if delta.stop_string is not None:
            self._finish(FinishReason.STOP, delta.stop_string)
            return delta.text
        if self.grammar is not None and self.grammar.is_finished():
            # Complete: nothing but EOS could follow, so it ends here without one.
            self._finish(FinishReason.STOP, None)
            return delta.text + self.detokenizer.finish()
        if (
            len(self.output_token_ids) >= params.max_tokens
            or self.num_tokens >= self._max_model_len
        ):
            self._finish(FinishReason.LENGTH, None)
            return delta.text + self.detokenizer.finish()
        return delta.text

    def _fail_grammar(self, token_id: int) -> None:
        # The mask allowed only what the grammar accepts: a token it refuses is a bug of
        # the engine's, which fails this request alone.
        error = (
            f"the structured-output grammar refused sampled token id {token_id} after "
            f"{len(self.output_token_ids) - 1} output tokens: {self.grammar.error}"
        )
        self.finish_abort(FinishReason.ERROR, error, ErrorKind.GRAMMAR_FAILED)

    def add_prompt_logprobs(self, entries: list[TokenLogprobs]) -> None:
        """The logprobs of the next prompt tokens, in order, as a step computed them."""
        if entries:
            self.prompt_logprobs.extend(entries)

    def finish_prompt_only(self) -> str:
        """End a prompt-only request once its prompt is computed: no token, reason length."""
        self._finish(FinishReason.LENGTH, None)
        return self.detokenizer.finish()

    def finish_abort(
        self, reason: FinishReason, error: str | None = None, kind: ErrorKind | None = None
    ) -> None:
        self.error, self.error_kind = error, kind
        self._finish(reason, None)

    def _finish(self, reason: FinishReason, stop_reason: str | int | None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finished_time = self._clock()

    @property
    def output_text(self) -> str:
        return self.detokenizer.output_text
