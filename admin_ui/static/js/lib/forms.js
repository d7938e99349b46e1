// Reading form inputs into API bodies.

import { setFieldError } from "./feedback.js";

/** The input's number, or null when left empty (unlimited / unset). */
export function numberOrNull(input) {
  const text = input.value.trim();
  if (text === "") return input.validity && input.validity.badInput ? Number.NaN : null;
  return Number(text);
}

/**
 * {body, bad}: body maps each named input of `form` to its number (null when empty); bad
 * lists the inputs holding something that is not a number (marked next to the field).
 */
export function readNumbers(form, names) {
  const body = {};
  const bad = [];
  for (const name of names) {
    const value = numberOrNull(form.elements[name]);
    if (Number.isNaN(value)) {
      bad.push(name);
      setFieldError(form, name, "Enter a number.");
    } else {
      body[name] = value;
    }
  }
  return { body, bad };
}

/** Drop keys whose value is null (for bodies where "unset" means "use the default"). */
export function withoutNulls(body) {
  return Object.fromEntries(Object.entries(body).filter(([, value]) => value !== null));
}

/** Put `value` in an input: "" for null. */
export function setValue(input, value) {
  input.value = value === null || value === undefined ? "" : String(value);
}
