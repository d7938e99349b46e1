"""The browser toolchain works: Debian's Chromium, driven by Playwright, reads our server."""

from __future__ import annotations

import json

from loramux.platform.app import create_app
from loramux.platform.context import build_context
from loramux.platform.settings import Settings
from tests.fixtures.browser import ServerThread


def test_chromium_reads_healthz_and_models(browser, tiny_model_dir, tmp_path, artifacts_dir):
    context = build_context(
        Settings(data_dir=tmp_path, model=str(tiny_model_dir)), log=lambda _: None
    )
    with ServerThread(create_app(context)) as server:
        page = browser.new_page()
        try:
            response = page.goto(f"{server.url}/healthz")
            assert response is not None and response.status == 200
            assert json.loads(page.inner_text("body")) == {"status": "ok"}
            page.set_extra_http_headers({"Authorization": f"Bearer {context.admin_token}"})
            response = page.goto(f"{server.url}/v1/models")
            assert response is not None and response.status == 200
            models = json.loads(page.inner_text("body"))
            assert [m["id"] for m in models["data"]] == [tiny_model_dir.name]
            page.screenshot(path=str(artifacts_dir / "models.png"))
        finally:
            page.close()
