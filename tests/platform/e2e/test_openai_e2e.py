"""End to end on the production stack: SmolLM2 with PEFT adapters uploaded over HTTP, the
official ``openai`` client, PostgreSQL, Redis and an S3-compatible server (moto).

Greedy output through the API must equal the engine's own output for the same request.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import redis

from loramux.engine import Engine, EngineConfig, SamplingParams
from loramux.platform.db.models import AdapterStatus
from loramux.platform.limits import RedisRateLimiter
from loramux.platform.settings import Settings
from loramux.platform.store.s3 import S3ObjectStore
from tests.platform.e2e.conftest import Platform, start_platform

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MAX_TOKENS = 12
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def adapters(make_adapter, smollm2_dir) -> dict[str, Path]:
    return {
        "qv-r8": make_adapter(smollm2_dir, rank=8, targets=("q_proj", "v_proj"), seed=1),
        "attn-r16": make_adapter(smollm2_dir, rank=16, targets=ATTENTION, seed=2),
    }


@pytest.fixture
def platform(
    tmp_path, smollm2_dir, postgres_database_url, redis_url, s3_endpoint, s3_bucket
) -> Platform:
    settings = Settings(
        data_dir=tmp_path,
        model=str(smollm2_dir),
        database_url=postgres_database_url,
        redis_url=redis_url,
        **s3_endpoint.store_settings(s3_bucket),
        kv_cache_bytes=64 << 20,
    )
    with start_platform(settings) as running:
        yield running


def upload(platform: Platform, headers: dict[str, str], name: str, adapter_dir: Path) -> dict:
    files = [("files", (f, (adapter_dir / f).read_bytes())) for f in ADAPTER_FILES]
    response = httpx.post(
        f"{platform.url}/v1/adapters",
        data={"name": name},
        files=files,
        headers=headers,
        timeout=120,
    )
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["status"] == AdapterStatus.READY.value, body
    return body


def stream_completion(client: openai.OpenAI, **request) -> tuple[str, list]:
    text, usages = "", []
    stream = client.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        text += "".join(choice.text for choice in chunk.choices)
    return text, usages


def test_openai_client_on_the_production_stack(
    platform, adapters, smollm2_dir, s3_endpoint, s3_bucket, redis_url
):
    # --- the backends really are the production ones ---------------------------------------
    assert platform.context.settings.resolved_database_url.startswith("postgresql")
    assert isinstance(platform.context.rate_limiter, RedisRateLimiter)
    assert isinstance(platform.context.store, S3ObjectStore)

    tenant = platform.new_tenant(input_price_per_mtok=2.0, output_price_per_mtok=8.0)
    for name, adapter_dir in adapters.items():
        upload(platform, tenant.headers, name, adapter_dir)

    # adapter files are objects in the bucket, not files on disk
    listed = s3_endpoint.client().list_objects_v2(Bucket=s3_bucket)
    keys = [obj["Key"] for obj in listed.get("Contents", [])]
    sizes = sorted(obj["Size"] for obj in listed.get("Contents", []))
    local = sorted((d / f).stat().st_size for d in adapters.values() for f in ADAPTER_FILES)
    assert len(keys) == 4 and sizes == local, keys

    # --- the reference: the engine itself, same weights, same adapter files ------------------
    engine = Engine(EngineConfig(model=str(smollm2_dir), dtype="float32", kv_cache_bytes=64 << 20))
    for name, adapter_dir in adapters.items():
        engine.add_adapter(name, adapter_dir)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    models = [platform.base_model, *adapters]
    expected = {}
    for model in models:
        adapter = [None] if model == platform.base_model else [model]
        expected[model] = engine.generate([PROMPT], params, adapters=adapter)[0]
    assert len({out.text for out in expected.values()}) == 3  # each adapter changes the output

    client = platform.client(tenant)
    usages = []
    for model in models:
        ref = expected[model]
        result = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
        assert result.model == model
        assert result.choices[0].text == ref.text, model
        assert result.choices[0].finish_reason == ref.finish_reason
        assert result.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert result.usage.completion_tokens == len(ref.token_ids)
        usages.append(result.usage)

        text, streamed_usage = stream_completion(
            client, model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
        assert text == ref.text, model
        assert len(streamed_usage) == 1
        assert streamed_usage[0].completion_tokens == len(ref.token_ids)
        assert streamed_usage[0].prompt_tokens == result.usage.prompt_tokens
        usages.append(streamed_usage[0])

    # --- chat: the template, then the same greedy decoding ------------------------------------
    messages = [{"role": "user", "content": "Name one colour."}]
    chat_prompt = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    for model in (platform.base_model, "attn-r16"):
        adapter = [None] if model == platform.base_model else [model]
        ref = engine.generate([chat_prompt], params, adapters=adapter)[0]
        chat = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].message.content == ref.text, model
        assert chat.usage.completion_tokens == len(ref.token_ids)
        usages.append(chat.usage)

        pieces, chat_usage = [], []
        for chunk in client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if chunk.usage is not None:
                chat_usage.append(chunk.usage)
            pieces.extend(choice.delta.content or "" for choice in chunk.choices)
        assert "".join(pieces) == chat.choices[0].message.content
        assert len(chat_usage) == 1
        assert chat_usage[0].completion_tokens == chat.usage.completion_tokens
        usages.append(chat_usage[0])

    # --- usage returned == the tenant's own usage export --------------------------------------
    mine = httpx.get(f"{platform.url}/v1/usage", headers=tenant.headers)
    assert mine.status_code == 200, mine.text
    totals = mine.json()["totals"]
    assert totals["requests"] == len(usages)
    assert totals["prompt_tokens"] == sum(u.prompt_tokens for u in usages)
    assert totals["completion_tokens"] == sum(u.completion_tokens for u in usages)
    assert totals["cost_micro_usd"] == sum(u.model_extra["cost_micro_usd"] for u in usages) > 0

    # --- the rate limiter keeps its buckets in Redis -------------------------------------------
    limited = platform.new_tenant(requests_per_minute=2)
    limited_client = platform.client(limited)
    limited_client.completions.create(model=platform.base_model, prompt=PROMPT, max_tokens=1)
    store = redis.Redis.from_url(redis_url)
    try:
        buckets = [k.decode() for k in store.scan_iter(match="loramux:rl:*")]
        assert any(limited.id in key for key in buckets), buckets
    finally:
        store.close()
    limited_client.completions.create(model=platform.base_model, prompt=PROMPT, max_tokens=1)
    with pytest.raises(openai.RateLimitError):
        limited_client.completions.create(model=platform.base_model, prompt=PROMPT, max_tokens=1)
