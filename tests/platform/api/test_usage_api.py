"""The usage routes over HTTP on PostgreSQL: shapes, CSV, auth, tenant isolation, errors."""

from __future__ import annotations

import csv
import io
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from loramux.platform.api.deps import api_key_hash
from loramux.platform.api.openai.render import openai_usage
from loramux.platform.context import PlatformContext, build_context
from loramux.platform.db.models import ApiKey
from loramux.platform.services.billing import METRICS
from loramux.platform.services.metering import Meter, Usage, UsageEvent
from loramux.platform.settings import Settings
from tests.platform.api.conftest import assert_openai_error
from tests.platform.db.factories import add_adapter, add_price, add_tenant

DAY0 = datetime(2031, 5, 1, tzinfo=UTC)
DAY_COLUMNS = ["tenant_id", "day", *METRICS]
ADAPTER_COLUMNS = ["tenant_id", "adapter", *METRICS]
REQUEST_COLUMNS = [
    "tenant_id",
    "request_id",
    "created_at",
    "model",
    "adapter",
    "adapter_version",
    "adapter_sha256",
    "user",
    "finish_reason",
    "latency_ms",
    *METRICS,
]


@pytest.fixture
def context(tmp_path, tiny_model_dir, postgres_database_url) -> Iterator[PlatformContext]:
    """No engine: these routes only read the database."""
    settings = Settings(
        data_dir=tmp_path,
        model=str(tiny_model_dir),
        database_url=postgres_database_url,
        admin_token=None,
    )
    context = build_context(settings, log=lambda _: None, with_engine=False)
    try:
        yield context
    finally:
        context.sessions.kw["bind"].dispose()


@pytest.fixture
def usage(context) -> dict:
    """Two tenants with keys, prices and usage on 1 and 2 May 2031 (one adapter each)."""
    tenants = {}
    with context.sessions.begin() as session:
        for name in ("acme", "globex"):
            tenant = add_tenant(session, name=f"{name}-{uuid.uuid4().hex[:6]}")
            add_price(session, tenant, DAY0 - timedelta(days=30))
            adapter = add_adapter(session, tenant, name="support")
            secret = f"lmx-{uuid.uuid4().hex}"
            session.add(
                ApiKey(tenant_id=tenant.id, prefix=secret[:8], key_hash=api_key_hash(secret))
            )
            tenants[name] = {"id": tenant.id, "adapter_id": adapter.id, "key": secret}

    meter = Meter(context.sessions)
    plan = [  # tenant, adapter?, hours after DAY0, prompt, cached, completion
        ("acme", True, 1, 1_000, 100, 50),
        ("acme", False, 2, 2_000, 0, 70),
        ("acme", True, 30, 3_000, 3_000, 90),
        ("globex", False, 5, 7_000, 10, 1_000),
    ]
    records = []
    for name, with_adapter, hours, prompt, cached, completion in plan:
        event = UsageEvent(
            request_id=f"req-{uuid.uuid4().hex}",
            tenant_id=tenants[name]["id"],
            adapter_id=tenants[name]["adapter_id"] if with_adapter else None,
            model="support" if with_adapter else "base",
            prompt_tokens=prompt,
            cached_prompt_tokens=cached,
            completion_tokens=completion,
            latency_ms=hours * 10,
            finish_reason="stop",
            created_at=DAY0 + timedelta(hours=hours),
        )
        records.append(meter.record(event))
    return {"tenants": tenants, "records": records}


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _get_json(client, path: str, headers: dict, **params) -> dict:
    response = client.get(path, params=params, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"rows", "totals"}
    assert set(body["totals"]) == set(METRICS)
    for name in METRICS:  # the rows add up to the totals, exactly
        assert sum(row[name] for row in body["rows"]) == body["totals"][name]
    return body


def _csv_rows(response) -> tuple[list[str], list[dict[str, str]]]:
    header, *lines = list(csv.reader(io.StringIO(response.text, newline="")))
    return header, [dict(zip(header, line, strict=True)) for line in lines]


# --- operators -------------------------------------------------------------------------------


