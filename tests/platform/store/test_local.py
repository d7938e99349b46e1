"""Local-directory-only behaviour: atomic writes, clean-up after a failed put, layout."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from loramux.platform.store import InvalidKey, LocalObjectStore, StoreUnavailable, key_for
from tests.platform.store.factories import MiB, generated_chunks


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_constructing_touches_nothing(tmp_path) -> None:
    LocalObjectStore(tmp_path / "store")

    assert not (tmp_path / "store").exists()


def test_objects_live_at_their_key_under_the_root(tmp_path) -> None:
    store = LocalObjectStore(tmp_path / "store")

    stored = store.put_stream([b"weights"])

    assert store.path_of(stored.key) == tmp_path / "store" / stored.key
    assert (tmp_path / "store" / stored.key).read_bytes() == b"weights"


def test_crash_mid_write_leaves_no_file_and_no_temp(tmp_path) -> None:
    root = tmp_path / "store"
    store = LocalObjectStore(root)

    def chunks():
        yield from generated_chunks(3 * MiB)
        raise RuntimeError("upload interrupted")

    with pytest.raises(RuntimeError, match="upload interrupted"):
        store.put_stream(chunks())

    assert _files(root) == []


def test_object_appears_only_when_complete(tmp_path) -> None:
    root = tmp_path / "store"
    store = LocalObjectStore(root)
    seen_during_put: list[list[str]] = []

    def chunks():
        for chunk in generated_chunks(4 * MiB):
            yield chunk
            seen_during_put.append([f for f in _files(root) if f.startswith("sha256/")])

    stored = store.put_stream(chunks())

    assert seen_during_put and all(seen == [] for seen in seen_during_put)
    assert _files(root) == [stored.key]


def test_putting_again_repairs_a_corrupted_copy(tmp_path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    stored = store.put_stream([b"good weights"])
    store.path_of(stored.key).write_bytes(b"bad weights!")

    assert store.put_stream([b"good weights"]) == stored

    with store.open(stored.key) as reader:
        assert reader.read() == b"good weights"


def test_unusable_root_is_store_unavailable_naming_it(tmp_path) -> None:
    root = tmp_path / "not-a-directory"
    root.write_bytes(b"")
    store = LocalObjectStore(root)

    with pytest.raises(StoreUnavailable, match="not-a-directory"):
        store.put_stream([b"weights"])


def test_keys_cannot_escape_the_root(tmp_path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    digest = hashlib.sha256(b"x").hexdigest()

    for key in ("../outside", f"sha256/{digest[:2]}/../{digest}", f"/sha256/{digest[:2]}/{digest}"):
        with pytest.raises(InvalidKey):
            store.path_of(key)
    assert store.path_of(key_for(digest)).is_relative_to(tmp_path / "store")
