"""The data directory and what loramux writes in it are readable by the owner only: a new
directory is 0700, the database, store objects and converted models are owner-only, and an
existing directory open to others is tightened at start, with a log line."""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from loramux.platform.admin_token import load_or_create_admin_token
from loramux.platform.context import build_context
from loramux.platform.data_dir import make_data_dir_private
from loramux.platform.settings import Settings


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _open_to_others(root: Path) -> list[str]:
    paths = [root, *root.rglob("*")]
    return [f"{p} {_mode(p):04o}" for p in paths if not p.is_symlink() and _mode(p) & 0o077]


@pytest.fixture(autouse=True)
def restore_umask() -> Iterator[None]:
    """make_data_dir_private sets the process umask; the rest of the test run keeps its own."""
    previous = os.umask(0o022)
    os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def test_a_new_data_dir_is_private(tmp_path):
    data_dir = tmp_path / "new" / "data"
    logged: list[str] = []
    make_data_dir_private(data_dir, log=logged.append)
    assert _mode(data_dir) == 0o700
    assert logged == []  # nothing to report on a fresh start


def test_what_a_start_writes_is_owner_only(tmp_path, tiny_model_dir):
    data_dir = tmp_path / "data"
    make_data_dir_private(data_dir, log=lambda _: None)
    settings = Settings(data_dir=data_dir, model=str(tiny_model_dir), admin_token=None)
    context = build_context(settings, log=lambda _: None, with_engine=False)
    try:
        stored = context.store.put_stream(io.BytesIO(b"adapter weights"))
        # What a model conversion or an adapter cache writes, made the ordinary way.
        cache = data_dir / "models" / "converted"
        cache.mkdir(parents=True)
        (cache / "model.safetensors").write_bytes(b"weights")
    finally:
        context.sessions.kw["bind"].dispose()
    assert (data_dir / "loramux.db").is_file()
    assert context.store.exists(stored.key)
    assert (data_dir / "admin_token").is_file()
    assert _open_to_others(data_dir) == []


def test_an_existing_open_data_dir_is_tightened_with_a_log_line(tmp_path):
    data_dir = tmp_path / "data"
    (data_dir / "store" / "sha256" / "ab").mkdir(parents=True)
    (data_dir / "models" / "SmolLM2").mkdir(parents=True)
    files = [
        data_dir / "loramux.db",
        data_dir / "store" / "sha256" / "ab" / "abcdef",
        data_dir / "models" / "SmolLM2" / "model.safetensors",
    ]
    for path in files:
        path.write_bytes(b"private")
        path.chmod(0o644)
    for folder in (data_dir, *(p for p in data_dir.rglob("*") if p.is_dir())):
        folder.chmod(0o755)
    outside = tmp_path / "shared.txt"
    outside.write_text("not loramux's")
    outside.chmod(0o644)
    (data_dir / "link-outside").symlink_to(outside)

    logged: list[str] = []
    make_data_dir_private(data_dir, log=logged.append)

    assert _open_to_others(data_dir) == []
    assert _mode(data_dir) == 0o700 and _mode(files[0]) == 0o600
    assert _mode(outside) == 0o644  # a link's target is left alone
    assert len(logged) == 1 and str(data_dir) in logged[0] and "0755" in logged[0], logged
    # The next start finds it private and says nothing.
    make_data_dir_private(data_dir, log=logged.append)
    assert len(logged) == 1


def test_the_umask_makes_later_files_owner_only(tmp_path):
    make_data_dir_private(tmp_path / "data", log=lambda _: None)
    later = tmp_path / "data" / "written-later"
    later.write_text("x")
    assert _mode(later) == 0o600


def test_the_admin_token_creates_a_missing_data_dir_private(tmp_path):
    data_dir = tmp_path / "data"
    token = load_or_create_admin_token(Settings(data_dir=data_dir, admin_token=None))
    assert token.created
    assert _mode(data_dir) == 0o700
    assert _mode(data_dir / "admin_token") == 0o600
