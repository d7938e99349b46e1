"""Tests for engine/lora/source.py: local folders, fetched folders, the bounded disk cache."""

from __future__ import annotations

import shutil
import stat
import threading
import time
from pathlib import Path

import pytest
import torch

from loramux.engine.lora.adapter import CONFIG_FILE, PICKLE_FILE, WEIGHTS_FILE, load_adapter
from loramux.engine.lora.source import (
    ADAPTER_FILES,
    AdapterDiskCache,
    AdapterFetchError,
    CallableSource,
    DiskCachedSource,
    LocalDirectorySource,
)
from loramux.engine.model.config import ModelConfig


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, make_adapter) -> dict[int, Path]:
    """Real PEFT adapters of the tiny model, by rank (different sizes on disk)."""
    return {rank: make_adapter(tiny_model_dir, rank=rank, seed=rank) for rank in (4, 8, 16)}


@pytest.fixture(scope="module")
def model_config(tiny_model_dir) -> ModelConfig:
    return ModelConfig.from_pretrained(tiny_model_dir)


def disk_size(folder: Path) -> int:
    return sum((folder / name).stat().st_size for name in ADAPTER_FILES)


def same_files(a: Path, b: Path) -> bool:
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in ADAPTER_FILES)


def same_weights(a, b) -> bool:
    return a.modules.keys() == b.modules.keys() and all(
        a.modules[m].rank == b.modules[m].rank
        and a.modules[m].scale == b.modules[m].scale
        and all(torch.equal(a.modules[m].a[i], b.modules[m].a[i]) for i in a.modules[m].a)
        and all(torch.equal(a.modules[m].b[i], b.modules[m].b[i]) for i in a.modules[m].b)
        for m in a.modules
    )


class Store:
    """A stand-in object store: copies an adapter folder into dest, counting calls."""

    def __init__(self, src: Path, *, delay: float = 0.0):
        self.src = src
        self.delay = delay
        self.dests: list[Path] = []
        self._lock = threading.Lock()

    @property
    def calls(self) -> int:
        return len(self.dests)

    def fetch(self, dest: Path) -> None:
        with self._lock:
            self.dests.append(dest)
        time.sleep(self.delay)
        for name in ADAPTER_FILES:
            shutil.copyfile(self.src / name, dest / name)

    def source(self, key: str | None, **kwargs) -> CallableSource:
        return CallableSource(
            self.fetch, description=f"store objects {key}/*", cache_key=key, **kwargs
        )


# LocalDirectorySource


def test_local_directory_yields_the_folder_as_is(adapters):
    source = LocalDirectorySource(adapters[4])
    with source.materialize() as folder:
        assert folder == adapters[4]
    assert (adapters[4] / WEIGHTS_FILE).is_file()  # nothing removed afterwards
    assert source.description == str(adapters[4]) and source.cache_key is None


@pytest.mark.parametrize("missing", [CONFIG_FILE, WEIGHTS_FILE])
def test_local_directory_missing_file_is_a_fetch_error_naming_it(adapters, adapter_copy, missing):
    folder = adapter_copy(adapters[4])
    (folder / missing).unlink()
    with (
        pytest.raises(AdapterFetchError, match=missing) as info,
        LocalDirectorySource(folder).materialize(),
    ):
        pytest.fail("a folder without its files was yielded")
    assert str(folder) in str(info.value)


def test_local_directory_missing_folder(tmp_path):
    with (
        pytest.raises(AdapterFetchError, match="does not exist"),
        LocalDirectorySource(tmp_path / "nope").materialize(),
    ):
        pytest.fail("a missing folder was yielded")


def test_local_directory_with_only_a_pickle_says_it_is_refused(adapters, adapter_copy):
    folder = adapter_copy(adapters[4])
    (folder / WEIGHTS_FILE).rename(folder / PICKLE_FILE)  # never opened
    with (
        pytest.raises(AdapterFetchError, match="pickle"),
        LocalDirectorySource(folder).materialize(),
    ):
        pytest.fail("a pickle-only folder was yielded")


# CallableSource


def test_callable_source_fetches_into_a_private_temp_dir_removed_after(
    adapters, model_config, tmp_path
):
    store = Store(adapters[8])
    source = store.source("k8", tmp_root=tmp_path)
    with source.materialize() as folder:
        assert folder == store.dests[0] and folder.parent == tmp_path
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert same_weights(
            load_adapter(folder, model_config), load_adapter(adapters[8], model_config)
        )
    assert not folder.exists() and list(tmp_path.iterdir()) == []
    with source.materialize() as again:  # every block fetches afresh
        assert again != folder
    assert store.calls == 2


