// Operator: one tenant — scheduling, limits, prices, API keys and adapters.

import { api } from "../lib/api.js";
import { $, failRows, fill, fillRows, h, pageData } from "../lib/dom.js";
import { busy, clearErrors, confirmButton, showApiError, toast } from "../lib/feedback.js";
import { readNumbers, setValue } from "../lib/forms.js";
import { addDays, count, dateTime, microUsd, relative, utcDay } from "../lib/format.js";
import { startPage } from "../lib/shell.js";
import { adapterCells } from "../lib/tables.js";

const tenantId = pageData("tenantId");
const base = `/admin/tenants/${encodeURIComponent(tenantId)}`;
// The limits form's numbers; empty sends null (unlimited, or the server's setting).
const LIMITS = [
  "requests_per_minute",
  "tokens_per_minute",
  "monthly_budget_usd",
  "request_timeout_s",
  "max_queued_requests",
  "pin_quota_bytes",
];

function showTenant(tenant) {
  document.title = `${tenant.name} · loramux`;
  fill($("#tenant-name"), tenant.name);
  fill(
    $("#tenant-meta"),
    "Tenant ",
    h("code", {}, tenant.id),
    ` · created ${dateTime(tenant.created_at)}`,
  );
  setValue($("#priority"), tenant.priority);
  fill($("#priority-value"), String(tenant.priority));
  setValue($("#weight"), tenant.weight);
  setValue($("#name"), tenant.name);
  for (const name of LIMITS) {
    setValue($(`#${name}`), tenant[name]);
  }
  for (const name of [
    "input_price_per_mtok",
    "cached_input_price_per_mtok",
    "output_price_per_mtok",
  ]) {
    setValue($(`#${name}`), tenant[name]);
  }
}

async function loadTenant() {
  try {
    showTenant(await api(base));
  } catch (error) {
    const box = $("#tenant-error");
    box.textContent = error.status === 404 ? `No such tenant: ${error.message}` : error.message;
    box.hidden = false;
    fill($("#tenant-name"), "Tenant not found");
    $("#tenant-panels").hidden = error.status === 404;
  }
}

/** PATCH the tenant from `form`; `describe(tenant)` says what changed. */
function saver(form, button, read, describe) {
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors(form);
    const fallback = form.querySelector(".card-foot .field-error");
    const body = read();
    if (!body) return;
    await busy(button, "Saving…", async () => {
      try {
        const tenant = await api(base, { method: "PATCH", body });
        showTenant(tenant);
        toast(describe(tenant));
      } catch (error) {
        showApiError(form, error, { codes: { tenant_name_taken: "name" }, fallback });
      }
    });
  });
}

function wireForms() {
  const scheduling = $("#scheduling-form");
  $("#priority").addEventListener("input", (event) =>
    fill($("#priority-value"), event.currentTarget.value),
  );
  saver(
    scheduling,
    $("#save-scheduling"),
    () => {
      const { body, bad } = readNumbers(scheduling, ["priority", "weight"]);
      return bad.length ? null : body;
    },
    (tenant) => {
      fill($("#scheduling-status"), "Live on the engine.");
      return `Saved: ${tenant.name} now runs at priority ${tenant.priority}, weight ${tenant.weight}.`;
    },
  );
  const limits = $("#limits-form");
  saver(
    limits,
    $("#save-limits"),
    () => {
      const { body, bad } = readNumbers(limits, LIMITS);
      return bad.length ? null : { name: limits.elements.name.value.trim(), ...body };
    },
    (tenant) => `Saved limits, budget and deadline of ${tenant.name}.`,
  );
  const prices = $("#prices-form");
  saver(
    prices,
    $("#save-prices"),
    () => {
      const names = [
        "input_price_per_mtok",
        "cached_input_price_per_mtok",
        "output_price_per_mtok",
      ];
      const { body, bad } = readNumbers(prices, names);
      if (bad.length) return null;
      // Empty prices keep the price in force (and an empty cached price follows input).
      return Object.fromEntries(Object.entries(body).filter(([, v]) => v !== null));
    },
    (tenant) => `New prices for ${tenant.name} are in force from now.`,
  );
}

// --- API keys ----------------------------------------------------------------------------

