"""The operator's billing routes over HTTP on PostgreSQL with the real engine: the roll-up,
exports of closed days and of today (provisional, then final), idempotence, the list, the
download against the report and the usage the API returned, every refusal, the document."""

from __future__ import annotations

import csv
import io
from datetime import UTC, date, datetime, timedelta

import pytest
from sqlalchemy import func, select

from loramux.platform.api.admin import billing as admin_billing
from loramux.platform.db.models import BillingExport, Tenant, UsageDaily
from loramux.platform.services.billing import METRICS, to_csv, usage_report
from loramux.platform.services.rollups import utc_day_bounds
from tests.platform.api.conftest import assert_openai_error
from tests.platform.db.factories import usage_record
from tests.platform.services.stores import FlakyStore

EXPORTS = "/admin/billing/exports"
ROLLUP = "/admin/usage/rollup"


def _today() -> date:
    return datetime.now(UTC).date()


def _days_ago(n: int) -> date:
    return _today() - timedelta(days=n)


def _at(day: date, hour: int = 12) -> datetime:
    return utc_day_bounds(day)[0] + timedelta(hours=hour)


@pytest.fixture
def tenant(new_tenant) -> dict:
    return new_tenant(input_price_per_mtok=2.0, output_price_per_mtok=4.0)


def _add_usage(context, tenant_id: str, *moments: datetime) -> None:
    with context.sessions.begin() as session:
        owner = session.get(Tenant, tenant_id)
        session.add_all(usage_record(owner, created_at=moment) for moment in moments)


def _exports(context) -> int:
    with context.sessions() as session:
        return session.scalar(select(func.count()).select_from(BillingExport))


def _download(client, admin, export: dict):
    response = client.get(export["download_url"], headers=admin)
    assert response.status_code == 200, response.text
    return response


def _csv_totals(data: bytes) -> dict[str, int]:
    rows = list(csv.DictReader(io.StringIO(data.decode("utf-8"))))
    return {metric: sum(int(row[metric]) for row in rows) for metric in METRICS}


# --- roll-up ---------------------------------------------------------------------------------


def test_rollup_rolls_the_closed_days_and_says_why_today_is_not(client, admin, context, tenant):
    _add_usage(context, tenant["id"], _at(_days_ago(3)), _at(_days_ago(2)), _at(_days_ago(2), 3))
    _add_usage(context, tenant["id"], datetime.now(UTC))

    response = client.post(ROLLUP, headers=admin)

    assert response.status_code == 200, response.text
    body = response.json()
    # From the first day with usage to the last closed one (yesterday, or the day before
    # in the 5 minutes after midnight), days without usage included.
    last_closed = date.fromisoformat(body["last_closed_day"])
    assert last_closed in (_days_ago(1), _days_ago(2))
    expected = [_days_ago(n) for n in range(3, 0, -1) if _days_ago(n) <= last_closed]
    assert body["rolled_up"] == [day.isoformat() for day in expected]
    assert body["open_days"][-1] == _today().isoformat()
    assert _today().isoformat() not in body["rolled_up"] and not body["more_pending"]
    assert body["last_closed_day"] < body["open_days"][0]
    assert "5 minutes after the midnight" in body["note"] and _today().isoformat() in body["note"]
    with context.sessions() as session:
        rolled = session.execute(select(UsageDaily.day, UsageDaily.requests)).all()
    assert sorted(rolled) == [(_days_ago(3), 1), (_days_ago(2), 2)]

    again = client.post(ROLLUP, headers=admin).json()
    assert again["rolled_up"] == [] and "Nothing to roll up" in again["note"]

    # One closed day again, on request (after a backfill).
    _add_usage(context, tenant["id"], _at(_days_ago(3), 5))
    redo = client.post(ROLLUP, json={"day": _days_ago(3).isoformat()}, headers=admin)
    assert redo.status_code == 200 and redo.json()["rolled_up"] == [_days_ago(3).isoformat()]
    with context.sessions() as session:
        assert (
            session.scalar(select(UsageDaily.requests).where(UsageDaily.day == _days_ago(3))) == 2
        )