def test_callable_source_wraps_fetch_exceptions_and_cleans_up(adapters, tmp_path):
    dests = []

    def fetch(dest: Path) -> None:
        dests.append(dest)
        shutil.copyfile(adapters[4] / CONFIG_FILE, dest / CONFIG_FILE)
        raise ConnectionError("store unreachable")

    source = CallableSource(fetch, description="store objects t1/a1/*", tmp_root=tmp_path)
    with pytest.raises(AdapterFetchError) as info, source.materialize():
        pytest.fail("a failed fetch was yielded")
    message = str(info.value)
    assert "store objects t1/a1/*" in message and "ConnectionError" in message
    assert "store unreachable" in message
    assert isinstance(info.value.__cause__, ConnectionError)
    assert len(dests) == 1 and not dests[0].exists() and list(tmp_path.iterdir()) == []


def test_callable_source_that_writes_too_little_is_a_fetch_error(adapters, tmp_path):
    def fetch(dest: Path) -> None:
        shutil.copyfile(adapters[4] / CONFIG_FILE, dest / CONFIG_FILE)

    source = CallableSource(fetch, description="store objects x/*", tmp_root=tmp_path)
    with pytest.raises(AdapterFetchError, match=WEIGHTS_FILE), source.materialize():
        pytest.fail("a half-fetched folder was yielded")
    assert list(tmp_path.iterdir()) == []


def test_callable_source_lets_the_callers_exceptions_through(adapters, tmp_path):
    source = Store(adapters[4]).source(None, tmp_root=tmp_path)
    with pytest.raises(KeyError, match="caller's own"), source.materialize():
        raise KeyError("caller's own")
    assert list(tmp_path.iterdir()) == []


# DiskCachedSource + AdapterDiskCache


def test_disk_cache_miss_then_hit_fetches_once(adapters, model_config, tmp_path):
    cache = AdapterDiskCache(tmp_path / "cache", max_bytes=10 << 20)
    store = Store(adapters[8])
    source = DiskCachedSource(store.source("sha-8"), cache)
    assert source.cache_key == "sha-8" and source.description == "store objects sha-8/*"
    with source.materialize() as first:
        assert first.is_relative_to(cache.root) and same_files(first, adapters[8])
    with DiskCachedSource(store.source("sha-8"), cache).materialize() as second:
        assert second == first
        assert same_weights(
            load_adapter(second, model_config), load_adapter(adapters[8], model_config)
        )
    assert store.calls == 1 and (cache.misses, cache.hits) == (1, 1)
    assert "sha-8" in cache and len(cache) == 1 and cache.bytes_used == disk_size(adapters[8])


def test_disk_cache_evicts_least_recently_used_by_bytes(adapters, tmp_path):
    sizes = {rank: disk_size(folder) for rank, folder in adapters.items()}
    cache = AdapterDiskCache(tmp_path / "cache", max_bytes=sum(sizes.values()) - 1)
    stores = {rank: Store(folder) for rank, folder in adapters.items()}

    def use(rank: int) -> None:
        with DiskCachedSource(stores[rank].source(f"k{rank}"), cache).materialize():
            pass

    use(4)
    use(8)
    use(4)  # 8 is now the least recently used
    use(16)
    assert "k8" not in cache and "k4" in cache and "k16" in cache
    assert cache.evictions == 1 and cache.bytes_used == sizes[4] + sizes[16]
    use(8)  # refetched; 4 is now the least recently used
    assert "k4" not in cache and "k8" in cache and "k16" in cache
    assert [stores[r].calls for r in (4, 8, 16)] == [1, 2, 1]
    assert cache.bytes_used <= cache.max_bytes and cache.evictions == 2


def test_disk_cache_lru_order_survives_a_restart(adapters, tmp_path):
    sizes = {rank: disk_size(folder) for rank, folder in adapters.items()}
    stores = {rank: Store(folder) for rank, folder in adapters.items()}
    first = AdapterDiskCache(tmp_path / "cache", max_bytes=10 << 20)
    for rank in (4, 8, 4):
        with DiskCachedSource(stores[rank].source(f"k{rank}"), first).materialize():
            pass
    restarted = AdapterDiskCache(tmp_path / "cache", max_bytes=sum(sizes.values()) - 1)
    assert "k4" in restarted and "k8" in restarted
    assert restarted.bytes_used == sizes[4] + sizes[8]
    with DiskCachedSource(stores[16].source("k16"), restarted).materialize():
        pass
    assert "k8" not in restarted and "k4" in restarted  # 4 was used after 8 last run
    assert stores[4].calls == 1


