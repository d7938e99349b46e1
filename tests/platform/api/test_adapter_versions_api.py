"""Addressing one version of an adapter (``name@3``, ``name@sha256:<prefix>``) over HTTP with
the official ``openai`` client: each version answers with its own weights, the bare name
with the newest, bad forms are 400s naming the forms, another tenant's versions are 404s
however named, usage records carry the version served, and a new version never reuses the
cached KV of the old one under the same name."""

from __future__ import annotations

import logging
import threading
import time

import httpx
import openai
import pytest
from sqlalchemy import select

from loramux.engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from loramux.platform.db.models import Adapter, AdapterStatus, UsageRecord
from tests.platform.api.conftest import assert_openai_error, upload_adapter
from tests.platform.db.factories import add_adapter_version

PROMPT = "Versions of one adapter answer the same prompt differently: "


def _complete(client: openai.OpenAI, model: str, prompt: str = PROMPT):
    return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)


@pytest.fixture
def two_versions(make_client, server, context, make_adapter):
    """A tenant whose adapter ``bot`` has two versions of different weights; the text each
    gave as the newest (before the second existed, and after)."""
    client, tenant_id = make_client()
    model_dir = context.base_model.path
    first = upload_adapter(server, client, "bot", make_adapter(model_dir, rank=4, seed=11, std=0.3))
    text_1 = _complete(client, "bot").choices[0].text
    second = upload_adapter(
        server, client, "bot", make_adapter(model_dir, rank=4, seed=12, std=0.3)
    )
    text_2 = _complete(client, "bot").choices[0].text
    assert (first["version"], second["version"]) == (1, 2)
    assert text_1 != text_2  # the versions' weights differ enough to tell them apart
    return client, tenant_id, first, second, text_1, text_2


def test_each_version_answers_by_number_and_by_digest(two_versions, context, server, caplog):
    client, tenant_id, first, second, text_1, text_2 = two_versions
    caplog.set_level(logging.INFO, logger="loramux.requests")
    named = {
        "bot": text_2,
        "bot@1": text_1,
        "bot@2": text_2,
        f"bot@sha256:{first['sha256'][:8]}": text_1,
        f"bot@sha256:{second['sha256'][:16].upper()}": text_2,
        f"bot@sha256:{first['sha256']}": text_1,
    }
    for model, text in named.items():
        result = _complete(client, model)
        assert (result.choices[0].text, result.model) == (text, model), model
    # The old version keeps answering while the new one does: neither retires the other.
    assert _complete(client, "bot@1").choices[0].text == text_1
    with context.sessions() as session:
        records = session.scalars(
            select(UsageRecord)
            .where(UsageRecord.tenant_id == tenant_id)
            .order_by(UsageRecord.created_at)
        ).all()
    served = [(r.model, r.adapter_version_id) for r in records]
    # The first two requests named "bot" while version 1, then version 2, was the newest.
    (_, version_1), (_, version_2) = served[:2]
    assert version_1 != version_2
    assert ("bot@1", version_1) in served and ("bot@2", version_2) in served
    assert (f"bot@sha256:{first['sha256'][:8]}", version_1) in served
    # The tenant's usage export names the version and its digest, request by request.
    usage = httpx.get(
        f"{server.url}/v1/usage",
        params={"group_by": "request"},
        headers={"Authorization": f"Bearer {client.api_key}"},
    )
    assert usage.status_code == 200, usage.text
    rows = {(r["model"], r["adapter_version"], r["adapter_sha256"]) for r in usage.json()["rows"]}
    assert ("bot@1", 1, first["sha256"]) in rows and ("bot@2", 2, second["sha256"]) in rows
    # ...and so does the request log, a line per request, with no prompt or text in it.
    lines = [r.getMessage() for r in caplog.records if r.name == "loramux.requests"]
    by_model = {line.split("model=")[1].split(" ")[0].strip("'"): line for line in lines}
    assert f"sha256={first['sha256']} " in by_model["bot@1"]
    assert f"adapter_version={version_2} sha256={second['sha256']} " in by_model["bot@2"]
    assert text_1.strip() and not any(PROMPT.strip() in ln or text_1 in ln for ln in lines)


