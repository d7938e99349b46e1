"""An adapter may not take the base model's name: requests naming it reach the base model,
so such an adapter would be listed twice in /v1/models and never be reachable."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import update

from loramux.platform.db.models import Adapter
from loramux.platform.errors import Conflict
from loramux.platform.services.adapters import check_adapter_name
from tests.platform.api.conftest import assert_openai_error

FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def adapter_dir(make_adapter, tiny_model_dir) -> Path:
    return make_adapter(tiny_model_dir, rank=4, targets=("q_proj",), seed=5)


def _upload(client, headers, name: str, adapter_dir: Path):
    files = [("files", (file, (adapter_dir / file).read_bytes())) for file in FILES]
    return client.post("/v1/adapters", data={"name": name}, files=files, headers=headers)


def test_the_base_model_name_is_refused_by_the_name_check():
    with pytest.raises(Conflict) as refused:
        check_adapter_name("SmolLM2-135M-Instruct", base_model_id="SmolLM2-135M-Instruct")
    assert refused.value.code == "adapter_name_conflict"
    assert "base model" in refused.value.message
    # Other names, and names differing only in case (a distinct model id), are fine.
    assert check_adapter_name("my-bot", base_model_id="SmolLM2-135M-Instruct") == "my-bot"
    assert check_adapter_name("smollm2-135m-instruct", base_model_id="SmolLM2-135M-Instruct")


def test_uploading_an_adapter_under_the_base_model_name_is_a_409(
    client, context, tenant_key, adapter_dir
):
    auth = tenant_key()
    base = context.base_model.model_id
    error = assert_openai_error(_upload(client, auth, base, adapter_dir), 409)
    assert error["code"] == "adapter_name_conflict"
    assert base in error["message"]
    assert client.get("/v1/adapters", headers=auth).json()["data"] == []


def test_models_list_the_base_model_once_even_for_an_old_adapter_of_its_name(
    client, context, tenant_key, adapter_dir
):
    auth = tenant_key()
    base = context.base_model.model_id
    assert _upload(client, auth, "renamed-later", adapter_dir).status_code == 201
    # An adapter named before such names were refused.
    with context.sessions.begin() as session:
        session.execute(update(Adapter).where(Adapter.name == "renamed-later").values(name=base))
    ids = [card["id"] for card in client.get("/v1/models", headers=auth).json()["data"]]
    assert ids == [base]
