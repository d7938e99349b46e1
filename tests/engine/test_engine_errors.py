"""Bad input is refused with a clear error before any work, and leaves no engine state.

Requests: bad sampling parameters, prompts that do not fit, unknown adapters, duplicate
ids. Adapters: damaged PEFT directories, pickles, shape and rank mismatches, names in
use. After every refusal the engine holds exactly what it held before, and the next
normal request gives the same tokens as before the refusal.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from loramux.engine import (
    AdapterError,
    AdapterInUse,
    Engine,
    EngineConfig,
    EngineError,
    SamplingParams,
    UnknownAdapter,
)
from tests.fixtures.models import build_peft_adapter, build_tiny_model

MAX_MODEL_LEN = 16
MAX_LORA_RANK = 8
VOCAB = 49152  # the tiny model's vocab (SmolLM2's tokenizer)
GOOD_PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def kept_adapter(tiny_model_dir, make_adapter) -> Path:
    return make_adapter(tiny_model_dir, rank=8, targets=("q_proj", "v_proj", "down_proj"), seed=5)


@pytest.fixture(scope="module")
def small_adapter(tiny_model_dir, make_adapter) -> Path:
    return make_adapter(tiny_model_dir, rank=4, targets=("q_proj", "v_proj"), seed=6)


@pytest.fixture
def engine(tiny_model_dir, kept_adapter) -> Engine:
    engine = Engine(
        EngineConfig(
            model=str(tiny_model_dir),
            kv_cache_bytes=16 << 20,
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            max_lora_rank=MAX_LORA_RANK,
        )
    )
    engine.add_adapter("kept", kept_adapter)
    return engine


def baseline(engine: Engine) -> list[list[int]]:
    """What a normal batch gives (base and adapter); compared after every refusal."""
    outs = engine.generate([GOOD_PROMPT, GOOD_PROMPT], GREEDY, adapters=[None, "kept"])
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert outs[0].token_ids != outs[1].token_ids  # the adapter matters
    return [o.token_ids for o in outs]


def assert_clean(engine: Engine, expected: list[list[int]]) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_used_blocks == 0
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert engine.step() == []
    assert baseline(engine) == expected


# --------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ],
)
def test_bad_sampling_params_raise_naming_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


# --------------------------------------------------------------------------- requests

BAD_REQUESTS = {
    "prompt-at-limit": (
        [5] * MAX_MODEL_LEN,
        {},
        rf"{MAX_MODEL_LEN} tokens.*limit is {MAX_MODEL_LEN}",
    ),
    "prompt-over-limit": (" word" * 40, {}, rf"limit is {MAX_MODEL_LEN}"),
    "empty-string": ("", {}, "prompt is empty"),
    "empty-ids": ([], {}, "prompt is empty"),
    "id-too-large": ([1, 2, VOCAB], {}, rf"\[0, {VOCAB}\).*{VOCAB}"),
    "id-negative": ([1, -1], {}, rf"\[0, {VOCAB}\).*-1"),
    # token ids must be integers: nothing is silently truncated or parsed
    "float-ids": ([5, 1.5], {}, "token ids must be integers, got 1.5"),
    "str-ids": ([5, "12"], {}, "token ids must be integers, got '12'"),
    "bool-ids": ([True, 5], {}, "token ids must be integers, got True"),
    "bytes-prompt": (b"hello", {}, "str or a sequence of token ids, got bytes"),
    "int-prompt": (12345, {}, "str or a sequence of token ids, got int"),
    "unknown-adapter": (GOOD_PROMPT, {"adapter": "nope"}, "unknown adapter 'nope'"),
    "params-not-sampling-params": (GOOD_PROMPT, {"params": {"max_tokens": 3}}, "SamplingParams"),
    # with min_tokens the sampler would have to suppress an id the logits do not have
    "stop-token-outside-vocab": (
        GOOD_PROMPT,
        {"params": SamplingParams(stop_token_ids=[VOCAB + 5], min_tokens=2)},
        rf"stop_token_ids.*{VOCAB}",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_refused_and_leaves_nothing(engine, case):
    prompt, kwargs, match = BAD_REQUESTS[case]
    expected = baseline(engine)
    params = kwargs.get("params", GREEDY)
    with pytest.raises(EngineError, match=match) as info:
        engine.add_request("bad", prompt, params, adapter=kwargs.get("adapter"))
    assert isinstance(info.value, ValueError)
    assert_clean(engine, expected)
    # the same through generate(), where it is one of several prompts
    with pytest.raises(EngineError, match=match):
        engine.generate(
            [GOOD_PROMPT, prompt, GOOD_PROMPT],
            [GREEDY, params, GREEDY],
            adapters=["kept", kwargs.get("adapter"), None],
        )
    assert_clean(engine, expected)


def test_refusal_does_not_disturb_requests_in_flight(engine):
    expected = baseline(engine)
    engine.add_request("a", GOOD_PROMPT, GREEDY)
    engine.add_request("b", GOOD_PROMPT, GREEDY, adapter="kept")
    outs = {o.request_id: o for o in engine.step()}
    for case in ("empty-ids", "unknown-adapter", "prompt-at-limit"):
        prompt, kwargs, match = BAD_REQUESTS[case]
        with pytest.raises(EngineError, match=match):
            engine.add_request("c", prompt, GREEDY, adapter=kwargs.get("adapter"))
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert [outs["a"].token_ids, outs["b"].token_ids] == expected
    assert set(outs) == {"a", "b"}
    assert_clean(engine, expected)


def test_integer_like_token_ids_are_accepted(engine):
    ids = engine.tokenizer(GOOD_PROMPT)["input_ids"]
    prompts = [ids, tuple(ids), torch.tensor(ids), np.array(ids, dtype=np.int64)]
    outs = engine.generate(prompts, GREEDY)
    assert all(o.prompt_token_ids == ids for o in outs)
    assert all(o.token_ids == outs[0].token_ids for o in outs)


def test_longest_prompt_that_fits_gets_one_token(engine):
    expected = baseline(engine)
    [out] = engine.generate([[5] * (MAX_MODEL_LEN - 1)], SamplingParams(max_tokens=10))
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    assert_clean(engine, expected)


def test_duplicate_request_id_is_refused_without_touching_the_first(engine):
    expected = baseline(engine)
    engine.add_request("dup", GOOD_PROMPT, GREEDY, adapter="kept")
    other = SamplingParams(temperature=1.0, max_tokens=9, seed=1)
    with pytest.raises(EngineError, match="'dup' is already in use"):
        engine.add_request("dup", "Something else entirely", other)  # while waiting
    first = engine.step()
    with pytest.raises(EngineError, match="'dup' is already in use"):
        engine.add_request("dup", "Something else entirely", other)  # while running
    outs = first
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert {o.request_id for o in outs} == {"dup"}
    assert outs[-1].finished and outs[-1].token_ids == expected[1]
    assert outs[-1].adapter == "kept"
    assert_clean(engine, expected)
    # once finished, the id is free again
    engine.add_request("dup", GOOD_PROMPT, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert_clean(engine, expected)


def test_generate_refuses_mismatched_lengths(engine):
    expected = baseline(engine)
    with pytest.raises(EngineError, match="same length"):
        engine.generate([GOOD_PROMPT, GOOD_PROMPT], [GREEDY], adapters=None)
    with pytest.raises(EngineError, match="same length"):
        engine.generate([GOOD_PROMPT], GREEDY, adapters=[None, "kept"])
    assert_clean(engine, expected)


# --------------------------------------------------------------------------- adapters


def _rewrite_weights(adapter_dir: Path, edit) -> None:
    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(path)
    tensors = edit(dict(tensors))
    save_file(tensors, path, metadata={"format": "pt"})


def _first_key(tensors: dict, fragment: str) -> str:
    return sorted(k for k in tensors if fragment in k)[0]


def _rename_to_unknown_module(adapter_dir: Path) -> None:
    def edit(tensors):
        key = _first_key(tensors, "q_proj.lora_A")
        tensors[key.replace("q_proj", "foo_proj")] = tensors.pop(key)
        return tensors

    _rewrite_weights(adapter_dir, edit)


def _poison(value: float):
    def damage(adapter_dir: Path) -> None:
        def edit(tensors):
            key = _first_key(tensors, "v_proj.lora_B")
            tensors[key] = tensors[key].clone()
            tensors[key][1, 2] = value
            return tensors

        _rewrite_weights(adapter_dir, edit)

    return damage


def _edit_config(**changes):
    def damage(adapter_dir: Path) -> None:
        path = adapter_dir / "adapter_config.json"
        config = json.loads(path.read_text())
        config.update(changes)
        path.write_text(json.dumps(config))

    return damage


def _unlink(name: str):
    def damage(adapter_dir: Path) -> None:
        (adapter_dir / name).unlink()

    return damage


def _garbage_weights(adapter_dir: Path) -> None:
    (adapter_dir / "adapter_model.safetensors").write_bytes(b"\x00not safetensors\xff" * 10)


DAMAGED_ADAPTERS = {
    "missing-weights": (
        _unlink("adapter_model.safetensors"),
        "adapter_model.safetensors is missing",
    ),
    "missing-config": (_unlink("adapter_config.json"), "adapter_config.json is missing"),
    "corrupt-weights": (_garbage_weights, "could not be read as safetensors"),
    "unknown-module": (_rename_to_unknown_module, r"foo_proj\.lora_A.*'foo_proj'"),
    "nan": (_poison(float("nan")), r"layers\.\d+\.v_proj holds NaN"),
    "inf": (_poison(float("inf")), r"layers\.\d+\.v_proj holds NaN or infinite"),
    "dora-without-magnitudes": (
        _edit_config(use_dora=True),
        "has no lora_magnitude_vector, which an adapter with use_dora: true needs",
    ),
    "modules-to-save-missing": (
        _edit_config(modules_to_save=["lm_head"]),
        "modules_to_save lists lm_head, but the weights hold no table of it",
    ),
    "modules-to-save-unsupported": (
        _edit_config(modules_to_save=["model.norm"]),
        "modules_to_save names 'model.norm'; only the embedding",
    ),
    "bias": (_edit_config(bias="all"), "bias='all' retrain the base model's own biases"),
    "rank-disagrees-with-config": (_edit_config(r=6), "rank 4, adapter_config says r=6"),
    "not-lora": (_edit_config(peft_type="PREFIX_TUNING"), "PREFIX_TUNING"),
}


def assert_adapters_unchanged(engine: Engine, before: tuple, expected) -> None:
    assert adapter_state(engine) == before
    assert_clean(engine, expected)


def adapter_state(engine: Engine) -> tuple:
    """What is registered, what is where, and the memory of both tiers."""
    tiers = engine.tiers
    return (
        engine.list_adapters(),
        engine.adapter_residency(),
        engine.lora_pool.num_rows_used,
        tiers.host.bytes_used,
    )


@pytest.mark.parametrize("case", list(DAMAGED_ADAPTERS))
def test_damaged_adapter_is_refused(engine, small_adapter, adapter_copy, case):
    damage, match = DAMAGED_ADAPTERS[case]
    expected, before = baseline(engine), adapter_state(engine)
    path = adapter_copy(small_adapter)
    damage(path)
    with pytest.raises(AdapterError, match=match) as info:
        engine.add_adapter("new", path)
    assert isinstance(info.value, ValueError)
    assert_adapters_unchanged(engine, before, expected)
    with pytest.raises(EngineError, match="unknown adapter 'new'"):
        engine.add_request("x", GOOD_PROMPT, GREEDY, adapter="new")


def test_missing_directory_is_refused(engine, tmp_path):
    expected, before = baseline(engine), adapter_state(engine)
    with pytest.raises(AdapterError, match="does not exist"):
        engine.add_adapter("new", tmp_path / "nowhere")
    assert_adapters_unchanged(engine, before, expected)


class _Payload:
    """Unpickling this creates a directory: proof that someone unpickled it."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_pickle_adapter_is_refused_unopened(
    engine, small_adapter, adapter_copy, tmp_path, monkeypatch
):
    expected, before = baseline(engine), adapter_state(engine)
    path = adapter_copy(small_adapter)
    (path / "adapter_model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (path / "adapter_model.bin").write_bytes(pickle.dumps(_Payload(marker)))

    opened = []
    real_open = io.open

    def guarded_open(file, *args, **kwargs):
        if str(file).endswith(".bin"):
            opened.append(str(file))
        return real_open(file, *args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("the engine tried to unpickle")

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(io, "open", guarded_open)
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    with pytest.raises(AdapterError, match=r"adapter_model\.bin is a pickle.*refused"):
        engine.add_adapter("new", path)
    monkeypatch.undo()
    assert opened == []
    assert not marker.exists()
    assert_adapters_unchanged(engine, before, expected)


def test_adapter_for_another_hidden_size_names_tensor_and_shapes(engine, tmp_path, tokenizer_dir):
    expected, before = baseline(engine), adapter_state(engine)
    other_model = build_tiny_model(tmp_path / "narrow", tokenizer_dir, hidden_size=32)
    path = build_peft_adapter(other_model, tmp_path / "narrow-adapter", rank=4)
    with pytest.raises(AdapterError) as info:
        engine.add_adapter("new", path)
    message = str(info.value)
    assert "layers.0.q_proj.lora_A" in message
    assert "(4, 32)" in message and "[r, 64]" in message
    assert_adapters_unchanged(engine, before, expected)


def test_rank_above_engine_maximum_is_refused(engine, tiny_model_dir, make_adapter):
    expected, before = baseline(engine), adapter_state(engine)
    path = make_adapter(tiny_model_dir, rank=2 * MAX_LORA_RANK, seed=7)
    with pytest.raises(
        AdapterError, match=rf"rank 16, above this engine's maximum of {MAX_LORA_RANK}"
    ):
        engine.add_adapter("new", path)
    assert_adapters_unchanged(engine, before, expected)


def test_duplicate_adapter_name_is_refused(engine, small_adapter):
    expected, before = baseline(engine), adapter_state(engine)
    with pytest.raises(EngineError, match="'kept' is already loaded"):
        engine.add_adapter("kept", small_adapter)  # a different adapter under the same name
    assert_adapters_unchanged(engine, before, expected)  # "kept" still serves the old weights


def test_remove_unknown_adapter_is_refused(engine):
    expected, before = baseline(engine), adapter_state(engine)
    with pytest.raises(UnknownAdapter, match="'nope' is not loaded"):  # an EngineError
        engine.remove_adapter("nope")
    assert_adapters_unchanged(engine, before, expected)


def test_remove_adapter_in_use_is_refused_until_its_requests_end(engine, small_adapter):
    expected = baseline(engine)
    rows_before = engine.lora_pool.num_rows_used
    host_before = engine.tiers.host.bytes_used
    engine.add_adapter("small", small_adapter)
    assert engine.adapter_residency()["small"] == "host"  # on the device once a request needs it
    assert engine.tiers.host.bytes_used > host_before
    [alone] = engine.generate([GOOD_PROMPT], GREEDY, adapters=["small"])
    assert engine.adapter_residency()["small"] == "device"
    assert engine.lora_pool.num_rows_used == rows_before + 4

    engine.add_request("w", GOOD_PROMPT, GREEDY, adapter="small")
    with pytest.raises(AdapterInUse, match="'small' is in use by 1 request"):  # an EngineError
        engine.remove_adapter("small")  # waiting
    outs = engine.step()
    with pytest.raises(AdapterInUse, match="'small' is in use by 1 request"):
        engine.remove_adapter("small")  # running
    engine.add_request("aborted", GOOD_PROMPT, GREEDY, adapter="small")
    with pytest.raises(AdapterInUse, match="in use by 2 request"):
        engine.remove_adapter("small")
    engine.abort("aborted")
    assert engine.list_adapters() == ["kept", "small"]
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == "w" and outs[-1].token_ids == alone.token_ids

    engine.remove_adapter("small")
    assert engine.list_adapters() == ["kept"]
    assert engine.lora_pool.num_rows_used == rows_before  # device rows and host memory freed
    assert engine.tiers.host.bytes_used == host_before
    with pytest.raises(UnknownAdapter, match="unknown adapter 'small'"):
        engine.add_request("x", GOOD_PROMPT, GREEDY, adapter="small")
    assert_clean(engine, expected)

    # the freed rows are reused, and the name can be loaded again
    capacity = engine.lora_pool.capacity
    engine.add_adapter("small", small_adapter)
    [again] = engine.generate([GOOD_PROMPT], GREEDY, adapters=["small"])
    assert engine.lora_pool.num_rows_used == rows_before + 4
    assert engine.lora_pool.capacity == capacity
    assert again.token_ids == alone.token_ids
