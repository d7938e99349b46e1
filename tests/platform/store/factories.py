"""Factories for the object store tests: generated content and a back door to each backend."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loramux.platform.store import ObjectStore
from loramux.platform.store.s3 import S3ObjectStore, make_s3_client

MiB = 1024 * 1024


@dataclass
class Backend:
    """A store under test and a back door to its storage."""

    name: str
    store: ObjectStore
    raw: Any  # the root Path (local) or the raw boto3 client (s3)
    bucket: str | None = None

    def listing(self) -> list[str]:
        """Every file under the root / object in the bucket, temporary ones included."""
        if self.bucket is None:
            return sorted(
                p.relative_to(self.raw).as_posix() for p in self.raw.rglob("*") if p.is_file()
            )
        paginator = self.raw.get_paginator("list_objects_v2")
        return sorted(
            o["Key"]
            for page in paginator.paginate(Bucket=self.bucket)
            for o in page.get("Contents", [])
        )

    def pending_uploads(self) -> list[str]:
        if self.bucket is None:
            return []
        return [
            u["Key"] for u in self.raw.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])
        ]

    def overwrite(self, key: str, data: bytes) -> None:
        """Replace the stored bytes behind the store's back (simulated corruption)."""
        if self.bucket is None:
            (self.raw / key).write_bytes(data)
        else:
            self.raw.put_object(Bucket=self.bucket, Key=key, Body=data)

    def raw_bytes(self, key: str) -> bytes:
        if self.bucket is None:
            return (self.raw / key).read_bytes()
        return self.raw.get_object(Bucket=self.bucket, Key=key)["Body"].read()


def s3_store(endpoint: Any, bucket: str, **options: Any) -> S3ObjectStore:
    client = make_s3_client(
        endpoint_url=endpoint.endpoint_url,
        region=endpoint.region,
        access_key_id=endpoint.access_key_id,
        secret_access_key=endpoint.secret_access_key,
    )
    return S3ObjectStore(bucket, client, **options)


def empty_and_delete_bucket(client: Any, bucket: str) -> None:
    """Abort pending uploads, delete every object, delete the bucket."""
    for upload in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
        client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if objects:
            client.delete_objects(Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
    client.delete_bucket(Bucket=bucket)


# --- content ----------------------------------------------------------------------------------


def generated_chunks(total: int, *, chunk_size: int = MiB, seed: int = 0) -> Iterator[bytes]:
    """``total`` pseudo-random bytes in ``chunk_size`` pieces, generated as they are asked for.

    The bytes depend only on ``total`` and ``seed``, not on ``chunk_size``.
    """
    rng = random.Random(seed)
    pending = b""
    produced = 0
    while produced < total:
        while len(pending) < chunk_size and produced + len(pending) < total:
            pending += rng.randbytes(64 * 1024)
        chunk = pending[: min(chunk_size, total - produced)]
        pending = pending[len(chunk) :]
        produced += len(chunk)
        yield chunk


def generated_sha256(total: int, *, chunk_size: int = MiB, seed: int = 0) -> str:
    digest = hashlib.sha256()
    for chunk in generated_chunks(total, chunk_size=chunk_size, seed=seed):
        digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(MiB):
            digest.update(chunk)
    return digest.hexdigest()