@pytest.mark.parametrize(
    ("day", "words"),
    [(lambda: _today(), "not closed yet"), (lambda: _days_ago(-2), "in the future")],
)
def test_rollup_of_an_open_day_is_refused(client, admin, day, words):
    error = assert_openai_error(
        client.post(ROLLUP, json={"day": day().isoformat()}, headers=admin), 400
    )
    assert error["code"] == "invalid_period" and words in error["message"]


# --- exports of closed days ------------------------------------------------------------------


def test_a_closed_day_exports_final_once_and_downloads_the_report(client, admin, context, tenant):
    day = _days_ago(3)
    _add_usage(context, tenant["id"], _at(day, 1), _at(day, 9), _at(day, 23))
    _add_usage(context, tenant["id"], _at(day + timedelta(days=1), 0))  # the next day

    response = client.post(EXPORTS, json={"day": day.isoformat()}, headers=admin)

    assert response.status_code == 201, response.text
    export = response.json()
    assert export["created"] and not export["provisional"] and export["version"] == 1
    assert export["group_by"] == "request"  # the setting's default
    assert export["key"] == f"billing/{day.isoformat()}.by-request.csv"
    assert export["file_name"] == f"billing-{day.isoformat()}.by-request.csv"
    assert (export["first_day"], export["last_day"]) == (day.isoformat(), day.isoformat())
    assert export["rows"] == 3 and export["note"].startswith("Final")

    download = _download(client, admin, export)
    assert download.headers["content-type"].startswith("text/csv")
    assert download.headers["content-disposition"] == (
        f'attachment; filename="{export["file_name"]}"'
    )
    assert download.headers["etag"] == f'"{export["sha256"]}"'
    start, end = utc_day_bounds(day)
    with context.sessions() as session:
        report = usage_report(session, start=start, end=end, group_by="request")
    assert download.content == to_csv(report).encode()
    usage = client.get(
        "/admin/usage",
        params={"start": day.isoformat(), "end": (day + timedelta(days=1)).isoformat()},
        headers=admin,
    ).json()
    assert _csv_totals(download.content) == usage["totals"] == report.totals

    again = client.post(EXPORTS, json={"day": day.isoformat()}, headers=admin)
    assert again.status_code == 200, again.text
    assert again.json()["id"] == export["id"] and not again.json()["created"]
    assert "Already exported" in again.json()["note"]
    assert _exports(context) == 1


def test_a_range_export_with_a_grouping(client, admin, context, tenant):
    first, last = _days_ago(6), _days_ago(3)
    _add_usage(context, tenant["id"], _at(first), _at(_days_ago(5)), _at(last, 23))

    body = {"start": first.isoformat(), "end": last.isoformat(), "group_by": "day"}
    export = client.post(EXPORTS, json=body, headers=admin).json()

    assert export["key"] == f"billing/{first.isoformat()}_{last.isoformat()}.by-day.csv"
    assert export["period_start"].startswith(first.isoformat())
    assert export["period_end"].startswith((last + timedelta(days=1)).isoformat())
    rows = list(csv.DictReader(io.StringIO(_download(client, admin, export).text)))
    assert [row["day"] for row in rows] == [
        first.isoformat(),
        _days_ago(5).isoformat(),
        last.isoformat(),
    ]


# --- today: provisional, then final ----------------------------------------------------------


