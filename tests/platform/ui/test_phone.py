"""Every console page at phone width (390×844): nothing wider than the screen, the menu
opens and leads on, the data shows."""

from __future__ import annotations

from tests.platform.ui.conftest import complete, sign_in, upload_adapter, wait_loaded

OPERATOR_PAGES = ("tenants", "tenant", "adapters", "usage", "engine")
TENANT_PAGES = ("adapters", "playground", "usage")
FITS = "() => document.documentElement.scrollWidth <= window.innerWidth"


def _visit(page, url: str, shots, label: str) -> None:
    page.goto(url)
    wait_loaded(page)
    assert page.evaluate(FITS), f"{label} is wider than the screen"
    shots(page, label)


def test_every_page_fits_a_phone(phone_page, ui_platform, adapter_dir, shots):
    page = phone_page
    tenant = ui_platform.new_tenant(input_price_per_mtok=1, output_price_per_mtok=2)
    upload_adapter(ui_platform, tenant, "pocket", adapter_dir)
    complete(ui_platform, tenant, model="pocket", prompt="Hi", max_tokens=3, ignore_eos=True)

    sign_in(page, ui_platform, ui_platform.context.admin_token, "/ui/operator/tenants", shots)
    assert page.locator("#sidebar-menu").is_hidden()  # folded behind the menu button
    page.click("#menu-toggle")
    assert page.get_attribute("#menu-toggle", "aria-expanded") == "true"
    assert page.locator("#sidebar-menu").is_visible()
    shots(page, "operator-menu-open")
    for name in OPERATOR_PAGES:
        path = f"tenants/{tenant.id}" if name == "tenant" else name
        _visit(page, f"{ui_platform.url}/ui/operator/{path}", shots, f"operator-{name}")

    page.click("#menu-toggle")
    page.click("#sign-out")
    sign_in(page, ui_platform, tenant.key, "/ui/tenant/adapters", shots)
    for name in TENANT_PAGES:
        _visit(page, f"{ui_platform.url}/ui/tenant/{name}", shots, f"tenant-{name}")
    page.click("#menu-toggle")
    page.click("#sidebar-menu >> text=Adapters")
    page.wait_for_url(f"{ui_platform.url}/ui/tenant/adapters")
