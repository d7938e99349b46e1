"""Sharing an adapter between tenants over HTTP, with the official ``openai`` client: an owner
grants a tenant its adapter (every version, or one), the grantee finds it in ``/v1/models``
as ``owner/name``, calls it and is billed for it, the owner sees its use by grantee, and a
revoked grantee is refused on its next request. As a hostile tenant: no way of naming an
adapter that was not granted (name, version, digest, alias, id, owner's namespace) lists,
calls, reads or changes it."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.platform.api.conftest import assert_openai_error, upload_adapter

PROMPT = "A shared adapter answers its grantees as it answers its owner: "


def _complete(client: openai.OpenAI, model: str):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)


def _headers(client: openai.OpenAI) -> dict[str, str]:
    return {"Authorization": f"Bearer {client.api_key}"}


def _name(server, client: openai.OpenAI) -> str:
    return httpx.get(f"{server.url}/v1/me", headers=_headers(client)).json()["tenant_name"]


def _grant(server, owner, adapter: str, grantee: str, body=None) -> httpx.Response:
    return httpx.put(
        f"{server.url}/v1/adapters/{adapter}/grants/{grantee}",
        json={} if body is None else body,
        headers=_headers(owner),
    )


def _models(client: openai.OpenAI) -> dict[str, str]:
    return {card.id: card.owned_by for card in client.models.list().data}


def _refused(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        _complete(client, model)
    assert assert_openai_error(refused.value.response, 404)["code"] == "model_not_found"


@pytest.fixture
def sharing(make_client, server, context, make_adapter):
    """An owner whose adapter ``helper`` has two versions, the text each gives, and two other
    tenants: the one it will grant, and a stranger."""
    owner, _ = make_client()
    model_dir = context.base_model.path
    first = upload_adapter(server, owner, "helper", make_adapter(model_dir, rank=4, seed=31))
    second = upload_adapter(server, owner, "helper", make_adapter(model_dir, rank=4, seed=32))
    texts = {n: _complete(owner, f"helper@{n}").choices[0].text for n in (1, 2)}
    assert texts[1] != texts[2]  # the versions' weights differ enough to tell apart
    (grantee, grantee_id), (stranger, _) = make_client(), make_client()
    return {
        "owner": owner,
        "owner_name": _name(server, owner),
        "versions": (first, second),
        "texts": texts,
        "grantee": grantee,
        "grantee_id": grantee_id,
        "grantee_name": _name(server, grantee),
        "stranger": stranger,
    }


def test_a_grantee_calls_the_shared_adapter_and_is_billed_for_it(sharing, server):
    owner, grantee, texts = sharing["owner"], sharing["grantee"], sharing["texts"]
    shared = f"{sharing['owner_name']}/helper"
    granted = _grant(server, owner, "helper", sharing["grantee_name"])
    assert granted.status_code == 200, granted.text
    assert granted.json() | {"created_at": None, "updated_at": None} == {
        "object": "adapter.grant",
        "adapter": "helper",
        "grantee": sharing["grantee_name"],
        "version": None,
        "model": shared,
        "created_at": None,
        "updated_at": None,
    }
    listed = httpx.get(f"{server.url}/v1/adapters/helper/grants", headers=_headers(owner))
    assert [g["grantee"] for g in listed.json()["data"]] == [sharing["grantee_name"]]

    assert _models(grantee)[shared] == sharing["owner_name"]
    assert shared not in _models(owner)  # the owner calls it by its own name
    first_sha = sharing["versions"][0]["sha256"]
    calls = {
        shared: texts[2],
        f"{shared}@1": texts[1],
        f"{shared}@sha256:{first_sha[:10]}": texts[1],
    }
    answers = {model: _complete(grantee, model) for model in calls}
    for model, text in calls.items():  # the owner's weights, token for token
        assert (answers[model].choices[0].text, answers[model].model) == (text, model)

    # Billed to the grantee, at its prices: its usage names the owner's adapter and version.
    rows = httpx.get(
        f"{server.url}/v1/usage", params={"group_by": "request"}, headers=_headers(grantee)
    ).json()["rows"]
    assert sorted((r["model"], r["adapter"], r["adapter_version"]) for r in rows) == sorted(
        [
            (shared, shared, 2),
            (f"{shared}@1", shared, 1),
            (f"{shared}@sha256:{first_sha[:10]}", shared, 1),
        ]
    )
    assert {r["tenant_id"] for r in rows} == {sharing["grantee_id"]}
    assert [r["completion_tokens"] for r in rows] == [
        answers[r["model"]].usage.completion_tokens for r in rows
    ]
    by_adapter = httpx.get(
        f"{server.url}/v1/usage", params={"group_by": "adapter"}, headers=_headers(grantee)
    ).json()["rows"]
    assert [(r["adapter"], r["requests"]) for r in by_adapter] == [(shared, 3)]
    # The owner's own usage holds only its own two requests ...
    own = httpx.get(f"{server.url}/v1/usage", headers=_headers(owner)).json()["totals"]
    assert own["requests"] == 2
    # ... and its shared usage the grantee's three, in counts and tokens only.
    seen = httpx.get(f"{server.url}/v1/usage/shared", headers=_headers(owner)).json()
    assert seen["rows"] == [
        {
            "adapter": "helper",
            "grantee": sharing["grantee_name"],
            "requests": 3,
            "prompt_tokens": sum(a.usage.prompt_tokens for a in answers.values()),
            "cached_prompt_tokens": sum(
                a.usage.prompt_tokens_details.cached_tokens for a in answers.values()
            ),
            "completion_tokens": sum(a.usage.completion_tokens for a in answers.values()),
        }
    ]
    assert seen["totals"]["requests"] == 3
    assert httpx.get(f"{server.url}/v1/usage/shared", headers=_headers(grantee)).json() == {
        "rows": [],
        "totals": {
            "requests": 0,
            "prompt_tokens": 0,
            "cached_prompt_tokens": 0,
            "completion_tokens": 0,
        },
    }


def test_a_revoked_grantee_is_refused_on_its_next_request(sharing, server):
    owner, grantee = sharing["owner"], sharing["grantee"]
    shared = f"{sharing['owner_name']}/helper"
    assert _grant(server, owner, "helper", sharing["grantee_name"]).status_code == 200
    assert _complete(grantee, shared).choices[0].text == sharing["texts"][2]
    url = f"{server.url}/v1/adapters/helper/grants/{sharing['grantee_name']}"
    assert httpx.delete(url, headers=_headers(owner)).status_code == 204
    _refused(grantee, shared)  # the very next request
    _refused(grantee, f"{shared}@1")
    assert shared not in _models(grantee)
    again = httpx.delete(url, headers=_headers(owner))
    assert assert_openai_error(again, 404)["code"] == "grant_not_found"
    # Granted again, then the owner deletes the adapter: gone for the grantee too.
    assert _grant(server, owner, "helper", sharing["grantee_name"]).status_code == 200
    assert _complete(grantee, shared).choices[0].text == sharing["texts"][2]
    deleted = httpx.delete(f"{server.url}/v1/adapters/helper", headers=_headers(owner))
    assert deleted.status_code == 204
    _refused(grantee, shared)
    assert shared not in _models(grantee)


def test_a_grant_of_one_version_reaches_that_version_alone(sharing, server):
    owner, grantee, texts = sharing["owner"], sharing["grantee"], sharing["texts"]
    shared = f"{sharing['owner_name']}/helper"
    first, second = sharing["versions"]
    granted = _grant(server, owner, "helper", sharing["grantee_name"], {"version": 1})
    assert granted.json()["version"] == 1
    # The bare name reaches the granted version, though the owner's newest is version 2.
    assert _complete(grantee, shared).choices[0].text == texts[1]
    assert _complete(grantee, f"{shared}@1").choices[0].text == texts[1]
    assert _complete(grantee, f"{shared}@sha256:{first['sha256'][:8]}").choices[0].text == texts[1]
    for model in (f"{shared}@2", f"{shared}@sha256:{second['sha256'][:8]}", f"{shared}@3"):
        _refused(grantee, model)
    # Granting every version: the bare name follows the owner's alias.
    assert _grant(server, owner, "helper", sharing["grantee_name"]).json()["version"] is None
    assert _complete(grantee, shared).choices[0].text == texts[2]
    alias = httpx.put(
        f"{server.url}/v1/adapters/helper/alias", json={"version": 1}, headers=_headers(owner)
    )
    assert alias.status_code == 200, alias.text
    assert _complete(grantee, shared).choices[0].text == texts[1]
    assert _complete(grantee, f"{shared}@2").choices[0].text == texts[2]


def test_what_a_grant_refuses(sharing, server, context):
    owner, grantee_name = sharing["owner"], sharing["grantee_name"]
    cases = [
        ("helper", "no-such-tenant", {}, 404, "grantee_not_found"),
        ("helper", sharing["owner_name"], {}, 400, "invalid_grant"),
        ("helper", grantee_name, {"version": 3}, 404, "adapter_version_not_found"),
        ("nothing", grantee_name, {}, 404, "adapter_not_found"),
        ("helper", grantee_name, {"version": 0}, 422, "invalid_parameters"),
        ("helper", grantee_name, {"version": "1"}, 422, "invalid_parameters"),
        ("helper", grantee_name, {"versions": 1}, 422, "invalid_parameters"),
    ]
    for adapter, grantee, body, status, code in cases:
        answer = _grant(server, owner, adapter, grantee, body)
        assert assert_openai_error(answer, status)["code"] == code, (adapter, grantee, body)
    listed = httpx.get(f"{server.url}/v1/adapters/helper/grants", headers=_headers(owner))
    assert listed.json()["data"] == []  # nothing refused was kept


def test_a_hostile_tenant_reaches_nothing_not_granted_to_it(sharing, server):
    """The stranger has no grant; the grantee has one, and tries to go beyond it."""
    owner, grantee, stranger = sharing["owner"], sharing["grantee"], sharing["stranger"]
    owner_name, (first, second) = sharing["owner_name"], sharing["versions"]
    assert (
        _grant(server, owner, "helper", sharing["grantee_name"], {"version": 1}).status_code == 200
    )
    stranger_name = _name(server, stranger)

    # Calling, however named: the owner's namespace, versions, digests, the adapter's id.
    shared = f"{owner_name}/helper"
    names = [
        shared,
        f"{shared}@1",
        f"{shared}@2",
        f"{shared}@sha256:{first['sha256'][:12]}",
        f"{shared}@sha256:{second['sha256']}",
        f"{owner_name}/{first['id']}",
        first["id"],
        "helper",
        "helper@1",
        f"helper@sha256:{first['sha256'][:12]}",
    ]
    for model in names:
        _refused(stranger, model)
    for model in names[2:]:  # beyond the grantee's one version, or outside the namespace
        if model != names[3]:  # version 1's digest is granted
            _refused(grantee, model)
    assert not any(model.startswith(owner_name) for model in _models(stranger))

    # Reading and changing: every adapter route acts on the caller's own adapter.
    for client in (stranger, grantee):
        headers = _headers(client)
        for method, path, body in (
            ("GET", "/v1/adapters/helper", None),
            ("GET", "/v1/adapters/helper/versions", None),
            ("GET", "/v1/adapters/helper/grants", None),
            ("PUT", "/v1/adapters/helper/alias", {"version": 1}),
            ("PUT", f"/v1/adapters/helper/grants/{stranger_name}", {}),
            ("DELETE", f"/v1/adapters/helper/grants/{sharing['grantee_name']}", None),
            ("DELETE", "/v1/adapters/helper", None),
            ("GET", f"/v1/adapters/{first['id']}", None),
        ):
            answer = httpx.request(method, f"{server.url}{path}", json=body, headers=headers)
            assert assert_openai_error(answer, 404)["code"] == "adapter_not_found", (method, path)
        for path in (f"/v1/adapters/{owner_name}%2Fhelper", f"/v1/adapters/{shared}/versions"):
            assert httpx.get(f"{server.url}{path}", headers=headers).status_code == 404
        listed = httpx.get(f"{server.url}/v1/adapters", headers=headers).json()["data"]
        assert listed == []
        assert httpx.get(f"{server.url}/v1/usage/shared", headers=headers).json()["rows"] == []
    # The grantee could not pass the adapter on, nor end its own grant, nor move the alias.
    assert _complete(grantee, shared).choices[0].text == sharing["texts"][1]
    _refused(stranger, shared)
    grants = httpx.get(f"{server.url}/v1/adapters/helper/grants", headers=_headers(owner))
    assert [(g["grantee"], g["version"]) for g in grants.json()["data"]] == [
        (sharing["grantee_name"], 1)
    ]
    versions = httpx.get(f"{server.url}/v1/adapters/helper/versions", headers=_headers(owner))
    assert versions.json()["alias_version"] is None
