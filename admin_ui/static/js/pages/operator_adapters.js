// Operator: every tenant's adapters, optionally one tenant's.

import { api } from "../lib/api.js";
import { $, failRows, fill, fillRows, h } from "../lib/dom.js";
import { plural } from "../lib/format.js";
import { startPage } from "../lib/shell.js";
import { adapterCells } from "../lib/tables.js";

const filter = $("#tenant-filter");

function row(adapter) {
  const href = `/ui/operator/tenants/${encodeURIComponent(adapter.tenant_id)}`;
  return h(
    "tr",
    {},
    h("td", {}, h("a", { href }, adapter.tenant_name)),
    h("td", {}, h("strong", {}, adapter.name)),
    ...adapterCells(adapter),
  );
}

async function load() {
  const tenant = filter.value;
  try {
    const list = await api("/admin/adapters", { query: { tenant_id: tenant } });
    const ready = list.data.filter((adapter) => adapter.status === "ready").length;
    fill($("#adapter-count"), `${plural(list.data.length, "adapter")}, ${ready} ready`);
    fillRows(
      $("#adapters-table tbody"),
      list.data.map(row),
      "No adapters",
      "Tenants upload adapters from their console.",
    );
  } catch (error) {
    fill($("#adapter-count"), "");
    failRows($("#adapters-table tbody"), `Adapters could not be listed: ${error.message}`);
  }
}

async function loadTenants() {
  try {
    for (const tenant of await api("/admin/tenants")) {
      filter.append(h("option", { value: tenant.id }, tenant.name));
    }
  } catch {
    filter.disabled = true; // the table still lists every tenant's adapters
  }
}

if (startPage("operator")) {
  load();
  loadTenants();
  filter.addEventListener("change", load);
}
