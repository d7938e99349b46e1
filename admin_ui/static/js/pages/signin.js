// Sign-in: the token is checked with GET /v1/me, which also says the role.

import { api, ApiError, currentSession, saveSession } from "../lib/api.js";
import { $ } from "../lib/dom.js";
import { busy, clearErrors, setFieldError } from "../lib/feedback.js";
import { HOMES } from "../lib/shell.js";

const form = $("#signin-form");
const input = $("#token");
const params = new URLSearchParams(window.location.search);

function safeNext(role) {
  // Only our own pages of the right role: never an open redirect.
  const next = params.get("next");
  const prefix = role === "operator" ? "/ui/operator/" : "/ui/tenant/";
  return next && next.startsWith(prefix) ? next : HOMES[role];
}

function showNotice() {
  const notice = $("#signin-notice");
  if (params.has("signed_out")) {
    notice.textContent = "You are signed out. The token was removed from this browser.";
    notice.hidden = false;
  } else if (params.has("expired")) {
    notice.className = "notice warn";
    notice.textContent = `Your session ended: ${params.get("expired")} Sign in again.`;
    notice.hidden = false;
  }
}

$("#token-reveal").addEventListener("click", (event) => {
  const reveal = input.type === "password";
  input.type = reveal ? "text" : "password";
  event.currentTarget.textContent = reveal ? "Hide" : "Show";
  event.currentTarget.setAttribute("aria-pressed", String(reveal));
});

form.addEventListener("submit", async (event) => {
  event.preventDefault();
  clearErrors(form);
  const token = input.value.trim();
  if (!token) {
    setFieldError(form, "token", "Enter the admin token or an API key.");
    input.focus();
    return;
  }
  await busy($("#signin-submit"), "Signing in…", async () => {
    try {
      const identity = await api("/v1/me", { token });
      saveSession(token, identity);
      window.location.assign(safeNext(identity.role));
    } catch (error) {
      const message =
        error instanceof ApiError && error.status === 401
          ? `That token was not accepted: ${error.message}`
          : error.message;
      setFieldError(form, "token", message);
      input.focus();
      input.select();
    }
  });
});

const signedIn = currentSession();
if (signedIn) {
  window.location.replace(safeNext(signedIn.identity.role)); // already signed in
} else {
  showNotice();
}
