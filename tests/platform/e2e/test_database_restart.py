"""A PostgreSQL restart: the test's own server stops while completions run and new ones
arrive, then starts again.

Requests arriving while it is down get a JSON 503 ``database_unavailable`` (never a
plain-text 500), an upload among them, which leaves no file. Requests already running finish for their clients, streamed or not; a
final usage record the database cannot take is kept and written once it is back, exactly
once, and the request's budget hold lasts until then. Service resumes without a platform
restart, every usage row equals what its client received, and nothing stays held.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from loramux.platform.limits import TenantBudget
from loramux.platform.services.upload_workspace import SCRATCH_DIR
from loramux.platform.settings import Settings
from tests.fixtures.polling import eventually
from tests.fixtures.services import RestartablePostgres, private_postgres
from tests.platform.e2e.conftest import Platform, start_platform
from tests.platform.e2e.outage_calls import (
    Call,
    assert_billed_as_delivered,
    start_running,
    usage_rows,
)
from tests.platform.e2e.test_upload_store_outage import ADAPTER_FILES

LONG = 480  # tokens: about 2.5 s of the tiny model, far longer than stopping PostgreSQL takes
JOURNAL_INTERVAL_S = 0.2  # how often waiting records are tried again


@pytest.fixture
def database() -> Iterator[RestartablePostgres]:
    with private_postgres() as server:
        yield server


@pytest.fixture
def platform(tmp_path, tiny_model_dir, database) -> Iterator[Platform]:
    settings = Settings(
        data_dir=tmp_path,
        model=str(tiny_model_dir),
        database_url=database.url,
        usage_journal_interval_s=JOURNAL_INTERVAL_S,
    )
    with start_platform(settings) as running:
        yield running


def test_a_database_restart_answers_503_and_loses_no_usage(
    platform, database, make_adapter, tiny_model_dir
):
    adapter_dir = make_adapter(tiny_model_dir, rank=4, targets=("v_proj",), seed=21)
    files = [("files", (f, (adapter_dir / f).read_bytes())) for f in ADAPTER_FILES]
    budget = TenantBudget(platform.context.rate_limiter)
    tenant = platform.new_tenant(
        requests_per_minute=1000,
        monthly_budget_usd=10.0,
        input_price_per_mtok=1.0,
        output_price_per_mtok=2.0,
    )
    calls: list[Call] = []

    def send(*, stream: bool) -> Call:
        calls.append(Call(platform, tenant, stream=stream).run())
        return calls[-1]

    def served() -> None:
        for stream in (False, True):
            call = send(stream=stream)
            assert call.status == 200 and call.done and call.error is None, call
            assert call.delivered == call.max_tokens

    def refused() -> None:  # a JSON 503 that says what is wrong, whatever the route
        for stream in (False, True):
            call = send(stream=stream)
            assert (call.status, call.content_type) == (503, "application/json"), call
            assert call.error["code"] == "database_unavailable", call
            assert "try again" in call.error["message"], call

    def run_long(*streamed: bool) -> tuple[list[Call], list]:
        running = [Call(platform, tenant, stream=s, max_tokens=LONG) for s in streamed]
        return running, start_running(running)

    def finished(running: list[Call], threads: list) -> None:
        for thread in threads:
            thread.join(timeout=60)
        for call in running:  # the whole answer, whatever the database did meanwhile
            assert call.status == 200 and call.done and call.error is None, call
            assert (call.delivered, call.finish_reason) == (LONG, "length"), call
        calls.extend(running)

    served()

    # --- a restart while a stream and a non-streamed request run ---------------------------------
    running, threads = run_long(True, False)
    database.stop()
    refused()
    database.start()
    assert not any(call.done for call in running), "they ended before the database was back"
    finished(running, threads)
    assert running[1].body["usage"]["completion_tokens"] == LONG  # written at its end

    # --- down while two streams and a non-streamed request end ---------------------------------
    running, threads = run_long(True, True, False)
    database.stop()
    assert not any(call.done for call in running), "they ended before the outage began"
    refused()
    usage = httpx.get(f"{platform.url}/v1/usage", headers=tenant.headers)
    assert usage.status_code == 503 and usage.json()["error"]["code"] == "database_unavailable"
    upload = httpx.post(
        f"{platform.url}/v1/adapters",
        data={"name": "stormy"},
        files=files,
        headers=tenant.headers,
        timeout=60,
    )
    assert upload.status_code == 503 and upload.json()["error"]["code"] == "database_unavailable"
    finished(running, threads)
    assert running[2].body["usage"] is None  # not recorded yet: no numbers to give
    assert budget.held(tenant.id) > 0  # their holds last until their usage is written

    # --- back: the waiting records are written, the same platform serves again ------------------
    database.start()
    waiting = {call.request_id for call in running}

    def written() -> bool:
        return waiting <= {row.request_id for row in usage_rows(platform, tenant) if row.final}

    eventually(written, "the waiting usage records", 30, JOURNAL_INTERVAL_S)
    served()
    assert_billed_as_delivered(platform, tenant, calls)
    assert budget.held(tenant.id) == 0
    # The refused upload left nothing: no adapter, no stored file, no scratch file.
    listed = httpx.get(f"{platform.url}/v1/adapters", headers=tenant.headers)
    assert listed.status_code == 200 and listed.json()["data"] == []
    assert [p for p in platform.context.store.root.rglob("*") if p.is_file()] == []
    assert list((platform.context.settings.data_dir / SCRATCH_DIR).rglob("*")) == []
    delivered = sum(call.delivered for call in calls)
    billed = sum(row.completion_tokens for row in usage_rows(platform, tenant))
    statuses = sorted(call.status for call in calls)
    print(
        f"{len(calls) + 2} requests, statuses {statuses} + 2 x 503 (usage, upload); "
        f"delivered {delivered} tokens, billed {billed}"
    )
