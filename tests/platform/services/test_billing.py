"""Billing export: grouped usage whose totals are exact, on PostgreSQL and SQLite."""

from __future__ import annotations

import csv
import io
import random
import uuid
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta, timezone

import pytest
from sqlalchemy import text

from loramux.platform.api.openai.render import openai_usage
from loramux.platform.db.models import UsageRecord
from loramux.platform.services.billing import (
    GROUP_BYS,
    KEY_COLUMNS,
    METRICS,
    UsageReport,
    format_cell,
    to_csv,
    usage_report,
)
from loramux.platform.services.metering import Meter, Usage, UsageEvent
from tests.platform.db.factories import add_adapter, add_adapter_version, add_price, add_tenant

DAY0 = datetime(2031, 5, 1, tzinfo=UTC)
DAYS = 10
ZERO = dict.fromkeys(METRICS, 0)


def _record(make_session, tenant_id: str, created_at: datetime, **fields) -> UsageRecord:
    event = UsageEvent(
        request_id=f"req-{uuid.uuid4().hex}",
        tenant_id=tenant_id,
        model=fields.pop("model", "base"),
        prompt_tokens=fields.pop("prompt_tokens", 100),
        completion_tokens=fields.pop("completion_tokens", 10),
        created_at=created_at,
        **fields,
    )
    record = Meter(make_session).record(event)
    assert record is not None
    return record


def _report(make_session, **filters) -> UsageReport:
    with make_session() as session:
        return usage_report(session, **filters)


def _parse_csv(body: str) -> tuple[list[str], list[dict[str, str]]]:
    reader = csv.reader(io.StringIO(body, newline=""))
    header, *lines = list(reader)
    return header, [dict(zip(header, line, strict=True)) for line in lines]


# --------------------------------------------------------------------------------------------
# The property: over any period, rows, totals, CSV and the clients' usage all agree exactly.
# --------------------------------------------------------------------------------------------


def _populate(make_session, rng: random.Random) -> tuple[list[UsageRecord], dict[str, str]]:
    """~300 records over 3 tenants, 4 adapters and the base model, over 10 days.

    Prices change mid-period; token counts range from 1 to tens of millions; each adapter
    has two versions, and a record names one. Returns the stored records and, by id, each
    adapter's name and each version's (number, sha256).
    """
    with make_session.begin() as session:
        tenants = [add_tenant(session) for _ in range(3)]
        for index, tenant in enumerate(tenants):
            add_price(session, tenant, DAY0 - timedelta(days=1), 1_000_000 + index, 500_000, 3)
            add_price(session, tenant, DAY0 + timedelta(days=4, hours=index), 777_777, 1, 9_999_999)
        adapters = [
            add_adapter(session, tenants[0], name="alpha"),
            add_adapter(session, tenants[0], name="beta"),
            add_adapter(session, tenants[1], name="alpha"),  # same name, other tenant
            add_adapter(session, tenants[1], name="gamma"),
        ]
        choices = {
            tenant.id: [None, *(a for a in adapters if a.tenant_id == tenant.id)]
            for tenant in tenants
        }
        versions = {
            adapter.id: [
                add_adapter_version(session, adapter, number, sha256=uuid.uuid4().hex * 2)
                for number in (1, 2)
            ]
            for adapter in adapters
        }
        names = {adapter.id: adapter.name for adapter in adapters}
        names |= {v.id: (v.version, v.sha256) for vs in versions.values() for v in vs}

    records = []
    for _ in range(300):
        tenant_id = rng.choice(list(choices))
        adapter = rng.choice(choices[tenant_id])
        # Some records exactly on a midnight, the rest anywhere in the 10 days.
        if rng.random() < 0.1:
            created_at = DAY0 + timedelta(days=rng.randrange(DAYS))
        else:
            created_at = DAY0 + timedelta(microseconds=rng.randrange(DAYS * 86_400 * 10**6))
        prompt = rng.choice([1, rng.randrange(1, 5_000), rng.randrange(1, 30_000_000)])
        records.append(
            _record(
                make_session,
                tenant_id,
                created_at,
                adapter_id=adapter.id if adapter else None,
                adapter_version_id=rng.choice(versions[adapter.id]).id if adapter else None,
                model=adapter.name if adapter else "base",
                prompt_tokens=prompt,
                cached_prompt_tokens=rng.randrange(prompt + 1),
                completion_tokens=rng.choice([1, rng.randrange(1, 2_000_000)]),
                latency_ms=rng.randrange(0, 60_000),
                finish_reason=rng.choice(["stop", "length", "abort", None]),
                end_user=rng.choice([None, "user-1", "user-2"]),
            )
        )
    return records, names


