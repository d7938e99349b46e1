"""Unauthenticated ``/readyz`` names the failed check and a generic reason only: no endpoint,
bucket, object key, host or database URL (password included); the details are logged."""

from __future__ import annotations

import logging

from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.orm import sessionmaker

from loramux.platform.store import StoreUnavailable

HEALTH_LOGGER = "loramux.platform.api.ops.health"
PRIVATE_STORE_DETAILS = (
    "minio.internal.example",
    "tenant-adapters-bucket",
    "sha256/ab/abcdef0123456789",
)
PASSWORD = "s3cret-readiness-pw"


def test_a_broken_store_is_named_without_its_endpoint_bucket_or_key(
    client, context, monkeypatch, caplog
):
    def unavailable(key: str) -> bool:
        raise StoreUnavailable(
            "object store at https://minio.internal.example:9000 failed on "
            "s3://tenant-adapters-bucket/sha256/ab/abcdef0123456789: connection refused"
        )

    monkeypatch.setattr(context.store, "exists", unavailable)
    with caplog.at_level(logging.WARNING, logger=HEALTH_LOGGER):
        response = client.get("/readyz")
    assert response.status_code == 503, response.text
    store = response.json()["checks"]["store"]
    assert store["status"] == "failed"
    assert "store" in store["error"]
    for detail in PRIVATE_STORE_DETAILS:
        assert detail not in response.text
    # Operators find the details in the log.
    logged = caplog.text
    assert all(detail in logged for detail in PRIVATE_STORE_DETAILS), logged


def test_a_broken_database_is_named_without_its_url(
    client, context, postgres_database_url, monkeypatch, caplog
):
    url = make_url(postgres_database_url).set(
        host="127.0.0.1", port=1, username="readiness", password=PASSWORD
    )
    unreachable = create_engine(url)
    monkeypatch.setattr(context, "sessions", sessionmaker(bind=unreachable))
    try:
        with caplog.at_level(logging.WARNING, logger=HEALTH_LOGGER):
            response = client.get("/readyz")
    finally:
        unreachable.dispose()
    assert response.status_code == 503, response.text
    database = response.json()["checks"]["database"]
    assert database["status"] == "failed"
    assert "database" in database["error"]
    for private in (PASSWORD, "127.0.0.1", "readiness", "postgresql", url.database):
        assert private not in response.text, private
    assert "127.0.0.1" in caplog.text  # where it tried, for the operator
    assert PASSWORD not in caplog.text
