"""Final usage records the database could not take (down or restarting): the journal
writes them once it is back, exactly once, and only then settles the request's holds."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import exc as sa_exc

from loramux.platform.services.metering import Meter, database_unavailable
from loramux.platform.services.usage_journal import UsageJournal
from tests.platform.services.test_usage_journal import _event, _rows, _tenant


class FlakyMeter(Meter):
    """A meter whose database is down until ``up`` is set; with ``lost_answer`` the
    write reaches it but the answer is lost (the connection drops after the commit)."""

    def __init__(self, sessions):
        super().__init__(sessions)
        self.up = False
        self.lost_answer = False
        self.tries = 0

    def record(self, event):
        self.tries += 1
        if not self.up:
            raise _connection_refused()
        written = super().record(event)
        if self.lost_answer:
            self.lost_answer = False
            raise _connection_refused()
        return written


def _connection_refused() -> sa_exc.OperationalError:
    return sa_exc.OperationalError("INSERT ...", {}, ConnectionRefusedError("refused"))


def test_waiting_records_are_written_once_the_database_is_back(make_session):
    tenant_id = _tenant(make_session)
    meter = FlakyMeter(make_session)
    journal = UsageJournal(meter)
    settled: list[str] = []
    for request_id in ("req-a", "req-b"):
        event = _event(tenant_id, request_id, 7)
        journal.write_later(event, lambda rid=request_id: settled.append(rid))

    assert asyncio.run(journal.write_unwritten()) == 0  # still down
    assert meter.tries == 1  # stopped at the first failure: one try per tick, not per record
    assert (journal.unwritten, settled, _rows(make_session)) == (2, [], [])

    meter.up, meter.lost_answer = True, True  # req-a gets through, its answer does not
    assert asyncio.run(journal.write_unwritten()) == 0
    assert asyncio.run(journal.write_unwritten()) == 2  # req-a: already final, a no-op
    assert settled == ["req-a", "req-b"]  # holds settled once each, after the write
    rows = _rows(make_session)
    assert [(r.request_id, r.completion_tokens, r.final) for r in rows] == [
        ("req-a", 7, True),
        ("req-b", 7, True),
    ]
    assert journal.unwritten == 0
    assert asyncio.run(journal.write_unwritten()) == 0


def test_a_record_refused_for_good_does_not_hold_up_the_others(make_session):
    tenant_id = _tenant(make_session)
    meter = FlakyMeter(make_session)
    meter.up = True
    journal = UsageJournal(meter)
    settled: list[str] = []
    bad = _event("no-such-tenant", "req-bad", 7)  # its tenant does not exist: never written
    journal.write_later(bad, lambda: settled.append("req-bad"))
    journal.write_later(_event(tenant_id, "req-good", 7), lambda: settled.append("req-good"))
    assert asyncio.run(journal.write_unwritten()) == 1
    assert (journal.unwritten, settled) == (0, ["req-bad", "req-good"])
    assert [row.request_id for row in _rows(make_session)] == ["req-good"]


def test_stopping_tries_the_waiting_records_once_more(make_session):
    tenant_id = _tenant(make_session)
    meter = FlakyMeter(make_session)
    meter.up = True
    journal = UsageJournal(meter)
    journal.write_later(_event(tenant_id, "req-late", 3), lambda: None)
    asyncio.run(journal.stop())
    assert [row.request_id for row in _rows(make_session)] == ["req-late"]


@pytest.mark.parametrize(
    ("error", "unavailable"),
    [
        (_connection_refused(), True),
        (sa_exc.InterfaceError("SELECT 1", {}, Exception("connection closed")), True),
        (sa_exc.DBAPIError("SELECT 1", {}, Exception("x"), connection_invalidated=True), True),
        (sa_exc.TimeoutError("QueuePool limit reached"), True),
        (sa_exc.IntegrityError("INSERT ...", {}, Exception("duplicate key")), False),
        (sa_exc.ProgrammingError("SELEKT", {}, Exception("syntax error")), False),
        (ValueError("not the database"), False),
    ],
)
def test_which_errors_mean_the_database_is_unavailable(error, unavailable):
    assert database_unavailable(error) is unavailable
