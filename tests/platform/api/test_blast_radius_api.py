"""One tenant's broken adapter, met over HTTP: its request fails with a clear 500
``adapter_failed``; another tenant's stream running in the same batches goes on with the
tokens it would have had, and is billed exactly for them."""

from __future__ import annotations

import threading
import uuid

import httpx
import openai
import pytest

from loramux.engine import Engine, EngineConfig, SamplingParams
from loramux.platform.app import create_app
from tests.fixtures.browser import ServerThread
from tests.platform.api.conftest import store_ready_adapter

PROMPT = "The quick brown fox"
BROKEN_RANK = 3  # the rank that marks the broken adapter's weights as they are written


@pytest.fixture
def server(context):
    with ServerThread(create_app(context)) as running:
        yield running


def new_tenant(server, context) -> tuple[openai.OpenAI, str]:
    admin = {"Authorization": f"Bearer {context.admin_token}"}
    tenant = httpx.post(
        f"{server.url}/admin/tenants", json={"name": f"t-{uuid.uuid4().hex[:8]}"}, headers=admin
    ).json()
    key = httpx.post(f"{server.url}/admin/tenants/{tenant['id']}/api-keys", headers=admin)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key.json()["key"], max_retries=0)
    return client, tenant["id"]


def test_a_broken_adapter_fails_its_own_request_and_no_one_elses(
    server, context, make_adapter, monkeypatch
):
    model_dir = context.base_model.path
    good_dir = make_adapter(model_dir, rank=4, seed=1, std=0.2)
    broken_dir = make_adapter(model_dir, rank=BROKEN_RANK, seed=2, std=0.2)
    victim, victim_id = new_tenant(server, context)
    hostile, hostile_id = new_tenant(server, context)
    store_ready_adapter(context, victim_id, "good", good_dir)
    store_ready_adapter(context, hostile_id, "broken", broken_dir)

    # Its device rows turn to NaN as they are written. The torch backend reads an adapter's
    # rows for its own tokens only, so the NaN stays in the broken request's tokens.
    pool = context.engine.engine.lora_pool
    real_write = pool._write

    def write(start, weights):
        real_write(start, weights)
        if weights.rank == BROKEN_RANK:
            for module, mw in weights.modules.items():
                for layer in mw.a:
                    pool.a_pool(layer, module)[start : start + mw.rank] = float("nan")

    monkeypatch.setattr(pool, "_write", write)

    reference = Engine(EngineConfig(model=str(model_dir), kv_cache_bytes=16 << 20))
    reference.add_adapter("good", good_dir)
    expected = reference.generate(
        [PROMPT], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), ["good"]
    )[0].text

    stream = victim.completions.create(
        model="good",
        prompt=PROMPT,
        max_tokens=64,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [next(stream)]  # the victim's request is running now
    failure: list[Exception] = []

    def call_broken():
        try:
            hostile.completions.create(model="broken", prompt=PROMPT, max_tokens=24)
        except openai.APIStatusError as exc:
            failure.append(exc)

    broken = threading.Thread(target=call_broken)
    broken.start()
    chunks.extend(stream)
    broken.join(timeout=60)

    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected
    assert chunks[-1].usage.completion_tokens == 64
    [error] = failure
    assert error.status_code == 500
    body = error.response.json()["error"]
    assert body["code"] == "adapter_failed"
    assert "'broken'" in body["message"] and "non-finite" in body["message"]
    metrics = context.engine.engine.metrics
    assert metrics.requests_failed_in_step._value.get() == 1
    # The runner named the broken request from its own non-finite tokens: no re-run of the
    # step was needed to find it (the masked-dense op it replaced spread NaN to everyone).
    assert metrics.step_reruns._value.get() == 0
