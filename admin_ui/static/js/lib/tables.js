// Table cells shared by several pages.

import { h } from "./dom.js";
import { bytes, dateTime } from "./format.js";

const STATUS = {
  ready: ["ok", "Ready"],
  validating: ["info", "Validating"],
  uploading: ["info", "Uploading"],
  failed: ["danger", "Failed"],
};

export function statusBadge(status) {
  const [kind, label] = STATUS[status] || ["", status || "unknown"];
  return h("span", { class: `badge ${kind}` }, label);
}

export function priorityBadge(priority) {
  const kind = priority >= 7 ? "accent" : priority <= 2 ? "" : "info";
  return h(
    "span",
    { class: `badge plain ${kind}`, title: `Priority ${priority} of 9` },
    String(priority),
  );
}

/** The cells every adapter table shows, after its name cells. */
export function adapterCells(adapter) {
  const status = h(
    "td",
    { class: adapter.failure_reason ? "wrap" : undefined },
    statusBadge(adapter.status),
  );
  if (adapter.failure_reason) status.append(h("span", { class: "sub" }, adapter.failure_reason));
  return [
    status,
    h("td", { class: "num" }, adapter.version ?? "–"),
    h("td", { class: "num" }, adapter.rank ?? "–"),
    h("td", {}, adapter.target_modules ? adapter.target_modules.join(", ") : "–"),
    h("td", { class: "num" }, bytes(adapter.size_bytes)),
    h("td", {}, dateTime(adapter.created_at)),
  ];
}
