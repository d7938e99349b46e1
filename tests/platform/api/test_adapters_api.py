"""The tenant adapter API over HTTP on PostgreSQL: upload, versions, list/get/delete, hostile input."""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file
from sqlalchemy import select

from loramux.platform.app import create_app
from loramux.platform.db.models import Adapter, AdapterStatus, AdapterVersion
from loramux.platform.services import adapter_runtime
from tests.fixtures.models import build_tiny_model
from tests.fixtures.polling import eventually
from tests.platform.api.conftest import assert_openai_error
from tests.platform.ingest.builders import (
    Member,
    adapter_members,
    adapter_zip_members,
    malicious_pickle,
    write_tar,
    write_zip,
)

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
RANK = 8
TARGETS = ("q_proj", "v_proj")


@pytest.fixture(scope="module")
def good_adapter(make_adapter, tiny_model_dir) -> Path:
    return make_adapter(tiny_model_dir, rank=RANK, targets=TARGETS, seed=1)


@pytest.fixture(scope="module")
def other_adapter(make_adapter, tiny_model_dir) -> Path:
    return make_adapter(tiny_model_dir, rank=4, targets=("o_proj",), seed=3)


@pytest.fixture(autouse=True)
def private_tmp(tmp_path, monkeypatch) -> Path:
    """Temporary files of the app (and Starlette's spools) go here, so tests can see leftovers.
    (Not ``tmp_path / "tmp"``: that is the data directory's own, holding ``tmp/uploads``.)"""
    folder = tmp_path / "system-tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.fixture
def auth(tenant_key) -> dict[str, str]:
    return tenant_key()


def _files(adapter_dir: Path) -> list[tuple[str, tuple[str, bytes]]]:
    return [("files", (name, (adapter_dir / name).read_bytes())) for name in (CONFIG, WEIGHTS)]


def _upload(client, headers, name: str, files) -> object:
    return client.post("/v1/adapters", data={"name": name}, files=files, headers=headers)


def _archive(path: Path) -> list[tuple[str, tuple[str, bytes]]]:
    return [("files", (path.name, path.read_bytes()))]


def _store_files(context) -> list[Path]:
    root = Path(context.store.root)
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def _rows(context) -> tuple[list, list]:
    with context.sessions() as session:
        return session.scalars(select(Adapter)).all(), session.scalars(select(AdapterVersion)).all()


def _assert_left_nothing(context, private_tmp: Path) -> None:
    adapters, versions = _rows(context)
    assert adapters == [] and versions == []
    assert _store_files(context) == []
    assert list(private_tmp.iterdir()) == []


# --- honest uploads --------------------------------------------------------------------------


def test_upload_two_files_is_ready(client, context, auth, good_adapter, private_tmp):
    response = _upload(client, auth, "support-bot", _files(good_adapter))
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["name"] == "support-bot"
    assert body["status"] == AdapterStatus.READY.value
    assert body["version"] == 1
    assert body["rank"] == RANK
    assert body["target_modules"] == sorted(TARGETS)
    weights = (good_adapter / WEIGHTS).read_bytes()
    assert body["sha256"] == hashlib.sha256(weights).hexdigest()
    assert body["size_bytes"] == len(weights) + (good_adapter / CONFIG).stat().st_size
    assert list(private_tmp.iterdir()) == []  # nothing left in temporary space

    with context.sessions() as session:
        version = session.scalars(select(AdapterVersion)).one()
        assert version.base_model == context.base_model.model_id
        assert context.store.exists(version.weights_store_key)
        assert context.store.exists(version.config_store_key)
        assert (
            version.config_sha256
            == hashlib.sha256((good_adapter / CONFIG).read_bytes()).hexdigest()
        )


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_upload_archive(client, auth, good_adapter, tmp_path, kind):
    if kind == "zip":
        archive = write_zip(tmp_path / "adapter.zip", adapter_zip_members(good_adapter, "out"))
    else:
        archive = write_tar(tmp_path / "adapter.tar.gz", adapter_members(good_adapter, "out"))
    response = _upload(client, auth, f"from-{kind.replace('.', '-')}", _archive(archive))
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["status"] == "ready" and body["rank"] == RANK
    weights = (good_adapter / WEIGHTS).read_bytes()
    assert body["sha256"] == hashlib.sha256(weights).hexdigest()


