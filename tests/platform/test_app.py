"""The HTTP app over a real context: health, admin auth on /v1/models, OpenAI-style errors."""

from __future__ import annotations

import stat

import pytest
from fastapi.testclient import TestClient

from loramux.platform.admin_token import TOKEN_FILE, load_or_create_admin_token
from loramux.platform.app import create_app
from loramux.platform.context import build_context
from loramux.platform.settings import Settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("LORAMUX_ADMIN_TOKEN", "LORAMUX_MODEL", "LORAMUX_MODEL_ID", "LORAMUX_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def context(tmp_path, tiny_model_dir):
    return build_context(Settings(data_dir=tmp_path, model=str(tiny_model_dir)), log=lambda _: None)


@pytest.fixture
def client(context):
    with TestClient(create_app(context)) as test_client:
        yield test_client


def _assert_openai_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error


def test_healthz(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_models_without_token_is_401(client):
    error = _assert_openai_error(client.get("/v1/models"), 401)
    assert error["type"] == "authentication_error"
    assert error["code"] == "missing_api_key"


def test_models_with_non_bearer_scheme_is_401(client, context):
    response = client.get("/v1/models", headers={"Authorization": f"Basic {context.admin_token}"})
    _assert_openai_error(response, 401)


def test_models_with_wrong_token_is_401(client, context):
    response = client.get("/v1/models", headers={"Authorization": "Bearer not-the-admin-token"})
    error = _assert_openai_error(response, 401)
    assert error["type"] == "authentication_error"
    assert error["code"] == "invalid_api_key"
    assert context.admin_token not in response.text


def test_models_with_admin_token_lists_the_base_model(client, context, tiny_model_dir):
    response = client.get("/v1/models", headers={"Authorization": f"Bearer {context.admin_token}"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list"
    ids = [card["id"] for card in body["data"]]
    assert ids == [tiny_model_dir.name]
    assert body["data"][0]["object"] == "model"


def test_unknown_route_is_404_in_openai_shape(client, context):
    response = client.get(
        "/v1/no-such-route", headers={"Authorization": f"Bearer {context.admin_token}"}
    )
    error = _assert_openai_error(response, 404)
    assert error["type"] == "not_found_error"


def test_context_holds_the_base_model(context, tiny_model_dir):
    assert context.base_model.model_id == tiny_model_dir.name
    assert context.base_model.path == tiny_model_dir.resolve()


# --- the admin token -------------------------------------------------------------------------


def test_admin_token_created_once_with_mode_0600(tmp_path):
    settings = Settings(data_dir=tmp_path)
    first = load_or_create_admin_token(settings)
    assert first.created is True
    assert first.value

    token_file = tmp_path / TOKEN_FILE
    assert token_file.is_file()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert token_file.read_text().strip() == first.value

    second = load_or_create_admin_token(settings)
    assert second.created is False
    assert second.value == first.value


def test_admin_tokens_differ_between_data_dirs(tmp_path):
    one = load_or_create_admin_token(Settings(data_dir=tmp_path / "one"))
    two = load_or_create_admin_token(Settings(data_dir=tmp_path / "two"))
    assert one.value != two.value


def test_build_context_reports_token_creation_once(tmp_path, tiny_model_dir):
    settings = Settings(data_dir=tmp_path, model=str(tiny_model_dir))
    first = build_context(settings, log=lambda _: None)
    second = build_context(settings, log=lambda _: None)
    assert first.admin_token_created is True
    assert second.admin_token_created is False
    assert second.admin_token == first.admin_token


def test_env_admin_token_overrides_the_file(tmp_path, tiny_model_dir, monkeypatch):
    stored = load_or_create_admin_token(Settings(data_dir=tmp_path)).value
    monkeypatch.setenv("LORAMUX_ADMIN_TOKEN", "operator-chosen-token")
    settings = Settings(data_dir=tmp_path, model=str(tiny_model_dir))
    token = load_or_create_admin_token(settings)
    assert token.value == "operator-chosen-token"
    assert token.created is False

    context = build_context(settings, log=lambda _: None)
    with TestClient(create_app(context)) as client:
        ok = client.get("/v1/models", headers={"Authorization": "Bearer operator-chosen-token"})
        assert ok.status_code == 200, ok.text
        stale = client.get("/v1/models", headers={"Authorization": f"Bearer {stored}"})
        _assert_openai_error(stale, 401)


def test_env_admin_token_writes_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAMUX_ADMIN_TOKEN", "operator-chosen-token")
    load_or_create_admin_token(Settings(data_dir=tmp_path))
    assert not (tmp_path / TOKEN_FILE).exists()
