"""``GET /admin/engine``: the in-process engine's live snapshot, in the platform's names."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from loramux.platform.app import create_app
from loramux.platform.context import build_context
from loramux.platform.db.models import AdapterVersion
from loramux.platform.settings import Settings
from tests.platform.api.conftest import assert_openai_error

FILES = ("adapter_config.json", "adapter_model.safetensors")
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def adapter_dir(make_adapter, tiny_model_dir):
    return make_adapter(tiny_model_dir, rank=4, targets=("q_proj", "v_proj"), seed=22)


def test_idle_engine(client, admin, context):
    response = client.get("/admin/engine", headers=admin)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["running_requests"] == body["waiting_requests"] == 0
    kv = body["kv_cache"]
    assert kv["blocks_used"] == 0 and kv["usage"] == 0
    assert kv["blocks_held"] == 0 and kv["preemptions"] == 0
    assert kv["blocks_total"] == kv["blocks_usable"] > 0
    assert body["device"] == {
        "count": 0,
        "bytes": 0,
        "capacity_bytes": body["device"]["capacity_bytes"],
        "adapters": [],
    }
    assert body["device"]["capacity_bytes"] > 0
    assert body["host"]["capacity_bytes"] == context.settings.engine.lora.adapter_host_bytes
    assert body["adapters"] == [] and body["tenants"] == []
    assert body["ttft"] == {"samples": 0, "p50_ms": None, "p90_ms": None, "p99_ms": None}
    assert body["latency_window_s"] > 0 and body["taken_at"]
    # What the budget holds (the test run sets LORAMUX_ENGINE_KV_CACHE_BYTES) and no memory pressure.
    settings = context.settings
    memory = body["memory"]
    assert memory["budget_bytes"] == settings.engine.cache.kv_cache_bytes
    assert memory["source"] == "set" and memory["device"] == "cpu"
    assert memory["kv_blocks"] == kv["blocks_total"]
    assert memory["kv_tokens"] == kv["blocks_total"] * kv["block_size"]
    assert memory["rank"] == 16 and memory["rank_adapter_bytes"] > 0
    assert (memory["full_batch_requests"], memory["full_batch_context"]) == (
        settings.engine.scheduler.max_num_seqs,
        512,
    )
    assert memory["full_batch_fits"] is True
    assert 0 < memory["adapters_beside_full_batch"] <= memory["adapters_max"]
    engine = context.engine.engine
    assert memory["max_model_len"] == engine.max_model_len > 0
    assert memory["kv_floor_blocks"] == engine.kv.min_limit and memory["draft_kv_bytes"] == 0
    assert body["residency"] == {
        "preemptions": 0,
        "adapter_evictions": 0,
        "adapter_reloads": 0,
        "adapter_room_wait_steps": 0,
        "preemptions_per_min": 0.0,
        "adapter_evictions_per_min": 0.0,
        "adapter_reloads_per_min": 0.0,
        "adapter_room_wait_steps_per_min": 0.0,
        "window_s": 60.0,
        "thrashing": False,
    }
    [row] = body["engines"]
    assert (
        row["budget_bytes"] == settings.engine.cache.kv_cache_bytes
        and row["budget_source"] == "set"
    )
    assert row["kv_tokens"] == memory["kv_tokens"]
    assert row["adapters_beside_full_batch"] == memory["adapters_beside_full_batch"]
    assert row["adapter_reloads_per_min"] == 0.0 and row["thrashing"] is False
    # Speculative decoding is off by default: nothing proposed, nothing served yet.
    assert body["speculation"] == {
        "method": "off",
        "num_speculative_tokens": 0,
        "adapters": [],
        "total": NO_SPECULATION,
    }
    assert (row["speculative_method"], row["num_speculative_tokens"]) == ("off", 0)
    # No structured request yet: the compiled-grammar cache is empty, its budgets set.
    assert body["grammar_cache"] == {
        **NO_GRAMMARS,
        "budget_bytes": settings.engine.cache.grammar_cache_bytes,
        "tenant_budget_bytes": settings.engine.cache.grammar_cache_bytes // 4,
    }


NO_GRAMMARS = {
    "bytes": 0,
    "entries": 0,
    "tenants": 0,
    "largest_tenant_bytes": 0,
    "hits": 0,
    "misses": 0,
    "evictions": 0,
    "tenant_evictions": 0,
    "evicted_bytes": 0,
    "not_kept": 0,
}


def test_compiled_grammars_are_shown_in_bytes_per_tenant(client, admin, context, tenant_key):
    """Two tenants send the same schema: each has its own compiled grammar, charged to it."""
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": [f"colour-{k}" for k in range(500)]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    for auth in (tenant_key(), tenant_key()):
        done = client.post(
            "/v1/completions",
            json={
                "model": context.base_model.model_id,
                "prompt": "Pick a colour:",
                "max_tokens": MAX_TOKENS,
                "response_format": response_format,
            },
            headers=auth,
        )
        assert done.status_code == 200, done.text
    cache = client.get("/admin/engine", headers=admin).json()["grammar_cache"]
    assert (cache["entries"], cache["tenants"], cache["misses"]) == (2, 2, 2)
    assert cache["hits"] == 2  # each request's compile at add, after its compile off-thread
    assert 2 * 100_000 < cache["bytes"] <= 2 * cache["largest_tenant_bytes"]
    assert cache["bytes"] <= cache["budget_bytes"]


NO_SPECULATION = {
    "proposed_tokens": 0,
    "accepted_tokens": 0,
    "verify_steps": 0,
    "decode_steps": 0,
    "generated_tokens": 0,
    "acceptance_rate": None,
    "tokens_per_step": None,
}


def test_after_requests_names_adapters_tenants_and_latency(
    client, admin, context, new_tenant, adapter_dir
):
    tenant = new_tenant(name="acme", priority=3, weight=2.0)
    key = client.post(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin).json()["key"]
    auth = {"Authorization": f"Bearer {key}"}
    files = [("files", (f, (adapter_dir / f).read_bytes())) for f in FILES]
    uploaded = client.post("/v1/adapters", data={"name": "support"}, files=files, headers=auth)
    assert uploaded.status_code == 201, uploaded.text
    prompt_tokens = 0
    for model in ("support", "support"):
        done = client.post(
            "/v1/completions",
            json={"model": model, "prompt": "Hello", "max_tokens": MAX_TOKENS, "ignore_eos": True},
            headers=auth,
        )
        assert done.status_code == 200, done.text
        prompt_tokens += done.json()["usage"]["prompt_tokens"]
    patched = client.patch(f"/admin/tenants/{tenant['id']}", json={"priority": 8}, headers=admin)
    assert patched.status_code == 200, patched.text

    body = client.get("/admin/engine", headers=admin).json()
    assert body["ttft"]["samples"] == 2
    assert body["itl"]["samples"] == 2 * (MAX_TOKENS - 1)
    assert 0 < body["ttft"]["p50_ms"] <= body["ttft"]["p90_ms"] <= body["ttft"]["p99_ms"]
    with context.sessions() as session:  # the engine knows a version by its id
        version_id = session.scalars(select(AdapterVersion.id)).one()
    assert body["adapters"] == [
        {
            "engine_name": version_id,
            "tier": "device",
            "tenant_id": tenant["id"],
            "tenant_name": "acme",
            "adapter": "support",
            "version": 1,
            "pin": None,  # not pinned
        }
    ]
    assert body["device"]["count"] == 1 and body["device"]["bytes"] > 0
    assert body["device"]["adapters"] == body["adapters"]
    assert [a["adapter"] for a in body["host"]["adapters"]] == ["support"]
    # What the platform pushed: the priority as changed, the weight as created; and what
    # the tenant was served: every token, all of the recent service (the only tenant).
    assert body["tenants"] == [
        {
            "tenant_id": tenant["id"],
            "tenant_name": "acme",
            "priority": 8,
            "weight": 2.0,
            "served_prompt_tokens": prompt_tokens,
            "served_output_tokens": 2 * MAX_TOKENS,
            "queued_requests": 0,
            "running_requests": 0,
            "share": 1.0,
            "weight_share": None,  # no request now
        }
    ]
    assert body["share_window_s"] == 30.0
    # No speculation: one token per step, nothing proposed, the adapter by its names.
    [spec] = body["speculation"]["adapters"]
    assert spec == {
        **NO_SPECULATION,
        "decode_steps": 2 * MAX_TOKENS,
        "generated_tokens": 2 * MAX_TOKENS,
        "tokens_per_step": 1.0,
        "engine_name": version_id,
        "tenant_id": tenant["id"],
        "tenant_name": "acme",
        "adapter": "support",
        "version": 1,
    }


def test_each_tenants_share_is_its_service_over_everyones(client, admin, context, new_tenant):
    """Two tenants served one after the other: each one's share is its prompt tokens plus
    twice its output tokens, over both tenants' (the weighing the fair share uses)."""
    served = {}
    for name, weight, max_tokens in (("light", 1.0, 3), ("heavy", 3.0, 9)):
        tenant = new_tenant(name=name, weight=weight)
        key = client.post(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin).json()["key"]
        done = client.post(
            "/v1/completions",
            json={
                "model": context.base_model.model_id,
                "prompt": "Count:",
                "max_tokens": max_tokens,
                "ignore_eos": True,
            },
            headers={"Authorization": f"Bearer {key}"},
        )
        assert done.status_code == 200, done.text
        usage = done.json()["usage"]
        served[tenant["id"]] = (usage["prompt_tokens"], usage["completion_tokens"])
        assert usage["completion_tokens"] == max_tokens

    tenants = {
        t["tenant_id"]: t for t in client.get("/admin/engine", headers=admin).json()["tenants"]
    }
    service = {tid: prompt + 2 * output for tid, (prompt, output) in served.items()}
    for tid, (prompt, output) in served.items():
        row = tenants[tid]
        assert (row["served_prompt_tokens"], row["served_output_tokens"]) == (prompt, output)
        assert row["share"] == pytest.approx(service[tid] / sum(service.values()))
        assert row["queued_requests"] == row["running_requests"] == 0
    assert sorted(row["weight"] for row in tenants.values()) == [1.0, 3.0]


