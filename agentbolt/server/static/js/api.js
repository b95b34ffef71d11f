// The server's HTTP API, read-only, with the bearer token kept in localStorage.

const TOKEN_KEY = "agentbolt.token";
const TIMEOUT_MS = 15000;

/** The server answered with an error status (body: {"error": {"type", "message"}}). */
export class ApiError extends Error {
  constructor(status, message, kind) {
    super(message);
    this.status = status;
    this.kind = kind || "http_error";
  }
}

/** 401: no token, or the server rejected the one we sent. */
export class AuthError extends ApiError {
  constructor(message, hadToken) {
    super(401, message, "unauthorized");
    this.hadToken = hadToken;
  }
}

/** The server could not be reached at all (down, restarting, network gone, timeout). */
export class NetworkError extends Error {}

// Kept in memory as well, for browsers where storage is disabled.
let memoryToken = "";

export function getToken() {
  try {
    return localStorage.getItem(TOKEN_KEY) ?? memoryToken;
  } catch {
    return memoryToken;
  }
}

export function setToken(token) {
  memoryToken = token || "";
  try {
    if (token) localStorage.setItem(TOKEN_KEY, token);
    else localStorage.removeItem(TOKEN_KEY);
  } catch {
    /* storage disabled: the token lives for this page only */
  }
}

export function query(params) {
  const q = new URLSearchParams();
  for (const [key, value] of Object.entries(params || {})) {
    if (value === null || value === undefined || value === "") continue;
    for (const v of Array.isArray(value) ? value : [value]) q.append(key, String(v));
  }
  const s = q.toString();
  return s ? `?${s}` : "";
}

/** GET ``/api{path}`` and return its JSON. ``token`` overrides the stored one (to test it). */
export async function get(path, params, { signal, token } = {}) {
  const sent = token ?? getToken();
  const headers = { accept: "application/json" };
  if (sent) headers.authorization = `Bearer ${sent}`;
  // One signal for "navigated away" and "took too long" (AbortSignal.any is too recent to rely on).
  const controller = new AbortController();
  let timedOut = false;
  const timer = setTimeout(() => {
    timedOut = true;
    controller.abort();
  }, TIMEOUT_MS);
  const cancel = () => controller.abort();
  if (signal?.aborted) controller.abort();
  signal?.addEventListener("abort", cancel, { once: true });
  let response;
  let text;
  try {
    response = await fetch(`/api${path}${query(params)}`, { headers, signal: controller.signal, cache: "no-store" });
    text = await response.text();
  } catch (err) {
    if (signal?.aborted) throw err; // navigation cancelled it: not a connection problem
    throw new NetworkError(timedOut ? "The server did not answer in time." : "The server could not be reached.");
  } finally {
    clearTimeout(timer);
    signal?.removeEventListener("abort", cancel);
  }
  let body = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch {
    body = null;
  }
  if (response.ok) return body;
  const message = body?.error?.message || body?.detail || response.statusText || `HTTP ${response.status}`;
  if (response.status === 401) throw new AuthError(message, Boolean(sent));
  if (response.status >= 502 && response.status <= 504) throw new NetworkError(`The server is unavailable (HTTP ${response.status}).`);
  throw new ApiError(response.status, message, body?.error?.type);
}

/** Every page of a cursor-paginated list, up to ``maxItems``. */
export async function getAll(path, params, { signal, maxItems = 5000, pageSize = 1000 } = {}) {
  const items = [];
  let cursor = null;
  do {
    const page = await get(path, { ...params, limit: pageSize, cursor }, { signal });
    items.push(...page.items);
    cursor = page.next_cursor;
  } while (cursor && items.length < maxItems);
  return { items, truncated: Boolean(cursor) };
}