def test_reupload_makes_a_new_version(client, context, auth, good_adapter, other_adapter):
    first = _upload(client, auth, "bot", _files(good_adapter)).json()
    second = _upload(client, auth, "bot", _files(other_adapter))
    assert second.status_code == 201, second.text
    body = second.json()
    assert body["id"] == first["id"]
    assert body["version"] == 2
    assert body["rank"] == 4 and body["target_modules"] == ["o_proj"]
    got = client.get("/v1/adapters/bot", headers=auth).json()
    assert got["version"] == 2 and got["rank"] == 4
    _, versions = _rows(context)
    assert sorted(v.version for v in versions) == [1, 2]


def test_list_get_delete(client, context, auth, good_adapter, other_adapter):
    assert client.get("/v1/adapters", headers=auth).json() == {"object": "list", "data": []}
    _upload(client, auth, "b-adapter", _files(other_adapter))
    _upload(client, auth, "a-adapter", _files(good_adapter))
    listed = client.get("/v1/adapters", headers=auth).json()["data"]
    assert [a["name"] for a in listed] == ["a-adapter", "b-adapter"]
    assert all(a["status"] == "ready" for a in listed)

    got = client.get("/v1/adapters/a-adapter", headers=auth)
    assert got.status_code == 200 and got.json()["rank"] == RANK

    deleted = client.delete("/v1/adapters/a-adapter", headers=auth)
    assert deleted.status_code == 204, deleted.text
    assert_openai_error(client.get("/v1/adapters/a-adapter", headers=auth), 404)
    assert [a["name"] for a in client.get("/v1/adapters", headers=auth).json()["data"]] == [
        "b-adapter"
    ]
    with context.sessions() as session:  # soft-deleted: usage history keeps the row
        row = session.scalars(select(Adapter).where(Adapter.name == "a-adapter")).one()
        assert row.deleted_at is not None
    # A deleted name can be used again, starting a new adapter.
    again = _upload(client, auth, "a-adapter", _files(good_adapter))
    assert again.status_code == 201 and again.json()["version"] == 1


def test_other_tenants_adapters_are_404(client, auth, tenant_key, good_adapter):
    _upload(client, auth, "private", _files(good_adapter))
    other = tenant_key()
    for response in (
        client.get("/v1/adapters/private", headers=other),
        client.delete("/v1/adapters/private", headers=other),
        client.get("/v1/adapters/unknown", headers=auth),
        client.delete("/v1/adapters/unknown", headers=auth),
    ):
        error = assert_openai_error(response, 404)
        assert error["code"] == "adapter_not_found"
    assert client.get("/v1/adapters", headers=other).json()["data"] == []
    # The owner still has it, and the other tenant may use the same name.
    assert client.get("/v1/adapters/private", headers=auth).status_code == 200
    assert _upload(client, other, "private", _files(good_adapter)).status_code == 201


def test_routes_need_an_api_key(client, admin, good_adapter):
    for headers in ({}, {"Authorization": "Bearer lmx-not-a-key"}, admin):
        assert_openai_error(client.get("/v1/adapters", headers=headers), 401)
        assert_openai_error(client.get("/v1/adapters/x", headers=headers), 401)
        assert_openai_error(client.delete("/v1/adapters/x", headers=headers), 401)
        assert_openai_error(_upload(client, headers, "x", _files(good_adapter)), 401)


def test_uploaded_adapter_loads_into_the_engine(client, context, auth, good_adapter):
    assert _upload(client, auth, "servable", _files(good_adapter)).status_code == 201
    runtime = client.app.state.adapter_runtime
    with context.sessions() as session:
        version = session.scalars(select(AdapterVersion)).one()
    name = client.portal.call(runtime.ensure_loaded, version)
    assert name == version.id
    assert name in client.portal.call(context.engine.list_adapters)
    # Deleting the adapter unloads it from the engine.
    assert client.delete("/v1/adapters/servable", headers=auth).status_code == 204
    assert name not in client.portal.call(context.engine.list_adapters)


