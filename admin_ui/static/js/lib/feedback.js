// Visible feedback: toasts, busy buttons, and API errors shown next to what caused them.

import { $ } from "./dom.js";

export function toast(message, kind = "ok", seconds = 5) {
  const box = $("#toasts");
  if (!box) return;
  const note = document.createElement("div");
  note.className = `toast ${kind}`;
  note.textContent = message;
  box.append(note);
  setTimeout(() => note.remove(), seconds * 1000);
}

/** Mark a button busy while `work` runs; returns what `work` returns. */
export async function busy(button, label, work) {
  const original = [...button.childNodes];
  button.disabled = true;
  button.setAttribute("aria-busy", "true");
  const spinner = document.createElement("span");
  spinner.className = "spinner";
  button.replaceChildren(spinner, document.createTextNode(label));
  try {
    return await work();
  } finally {
    button.replaceChildren(...original);
    button.disabled = false;
    button.removeAttribute("aria-busy");
  }
}

function fieldOf(form, name) {
  return form.querySelector(`[data-field="${name}"]`);
}

export function clearErrors(form) {
  for (const field of form.querySelectorAll(".field.invalid")) field.classList.remove("invalid");
  for (const message of form.querySelectorAll(".field-error")) message.textContent = "";
  for (const input of form.querySelectorAll("[aria-invalid]"))
    input.removeAttribute("aria-invalid");
}

export function setFieldError(form, name, message) {
  const field = fieldOf(form, name);
  if (!field) return false;
  field.classList.add("invalid");
  const slot = field.querySelector(".field-error");
  if (slot) slot.textContent = message;
  const input = field.querySelector("input, select, textarea");
  if (input) input.setAttribute("aria-invalid", "true");
  return true;
}

/**
 * Show an ApiError beside the fields it names. Validation errors read
 * "field: message; other: message"; `codes` maps error codes to a field (e.g. a name
 * conflict to "name"). Whatever names no field goes to `fallback` (an element).
 */
export function showApiError(form, error, { codes = {}, fallback } = {}) {
  const leftovers = [];
  const byCode = codes[error.code];
  if (byCode && setFieldError(form, byCode, error.message)) {
    focusFirstInvalid(form);
    return;
  }
  if (error.code === "invalid_parameters") {
    for (const part of error.message.split("; ")) {
      const match = /^([\w.]+): (.*)$/.exec(part);
      const name = match && match[1].split(".").pop();
      if (!match || !setFieldError(form, name, sentence(match[2]))) leftovers.push(part);
    }
  } else {
    leftovers.push(error.message);
  }
  if (leftovers.length && fallback) {
    fallback.textContent = leftovers.join(" ");
    fallback.hidden = false;
  }
  focusFirstInvalid(form);
}

function sentence(text) {
  return text ? text[0].toUpperCase() + text.slice(1) + (/[.!?]$/.test(text) ? "" : ".") : text;
}

function focusFirstInvalid(form) {
  const input = form.querySelector('[aria-invalid="true"]');
  if (input) input.focus();
}

/** A button that needs a second click to act ("Revoke" -> "Confirm revoke"). */
export function confirmButton(button, confirmLabel, action) {
  let armed = false;
  let timer = null;
  const label = button.textContent;
  button.addEventListener("click", async () => {
    if (!armed) {
      armed = true;
      button.textContent = confirmLabel;
      button.classList.add("confirming");
      timer = setTimeout(() => {
        armed = false;
        button.textContent = label;
        button.classList.remove("confirming");
      }, 4000);
      return;
    }
    clearTimeout(timer);
    button.classList.remove("confirming");
    await busy(button, "Working…", action);
    armed = false;
    button.textContent = label;
  });
}
