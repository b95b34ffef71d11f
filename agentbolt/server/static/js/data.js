// Loading helpers shared by pages.

import { get, getAll } from "./api.js";

/**
 * Every resources version, newest first. Versions never change once published, so they are
 * cached in ``state`` and only a first small page is asked for on each poll.
 */
export async function allResources(state, signal) {
  const head = await get("/resources", { limit: 20 }, { signal });
  const known = state.resources;
  const fresh = head.items.some((r) => !known?.byVersion.has(r.version));
  if (known && !fresh && (head.items[0]?.version ?? null) === (known.items[0]?.version ?? null)) return known;
  const all = head.next_cursor ? await getAll("/resources", {}, { signal, maxItems: 5000, pageSize: 500 }) : { items: head.items, truncated: false };
  state.resources = { items: all.items, truncated: all.truncated, byVersion: new Map(all.items.map((r) => [r.version, r])) };
  return state.resources;
}

/** busy / idle / gone / revoked: a runner unseen for two lease lengths (at least 30 s) is gone;
 * one an admin revoked is revoked, whatever it last did. */
export function runnerState(worker, now, leaseSeconds) {
  if (worker.revoked_at != null) return "revoked";
  const horizon = Math.max(30, 2 * (leaseSeconds || 30));
  if (now - worker.last_seen > horizon) return "gone"; // heartbeats and dequeues both count
  return worker.running > 0 ? "busy" : "idle";
}

export const FINAL = new Set(["succeeded", "failed", "cancelled"]);