def test_a_superseded_version_leaves_the_engine_after_its_grace(
    client, context, auth, good_adapter, other_adapter, monkeypatch
):
    """Each re-upload used to leave the previous version registered in the engine for good
    (the soak counted 38 registrations for 24 reachable versions)."""
    monkeypatch.setattr(adapter_runtime, "SUPERSEDED_GRACE_S", 2.0)
    runtime = client.app.state.adapter_runtime
    versions = []
    for files in (good_adapter, other_adapter):
        assert _upload(client, auth, "bot", _files(files)).status_code == 201
        with context.sessions() as session:
            versions.append(
                session.scalars(
                    select(AdapterVersion).order_by(AdapterVersion.version.desc())
                ).first()
            )
        client.portal.call(runtime.ensure_loaded, versions[-1])
    names = [version.id for version in versions]
    # In its grace period an old version is still registered: a request that resolved it
    # just before the new one was registered still finds it.
    assert set(client.portal.call(context.engine.list_adapters)) == set(names)
    assert client.portal.call(runtime.ensure_loaded, versions[0]) == names[0]
    eventually(
        lambda: client.portal.call(context.engine.list_adapters) == [names[-1]],
        "superseded versions to leave the engine",
        timeout_s=30,
    )


def _two_versions(client, context, auth, first, second) -> list[AdapterVersion]:
    """Versions 1 and 2 of the adapter ``bot``, uploaded from ``first`` then ``second``."""
    for files in (first, second):
        assert _upload(client, auth, "bot", _files(files)).status_code == 201
    with context.sessions() as session:
        return session.scalars(select(AdapterVersion).order_by(AdapterVersion.version)).all()


def test_an_older_version_still_asked_for_stays_and_never_retires_the_newest(
    client, context, auth, good_adapter, other_adapter, monkeypatch
):
    """``name@1`` reaches an older version: while requests keep asking for it, it stays
    registered; registering it does not retire the newest; unasked, it leaves."""
    monkeypatch.setattr(adapter_runtime, "SUPERSEDED_GRACE_S", 1.0)
    runtime = client.app.state.adapter_runtime
    old, new = _two_versions(client, context, auth, good_adapter, other_adapter)
    client.portal.call(runtime.ensure_loaded, new)
    client.portal.call(runtime.ensure_loaded, old)  # as `bot@1` would
    for _ in range(8):  # 2.4 s of requests for the old version: past its grace
        assert client.portal.call(runtime.ensure_loaded, old) == old.id
        time.sleep(0.3)
    assert set(client.portal.call(context.engine.list_adapters)) == {old.id, new.id}
    eventually(
        lambda: client.portal.call(context.engine.list_adapters) == [new.id],
        "the old version to leave once no request asks for it",
        timeout_s=30,
    )


def test_a_pinned_superseded_version_stays_past_its_grace_until_unpinned(
    client, context, auth, good_adapter, other_adapter, monkeypatch
):
    """A tenant pins its version 1 while version 2 is the newest: the pin keeps it
    registered (and on the device) past the superseded versions' grace; unpinned, it
    leaves like any superseded version."""
    monkeypatch.setattr(adapter_runtime, "SUPERSEDED_GRACE_S", 0.5)
    runtime = client.app.state.adapter_runtime
    old, new = _two_versions(client, context, auth, good_adapter, other_adapter)
    client.portal.call(runtime.ensure_loaded, old)
    client.portal.call(runtime.ensure_loaded, new)  # version 1 is retiring now
    client.portal.call(runtime.pin, old)
    time.sleep(1.5)  # three graces
    assert set(client.portal.call(context.engine.list_adapters)) == {old.id, new.id}
    assert client.portal.call(runtime.pin_states) == {old.id: "pinned"}
    client.portal.call(runtime.unpin, old)
    eventually(
        lambda: client.portal.call(context.engine.list_adapters) == [new.id],
        "the unpinned old version to leave",
        timeout_s=30,
    )


# --- hostile and broken uploads --------------------------------------------------------------


