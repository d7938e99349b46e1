"""The admin UI in a real browser: one SmolLM2 platform server for the package, a fresh
browser context per test, helpers to sign in and to save a screenshot of every page.

The server is the embedded default (SQLite, local store, in-process tasks and engine) on
the real SmolLM2; tests make their own tenants, so they do not depend on each other.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from loramux.platform.settings import Settings
from tests.platform.e2e.conftest import Platform, Tenant, start_platform

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


@pytest.fixture(scope="package")
def ui_platform(tmp_path_factory, smollm2_dir) -> Iterator[Platform]:
    settings = Settings(data_dir=tmp_path_factory.mktemp("ui-platform"), model=str(smollm2_dir))
    with start_platform(settings) as platform:
        yield platform


@pytest.fixture(scope="package")
def adapter_dir(make_adapter, smollm2_dir) -> Path:
    """A real PEFT LoRA adapter for SmolLM2 (rank 8 on q/v)."""
    return make_adapter(smollm2_dir, rank=8, targets=("q_proj", "v_proj"), seed=7)


def upload_adapter(platform: Platform, tenant: Tenant, name: str, adapter: Path) -> dict:
    """Upload over the API (for tests whose subject is not the upload page)."""
    files = [("files", (n, (adapter / n).read_bytes())) for n in ADAPTER_FILES]
    response = httpx.post(
        f"{platform.url}/v1/adapters",
        data={"name": name},
        files=files,
        headers=tenant.headers,
        timeout=120,
    )
    assert response.status_code == 201, response.text
    return response.json()


def complete(platform: Platform, tenant: Tenant, **body) -> dict:
    response = httpx.post(
        f"{platform.url}/v1/completions", json=body, headers=tenant.headers, timeout=120
    )
    assert response.status_code == 200, response.text
    return response.json()


def adapter_archive(adapter: Path, out: Path) -> Path:
    with tarfile.open(out, "w:gz") as archive:
        for name in ADAPTER_FILES:
            archive.add(adapter / name, arcname=name)
    return out


# --- the browser side ------------------------------------------------------------------------


@dataclass
class Shots:
    """Saves a full-page screenshot per visited page under test-artifacts/ui/."""

    folder: Path
    prefix: str
    taken: list[Path] = field(default_factory=list)

    def __call__(self, page, label: str) -> Path:
        slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
        path = self.folder / f"{self.prefix}-{len(self.taken) + 1:02d}-{slug}.png"
        page.evaluate("window.scrollTo(0, 0)")  # sticky parts drawn where they rest
        page.screenshot(path=str(path), full_page=True)
        self.taken.append(path)
        return path


@pytest.fixture
def shots(request, artifacts_dir) -> Shots:
    folder = artifacts_dir / "ui"
    folder.mkdir(parents=True, exist_ok=True)
    prefix = re.sub(r"^test_", "", request.node.name)
    prefix = re.sub(r"[^a-z0-9]+", "-", prefix.lower()).strip("-")
    for old in folder.glob(f"{prefix}-*.png"):  # a rerun replaces, never mixes
        old.unlink()
    return Shots(folder, prefix)


def _page_fixture(browser, viewport) -> Iterator[object]:
    context = browser.new_context(viewport=viewport, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(60_000)  # generous: CPU inference on a shared 2-core machine
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
    page.on(
        "console",
        lambda msg: (
            errors.append(f"console: {msg.text}")
            # The browser logs every failed HTTP response; the pages show those themselves.
            if msg.type == "error" and "Failed to load resource" not in msg.text
            else None
        ),
    )
    try:
        yield page
    finally:
        context.close()
    assert errors == [], "the page logged JavaScript errors"


@pytest.fixture
def page(browser) -> Iterator[object]:
    """A desktop-sized page (1280×800) in its own context; JS errors fail the test."""
    yield from _page_fixture(browser, DESKTOP)


@pytest.fixture
def phone_page(browser) -> Iterator[object]:
    """A phone-width page (390×844)."""
    yield from _page_fixture(browser, PHONE)


def sign_in(page, platform: Platform, token: str, home: str, shots: Shots) -> None:
    """Sign in through the form and land on ``home`` (a /ui path), both pages shot."""
    page.goto(f"{platform.url}/ui/signin")
    page.fill("#token", token)
    shots(page, "sign-in")
    page.click("#signin-submit")
    page.wait_for_url(f"{platform.url}{home}")
    wait_loaded(page)
    shots(page, home.removeprefix("/ui/"))


def wait_loaded(page) -> None:
    """Until the page's skeletons are all replaced by data."""
    page.wait_for_function("() => !document.querySelector('.skeleton')")


def click_and_wait_for_toast(page, button: str, text: str) -> None:
    """Click `button` and wait for a new toast containing `text`: an earlier toast of the same
    text may still be on screen (they last 5 s), so this counts them before the click."""
    toasts = page.locator("#toasts .toast", has_text=text)
    before = toasts.count()
    page.click(button)
    page.wait_for_function(
        "([text, before]) => [...document.querySelectorAll('#toasts .toast')]"
        ".filter((toast) => toast.textContent.includes(text)).length > before",
        arg=[text, before],
    )


def session_token(page) -> str | None:
    return page.evaluate("() => sessionStorage.getItem('loramux.token')")
