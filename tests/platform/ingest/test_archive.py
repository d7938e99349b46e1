"""Unpacking uploaded archives: hostile ones are refused and leave nothing behind."""

from __future__ import annotations

import io
import os
import pickle
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from loramux.platform.ingest import UploadRejected, unpack_adapter_archive, validate_adapter_dir
from tests.platform.ingest.builders import (
    Member,
    adapter_members,
    adapter_zip_members,
    malicious_pickle,
    write_tar,
    write_zip,
)
from tests.platform.ingest.conftest import GOOD_RANK, GOOD_TARGETS

MB = 1 << 20
LIMIT = 10 * MB


def refuse(archive: Path, match: str, **limits) -> UploadRejected:
    """Unpack ``archive`` into a fresh folder, expect a refusal, check nothing is left."""
    dest = archive.parent / "unpacked"
    limits.setdefault("max_total_bytes", LIMIT)
    with pytest.raises(UploadRejected, match=match) as caught:
        unpack_adapter_archive(archive, dest, **limits)
    assert not dest.exists(), f"left behind: {list(dest.rglob('*'))}"
    assert sorted(p.name for p in archive.parent.iterdir()) == [archive.name]
    return caught.value


# --- hostile tar archives --------------------------------------------------------------------


def test_tar_parent_traversal(tmp_path, good_adapter):
    members = [*adapter_members(good_adapter), Member("../evil", b"owned")]
    refuse(write_tar(tmp_path / "up.tar.gz", members), r"'\.\./evil'.*outside")
    assert not (tmp_path.parent / "evil").exists()


def test_tar_traversal_hidden_inside_a_folder(tmp_path, good_adapter):
    members = [Member("adapter/../../evil", b"owned"), *adapter_members(good_adapter)]
    refuse(write_tar(tmp_path / "up.tar.gz", members), r"outside")


def test_tar_absolute_path(tmp_path, good_adapter):
    members = [*adapter_members(good_adapter), Member("/tmp/loramux-evil", b"owned")]
    refuse(write_tar(tmp_path / "up.tar.gz", members), r"'/tmp/loramux-evil'.*absolute path")


def test_tar_symlink(tmp_path, good_adapter):
    link = Member("README.md", type=tarfile.SYMTYPE, linkname="/etc/passwd")
    refuse(write_tar(tmp_path / "up.tar.gz", [link, *adapter_members(good_adapter)]), r"is a link")


def test_tar_hardlink(tmp_path, good_adapter):
    link = Member("README.md", type=tarfile.LNKTYPE, linkname="/etc/shadow")
    refuse(write_tar(tmp_path / "up.tar.gz", [*adapter_members(good_adapter), link]), r"is a link")


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_tar_device_or_fifo(tmp_path, good_adapter, kind):
    special = Member("README.md", type=kind)
    refuse(write_tar(tmp_path / "up.tar.gz", [special, *adapter_members(good_adapter)]), "fifo")


def test_tar_bomb_is_refused_while_streaming(tmp_path, good_adapter):
    bomb = Member("README.md", zeros=50 * MB)
    archive = write_tar(tmp_path / "up.tar.gz", [*adapter_members(good_adapter), bomb])
    assert archive.stat().st_size < MB
    refuse(archive, r"decompression bomb")


def test_tar_too_many_members(tmp_path, good_adapter):
    members = [*adapter_members(good_adapter), Member("README.md", b"# hi")]
    refuse(write_tar(tmp_path / "up.tar.gz", members), r"more than 2 members", max_members=2)


def test_tar_nested_archive_by_name(tmp_path, good_adapter):
    inner = write_tar(tmp_path / "inner.tar.gz", adapter_members(good_adapter))
    data = inner.read_bytes()
    inner.unlink()
    members = [*adapter_members(good_adapter), Member("weights.tar.gz", data)]
    refuse(write_tar(tmp_path / "up.tar.gz", members), r"'weights.tar.gz' is a nested archive")


def test_tar_nested_archive_by_magic_bytes(tmp_path, good_adapter):
    inner = write_zip(tmp_path / "inner.zip", adapter_zip_members(good_adapter))
    data = inner.read_bytes()
    inner.unlink()
    config = (good_adapter / "adapter_config.json").read_bytes()
    members = [Member("adapter_config.json", config), Member("adapter_model.safetensors", data)]
    refuse(write_tar(tmp_path / "up.tar.gz", members), r"safetensors' is a nested archive")


