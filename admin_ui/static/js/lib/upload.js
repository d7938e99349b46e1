// Choosing adapter files (picker or drag and drop) and showing an upload's progress.

import { $, fill, h } from "./dom.js";
import { bytes } from "./format.js";

const ARCHIVE = /\.(tar\.gz|tgz|zip)$/i;

/** Why these files cannot be an adapter upload, or null when they can be. */
export function filesProblem(files) {
  if (files.length === 0)
    return "Choose adapter_config.json and adapter_model.safetensors, or one archive.";
  if (
    files.length === 1 &&
    !ARCHIVE.test(files[0].name) &&
    !files[0].name.endsWith(".json") &&
    !files[0].name.endsWith(".safetensors")
  ) {
    const name = files[0].name;
    return `${name} is not an adapter archive: send a .tar.gz or .zip, or the two adapter files.`;
  }
  if (files.length > 2)
    return `That is ${files.length} files: send the two adapter files, or one archive.`;
  return null;
}

/** A name to suggest for an archive: its file name without the extension. */
export function suggestedName(files) {
  if (files.length !== 1 || !ARCHIVE.test(files[0].name)) return "";
  return files[0].name
    .replace(ARCHIVE, "")
    .replace(/[^A-Za-z0-9._-]/g, "-")
    .slice(0, 64);
}

/** Wire the drop zone and the file input; onFiles(files) gets each new choice. */
export function wireFilePicker(onFiles) {
  const zone = $("#dropzone");
  const input = $("#files");
  input.addEventListener("change", () => onFiles([...input.files]));
  for (const type of ["dragenter", "dragover"]) {
    zone.addEventListener(type, (event) => {
      event.preventDefault();
      zone.classList.add("dragging");
    });
  }
  for (const type of ["dragleave", "dragend"])
    zone.addEventListener(type, () => zone.classList.remove("dragging"));
  zone.addEventListener("drop", (event) => {
    event.preventDefault();
    zone.classList.remove("dragging");
    onFiles([...event.dataTransfer.files]);
  });
}

export function showChosen(files) {
  const list = $("#file-list");
  fill(
    list,
    files.map((file) =>
      h("li", {}, h("span", {}, file.name), h("span", { class: "hint" }, bytes(file.size))),
    ),
  );
  list.hidden = files.length === 0;
}

/** The steps (upload, validate, ready), the progress bar and the status line. */
export class UploadProgress {
  constructor() {
    this.box = $("#upload-progress");
    this.bar = $("#progress");
  }

  reset() {
    this.box.hidden = true;
    this.bar.className = "progress";
    this.setBar(0);
    for (const step of this.box.querySelectorAll("[data-step]")) step.className = "";
    fill($("#upload-status"), "");
  }

  setBar(fraction) {
    const percent = Math.round(fraction * 100);
    $("#progress-bar").style.width = `${percent}%`;
    this.bar.setAttribute("aria-valuenow", String(percent));
  }

  step(name, state, status) {
    this.box.hidden = false;
    const item = this.box.querySelector(`[data-step="${name}"]`);
    item.className = state;
    if (status !== undefined) fill($("#upload-status"), ...[status].flat());
  }

  uploading(fraction) {
    this.setBar(fraction);
    this.step("upload", "active", `Uploading… ${Math.round(fraction * 100)}%`);
  }

  validating() {
    this.setBar(1);
    this.step("upload", "done");
    this.step("validate", "active", [
      h("span", { class: "spinner" }),
      " Validating against the base model…",
    ]);
  }

  ready(adapter) {
    this.setBar(1);
    this.bar.classList.add("done");
    this.step("upload", "done");
    this.step("validate", "done");
    const modules = adapter.target_modules ? adapter.target_modules.join(", ") : "";
    this.step(
      "ready",
      "done",
      `Ready: ${adapter.name} v${adapter.version} · rank ${adapter.rank} · ${modules}`,
    );
  }

  failed(stage, reason) {
    this.bar.classList.add("failed");
    this.step(stage, "failed", stage === "upload" ? "Upload failed." : "Validation failed.");
    if (stage === "validate") this.step("upload", "done");
    const box = $("#upload-error");
    box.textContent = reason;
    box.hidden = false;
  }
}