def _complete(client, key: dict, prompt: str) -> dict:
    response = client.post(
        "/v1/completions",
        json={
            "model": client.get("/v1/models", headers=key).json()["data"][0]["id"],
            "prompt": prompt,
            "max_tokens": 3,
        },
        headers=key,
    )
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_today_exports_provisional_and_the_closed_day_final(
    client, admin, context, tenant, monkeypatch
):
    key_response = client.post(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin)
    key = {"Authorization": f"Bearer {key_response.json()['key']}"}
    usages = [_complete(client, key, "Hello"), _complete(client, key, "Once upon a time")]
    today = _today().isoformat()
    body = {"day": today, "group_by": "day"}

    first = client.post(EXPORTS, json=body, headers=admin)
    unchanged = client.post(EXPORTS, json=body, headers=admin)
    usages.append(_complete(client, key, "The sky is"))
    grown = client.post(EXPORTS, json=body, headers=admin)

    assert first.status_code == 201 and first.json()["provisional"]
    assert "Provisional" in first.json()["note"] and "00:05:00Z" in first.json()["note"]
    assert unchanged.status_code == 200 and unchanged.json()["id"] == first.json()["id"]
    assert grown.status_code == 201 and grown.json()["version"] == 2
    assert grown.json()["key"] == f"billing/{today}.by-day.v2.csv"
    totals = _csv_totals(_download(client, admin, grown.json()).content)
    assert totals["requests"] == 3
    for field in ("prompt_tokens", "completion_tokens"):
        assert totals[field] == sum(usage[field] for usage in usages)
    assert totals["cost_micro_usd"] > 0

    # Tomorrow 00:06 UTC: today has closed, so exporting it makes the final version.
    tomorrow = utc_day_bounds(_today())[1]
    monkeypatch.setattr(admin_billing, "utc_now", lambda: tomorrow + timedelta(minutes=6))
    final = client.post(EXPORTS, json=body, headers=admin)
    again = client.post(EXPORTS, json=body, headers=admin)

    assert final.status_code == 201, final.text
    assert (final.json()["version"], final.json()["provisional"]) == (3, False)
    assert final.json()["key"] == f"billing/{today}.by-day.v3.csv"
    assert _download(client, admin, final.json()).content == (
        _download(client, admin, grown.json()).content
    )
    assert again.status_code == 200 and again.json()["id"] == final.json()["id"]
    # Every version stays downloadable, verified.
    assert _csv_totals(_download(client, admin, first.json()).content)["requests"] == 2


# --- the list --------------------------------------------------------------------------------


def test_the_list_is_newest_first_with_what_an_operator_needs(client, admin, context, tenant):
    _add_usage(context, tenant["id"], _at(_days_ago(4)))
    made = [
        client.post(EXPORTS, json=body, headers=admin).json()
        for body in (
            {"day": _days_ago(5).isoformat()},
            {"day": _days_ago(4).isoformat(), "group_by": "adapter"},
            {"start": _days_ago(9).isoformat(), "end": _days_ago(4).isoformat()},
        )
    ]

    listed = client.get(EXPORTS, headers=admin)

    assert listed.status_code == 200
    exports = listed.json()
    assert [e["id"] for e in exports] == [e["id"] for e in reversed(made)]
    newest = exports[0]
    assert set(newest) == {
        "id", "first_day", "last_day", "period_start", "period_end", "group_by", "version",
        "provisional", "rows", "size_bytes", "sha256", "created_at", "key", "file_name",
        "download_url",
    }  # fmt: skip
    assert newest["download_url"] == f"{EXPORTS}/{newest['id']}/download"
    assert len(_download(client, admin, newest).content) == newest["size_bytes"]
    page = client.get(EXPORTS, params={"limit": 1, "offset": 1}, headers=admin).json()
    assert [e["id"] for e in page] == [made[1]["id"]]