def test_admin_usage_by_day(client, admin, usage):
    acme = usage["tenants"]["acme"]["id"]
    body = _get_json(client, "/admin/usage", admin, tenant_id=acme, group_by="day")
    assert [set(row) for row in body["rows"]] == [set(DAY_COLUMNS)] * 2
    assert [(r["tenant_id"], r["day"], r["requests"]) for r in body["rows"]] == [
        (acme, "2031-05-01", 2),
        (acme, "2031-05-02", 1),
    ]
    acme_records = usage["records"][:3]
    assert body["totals"] == {
        "requests": 3,
        "prompt_tokens": 6_000,
        "cached_prompt_tokens": 3_100,
        "completion_tokens": 210,
        "cost_micro_usd": sum(record.cost_micro_usd for record in acme_records),
    }


def test_admin_usage_defaults_to_every_tenant_by_day(client, admin, usage):
    body = _get_json(client, "/admin/usage", admin)
    assert body["totals"]["requests"] == 4
    assert {row["tenant_id"] for row in body["rows"]} == {
        tenant["id"] for tenant in usage["tenants"].values()
    }


def test_admin_usage_by_adapter_and_by_request(client, admin, usage):
    acme = usage["tenants"]["acme"]["id"]
    by_adapter = _get_json(client, "/admin/usage", admin, tenant_id=acme, group_by="adapter")
    assert [set(row) for row in by_adapter["rows"]] == [set(ADAPTER_COLUMNS)] * 2
    assert [(r["adapter"], r["requests"]) for r in by_adapter["rows"]] == [
        (None, 1),
        ("support", 2),
    ]

    by_request = _get_json(client, "/admin/usage", admin, tenant_id=acme, group_by="request")
    first = usage["records"][0]
    assert by_request["rows"][0] == {
        "tenant_id": acme,
        "request_id": first.request_id,
        "created_at": "2031-05-01T01:00:00Z",
        "model": "support",
        "adapter": "support",
        "adapter_version": None,  # a record made without a version (tested in test_billing)
        "adapter_sha256": None,
        "user": None,
        "finish_reason": "stop",
        "latency_ms": 10,
        "requests": 1,
        "prompt_tokens": 1_000,
        "cached_prompt_tokens": 100,
        "completion_tokens": 50,
        "cost_micro_usd": first.cost_micro_usd,
    }
    assert by_adapter["totals"] == by_request["totals"]


@pytest.mark.parametrize("group_by", ["day", "adapter", "request"])
def test_admin_usage_as_csv_has_the_json_rows(client, admin, usage, group_by):
    params = {"start": "2031-05-01", "end": "2031-05-11", "group_by": group_by}
    body = _get_json(client, "/admin/usage", admin, **params)
    response = client.get("/admin/usage", params={**params, "format": "csv"}, headers=admin)

    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/csv")
    assert response.headers["content-disposition"] == (
        'attachment; filename="usage-2031-05-01-2031-05-11.csv"'
    )
    header, lines = _csv_rows(response)
    assert header == list(body["rows"][0])
    assert len(lines) == len(body["rows"])
    for line, row in zip(lines, body["rows"], strict=True):
        for name, value in row.items():
            if name in METRICS or name == "latency_ms":
                assert int(line[name]) == value
            else:
                assert line[name] == ("" if value is None else value)


def test_csv_file_name_of_open_and_precise_periods(client, admin, usage):
    cases = {
        (): "usage-beginning-now.csv",
        (("start", "2031-05-01T12:30:00Z"),): "usage-2031-05-01T123000Z-now.csv",
        (("end", "2031-05-02"),): "usage-beginning-2031-05-02.csv",
    }
    for params, filename in cases.items():
        response = client.get(
            "/admin/usage", params={**dict(params), "format": "csv"}, headers=admin
        )
        assert response.status_code == 200, response.text
        assert response.headers["content-disposition"] == f'attachment; filename="{filename}"'