def _random_instant(rng: random.Random, records: list[UsageRecord]) -> datetime | None:
    kind = rng.randrange(4)
    if kind == 0:
        return None
    if kind == 1:  # exactly a record's moment: tests inclusive start / exclusive end
        return rng.choice(records).created_at
    if kind == 2:  # a midnight, possibly outside the data
        return DAY0 + timedelta(days=rng.randrange(-1, DAYS + 2))
    return DAY0 + timedelta(seconds=rng.randrange(-86_400, (DAYS + 1) * 86_400))


def _key_of(group_by: str, names: dict) -> Callable[[UsageRecord], tuple]:
    def key(record: UsageRecord) -> tuple:
        adapter = names.get(record.adapter_id)
        version = names.get(record.adapter_version_id, (None, None))
        if group_by == "day":
            return (record.tenant_id, record.created_at.astimezone(UTC).date())
        if group_by == "adapter":
            return (record.tenant_id, adapter)
        return (
            record.tenant_id,
            record.request_id,
            record.created_at,
            record.model,
            adapter,
            *version,
            record.end_user,
            record.finish_reason,
            record.latency_ms,
        )

    return key


def _metrics_of(records: list[UsageRecord]) -> dict[str, int]:
    return {
        "requests": len(records),
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in records),
        "completion_tokens": sum(r.completion_tokens for r in records),
        "cost_micro_usd": sum(r.cost_micro_usd for r in records),
    }


def _expected_rows(group_by: str, selected: list[UsageRecord], names) -> list[dict]:
    groups: dict[tuple, list[UsageRecord]] = defaultdict(list)
    for record in selected:
        groups[_key_of(group_by, names)(record)].append(record)
    return [
        {**dict(zip(KEY_COLUMNS[group_by], key, strict=True)), **_metrics_of(members)}
        for key, members in groups.items()
    ]


def _sort_key(row: dict) -> tuple:
    return tuple((value is not None, str(value)) for value in row.values())


def _check_csv(report: UsageReport) -> None:
    header, lines = _parse_csv(to_csv(report))
    assert tuple(header) == report.columns
    assert len(lines) == len(report.rows)
    for line, row in zip(lines, report.rows, strict=True):
        for name in METRICS:
            assert int(line[name]) == row[name]
        for name in KEY_COLUMNS[report.group_by]:
            assert line[name] == format_cell(row[name])


def test_totals_are_exact_over_any_period_and_grouping(make_session):
    rng = random.Random(20310501)
    records, names = _populate(make_session, rng)
    tenant_ids = sorted({record.tenant_id for record in records})

    for _ in range(20):
        tenant_id = rng.choice([None, *tenant_ids])
        start, end = _random_instant(rng, records), _random_instant(rng, records)
        if start is not None and end is not None and start > end:
            start, end = end, start
        selected = [
            record
            for record in records
            if (tenant_id is None or record.tenant_id == tenant_id)
            and (start is None or record.created_at >= start)
            and (end is None or record.created_at < end)
        ]
        # What the API returned to clients for those requests, summed.
        client_cost = sum(openai_usage(Usage.of(record))["cost_micro_usd"] for record in selected)
        client_tokens = sum(openai_usage(Usage.of(record))["total_tokens"] for record in selected)

        for group_by in GROUP_BYS:
            report = _report(
                make_session, tenant_id=tenant_id, start=start, end=end, group_by=group_by
            )
            assert report.totals == _metrics_of(selected)
            assert {name: sum(row[name] for row in report.rows) for name in METRICS} == (
                report.totals
            )
            assert report.totals["cost_micro_usd"] == client_cost
            totals = report.totals
            assert totals["prompt_tokens"] + totals["completion_tokens"] == client_tokens
            assert sorted(report.rows, key=_sort_key) == sorted(
                _expected_rows(group_by, selected, names), key=_sort_key
            )
            assert all(tuple(row) == report.columns for row in report.rows)
            _check_csv(report)


# --------------------------------------------------------------------------------------------
# Grouping, ordering and period details.
# --------------------------------------------------------------------------------------------


def test_days_are_utc_and_the_period_is_start_inclusive_end_exclusive(make_session):
    with make_session.begin() as session:
        tenant_id = add_tenant(session).id
    midnight = datetime(2031, 1, 2, tzinfo=UTC)
    tokyo = timezone(timedelta(hours=9))
    _record(make_session, tenant_id, midnight - timedelta(microseconds=1), completion_tokens=1)
    _record(make_session, tenant_id, midnight, completion_tokens=2)
    # 08:30 in Tokyo on Jan 3 is 23:30 UTC on Jan 2.
    _record(make_session, tenant_id, datetime(2031, 1, 3, 8, 30, tzinfo=tokyo), completion_tokens=4)

    report = _report(make_session, tenant_id=tenant_id)
    assert [(row["day"], row["completion_tokens"]) for row in report.rows] == [
        (date(2031, 1, 1), 1),
        (date(2031, 1, 2), 6),
    ]
    assert _report(make_session, start=midnight).totals["completion_tokens"] == 6
    assert _report(make_session, end=midnight).totals["completion_tokens"] == 1
    assert _report(make_session, start=midnight, end=midnight).totals == ZERO


