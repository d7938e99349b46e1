// Operator: the tenant list and the form creating one.

import { api } from "../lib/api.js";
import { $, failRows, fill, fillRows, h } from "../lib/dom.js";
import { busy, clearErrors, showApiError } from "../lib/feedback.js";
import { readNumbers, withoutNulls } from "../lib/forms.js";
import { compactCount, count, dateTime, plural, usd } from "../lib/format.js";
import { startPage } from "../lib/shell.js";
import { priorityBadge } from "../lib/tables.js";

const form = $("#tenant-form");
const panel = $("#new-tenant");
const toggle = $("#new-tenant-toggle");
const NUMBERS = [
  "priority",
  "weight",
  "requests_per_minute",
  "tokens_per_minute",
  "monthly_budget_usd",
  "input_price_per_mtok",
  "cached_input_price_per_mtok",
  "output_price_per_mtok",
];

const UNLIMITED = () => h("span", { class: "sub" }, "Unlimited");

function rateLimits(tenant) {
  const parts = [];
  if (tenant.requests_per_minute !== null) parts.push(`${count(tenant.requests_per_minute)} req`);
  if (tenant.tokens_per_minute !== null)
    parts.push(`${compactCount(tenant.tokens_per_minute)} tok`);
  return parts.length ? `${parts.join(" · ")} / min` : UNLIMITED();
}

function row(tenant) {
  const href = `/ui/operator/tenants/${encodeURIComponent(tenant.id)}`;
  return h(
    "tr",
    { dataset: { tenantId: tenant.id } },
    h(
      "td",
      {},
      h("a", { href }, tenant.name),
      h("span", { class: "sub mono", title: tenant.id }, `${tenant.id.slice(0, 8)}…`),
    ),
    h("td", { class: "num" }, priorityBadge(tenant.priority)),
    h("td", { class: "num" }, tenant.weight),
    h("td", { class: "num" }, rateLimits(tenant)),
    h(
      "td",
      { class: "num" },
      tenant.monthly_budget_usd === null ? UNLIMITED() : usd(tenant.monthly_budget_usd),
    ),
    h(
      "td",
      { class: "num" },
      `${usd(tenant.input_price_per_mtok)} · ${usd(tenant.output_price_per_mtok)}`,
    ),
    h("td", {}, dateTime(tenant.created_at)),
  );
}

async function load() {
  try {
    const tenants = await api("/admin/tenants");
    fill($("#tenant-count"), plural(tenants.length, "tenant"));
    fillRows(
      $("#tenants-table tbody"),
      tenants.map(row),
      "No tenants yet",
      "Create one to hand out API keys.",
    );
  } catch (error) {
    fill($("#tenant-count"), "");
    failRows($("#tenants-table tbody"), `Tenants could not be listed: ${error.message}`);
  }
}

function showForm(open) {
  panel.hidden = !open;
  toggle.setAttribute("aria-expanded", String(open));
  if (open) $("#name").focus();
}

async function create(event) {
  event.preventDefault();
  clearErrors(form);
  const fallback = $("#tenant-form-error");
  const { body: numbers, bad } = readNumbers(form, NUMBERS);
  if (bad.length) return;
  // Empty limits, budget and cached price mean "unset" (unlimited, same as input).
  const body = { name: form.elements.name.value.trim(), ...withoutNulls(numbers) };
  await busy($("#create-tenant"), "Creating…", async () => {
    try {
      const tenant = await api("/admin/tenants", { method: "POST", body });
      window.location.assign(`/ui/operator/tenants/${encodeURIComponent(tenant.id)}?created=1`);
    } catch (error) {
      showApiError(form, error, { codes: { tenant_name_taken: "name" }, fallback });
    }
  });
}

if (startPage("operator")) {
  load();
  toggle.addEventListener("click", () => showForm(panel.hidden));
  $("#cancel-tenant").addEventListener("click", () => {
    showForm(false);
    toggle.focus();
  });
  form.addEventListener("submit", create);
  if (new URLSearchParams(window.location.search).has("new")) showForm(true);
}