@pytest.fixture(scope="module")
def narrow_adapter(make_adapter, tmp_path_factory, tokenizer_dir, tiny_model_dir) -> Path:
    """An adapter from a hidden-32 base, its config claiming the tiny base: wrong shapes."""
    narrow = build_tiny_model(
        tmp_path_factory.mktemp("narrow-llama"), tokenizer_dir, hidden_size=32
    )
    built = make_adapter(narrow, rank=4, targets=TARGETS, seed=2)
    out = tmp_path_factory.mktemp("narrow-adapter")
    config = json.loads((built / CONFIG).read_text())
    config["base_model_name_or_path"] = str(tiny_model_dir)
    (out / CONFIG).write_text(json.dumps(config))
    (out / WEIGHTS).write_bytes((built / WEIGHTS).read_bytes())
    return out


@pytest.fixture(scope="module")
def nan_adapter(good_adapter, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("nan-adapter")
    tensors = load_file(str(good_adapter / WEIGHTS))
    first = sorted(tensors)[0]
    tensors[first] = tensors[first].clone()
    tensors[first].view(-1)[0] = float("nan")
    save_file(tensors, str(out / WEIGHTS))
    (out / CONFIG).write_bytes((good_adapter / CONFIG).read_bytes())
    return out


def _pickle_files(good_adapter, tmp_path):
    marker = tmp_path / "unpickled"
    return [
        ("files", (CONFIG, (good_adapter / CONFIG).read_bytes())),
        ("files", ("adapter_model.bin", malicious_pickle(marker))),
    ], "pickle"


def _traversal_tar(good_adapter, tmp_path):
    members = [*adapter_members(good_adapter), Member("../escape.txt", b"gotcha")]
    return _archive(write_tar(tmp_path / "evil.tar.gz", members)), "outside the archive"


def _wrong_shapes(narrow_adapter, tmp_path):
    return _files(narrow_adapter), "shape"


def _nan(nan_adapter, tmp_path):
    return _files(nan_adapter), "NaN"


def _missing_file(good_adapter, tmp_path):
    return [("files", (CONFIG, (good_adapter / CONFIG).read_bytes()))], WEIGHTS


def _not_an_archive(good_adapter, tmp_path):
    return [("files", ("adapter.tar.gz", b"this is not an archive at all"))], "archive"


HOSTILE = {
    "pickle": ("good_adapter", _pickle_files),
    "traversal": ("good_adapter", _traversal_tar),
    "wrong_shapes": ("narrow_adapter", _wrong_shapes),
    "nan": ("nan_adapter", _nan),
    "missing_file": ("good_adapter", _missing_file),
    "not_an_archive": ("good_adapter", _not_an_archive),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_upload_is_refused_and_leaves_nothing(
    client, context, auth, request, tmp_path, private_tmp, case
):
    fixture, build = HOSTILE[case]
    files, needle = build(request.getfixturevalue(fixture), tmp_path)
    error = assert_openai_error(_upload(client, auth, "evil", files), 422)
    assert needle.lower() in error["message"].lower(), error
    assert not (tmp_path / "unpickled").exists()
    assert not (tmp_path.parent / "escape.txt").exists()
    _assert_left_nothing(context, private_tmp)


def test_failed_reupload_keeps_the_ready_version(
    client, context, auth, good_adapter, nan_adapter, private_tmp
):
    first = _upload(client, auth, "keep", _files(good_adapter)).json()
    assert_openai_error(_upload(client, auth, "keep", _files(nan_adapter)), 422)
    got = client.get("/v1/adapters/keep", headers=auth).json()
    assert got["version"] == 1 and got["status"] == "ready" and got["sha256"] == first["sha256"]
    adapters, versions = _rows(context)
    assert len(adapters) == 1 and [v.version for v in versions] == [1]
    assert list(private_tmp.iterdir()) == []


@pytest.mark.parametrize("name", ["", "-leading-dash", "has space", "a/b", "x" * 65, "ünï"])
def test_bad_name_is_422(client, context, auth, good_adapter, private_tmp, name):
    error = assert_openai_error(_upload(client, auth, name, _files(good_adapter)), 422)
    assert "name" in error["message"]
    _assert_left_nothing(context, private_tmp)


@pytest.fixture
def small_upload_cap(context) -> int:
    """A 4 KiB upload cap; request it before ``client`` so the app is built with it."""
    context.settings = context.settings.model_copy(update={"max_upload_bytes": 4096})
    return 4096


def test_oversize_upload_is_413(small_upload_cap, client, context, auth, good_adapter, private_tmp):
    error = assert_openai_error(_upload(client, auth, "big", _files(good_adapter)), 413)
    assert "too large" in error["message"] and "4096" in error["message"]
    _assert_left_nothing(context, private_tmp)


def test_oversize_chunked_upload_is_413(small_upload_cap, client, context, auth, private_tmp):
    """Without a Content-Length the body is counted as it arrives."""
    boundary = "loramuxboundary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nbig\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="files"; '
            f'filename="{WEIGHTS}"\r\nContent-Type: application/octet-stream\r\n\r\n'
        ).encode()
        + bytes(64 * 1024)
        + f"\r\n--{boundary}--\r\n".encode()
    )

    def chunks():
        for start in range(0, len(body), 1024):
            yield body[start : start + 1024]

    headers = {**auth, "Content-Type": f"multipart/form-data; boundary={boundary}"}
    response = client.post("/v1/adapters", content=chunks(), headers=headers)
    assert_openai_error(response, 413)
    _assert_left_nothing(context, private_tmp)