def test_speculation_per_adapter_and_in_all(speculating, adapter_dir):
    """An engine speculating with n-gram proposals: per adapter and for the base model,
    what was proposed, accepted and emitted, the rates worked out from them, and the sum."""
    client, context = speculating
    admin = {"Authorization": f"Bearer {context.admin_token}"}
    tenant = client.post("/admin/tenants", json={"name": "spec"}, headers=admin).json()
    key = client.post(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin).json()["key"]
    auth = {"Authorization": f"Bearer {key}"}
    files = [("files", (f, (adapter_dir / f).read_bytes())) for f in FILES]
    uploaded = client.post("/v1/adapters", data={"name": "loop"}, files=files, headers=auth)
    assert uploaded.status_code == 201, uploaded.text
    emitted = {}
    for model in (context.base_model.model_id, "loop"):
        done = client.post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": "one two three one two three one two",
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
            },
            headers=auth,
        )
        assert done.status_code == 200, done.text
        emitted[model] = done.json()["usage"]["completion_tokens"]  # billed: all emitted
    body = client.get("/admin/engine", headers=admin).json()

    speculation = body["speculation"]
    assert (speculation["method"], speculation["num_speculative_tokens"]) == ("ngram", 4)
    base, loop = speculation["adapters"]  # the base model first
    assert (base["engine_name"], base["adapter"], base["tenant_name"]) == ("", None, None)
    assert (loop["adapter"], loop["version"], loop["tenant_name"]) == ("loop", 1, "spec")
    assert base["generated_tokens"] == emitted[context.base_model.model_id] == 24
    assert loop["generated_tokens"] == emitted["loop"] == 24
    for row in (base, loop):
        assert row["proposed_tokens"] > 0 and row["verify_steps"] > 0
        assert 0 <= row["accepted_tokens"] <= row["proposed_tokens"]
        assert row["acceptance_rate"] == row["accepted_tokens"] / row["proposed_tokens"]
        assert row["decode_steps"] < row["generated_tokens"] or row["accepted_tokens"] == 0
        assert row["tokens_per_step"] == row["generated_tokens"] / row["decode_steps"]
    total = speculation["total"]
    for figure in ("proposed_tokens", "accepted_tokens", "decode_steps", "generated_tokens"):
        assert total[figure] == base[figure] + loop[figure], figure
    assert total["accepted_tokens"] > 0  # the loops were predicted
    assert total["tokens_per_step"] > 1.0
    [row] = body["engines"]
    assert (row["speculative_method"], row["num_speculative_tokens"]) == ("ngram", 4)


