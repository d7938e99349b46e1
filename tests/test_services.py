"""Round trips against the real services started by tests/fixtures/services.py."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest
import redis

from tests.fixtures.services import S3Endpoint, fresh_postgres_database, libpq_url

MIB = 1024 * 1024


# --------------------------------------------------------------------------------------------
# PostgreSQL
# --------------------------------------------------------------------------------------------


def test_postgres_url_is_sqlalchemy_psycopg_url(postgres_url: str) -> None:
    assert postgres_url.startswith("postgresql+psycopg://")
    with psycopg.connect(libpq_url(postgres_url)) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_postgres_insert_select_and_rollback(postgres_database_url: str) -> None:
    with psycopg.connect(libpq_url(postgres_database_url)) as conn:
        conn.execute("CREATE TABLE tenants (id serial PRIMARY KEY, name text NOT NULL UNIQUE)")
        conn.execute("INSERT INTO tenants (name) VALUES (%s), (%s)", ("acme", "globex"))
        conn.commit()

        rows = conn.execute("SELECT name FROM tenants ORDER BY name").fetchall()
        assert rows == [("acme",), ("globex",)]

        with pytest.raises(RuntimeError, match="abort"), conn.transaction():
            conn.execute("INSERT INTO tenants (name) VALUES (%s)", ("initech",))
            raise RuntimeError("abort")

        count = conn.execute("SELECT count(*) FROM tenants WHERE name = 'initech'").fetchone()
        assert count == (0,)

    # A new connection sees the committed rows only.
    with psycopg.connect(libpq_url(postgres_database_url)) as conn:
        assert conn.execute("SELECT count(*) FROM tenants").fetchone() == (2,)


def _current_database(url: str) -> str:
    with psycopg.connect(libpq_url(url)) as conn:
        row = conn.execute("SELECT current_database()").fetchone()
    assert row is not None
    return str(row[0])


@pytest.fixture
def other_postgres_database_url(postgres_url: str) -> Iterator[str]:
    """A second per-test database (function fixtures are cached once per test)."""
    with fresh_postgres_database(postgres_url) as url:
        yield url


def test_postgres_databases_are_distinct(
    postgres_database_url: str, other_postgres_database_url: str
) -> None:
    assert postgres_database_url != other_postgres_database_url
    first = _current_database(postgres_database_url)
    second = _current_database(other_postgres_database_url)
    assert first != second

    with psycopg.connect(libpq_url(postgres_database_url)) as conn:
        conn.execute("CREATE TABLE only_here (x int)")
    with psycopg.connect(libpq_url(other_postgres_database_url)) as conn:
        row = conn.execute("SELECT to_regclass('only_here')").fetchone()
    assert row == (None,)


def test_postgres_database_is_fresh_per_test(postgres_database_url: str) -> None:
    # The table created by the insert/rollback test must not be visible here.
    with psycopg.connect(libpq_url(postgres_database_url)) as conn:
        assert conn.execute("SELECT to_regclass('tenants')").fetchone() == (None,)


# --------------------------------------------------------------------------------------------
# Redis
# --------------------------------------------------------------------------------------------


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def test_redis_set_get(redis_client: redis.Redis) -> None:
    key = f"test:{uuid.uuid4().hex}"
    assert redis_client.set(key, "hello", ex=60)
    assert redis_client.get(key) == "hello"
    assert redis_client.delete(key) == 1
    assert redis_client.get(key) is None


def test_redis_rate_limit_counter_with_expire(redis_client: redis.Redis) -> None:
    """Fixed-window limiter: INCR a per-window counter; the first hit sets its expiry."""
    key = f"ratelimit:{uuid.uuid4().hex}"
    limit, window_ms = 3, 300

    def allow() -> bool:
        count = redis_client.incr(key)
        if count == 1:
            redis_client.pexpire(key, window_ms)
        return count <= limit

    assert [allow() for _ in range(5)] == [True, True, True, False, False]
    assert 0 < redis_client.pttl(key) <= window_ms

    deadline = time.monotonic() + 5
    while redis_client.exists(key) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not redis_client.exists(key), "counter did not expire"
    # A new window starts from zero.
    assert allow()
    redis_client.delete(key)


# --------------------------------------------------------------------------------------------
# S3
# --------------------------------------------------------------------------------------------


def test_s3_endpoint_shape(s3_endpoint: S3Endpoint) -> None:
    assert s3_endpoint.endpoint_url.startswith("http")
    assert s3_endpoint.access_key_id
    assert s3_endpoint.secret_access_key
    assert s3_endpoint.region


def test_s3_put_get_list_delete(s3_endpoint: S3Endpoint, s3_bucket: str) -> None:
    client = s3_endpoint.client()
    client.put_object(Bucket=s3_bucket, Key="adapters/a.bin", Body=b"weights-a")
    client.put_object(Bucket=s3_bucket, Key="adapters/b.bin", Body=b"weights-b")

    body = client.get_object(Bucket=s3_bucket, Key="adapters/a.bin")["Body"].read()
    assert body == b"weights-a"

    listed = client.list_objects_v2(Bucket=s3_bucket, Prefix="adapters/")
    assert sorted(o["Key"] for o in listed["Contents"]) == ["adapters/a.bin", "adapters/b.bin"]

    client.delete_object(Bucket=s3_bucket, Key="adapters/a.bin")
    listed = client.list_objects_v2(Bucket=s3_bucket, Prefix="adapters/")
    assert [o["Key"] for o in listed["Contents"]] == ["adapters/b.bin"]


def test_s3_multipart_upload(s3_endpoint: S3Endpoint, s3_bucket: str) -> None:
    client = s3_endpoint.client()
    key = "adapters/big.safetensors"
    parts_data = [b"\x01" * (5 * MIB), b"\x02" * (5 * MIB), b"tail-bytes"]

    upload_id = client.create_multipart_upload(Bucket=s3_bucket, Key=key)["UploadId"]
    parts = []
    for number, data in enumerate(parts_data, start=1):
        response = client.upload_part(
            Bucket=s3_bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data
        )
        parts.append({"PartNumber": number, "ETag": response["ETag"]})
    client.complete_multipart_upload(
        Bucket=s3_bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
    )

    expected = b"".join(parts_data)
    head = client.head_object(Bucket=s3_bucket, Key=key)
    assert head["ContentLength"] == len(expected)
    assert client.get_object(Bucket=s3_bucket, Key=key)["Body"].read() == expected

    listed = client.list_objects_v2(Bucket=s3_bucket)
    assert [(o["Key"], o["Size"]) for o in listed["Contents"]] == [(key, len(expected))]

    client.delete_object(Bucket=s3_bucket, Key=key)
    assert client.list_objects_v2(Bucket=s3_bucket)["KeyCount"] == 0


def test_s3_buckets_are_unique(s3_endpoint: S3Endpoint, s3_bucket: str) -> None:
    names = [b["Name"] for b in s3_endpoint.client().list_buckets()["Buckets"]]
    assert names.count(s3_bucket) == 1
