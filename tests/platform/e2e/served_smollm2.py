"""``loramux serve`` on its embedded defaults with SmolLM2, one tenant and one PEFT adapter
uploaded over HTTP: what a tenant has before it points a real client (lm-eval, GuideLLM)
at its adapter. Test modules wrap :func:`serve_with_adapter` in a module-scoped fixture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from tests.platform.e2e.conftest import upload_adapter
from tests.platform.e2e.serve_process import ServeProcess


class QuietServeProcess(ServeProcess):
    """``loramux serve`` whose OpenMP threads sleep while they wait instead of spinning.

    The clients these tests run (lm-eval, GuideLLM, a transformers reference) share the
    machine's cores with the server; libgomp's threads spin while waiting for a partner that
    is not scheduled: on 2 busy cores, 16 greedy steps of SmolLM2 at batch 2 in transformers
    took 25-44 s (16-35 s of CPU) instead of 3.7 s with ``OMP_WAIT_POLICY=PASSIVE``. What
    the server computes is the same either way.
    """

    def _env(self) -> dict[str, str]:
        return {**super()._env(), "OMP_WAIT_POLICY": "PASSIVE"}


@contextlib.contextmanager
def serve_with_adapter(
    root: Path, model_dir: Path, adapter_dir: Path, adapter: str
) -> Iterator[tuple[ServeProcess, str]]:
    """``loramux serve`` on ``model_dir`` (SQLite, local store) under ``root``, with a
    tenant that uploaded ``adapter_dir`` as ``adapter``; yields the server and the
    tenant's API key, and stops the server when the block ends."""
    serve = QuietServeProcess(
        root / "data", root / "system-tmp", root / "serve.log", MODEL=str(model_dir)
    )
    serve.start()
    try:
        headers = serve.tenant_headers()
        upload_adapter(serve.url, headers, adapter, adapter_dir)
        yield serve, headers["Authorization"].removeprefix("Bearer ")
    finally:
        serve.stop()
