"""A real ``loramux serve`` (SmolLM2, SQLite) killed and stopped under load.

* SIGKILL mid-stream: the usage journal has checkpointed the stream, so after a restart on
  the same data directory the billed tokens are at most those delivered, and short of them
  by at most what arrived in the last checkpoint interval (plus slack for one write).
* SIGTERM with a long stream and a long non-streamed request running: the server stops
  accepting, lets them run for ``LORAMUX_SHUTDOWN_TIMEOUT_S``, then ends both cleanly (the
  stream's last chunk says ``abort`` and ``[DONE]`` follows; the response carries what was
  generated) and exits; each is billed exactly what it delivered.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from loramux.platform.db.models import UsageRecord
from loramux.platform.db.session import create_engine_for, session_factory
from loramux.platform.settings import EMBEDDED_MODEL_ID
from tests.fixtures.browser import free_port
from tests.fixtures.engine_budget import budget_env
from tests.fixtures.models import seed_embedded_model
from tests.fixtures.polling import eventually
from tests.platform.tasks.worker_process import REPO_ROOT

SHUTDOWN_TIMEOUT_S = 2.0
JOURNAL_INTERVAL_S = 1.0
# The journal's bound is one interval plus one checkpoint write; on a busy 2-core machine a
# write and the scheduling around it get a generous second.
LOSS_WINDOW_S = JOURNAL_INTERVAL_S + 1.0
STARTUP_TIMEOUT_S = 120.0
LONG = 2000  # tokens: far more than anything here waits for (SmolLM2 makes ~20 per second)


@pytest.fixture
def data_dir(tmp_path, smollm2_metadata_dir) -> Path:
    """A data directory holding the embedded model's config and tokenizer already (what a
    first start writes): served, as with no settings, from the GGUF's own weights."""
    data = tmp_path / "data"
    seed_embedded_model(data, smollm2_metadata_dir)
    return data


@dataclass
class Serve:
    process: subprocess.Popen
    url: str
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@contextlib.contextmanager
def serving(data_dir: Path, log: Path) -> Iterator[Serve]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAMUX_")}
    env.update(
        budget_env(),
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        LORAMUX_SHUTDOWN_TIMEOUT_S=str(SHUTDOWN_TIMEOUT_S),
        LORAMUX_USAGE_JOURNAL_INTERVAL_S=str(JOURNAL_INTERVAL_S),
    )
    command = [sys.executable, "-m", "loramux.platform.cli", "serve", "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*command, "--data-dir", str(data_dir)],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = Serve(process, f"http://127.0.0.1:{port}", log)
    try:

        def healthy() -> bool:
            assert process.poll() is None, f"loramux serve exited:\n{server.tail()}"
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{server.url}/healthz", timeout=2).status_code == 200
            return False

        eventually(healthy, "loramux serve to answer /healthz", STARTUP_TIMEOUT_S, 0.2)
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def new_tenant_key(server: Serve, data_dir: Path) -> tuple[str, str]:
    admin = {"Authorization": f"Bearer {(data_dir / 'admin_token').read_text().strip()}"}
    body = {"name": "acme", "input_price_per_mtok": 1.0, "output_price_per_mtok": 2.0}
    tenant = httpx.post(f"{server.url}/admin/tenants", json=body, headers=admin)
    assert tenant.status_code == 201, tenant.text
    tenant_id = tenant.json()["id"]
    key = httpx.post(f"{server.url}/admin/tenants/{tenant_id}/api-keys", headers=admin)
    assert key.status_code == 201, key.text
    return tenant_id, key.json()["key"]


@dataclass
class Stream:
    """A streamed completion read in a thread: every token's arrival time, how it ended."""

    url: str
    key: str
    arrivals: list[float] = field(default_factory=list)
    chunks: list[dict] = field(default_factory=list)
    done: bool = False  # [DONE] arrived
    error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": EMBEDDED_MODEL_ID,
            "prompt": "Once upon a time",
            "max_tokens": LONG,
            "stream": True,
            "logprobs": 1,  # every chunk lists its tokens: the client counts what it got
            "ignore_eos": True,
        }
        headers = {"Authorization": f"Bearer {self.key}"}
        try:
            with httpx.stream(
                "POST", f"{self.url}/v1/completions", json=body, headers=headers, timeout=120
            ) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line.removeprefix("data: "))
                        now = time.monotonic()
                        self.chunks.append(chunk)
                        tokens = (
                            chunk["choices"][0]["logprobs"]["tokens"] if chunk["choices"] else []
                        )
                        self.arrivals.extend([now] * len(tokens))
        except httpx.HTTPError as exc:  # the server died under it
            self.error = exc

    @property
    def delivered(self) -> int:
        return len(self.arrivals)


