"""Uploading adapters in the browser: an archive dropped on the page becomes ready; a broken
adapter shows the validator's reason and leaves nothing behind; bad input is explained
next to the field that caused it."""

from __future__ import annotations

import base64
import json
import shutil

import httpx

from tests.platform.ui.conftest import (
    ADAPTER_FILES,
    adapter_archive,
    sign_in,
    wait_loaded,
)

DROP = """([selector, files, drop]) => {
  const data = new DataTransfer();
  for (const file of files) {
    const bytes = Uint8Array.from(atob(file.b64), (c) => c.charCodeAt(0));
    data.items.add(new File([bytes], file.name));
  }
  const zone = document.querySelector(selector);
  const fire = (type) => zone.dispatchEvent(
    new DragEvent(type, {dataTransfer: data, bubbles: true, cancelable: true}));
  fire("dragenter");
  fire("dragover");
  if (drop) fire("drop");
}"""


def drag_files(page, paths, *, drop: bool) -> None:
    """Drag ``paths`` over the drop zone, as the browser does for files from the desktop,
    and drop them when ``drop``."""
    files = [{"name": p.name, "b64": base64.b64encode(p.read_bytes()).decode()} for p in paths]
    page.evaluate(DROP, ["#dropzone", files, drop])


def _adapters(platform, tenant) -> list[dict]:
    response = httpx.get(f"{platform.url}/v1/adapters", headers=tenant.headers)
    assert response.status_code == 200, response.text
    return response.json()["data"]


def test_dropped_archive_becomes_ready_and_can_be_deleted(
    page, ui_platform, adapter_dir, tmp_path, shots
):
    tenant = ui_platform.new_tenant()
    archive = adapter_archive(adapter_dir, tmp_path / "recipes-v2.tar.gz")
    sign_in(page, ui_platform, tenant.key, "/ui/tenant/adapters", shots)
    wait_loaded(page)

    drag_files(page, [archive], drop=False)
    assert "dragging" in page.get_attribute("#dropzone", "class")
    shots(page, "dragging-over")
    drag_files(page, [archive], drop=True)
    assert page.input_value("#adapter-name") == "recipes-v2"  # suggested from the archive
    assert page.locator("#file-list li").inner_text().startswith("recipes-v2.tar.gz")
    page.click("#upload-submit")
    page.wait_for_selector("[data-step='ready'].done")
    page.locator("#adapters-table tr[data-adapter='recipes-v2']").get_by_text("Ready").wait_for()
    shots(page, "archive-ready")

    [stored] = _adapters(ui_platform, tenant)
    assert (stored["name"], stored["status"], stored["rank"]) == ("recipes-v2", "ready", 8)
    assert stored["target_modules"] == ["q_proj", "v_proj"]

    # Deleting it takes a second click to confirm.
    row = page.locator("#adapters-table tr[data-adapter='recipes-v2']")
    row.get_by_role("button", name="Delete").click()
    assert _adapters(ui_platform, tenant) != []  # not on the first click
    row.get_by_role("button", name="Confirm delete").click()
    page.get_by_text("Adapter recipes-v2 deleted.").wait_for()
    page.get_by_text("No adapters yet").wait_for()
    assert _adapters(ui_platform, tenant) == []


def test_broken_uploads_show_their_reason(page, ui_platform, adapter_dir, tmp_path, shots):
    tenant = ui_platform.new_tenant()
    broken = tmp_path / "broken"
    shutil.copytree(adapter_dir, broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    config["r"] = 512  # above the server's maximum rank (64)
    (broken / "adapter_config.json").write_text(json.dumps(config))
    notes = tmp_path / "notes.txt"
    notes.write_text("not an adapter")
    sign_in(page, ui_platform, tenant.key, "/ui/tenant/adapters", shots)
    wait_loaded(page)

    # A file that cannot be an adapter is explained before anything is sent.
    page.set_input_files("#files", [str(notes)])
    page.fill("#adapter-name", "notes")
    assert "notes.txt is not an adapter archive" in page.text_content("#files-error")
    page.click("#upload-submit")
    assert page.locator("#upload-progress").is_hidden()

    # A name the API refuses: its message sits under the name field.
    page.set_input_files("#files", [str(broken / f) for f in ADAPTER_FILES])
    page.fill("#adapter-name", "bad name!")
    page.click("#upload-submit")
    page.wait_for_selector("[data-field='adapter-name'].invalid")
    assert "Invalid adapter name 'bad name!'" in page.text_content("#adapter-name-error")
    shots(page, "bad-name")

    # The validator's reason for a broken adapter, after the upload itself went through.
    page.fill("#adapter-name", "too-wide")
    page.click("#upload-submit")
    page.wait_for_selector("#upload-error:not([hidden])")
    reason = page.text_content("#upload-error")
    assert "rank 512 (r) is above the maximum rank of 64" in reason
    assert page.get_attribute("[data-step='upload']", "class") == "done"
    assert page.get_attribute("[data-step='validate']", "class") == "failed"
    assert page.text_content("#upload-status") == "Validation failed."
    shots(page, "validation-failed")

    assert _adapters(ui_platform, tenant) == []  # a refused upload keeps nothing
    page.reload()
    wait_loaded(page)
    assert "No adapters yet" in page.text_content("#adapters-table")
