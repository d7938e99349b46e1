"""The main story in a real browser: the operator signs in, creates a tenant and its key;
the tenant signs in with that key, uploads a PEFT adapter, watches it become ready and
streams a completion from it in the playground."""

from __future__ import annotations

import uuid

import httpx

from tests.platform.e2e.conftest import Tenant
from tests.platform.ui.conftest import (
    ADAPTER_FILES,
    complete,
    session_token,
    wait_loaded,
)

PROMPT = "The three most useful kitchen tools are"
MAX_TOKENS = 12


def _set_range(page, selector: str, value: str) -> None:
    # Playwright cannot type into a range input; set it as a user's drag would.
    page.locator(selector).evaluate(
        "(el, v) => { el.value = v; el.dispatchEvent(new Event('input', {bubbles: true})); }",
        value,
    )


def test_journey_operator_key_tenant_upload_playground(page, ui_platform, adapter_dir, shots):
    url = ui_platform.url
    name = f"acme-{uuid.uuid4().hex[:6]}"

    # The operator signs in: /ui sends a signed-out visitor to the sign-in page.
    page.goto(f"{url}/ui")
    page.wait_for_url(f"{url}/ui/signin")
    shots(page, "sign-in")
    page.fill("#token", ui_platform.context.admin_token)
    page.click("#signin-submit")
    page.wait_for_url(f"{url}/ui/operator/tenants")
    wait_loaded(page)
    shots(page, "operator-tenants")

    # ... creates a tenant with the form,
    page.click("#new-tenant-toggle")
    page.fill("#name", name)
    page.fill("#priority", "4")
    page.fill("#weight", "1.5")
    page.fill("#input_price_per_mtok", "0.5")
    page.fill("#output_price_per_mtok", "1.5")
    shots(page, "new-tenant-form")
    page.click("#create-tenant")
    page.wait_for_url(f"{url}/ui/operator/tenants/*")
    tenant_id = page.url.rsplit("/", 1)[-1]
    wait_loaded(page)
    assert page.text_content("#tenant-name") == name
    stored = httpx.get(f"{url}/admin/tenants/{tenant_id}", headers=ui_platform.admin).json()
    assert (stored["name"], stored["priority"], stored["weight"]) == (name, 4, 1.5)
    assert (stored["input_price_per_mtok"], stored["output_price_per_mtok"]) == (0.5, 1.5)

    # ... and a key, shown once with a copy button.
    page.fill("#key-name", "laptop")
    page.click("#create-key")
    page.wait_for_selector("#new-key-box:not([hidden])")
    key = page.text_content("#new-key")
    assert key.startswith("lmx-") and len(key) > 40
    page.click("#copy-key")
    page.wait_for_selector("#copy-key:text('Copied')")
    key_row = page.locator("#keys-table tbody tr", has_text=key[:12])
    assert "Active" in key_row.inner_text() and "laptop" in key_row.inner_text()
    shots(page, "tenant-with-new-key")

    # Signing out clears the token from the browser.
    page.click("#sign-out")
    page.wait_for_url(f"{url}/ui/signin?signed_out=1")
    assert session_token(page) is None
    shots(page, "signed-out")

    # The tenant signs in with the key the page showed.
    page.fill("#token", key)
    page.click("#signin-submit")
    page.wait_for_url(f"{url}/ui/tenant/adapters")
    wait_loaded(page)
    assert name in page.text_content("#whoami")
    shots(page, "tenant-adapters-empty")

    # ... uploads the adapter's two files with the file picker and watches it validate.
    page.fill("#adapter-name", "kitchen-helper")
    page.set_input_files("#files", [str(adapter_dir / f) for f in ADAPTER_FILES])
    assert page.locator("#file-list li").count() == 2
    page.click("#upload-submit")
    page.wait_for_selector("[data-step='ready'].done")
    status = page.text_content("#upload-status")
    assert status.startswith("Ready: kitchen-helper v1") and "rank 8" in status
    assert page.get_attribute("#progress", "aria-valuenow") == "100"
    row = page.locator("#adapters-table tbody tr[data-adapter='kitchen-helper']")
    row.get_by_text("Ready").wait_for()
    shots(page, "adapter-ready")

    # ... and streams a greedy completion in the playground.
    page.click("nav >> text=Playground")
    page.wait_for_url(f"{url}/ui/tenant/playground")
    page.wait_for_selector("#model option[value='kitchen-helper']", state="attached")
    page.select_option("#model", "kitchen-helper")
    page.select_option("#mode", "completion")
    page.fill("#max_tokens", str(MAX_TOKENS))
    _set_range(page, "#temperature", "0")
    page.fill("#prompt", PROMPT)
    # Record every text the output shows while it streams.
    page.evaluate(
        """() => {
          window.__seen = [];
          const out = document.querySelector('#output');
          new MutationObserver(() => window.__seen.push(out.textContent))
            .observe(out, {childList: true, characterData: true, subtree: true});
        }"""
    )
    page.click("#generate")
    page.wait_for_selector("#output[data-finished='true']")
    streamed = page.text_content("#output")
    seen = [text for text in page.evaluate("window.__seen") if text]
    shots(page, "playground-streamed")

    reference = complete(
        ui_platform,
        Tenant(id=tenant_id, key=key),
        model="kitchen-helper",
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        top_p=1,
    )
    assert streamed == reference["choices"][0]["text"]
    partial = {text for text in seen if text != streamed and streamed.startswith(text)}
    assert partial, f"the output never showed a partial text; saw {seen!r}"
    assert "Tokens" in page.text_content("#run-metrics")
