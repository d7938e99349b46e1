"""S3-only behaviour: single PUT vs multipart, clean-up on failure, unreachable endpoints."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
from botocore.exceptions import ClientError, ReadTimeoutError

from loramux.platform.store import (
    ObjectTooLarge,
    StoreError,
    StoreUnavailable,
    key_for,
)
from loramux.platform.store.s3 import MIN_PART_SIZE, S3ObjectStore, make_s3_client
from tests.platform.store.factories import MiB, generated_chunks, s3_store


@pytest.fixture
def store(s3_endpoint: Any, s3_bucket: str) -> S3ObjectStore:
    return s3_store(s3_endpoint, s3_bucket, part_size=MIN_PART_SIZE)


@pytest.fixture
def raw(s3_endpoint: Any) -> Any:
    return s3_endpoint.client()


def _keys(raw: Any, bucket: str) -> list[str]:
    return sorted(o["Key"] for o in raw.list_objects_v2(Bucket=bucket).get("Contents", []))


def _pending_uploads(raw: Any, bucket: str) -> list[dict[str, Any]]:
    return raw.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


class _Counting:
    """Wraps one client method: counts the calls, then delegates (or raises ``fail``)."""

    def __init__(self, method: Any, fail: Exception | None = None) -> None:
        self.method = method
        self.fail = fail
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        return self.method(*args, **kwargs)


def _server_error(operation: str) -> ClientError:
    return ClientError(
        {
            "Error": {"Code": "InternalError", "Message": "boom"},
            "ResponseMetadata": {"HTTPStatusCode": 500},
        },
        operation,
    )


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- single PUT and multipart --------------------------------------------------------------------


def test_content_up_to_one_part_is_a_single_put(store, raw, s3_bucket, monkeypatch) -> None:
    create = _Counting(store.client.create_multipart_upload)
    monkeypatch.setattr(store.client, "create_multipart_upload", create)

    stored = store.put_stream(generated_chunks(MIN_PART_SIZE, chunk_size=MiB))

    assert create.calls == 0
    assert _keys(raw, s3_bucket) == [stored.key]


def test_content_over_one_part_goes_through_a_temporary_key(store, raw, s3_bucket, monkeypatch):
    create = _Counting(store.client.create_multipart_upload)
    monkeypatch.setattr(store.client, "create_multipart_upload", create)

    stored = store.put_stream(generated_chunks(MIN_PART_SIZE + 1, chunk_size=MiB))

    assert create.calls == 1
    assert _keys(raw, s3_bucket) == [stored.key]
    assert _pending_uploads(raw, s3_bucket) == []
    assert raw.head_object(Bucket=s3_bucket, Key=stored.key)["ContentLength"] == MIN_PART_SIZE + 1


def test_putting_stored_large_content_again_skips_the_copy(store, raw, s3_bucket, monkeypatch):
    first = store.put_stream(generated_chunks(12 * MiB))
    copy = _Counting(store.client.copy)
    monkeypatch.setattr(store.client, "copy", copy)

    assert store.put_stream(generated_chunks(12 * MiB)) == first

    assert copy.calls == 0
    assert _keys(raw, s3_bucket) == [first.key]


def test_named_content_over_one_part_is_uploaded_at_its_name_without_a_copy(
    store, raw, s3_bucket, monkeypatch
):
    create = _Counting(store.client.create_multipart_upload)
    copy = _Counting(store.client.copy)
    monkeypatch.setattr(store.client, "create_multipart_upload", create)
    monkeypatch.setattr(store.client, "copy", copy)
    name = "billing/2026-11-01_2026-11-30.by-request.csv"

    stored = store.put_named(name, generated_chunks(2 * MIN_PART_SIZE + 1, chunk_size=MiB))

    assert (create.calls, copy.calls) == (1, 0)
    assert stored.key == name and stored.size == 2 * MIN_PART_SIZE + 1
    assert _keys(raw, s3_bucket) == [name]
    assert _pending_uploads(raw, s3_bucket) == []


def test_a_failing_named_completion_aborts_and_keeps_the_old_object(
    store, raw, s3_bucket, monkeypatch
):
    name = "billing/2026-11-24.by-day.csv"
    store.put_named(name, [b"old"])
    failing = _Counting(None, fail=_server_error("CompleteMultipartUpload"))
    monkeypatch.setattr(store.client, "complete_multipart_upload", failing)

    with pytest.raises(StoreUnavailable):
        store.put_named(name, generated_chunks(2 * MIN_PART_SIZE))

    assert failing.calls == 1
    assert _pending_uploads(raw, s3_bucket) == []
    assert _keys(raw, s3_bucket) == [name]
    assert raw.get_object(Bucket=s3_bucket, Key=name)["Body"].read() == b"old"


# --- clean-up on failure -------------------------------------------------------------------------


def test_source_failing_midway_aborts_the_multipart_upload(store, raw, s3_bucket) -> None:
    def chunks():
        yield from generated_chunks(3 * MIN_PART_SIZE, chunk_size=MiB)
        raise RuntimeError("client went away")

    with pytest.raises(RuntimeError, match="client went away"):
        store.put_stream(chunks())

    assert _pending_uploads(raw, s3_bucket) == []
    assert _keys(raw, s3_bucket) == []


def test_max_bytes_passed_midway_aborts_the_multipart_upload(store, raw, s3_bucket) -> None:
    with pytest.raises(ObjectTooLarge):
        store.put_stream(generated_chunks(4 * MIN_PART_SIZE), max_bytes=3 * MIN_PART_SIZE)

    assert _pending_uploads(raw, s3_bucket) == []
    assert _keys(raw, s3_bucket) == []


def test_failing_part_upload_aborts_the_multipart_upload(store, raw, s3_bucket, monkeypatch):
    real_upload_part = store.client.upload_part
    calls = []

    def upload_part(**kwargs: Any) -> Any:
        calls.append(kwargs["PartNumber"])
        if kwargs["PartNumber"] == 2:
            raise _server_error("UploadPart")
        return real_upload_part(**kwargs)

    monkeypatch.setattr(store.client, "upload_part", upload_part)

    with pytest.raises(StoreUnavailable, match="InternalError"):
        store.put_stream(generated_chunks(3 * MIN_PART_SIZE))

    assert calls == [1, 2]
    assert _pending_uploads(raw, s3_bucket) == []
    assert _keys(raw, s3_bucket) == []


def test_failing_copy_deletes_the_temporary_object(store, raw, s3_bucket, monkeypatch) -> None:
    monkeypatch.setattr(store.client, "copy", _Counting(None, fail=_server_error("CopyObject")))

    with pytest.raises(StoreUnavailable):
        store.put_stream(generated_chunks(2 * MIN_PART_SIZE))

    assert _keys(raw, s3_bucket) == []
    assert _pending_uploads(raw, s3_bucket) == []


# --- errors ------------------------------------------------------------------------------------


def test_unreachable_endpoint_is_store_unavailable_quickly(tmp_path) -> None:
    endpoint_url = f"http://127.0.0.1:{_closed_port()}"
    client = make_s3_client(
        endpoint_url=endpoint_url,
        region="us-east-1",
        access_key_id="test",
        secret_access_key="test",
        connect_timeout=1.0,
        read_timeout=1.0,
        max_attempts=1,
    )
    store = S3ObjectStore("adapters", client)
    key = key_for("0" * 64)
    attempts = {
        "put_stream": lambda: store.put_stream([b"weights"]),
        "open": lambda: store.open(key),
        "read_to": lambda: store.read_to(key, tmp_path / "dest"),
        "exists": lambda: store.exists(key),
        "size": lambda: store.size(key),
        "delete": lambda: store.delete(key),
    }

    started = time.monotonic()
    for name, attempt in attempts.items():
        with pytest.raises(StoreUnavailable) as caught:
            attempt()
        assert endpoint_url in str(caught.value), name
        assert "adapters" in str(caught.value), name

    assert time.monotonic() - started < 10.0
    assert not (tmp_path / "dest").exists()


def test_missing_bucket_is_store_unavailable(s3_endpoint) -> None:
    store = s3_store(s3_endpoint, "no-such-bucket-here")

    with pytest.raises(StoreUnavailable, match=r"no-such-bucket-here.*does not exist"):
        store.put_stream([b"weights"])


def test_connection_lost_mid_read_is_store_unavailable(store, monkeypatch) -> None:
    stored = store.put_stream([b"weights"])

    class _DroppingBody:
        def read(self, size: int = -1) -> bytes:
            raise ReadTimeoutError(endpoint_url=store.endpoint_url)

        def close(self) -> None:
            pass

    monkeypatch.setattr(store.client, "get_object", lambda **_: {"Body": _DroppingBody()})

    with store.open(stored.key) as reader, pytest.raises(StoreUnavailable) as caught:
        reader.read()
    assert store.endpoint_url in str(caught.value)


def test_other_client_errors_are_store_errors(store, monkeypatch) -> None:
    error = ClientError(
        {"Error": {"Code": "InvalidArgument"}, "ResponseMetadata": {"HTTPStatusCode": 400}},
        "PutObject",
    )
    monkeypatch.setattr(store.client, "put_object", _Counting(None, fail=error))

    with pytest.raises(StoreError, match="InvalidArgument") as caught:
        store.put_stream([b"weights"])
    assert not isinstance(caught.value, StoreUnavailable)


@pytest.mark.parametrize("part_size", [MIN_PART_SIZE - 1, 6 * 1024 * 1024 * 1024])
def test_part_size_must_be_one_s3_accepts(part_size: int) -> None:
    with pytest.raises(ValueError, match="part_size"):
        S3ObjectStore("bucket", client=None, part_size=part_size)
