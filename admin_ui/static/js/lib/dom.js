// Building DOM from data: text always goes in as text, never as HTML.

/**
 * h("td", {class: "num"}, "12") -> <td class="num">12</td>. Children may be nodes, strings
 * or arrays.
 */
export function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") {
      node.addEventListener(key.slice(2), value);
    } else if (key === "dataset") {
      Object.assign(node.dataset, value);
    } else {
      node.setAttribute(key, value === true ? "" : String(value));
    }
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function $(selector, root = document) {
  return root.querySelector(selector);
}

export function $$(selector, root = document) {
  return [...root.querySelectorAll(selector)];
}

/** Replace every child of `node` with `children`. */
export function fill(node, ...children) {
  node.replaceChildren();
  append(node, children);
  return node;
}

function fullWidthRow(tbody, ...content) {
  const columns = tbody.closest("table").querySelectorAll("thead th").length;
  return h("tr", {}, h("td", { colspan: columns, class: "empty" }, ...content));
}

/** A table body's rows, or one full-width row saying it is empty. */
export function fillRows(tbody, rows, emptyTitle, emptyText) {
  if (rows.length) fill(tbody, rows);
  else fill(tbody, fullWidthRow(tbody, h("strong", {}, emptyTitle), emptyText || ""));
}

/** One full-width row saying why the table could not be filled. */
export function failRows(tbody, message) {
  fill(tbody, fullWidthRow(tbody, h("div", { class: "notice danger", role: "alert" }, message)));
}

export function pageData(name) {
  return document.body.dataset[name];
}
