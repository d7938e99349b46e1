"""The operator's console in the browser: raising a tenant's priority reaches the running
engine; the billing CSV adds up to ``GET /admin/usage``; the engine panel refreshes by
itself; every tenant's adapters are listed; API errors sit next to the fields."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta

import httpx

from tests.platform.ui.conftest import complete, sign_in, upload_adapter, wait_loaded

METRICS = ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens")


def _admin_get(platform, path: str, **params) -> dict:
    response = httpx.get(f"{platform.url}{path}", params=params, headers=platform.admin)
    assert response.status_code == 200, response.text
    return response.json()


def _engine_scheduling(platform, tenant_id: str) -> dict:
    tenants = _admin_get(platform, "/admin/engine")["tenants"]
    return next(t for t in tenants if t["tenant_id"] == tenant_id)


def _set_range(page, selector: str, value: str) -> None:
    page.locator(selector).evaluate(
        "(el, v) => { el.value = v; el.dispatchEvent(new Event('input', {bubbles: true})); }",
        value,
    )


def test_priority_reaches_the_engine_and_billing_csv_adds_up(
    page, ui_platform, adapter_dir, tmp_path, shots
):
    tenant = ui_platform.new_tenant(
        priority=2, weight=1.0, input_price_per_mtok=0.4, output_price_per_mtok=1.6
    )
    upload_adapter(ui_platform, tenant, "ledger", adapter_dir)
    for model, prompt in (("ledger", "Total the receipts:"), (ui_platform.base_model, "Hi")):
        complete(ui_platform, tenant, model=model, prompt=prompt, max_tokens=4, ignore_eos=True)
    assert _engine_scheduling(ui_platform, tenant.id)["priority"] == 2

    # Raise the priority (and the weight) on the tenant's page.
    sign_in(page, ui_platform, ui_platform.context.admin_token, "/ui/operator/tenants", shots)
    page.click(f"#tenants-table tr[data-tenant-id='{tenant.id}'] a")
    page.wait_for_url(f"{ui_platform.url}/ui/operator/tenants/{tenant.id}")
    wait_loaded(page)
    _set_range(page, "#priority", "8")
    assert page.text_content("#priority-value") == "8"
    page.fill("#weight", "3")
    page.click("#save-scheduling")
    page.wait_for_selector("#scheduling-status:text('Live on the engine.')")
    page.get_by_text("now runs at priority 8, weight 3").wait_for()
    shots(page, "priority-raised")

    stored = _admin_get(ui_platform, f"/admin/tenants/{tenant.id}")
    assert (stored["priority"], stored["weight"]) == (8, 3.0)
    scheduling = _engine_scheduling(ui_platform, tenant.id)
    assert (scheduling["priority"], scheduling["weight"]) == (8, 3.0)
    served = scheduling["served_prompt_tokens"] + scheduling["served_output_tokens"]
    assert scheduling["served_output_tokens"] == 8 and scheduling["queued_requests"] == 0

    # The engine panel shows the same, with what the tenant was served.
    page.click("nav >> text=Engine")
    row = page.locator(f"#engine-tenants tr[data-tenant-id='{tenant.id}']")
    row.wait_for()
    cells = row.locator("td").all_inner_texts()
    assert cells[1:4] == ["8", "3", "–"]  # no request now: no weight share
    assert cells[5].splitlines() == [
        f"{served:,}",
        f"{scheduling['served_prompt_tokens']:,} prompt · 8 output",
    ]
    assert cells[6].splitlines() == ["0", "0 running"]
    shots(page, "engine-holds-the-new-priority")

    # Usage charts and the billing export of this tenant for the last two weeks.
    today = datetime.now(UTC).date()
    start, end = today - timedelta(days=13), today
    page.goto(f"{ui_platform.url}/ui/operator/usage?tenant={tenant.id}&start={start}&end={end}")
    wait_loaded(page)
    page.wait_for_selector("#chart-tokens-day svg rect.bar")
    page.wait_for_selector("#chart-adapter svg rect.bar")
    assert page.input_value("#tenant") == tenant.id
    assert page.text_content("#total-requests") == "2"
    shots(page, "usage-and-billing")
    page.select_option("#group-by", "request")
    with page.expect_download() as download_info:
        page.click("#download-csv")
    download = download_info.value
    assert download.suggested_filename == f"usage-{start}-{end + timedelta(days=1)}.csv"
    saved = tmp_path / download.suggested_filename
    download.save_as(saved)
    page.wait_for_selector("#export-status:text('Downloaded')")

    rows = list(csv.DictReader(io.StringIO(saved.read_text())))
    api = _admin_get(
        ui_platform,
        "/admin/usage",
        tenant_id=tenant.id,
        start=str(start),
        end=str(end + timedelta(days=1)),
        group_by="request",
    )
    assert len(rows) == len(api["rows"]) == 2
    assert {row["adapter"] for row in rows} == {"ledger", ""}
    for metric in (*METRICS, "cost_micro_usd"):
        assert sum(int(row[metric]) for row in rows) == api["totals"][metric], metric
    assert api["totals"]["cost_micro_usd"] > 0


def test_engine_panel_refreshes_and_every_tenants_adapters_are_listed(
    page, ui_platform, adapter_dir, shots
):
    first, second = ui_platform.new_tenant(), ui_platform.new_tenant()
    upload_adapter(ui_platform, first, "alpha", adapter_dir)
    upload_adapter(ui_platform, second, "beta", adapter_dir)
    sign_in(page, ui_platform, ui_platform.context.admin_token, "/ui/operator/tenants", shots)

    page.click("nav >> text=Engine")
    page.wait_for_url(f"{ui_platform.url}/ui/operator/engine")
    page.wait_for_selector("#updated-at[data-refreshes]")
    seen = int(page.get_attribute("#updated-at", "data-refreshes"))
    # A request arrives while the panel is open: the panel shows it without a reload.
    complete(ui_platform, first, model="alpha", prompt="Hello", max_tokens=3, ignore_eos=True)
    page.wait_for_function(
        "n => Number(document.querySelector('#updated-at').dataset.refreshes) >= n", arg=seen + 2
    )
    first_name = _admin_get(ui_platform, f"/admin/tenants/{first.id}")["name"]
    page.locator("#device-tier .chip", has_text=f"{first_name} / alpha v1").wait_for()
    assert page.text_content("#ttft-n") != "0"
    # Each engine has its own row (one, in process, in the embedded default).
    engine_row = page.locator("#engines-table tbody tr[data-engine-id='local']")
    engine_row.wait_for()
    assert "up" in engine_row.inner_text() and "in process" in engine_row.inner_text()
    assert page.text_content("#engines-sub").startswith("1 of 1 up")
    # What the memory budget holds (the test run sets LORAMUX_ENGINE_KV_CACHE_BYTES to 256 MiB:
    # SmolLM2's full batch of 64 x 512 tokens does not fit it) and whether memory is the limit.
    memory = _admin_get(ui_platform, "/admin/engine")["memory"]
    assert page.text_content("#memory-budget") == "256 MB"
    assert page.text_content("#memory-source") == "set by LORAMUX_ENGINE_KV_CACHE_BYTES"
    kv = f"{memory['kv_blocks']:,} blocks · {memory['kv_tokens']:,} tokens"
    assert page.text_content("#memory-kv") == kv
    assert page.text_content("#memory-batch-label").endswith("(64 requests × 512 tokens)")
    assert page.text_content("#memory-beside") == "none: it does not fit"
    assert page.text_content("#memory-max") == f"{memory['adapters_max']:,}"
    context_limit = f"{memory['max_model_len']:,} tokens · {memory['kv_floor_blocks']:,} blocks"
    assert page.text_content("#memory-context") == context_limit
    assert page.text_content("#res-adapter_reloads") == "0"
    assert page.text_content("#res-adapter_room_wait_steps-rate") == "0"
    assert page.locator("#thrash-notice").is_hidden()
    assert "no request was preempted" in page.text_content("#residency-verdict")
    assert "256 MB" in engine_row.inner_text()
    # Speculative decoding is off by default: the panel says how to turn it on.
    assert page.text_content("#spec-method") == "Off"
    assert page.text_content("#spec-off").startswith(
        "off — set LORAMUX_ENGINE_SPECULATIVE_METHOD=ngram"
    )
    alpha = page.locator("#spec-table tbody tr", has_text=f"{first_name} / alpha v1")
    assert alpha.locator("td").all_inner_texts()[3].splitlines()[0] == "1.00"  # a token a step
    shots(page, "engine-live")
    page.click("#pause")
    assert page.text_content("#updated-at") == "Paused"

    page.click("nav >> text=Adapters")
    page.wait_for_url(f"{ui_platform.url}/ui/operator/adapters")
    wait_loaded(page)
    names = page.locator("#adapters-table tbody tr td:nth-child(2)").all_inner_texts()
    assert {"alpha", "beta"} <= set(names)
    shots(page, "all-adapters")
    page.wait_for_selector(f"#tenant-filter option[value='{second.id}']", state="attached")
    page.select_option("#tenant-filter", second.id)
    page.wait_for_function(
        "() => [...document.querySelectorAll('#adapters-table tbody tr td:nth-child(2)')]"
        ".map(td => td.textContent).join() === 'beta'"
    )


def test_engine_panel_says_when_adapters_thrash(page, ui_platform, shots):
    """The snapshot of an engine whose adapters thrash, on a budget sized to the machine
    (the platform's own answer, changed on its way to the page; the engine's real 256 MiB
    budget, said to be 15% of a small machine's RAM)."""

    def thrashing(route):
        body = route.fetch().json()
        body["memory"].update(
            source="machine",
            detail="sized to the machine: 15% of 1.7 GiB available RAM",
        )
        body["residency"].update(adapter_reloads=420, adapter_reloads_per_min=42.0, thrashing=True)
        body["engines"][0].update(adapter_reloads_per_min=42.0, thrashing=True)
        route.fulfill(json=body)

    page.route("**/admin/engine", thrashing)
    sign_in(page, ui_platform, ui_platform.context.admin_token, "/ui/operator/tenants", shots)
    page.click("nav >> text=Engine")
    page.wait_for_selector("#updated-at[data-refreshes]")
    notice = page.locator("#thrash-notice")
    notice.wait_for()
    assert notice.inner_text() == (
        "Adapters are thrashing: 42 re-loads a minute. Memory, not compute, is the limit: "
        "raise LORAMUX_ENGINE_KV_CACHE_BYTES or lower LORAMUX_ENGINE_MAX_NUM_SEQS."
    )
    assert page.text_content("#memory-budget") == "256 MB"
    assert page.text_content("#memory-source") == (
        "sized to the machine: 15% of 1.7 GiB available RAM"
    )
    assert page.text_content("#res-adapter_reloads-rate") == "42"
    assert page.text_content("#res-adapter_reloads") == "420"
    row = page.locator("#engines-table tbody tr[data-engine-id='local']")
    assert "42 re-loads/min · thrashing" in row.inner_text()
    shots(page, "engine-thrashing")


def _js_bytes(value: int) -> str:
    """``bytes()`` of admin_ui's format.js: 1024-based, one decimal under 100."""
    amount, unit = float(value), 0
    while amount >= 1024 and unit < 4:
        amount, unit = amount / 1024, unit + 1
    digits = 0 if unit == 0 or amount >= 100 else 1
    return f"{amount:.{digits}f} {['B', 'KB', 'MB', 'GB', 'TB'][unit]}"


def test_engine_panel_shows_the_compiled_grammar_cache(page, ui_platform, shots):
    """A structured request's compiled grammar, in the memory card: its bytes of the budget
    (the default 256 MiB, 64 MiB a tenant), grammars held and evicted."""
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": [f"colour-{k}" for k in range(2000)]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    tenant = ui_platform.new_tenant()
    complete(
        ui_platform,
        tenant,
        model=ui_platform.base_model,
        prompt="Pick:",
        max_tokens=4,
        response_format=fmt,
    )
    cache = _admin_get(ui_platform, "/admin/engine")["grammar_cache"]
    assert cache["entries"] >= 1 and cache["bytes"] > 500_000  # 2,000 values: about 1 MB
    sign_in(page, ui_platform, ui_platform.context.admin_token, "/ui/operator/tenants", shots)
    page.click("nav >> text=Engine")
    page.wait_for_url(f"{ui_platform.url}/ui/operator/engine")
    wait_loaded(page)
    shown, hint = page.locator("#memory-grammars").inner_text().splitlines()
    assert shown == f"{_js_bytes(cache['bytes'])} of 256 MB"
    share = _js_bytes(64 << 20)  # "64.0 MB"
    entries, evicted = f"{cache['entries']:,}", f"{cache['evictions']:,}"
    assert hint == f"{entries} cached · at most {share} a tenant · {evicted} evicted"
    page.locator("#memory-table").scroll_into_view_if_needed()
    shots(page, "engine-grammar-cache")


def test_engine_panel_shows_each_tenants_share_next_to_its_weight(page, ui_platform, shots):
    """Two backlogged tenants of weights 1 and 3: the platform's own snapshot, with their
    service put in on its way to the page (a backlog on SmolLM2 would take minutes)."""
    light = ui_platform.new_tenant(weight=1.0, priority=2)
    heavy = ui_platform.new_tenant(weight=3.0, priority=2)
    figures = {
        light.id: dict(
            served_prompt_tokens=1200,
            served_output_tokens=1440,
            queued_requests=12,
            running_requests=2,
            share=0.262,
            weight_share=0.25,
        ),
        heavy.id: dict(
            served_prompt_tokens=3600,
            served_output_tokens=4310,
            queued_requests=11,
            running_requests=6,
            share=0.738,
            weight_share=0.75,
        ),
    }

    def backlogged(route):
        body = route.fetch().json()
        for tenant in body["tenants"]:
            tenant.update(figures.get(tenant["tenant_id"], {}))
        route.fulfill(json=body)

    page.route("**/admin/engine", backlogged)
    sign_in(page, ui_platform, ui_platform.context.admin_token, "/ui/operator/tenants", shots)
    page.click("nav >> text=Engine")
    page.wait_for_selector("#updated-at[data-refreshes]")
    shown = {}
    for tenant in (light, heavy):
        row = page.locator(f"#engine-tenants tr[data-tenant-id='{tenant.id}']")
        shown[tenant.id] = [text.splitlines() for text in row.locator("td").all_inner_texts()[1:]]
    assert shown[light.id] == [
        ["2"],
        ["1"],
        ["25.0%"],
        ["26.2%"],
        ["2,640", "1,200 prompt · 1,440 output"],
        ["12", "2 running"],
    ]
    assert shown[heavy.id] == [
        ["2"],
        ["3"],
        ["75.0%"],
        ["73.8%"],
        ["7,910", "3,600 prompt · 4,310 output"],
        ["11", "6 running"],
    ]
    # The bar reaches the share; the tick stands at the weight's share.
    bar = page.locator(f"#engine-tenants tr[data-tenant-id='{heavy.id}'] .share-bar")
    assert bar.locator("div").evaluate("el => el.style.width") == "73.8%"
    assert bar.locator(".share-target").evaluate("el => el.style.left") == "75%"
    assert "over the last 30 s" in page.text_content("#share-sub")
    page.locator("#engine-tenants").scroll_into_view_if_needed()
    shots(page, "engine-tenant-shares")


def test_api_errors_show_next_to_their_fields(page, ui_platform, shots):
    taken = ui_platform.new_tenant()
    taken_name = _admin_get(ui_platform, f"/admin/tenants/{taken.id}")["name"]
    sign_in(page, ui_platform, ui_platform.context.admin_token, "/ui/operator/tenants", shots)
    page.click("#new-tenant-toggle")
    page.fill("#name", "fresh-name")
    page.fill("#priority", "12")
    page.fill("#weight", "0")
    page.click("#create-tenant")
    page.wait_for_selector("[data-field='priority'].invalid")
    assert "less than or equal to 9" in page.text_content("#priority-error")
    assert "greater than 0" in page.text_content("#weight-error")
    assert page.text_content("#name-error") == ""
    shots(page, "invalid-fields")

    page.fill("#priority", "5")
    page.fill("#weight", "1")
    page.fill("#name", taken_name)
    page.click("#create-tenant")
    page.wait_for_selector("[data-field='name'].invalid")
    assert "already exists" in page.text_content("#name-error")
    assert page.text_content("#priority-error") == "" and page.text_content("#weight-error") == ""
    assert page.evaluate("document.activeElement.id") == "name"
    shots(page, "name-taken")
    names = [t["name"] for t in _admin_get(ui_platform, "/admin/tenants")]
    assert "fresh-name" not in names and names.count(taken_name) == 1