@pytest.mark.parametrize("name", ["adapter_model.bin", "adapter/pytorch_model.pt", "x.pkl"])
def test_pickle_in_archive_is_refused_unopened(tmp_path, good_adapter, monkeypatch, name):
    def no_unpickling(*args, **kwargs):
        raise AssertionError("something tried to unpickle the upload")

    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    monkeypatch.setattr(pickle, "Unpickler", no_unpickling)
    marker = tmp_path.parent / f"{tmp_path.name}-pwned"
    payload = malicious_pickle(marker)
    folder = "adapter" if "/" in name else ""
    members = [*adapter_members(good_adapter, folder), Member(name, payload)]
    archive = write_tar(tmp_path / "up.tar.gz", members)
    refuse(archive, rf"'{name}' is a pickle file and is refused unopened")
    assert not marker.exists()
    # The payload is real: unpickling it does create the marker.
    monkeypatch.undo()
    pickle.loads(payload)
    assert marker.exists()
    marker.unlink()


def test_unexpected_file(tmp_path, good_adapter):
    members = [*adapter_members(good_adapter), Member("run.sh", b"rm -rf /")]
    refuse(write_tar(tmp_path / "up.tar.gz", members), r"'run.sh' is not expected")


def test_files_in_two_folders(tmp_path, good_adapter):
    members = adapter_members(good_adapter, "a")
    members[1].name = "b/adapter_model.safetensors"
    refuse(write_tar(tmp_path / "up.tar.gz", members), r"one folder")


def test_nested_folder(tmp_path, good_adapter):
    members = adapter_members(good_adapter, "a/b")
    refuse(write_tar(tmp_path / "up.tar.gz", members), r"nested folder")


def test_duplicate_member(tmp_path, good_adapter):
    members = [*adapter_members(good_adapter), *adapter_members(good_adapter)]
    refuse(write_tar(tmp_path / "up.tar.gz", members), r"appears twice")


def test_archive_without_weights(tmp_path, good_adapter):
    members = adapter_members(good_adapter)[:1]
    refuse(write_tar(tmp_path / "up.tar.gz", members), r"no adapter_model.safetensors")


def test_text_file_named_tar_gz(tmp_path):
    archive = tmp_path / "up.tar.gz"
    archive.write_text("this is a text file, not an archive\n" * 40)
    refuse(archive, r"not a \.tar\.gz or \.zip archive")


def test_gzip_that_is_not_a_tar(tmp_path):
    import gzip

    archive = tmp_path / "up.tgz"
    archive.write_bytes(gzip.compress(b"just some text, no tar headers\n" * 40))
    refuse(archive, r"not a valid tar archive")


def test_truncated_tar_gz(tmp_path, good_adapter):
    archive = write_tar(tmp_path / "up.tar.gz", adapter_members(good_adapter))
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    refuse(archive, r"not a valid tar archive")


def test_unsupported_compression(tmp_path, good_adapter):
    import bz2

    plain = write_tar(tmp_path / "plain.tar", adapter_members(good_adapter), gz=False)
    data = bz2.compress(plain.read_bytes())
    plain.unlink()
    archive = tmp_path / "up.tar.gz"
    archive.write_bytes(data)
    refuse(archive, r"bzip2 archives are not supported")


def test_total_size_limit_counts_real_bytes(tmp_path, good_adapter):
    noise = Member("README.md", os.urandom(2 * MB))  # incompressible: no bomb, just too big
    archive = write_tar(tmp_path / "up.tar.gz", [*adapter_members(good_adapter), noise])
    refuse(archive, r"size limit of 1048576 bytes", max_total_bytes=MB)


def test_tar_header_bomb_is_metered(tmp_path, good_adapter):
    """A pax header claiming 50 MB: tarfile would read it into memory, the meter stops it."""
    bomb = Member("pax", type=tarfile.XHDTYPE, zeros=50 * MB)
    archive = write_tar(tmp_path / "up.tar.gz", [bomb, *adapter_members(good_adapter)])
    refuse(archive, r"decompression bomb|size limit")


def test_refusal_leaves_existing_empty_dest_empty(tmp_path, good_adapter):
    dest = tmp_path / "dest"
    dest.mkdir()
    archive = write_tar(
        tmp_path / "up.tar.gz", [*adapter_members(good_adapter), Member("../evil", b"x")]
    )
    with pytest.raises(UploadRejected):
        unpack_adapter_archive(archive, dest, max_total_bytes=LIMIT)
    assert dest.is_dir() and list(dest.iterdir()) == []


# --- hostile zip archives --------------------------------------------------------------------


def test_zip_parent_traversal(tmp_path, good_adapter):
    members = {**adapter_zip_members(good_adapter), "../evil": b"owned"}
    refuse(write_zip(tmp_path / "up.zip", members), r"'\.\./evil'.*outside")


