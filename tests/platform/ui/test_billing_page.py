"""The operator's billing exports page in a real browser: export today (provisional) and a
closed range (final, then already exported), a refusal shown beside its field, the list
with its badges, a download saved under its name with the bytes the API holds, and the
usage roll-up run from the page."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta

import httpx

from loramux.platform.db.models import Tenant as TenantRow
from loramux.platform.services.billing import METRICS
from loramux.platform.services.rollups import utc_day_bounds
from tests.platform.db.factories import usage_record
from tests.platform.ui.conftest import complete, sign_in, wait_loaded


def _days_ago(n: int):
    return datetime.now(UTC).date() - timedelta(days=n)


def test_billing_page_exports_lists_downloads_and_rolls_up(page, ui_platform, tmp_path, shots):
    url = ui_platform.url
    tenant = ui_platform.new_tenant(input_price_per_mtok=1.0, output_price_per_mtok=3.0)
    for prompt in ("Invoice total:", "Hello"):
        complete(ui_platform, tenant, model=ui_platform.base_model, prompt=prompt, max_tokens=3)
    # Usage on closed days too (written as the platform's meter would have, days ago).
    with ui_platform.context.sessions.begin() as session:
        owner = session.get(TenantRow, tenant.id)
        for days, hour in ((3, 2), (3, 15), (2, 9)):
            moment = utc_day_bounds(_days_ago(days))[0] + timedelta(hours=hour)
            session.add(usage_record(owner, created_at=moment, cost_micro_usd=1234))

    sign_in(page, ui_platform, ui_platform.context.admin_token, "/ui/operator/tenants", shots)
    page.click("nav >> text=Billing exports")
    page.wait_for_url(f"{url}/ui/operator/billing")
    wait_loaded(page)

    # Today: provisional.
    today = _days_ago(0).isoformat()
    page.fill("#day", today)
    page.select_option("#group_by", "day")
    page.click("#export-now")
    result = page.locator("#export-result")
    result.locator("strong", has_text="Exported").wait_for()
    assert "Provisional" in result.inner_text() and "00:05:00Z" in result.inner_text()
    today_row = page.locator("#exports-table tbody tr", has_text=f"billing/{today}.by-day.csv")
    today_row.wait_for()
    assert "Provisional" in today_row.inner_text()

    # A closed range: final; exported again, the same export.
    first, last = _days_ago(3).isoformat(), _days_ago(1).isoformat()
    page.select_option("#kind", "range")
    assert page.is_hidden("#day") and page.is_visible("#start")
    page.fill("#start", first)
    page.fill("#end", last)
    page.select_option("#group_by", "request")
    page.click("#export-now")
    result.locator("strong", has_text=f"Exported {first} – {last}").wait_for()
    assert "Final" in result.inner_text()
    key = f"billing/{first}_{last}.by-request.csv"
    range_row = page.locator("#exports-table tbody tr", has_text=key)
    range_row.wait_for()
    cells = range_row.locator("td").all_inner_texts()
    assert cells[1:5] == ["Request", "1", "Final", "3"]
    page.click("#export-now")
    result.locator("strong", has_text="Already exported").wait_for()
    assert page.locator("#exports-table tbody tr", has_text=key).count() == 1
    rows = page.locator("#exports-table tbody tr")
    assert key in rows.nth(0).inner_text()  # newest first
    shots(page, "billing-exports")

    # A range reaching into the future is refused beside the last day.
    page.fill("#end", _days_ago(-2).isoformat())
    page.click("#export-now")
    page.wait_for_selector("#end-error:text('in the future')")
    assert page.get_attribute("#end", "aria-invalid") == "true"
    shots(page, "refused-range")

    # The download saves the CSV the API holds, under its readable name.
    with page.expect_download() as download_info:
        range_row.locator("button", has_text="Download").click()
    download = download_info.value
    assert download.suggested_filename == f"billing-{first}_{last}.by-request.csv"
    saved = tmp_path / download.suggested_filename
    download.save_as(saved)
    exports = httpx.get(f"{url}/admin/billing/exports", headers=ui_platform.admin).json()
    (listed,) = [e for e in exports if e["key"] == key]
    api_csv = httpx.get(f"{url}{listed['download_url']}", headers=ui_platform.admin).content
    assert saved.read_bytes() == api_csv
    mine = [
        r for r in csv.DictReader(io.StringIO(saved.read_text())) if r["tenant_id"] == tenant.id
    ]
    usage = ui_platform.admin_usage(
        tenant_id=tenant.id, start=first, end=_days_ago(0).isoformat()
    ).json()
    assert len(mine) == 3
    for metric in METRICS:
        assert sum(int(r[metric]) for r in mine) == usage["totals"][metric], metric

    # The roll-up, run from the page, says what it did and why today is left.
    page.click("#run-rollup")
    rollup = page.locator("#rollup-result")
    rollup.locator("p", has_text="Not rolled up").wait_for()
    assert today in rollup.inner_text() and "5 minutes" in rollup.inner_text()
    shots(page, "rollup-run")
