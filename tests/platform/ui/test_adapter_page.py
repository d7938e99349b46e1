"""A tenant's adapter page in a real browser: its versions and which one the bare name
reaches (moved back and forward), its pin on the device within the quota the operator gave,
and the tenants it is shared with, each with what it ran; every change checked through the
API the page uses, and each state shot."""

from __future__ import annotations

import httpx

from tests.platform.ui.conftest import (
    click_and_wait_for_toast,
    complete,
    sign_in,
    upload_adapter,
    wait_loaded,
)


def _tenant_name(platform, tenant) -> str:
    return httpx.get(f"{platform.url}/v1/me", headers=tenant.headers).json()["tenant_name"]


def test_a_tenant_moves_pins_and_shares_its_adapter_on_its_page(
    page, ui_platform, shots, make_adapter, smollm2_dir
):
    owner, grantee = ui_platform.new_tenant(), ui_platform.new_tenant()
    for seed in (21, 22):
        folder = make_adapter(smollm2_dir, rank=8, targets=("q_proj", "v_proj"), seed=seed)
        uploaded = upload_adapter(ui_platform, owner, "helper", folder)
    size = uploaded["size_bytes"]
    quota = httpx.patch(
        f"{ui_platform.url}/admin/tenants/{owner.id}",
        json={"pin_quota_bytes": 4 * size},
        headers=ui_platform.admin,
    )
    assert quota.status_code == 200, quota.text
    sign_in(page, ui_platform, owner.key, "/ui/tenant/adapters", shots)
    wait_loaded(page)
    page.click("#adapters-table a:has-text('helper')")
    page.wait_for_url(f"{ui_platform.url}/ui/tenant/adapters/helper")
    wait_loaded(page)
    assert page.text_content("#versions-table tr[data-version='2'] td:nth-child(7)").strip() == (
        "reached by the name"
    )
    shots(page, "adapter-versions")

    # Roll the name back to v1, then follow the newest again.
    click_and_wait_for_toast(page, "button[data-alias='1']", "now reaches v1")
    page.wait_for_selector("#versions-table tr[data-version='1'] .badge.ok")
    versions = httpx.get(f"{ui_platform.url}/v1/adapters/helper/versions", headers=owner.headers)
    assert versions.json()["alias_version"] == 1
    shots(page, "adapter-name-held-at-v1")
    click_and_wait_for_toast(page, "#follow-newest", "follows its newest version again")
    page.wait_for_selector("#follow-newest", state="hidden")

    # Pin the bare name's version: the engine holds it.
    click_and_wait_for_toast(page, "#pin-submit", "is pinned on the device")
    page.wait_for_function(
        "() => document.querySelector('#pin-status').textContent.includes('Held on the device')"
    )
    pin = httpx.get(f"{ui_platform.url}/v1/adapters/helper/pin", headers=owner.headers).json()
    assert (pin["version"], pin["state"], pin["pinned_bytes"]) == (2, "pinned", size)
    assert "of your" in page.text_content("#pin-quota-text")
    shots(page, "adapter-pinned")

    # Share v1 only with the other tenant by name; a name that is no tenant is refused.
    page.fill("#grantee", "no-such-tenant")
    page.click("#grant-submit")
    page.wait_for_selector("[data-field='grantee'].invalid")
    assert "No tenant named" in page.text_content("#grantee-error")
    grantee_name = _tenant_name(ui_platform, grantee)
    page.fill("#grantee", grantee_name)
    page.select_option("#grant-version", "1")
    click_and_wait_for_toast(page, "#grant-submit", f"{grantee_name} can call")
    page.wait_for_selector(f"#grants-table tr[data-grantee='{grantee_name}']")
    owner_name = _tenant_name(ui_platform, owner)
    answer = complete(
        ui_platform, grantee, model=f"{owner_name}/helper", prompt="Hello", max_tokens=4
    )
    page.reload()
    wait_loaded(page)
    row = page.text_content(f"#grants-table tr[data-grantee='{grantee_name}']")
    assert "v1 only" in row
    used = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
    cells = page.locator(f"#grants-table tr[data-grantee='{grantee_name}'] td.num")
    assert (cells.nth(0).text_content(), cells.nth(1).text_content()) == ("1", str(used))
    assert page.text_content("#shared-model") == f"{owner_name}/helper"
    shots(page, "adapter-shared")

    # Revoke: the grantee's next request is refused.
    page.click(f"#grants-table tr[data-grantee='{grantee_name}'] .btn-danger")
    click_and_wait_for_toast(
        page,
        f"#grants-table tr[data-grantee='{grantee_name}'] .btn-danger",
        "can no longer call",
    )
    refused = httpx.post(
        f"{ui_platform.url}/v1/completions",
        json={"model": f"{owner_name}/helper", "prompt": "Hello", "max_tokens": 4},
        headers=grantee.headers,
        timeout=60,
    )
    assert refused.status_code == 404, refused.text

    # The operator's engine page marks the pinned version on the device.
    page.click("#sign-out")
    page.wait_for_url("**/ui/signin?signed_out=1")
    sign_in(page, ui_platform, ui_platform.context.admin_token, "/ui/operator/tenants", shots)
    page.goto(f"{ui_platform.url}/ui/operator/engine")
    wait_loaded(page)
    chip = page.locator("#device-tier .chip", has_text="/ helper v2")
    assert chip.text_content().endswith("· pinned"), chip.text_content()
    shots(page, "engine-pinned")
