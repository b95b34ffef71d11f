// The server's HTTP API with the bearer token kept in localStorage: reads, and the one write
// the dashboard makes (a reviewer's score, sent with an Idempotency-Key).

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
export function get(path, params, { signal, token } = {}) {
  return request("GET", path, params, undefined, { signal, token });
}

/**
 * POST ``body`` as JSON to ``/api{path}`` and return the answer's JSON. ``idempotencyKey`` is
 * sent as the Idempotency-Key header: the server answers a repeat of the key with the first
 * result, so a retried or double-clicked write is stored once.
 */
export function post(path, body, { signal, idempotencyKey } = {}) {
  return request("POST", path, null, body, { signal, idempotencyKey });
}

/** A random key for one logical write (crypto.randomUUID needs a secure context; this does not). */
export function newKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

async function request(method, path, params, body, { signal, token, idempotencyKey } = {}) {
  const sent = token ?? getToken();
  const headers = { accept: "application/json" };
  if (sent) headers.authorization = `Bearer ${sent}`;
  if (body !== undefined) headers["content-type"] = "application/json";
  if (idempotencyKey) headers["idempotency-key"] = idempotencyKey;
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
    const init = { method, headers, signal: controller.signal, cache: "no-store" };
    if (body !== undefined) init.body = JSON.stringify(body);
    response = await fetch(`/api${path}${query(params)}`, init);
    text = await response.text();
  } catch (err) {
    if (signal?.aborted) throw err; // navigation cancelled it: not a connection problem
    throw new NetworkError(timedOut ? "The server did not answer in time." : "The server could not be reached.");
  } finally {
    clearTimeout(timer);
    signal?.removeEventListener("abort", cancel);
  }
  let parsed = null;
  try {
    parsed = text ? JSON.parse(text) : null;
  } catch {
    parsed = null;
  }
  if (response.ok) return parsed;
  const message = errorMessage(parsed) || response.statusText || `HTTP ${response.status}`;
  if (response.status === 401) throw new AuthError(message, Boolean(sent));
  if (response.status >= 502 && response.status <= 504) throw new NetworkError(`The server is unavailable (HTTP ${response.status}).`);
  throw new ApiError(response.status, message, parsed?.error?.type);
}

/** The message of an error body: ours ({"error": {"message"}}) or FastAPI's ({"detail": ...}). */
function errorMessage(parsed) {
  if (parsed?.error?.message) return parsed.error.message;
  const detail = parsed?.detail;
  if (typeof detail === "string") return detail;
  if (Array.isArray(detail)) return detail.map((d) => d?.msg || String(d)).join("; ");
  return "";
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
