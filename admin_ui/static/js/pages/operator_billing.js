// Operator: the billing exports (list, download), exporting a day or a range now, and
// running the usage roll-up now. Only the public admin API: /admin/billing/exports and
// /admin/usage/rollup.

import { api } from "../lib/api.js";
import { $, failRows, fill, fillRows, h } from "../lib/dom.js";
import { saveResponse } from "../lib/download.js";
import { busy, clearErrors, setFieldError, showApiError, toast } from "../lib/feedback.js";
import { bytes, count, dateTime, plural, utcDay } from "../lib/format.js";
import { startPage } from "../lib/shell.js";

const EXPORTS = "/admin/billing/exports";
const exportForm = $("#export-form");
const GROUPING = { request: "Request", day: "Day", adapter: "Adapter" };

function periodText(exported) {
  const { first_day: first, last_day: last } = exported;
  return first === last ? first : `${first} – ${last}`;
}

function stateBadge(exported) {
  return exported.provisional
    ? h("span", { class: "badge warn", title: "Exported before its period closed" }, "Provisional")
    : h("span", { class: "badge ok" }, "Final");
}

async function download(exported, button) {
  await busy(button, "Saving…", async () => {
    try {
      const response = await api(exported.download_url, { raw: true });
      const name = await saveResponse(response, exported.file_name);
      toast(`${name} downloaded (sha256 verified by the server).`);
    } catch (error) {
      toast(`${exported.file_name} could not be downloaded: ${error.message}`, "danger", 8);
    }
  });
}

function downloadButton(exported) {
  const button = h(
    "button",
    {
      class: "btn btn-sm",
      type: "button",
      dataset: { exportId: exported.id },
      "aria-label": `Download ${exported.file_name}`,
    },
    "Download",
  );
  button.addEventListener("click", () => download(exported, button));
  return button;
}

function row(exported) {
  return h(
    "tr",
    { dataset: { exportId: exported.id } },
    h(
      "td",
      { class: "wrap" },
      h("strong", {}, periodText(exported)),
      h("span", { class: "sub mono" }, exported.key),
    ),
    h("td", {}, GROUPING[exported.group_by] || exported.group_by),
    h("td", { class: "num" }, exported.version),
    h("td", {}, stateBadge(exported)),
    h("td", { class: "num" }, count(exported.rows)),
    h("td", { class: "num" }, bytes(exported.size_bytes)),
    h("td", {}, dateTime(exported.created_at)),
    h("td", {}, downloadButton(exported)),
  );
}

async function loadExports() {
  try {
    const list = await api(EXPORTS, { query: { limit: 200 } });
    const provisional = list.filter((exported) => exported.provisional).length;
    fill(
      $("#export-count"),
      `${plural(list.length, "export")}, newest first` +
        (provisional ? ` · ${count(provisional)} provisional` : ""),
    );
    fillRows(
      $("#exports-table tbody"),
      list.map(row),
      "No exports yet",
      " The daily export writes one per closed day; or export a day above.",
    );
  } catch (error) {
    fill($("#export-count"), "");
    failRows($("#exports-table tbody"), `Exports could not be listed: ${error.message}`);
  }
}

// --- export now ------------------------------------------------------------------------------

function showKind() {
  const range = $("#kind").value === "range";
  exportForm.querySelector('[data-field="day"]').hidden = range;
  exportForm.querySelector('[data-field="start"]').hidden = !range;
  exportForm.querySelector('[data-field="end"]').hidden = !range;
}

/** The request body, or null after marking what is missing. */
function exportBody() {
  clearErrors(exportForm);
  const body = {};
  if ($("#kind").value === "day") {
    body.day = $("#day").value;
    if (!body.day) setFieldError(exportForm, "day", "Choose the day.");
  } else {
    body.start = $("#start").value;
    body.end = $("#end").value;
    if (!body.start) setFieldError(exportForm, "start", "Choose the first day.");
    if (!body.end) setFieldError(exportForm, "end", "Choose the last day.");
    if (body.start && body.end && body.start > body.end)
      setFieldError(exportForm, "end", "The last day is before the first.");
  }
  if ($("#group_by").value) body.group_by = $("#group_by").value;
  return exportForm.querySelector(".field.invalid") ? null : body;
}

function showExported(exported) {
  const result = $("#export-result");
  const verb = exported.created ? "Exported" : "Already exported";
  fill(
    result,
    h(
      "div",
      { class: `notice ${exported.provisional ? "warn" : "ok"}`, role: "status" },
      h(
        "div",
        { class: "result-body" },
        h(
          "p",
          {},
          h("strong", {}, `${verb} ${periodText(exported)}`),
          ` by ${exported.group_by}, version ${exported.version} `,
          stateBadge(exported),
          ` · ${plural(exported.rows, "row")} · ${bytes(exported.size_bytes)}`,
        ),
        h("p", {}, exported.note),
        h(
          "div",
          { class: "result-actions" },
          downloadButton(exported),
          h("span", { class: "mono" }, exported.key),
        ),
      ),
    ),
  );
  result.hidden = false;
}

async function exportNow() {
  const error = $("#export-error");
  error.textContent = "";
  const body = exportBody();
  if (!body) return;
  try {
    const exported = await api(EXPORTS, { method: "POST", body });
    showExported(exported);
    toast(`${exported.created ? "Exported" : "Already exported"} ${periodText(exported)}.`);
    await loadExports();
  } catch (err) {
    $("#export-result").hidden = true;
    const field = $("#kind").value === "day" ? "day" : "end";
    showApiError(exportForm, err, { codes: { invalid_period: field }, fallback: error });
  }
}

// --- roll-up now -----------------------------------------------------------------------------

async function rollupNow() {
  const error = $("#rollup-error");
  const result = $("#rollup-result");
  error.textContent = "";
  try {
    const run = await api("/admin/usage/rollup", { method: "POST" });
    const rolled = run.rolled_up.length
      ? `${plural(run.rolled_up.length, "day")} rolled up`
      : "Nothing to roll up";
    fill(
      result,
      h(
        "div",
        { class: "notice info", role: "status" },
        h(
          "div",
          { class: "result-body" },
          h("p", {}, h("strong", {}, rolled), ` · ${plural(run.open_days.length, "day")} open`),
          h("p", {}, run.note),
        ),
      ),
    );
    result.hidden = false;
  } catch (err) {
    result.hidden = true;
    error.textContent = err.message;
  }
}

if (startPage("operator")) {
  $("#day").value = utcDay(-1);
  $("#start").value = utcDay(-7);
  $("#end").value = utcDay(-1);
  showKind();
  loadExports();
  $("#kind").addEventListener("change", showKind);
  exportForm.addEventListener("submit", (event) => {
    event.preventDefault();
    busy($("#export-now"), "Exporting…", exportNow);
  });
  $("#run-rollup").addEventListener("click", (event) =>
    busy(event.currentTarget, "Rolling up…", rollupNow),
  );
}
