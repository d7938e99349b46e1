"""The engine panel's speculative decoding block, on a SmolLM2 platform of its own whose
engine speculates with n-gram proposals (prompt lookup): after a few requests it shows the
method, k, and per adapter what was proposed, accepted and gained, with the totals."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from loramux.platform.settings import Settings
from tests.platform.e2e.conftest import Platform, start_platform
from tests.platform.ui.conftest import sign_in, upload_adapter, wait_loaded

# A pattern to go on with: what prompt lookup predicts well.
PATTERN = "red, green, blue, red, green, blue, red, green, blue, red,"


@pytest.fixture(scope="module")
def ngram_platform(tmp_path_factory, smollm2_dir) -> Iterator[Platform]:
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("ui-ngram-platform"),
        model=str(smollm2_dir),
        speculative_method="ngram",
        num_speculative_tokens=4,
    )
    with start_platform(settings) as platform:
        yield platform


def _complete(platform: Platform, tenant, model: str, **extra) -> dict:
    body = {
        "model": model,
        "prompt": PATTERN,
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    response = httpx.post(
        f"{platform.url}/v1/completions", json=body, headers=tenant.headers, timeout=120
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_engine_panel_shows_speculation_per_adapter(page, ngram_platform, adapter_dir, shots):
    tenant = ngram_platform.new_tenant()
    upload_adapter(ngram_platform, tenant, "echo", adapter_dir)
    for model in (ngram_platform.base_model, "echo"):
        _complete(ngram_platform, tenant, model)
    snapshot = httpx.get(f"{ngram_platform.url}/admin/engine", headers=ngram_platform.admin)
    spec = snapshot.json()["speculation"]
    base, echo = spec["adapters"]
    assert base["engine_name"] == "" and echo["adapter"] == "echo"
    assert base["accepted_tokens"] > 0, spec  # SmolLM2 went on with the pattern

    sign_in(page, ngram_platform, ngram_platform.context.admin_token, "/ui/operator/tenants", shots)
    page.click("nav >> text=Engine")
    page.wait_for_url(f"{ngram_platform.url}/ui/operator/engine")
    wait_loaded(page)
    assert page.text_content("#spec-method") == "n-gram (prompt lookup)"
    assert page.text_content("#spec-detail").startswith("k = 4: up to 4 proposed tokens")
    assert page.locator("#spec-off").is_hidden()
    shown = {}
    for row in (base, echo):
        line = page.locator(f"#spec-table tbody tr[data-engine-name='{row['engine_name']}']")
        shown[row["engine_name"]] = [
            t.splitlines() for t in line.locator("th, td").all_inner_texts()
        ]
    labels = {"": "Base model", echo["engine_name"]: f"{echo['tenant_name']} / echo v1"}
    for row in (base, echo):
        label, proposed, accepted, rate, per_step = shown[row["engine_name"]]
        assert label == [labels[row["engine_name"]]]
        assert proposed == [f"{row['proposed_tokens']:,}", f"{row['verify_steps']:,} verify steps"]
        assert accepted == [f"{row['accepted_tokens']:,}"]
        # One decimal of a percentage, two of tokens per step (JS rounds ties up).
        assert float(rate[0].removesuffix("%")) == pytest.approx(
            row["acceptance_rate"] * 100, abs=0.051
        )
        assert float(per_step[0]) == pytest.approx(row["tokens_per_step"], abs=0.0051)
        assert per_step[1] == f"{row['generated_tokens']:,} tokens / {row['decode_steps']:,} steps"
    total = page.locator("#spec-total").locator("th, td").all_inner_texts()
    assert total[0] == "All adapters"
    assert total[1].splitlines()[0] == f"{spec['total']['proposed_tokens']:,}"
    assert float(total[4].splitlines()[0]) > 1.0  # speculation gained: more than a token a step
    page.locator("#spec-table").scroll_into_view_if_needed()
    shots(page, "engine-speculation")


def test_engine_panel_says_when_engines_speculate_differently(page, ui_platform, shots):
    """Two engines, one speculating and one not: the platform's own snapshot, changed on its
    way to the page (a second engine process is not needed to draw it)."""

    def mixed(route):
        body = route.fetch().json()
        body["speculation"].update(method="mixed", num_speculative_tokens=4)
        local = body["engines"][0]
        body["engines"] = [
            {**local, "engine_id": "gpu-0", "speculative_method": "ngram"}
            | {"num_speculative_tokens": 4, "url": "http://10.0.0.5:8001"},
            {**local, "engine_id": "gpu-1", "speculative_method": "off"}
            | {"num_speculative_tokens": 0, "url": "http://10.0.0.6:8001"},
        ]
        route.fulfill(json=body)

    page.route("**/admin/engine", mixed)
    sign_in(page, ui_platform, ui_platform.context.admin_token, "/ui/operator/tenants", shots)
    page.click("nav >> text=Engine")
    page.wait_for_selector("#updated-at[data-refreshes]")
    assert page.text_content("#spec-method") == "Mixed"
    assert page.text_content("#spec-detail") == (
        "the engines differ: gpu-0 ngram (k = 4), gpu-1 off"
    )
    assert page.locator("#spec-off").is_hidden()
    page.locator("#spec-table").scroll_into_view_if_needed()
    shots(page, "engine-speculation-mixed")