function keyRow(key) {
  const revoked = key.revoked_at !== null;
  const action = h("td", { class: "num" });
  if (!revoked) {
    const button = h("button", { class: "btn btn-sm btn-danger", type: "button" }, "Revoke");
    confirmButton(button, "Confirm revoke", async () => {
      try {
        await api(`/admin/api-keys/${encodeURIComponent(key.id)}`, { method: "DELETE" });
        toast(`Key ${key.prefix}… revoked: it no longer authenticates.`);
        await loadKeys();
      } catch (error) {
        toast(`The key could not be revoked: ${error.message}`, "danger");
      }
    });
    action.append(button);
  }
  return h(
    "tr",
    { dataset: { keyId: key.id } },
    h("td", {}, h("code", {}, `${key.prefix}…`)),
    h("td", {}, key.name || h("span", { class: "sub" }, "—")),
    h("td", {}, dateTime(key.created_at)),
    h("td", {}, relative(key.last_used_at)),
    h(
      "td",
      {},
      revoked
        ? h("span", { class: "badge danger" }, "Revoked")
        : h("span", { class: "badge ok" }, "Active"),
    ),
    action,
  );
}

async function loadKeys() {
  try {
    const keys = await api(`${base}/api-keys`);
    fillRows(
      $("#keys-table tbody"),
      keys.map(keyRow),
      "No keys yet",
      "Create one for the tenant to sign in and call the API.",
    );
  } catch (error) {
    failRows($("#keys-table tbody"), `Keys could not be listed: ${error.message}`);
  }
}

async function copyKey() {
  const text = $("#new-key").textContent;
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // No clipboard permission: select the key so Ctrl+C copies it.
    const range = document.createRange();
    range.selectNodeContents($("#new-key"));
    getSelection().removeAllRanges();
    getSelection().addRange(range);
    toast("Select-and-copy: the key is selected, press Ctrl+C.", "info");
    return;
  }
  fill($("#copy-key"), "Copied");
  toast("API key copied to the clipboard.");
}

function wireKeys() {
  const form = $("#key-form");
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors(form);
    const name = form.elements.name.value.trim();
    await busy($("#create-key"), "Creating…", async () => {
      try {
        const key = await api(`${base}/api-keys`, {
          method: "POST",
          body: name ? { name } : undefined,
        });
        fill($("#new-key"), key.key);
        fill($("#copy-key"), "Copy");
        $("#new-key-box").hidden = false;
        form.elements.name.value = "";
        toast(`Key ${key.prefix}… created. Copy it now.`);
        $("#copy-key").focus();
        await loadKeys();
      } catch (error) {
        showApiError(form, error, { codes: {}, fallback: $("#key-name-error") });
      }
    });
  });
  $("#copy-key").addEventListener("click", copyKey);
}

// --- usage at a glance -------------------------------------------------------------------

async function loadGlance() {
  const start = utcDay(-29);
  try {
    const report = await api("/admin/usage", {
      query: { tenant_id: tenantId, start, end: addDays(utcDay(0), 1), group_by: "day" },
    });
    const totals = report.totals;
    fill($("#glance-requests"), count(totals.requests));
    fill(
      $("#glance-tokens"),
      `${count(totals.prompt_tokens)} prompt · ${count(totals.completion_tokens)} completion`,
    );
    fill($("#glance-cost"), microUsd(totals.cost_micro_usd));
  } catch (error) {
    fill(
      $("#glance"),
      h("div", { class: "notice danger" }, `Usage could not be loaded: ${error.message}`),
    );
  }
}

// --- adapters ----------------------------------------------------------------------------

async function loadAdapters() {
  try {
    const list = await api("/admin/adapters", { query: { tenant_id: tenantId } });
    const rows = list.data.map((adapter) =>
      h("tr", {}, h("td", {}, h("strong", {}, adapter.name)), ...adapterCells(adapter)),
    );
    fillRows(
      $("#adapters-table tbody"),
      rows,
      "No adapters yet",
      "The tenant uploads them from its console.",
    );
  } catch (error) {
    failRows($("#adapters-table tbody"), `Adapters could not be listed: ${error.message}`);
  }
}

if (startPage("operator")) {
  loadTenant();
  loadKeys();
  loadAdapters();
  loadGlance();
  wireForms();
  wireKeys();
  if (new URLSearchParams(window.location.search).has("created")) {
    toast("Tenant created. Give it an API key below.");
    history.replaceState(null, "", window.location.pathname);
  }
}