def test_a_version_in_a_form_not_read_is_a_400_naming_the_forms(two_versions):
    client = two_versions[0]
    for model in (
        "bot@",
        "bot@0",
        "bot@01",
        "bot@x",
        "bot@sha256:",
        "bot@sha256:abc",
        "bot@sha1:ab",
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            _complete(client, model)
        assert assert_openai_error(refused.value.response, 400)["code"] == "invalid_model"
        assert "name@<version number>" in str(refused.value), model


def test_a_missing_version_and_another_tenants_versions_are_404s(two_versions, make_client):
    client, _, first, *_ = two_versions
    for model in ("bot@3", "bot@sha256:" + "0" * 8, "nobody@1"):
        with pytest.raises(openai.NotFoundError) as missing:
            _complete(client, model)
        assert assert_openai_error(missing.value.response, 404)["code"] == "model_not_found"
    stranger, _ = make_client()
    for model in ("bot", "bot@1", f"bot@sha256:{first['sha256'][:12]}", f"{first['id']}"):
        with pytest.raises(openai.NotFoundError) as hidden:
            _complete(stranger, model)
        assert assert_openai_error(hidden.value.response, 404)["code"] == "model_not_found"
        assert first["sha256"][:8] not in str(hidden.value).replace(model, "")


def test_a_new_version_never_reuses_the_old_versions_cached_prompt(
    make_client, server, context, make_adapter
):
    client, _ = make_client()
    model_dir = context.base_model.path
    prompt = PROMPT * 6  # several full KV blocks
    upload_adapter(server, client, "cached", make_adapter(model_dir, rank=4, seed=21))
    _complete(client, "cached", prompt)
    again = _complete(client, "cached", prompt)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the same version hits
    upload_adapter(server, client, "cached", make_adapter(model_dir, rank=4, seed=22))
    fresh = _complete(client, "cached", prompt)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    # And the old version, named, still finds its own blocks.
    old = _complete(client, "cached@1", prompt)
    assert old.usage.prompt_tokens_details.cached_tokens > 0


def test_the_alias_rolls_the_name_back_and_forward_mid_traffic(two_versions, server):
    """The rollback the issue asks for: the bare name moves between versions while a client
    keeps calling it, and no request fails; each answer after the alias's is the target's."""
    client, _, first, second, text_1, text_2 = two_versions
    auth = {"Authorization": f"Bearer {client.api_key}"}
    texts, errors, stop = [], [], threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            try:
                texts.append(_complete(client, "bot").choices[0].text)
            except Exception as exc:  # every failure is what the test counts
                errors.append(exc)

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        for target, text in ((1, text_1), (None, text_2), (1, text_1)):
            moved = httpx.put(
                f"{server.url}/v1/adapters/bot/alias", json={"version": target}, headers=auth
            )
            assert moved.status_code == 200, moved.text
            assert (moved.json()["alias_version"], moved.json()["version"]) == (target, 2)
            assert _complete(client, "bot").choices[0].text == text
            time.sleep(0.3)
    finally:
        stop.set()
        worker.join(timeout=60)
    assert not errors and len(texts) >= 3 and set(texts) <= {text_1, text_2}
    assert _complete(client, "bot@2").choices[0].text == text_2  # numbers ignore the alias

    listed = httpx.get(f"{server.url}/v1/adapters/bot/versions", headers=auth).json()
    assert listed["alias_version"] == 1
    assert [(v["version"], v["sha256"]) for v in listed["data"]] == [
        (2, second["sha256"]),
        (1, first["sha256"]),
    ]


def test_the_alias_refuses_what_it_cannot_point_at(two_versions, server, context, make_client):
    client, tenant_id, *_ = two_versions
    auth = {"Authorization": f"Bearer {client.api_key}"}

    def put(body, name="bot", headers=auth):
        return httpx.put(f"{server.url}/v1/adapters/{name}/alias", json=body, headers=headers)

    with context.sessions.begin() as session:
        adapter = session.scalars(select(Adapter).where(Adapter.tenant_id == tenant_id)).one()
        add_adapter_version(
            session, adapter, 3, status=AdapterStatus.FAILED.value, failure_reason="bad shapes"
        )
    assert put({"version": 3}).json()["error"]["code"] == "adapter_version_not_ready"
    assert put({"version": 3}).status_code == 409
    assert put({"version": 9}).status_code == 404
    assert put({"version": 9}).json()["error"]["code"] == "adapter_version_not_found"
    for body in ({"version": 0}, {"version": "1"}, {}, {"version": 1, "extra": True}):
        assert put(body).status_code == 422, body
    assert put({"version": 1}, name="nobody").status_code == 404
    stranger, _ = make_client()
    stranger_auth = {"Authorization": f"Bearer {stranger.api_key}"}
    assert put({"version": 1}, headers=stranger_auth).json()["error"]["code"] == "adapter_not_found"
    hidden = httpx.get(f"{server.url}/v1/adapters/bot/versions", headers=stranger_auth)
    assert hidden.status_code == 404
    # Nothing moved: the owner's bare name still reaches the newest version.
    assert httpx.get(f"{server.url}/v1/adapters/bot", headers=auth).json()["alias_version"] is None


def test_the_same_bytes_again_are_the_same_version(two_versions, server, context, make_adapter):
    """Re-uploading version 1's files answers 200 with version 1: no new version, no new
    stored object, the bare name still the newest."""
    client, _, first, _, _, text_2 = two_versions
    auth = {"Authorization": f"Bearer {client.api_key}"}
    stored = sorted(p.name for p in context.store.root.rglob("*") if p.is_file())
    folder = make_adapter(context.base_model.path, rank=4, seed=11, std=0.3)  # version 1's
    files = [("files", (f, (folder / f).read_bytes())) for f in (CONFIG_FILE, WEIGHTS_FILE)]
    again = httpx.post(
        f"{server.url}/v1/adapters", data={"name": "bot"}, files=files, headers=auth, timeout=60
    )
    assert again.status_code == 200, again.text
    assert (again.json()["version"], again.json()["sha256"]) == (1, first["sha256"])
    versions = httpx.get(f"{server.url}/v1/adapters/bot/versions", headers=auth).json()["data"]
    assert [v["version"] for v in versions] == [2, 1]
    assert sorted(p.name for p in context.store.root.rglob("*") if p.is_file()) == stored
    assert _complete(client, "bot").choices[0].text == text_2
