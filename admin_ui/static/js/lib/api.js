// The public JSON API, called with the signed-in bearer token. Nothing else talks to the server.

const TOKEN_KEY = "loramux.token";
const IDENTITY_KEY = "loramux.identity";

/** The signed-in session: {token, identity} or null. Kept in sessionStorage (this tab only). */
export function currentSession() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const identity = sessionStorage.getItem(IDENTITY_KEY);
  if (!token || !identity) return null;
  try {
    return { token, identity: JSON.parse(identity) };
  } catch {
    return null;
  }
}

export function saveSession(token, identity) {
  sessionStorage.setItem(TOKEN_KEY, token);
  sessionStorage.setItem(IDENTITY_KEY, JSON.stringify(identity));
}

export function clearSession() {
  sessionStorage.removeItem(TOKEN_KEY);
  sessionStorage.removeItem(IDENTITY_KEY);
}

/**
 * An error the API answered (status, message and code from its error body), or a network
 * failure (status 0).
 */
export class ApiError extends Error {
  constructor(status, message, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function errorFrom(response) {
  let message = `${response.status} ${response.statusText}`.trim();
  let code = null;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || null;
    }
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(response.status, message, code);
}

function url(path, query) {
  const target = new URL(path, window.location.origin);
  for (const [key, value] of Object.entries(query || {})) {
    if (value !== undefined && value !== null && value !== "") target.searchParams.set(key, value);
  }
  return target.pathname + target.search;
}

function authHeaders(token) {
  const session = currentSession();
  const bearer = token ?? (session && session.token);
  return bearer ? { Authorization: `Bearer ${bearer}` } : {};
}

/** When the stored token stops working (revoked, deleted tenant), the session is over. */
function endSessionOn401(error, token) {
  if (error.status === 401 && token === undefined && currentSession()) {
    clearSession();
    const next = encodeURIComponent(window.location.pathname + window.location.search);
    const reason = encodeURIComponent(error.message);
    window.location.assign(`/ui/signin?expired=${reason}&next=${next}`);
  }
}

/**
 * fetch() with the bearer token. Resolves to the parsed JSON (or the Response with `raw`),
 * rejects with ApiError carrying the API's own message.
 */
export async function api(path, { method = "GET", body, query, token, raw = false, signal } = {}) {
  const headers = authHeaders(token);
  const init = { method, headers, signal };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(url(path, query), init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(
      0,
      `Could not reach the server (${err.message}). Check your connection and try again.`,
    );
  }
  if (!response.ok) {
    const error = await errorFrom(response);
    endSessionOn401(error, token);
    throw error;
  }
  if (raw) return response;
  if (response.status === 204) return null;
  return response.json();
}

/**
 * POST a multipart form with upload progress (fetch cannot report it; XMLHttpRequest can).
 * onProgress(fraction) while the body goes up; onSent() once it is all sent (the server is
 * now working on it). Resolves to {status, body}; rejects with ApiError.
 */
export function uploadForm(path, form, { onProgress, onSent } = {}) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", path);
    for (const [key, value] of Object.entries(authHeaders())) xhr.setRequestHeader(key, value);
    xhr.responseType = "text";
    xhr.upload.addEventListener("progress", (event) => {
      if (event.lengthComputable && onProgress) onProgress(event.loaded / event.total);
    });
    xhr.upload.addEventListener("load", () => onSent && onSent());
    xhr.addEventListener("load", () => {
      let body = null;
      try {
        body = JSON.parse(xhr.responseText);
      } catch {
        body = null;
      }
      if (xhr.status >= 200 && xhr.status < 300) {
        resolve({ status: xhr.status, body });
        return;
      }
      const message =
        (body && body.error && body.error.message) || `${xhr.status} ${xhr.statusText}`;
      const error = new ApiError(xhr.status, message, body && body.error ? body.error.code : null);
      endSessionOn401(error, undefined);
      reject(error);
    });
    xhr.addEventListener("error", () =>
      reject(new ApiError(0, "The upload was interrupted: the server could not be reached.")),
    );
    xhr.send(form);
  });
}

/**
 * POST a JSON body and read the server-sent events of the answer as they arrive
 * (fetch + ReadableStream). onEvent(data) gets each parsed `data:` payload; resolves when
 * the stream ends ("[DONE]" or closed). An `error` event rejects with ApiError.
 */
export async function streamEvents(path, body, { onEvent, signal }) {
  const response = await api(path, { method: "POST", body, raw: true, signal });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const payload = JSON.parse(data);
      if (payload.error) throw new ApiError(503, payload.error.message, payload.error.code);
      onEvent(payload);
    }
  }
}
