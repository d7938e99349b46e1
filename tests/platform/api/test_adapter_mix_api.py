"""Composing adapters in one request over HTTP with the official ``openai`` client: the
``adapters`` extension field and the ``model`` form ``a*0.7+b*0.3`` give transformers +
PEFT's ``add_weighted_adapter(..., "cat")`` text, on completions and chat, with an adapter
another tenant shares; the usage record names each version served and bills the request's
tokens; what cannot be composed is refused with the code that says why."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.engine.hf_reference import greedy_tokens
from tests.platform.api.conftest import assert_openai_error, upload_adapter

PROMPT = "Composed adapters answer together: "
MAX_TOKENS = 10
SPECS = {
    "domain": {"rank": 4, "targets": ("q_proj", "v_proj"), "seed": 41, "std": 0.3},
    "style": {"rank": 8, "targets": ("o_proj", "down_proj"), "seed": 42, "std": 0.3},
}


def _complete(client: openai.OpenAI, model: str, **extra):
    return client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
    )


@pytest.fixture
def composing(make_client, server, context, make_adapter):
    """A tenant with adapters ``domain`` and ``style``; their folders; the base model."""
    client, tenant_id = make_client()
    model_dir = context.base_model.path
    folders = {name: make_adapter(model_dir, **spec) for name, spec in SPECS.items()}
    for name, folder in folders.items():
        upload_adapter(server, client, name, folder)
    return client, tenant_id, folders, context.base_model.model_id


def _reference_text(context, folders: dict, parts) -> str:
    tokenizer = context.engine.tokenizer
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    mix = [(folders[name], weight) for name, weight in parts]
    tokens = greedy_tokens(context.base_model.path, None, prompt_ids, MAX_TOKENS, mix=mix)
    return tokenizer.decode(tokens, skip_special_tokens=True)


def test_a_composed_request_gives_pefts_weighted_combination(composing, context, server):
    client, tenant_id, folders, base = composing
    parts = [("domain", 0.7), ("style", -0.4)]
    expected = _reference_text(context, folders, parts)
    adapters = [{"name": name, "weight": weight} for name, weight in parts]
    by_field = _complete(client, base, adapters=adapters)
    by_model = _complete(client, "domain*0.7+style*-0.4")
    assert by_field.choices[0].text == by_model.choices[0].text == expected
    # Not one adapter's text alone.
    assert _complete(client, "domain").choices[0].text != expected
    # The response and the usage record name each version served.
    assert by_field.model == by_model.model == "domain@1*0.7+style@1*-0.4"
    rows = httpx.get(
        f"{server.url}/v1/usage",
        params={"group_by": "request"},
        headers={"Authorization": f"Bearer {client.api_key}"},
    ).json()["rows"]
    composed = [r for r in rows if r["model"] == "domain@1*0.7+style@1*-0.4"]
    assert len(composed) == 2
    for row, answer in zip(composed, (by_field, by_model), strict=True):
        assert (row["prompt_tokens"], row["completion_tokens"]) == (
            answer.usage.prompt_tokens,
            answer.usage.completion_tokens,
        )
        assert row["adapter"] == row["model"] and row["tenant_id"] == tenant_id
    # Chat takes the same field.
    chat = client.chat.completions.create(
        model=base,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
        extra_body={"adapters": adapters},
    )
    same = client.chat.completions.create(
        model="domain*0.7+style*-0.4",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
    )
    assert chat.choices[0].message.content == same.choices[0].message.content
    assert chat.model == "domain@1*0.7+style@1*-0.4"


def test_a_composition_may_take_an_adapter_another_tenant_shares(
    composing, make_client, server, context, make_adapter
):
    client, _, folders, base = composing
    owner, _ = make_client()
    owner_name = httpx.get(
        f"{server.url}/v1/me", headers={"Authorization": f"Bearer {owner.api_key}"}
    ).json()["tenant_name"]
    shared_folder = make_adapter(context.base_model.path, rank=4, seed=43, std=0.3)
    upload_adapter(server, owner, "tone", shared_folder)
    me = httpx.get(f"{server.url}/v1/me", headers={"Authorization": f"Bearer {client.api_key}"})
    adapters = [{"name": "domain", "weight": 0.5}, {"name": f"{owner_name}/tone", "weight": 1.0}]
    with pytest.raises(openai.NotFoundError) as hidden:  # not granted yet
        _complete(client, base, adapters=adapters)
    assert assert_openai_error(hidden.value.response, 404)["code"] == "model_not_found"
    granted = httpx.put(
        f"{server.url}/v1/adapters/tone/grants/{me.json()['tenant_name']}",
        json={},
        headers={"Authorization": f"Bearer {owner.api_key}"},
    )
    assert granted.status_code == 200, granted.text
    expected = _reference_text(
        context, {**folders, "tone": shared_folder}, [("domain", 0.5), ("tone", 1.0)]
    )
    answer = _complete(client, base, adapters=adapters)
    assert answer.choices[0].text == expected
    assert answer.model == f"domain@1*0.5+{owner_name}/tone@1*1"


def test_what_cannot_be_composed_is_refused_with_its_code(
    composing, server, context, make_adapter, base
):
    client, _, _, _ = composing
    dora = make_adapter(context.base_model.path, rank=4, seed=44, use_dora=True)
    upload_adapter(server, client, "dora", dora)
    part = {"name": "domain", "weight": 1.0}
    cases = [
        ("domain", {"adapters": [part]}, 400, "invalid_model"),  # model must be the base
        (base, {"adapters": [part] * 2}, 400, "invalid_adapters"),  # one version twice
        (
            base,
            {"adapters": [{"name": f"domain@{i}", "weight": 1} for i in range(5)]},
            400,
            "invalid_adapters",
        ),
        (base, {"adapters": [{"name": "nobody", "weight": 1.0}]}, 404, "model_not_found"),
        (base, {"adapters": [{"name": "domain", "weight": 1000.0}]}, 422, "invalid_parameters"),
        (base, {"adapters": []}, 422, "invalid_parameters"),
        (base, {"adapters": [{"name": "domain"}]}, 422, "invalid_parameters"),
        ("domain*x", {}, 400, "invalid_adapters"),
        ("domain*nan+style*1", {}, 400, "invalid_adapters"),
        ("*1", {}, 400, "invalid_adapters"),
        ("domain*1+dora*1", {}, 400, "adapter_not_composable"),
    ]
    for model, extra, status, code in cases:
        answer = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": model, "prompt": PROMPT, "max_tokens": 2, **extra},
            headers={"Authorization": f"Bearer {client.api_key}"},
            timeout=60,
        )
        assert assert_openai_error(answer, status)["code"] == code, (model, extra)
    # Each of them alone still serves.
    for model in ("domain", "dora"):
        assert _complete(client, model).choices[0].finish_reason == "length"
