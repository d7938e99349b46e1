"""The playground's other paths: chat mode (the chat template) streams what the chat API
answers, and Stop ends a long generation early."""

from __future__ import annotations

import httpx

from tests.fixtures.polling import eventually
from tests.platform.ui.conftest import sign_in, upload_adapter

QUESTION = "Name a colour of the sky."


def test_chat_mode_and_stop(page, ui_platform, adapter_dir, shots):
    tenant = ui_platform.new_tenant()
    upload_adapter(ui_platform, tenant, "chatty", adapter_dir)
    sign_in(page, ui_platform, tenant.key, "/ui/tenant/adapters", shots)
    page.goto(f"{ui_platform.url}/ui/tenant/playground?adapter=chatty")
    page.wait_for_selector("#model option[value='chatty']", state="attached")
    assert page.input_value("#model") == "chatty"  # preselected from the link
    assert page.input_value("#mode") == "chat"

    # Chat: greedy, the same answer the chat API gives.
    page.locator("#temperature").evaluate(
        "el => { el.value = '0'; el.dispatchEvent(new Event('input', {bubbles: true})); }"
    )
    page.fill("#max_tokens", "10")
    page.fill("#prompt", QUESTION)
    page.keyboard.press("Control+Enter")  # the shortcut the placeholder names
    page.wait_for_selector("#output[data-finished='true']")
    answer = httpx.post(
        f"{ui_platform.url}/v1/chat/completions",
        json={
            "model": "chatty",
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 10,
            "temperature": 0,
            "top_p": 1,
        },
        headers=tenant.headers,
        timeout=120,
    ).json()
    assert page.text_content("#output") == answer["choices"][0]["message"]["content"]
    shots(page, "chat-answer")

    # Stop: a long completion ends as soon as asked, and the page is ready for the next.
    page.select_option("#mode", "completion")
    page.fill("#max_tokens", "400")
    page.fill("#prompt", "Once upon a time")
    page.click("#generate")
    page.wait_for_function("() => document.querySelector('#output').textContent.length > 30")
    page.click("#stop")
    page.wait_for_selector("#output[data-finished='true']")
    assert "Finish stopped" in page.text_content("#run-metrics")
    assert page.is_enabled("#generate") and page.is_disabled("#stop")
    shots(page, "stopped")

    # The server let the request go when the page did: it was billed as aborted, for no more
    # tokens than the page had shown.
    def aborted() -> list[dict]:
        rows = httpx.get(
            f"{ui_platform.url}/v1/usage", params={"group_by": "request"}, headers=tenant.headers
        ).json()["rows"]
        return [row for row in rows if row["finish_reason"] == "abort"]

    [stopped] = eventually(aborted, "the stopped request's usage record")
    assert 0 < stopped["completion_tokens"] < 400
