import dataclasses
import math

import pytest

from loramux.engine.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults():
    p = SamplingParams()
    assert p.max_tokens == 16
    assert p.temperature == 1.0
    assert p.top_k is None
    assert p.top_p == 1.0
    assert p.min_p == 0.0
    assert p.repetition_penalty == 1.0
    assert p.presence_penalty == 0.0
    assert p.frequency_penalty == 0.0
    assert p.seed is None
    assert p.logprobs is None
    assert p.stop == ()
    assert p.stop_token_ids == ()
    assert p.include_stop_str_in_output is False
    assert p.ignore_eos is False
    assert p.min_tokens == 0
    assert p.skip_special_tokens is True
    assert not p.greedy


def test_greedy_property():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy  # below GREEDY_TEMPERATURE
    assert not SamplingParams(temperature=1e-4).greedy


def test_frozen_and_hashable():
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[3, 4])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 3  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(stop=("a", "b"), stop_token_ids=(3, 4)))


def test_stop_normalised():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=("x",)).stop == ("x",)
    assert SamplingParams(stop=None).stop == ()  # type: ignore[arg-type]
    assert isinstance(SamplingParams(stop=["a"]).stop, tuple)


def test_stop_token_ids_normalised():
    p = SamplingParams(stop_token_ids=[7, 0, 7])  # type: ignore[arg-type]
    assert p.stop_token_ids == (7, 0, 7)
    assert isinstance(p.stop_token_ids, tuple)
    assert SamplingParams(stop_token_ids=range(2)).stop_token_ids == (0, 1)  # type: ignore[arg-type]


def test_numbers_are_coerced_to_builtin_types():
    p = SamplingParams(temperature=1, top_p=1, repetition_penalty=2, presence_penalty=-2)
    assert type(p.temperature) is float
    assert type(p.top_p) is float
    assert type(p.repetition_penalty) is float
    assert type(p.presence_penalty) is float


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=1),
        dict(temperature=0.0),
        dict(temperature=100.0),
        dict(top_k=1),
        dict(top_p=1e-9),
        dict(top_p=1.0),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(repetition_penalty=1e-3),
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(presence_penalty=2.0, frequency_penalty=-2.0),
        dict(seed=-1),
        dict(seed=0),
        dict(seed=2**64 - 1),
        dict(seed=-(2**63)),
        dict(logprobs=0),
        dict(logprobs=MAX_LOGPROBS),
        dict(min_tokens=16),
        dict(max_tokens=4, min_tokens=4),
    ],
)
def test_valid_edges(kwargs):
    p = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        assert getattr(p, k) == v


BAD = [
    ("max_tokens", 0, "max_tokens"),
    ("max_tokens", -3, "-3"),
    ("max_tokens", 1.5, "max_tokens"),
    ("max_tokens", True, "max_tokens"),
    ("max_tokens", "8", "max_tokens"),
    ("temperature", -0.1, "temperature"),
    ("temperature", math.nan, "temperature"),
    ("temperature", math.inf, "temperature"),
    ("temperature", True, "temperature"),
    ("temperature", "1", "temperature"),
    ("top_k", 0, "top_k"),
    ("top_k", -1, "top_k"),
    ("top_k", 2.0, "top_k"),
    ("top_k", True, "top_k"),
    ("top_p", 0.0, "top_p"),
    ("top_p", 1.5, "1.5"),
    ("top_p", -0.2, "top_p"),
    ("top_p", math.nan, "top_p"),
    ("min_p", -0.01, "min_p"),
    ("min_p", 1.01, "min_p"),
    ("min_p", math.inf, "min_p"),
    ("repetition_penalty", 0.0, "repetition_penalty"),
    ("repetition_penalty", -1.0, "repetition_penalty"),
    ("repetition_penalty", math.inf, "repetition_penalty"),
    ("repetition_penalty", math.nan, "repetition_penalty"),
    ("presence_penalty", 2.5, "presence_penalty"),
    ("presence_penalty", -2.01, "presence_penalty"),
    ("presence_penalty", math.nan, "presence_penalty"),
    ("frequency_penalty", 3.0, "frequency_penalty"),
    ("frequency_penalty", -math.inf, "frequency_penalty"),
    ("seed", 1.0, "seed"),
    ("seed", True, "seed"),
    ("seed", 2**64, "seed"),
    ("seed", -(2**63) - 1, "seed"),
    ("logprobs", -1, "logprobs"),
    ("logprobs", MAX_LOGPROBS + 1, "logprobs"),
    ("logprobs", False, "logprobs"),
    ("logprobs", 1.0, "logprobs"),
    ("stop", "", "stop"),
    ("stop", ["a", ""], "stop"),
    ("stop", [1], "stop"),
    ("stop", 5, "stop"),
    ("stop", b"x", "stop"),
    ("stop_token_ids", [-1], "stop_token_ids"),
    ("stop_token_ids", [1.0], "stop_token_ids"),
    ("stop_token_ids", [True], "stop_token_ids"),
    ("stop_token_ids", 3, "stop_token_ids"),
    ("stop_token_ids", "12", "stop_token_ids"),
    ("include_stop_str_in_output", 1, "include_stop_str_in_output"),
    ("ignore_eos", "yes", "ignore_eos"),
    ("skip_special_tokens", None, "skip_special_tokens"),
    ("min_tokens", -1, "min_tokens"),
    ("min_tokens", 17, "min_tokens"),  # > default max_tokens of 16
    ("min_tokens", 1.0, "min_tokens"),
]


@pytest.mark.parametrize(("name", "value", "needle"), BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_invalid_raises_naming_parameter(name, value, needle):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{name: value})
    msg = str(exc.value)
    assert name in msg
    assert needle in msg


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        (dict(max_tokens=-3), ["max_tokens", ">= 1", "-3"]),
        (dict(top_p=1.5), ["top_p", "(0, 1]", "1.5"]),
        (dict(min_p=2.0), ["min_p", "[0, 1]", "2.0"]),
        (dict(presence_penalty=2.5), ["presence_penalty", "[-2, 2]", "2.5"]),
        (dict(logprobs=21), ["logprobs", "20", "21"]),
        (dict(repetition_penalty=0.0), ["repetition_penalty", "> 0", "0.0"]),
        (dict(max_tokens=4, min_tokens=5), ["min_tokens", "max_tokens=4", "5"]),
    ],
)
def test_message_names_value_and_range(kwargs, fragments):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    for f in fragments:
        assert f in str(exc.value)
