// Tenant: one adapter — its versions and which one the bare name reaches, its pin on the
// device, and the tenants it is shared with (with their use of it).

import { api } from "../lib/api.js";
import { $, failRows, fill, fillRows, h, pageData } from "../lib/dom.js";
import {
  busy,
  clearErrors,
  confirmButton,
  setFieldError,
  showApiError,
  toast,
} from "../lib/feedback.js";
import { bytes, count, dateTime } from "../lib/format.js";
import { startPage } from "../lib/shell.js";
import { statusBadge } from "../lib/tables.js";

const PIN_POLL_MS = 1000;
const name = pageData("adapterName");
const base = `/v1/adapters/${encodeURIComponent(name)}`;
let ownerName = "owner";
let pinTimer = null;

// --- versions and the alias --------------------------------------------------------------

function versionRow(version, reached) {
  const isReached = version.version === reached;
  const action = h("td", { class: "num" });
  if (version.status === "ready" && !isReached) {
    action.append(
      h(
        "button",
        {
          class: "btn btn-sm",
          type: "button",
          title: `Make the bare name ${name} reach v${version.version} (a rollback)`,
          dataset: { alias: String(version.version) },
          onclick: (event) => setAlias(event.currentTarget, version.version),
        },
        "Make default",
      ),
    );
  }
  return h(
    "tr",
    { dataset: { version: String(version.version) } },
    h("td", { class: "num" }, h("strong", {}, `v${version.version}`)),
    h("td", {}, statusBadge(version.status)),
    h("td", { class: "mono", title: version.sha256 || "" }, version.sha256 ? version.sha256.slice(0, 16) : "–"),
    h("td", { class: "num" }, version.rank ?? "–"),
    h("td", { class: "num" }, bytes(version.size_bytes)),
    h("td", {}, dateTime(version.created_at)),
    h("td", {}, isReached ? h("span", { class: "badge ok" }, "reached by the name") : ""),
    action,
  );
}

function versionOptions(select, versions, first) {
  const ready = versions.filter((version) => version.status === "ready");
  fill(
    select,
    h("option", { value: "" }, first),
    ready.map((version) => h("option", { value: String(version.version) }, `v${version.version}`)),
  );
}

async function loadVersions() {
  try {
    const list = await api(`${base}/versions`);
    const ready = list.data.filter((version) => version.status === "ready");
    // The version the bare name reaches: the alias, else the newest ready one.
    const reached = list.alias_version ?? (ready.length ? ready[0].version : null);
    fillRows(
      $("#versions-table tbody"),
      list.data.map((version) => versionRow(version, reached)),
      "No versions",
      "Upload the adapter again to add one.",
    );
    $("#follow-newest").hidden = list.alias_version === null;
    fill(
      $("#adapter-meta"),
      `${count(list.data.length)} version${list.data.length === 1 ? "" : "s"} · `,
      list.alias_version === null
        ? "the name follows the newest ready version"
        : `the name is held at v${list.alias_version}`,
    );
    versionOptions($("#pin-version"), list.data, "The bare name's");
    versionOptions($("#grant-version"), list.data, "Every version");
  } catch (error) {
    const box = $("#adapter-error");
    box.textContent = error.status === 404 ? `No adapter named ${name}.` : error.message;
    box.hidden = false;
    $("#adapter-panels").hidden = error.status === 404;
    failRows($("#versions-table tbody"), error.message);
  }
}

async function setAlias(button, version) {
  await busy(button, "Moving…", async () => {
    try {
      await api(`${base}/alias`, { method: "PUT", body: { version } });
      toast(
        version === null
          ? `${name} follows its newest version again.`
          : `${name} now reaches v${version}; requests already running finish on theirs.`,
      );
      await loadVersions();
    } catch (error) {
      toast(`The name could not be moved: ${error.message}`, "danger");
    }
  });
}

// --- the pin -----------------------------------------------------------------------------

function showPin(pin) {
  clearTimeout(pinTimer);
  const status = $("#pin-status");
  if (pin.version === null) {
    fill(status, h("span", { class: "badge" }, "Not pinned"), " It is loaded when requests need it.");
  } else {
    const held = pin.state === "pinned";
    fill(
      status,
      h("span", { class: `badge ${held ? "ok" : "info"}` }, held ? "Pinned" : "Pin pending"),
      ` v${pin.version}`,
      pin.pinned_by === "operator" ? " (pinned by your operator)" : "",
      h("div", { class: "sub" }, held ? "Held on the device by every engine." : pin.state),
    );
    if (!held) pinTimer = setTimeout(loadPin, PIN_POLL_MS);
  }
  const quota = pin.quota_bytes;
  const share = quota ? Math.min(100, (100 * pin.pinned_bytes) / quota) : 0;
  $("#pin-quota").hidden = !quota;
  $("#pin-quota").setAttribute("aria-valuenow", String(Math.round(share)));
  $("#pin-quota-bar").style.width = `${share}%`;
  fill(
    $("#pin-quota-text"),
    quota
      ? `Your pins hold ${bytes(pin.pinned_bytes)} of your ${bytes(quota)} quota.`
      : "Your operator has given you no pin quota: ask for one to pin adapters.",
  );
  $("#unpin").hidden = pin.version === null || pin.pinned_by === "operator";
  $("#pin-submit").disabled = pin.pinned_by === "operator";
}

