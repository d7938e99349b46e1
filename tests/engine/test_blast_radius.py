"""Blast radius: whatever one adapter brings fails its own requests, never the batch.

Faults are injected into a real engine mid-batch — an exception inside one adapter's LoRA
application in the middle of the forward pass, NaN written into one adapter's device rows —
and every other request's tokens are compared with an undisturbed run of the same batch.
"""

from __future__ import annotations

import pytest

from loramux.engine import Engine, ErrorKind, SamplingParams
from loramux.engine.model import llama
from tests.engine.factories import PROMPTS, build_engine

TARGETS = ("q_proj", "v_proj", "o_proj")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=1234, max_tokens=8, ignore_eos=True)
# Base model, three adapters, "bad" twice, and a seeded sampler on a good adapter.
BATCH = [
    (PROMPTS[0], None, GREEDY),
    (PROMPTS[1], "good", GREEDY),
    (PROMPTS[2], "bad", GREEDY),
    (PROMPTS[3], "other", GREEDY),
    (PROMPTS[4], "bad", GREEDY),
    (PROMPTS[5], "good", SEEDED),
]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, make_adapter):
    return {
        name: make_adapter(tiny_model_dir, rank=rank, targets=TARGETS, seed=seed)
        for name, rank, seed in (("good", 8, 1), ("bad", 4, 2), ("other", 8, 3))
    }


def run_batch(engine: Engine):
    prompts, names, params = zip(*BATCH, strict=True)
    return engine.generate(list(prompts), list(params), adapters=list(names))


@pytest.fixture(scope="module")
def undisturbed(tiny_model_dir, adapters):
    return [out.token_ids for out in run_batch(build_engine(tiny_model_dir, adapters))]


def check_isolated(engine: Engine, outs, undisturbed, message: str, kind: ErrorKind) -> None:
    for (_, adapter, _), out, expected in zip(BATCH, outs, undisturbed, strict=True):
        assert out.finished
        if adapter == "bad":
            assert out.finish_reason == "error" and out.error_kind == kind
            assert "'bad'" in out.error and message in out.error
        else:
            assert out.finish_reason == "length", out.error
            assert out.token_ids == expected
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_used_blocks == 0
    engine.kv.check_invariants()
    engine.lora_pool.check_invariants()


def test_an_exception_in_one_adapters_lora_fails_only_its_requests(
    tiny_model_dir, adapters, undisturbed, monkeypatch
):
    engine = build_engine(tiny_model_dir, adapters)
    real_project = llama._project
    faults = []

    def project(x, linears, layer, modules, lora):
        # Layer 1's o_proj: after layer 0 wrote its KV, in the middle of the forward pass.
        if lora is not None and layer == 1 and modules == llama.O_PROJ:
            bad_row = engine.lora_pool.resident(engine.tiers.get("bad").adapter_id).row_start
            if any(rows[:1] == [bad_row] for rows in lora.table.adapter_rows):
                faults.append(len(x))
                raise RuntimeError("injected fault in adapter LoRA")
        return real_project(x, linears, layer, modules, lora)

    monkeypatch.setattr(llama, "_project", project)
    outs = run_batch(engine)
    assert faults  # the fault did fire, mid-batch
    check_isolated(
        engine, outs, undisturbed, "injected fault in adapter LoRA", ErrorKind.STEP_FAILED
    )
    assert engine.metrics.requests_failed_in_step._value.get() == 2

    # Nothing of the adapter is quarantined: with the fault gone it serves again.
    monkeypatch.setattr(llama, "_project", real_project)
    assert [o.token_ids for o in run_batch(engine)] == undisturbed


def test_nan_in_one_adapters_device_rows_fails_only_its_requests(
    tiny_model_dir, adapters, undisturbed, monkeypatch
):
    """NaN rows of one adapter, in a batch with others: the torch backend's ops read an
    adapter's rows for its own tokens only (its decode stacks zero past each rank and drop
    the padding slots' outputs), so only the bad requests come out non-finite and the
    runner names them without re-running the step."""
    engine = build_engine(tiny_model_dir, adapters)
    pool = engine.lora_pool
    real_write = pool._write

    def write(start, weights):
        real_write(start, weights)
        if weights.name == "bad":
            for module, mw in weights.modules.items():
                for layer in mw.a:
                    pool.a_pool(layer, module)[start : start + mw.rank] = float("nan")

    monkeypatch.setattr(pool, "_write", write)
    outs = run_batch(engine)
    check_isolated(engine, outs, undisturbed, "non-finite values", ErrorKind.NON_FINITE)
    assert engine.metrics.step_reruns._value.get() == 0


def test_non_finite_rows_of_one_adapter_need_no_rerun(tiny_model_dir, adapters, monkeypatch):
    """Alone in a step (segment form, no op mixing requests' rows), a NaN adapter's requests
    are named by the runner and failed without re-running anything."""
    engine = build_engine(tiny_model_dir, adapters)
    pool = engine.lora_pool
    real_write = pool._write

    def write(start, weights):
        real_write(start, weights)
        for layer in weights.modules["q_proj"].a:
            pool.b_pool(layer, "q_proj")[start] = float("inf")

    monkeypatch.setattr(pool, "_write", write)
    base, bad = engine.generate([PROMPTS[0], PROMPTS[1]], GREEDY, adapters=[None, "bad"])
    assert base.finish_reason == "length"
    assert bad.finish_reason == "error" and "non-finite" in bad.error
    assert engine.metrics.step_reruns._value.get() == 0
    reference = build_engine(engine.config.model).generate([PROMPTS[0]], GREEDY)[0]
    assert base.token_ids == reference.token_ids


def test_a_step_that_fails_for_everyone_fails_each_request_with_the_reason(
    tiny_model_dir, adapters, monkeypatch
):
    engine = build_engine(tiny_model_dir, adapters)
    monkeypatch.setattr(
        engine.executor, "execute", lambda plan: (_ for _ in ()).throw(RuntimeError("no device"))
    )
    outs = engine.generate([PROMPTS[0], PROMPTS[1]], GREEDY, adapters=[None, "good"])
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert all("no device" in o.error for o in outs)
    assert not engine.has_unfinished_requests() and engine.kv.num_used_blocks == 0
