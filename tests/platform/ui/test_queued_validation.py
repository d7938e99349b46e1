"""With a task broker, an upload answers 202 and a Celery worker decides later: the upload
page shows the adapter validating and keeps polling until it is ready, or failed with the
worker's reason. Real PostgreSQL, Redis and Celery worker; the tiny model keeps it quick."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from loramux.platform.settings import Settings
from tests.platform.e2e.conftest import Platform, start_platform
from tests.platform.tasks.worker_process import running_worker, worker_env
from tests.platform.ui.conftest import ADAPTER_FILES, sign_in, wait_loaded


@pytest.fixture
def queued_platform(
    tmp_path, tiny_model_dir, postgres_database_url, redis_url
) -> Iterator[Platform]:
    settings = Settings(
        data_dir=tmp_path / "data",
        model=str(tiny_model_dir),
        database_url=postgres_database_url,
        # A Redis database of its own: no other test's messages reach this worker.
        celery_broker_url=redis_url.rsplit("/", 1)[0] + "/4",
    )
    with start_platform(settings) as platform:
        try:
            yield platform
        finally:
            platform.context.tasks.close()


@pytest.fixture
def nan_adapter(make_adapter, tiny_model_dir, tmp_path) -> Path:
    """Well-formed files whose weights hold a NaN: only the worker's full read finds it."""
    good = make_adapter(tiny_model_dir, rank=4, targets=("v_proj",), seed=31)
    tensors = load_file(str(good / ADAPTER_FILES[1]))
    first = sorted(tensors)[0]
    tensors[first] = tensors[first].clone()
    tensors[first].view(-1)[0] = float("nan")
    out = tmp_path / "nan-adapter"
    out.mkdir()
    save_file(tensors, str(out / ADAPTER_FILES[1]))
    (out / ADAPTER_FILES[0]).write_bytes((good / ADAPTER_FILES[0]).read_bytes())
    return out


def _upload(page, name: str, adapter: Path) -> None:
    page.click("#upload-reset")
    page.fill("#adapter-name", name)
    page.set_input_files("#files", [str(adapter / f) for f in ADAPTER_FILES])
    page.click("#upload-submit")


def test_page_follows_a_queued_validation_to_its_verdict(
    page, queued_platform, make_adapter, tiny_model_dir, nan_adapter, tmp_path, shots
):
    good = make_adapter(tiny_model_dir, rank=4, targets=("q_proj", "v_proj"), seed=32)
    tenant = queued_platform.new_tenant()
    sign_in(page, queued_platform, tenant.key, "/ui/tenant/adapters", shots)
    wait_loaded(page)

    # No worker yet: the upload is accepted and waits in the queue, and the page says so.
    _upload(page, "queued-good", good)
    page.wait_for_selector("[data-step='validate'].active")
    assert "Validating against the base model" in page.text_content("#upload-status")
    page.locator("#adapters-table tr[data-adapter='queued-good']").get_by_text(
        "Validating"
    ).wait_for()
    shots(page, "validating-in-queue")

    context = queued_platform.context
    env = worker_env(
        broker_url=context.settings.celery_broker_url,
        database_url=context.settings.database_url,
        data_dir=context.settings.data_dir,
    )
    with running_worker(env, tmp_path / "worker.log"):
        # The worker's verdict reaches the page that kept polling.
        page.wait_for_selector("[data-step='ready'].done")
        assert page.text_content("#upload-status").startswith("Ready: queued-good v1")
        page.locator("#adapters-table tr[data-adapter='queued-good']").get_by_text(
            "Ready"
        ).wait_for()
        shots(page, "ready-after-worker")

        _upload(page, "poisoned", nan_adapter)
        page.wait_for_selector("[data-step='validate'].failed")
        reason = page.text_content("#upload-error")
        assert reason.startswith("Adapter rejected: ") and "NaN" in reason
        failed_row = page.locator("#adapters-table tr[data-adapter='poisoned']")
        failed_row.get_by_text("Failed").wait_for()
        assert "NaN" in failed_row.inner_text()
        shots(page, "failed-after-worker")
