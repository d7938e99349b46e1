"""Per-request sampling parameters.

A :class:`SamplingParams` is immutable and validated on construction; every bad value
raises :class:`ValueError` naming the parameter, the value and the allowed range.

Semantics (the sampler in :mod:`loramux.engine.sampler` implements them, in this order):

* ``min_tokens``: until this many tokens were produced, the engine asks the sampler to
  suppress EOS and ``stop_token_ids`` (their logits become ``-inf``).
* ``repetition_penalty`` (Hugging Face style): for every distinct token seen in the
  prompt *or* the output so far, a positive logit is divided by the penalty and a
  non-positive one multiplied by it. ``1.0`` is off; ``> 1`` discourages repeats.
* ``presence_penalty`` / ``frequency_penalty`` (OpenAI style, output tokens only):
  ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
* ``temperature``: ``0.0`` means greedy (argmax; the filters below are ignored);
  otherwise logits are divided by it.
* ``top_k`` keeps the k largest logits (``None`` = off), ``top_p`` keeps the smallest set
  of most likely tokens whose cumulative probability reaches ``top_p`` (``1.0`` = off),
  ``min_p`` drops tokens whose probability is below ``min_p`` times the largest
  probability (``0.0`` = off). They are applied in that order.
* ``seed``: when set, the request draws from its own generator, so its tokens do not
  depend on which other requests share the batch.
* ``logit_bias`` (OpenAI): token id -> a bias in [-100, 100] added to that token's logit
  before everything below (the engine checks the ids against the model's vocab). It
  changes what is sampled, not the returned log-probabilities.
* ``logprobs``: ``None`` returns none; ``0`` returns the log-probability of the sampled
  token; ``N`` (at most 20) also the N most likely tokens. Log-probabilities come from
  the model's raw logits, before the bias, penalties, temperature and filters.
* ``prompt_logprobs``: the same for every prompt token (the first has none: no context),
  each from the raw logits of the position before it, with the request's adapter applied.
  ``None`` returns none, ``0`` each prompt token's log-probability, ``N`` also the N most
  likely tokens at its position.
* ``stop`` / ``stop_token_ids``: generation ends when the output text contains one of the
  stop strings or a stop token is produced; the matched stop string is cut from the
  output unless ``include_stop_str_in_output``. ``ignore_eos`` keeps going past EOS.
* ``max_tokens``: the most tokens generated for the request: at least 1, or 0 when
  ``prompt_logprobs`` is set (scoring a prompt: it is computed, nothing is generated and
  the request finishes with reason ``length``).
* ``structured`` (:mod:`loramux.engine.structured`): the output must be JSON, JSON valid
  against a schema, text matching a regex, or tool calls. The engine masks the tokens the
  grammar forbids after the logit bias and penalties, before temperature and the filters
  (logprobs stay the raw model's). The request finishes with reason ``stop`` as soon as the
  grammar is complete; a stop string or ``max_tokens`` still cut it short, leaving an
  incomplete document (``max_tokens``: reason ``length``, as OpenAI does). The grammar wins
  over ``min_tokens`` and ``ignore_eos``: nothing is suppressed for such a request, and EOS
  ends it whenever the grammar allows it (suppressing EOS when it is the only token the
  grammar allows would leave nothing to sample). ``stop_token_ids`` other than EOS are
  never allowed by the grammar, so they end nothing.
* ``speculative``: whether the engine may speculate for this request when it is configured
  to (``EngineConfig.speculative_method``). Greedy output is token for token the same
  either way, sampled output has the same distribution; ``False`` opts out. A request with
  ``structured`` never speculates.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any, get_args

from loramux.engine.structured import StructuredSpec

# The spec classes, for the isinstance check (StructuredSpec is a union of them).
_SPEC_TYPES = get_args(StructuredSpec)
MAX_LOGPROBS = 20
"""The largest ``logprobs`` (number of top alternatives) a request may ask for."""

MAX_LOGIT_BIAS = 100.0
"""The largest magnitude of a ``logit_bias`` value (OpenAI's bound)."""

_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1  # what torch.Generator.manual_seed accepts


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


# Below this, sampling at temperature T is indistinguishable from the argmax, and logits / T
# can overflow to inf (turning the softmax into NaN), so such requests are served greedily.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops. See the module docstring."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # A dict is unhashable: left out of the hash (equal params still hash equal).
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    # False opts this request out of the engine's speculative decoding (its output is the
    # same either way; this only changes how many steps it takes).
    speculative: bool = True
    # JsonSchema and ToolCalls hold dicts (unhashable specs): left out of the hash.
    structured: StructuredSpec | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("logprobs", self._logprobs_count("logprobs", self.logprobs))
        put("prompt_logprobs", self._logprobs_count("prompt_logprobs", self.prompt_logprobs))
        max_tokens = _int("max_tokens", self.max_tokens)
        if max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(
                f"max_tokens must be >= 1 unless prompt_logprobs is set (then >= 0), "
                f"got {max_tokens}"
            )
        put("max_tokens", max_tokens)
        put("logit_bias", self._normalise_logit_bias(self.logit_bias))

        temperature = _float("temperature", self.temperature)
        if temperature < 0.0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
        put("temperature", temperature)

        if self.top_k is not None:
            top_k = _int("top_k", self.top_k)
            if top_k < 1:
                raise ValueError(f"top_k must be None (off) or >= 1, got {top_k}")
            put("top_k", top_k)

        top_p = _float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        put("top_p", top_p)

        min_p = _float("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        put("min_p", min_p)

        repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
        put("repetition_penalty", repetition_penalty)

        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            put(name, value)

        if self.seed is not None:
            seed = _int("seed", self.seed)
            if not _SEED_MIN <= seed <= _SEED_MAX:
                raise ValueError(f"seed must be in [{_SEED_MIN}, {_SEED_MAX}], got {seed}")
            put("seed", seed)

        put("stop", self._normalise_stop(self.stop))
        put("stop_token_ids", self._normalise_stop_token_ids(self.stop_token_ids))

        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "speculative",
        ):
            put(name, _bool(name, getattr(self, name)))

        min_tokens = _int("min_tokens", self.min_tokens)
        if not 0 <= min_tokens <= max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}"
            )
        put("min_tokens", min_tokens)

        if self.structured is not None and not isinstance(self.structured, _SPEC_TYPES):
            names = ", ".join(t.__name__ for t in _SPEC_TYPES)
            raise ValueError(
                f"structured must be None or one of {names}, got {type(self.structured).__name__}"
            )

    @staticmethod
    def _logprobs_count(name: str, value: Any) -> int | None:
        if value is None:
            return None
        count = _int(name, value)
        if not 0 <= count <= MAX_LOGPROBS:
            raise ValueError(f"{name} must be None or in [0, {MAX_LOGPROBS}], got {count}")
        return count

    @staticmethod
    def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
        """A fresh ``{int: float}`` (the caller's dict is not kept), None when empty."""
        if bias is None:
            return None
        if not isinstance(bias, Mapping):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
        out: dict[int, float] = {}
        for token, value in bias.items():
            if isinstance(token, bool) or not isinstance(token, Integral) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
            number = _float(f"logit_bias[{token}]", value)
            if not -MAX_LOGIT_BIAS <= number <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {number}"
                )
            out[int(token)] = number
        return out or None

    @staticmethod
    def _normalise_stop(stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, bytes) or not isinstance(stop, Iterable):
            raise ValueError(f"stop must be a str or a sequence of str, got {stop!r}")
        out = tuple(stop)
        for s in out:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only str, got {s!r} in {out!r}")
            if not s:
                raise ValueError(f"stop strings must be non-empty, got {out!r}")
        return out

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> tuple[int, ...]:
        if ids is None:
            return ()
        if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
            raise ValueError(f"stop_token_ids must be a sequence of int, got {ids!r}")
        out = []
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, Integral) or t < 0:
                raise ValueError(f"stop_token_ids must contain ints >= 0, got {t!r} in {ids!r}")
            out.append(int(t))
        return tuple(out)

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax: ``temperature == 0``, or a temperature so small
        (below ``GREEDY_TEMPERATURE``) that dividing the logits by it would overflow float32."""
        return self.temperature < GREEDY_TEMPERATURE