def test_days_do_not_depend_on_the_database_session_time_zone(make_session):
    with make_session.begin() as session:
        tenant_id = add_tenant(session).id
    _record(make_session, tenant_id, datetime(2031, 1, 1, 23, 0, tzinfo=UTC))
    with make_session() as session:
        if session.get_bind().dialect.name == "postgresql":
            session.execute(text("SET TIME ZONE 'Asia/Tokyo'"))
        report = usage_report(session, tenant_id=tenant_id)
    assert [row["day"] for row in report.rows] == [date(2031, 1, 1)]


def test_adapter_rows_name_the_adapter_and_put_the_base_model_first(make_session):
    with make_session.begin() as session:
        tenant = add_tenant(session)
        zeta, alpha = add_adapter(session, tenant, "zeta"), add_adapter(session, tenant, "alpha")
        tenant_id, ids = tenant.id, (zeta.id, alpha.id)
    for adapter_id in (*ids, None, ids[0]):
        _record(make_session, tenant_id, DAY0, adapter_id=adapter_id)

    report = _report(make_session, group_by="adapter")
    assert [(row["adapter"], row["requests"]) for row in report.rows] == [
        (None, 1),
        ("alpha", 1),
        ("zeta", 2),
    ]
    assert report.columns == ("tenant_id", "adapter", *METRICS)


def test_request_rows_are_the_records_in_time_order(make_session):
    with make_session.begin() as session:
        tenant_id = add_tenant(session).id
    late = _record(make_session, tenant_id, DAY0 + timedelta(hours=2), finish_reason="length")
    early = _record(make_session, tenant_id, DAY0 + timedelta(hours=1), latency_ms=7)

    rows = _report(make_session, group_by="request").rows
    assert [row["request_id"] for row in rows] == [early.request_id, late.request_id]
    assert rows[0] == {
        "tenant_id": tenant_id,
        "request_id": early.request_id,
        "created_at": DAY0 + timedelta(hours=1),
        "model": "base",
        "adapter": None,
        "adapter_version": None,
        "adapter_sha256": None,
        "user": None,
        "finish_reason": None,
        "latency_ms": 7,
        "requests": 1,
        "prompt_tokens": 100,
        "cached_prompt_tokens": 0,
        "completion_tokens": 10,
        "cost_micro_usd": 0,
    }


def test_an_empty_period_has_no_rows_and_zero_totals(make_session):
    for group_by in GROUP_BYS:
        report = _report(make_session, tenant_id="no-such-tenant", group_by=group_by)
        assert (report.rows, report.totals) == ([], ZERO)
        assert to_csv(report) == ",".join(report.columns) + "\r\n"


def test_csv_cells(make_session):
    with make_session.begin() as session:
        tenant_id = add_tenant(session).id
    record = _record(
        make_session, tenant_id, datetime(2031, 1, 1, 12, 0, 0, 250, tzinfo=UTC), model="a,b"
    )
    header, lines = _parse_csv(to_csv(_report(make_session, group_by="request")))
    assert header == [*KEY_COLUMNS["request"], *METRICS]
    assert lines == [
        {
            "tenant_id": tenant_id,
            "request_id": record.request_id,
            "created_at": "2031-01-01T12:00:00.000250Z",
            "model": "a,b",
            "adapter": "",
            "adapter_version": "",
            "adapter_sha256": "",
            "user": "",
            "finish_reason": "",
            "latency_ms": "0",
            "requests": "1",
            "prompt_tokens": "100",
            "cached_prompt_tokens": "0",
            "completion_tokens": "10",
            "cost_micro_usd": "0",
        }
    ]
    day_header, day_lines = _parse_csv(to_csv(_report(make_session)))
    assert day_header == ["tenant_id", "day", *METRICS]
    assert day_lines[0]["day"] == "2031-01-01"


@pytest.mark.parametrize(
    "filters",
    [
        {"group_by": "month"},
        {"start": DAY0 + timedelta(seconds=1), "end": DAY0},
        {"start": datetime(2031, 1, 1)},
        {"end": datetime(2031, 1, 1)},
    ],
)
def test_bad_filters_are_refused(make_session, filters):
    with pytest.raises(ValueError):
        _report(make_session, **filters)
