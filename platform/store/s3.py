"""The S3 object store (any S3-compatible endpoint), through boto3.

How a put works, with memory bounded by one upload part whatever the object's size:

* The key is the content's SHA-256, known only at the end of the stream. Bytes are hashed
  as they arrive and collected in a buffer of at most ``part_size`` (default 8 MiB).
* Content that ends before the buffer overflows (up to ``part_size`` bytes) is sent with one
  ``PutObject`` straight to its final key.
* Longer content is streamed as a multipart upload to a temporary key ``tmp/<uuid>``, one
  ``part_size`` part at a time. Once complete, it is copied server side to its final key
  (skipped when an object of the same size is already there: same key means same content)
  and the temporary object is deleted. The copy is boto3's managed copy: one ``CopyObject``
  up to :data:`COPY_MULTIPART_THRESHOLD`, a parallel multipart copy above (CopyObject stops
  at 5 GiB).
* On any failure (the source raises, ``max_bytes`` is passed, S3 errors) the multipart upload
  is aborted, or the temporary object deleted, before the error propagates. Only a process
  killed mid-put can leave an upload or a ``tmp/`` object behind; a bucket lifecycle rule that
  aborts incomplete multipart uploads and expires ``tmp/`` after a day covers that.

A named put (``put_named``) knows its key from the start: content up to ``part_size`` is one
``PutObject`` to the key, longer content a multipart upload straight to the key (S3 shows
the object only once the upload completes, replacing any object of that name whole); on
failure the upload is aborted, as above.

A multipart upload has at most 10,000 parts, so the largest object is 10,000 × ``part_size``.
Reads stream ``GetObject``'s body through a verifying reader. botocore's connection and
timeout errors become :class:`StoreUnavailable` (the message names the endpoint and bucket);
``NoSuchKey`` / 404 become :class:`ObjectNotFound`.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from boto3.s3.transfer import TransferConfig
from botocore.exceptions import (
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from loramux.platform.store.base import (
    ContentHasher,
    ObjectNotFound,
    ObjectStore,
    Source,
    StoredObject,
    StoreError,
    StoreUnavailable,
    VerifyingReader,
    check_key,
    check_named_key,
    check_sha256,
    iter_chunks,
    sha256_of_key,
)

if TYPE_CHECKING:
    from loramux.platform.settings import Settings

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
DEFAULT_PART_SIZE = 8 * MiB
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
MAX_PART_SIZE = 5 * 1024 * MiB
COPY_MULTIPART_THRESHOLD = 1024 * MiB
"""Objects above this are copied from tmp/ to their key by a parallel multipart copy."""
COPY_PART_SIZE = 256 * MiB
TMP_PREFIX = "tmp/"

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_REFUSED_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}
)
_UNREACHABLE = (
    BotoConnectionError,  # EndpointConnectionError, ConnectTimeoutError, SSLError, proxy errors
    HTTPClientError,  # ReadTimeoutError, ConnectionClosedError, ResponseStreamingError
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)


def make_s3_client(
    *,
    endpoint_url: str | None,
    region: str,
    access_key_id: str | None = None,
    secret_access_key: str | None = None,
    connect_timeout: float = 5.0,
    read_timeout: float = 60.0,
    max_attempts: int = 4,
) -> Any:
    """A boto3 S3 client with path-style addressing, bounded timeouts and standard retries.

    ``endpoint_url`` None means AWS; credentials None means boto3's default chain.
    ``max_attempts`` counts the first try (1: no retries).
    """
    import boto3
    from botocore.config import Config

    config = Config(
        region_name=region,
        s3={"addressing_style": "path"},
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"max_attempts": max_attempts, "mode": "standard"},
    )
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=access_key_id,
        aws_secret_access_key=secret_access_key,
        config=config,
    )


class _S3Reader(VerifyingReader):
    """A verifying reader over a ``GetObject`` body that reports botocore errors as ours."""

    def __init__(
        self, key: str, body: Any, errors: Callable[..., Any], sha256: str | None = None
    ) -> None:
        super().__init__(key, body, sha256)
        self._errors = errors

    def _read_raw(self, size: int) -> bytes:
        with self._errors(self.key):
            return super()._read_raw(size)


class _MultipartUpload:
    """One multipart upload (to a temporary key unless given one): parts in order, then
    complete or discard."""

    def __init__(self, store: S3ObjectStore, key: str | None = None) -> None:
        self._store = store
        self.key = key or f"{TMP_PREFIX}{uuid.uuid4().hex}"
        self._parts: list[dict[str, Any]] = []
        self.completed = False
        with store._errors():
            response = store.client.create_multipart_upload(Bucket=store.bucket, Key=self.key)
        self._upload_id: str = response["UploadId"]

    def add_part(self, data: bytes) -> None:
        number = len(self._parts) + 1
        with self._store._errors():
            response = self._store.client.upload_part(
                Bucket=self._store.bucket,
                Key=self.key,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=data,
            )
        self._parts.append({"PartNumber": number, "ETag": response["ETag"]})

    def complete(self) -> None:
        with self._store._errors():
            self._store.client.complete_multipart_upload(
                Bucket=self._store.bucket,
                Key=self.key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": self._parts},
            )
        self.completed = True

    def discard(self) -> None:
        """Abort the upload, or delete the temporary object once complete; never raises."""
        client, bucket = self._store.client, self._store.bucket
        try:
            if self.completed:
                client.delete_object(Bucket=bucket, Key=self.key)
            else:
                client.abort_multipart_upload(Bucket=bucket, Key=self.key, UploadId=self._upload_id)
        except Exception:
            logger.warning(
                "could not clean up %s in bucket %s at %s (a lifecycle rule will)",
                self.key,
                bucket,
                self._store.endpoint_url,
                exc_info=True,
            )


class S3ObjectStore(ObjectStore):
    """Objects in one S3 bucket, under their content-addressed keys."""

    def __init__(self, bucket: str, client: Any, *, part_size: int = DEFAULT_PART_SIZE) -> None:
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise ValueError(
                f"part_size must be between {MIN_PART_SIZE} and {MAX_PART_SIZE} bytes, "
                f"got {part_size}"
            )
        self.bucket = bucket
        self.client = client
        self.part_size = part_size
        self._copy_config = TransferConfig(
            multipart_threshold=COPY_MULTIPART_THRESHOLD,
            multipart_chunksize=COPY_PART_SIZE,
            max_concurrency=4,
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> S3ObjectStore:
        """The store of ``settings.s3_*`` (endpoint, bucket, region, credentials)."""
        if not settings.s3_bucket:
            raise ValueError("the S3 object store needs LORAMUX_S3_BUCKET")
        secret = settings.s3_secret_access_key
        client = make_s3_client(
            endpoint_url=settings.s3_endpoint_url,
            region=settings.s3_region,
            access_key_id=settings.s3_access_key_id,
            secret_access_key=secret.get_secret_value() if secret is not None else None,
        )
        return cls(settings.s3_bucket, client)

    @property
    def endpoint_url(self) -> str:
        return self.client.meta.endpoint_url

    def __repr__(self) -> str:
        return f"S3ObjectStore(bucket={self.bucket!r}, endpoint={self.endpoint_url!r})"

    # --- error translation -----------------------------------------------------------------

    @contextlib.contextmanager
    def _errors(self, key: str | None = None) -> Iterator[None]:
        """Turn botocore's exceptions inside the block into the store's."""
        try:
            yield
        except ClientError as exc:
            error = self._client_error(exc, key)
            if isinstance(error, StoreUnavailable):
                self.failures += 1
            raise error from exc
        except _UNREACHABLE as exc:
            self.failures += 1
            raise StoreUnavailable(
                f"S3 endpoint {self.endpoint_url} (bucket {self.bucket}) is unavailable: {exc}"
            ) from exc

    def _client_error(self, exc: ClientError, key: str | None) -> StoreError:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        where = f"S3 endpoint {self.endpoint_url} (bucket {self.bucket})"
        if key is not None and code in _NOT_FOUND_CODES:
            return ObjectNotFound(key)
        if code == "NoSuchBucket":
            return StoreUnavailable(f"{where}: the bucket does not exist")
        if code in _REFUSED_CODES or status == 403:
            return StoreUnavailable(f"{where} refused the credentials: {exc}")
        if status >= 500 or code in {"SlowDown", "ServiceUnavailable", "RequestTimeout"}:
            return StoreUnavailable(f"{where} failed: {exc}")
        return StoreError(f"{where}: {exc}")

    # --- writes ----------------------------------------------------------------------------

    def put_stream(self, source: Source, *, max_bytes: int | None = None) -> StoredObject:
        return self._put(source, max_bytes, None)

    def put_named(self, key: str, source: Source, *, max_bytes: int | None = None) -> StoredObject:
        return self._put(source, max_bytes, check_named_key(key))

    def _put(self, source: Source, max_bytes: int | None, name: str | None) -> StoredObject:
        """Stream ``source`` to its content address, or to ``name`` (see the module)."""
        hasher = ContentHasher(max_bytes)
        buffer = bytearray()
        upload: _MultipartUpload | None = None
        try:
            for chunk in iter_chunks(source):  # the source's own errors pass through
                hasher.update(chunk)
                buffer += chunk
                while len(buffer) > self.part_size:  # more follows: this part is not the last
                    if upload is None:
                        upload = _MultipartUpload(self, name)
                    with memoryview(buffer) as view:
                        part = bytes(view[: self.part_size])
                    del buffer[: self.part_size]
                    upload.add_part(part)
                    del part
            stored = hasher.result(name)
            if upload is None:
                with self._errors():
                    self.client.put_object(Bucket=self.bucket, Key=stored.key, Body=bytes(buffer))
                return stored
            if buffer:
                upload.add_part(bytes(buffer))
            buffer = bytearray()
            upload.complete()
            if name is None:  # a named upload completed at its key: nothing to promote
                self._promote(upload.key, stored)
        except BaseException:
            # A completed named upload is the object itself: it stays.
            if upload is not None and not (name is not None and upload.completed):
                upload.discard()
            raise
        return stored

    def _promote(self, tmp_key: str, stored: StoredObject) -> None:
        """Copy the completed temporary object to its final key, then delete it."""
        if not self._has_object_of_size(stored.key, stored.size):
            with self._errors():
                self.client.copy(
                    CopySource={"Bucket": self.bucket, "Key": tmp_key},
                    Bucket=self.bucket,
                    Key=stored.key,
                    Config=self._copy_config,
                )
        with self._errors():
            self.client.delete_object(Bucket=self.bucket, Key=tmp_key)

    def _has_object_of_size(self, key: str, size: int) -> bool:
        try:
            return self.size(key) == size
        except ObjectNotFound:
            return False

    def delete(self, key: str) -> None:
        check_key(key)
        with self._errors(key):
            self.client.delete_object(Bucket=self.bucket, Key=key)

    # --- reads -----------------------------------------------------------------------------

    def _reader(self, key: str, sha256: str | None) -> VerifyingReader:
        with self._errors(key):
            response = self.client.get_object(Bucket=self.bucket, Key=key)
        return _S3Reader(key, response["Body"], self._errors, sha256)

    def open(self, key: str) -> VerifyingReader:
        sha256_of_key(key)
        return self._reader(key, None)

    def open_named(self, key: str, sha256: str) -> VerifyingReader:
        return self._reader(check_named_key(key), check_sha256(sha256))

    def size(self, key: str) -> int:
        check_key(key)
        with self._errors(key):
            response = self.client.head_object(Bucket=self.bucket, Key=key)
        return int(response["ContentLength"])

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectNotFound:
            return False
        return True