def test_zip_backslash_traversal(tmp_path, good_adapter):
    members = {**adapter_zip_members(good_adapter), "..\\..\\evil": b"owned"}
    refuse(write_zip(tmp_path / "up.zip", members), r"outside")


def test_zip_symlink(tmp_path, good_adapter):
    archive = write_zip(tmp_path / "up.zip", adapter_zip_members(good_adapter))
    with zipfile.ZipFile(archive, "a") as zf:
        info = zipfile.ZipInfo("README.md")
        info.create_system = 3
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(info, "/etc/passwd")
    refuse(archive, r"'README.md' is a link")


def test_zip_bomb(tmp_path, good_adapter):
    members = {**adapter_zip_members(good_adapter), "README.md": 50 * MB}
    archive = write_zip(tmp_path / "up.zip", members)
    assert archive.stat().st_size < MB
    refuse(archive, r"decompression bomb")


def test_zip_too_many_members(tmp_path, good_adapter):
    members = {**adapter_zip_members(good_adapter)}
    members.update({f"notes/{i}.md": b"x" for i in range(20)})
    refuse(write_zip(tmp_path / "up.zip", members), r"22 members, more than the 16 allowed")


def test_zip_nested_archive(tmp_path, good_adapter):
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as zf:
        zf.writestr("adapter_model.bin", b"x")
    members = {**adapter_zip_members(good_adapter), "inner.zip": inner.getvalue()}
    refuse(write_zip(tmp_path / "up.zip", members), r"'inner.zip' is a nested archive")


def test_zip_pickle_member(tmp_path, good_adapter):
    marker = tmp_path.parent / f"{tmp_path.name}-zip-pwned"
    members = {**adapter_zip_members(good_adapter), "adapter_model.bin": malicious_pickle(marker)}
    refuse(write_zip(tmp_path / "up.zip", members), r"pickle file and is refused unopened")
    assert not marker.exists()


# --- honest archives -------------------------------------------------------------------------


def _check_unpacked(folder: Path, good_adapter: Path, model_config) -> None:
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    info = validate_adapter_dir(
        folder, model_config, base_model_id=None, max_rank=64, max_bytes=LIMIT
    )
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (folder / name).read_bytes() == (good_adapter / name).read_bytes()
    assert info.rank == GOOD_RANK
    assert info.target_modules == sorted(GOOD_TARGETS)


def test_tar_gz_with_files_at_top_level(tmp_path, good_adapter, model_config):
    archive = write_tar(tmp_path / "up.tar.gz", adapter_members(good_adapter))
    folder = unpack_adapter_archive(archive, tmp_path / "out", max_total_bytes=LIMIT)
    assert folder == tmp_path / "out"
    _check_unpacked(folder, good_adapter, model_config)


def test_tgz_with_one_top_folder_and_readme(tmp_path, good_adapter, model_config):
    members = [
        Member("./", type=tarfile.DIRTYPE),
        Member("./my-adapter", type=tarfile.DIRTYPE),
        *adapter_members(good_adapter, "./my-adapter"),
        Member("./my-adapter/README.md", b"# my adapter\n"),
        Member("./my-adapter/.gitattributes", b"*.safetensors filter=lfs\n"),
    ]
    archive = write_tar(tmp_path / "upload.bin", members)  # the name does not matter
    folder = unpack_adapter_archive(archive, tmp_path / "out", max_total_bytes=LIMIT)
    _check_unpacked(folder, good_adapter, model_config)


def test_plain_tar(tmp_path, good_adapter, model_config):
    archive = write_tar(tmp_path / "up.tar", adapter_members(good_adapter), gz=False)
    folder = unpack_adapter_archive(archive, tmp_path / "out", max_total_bytes=LIMIT)
    _check_unpacked(folder, good_adapter, model_config)


@pytest.mark.parametrize("folder_name", ["", "adapter"])
def test_zip(tmp_path, good_adapter, model_config, folder_name):
    archive = write_zip(tmp_path / "up.zip", adapter_zip_members(good_adapter, folder_name))
    folder = unpack_adapter_archive(archive, tmp_path / "out", max_total_bytes=LIMIT)
    _check_unpacked(folder, good_adapter, model_config)


def test_dest_must_be_empty(tmp_path, good_adapter):
    archive = write_tar(tmp_path / "up.tar.gz", adapter_members(good_adapter))
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        unpack_adapter_archive(archive, dest, max_total_bytes=LIMIT)
    assert (dest / "keep.txt").read_text() == "mine"