def test_only_operators_may_look(client, tenant_key):
    assert_openai_error(client.get("/admin/engine"), 401)
    assert_openai_error(client.get("/admin/engine", headers=tenant_key()), 401)


def test_a_platform_without_an_engine_says_so(tmp_path, tiny_model_dir):
    settings = Settings(data_dir=tmp_path, model=str(tiny_model_dir), admin_token=None)
    context = build_context(settings, log=lambda _: None, with_engine=False)
    with TestClient(create_app(context)) as client:
        response = client.get(
            "/admin/engine", headers={"Authorization": f"Bearer {context.admin_token}"}
        )
    error = assert_openai_error(response, 503)
    assert error["code"] == "engine_unavailable"


def test_remote_mode_with_no_live_engine_says_so(tmp_path, tiny_model_dir, redis_url):
    """Engine processes register in Redis; with none there, the snapshot and readiness say
    so (503 naming the cause) instead of failing."""
    empty_redis = redis_url.rsplit("/", 1)[0] + "/7"  # no engine registers in this database
    settings = Settings(
        data_dir=tmp_path,
        model=str(tiny_model_dir),
        redis_url=empty_redis,
        engine_mode="remote",
        engine_secret="remote-secret",
    )
    context = build_context(settings, log=lambda _: None)
    admin = {"Authorization": f"Bearer {context.admin_token}"}
    with TestClient(create_app(context)) as client:
        snapshot = client.get("/admin/engine", headers=admin)
        ready = client.get("/readyz")
    error = assert_openai_error(snapshot, 503)
    assert error["code"] == "engine_unavailable"
    assert "no live engine serves" in error["message"]
    assert ready.status_code == 503
    assert "no live engine serves" in ready.json()["checks"]["engine"]["error"]
