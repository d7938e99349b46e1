// Operator: usage per tenant over time, and the billing export as a CSV download.

import { api } from "../lib/api.js";
import { $, h } from "../lib/dom.js";
import { saveResponse } from "../lib/download.js";
import { busy, clearErrors, setFieldError, showApiError, toast } from "../lib/feedback.js";
import { addDays, utcDay } from "../lib/format.js";
import { startPage } from "../lib/shell.js";
import { showUsage } from "../lib/usage_view.js";

const DEFAULT_DAYS = 14;
const periodForm = $("#period-form");
const exportForm = $("#export-form");
const params = new URLSearchParams(window.location.search);
let chosenTenant = params.get("tenant") || ""; // known before the tenant list arrives
let tenantNames = Promise.resolve(new Map());

function period() {
  return { tenant: chosenTenant, start: $("#start").value, end: $("#end").value };
}

/** API query for the chosen period: `end` is inclusive on screen, exclusive in the API. */
function query(extra = {}) {
  const { tenant, start, end } = period();
  return {
    tenant_id: tenant || undefined,
    start,
    end: end ? addDays(end, 1) : undefined,
    ...extra,
  };
}

function checkPeriod() {
  clearErrors(periodForm);
  const { start, end } = period();
  if (!start) setFieldError(periodForm, "start", "Choose the first day.");
  if (!end) setFieldError(periodForm, "end", "Choose the last day.");
  if (start && end && start > end)
    setFieldError(periodForm, "end", "The last day is before the first.");
  return !periodForm.querySelector(".field.invalid");
}

function draw() {
  const { tenant, start, end } = period();
  const url = new URL(window.location.href);
  url.searchParams.set("start", start);
  url.searchParams.set("end", end);
  if (tenant) url.searchParams.set("tenant", tenant);
  else url.searchParams.delete("tenant");
  history.replaceState(null, "", url);
  return showUsage({
    start,
    end,
    tenantNames,
    fetchReport: (groupBy) => api("/admin/usage", { query: query({ group_by: groupBy }) }),
  });
}

async function loadTenants() {
  const select = $("#tenant");
  const names = new Map();
  try {
    const tenants = await api("/admin/tenants");
    for (const tenant of tenants) {
      names.set(tenant.id, tenant.name);
      select.append(h("option", { value: tenant.id }, tenant.name));
    }
    select.value = chosenTenant;
  } catch (error) {
    setFieldError(periodForm, "tenant", `Tenants could not be listed: ${error.message}`);
  }
  return names;
}

async function downloadCsv() {
  const status = $("#export-status");
  const error = $("#export-error");
  error.textContent = "";
  status.textContent = "";
  if (!checkPeriod()) return;
  try {
    const response = await api("/admin/usage", {
      query: query({ group_by: $("#group-by").value, format: "csv" }),
      raw: true,
    });
    const name = await saveResponse(response, "usage.csv");
    status.textContent = `Downloaded ${name}`;
    toast(`Billing export ${name} downloaded.`);
  } catch (err) {
    showApiError(exportForm, err, { fallback: error });
  }
}

if (startPage("operator")) {
  $("#start").value = params.get("start") || utcDay(-(DEFAULT_DAYS - 1));
  $("#end").value = params.get("end") || utcDay(0);
  tenantNames = loadTenants(); // in parallel with the usage itself
  draw();
  periodForm.addEventListener("submit", (event) => {
    event.preventDefault();
    if (checkPeriod()) busy($("#apply-period"), "Loading…", draw);
  });
  $("#tenant").addEventListener("change", (event) => {
    chosenTenant = event.currentTarget.value;
    if (checkPeriod()) draw();
  });
  exportForm.addEventListener("submit", (event) => {
    event.preventDefault();
    busy($("#download-csv"), "Preparing…", downloadCsv);
  });
}