def test_disk_cache_failed_fetch_leaves_no_entry(adapters, tmp_path):
    cache = AdapterDiskCache(tmp_path / "cache", max_bytes=10 << 20)

    def fetch(dest: Path) -> None:
        shutil.copyfile(adapters[4] / CONFIG_FILE, dest / CONFIG_FILE)
        (dest / WEIGHTS_FILE).write_bytes((adapters[4] / WEIGHTS_FILE).read_bytes()[:100])
        raise TimeoutError("connection dropped halfway")

    broken = CallableSource(fetch, description="store objects k4/*", cache_key="k4")
    with (
        pytest.raises(AdapterFetchError, match="connection dropped"),
        DiskCachedSource(broken, cache).materialize(),
    ):
        pytest.fail("a failed fetch was yielded")
    assert "k4" not in cache and len(cache) == 0 and cache.bytes_used == 0
    leftovers = [p for p in cache.root.rglob("*") if p.is_file()]
    assert leftovers == []
    store = Store(adapters[4])
    with DiskCachedSource(store.source("k4"), cache).materialize() as folder:
        assert same_files(folder, adapters[4])
    assert store.calls == 1 and "k4" in cache


def test_disk_cache_never_serves_a_damaged_entry(adapters, tmp_path):
    store = Store(adapters[4])
    cache = AdapterDiskCache(tmp_path / "cache", max_bytes=10 << 20)
    with DiskCachedSource(store.source("k4"), cache).materialize() as folder:
        pass
    (folder / WEIGHTS_FILE).unlink()  # damaged behind the cache's back
    restarted = AdapterDiskCache(tmp_path / "cache", max_bytes=10 << 20)
    assert "k4" not in restarted and not folder.exists()
    with DiskCachedSource(store.source("k4"), restarted).materialize() as again:
        assert same_files(again, adapters[4])
    (again / CONFIG_FILE).unlink()  # and again, while the same cache is running
    with DiskCachedSource(store.source("k4"), restarted).materialize() as third:
        assert same_files(third, adapters[4])
    assert store.calls == 3


def test_disk_cache_concurrent_misses_of_one_key_fetch_once(adapters, tmp_path):
    cache = AdapterDiskCache(tmp_path / "cache", max_bytes=10 << 20)
    store = Store(adapters[16], delay=0.2)
    barrier = threading.Barrier(8)
    seen: list[tuple[Path, bytes]] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait()
            with DiskCachedSource(store.source("k16"), cache).materialize() as folder:
                seen.append((folder, (folder / WEIGHTS_FILE).read_bytes()))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == [] and len(seen) == 8
    assert store.calls == 1 and (cache.misses, cache.hits) == (1, 7)
    assert len({folder for folder, _ in seen}) == 1
    assert all(data == (adapters[16] / WEIGHTS_FILE).read_bytes() for _, data in seen)
    assert len(cache) == 1 and cache.bytes_used == disk_size(adapters[16])


def test_disk_cache_keeps_an_entry_while_it_is_read(adapters, model_config, tmp_path):
    cache = AdapterDiskCache(tmp_path / "cache", max_bytes=disk_size(adapters[16]))
    with DiskCachedSource(Store(adapters[8]).source("k8"), cache).materialize() as held:
        with DiskCachedSource(Store(adapters[16]).source("k16"), cache).materialize():
            assert cache.bytes_used > cache.max_bytes  # over budget only while both are read
        load_adapter(held, model_config)  # still whole
    assert cache.bytes_used <= cache.max_bytes and len(cache) == 1


def test_disk_cache_serves_an_adapter_larger_than_the_budget_uncached(adapters, tmp_path):
    cache = AdapterDiskCache(tmp_path / "cache", max_bytes=disk_size(adapters[4]))
    store = Store(adapters[16])
    for _ in range(2):
        with DiskCachedSource(store.source("k16"), cache).materialize() as folder:
            assert same_files(folder, adapters[16]) and not folder.is_relative_to(cache.root)
    assert store.calls == 2 and len(cache) == 0 and cache.bytes_used == 0


def test_disk_cached_source_needs_a_cache_key(adapters, tmp_path):
    cache = AdapterDiskCache(tmp_path / "cache", max_bytes=1 << 20)
    with pytest.raises(ValueError, match="cache_key"):
        DiskCachedSource(LocalDirectorySource(adapters[4]), cache)


def test_disk_cache_does_nothing_at_construction(tmp_path):
    AdapterDiskCache(tmp_path / "cache", max_bytes=1 << 20)
    assert not (tmp_path / "cache").exists()
    with pytest.raises(ValueError, match="positive"):
        AdapterDiskCache(tmp_path / "cache", max_bytes=0)
