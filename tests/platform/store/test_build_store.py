"""build_store: the backend the settings choose."""

from __future__ import annotations

import os
from typing import Any

import pytest

from loramux.platform.settings import Settings
from loramux.platform.store import LocalObjectStore, build_store
from loramux.platform.store.s3 import S3ObjectStore


@pytest.fixture(autouse=True)
def clean_env(monkeypatch) -> None:
    """Only the values a test passes count, whatever LORAMUX_* the shell has."""
    for name in list(os.environ):
        if name.startswith("LORAMUX_"):
            monkeypatch.delenv(name)


def test_default_is_a_local_store_in_the_data_dir(tmp_path) -> None:
    store = build_store(Settings(data_dir=tmp_path / "data"))

    assert isinstance(store, LocalObjectStore)
    assert store.root == tmp_path / "data" / "store"


def test_s3_settings_give_a_working_s3_store(s3_endpoint: Any, s3_bucket: str, tmp_path) -> None:
    settings = Settings(
        data_dir=tmp_path,
        store_backend="s3",
        s3_endpoint_url=s3_endpoint.endpoint_url,
        s3_bucket=s3_bucket,
        s3_region=s3_endpoint.region,
        s3_access_key_id=s3_endpoint.access_key_id,
        s3_secret_access_key=s3_endpoint.secret_access_key,
    )

    store = build_store(settings)

    assert isinstance(store, S3ObjectStore)
    assert store.bucket == s3_bucket
    assert store.endpoint_url == s3_endpoint.endpoint_url
    stored = store.put_stream([b"adapter"])
    with store.open(stored.key) as reader:
        assert reader.read() == b"adapter"
    listed = s3_endpoint.client().list_objects_v2(Bucket=s3_bucket)["Contents"]
    assert [o["Key"] for o in listed] == [stored.key]
