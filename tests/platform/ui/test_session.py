"""Signing in and out: a bad token is refused with the API's words, signing out clears the
token, pages follow the role, a revoked key ends the session, all by keyboard too."""

from __future__ import annotations

import re

import httpx

from tests.platform.ui.conftest import DESKTOP, session_token, sign_in, wait_loaded


def test_bad_token_is_refused_next_to_the_field(page, ui_platform, shots):
    page.goto(f"{ui_platform.url}/ui/signin")
    page.click("#signin-submit")
    assert page.text_content("#token-error") == "Enter the admin token or an API key."
    page.fill("#token", "lmx-not-a-real-key")
    page.click("#signin-submit")
    page.wait_for_selector("#token-error:text('not accepted')")
    assert page.text_content("#token-error") == (
        "That token was not accepted: Invalid or revoked API key."
    )
    assert page.get_attribute("#token", "aria-invalid") == "true"
    assert session_token(page) is None
    assert page.url == f"{ui_platform.url}/ui/signin"
    shots(page, "bad-token")


def test_sign_out_clears_the_token_and_pages_follow_the_role(page, ui_platform, shots):
    tenant = ui_platform.new_tenant()
    sign_in(page, ui_platform, ui_platform.context.admin_token, "/ui/operator/tenants", shots)
    assert session_token(page) == ui_platform.context.admin_token
    # An operator sent to a tenant page lands on the operator's home instead.
    page.goto(f"{ui_platform.url}/ui/tenant/playground")
    page.wait_for_url(f"{ui_platform.url}/ui/operator/tenants")
    wait_loaded(page)
    shots(page, "operator-home-instead-of-tenant-page")

    page.click("#sign-out")
    page.wait_for_url(f"{ui_platform.url}/ui/signin?signed_out=1")
    assert session_token(page) is None
    assert page.evaluate("sessionStorage.length") == 0
    assert "signed out" in page.text_content("#signin-notice")
    shots(page, "signed-out")
    # Signed out, a console page sends the visitor to sign in, then back to it.
    page.goto(f"{ui_platform.url}/ui/operator/engine")
    page.wait_for_url("**/ui/signin?next=*")
    shots(page, "sign-in-to-continue")
    page.fill("#token", ui_platform.context.admin_token)
    page.click("#signin-submit")
    page.wait_for_url(f"{ui_platform.url}/ui/operator/engine")
    wait_loaded(page)
    shots(page, "back-on-the-engine-page")

    page.click("#sign-out")
    sign_in(page, ui_platform, tenant.key, "/ui/tenant/adapters", shots)
    page.goto(f"{ui_platform.url}/ui/operator/tenants")  # not for tenants
    page.wait_for_url(f"{ui_platform.url}/ui/tenant/adapters")
    wait_loaded(page)
    shots(page, "tenant-home-instead-of-operator-page")


def test_a_key_revoked_in_the_operator_console_ends_the_tenant_session(
    page, browser, ui_platform, shots
):
    tenant = ui_platform.new_tenant()
    sign_in(page, ui_platform, tenant.key, "/ui/tenant/adapters", shots)
    wait_loaded(page)

    # The operator, in a browser of their own, revokes the key (a second click confirms).
    operator = browser.new_context(viewport=DESKTOP).new_page()
    try:
        sign_in(
            operator, ui_platform, ui_platform.context.admin_token, "/ui/operator/tenants", shots
        )
        operator.goto(f"{ui_platform.url}/ui/operator/tenants/{tenant.id}")
        wait_loaded(operator)
        row = operator.locator("#keys-table tbody tr", has_text=tenant.key[:12])
        row.get_by_role("button", name="Revoke").click()
        row.get_by_role("button", name="Confirm revoke").click()
        row.get_by_text("Revoked").wait_for()
        shots(operator, "operator-revoked-key")
    finally:
        operator.context.close()
    me = httpx.get(f"{ui_platform.url}/v1/me", headers=tenant.headers)
    assert me.status_code == 401

    page.click("nav >> text=Usage")
    page.wait_for_url("**/ui/signin?expired=*")
    assert session_token(page) is None
    assert "Your session ended: Invalid or revoked API key." in page.text_content("#signin-notice")
    shots(page, "session-ended")


def test_keyboard_alone_signs_in_and_navigates(page, ui_platform, shots):
    page.goto(f"{ui_platform.url}/ui/signin")
    assert page.evaluate("document.activeElement.id") == "token"  # focused on arrival
    shots(page, "sign-in-focused")
    page.keyboard.type(ui_platform.context.admin_token)
    page.keyboard.press("Enter")
    page.wait_for_url(f"{ui_platform.url}/ui/operator/tenants")
    wait_loaded(page)

    # Tab from the top: the skip link first, then the console's links in order.
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent.trim()") == "Skip to content"
    reached = []
    for _ in range(8):
        page.keyboard.press("Tab")
        reached.append(page.evaluate("document.activeElement.textContent.trim()"))
        if reached[-1] == "Usage & billing":
            break
    assert reached[-1] == "Usage & billing", reached
    focus = page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
    assert focus != "none"  # a visible focus ring
    shots(page, "focus-on-usage-link")
    page.keyboard.press("Enter")
    # The usage page writes its period into the address as it loads (history.replaceState),
    # so the address may already carry ?start=... when the wait begins: both forms are it.
    usage = re.escape(f"{ui_platform.url}/ui/operator/usage")
    page.wait_for_url(re.compile(rf"{usage}(\?.*)?$"))
    wait_loaded(page)
    shots(page, "usage-by-keyboard")
