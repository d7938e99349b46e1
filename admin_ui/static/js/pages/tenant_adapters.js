// Tenant: upload adapters (picker or drag and drop) and manage them.

import { ApiError, api, uploadForm } from "../lib/api.js";
import { $, failRows, fill, fillRows, h } from "../lib/dom.js";
import { clearErrors, confirmButton, setFieldError, showApiError, toast } from "../lib/feedback.js";
import { plural } from "../lib/format.js";
import { startPage } from "../lib/shell.js";
import { adapterCells } from "../lib/tables.js";
import {
  UploadProgress,
  filesProblem,
  showChosen,
  suggestedName,
  wireFilePicker,
} from "../lib/upload.js";

const POLL_MS = 1000;
const form = $("#upload-form");
const progress = new UploadProgress();
let chosen = [];
let listTimer = null;

const sleep = (millis) => new Promise((resolve) => setTimeout(resolve, millis));

// --- the list ----------------------------------------------------------------------------

function row(adapter) {
  const remove = h("button", { class: "btn btn-sm btn-danger", type: "button" }, "Delete");
  confirmButton(remove, "Confirm delete", async () => {
    try {
      await api(`/v1/adapters/${encodeURIComponent(adapter.name)}`, { method: "DELETE" });
      toast(`Adapter ${adapter.name} deleted.`);
      await loadList();
    } catch (error) {
      toast(`${adapter.name} could not be deleted: ${error.message}`, "danger");
    }
  });
  return h(
    "tr",
    { dataset: { adapter: adapter.name } },
    h(
      "td",
      {},
      h(
        "a",
        { href: `/ui/tenant/adapters/${encodeURIComponent(adapter.name)}` },
        h("strong", {}, adapter.name),
      ),
    ),
    ...adapterCells(adapter),
    h("td", { class: "num" }, remove),
  );
}

/** The example call, with this server's address and one of the tenant's adapters. */
function showExample(adapters) {
  const ready = adapters.find((adapter) => adapter.status === "ready");
  const model = ready ? ready.name : "support-bot";
  fill(
    $("#curl-example"),
    `curl ${window.location.origin}/v1/completions \\\n` +
      `  -H "Authorization: Bearer $API_KEY" \\\n` +
      `  -H "Content-Type: application/json" \\\n` +
      `  -d '{"model": "${model}", "prompt": "Hello", "max_tokens": 32}'`,
  );
}

async function loadList() {
  clearTimeout(listTimer);
  try {
    const list = await api("/v1/adapters");
    const ready = list.data.filter((adapter) => adapter.status === "ready").length;
    showExample(list.data);
    fill($("#adapter-count"), `${plural(list.data.length, "adapter")}, ${ready} ready to serve`);
    fillRows(
      $("#adapters-table tbody"),
      list.data.map(row),
      "No adapters yet",
      "Upload one above: it is validated and ready in seconds.",
    );
    // Queued validations finish on a worker: look again until none is pending.
    if (
      list.data.some((adapter) => adapter.status === "validating" || adapter.status === "uploading")
    ) {
      listTimer = setTimeout(loadList, 2 * POLL_MS);
    }
  } catch (error) {
    failRows($("#adapters-table tbody"), `Adapters could not be listed: ${error.message}`);
  }
}

// --- uploading ---------------------------------------------------------------------------

function choose(files) {
  chosen = files;
  clearErrors(form);
  $("#upload-error").hidden = true;
  progress.reset();
  showChosen(files);
  const problem = filesProblem(files);
  if (problem) setFieldError(form, "files", problem);
  const name = $("#adapter-name");
  if (!name.value.trim()) name.value = suggestedName(files);
}

/** Poll a queued validation until the worker decides. */
async function untilDecided(name) {
  for (;;) {
    const adapter = await api(`/v1/adapters/${encodeURIComponent(name)}`);
    if (adapter.status === "ready" || adapter.status === "failed") return adapter;
    await sleep(POLL_MS);
  }
}

async function upload(event) {
  event.preventDefault();
  clearErrors(form);
  $("#upload-error").hidden = true;
  progress.reset();
  const name = $("#adapter-name").value.trim();
  const problem = filesProblem(chosen);
  if (!name)
    setFieldError(form, "adapter-name", "Give the adapter a name: requests call it by this name.");
  if (problem) setFieldError(form, "files", problem);
  if (!name || problem) return;
  const body = new FormData();
  body.append("name", name);
  for (const file of chosen) body.append("files", file, file.name);
  const button = $("#upload-submit");
  button.disabled = true;
  let sent = false;
  try {
    progress.uploading(0);
    const { body: answer } = await uploadForm("/v1/adapters", body, {
      onProgress: (fraction) => progress.uploading(fraction),
      onSent: () => {
        sent = true;
        progress.validating();
      },
    });
    sent = true;
    progress.validating();
    loadList();
    const adapter =
      answer.status === "ready" || answer.status === "failed" ? answer : await untilDecided(name);
    if (adapter.status === "ready") {
      progress.ready(adapter);
      toast(`${adapter.name} is ready to serve.`);
    } else {
      progress.failed("validate", adapter.failure_reason || "The adapter was refused.");
    }
  } catch (error) {
    if (error instanceof ApiError && error.code === "invalid_adapter_name") {
      progress.reset();
      showApiError(form, error, { codes: { invalid_adapter_name: "adapter-name" } });
    } else {
      progress.failed(sent ? "validate" : "upload", error.message);
    }
  } finally {
    button.disabled = false;
    loadList();
  }
}

function reset() {
  chosen = [];
  form.reset();
  clearErrors(form);
  showChosen([]);
  progress.reset();
  $("#upload-error").hidden = true;
}

if (startPage("tenant")) {
  loadList();
  wireFilePicker(choose);
  form.addEventListener("submit", upload);
  $("#upload-reset").addEventListener("click", reset);
}
