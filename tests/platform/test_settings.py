"""Settings: embedded defaults, LORAMUX_* environment overrides, and rejected values."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from loramux.platform.settings import Settings

_ENV_VARS = (
    "LORAMUX_DATA_DIR",
    "LORAMUX_HOST",
    "LORAMUX_PORT",
    "LORAMUX_DATABASE_URL",
    "LORAMUX_ADMIN_TOKEN",
    "LORAMUX_STORE_BACKEND",
    "LORAMUX_S3_BUCKET",
    "LORAMUX_MODEL",
    "LORAMUX_ENGINE_KV_CACHE_BYTES",  # the test run sets a small one (tests/fixtures/engine_budget.py)
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Each test starts from no LORAMUX_* settings, whatever the caller's shell has."""
    for name in _ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def test_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = Settings()
    assert settings.data_dir.is_absolute()
    assert settings.data_dir == (tmp_path / ".loramux").resolve()
    assert settings.port == 8000
    assert settings.host == "127.0.0.1"
    assert settings.database_url is None
    assert settings.admin_token is None
    assert settings.store_backend == "local"
    assert settings.model is None


def test_default_database_is_sqlite_in_the_data_dir(tmp_path):
    settings = Settings(data_dir=tmp_path)
    url = settings.resolved_database_url
    assert url.startswith("sqlite:///")
    db_path = Path(url.removeprefix("sqlite:///"))
    assert db_path.is_absolute()
    assert db_path.parent == tmp_path.resolve()


def test_relative_data_dir_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = Settings(data_dir="some/where")
    assert settings.data_dir == (tmp_path / "some" / "where").resolve()


def test_env_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAMUX_PORT", "9123")
    monkeypatch.setenv("LORAMUX_HOST", "0.0.0.0")
    monkeypatch.setenv("LORAMUX_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("LORAMUX_DATABASE_URL", "postgresql+psycopg://u:p@db:5432/loramux")
    monkeypatch.setenv("LORAMUX_ADMIN_TOKEN", "from-the-env")
    settings = Settings()
    assert settings.port == 9123
    assert settings.host == "0.0.0.0"
    assert settings.data_dir == (tmp_path / "data").resolve()
    assert settings.database_url == "postgresql+psycopg://u:p@db:5432/loramux"
    assert settings.resolved_database_url == "postgresql+psycopg://u:p@db:5432/loramux"
    assert settings.admin_token is not None
    assert settings.admin_token.get_secret_value() == "from-the-env"
    assert "from-the-env" not in repr(settings)


def test_the_engine_budget_is_sized_to_the_machine_unless_set(tmp_path, monkeypatch):
    from loramux.platform.base_model import ResolvedBaseModel
    from loramux.platform.engine_settings import engine_config

    base = ResolvedBaseModel(path=tmp_path, model_id="m")
    assert Settings(data_dir=tmp_path).engine.cache.kv_cache_bytes is None
    assert engine_config(Settings(data_dir=tmp_path), base).kv_cache_bytes is None
    monkeypatch.setenv("LORAMUX_ENGINE_KV_CACHE_BYTES", str(64 << 20))
    assert engine_config(Settings(data_dir=tmp_path), base).kv_cache_bytes == 64 << 20
    with pytest.raises(ValidationError, match="kv_cache_bytes"):
        Settings(data_dir=tmp_path, kv_cache_bytes=0)


def test_explicit_arguments_beat_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAMUX_PORT", "9123")
    assert Settings(port=9200, data_dir=tmp_path).port == 9200


def test_env_data_dir_moves_the_sqlite_database(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAMUX_DATA_DIR", str(tmp_path / "elsewhere"))
    settings = Settings()
    assert (
        settings.resolved_database_url
        == f"sqlite:///{(tmp_path / 'elsewhere').resolve()}/loramux.db"
    )


@pytest.mark.parametrize("port", [70000, -1])
def test_out_of_range_port_is_rejected(tmp_path, port):
    with pytest.raises(ValidationError, match="port"):
        Settings(data_dir=tmp_path, port=port)


def test_out_of_range_port_from_env_is_rejected(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAMUX_PORT", "70000")
    with pytest.raises(ValidationError, match="port"):
        Settings(data_dir=tmp_path)


def test_non_numeric_port_from_env_is_rejected(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAMUX_PORT", "eighty")
    with pytest.raises(ValidationError, match="port"):
        Settings(data_dir=tmp_path)


def test_s3_store_needs_a_bucket(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAMUX_STORE_BACKEND", "s3")
    with pytest.raises(ValidationError, match="LORAMUX_S3_BUCKET"):
        Settings(data_dir=tmp_path)


def test_s3_store_with_a_bucket_is_accepted(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAMUX_STORE_BACKEND", "s3")
    monkeypatch.setenv("LORAMUX_S3_BUCKET", "adapters")
    settings = Settings(data_dir=tmp_path)
    assert settings.store_backend == "s3"
    assert settings.s3_bucket == "adapters"


def test_unknown_store_backend_is_rejected(tmp_path):
    with pytest.raises(ValidationError, match="store_backend"):
        Settings(data_dir=tmp_path, store_backend="ftp")