def _started(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def usage_rows(data_dir: Path, tenant_id: str) -> list[UsageRecord]:
    engine = create_engine_for(f"sqlite:///{data_dir / 'loramux.db'}")
    try:
        with session_factory(engine)() as session:
            query = select(UsageRecord).where(UsageRecord.tenant_id == tenant_id)
            return list(session.scalars(query))
    finally:
        engine.dispose()


def test_kill_loses_at_most_one_checkpoint_and_sigterm_ends_requests_in_time(data_dir, tmp_path):
    # --- SIGKILL mid-stream ----------------------------------------------------------------
    with serving(data_dir, tmp_path / "first.log") as server:
        tenant_id, key = new_tenant_key(server, data_dir)
        stream = Stream(server.url, key)
        reader = _started(stream.run)
        eventually(lambda: stream.delivered, "the first tokens", 60, 0.05)
        time.sleep(2.5 * JOURNAL_INTERVAL_S)  # a few checkpoints into the stream
        killed_at = time.monotonic()
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(timeout=30)
        reader.join(timeout=30)
    delivered = stream.delivered
    recent = sum(1 for t in stream.arrivals if t > killed_at - LOSS_WINDOW_S)
    assert stream.error is not None and not stream.done  # cut off, not finished

    with serving(data_dir, tmp_path / "second.log") as server:
        admin = {"Authorization": f"Bearer {(data_dir / 'admin_token').read_text().strip()}"}
        report = httpx.get(
            f"{server.url}/admin/usage",
            params={"tenant_id": tenant_id, "group_by": "request"},
            headers=admin,
        ).json()
        billed = report["totals"]["completion_tokens"]
        print(f"SIGKILL: delivered {delivered}, billed {billed}, bound {recent}")
        assert report["totals"]["requests"] == 1
        assert 0 < billed <= delivered
        assert delivered - billed <= recent

        # --- SIGTERM with a long stream and a long non-streamed request running ----------
        stream = Stream(server.url, key)
        plain: dict = {}

        def non_streamed() -> None:
            body = {"model": EMBEDDED_MODEL_ID, "prompt": "Hello", "max_tokens": LONG}
            body["ignore_eos"] = True
            headers = {"Authorization": f"Bearer {key}"}
            response = httpx.post(
                f"{server.url}/v1/completions", json=body, headers=headers, timeout=120
            )
            plain["status"], plain["body"] = response.status_code, response.json()

        readers = [_started(stream.run), _started(non_streamed)]
        eventually(lambda: stream.delivered >= 5, "the stream to run", 60, 0.05)
        signalled_at = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=SHUTDOWN_TIMEOUT_S + 30)
        exited_after = time.monotonic() - signalled_at
        for reader in readers:
            reader.join(timeout=30)

    print(f"SIGTERM: exited after {exited_after:.1f} s (timeout {SHUTDOWN_TIMEOUT_S} s)")
    assert SHUTDOWN_TIMEOUT_S <= exited_after < SHUTDOWN_TIMEOUT_S + 5, server.tail()
    # both ended the clean way: the stream's final chunk and [DONE], the response in full
    assert stream.error is None and stream.done, server.tail()
    assert stream.chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert plain["status"] == 200, plain
    choice = plain["body"]["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert 0 < plain["body"]["usage"]["completion_tokens"] < LONG

    finals = {row.request_id: row for row in usage_rows(data_dir, tenant_id) if row.final}
    assert len(finals) == 2, finals  # (the killed stream's row stays provisional)
    streamed, answered = finals[stream.chunks[0]["id"]], finals[plain["body"]["id"]]
    assert streamed.completion_tokens == stream.delivered  # billed == delivered
    assert answered.completion_tokens == plain["body"]["usage"]["completion_tokens"]
    assert streamed.finish_reason == answered.finish_reason == "abort"
    # Each request served has its line in `loramux serve`'s log (the base model: no digest).
    logged = (tmp_path / "second.log").read_text(errors="replace")
    assert f"INFO loramux.requests: request {plain['body']['id']} tenant={tenant_id} " in logged
    assert "adapter_version=- sha256=- " in logged and "finish=abort" in logged