def test_the_period_is_start_inclusive_end_exclusive(client, admin, usage):
    def requests(**params) -> int:
        return _get_json(client, "/admin/usage", admin, **params)["totals"]["requests"]

    assert requests(start="2031-05-01T01:00:00Z", end="2031-05-01T05:00:00Z") == 2
    assert requests(start="2031-05-01T01:00:00.000001Z") == 3
    assert requests(end="2031-05-02") == 3  # a date is midnight UTC at its start
    assert requests(start="2031-05-02T09:00:00+03:00") == 1  # 06:00 UTC; 1 record at 06:00
    assert requests(start="2031-05-01T07:00:00", end="2031-05-02T06:00:00") == 0  # naive = UTC
    assert requests(start="2031-05-03", end="2031-05-03") == 0
    # A '+' left unescaped in the URL arrives as a space; it is still read as the offset.
    raw = client.get("/admin/usage?start=2031-05-02T09:00:00+03:00", headers=admin)
    assert raw.status_code == 200, raw.text
    assert raw.json()["totals"]["requests"] == 1


def test_admin_usage_needs_the_admin_token(client, usage):
    error = assert_openai_error(client.get("/admin/usage"), 401)
    assert error["type"] == "authentication_error"
    tenant_key = usage["tenants"]["acme"]["key"]
    assert_openai_error(client.get("/admin/usage", headers=_bearer(tenant_key)), 401)
    # Checked before the query: no data leaks through validation messages either.
    assert_openai_error(client.get("/admin/usage?start=nonsense"), 401)


def test_unknown_tenant_is_404(client, admin, usage):
    error = assert_openai_error(client.get("/admin/usage?tenant_id=nope", headers=admin), 404)
    assert error["type"] == "not_found_error"
    assert "nope" in error["message"]


@pytest.mark.parametrize("path", ["/admin/usage", "/v1/usage"])
@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"start": "yesterday"}, "start"),
        ({"end": "2031-13-01"}, "end"),
        ({"start": ""}, "start"),
        ({"start": "2031-05-02", "end": "2031-05-01"}, "start"),
        ({"group_by": "month"}, "group_by"),
        ({"format": "xml"}, "format"),
    ],
)
def test_bad_parameters_are_422_naming_them(client, admin, usage, path, params, named):
    headers = admin if path.startswith("/admin") else _bearer(usage["tenants"]["acme"]["key"])
    error = assert_openai_error(client.get(path, params=params, headers=headers), 422)
    assert error["type"] == "invalid_request_error"
    assert named in error["message"]


# --- tenants ---------------------------------------------------------------------------------


def test_a_tenant_sees_only_its_own_usage(client, usage):
    acme, globex = usage["tenants"]["acme"], usage["tenants"]["globex"]
    headers = _bearer(acme["key"])
    body = _get_json(client, "/v1/usage", headers)
    assert {row["tenant_id"] for row in body["rows"]} == {acme["id"]}
    assert [set(row) for row in body["rows"]] == [set(DAY_COLUMNS)] * 2
    assert body["totals"]["requests"] == 3
    # Naming another tenant changes nothing: the key decides whose usage this is.
    assert _get_json(client, "/v1/usage", headers, tenant_id=globex["id"]) == body

    other = _get_json(client, "/v1/usage", _bearer(globex["key"]), group_by="request")
    assert [row["request_id"] for row in other["rows"]] == [usage["records"][3].request_id]


def test_tenant_totals_equal_the_usage_the_api_returned(client, usage):
    acme = usage["tenants"]["acme"]
    returned = [openai_usage(Usage.of(record)) for record in usage["records"][:3]]
    body = _get_json(client, "/v1/usage", _bearer(acme["key"]), start="2031-05-01")
    assert body["totals"]["cost_micro_usd"] == sum(u["cost_micro_usd"] for u in returned)
    assert body["totals"]["completion_tokens"] == sum(u["completion_tokens"] for u in returned)
    assert body["totals"]["prompt_tokens"] == sum(u["prompt_tokens"] for u in returned)
    assert body["totals"]["cached_prompt_tokens"] == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in returned
    )


def test_tenant_usage_as_csv(client, usage):
    response = client.get(
        "/v1/usage", params={"format": "csv"}, headers=_bearer(usage["tenants"]["acme"]["key"])
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/csv")
    header, lines = _csv_rows(response)
    assert header == DAY_COLUMNS
    assert [line["day"] for line in lines] == ["2031-05-01", "2031-05-02"]


def test_tenant_usage_needs_a_live_key(client, usage):
    error = assert_openai_error(client.get("/v1/usage"), 401)
    assert error["code"] == "missing_api_key"
    assert_openai_error(client.get("/v1/usage", headers=_bearer("lmx-not-a-key")), 401)