def test_pickle_is_never_unpickled(client, auth, good_adapter, tmp_path):
    marker = tmp_path / "marker"
    files = [
        ("files", (CONFIG, (good_adapter / CONFIG).read_bytes())),
        ("files", ("adapter_model.pt", malicious_pickle(marker))),
    ]
    assert_openai_error(_upload(client, auth, "pk", files), 422)
    assert not marker.exists()


def test_absurd_lora_alpha_is_422_and_leaves_nothing(
    client, context, auth, good_adapter, private_tmp
):
    """lora_alpha 1e308 was once stored as ready, then failed every tenant's requests."""
    config = json.loads((good_adapter / CONFIG).read_text())
    files = [
        ("files", (CONFIG, json.dumps({**config, "lora_alpha": 1e308}).encode())),
        ("files", (WEIGHTS, (good_adapter / WEIGHTS).read_bytes())),
    ]
    error = assert_openai_error(_upload(client, auth, "overflow", files), 422)
    assert "lora_alpha must be a number above 0 and at most 1000000" in error["message"], error
    _assert_left_nothing(context, private_tmp)


# --- failures that leave nothing behind ------------------------------------------------------


def _scratch(context) -> Path:
    """Where uploads in progress keep their files: the data directory's tmp/uploads."""
    return context.settings.data_dir / "tmp" / "uploads"


def test_an_unwritable_local_store_answers_503_and_leaves_nothing(
    client, context, auth, good_adapter, private_tmp
):
    Path(context.store.root).write_text("a file where the store's directory should be")
    error = assert_openai_error(_upload(client, auth, "unstored", _files(good_adapter)), 503)
    assert error["code"] == "store_unavailable", error
    assert "try again" in error["message"].lower(), error
    assert str(context.store.root) not in error["message"], error
    assert _rows(context) == ([], [])
    assert list(_scratch(context).iterdir()) == []
    assert list(private_tmp.iterdir()) == []


def test_uploads_work_in_the_data_directory_and_clean_up(
    client, context, auth, good_adapter, nan_adapter, private_tmp
):
    assert _upload(client, auth, "kept", _files(good_adapter)).status_code == 201
    assert_openai_error(_upload(client, auth, "refused", _files(nan_adapter)), 422)
    assert _scratch(context).is_dir()  # made by the uploads, and emptied by each
    assert list(_scratch(context).iterdir()) == []
    assert list(private_tmp.iterdir()) == []


def test_the_scratch_folder_is_emptied_at_start_and_nothing_else(context):
    data_dir = context.settings.data_dir
    leftover = _scratch(context) / "upload-killed" / "adapter"
    leftover.mkdir(parents=True)
    (leftover / WEIGHTS).write_bytes(b"half an upload")
    (_scratch(context) / "stray-file").write_text("x")
    others = [data_dir / "tmp" / "not-uploads" / "file", data_dir / "notes.txt"]
    for path in others:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("keep me")

    with TestClient(create_app(context)):
        assert list(_scratch(context).iterdir()) == []
        assert all(path.read_text() == "keep me" for path in others)
