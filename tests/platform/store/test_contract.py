"""The object store contract, run on every backend (local directory and S3 on moto)."""

from __future__ import annotations

import hashlib
import io
import tracemalloc

import pytest

from loramux.platform.store import (
    ChecksumMismatch,
    InvalidKey,
    ObjectNotFound,
    ObjectTooLarge,
    StoredObject,
    is_content_key,
    key_for,
)
from tests.platform.store.factories import (
    Backend,
    MiB,
    file_sha256,
    generated_chunks,
    generated_sha256,
)

LARGE = 20 * MiB  # several 8 MiB upload parts on S3


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _stored_keys(backend: Backend) -> list[str]:
    return [name for name in backend.listing() if name.startswith("sha256/")]


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data", [b"", b"x", b"adapter weights" * 1000], ids=["empty", "1B", "15kB"]
)
def test_small_round_trip(backend: Backend, data: bytes) -> None:
    stored = backend.store.put_stream([data[: len(data) // 2], data[len(data) // 2 :]])

    assert stored == StoredObject(key=key_for(_digest(data)), sha256=_digest(data), size=len(data))
    assert backend.store.exists(stored.key)
    assert backend.store.size(stored.key) == len(data)
    with backend.store.open(stored.key) as reader:
        assert reader.read() == data
    assert backend.listing() == [stored.key]
    assert backend.pending_uploads() == []


def test_large_put_streams_with_bounded_memory(remote_backend: Backend) -> None:
    tracemalloc.start()
    try:
        stored = remote_backend.store.put_stream(generated_chunks(LARGE))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert peak < 64 * MiB, f"put held {peak / MiB:.1f} MiB at its peak"
    assert stored.size == LARGE
    assert remote_backend.listing() == [stored.key]


def test_large_round_trip(backend: Backend, tmp_path) -> None:
    stored = backend.store.put_stream(generated_chunks(LARGE))

    expected = generated_sha256(LARGE)
    assert stored == StoredObject(key_for(expected), expected, LARGE)
    assert backend.store.size(stored.key) == LARGE

    dest = tmp_path / "out" / "adapter_model.safetensors"
    assert backend.store.read_to(stored.key, dest) == stored
    assert dest.stat().st_size == LARGE
    assert file_sha256(dest) == expected
    assert sorted(p.name for p in dest.parent.iterdir()) == [dest.name]
    assert backend.listing() == [stored.key]  # no temporary object left
    assert backend.pending_uploads() == []


def test_put_accepts_a_file_object_and_a_path(backend: Backend, tmp_path) -> None:
    data = b"".join(generated_chunks(3 * MiB + 17, seed=3))
    path = tmp_path / "adapter.bin"
    path.write_bytes(data)

    from_stream = backend.store.put_stream(io.BytesIO(data))
    from_path = backend.store.put_file(path)

    assert from_stream == from_path
    assert from_path.sha256 == _digest(data)
    assert backend.raw_bytes(from_path.key) == data


def test_open_reads_in_pieces(backend: Backend) -> None:
    data = bytes(range(256)) * 100
    stored = backend.store.put_stream([data])

    with backend.store.open(stored.key) as reader:
        pieces = [reader.read(1000) for _ in range(26)]
        assert reader.read(1000) == b""

    assert b"".join(pieces) == data


# --- content addressing --------------------------------------------------------------------------


def test_key_is_the_sha256_of_the_content(backend: Backend) -> None:
    stored = backend.store.put_stream([b"hello"])

    digest = _digest(b"hello")
    assert stored.key == f"sha256/{digest[:2]}/{digest}"
    assert stored.sha256 == digest


def test_putting_identical_content_twice_is_idempotent(backend: Backend) -> None:
    first = backend.store.put_stream(generated_chunks(LARGE, seed=1))
    second = backend.store.put_stream(generated_chunks(LARGE, seed=1, chunk_size=3 * MiB + 1))
    small_first = backend.store.put_stream([b"config"])
    small_second = backend.store.put_stream([b"con", b"fig"])

    assert first == second
    assert small_first == small_second
    assert backend.listing() == sorted([first.key, small_first.key])
    assert backend.pending_uploads() == []
    with backend.store.open(first.key) as reader:
        assert hashlib.sha256(reader.read()).hexdigest() == first.sha256


def test_different_content_gets_different_keys(backend: Backend) -> None:
    a = backend.store.put_stream([b"a"])
    b = backend.store.put_stream([b"b"])

    assert a.key != b.key
    assert _stored_keys(backend) == sorted([a.key, b.key])


@pytest.mark.parametrize(
    "key",
    ["../../etc/passwd", "sha256/ab/" + "cd" * 32, "sha256/AB/" + "AB" * 32, "sha256/" + "a" * 64],
)
def test_malformed_keys_are_refused(backend: Backend, key: str) -> None:
    with pytest.raises(InvalidKey):
        backend.store.open(key)
    with pytest.raises(InvalidKey):
        backend.store.exists(key)


# --- size limit -----------------------------------------------------------------------------------


@pytest.mark.parametrize("total", [1000, LARGE], ids=["small", "multipart"])
def test_content_over_max_bytes_is_refused_and_leaves_nothing(backend: Backend, total: int) -> None:
    with pytest.raises(ObjectTooLarge) as caught:
        backend.store.put_stream(
            generated_chunks(total, chunk_size=100 * 1024), max_bytes=total - 1
        )

    assert caught.value.max_bytes == total - 1
    assert backend.listing() == []
    assert backend.pending_uploads() == []


def test_content_of_exactly_max_bytes_is_stored(backend: Backend) -> None:
    stored = backend.store.put_stream([b"12345"], max_bytes=5)

    assert stored.size == 5


def test_put_file_over_max_bytes_is_refused(backend: Backend, tmp_path) -> None:
    path = tmp_path / "big.bin"
    path.write_bytes(b"x" * 100)

    with pytest.raises(ObjectTooLarge):
        backend.store.put_file(path, max_bytes=99)
    assert backend.listing() == []


# --- corruption -----------------------------------------------------------------------------------


def _flip_one_byte(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :]


def test_corruption_is_detected_on_read_to_and_leaves_no_file(backend: Backend, tmp_path) -> None:
    data = b"".join(generated_chunks(2 * MiB, seed=5))
    stored = backend.store.put_stream([data])
    backend.overwrite(stored.key, _flip_one_byte(data))
    dest_dir = tmp_path / "cache"

    with pytest.raises(ChecksumMismatch) as caught:
        backend.store.read_to(stored.key, dest_dir / "adapter_model.safetensors")

    assert caught.value.key == stored.key
    assert caught.value.actual_sha256 != stored.sha256
    assert list(dest_dir.iterdir()) == []


def test_corruption_does_not_touch_an_existing_destination(backend: Backend, tmp_path) -> None:
    stored = backend.store.put_stream([b"good weights"])
    backend.overwrite(stored.key, b"bad weights!")
    dest = tmp_path / "cache" / "adapter.bin"
    dest.parent.mkdir()
    dest.write_bytes(b"previous")

    with pytest.raises(ChecksumMismatch):
        backend.store.read_to(stored.key, dest)

    assert dest.read_bytes() == b"previous"
    assert [p.name for p in dest.parent.iterdir()] == ["adapter.bin"]


def test_corruption_is_detected_by_open_at_the_end(backend: Backend) -> None:
    stored = backend.store.put_stream([b"good weights"])
    backend.overwrite(stored.key, b"good weights, and more")

    with backend.store.open(stored.key) as reader, pytest.raises(ChecksumMismatch):
        reader.read()


# --- missing keys and delete ----------------------------------------------------------------------


def test_missing_key_is_object_not_found(backend: Backend, tmp_path) -> None:
    key = key_for(_digest(b"never stored"))

    assert not backend.store.exists(key)
    with pytest.raises(ObjectNotFound) as caught:
        backend.store.open(key)
    assert caught.value.key == key
    with pytest.raises(ObjectNotFound):
        backend.store.size(key)
    with pytest.raises(ObjectNotFound):
        backend.store.read_to(key, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_delete_removes_the_object(backend: Backend) -> None:
    kept = backend.store.put_stream([b"kept"])
    gone = backend.store.put_stream([b"gone"])

    backend.store.delete(gone.key)

    assert not backend.store.exists(gone.key)
    assert backend.store.exists(kept.key)
    with pytest.raises(ObjectNotFound):
        backend.store.open(gone.key)
    assert _stored_keys(backend) == [kept.key]


def test_delete_of_a_missing_key_is_a_no_op(backend: Backend) -> None:
    backend.store.delete(key_for(_digest(b"never stored")))

    assert backend.listing() == []


def test_put_after_delete_stores_again(backend: Backend) -> None:
    stored = backend.store.put_stream([b"again"])
    backend.store.delete(stored.key)

    assert backend.store.put_stream([b"again"]) == stored
    assert backend.store.exists(stored.key)


# --- named objects ----------------------------------------------------------------------------

NAME = "billing/2026-11-24.by-request.csv"


def _failing_after(chunks, error: Exception):
    """The chunks, then ``error`` (a client whose source breaks mid-put)."""
    yield from chunks
    raise error


@pytest.mark.parametrize("total", [0, 1000, LARGE], ids=["empty", "small", "multipart"])
def test_named_round_trip(backend: Backend, total: int) -> None:
    expected = generated_sha256(total)

    stored = backend.store.put_named(NAME, generated_chunks(total))

    assert stored == StoredObject(key=NAME, sha256=expected, size=total)
    assert backend.store.exists(NAME)
    assert backend.store.size(NAME) == total
    with backend.store.open_named(NAME, stored.sha256) as reader:
        assert hashlib.sha256(reader.read()).hexdigest() == expected
    assert backend.listing() == [NAME]  # no temporary file or object, no content address
    assert backend.pending_uploads() == []


def test_named_put_replaces_whole_and_leaves_the_other_names(backend: Backend) -> None:
    first = backend.store.put_named(NAME, [b"day,requests\r\n", b"2026-11-24,3\r\n"])
    other = backend.store.put_named("billing/2026-11-24.by-request.v2.csv", [b"v2"])

    second = backend.store.put_named(NAME, generated_chunks(LARGE, seed=4))

    assert second.sha256 != first.sha256 and second.size == LARGE
    with backend.store.open_named(NAME, second.sha256) as reader:
        assert hashlib.sha256(reader.read()).hexdigest() == second.sha256
    assert backend.raw_bytes(other.key) == b"v2"
    assert backend.listing() == sorted([NAME, other.key])
    assert backend.pending_uploads() == []


@pytest.mark.parametrize("total", [1000, LARGE], ids=["small", "multipart"])
def test_a_failed_named_put_leaves_nothing_and_keeps_the_old_object(
    backend: Backend, total: int
) -> None:
    old = backend.store.put_named(NAME, [b"the old export"])

    with pytest.raises(RuntimeError, match="source broke"):
        backend.store.put_named(
            NAME, _failing_after(generated_chunks(total), RuntimeError("source broke"))
        )
    with pytest.raises(ObjectTooLarge):
        backend.store.put_named("billing/other.csv", generated_chunks(total), max_bytes=total - 1)

    assert backend.listing() == [NAME]
    assert backend.pending_uploads() == []
    assert backend.raw_bytes(NAME) == b"the old export"
    with backend.store.open_named(NAME, old.sha256) as reader:
        assert reader.read() == b"the old export"


def test_named_reads_verify_against_the_recorded_digest(backend: Backend) -> None:
    stored = backend.store.put_named(NAME, [b"tenant,requests\r\nacme,3\r\n"])

    backend.overwrite(NAME, b"tenant,requests\r\nacme,2\r\n")  # same size, other bytes
    with backend.store.open_named(NAME, stored.sha256) as reader, pytest.raises(ChecksumMismatch):
        reader.read()

    backend.store.put_named(NAME, [b"tenant,requests\r\nacme,3\r\n"])
    wrong = _digest(b"something else")
    with backend.store.open_named(NAME, wrong) as reader, pytest.raises(ChecksumMismatch) as caught:
        reader.read()
    assert caught.value.key == NAME and caught.value.actual_sha256 == stored.sha256


def test_named_objects_are_deleted_and_missing_ones_not_found(backend: Backend) -> None:
    stored = backend.store.put_named(NAME, [b"x"])
    content = backend.store.put_stream([b"x"])  # same bytes: its own, content-addressed object

    backend.store.delete(NAME)

    assert not backend.store.exists(NAME)
    assert backend.listing() == [content.key]
    with pytest.raises(ObjectNotFound):
        backend.store.size(NAME)
    with pytest.raises(ObjectNotFound) as caught:
        backend.store.open_named(NAME, stored.sha256)
    assert caught.value.key == NAME
    backend.store.delete(NAME)  # a missing name: no-op


@pytest.mark.parametrize(
    "name",
    [
        "",
        "/billing/x.csv",
        "../x.csv",
        "billing/../../etc/passwd",
        "billing/./x.csv",
        "billing//x.csv",
        "billing/x.csv/",
        "Billing/X.csv",
        "billing/x y.csv",
        "billing/.hidden",
        "tmp/x.csv",
        "sha256/ab/" + "ab" * 32,
        "billing/" + "x" * 600,
    ],
)
def test_bad_names_are_refused_and_store_nothing(backend: Backend, name: str) -> None:
    with pytest.raises(InvalidKey):
        backend.store.put_named(name, [b"x"])
    with pytest.raises(InvalidKey):
        backend.store.open_named(name, _digest(b"x"))
    if not is_content_key(name):  # a content address is a key, only not a name
        with pytest.raises(InvalidKey):
            backend.store.exists(name)
    assert backend.listing() == []


def test_names_and_content_addresses_keep_their_own_readers(backend: Backend) -> None:
    content = backend.store.put_stream([b"x"])
    backend.store.put_named(NAME, [b"x"])

    with pytest.raises(InvalidKey):
        backend.store.open(NAME)  # a name names no digest: open_named with the recorded one
    with pytest.raises(InvalidKey):
        backend.store.open_named(content.key, content.sha256)
    with pytest.raises(ValueError):
        backend.store.open_named(NAME, "not a digest")
