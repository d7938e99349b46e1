// Every page's chrome: who is signed in, the role guard, the phone menu and signing out.

import { clearSession, currentSession } from "./api.js";
import { $, fill, h } from "./dom.js";

export const HOMES = { operator: "/ui/operator/tenants", tenant: "/ui/tenant/adapters" };

function toSignIn() {
  const next = encodeURIComponent(window.location.pathname + window.location.search);
  window.location.replace(`/ui/signin?next=${next}`);
}

/**
 * Start a page of `role`: returns the session, or null after sending the browser where it
 * belongs (sign-in when signed out; the user's own home when the page is another role's).
 */
export function startPage(role) {
  const session = currentSession();
  if (!session) {
    toSignIn();
    return null;
  }
  if (session.identity.role !== role) {
    window.location.replace(HOMES[session.identity.role]);
    return null;
  }
  showIdentity(session.identity);
  wireMenu();
  $("#sign-out").addEventListener("click", signOut);
  return session;
}

function showIdentity(identity) {
  const who = $("#whoami");
  if (identity.role === "operator") {
    fill(who, "Operator", h("small", {}, "Admin token"));
  } else {
    fill(who, identity.tenant_name, h("small", {}, "Tenant API key"));
  }
}

function wireMenu() {
  const toggle = $("#menu-toggle");
  const sidebar = $("#sidebar");
  toggle.addEventListener("click", () => {
    const open = !sidebar.classList.contains("open");
    sidebar.classList.toggle("open", open);
    toggle.setAttribute("aria-expanded", String(open));
  });
}

export function signOut() {
  clearSession();
  window.location.assign("/ui/signin?signed_out=1");
}
