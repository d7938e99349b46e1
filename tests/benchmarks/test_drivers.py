"""The benchmark drivers on the tiny model: the same 12 requests through each system.

12 requests over 3 adapters and the base model, two tenants, staggered arrivals. Each
driver must produce a complete record per request (token stamps non-decreasing, none
before the arrival) and, where tokens are visible, the tokens a reference produces:

* engine: ``Engine.generate`` of the same prompts (exact-length greedy);
* PEFT baseline: ``hf_reference.greedy_tokens`` (one request alone, no padding);
* HTTP: a real platform server (embedded SQLite, adapters uploaded over HTTP); requests
  ask for exact lengths (``min_tokens`` = ``max_tokens``), so the reference is an
  exact-length engine run, and its text must match the stream's.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from loramux.benchmarks.common.drivers import (
    exact_length_params,
    run_engine,
    run_http,
    run_peft_baseline,
)
from loramux.benchmarks.common.workload import WorkloadRequest
from loramux.engine import Engine, EngineConfig
from loramux.platform.settings import Settings
from tests.engine.factories import build_engine
from tests.engine.hf_reference import greedy_tokens
from tests.platform.e2e.conftest import start_platform

ADAPTER_SHAPES = (
    {"rank": 4, "targets": ("q_proj", "v_proj"), "seed": 11},
    {"rank": 8, "targets": ("q_proj", "k_proj", "v_proj", "o_proj"), "seed": 12},
    {"rank": 8, "targets": ("gate_proj", "up_proj", "down_proj", "q_proj"), "seed": 13},
)
NAMES = ["ad0", "ad1", "ad2"]
TENANTS = ("alpha", "beta")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def adapter_dirs(make_adapter, tiny_model_dir) -> list[Path]:
    return [make_adapter(tiny_model_dir, std=0.2, **shape) for shape in ADAPTER_SHAPES]


@pytest.fixture(scope="module")
def requests() -> list[WorkloadRequest]:
    adapters = [0, 1, 2, None]
    return [
        WorkloadRequest(
            index=i,
            arrival_s=0.015 * i,
            adapter=adapters[i % 4],
            prompt_len=5 + (7 * i) % 16,
            output_len=3 + (5 * i) % 8,
            tenant=TENANTS[i % 2],
        )
        for i in range(12)
    ]


@pytest.fixture(scope="module")
def prompts(requests, tiny_model_dir) -> dict[int, list[int]]:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    generator = torch.Generator().manual_seed(0)
    # ids from 100 up: clear of the tokenizer's special tokens (BOS, EOS, pad)
    return {
        r.index: torch.randint(100, vocab, (r.prompt_len,), generator=generator).tolist()
        for r in requests
    }


def assert_complete(records, requests, *, counts: dict[int, int] | None = None) -> None:
    """One error-free record per request, in order, with sane stamps."""
    assert [rec.index for rec in records] == [r.index for r in requests]
    for rec, r in zip(records, requests, strict=True):
        assert rec.error is None, rec
        assert (rec.tenant, rec.adapter, rec.arrival_s) == (r.tenant, r.adapter, r.arrival_s)
        expected = r.output_len if counts is None else counts[r.index]
        assert len(rec.token_times_s) == expected, rec
        assert rec.sent_s is not None and rec.sent_s >= r.arrival_s
        assert rec.token_times_s[0] >= rec.sent_s
        assert rec.token_times_s == sorted(rec.token_times_s)
        assert rec.finish_s is not None and rec.finish_s >= rec.token_times_s[-1]


def test_run_engine_matches_generate(tiny_model_dir, adapter_dirs, requests, prompts):
    engine = build_engine(tiny_model_dir, dict(zip(NAMES, adapter_dirs, strict=True)))
    token_ids: dict[int, list[int]] = {}
    records = run_engine(
        engine,
        requests,
        prompts,
        NAMES,
        tenants={"alpha": (0, 2.0), "beta": (0, 1.0)},
        token_ids=token_ids,
    )
    assert_complete(records, requests)
    assert not engine.has_unfinished_requests()
    # open loop: requests arriving later really were added later
    assert records[-1].sent_s > records[0].sent_s + 0.1

    reference = engine.generate(
        [prompts[r.index] for r in requests],
        [exact_length_params(r.output_len) for r in requests],
        adapters=[None if r.adapter is None else NAMES[r.adapter] for r in requests],
    )
    assert [token_ids[r.index] for r in requests] == [list(o.token_ids) for o in reference]
    # the adapters matter: request 0's prompt on the base model gives other tokens
    plain = engine.generate([prompts[0]], exact_length_params(requests[0].output_len))
    assert list(plain[0].token_ids) != token_ids[0]


def test_run_engine_records_refused_requests(tiny_model_dir, requests, prompts):
    engine = build_engine(tiny_model_dir)  # no adapters: adapter requests are refused
    records = run_engine(engine, requests[:4], prompts, NAMES)
    for rec, r in zip(records, requests[:4], strict=True):
        if r.adapter is None:
            assert rec.error is None and len(rec.token_times_s) == r.output_len
        else:
            assert "unknown adapter" in rec.error and rec.finish_s is not None


def test_run_peft_baseline_exact_counts_and_greedy(tiny_model_dir, adapter_dirs, requests, prompts):
    token_ids: dict[int, list[int]] = {}
    records = run_peft_baseline(
        tiny_model_dir, adapter_dirs, requests, prompts, batch_size=4, token_ids=token_ids
    )
    assert_complete(records, requests)
    for r in requests:
        assert len(token_ids[r.index]) == r.output_len
    # static batches: a batch starts once its last request has arrived
    for start in range(0, len(requests), 4):
        batch = requests[start : start + 4]
        sent = {records[r.index].sent_s for r in batch}
        assert len(sent) == 1 and sent.pop() >= max(r.arrival_s for r in batch)
    # left padding could in principle flip a near-tie; on this model it does not
    for r in (requests[0], requests[3], requests[6]):  # adapters 0 and 2, and the base
        adapter_dir = None if r.adapter is None else adapter_dirs[r.adapter]
        expected = greedy_tokens(tiny_model_dir, adapter_dir, prompts[r.index], r.output_len)
        assert token_ids[r.index] == expected, r


@pytest.fixture
def platform(tmp_path, tiny_model_dir):
    settings = Settings(data_dir=tmp_path, model=str(tiny_model_dir), kv_cache_bytes=16 << 20)
    with start_platform(settings) as running:
        yield running


def upload(url: str, key: str, name: str, adapter_dir: Path) -> None:
    files = [("files", (f, (adapter_dir / f).read_bytes())) for f in ADAPTER_FILES]
    response = httpx.post(
        f"{url}/v1/adapters",
        data={"name": name},
        files=files,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert response.status_code == 201, response.text


def test_run_http_against_a_platform(platform, adapter_dirs, requests, prompts):
    keys = {}
    for tenant in TENANTS:  # adapters belong to a tenant: each uploads its own copies
        keys[tenant] = platform.new_tenant().key
        for name, adapter_dir in zip(NAMES, adapter_dirs, strict=True):
            upload(platform.url, keys[tenant], name, adapter_dir)

    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    records = run_http(
        platform.url,
        keys,
        requests,
        prompts,
        NAMES,
        base_model=platform.base_model,
        max_workers=8,
        texts=texts,
        finish_reasons=reasons,
    )

    reference = Engine(
        EngineConfig(model=str(platform.context.base_model.path), kv_cache_bytes=16 << 20)
    )
    for name, adapter_dir in zip(NAMES, adapter_dirs, strict=True):
        reference.add_adapter(name, adapter_dir)
    outs = reference.generate(
        [prompts[r.index] for r in requests],
        [exact_length_params(r.output_len) for r in requests],
        adapters=[None if r.adapter is None else NAMES[r.adapter] for r in requests],
    )
    counts = {r.index: len(o.token_ids) for r, o in zip(requests, outs, strict=True)}
    assert_complete(records, requests, counts=counts)
    assert [texts[r.index] for r in requests] == [o.text for o in outs]
    assert [reasons[r.index] for r in requests] == [o.finish_reason for o in outs]
    # min_tokens = max_tokens (EOS suppressed): every request got exactly its output_len
    assert counts == {r.index: r.output_len for r in requests}
    for rec in records:
        assert rec.token_times_s[0] - rec.arrival_s > 0  # TTFT
        itls = [b - a for a, b in zip(rec.token_times_s, rec.token_times_s[1:], strict=False)]
        assert all(itl > 0 for itl in itls), rec

    # errors are recorded, not raised: an unknown model (404), a tenant without a key
    lost = [
        WorkloadRequest(
            index=0, arrival_s=0.0, adapter=0, prompt_len=5, output_len=2, tenant="alpha"
        ),
        WorkloadRequest(
            index=1, arrival_s=0.0, adapter=None, prompt_len=5, output_len=2, tenant="nobody"
        ),
    ]
    failed = run_http(
        platform.url, keys, lost, prompts, ["missing"], base_model=platform.base_model
    )
    assert failed[0].error.startswith("HTTP 404") and failed[0].token_times_s == []
    assert "nobody" in failed[1].error and failed[1].finish_s is not None