async function loadPin() {
  try {
    showPin(await api(`${base}/pin`));
  } catch (error) {
    fill($("#pin-status"), h("div", { class: "notice danger", role: "alert" }, error.message));
  }
}

function wirePin() {
  const form = $("#pin-form");
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors(form);
    const fallback = $("#pin-form-error");
    const chosen = $("#pin-version").value;
    await busy($("#pin-submit"), "Pinning…", async () => {
      try {
        const pin = await api(`${base}/pin`, {
          method: "PUT",
          body: { version: chosen ? Number(chosen) : null },
        });
        showPin(pin);
        toast(`v${pin.version} of ${name} is pinned on the device.`);
      } catch (error) {
        showApiError(form, error, { fallback });
      }
    });
  });
  confirmButton($("#unpin"), "Confirm unpin", async () => {
    try {
      await api(`${base}/pin`, { method: "DELETE" });
      toast(`${name} is no longer pinned.`);
      await loadPin();
    } catch (error) {
      toast(`The pin could not be lifted: ${error.message}`, "danger");
    }
  });
}

// --- sharing -----------------------------------------------------------------------------

function grantRow(grant, use) {
  const revoke = h("button", { class: "btn btn-sm btn-danger", type: "button" }, "Revoke");
  confirmButton(revoke, "Confirm revoke", async () => {
    try {
      await api(`${base}/grants/${encodeURIComponent(grant.grantee)}`, { method: "DELETE" });
      toast(`${grant.grantee} can no longer call ${name}.`);
      await loadGrants();
    } catch (error) {
      toast(`The grant could not be revoked: ${error.message}`, "danger");
    }
  });
  const tokens = use ? use.prompt_tokens + use.completion_tokens : 0;
  return h(
    "tr",
    { dataset: { grantee: grant.grantee } },
    h(
      "td",
      { title: `Shared since ${dateTime(grant.created_at)}` },
      h("strong", {}, grant.grantee),
    ),
    h("td", {}, grant.version === null ? "Every version" : `v${grant.version} only`),
    h("td", { class: "num" }, count(use ? use.requests : 0)),
    h("td", { class: "num" }, count(tokens)),
    h("td", { class: "num" }, revoke),
  );
}

async function loadGrants() {
  try {
    const [grants, usage] = await Promise.all([api(`${base}/grants`), api("/v1/usage/shared")]);
    const uses = new Map(
      usage.rows.filter((row) => row.adapter === name).map((row) => [row.grantee, row]),
    );
    fillRows(
      $("#grants-table tbody"),
      grants.data.map((grant) => grantRow(grant, uses.get(grant.grantee))),
      "Not shared",
      "Share it with a tenant by name above.",
    );
  } catch (error) {
    failRows($("#grants-table tbody"), `Grants could not be listed: ${error.message}`);
  }
}

function wireGrants() {
  const form = $("#grant-form");
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors(form);
    const fallback = $("#grant-form-error");
    const grantee = $("#grantee").value.trim();
    const chosen = $("#grant-version").value;
    if (!grantee) {
      setFieldError(form, "grantee", "Name the tenant to share it with.");
      return;
    }
    await busy($("#grant-submit"), "Sharing…", async () => {
      try {
        const grant = await api(`${base}/grants/${encodeURIComponent(grantee)}`, {
          method: "PUT",
          body: { version: chosen ? Number(chosen) : null },
        });
        toast(`${grantee} can call ${grant.model} now.`);
        form.reset();
        await loadGrants();
      } catch (error) {
        showApiError(form, error, { codes: { grantee_not_found: "grantee" }, fallback });
      }
    });
  });
}

async function loadOwner() {
  try {
    const me = await api("/v1/me");
    ownerName = me.tenant_name;
    fill($("#shared-model"), `${ownerName}/${name}`);
  } catch {
    // The page works without it: the example keeps "owner".
  }
}

if (startPage("tenant")) {
  document.title = `${name} · loramux`;
  loadOwner();
  loadVersions();
  loadPin();
  loadGrants();
  wirePin();
  wireGrants();
  $("#follow-newest").addEventListener("click", (event) => setAlias(event.currentTarget, null));
}