# --- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (lambda: {"start": _days_ago(40).isoformat(), "end": _days_ago(9).isoformat()}, "32 days"),
        (
            lambda: {"start": _days_ago(3).isoformat(), "end": _days_ago(4).isoformat()},
            "after it ends",
        ),
        (lambda: {"day": _days_ago(-1).isoformat()}, "in the future"),
        (lambda: {"start": _days_ago(2).isoformat(), "end": _days_ago(-3).isoformat()}, "future"),
    ],
    ids=["over-the-cap", "backwards", "future-day", "range-into-the-future"],
)
def test_periods_that_cannot_be_exported_are_400(client, admin, context, body, words):
    error = assert_openai_error(client.post(EXPORTS, json=body(), headers=admin), 400)
    assert error["code"] == "invalid_period" and words in error["message"]
    assert _exports(context) == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "start"),
        ({"day": "2026-11-24", "start": "2026-11-01"}, "start"),
        ({"day": "2026-13-01"}, "day"),
        ({"day": "2026-1-5"}, "day"),
        ({"day": 20261124}, "day"),
        ({"day": "2026-11-24T00:00:00Z"}, "day"),
        ({"day": "2026-11-24", "group_by": "week"}, "group_by"),
        ({"start": "2026-11-01"}, "end"),
        ({"day": "2026-11-24", "tenant_id": "x"}, "tenant_id"),
    ],
)
def test_malformed_bodies_are_422_naming_the_field(client, admin, context, body, field):
    error = assert_openai_error(client.post(EXPORTS, json=body, headers=admin), 422)
    assert field in error["message"]
    assert _exports(context) == 0


def test_unknown_exports_are_404_and_a_corrupt_file_is_500(client, admin, context, tenant):
    assert_openai_error(client.get(f"{EXPORTS}/nope/download", headers=admin), 404)
    _add_usage(context, tenant["id"], _at(_days_ago(3)))
    export = client.post(EXPORTS, json={"day": _days_ago(3).isoformat()}, headers=admin).json()
    path = context.store.root / export["key"]
    path.write_bytes(path.read_bytes() + b"forged,row\r\n")

    error = assert_openai_error(client.get(export["download_url"], headers=admin), 500)

    assert error["code"] == "export_corrupt" and export["id"] in error["message"]


def test_a_store_outage_is_503_and_records_nothing(client, admin, context, tenant):
    _add_usage(context, tenant["id"], _at(_days_ago(3)))
    store = context.store
    context.store = flaky = FlakyStore(store)
    flaky.down = True

    error = assert_openai_error(
        client.post(EXPORTS, json={"day": _days_ago(3).isoformat()}, headers=admin), 503
    )

    assert error["code"] == "store_unavailable" and _exports(context) == 0
    flaky.down = False
    assert (
        client.post(EXPORTS, json={"day": _days_ago(3).isoformat()}, headers=admin).status_code
        == 201
    )


def test_only_the_operator_may_call_them(client, tenant_key):
    key = tenant_key()
    for method, path, body in (
        ("POST", ROLLUP, None),
        ("POST", EXPORTS, {"day": "2026-11-24"}),
        ("GET", EXPORTS, None),
        ("GET", f"{EXPORTS}/x/download", None),
    ):
        for headers in ({}, key):
            response = client.request(method, path, json=body, headers=headers)
            assert_openai_error(response, 401)


# --- the document ----------------------------------------------------------------------------


def test_the_routes_and_their_errors_are_documented(client):
    paths = client.get("/openapi.json").json()["paths"]

    def statuses(method: str, path: str) -> set[str]:
        return set(paths[path][method]["responses"])

    assert {"200", "201", "400", "401", "408", "413", "422", "503"} <= statuses("post", EXPORTS)
    assert {"200", "400", "401", "422", "503"} <= statuses("post", ROLLUP)
    assert {"200", "401", "422", "503"} <= statuses("get", EXPORTS)
    download = paths[f"{EXPORTS}/{{export_id}}/download"]["get"]
    assert {"200", "401", "404", "422", "500", "503"} <= set(download["responses"])
    assert "text/csv" in download["responses"]["200"]["content"]
    assert "application/json" not in download["responses"]["200"]["content"]
    request = paths[EXPORTS]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert len(request["oneOf"]) == 2  # {"day"} or {"start", "end"}
