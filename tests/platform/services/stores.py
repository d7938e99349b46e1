"""An object store that fails on demand, for the upload and sweep tests."""

from __future__ import annotations

from loramux.platform.store import ObjectStore, StoredObject, StoreUnavailable, VerifyingReader


class FlakyStore(ObjectStore):
    """Passes every call to ``inner``, except while ``down`` (every call raises
    ``StoreUnavailable``). After ``puts_before_outage`` puts, the next put goes down with
    the store (an outage in the middle of an upload), or with ``blip`` fails alone (the
    store answers again at once)."""

    def __init__(
        self, inner: ObjectStore, *, puts_before_outage: int | None = None, blip: bool = False
    ) -> None:
        self.inner = inner
        self.down = False
        self._puts_left = puts_before_outage
        self._blip = blip

    def _check(self) -> None:
        if self.down:
            raise StoreUnavailable("test store is down")

    def put_stream(self, source, *, max_bytes=None) -> StoredObject:
        if self._puts_left is not None:
            self._puts_left -= 1
            if self._puts_left == -1 and self._blip:
                raise StoreUnavailable("test store failed one put")
            if self._puts_left == -1:
                self.down = True
        self._check()
        return self.inner.put_stream(source, max_bytes=max_bytes)

    def put_named(self, key, source, *, max_bytes=None) -> StoredObject:
        self._check()
        return self.inner.put_named(key, source, max_bytes=max_bytes)

    def open(self, key: str) -> VerifyingReader:
        self._check()
        return self.inner.open(key)

    def open_named(self, key: str, sha256: str) -> VerifyingReader:
        self._check()
        return self.inner.open_named(key, sha256)

    def exists(self, key: str) -> bool:
        self._check()
        return self.inner.exists(key)

    def size(self, key: str) -> int:
        self._check()
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self._check()
        self.inner.delete(key)
