"""The operator sets a tenant's default request deadline, queue limit and pin quota on its
page; the tenant's next request is held to it over HTTP, and clearing the field gives the
server's setting back."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.platform.ui.conftest import click_and_wait_for_toast, sign_in, wait_loaded


def _tenant(platform, tenant_id: str) -> dict:
    response = httpx.get(f"{platform.url}/admin/tenants/{tenant_id}", headers=platform.admin)
    assert response.status_code == 200, response.text
    return response.json()


def _long_completion(platform, tenant) -> httpx.Response:
    body = {"model": platform.base_model, "prompt": "Tell", "max_tokens": 400, "ignore_eos": True}
    return httpx.post(
        f"{platform.url}/v1/completions", json=body, headers=tenant.headers, timeout=120
    )


def test_the_operator_sets_a_tenants_deadline_and_queue_limit(page, ui_platform, shots):
    tenant = ui_platform.new_tenant()
    sign_in(page, ui_platform, ui_platform.context.admin_token, "/ui/operator/tenants", shots)
    page.goto(f"{ui_platform.url}/ui/operator/tenants/{tenant.id}")
    wait_loaded(page)
    assert page.get_attribute("#request_timeout_s", "placeholder") == "Server maximum"

    page.fill("#request_timeout_s", "0")
    page.click("#save-limits")
    page.wait_for_selector("[data-field='request_timeout_s'].invalid")
    assert "greater than 0" in page.text_content("#request_timeout_s-error")

    page.fill("#request_timeout_s", "0.5")
    page.fill("#max_queued_requests", "3")
    page.fill("#pin_quota_bytes", "104857600")  # 100 MiB of adapters it may pin
    click_and_wait_for_toast(page, "#save-limits", "Saved limits, budget and deadline")
    shots(page, "tenant-deadline-set")
    stored = _tenant(ui_platform, tenant.id)
    assert (stored["request_timeout_s"], stored["max_queued_requests"]) == (0.5, 3)
    assert stored["pin_quota_bytes"] == 104857600

    response = _long_completion(ui_platform, tenant)
    assert response.status_code == 504, response.text
    assert "0.5 s (the tenant's default)" in response.json()["error"]["message"]
    # The official client meets the stream's last event as an error naming the deadline,
    # after the chunks that came before it.
    client = openai.OpenAI(
        base_url=f"{ui_platform.url}/v1", api_key=tenant.key, max_retries=0, timeout=60
    )
    stream = client.completions.create(
        model=ui_platform.base_model,
        prompt="Tell",
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = 0
    with pytest.raises(openai.APIError, match=r"passed its deadline of 0\.5 s"):
        for _ in stream:
            chunks += 1
    assert chunks >= 1

    page.fill("#request_timeout_s", "")
    page.fill("#max_queued_requests", "")
    click_and_wait_for_toast(page, "#save-limits", "Saved limits, budget and deadline")
    stored = _tenant(ui_platform, tenant.id)
    assert (stored["request_timeout_s"], stored["max_queued_requests"]) == (None, None)
    page.reload()
    wait_loaded(page)
    assert page.input_value("#request_timeout_s") == ""
