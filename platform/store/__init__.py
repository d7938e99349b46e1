"""Adapter object store: content-addressed (or named, for exports), verified, local directory or S3.

``build_store(settings)`` picks the backend; everything else speaks :class:`ObjectStore`
(semantics in :mod:`loramux.platform.store.base`). The S3 backend lives in
:mod:`loramux.platform.store.s3` and is imported only when chosen, so the embedded default
never loads boto3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loramux.platform.store.base import (
    ChecksumMismatch,
    InvalidKey,
    ObjectNotFound,
    ObjectStore,
    ObjectTooLarge,
    StoredObject,
    StoreError,
    StoreUnavailable,
    VerifyingReader,
    check_named_key,
    is_content_key,
    key_for,
    sha256_of_key,
)
from loramux.platform.store.local import LocalObjectStore

if TYPE_CHECKING:
    from loramux.platform.settings import Settings

__all__ = [
    "ChecksumMismatch",
    "InvalidKey",
    "LocalObjectStore",
    "ObjectNotFound",
    "ObjectStore",
    "ObjectTooLarge",
    "StoreError",
    "StoreUnavailable",
    "StoredObject",
    "VerifyingReader",
    "build_store",
    "check_named_key",
    "is_content_key",
    "key_for",
    "sha256_of_key",
]


def build_store(settings: Settings) -> ObjectStore:
    """The object store ``settings`` configure: ``<data_dir>/store`` or the S3 bucket."""
    if settings.store_backend == "s3":
        from loramux.platform.store.s3 import S3ObjectStore

        return S3ObjectStore.from_settings(settings)
    return LocalObjectStore(settings.data_dir / "store")
