"""Fixtures for the object store tests: one contract suite over every backend.

``backend`` is parametrized over ``local`` (a directory under tmp_path) and ``s3`` (a fresh
moto bucket); it yields a :class:`~tests.platform.store.factories.Backend`, the store plus
raw access to what it keeps.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from loramux.platform.store import LocalObjectStore
from tests.fixtures.services import S3Endpoint
from tests.platform.store.factories import Backend, empty_and_delete_bucket, s3_store


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "local":
        root = tmp_path / "store"
        yield Backend("local", LocalObjectStore(root), root)
        return
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    yield Backend("s3", s3_store(endpoint, bucket), endpoint.client(), bucket)


_MOTO_CHILD = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print("%s:%d" % server.get_host_and_port(), flush=True)
sys.stdin.read()  # until the parent closes our stdin
server.stop()
"""


@pytest.fixture(scope="session")
def remote_s3_endpoint(request: pytest.FixtureRequest) -> Iterator[S3Endpoint]:
    """An S3 endpoint served by another process, so tracemalloc sees only the client's memory.

    The shared ``s3_endpoint`` runs moto inside the test process, where the server's own
    buffers (it joins multipart parts in memory) would count against the client. With
    ``LORAMUX_TEST_S3_ENDPOINT`` set that endpoint is already remote and is used as is.
    """
    if os.environ.get("LORAMUX_TEST_S3_ENDPOINT"):
        yield request.getfixturevalue("s3_endpoint")
        return
    child = subprocess.Popen(
        [sys.executable, "-c", _MOTO_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        ready, _, _ = select.select([child.stdout], [], [], 30.0)
        address = child.stdout.readline().strip() if ready else ""
        if not address:
            pytest.fail("moto server subprocess did not report its address in 30 s", pytrace=False)
        yield S3Endpoint(f"http://{address}", "test", "test")
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=10)


@pytest.fixture(params=["local", "s3"])
def remote_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Like ``backend``, with S3 on :func:`remote_s3_endpoint` (for memory measurements)."""
    if request.param == "local":
        root = tmp_path / "store"
        yield Backend("local", LocalObjectStore(root), root)
        return
    endpoint = request.getfixturevalue("remote_s3_endpoint")
    client = endpoint.client()
    bucket = f"loramux-mem-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    try:
        yield Backend("s3", s3_store(endpoint, bucket), client, bucket)
    finally:
        empty_and_delete_bucket(client, bucket)
