// Overview: queue and outcome counts, throughput, runners, the latest rollouts.

import { get } from "../api.js";
import { barChart } from "../charts.js";
import { runnerState } from "../data.js";
import { ago, fmtInt, fmtNum, fmtPct, fmtTime, h, hrefFor, shortId, truncate } from "../dom.js";
import { badge, card, empty, modeTag, mono, stat, table } from "../ui.js";

const THROUGHPUT_EVERY_S = 10; // the bucketed series is re-read this often; counts every poll
const FINISHED = ["succeeded", "failed", "cancelled"];

async function throughput(ctx, stats) {
  const st = ctx.state;
  const now = ctx.now();
  if (!st.tp || now - st.tpAt >= THROUGHPUT_EVERY_S) {
    st.tp = await get("/dashboard/throughput", { window: 3600, bucket: 60 }, { signal: ctx.signal });
    st.tpAt = now;
    st.tpCounts = stats.rollouts;
    return st.tp;
  }
  // Between re-reads, what finished since (from the counts) goes into the current bucket.
  const buckets = st.tp.buckets.map((b) => ({ ...b }));
  const last = buckets[buckets.length - 1];
  for (const s of FINISHED) last[s] += Math.max(0, (stats.rollouts[s] || 0) - (st.tpCounts[s] || 0));
  return { ...st.tp, buckets };
}

async function load(ctx) {
  const opts = { signal: ctx.signal };
  const [stats, workers, recent] = await Promise.all([
    get("/stats", null, opts),
    get("/workers", null, opts),
    get("/rollouts", { newest_first: true, limit: 8 }, opts),
  ]);
  const tp = await throughput(ctx, stats);
  return { stats, workers, recent: recent.items, tp, now: ctx.now() };
}

function perMinute(tp, minutes) {
  // Full buckets only: the last one is still filling up.
  const full = tp.buckets.slice(0, -1).slice(-minutes);
  const total = full.reduce((sum, b) => sum + FINISHED.reduce((s, k) => s + b[k], 0), 0);
  return full.length ? (total / (full.length * tp.bucket_seconds)) * 60 : 0;
}

function statCards(d, ctx) {
  const r = d.stats.rollouts;
  const finished = r.succeeded + r.failed;
  const lease = ctx.info()?.lease_seconds;
  const states = d.workers.map((w) => runnerState(w, d.now, lease));
  const alive = states.filter((s) => s === "busy" || s === "idle").length;
  const busy = states.filter((s) => s === "busy").length;
  const rate = perMinute(d.tp, 10);
  return h("div", { class: "stats-grid" },
    stat("Queue depth", fmtInt(r.queued), { sub: r.queued ? "waiting for a runner" : "queue is empty", testid: "stat-queued" }),
    stat("Running", fmtInt(r.running), { sub: `${busy} busy runner${busy === 1 ? "" : "s"}`, tone: r.running ? "running" : "", testid: "stat-running" }),
    stat("Succeeded", fmtInt(r.succeeded), { sub: finished ? `${fmtPct(r.succeeded / finished)} of finished` : "none finished yet", tone: r.succeeded ? "succeeded" : "", testid: "stat-succeeded" }),
    stat("Failed", fmtInt(r.failed), { sub: r.cancelled ? `${fmtInt(r.cancelled)} cancelled` : "none cancelled", tone: r.failed ? "failed" : "", testid: "stat-failed" }),
    stat("Throughput", h("span", {}, fmtNum(rate, 1), h("span", { class: "stat-unit" }, "/min")), { sub: "finished, last 10 min", testid: "stat-throughput" }),
    stat("Runners alive", h("span", {}, fmtInt(alive), h("span", { class: "stat-unit" }, ` of ${d.workers.length}`)), {
      sub: d.workers.length ? `last seen ${ago(Math.max(...d.workers.map((w) => w.last_seen)), d.now).textContent}` : "none registered", testid: "stat-runners",
    }));
}

function throughputCard(d) {
  const buckets = d.tp.buckets.map((b) => ({ x: b.start, values: b }));
  const total = d.tp.buckets.reduce((s, b) => s + FINISHED.reduce((n, k) => n + b[k], 0), 0);
  const chart = barChart({
    id: "throughput", buckets, height: 200,
    stacks: [
      { key: "succeeded", name: "Succeeded", cls: "st-succeeded" },
      { key: "failed", name: "Failed", cls: "st-failed" },
      { key: "cancelled", name: "Cancelled", cls: "st-cancelled" },
    ],
    xFormat: (t) => fmtTime(t).slice(0, 5), yLabel: "per minute",
    tooltipTitle: (b) => `${fmtTime(b.x).slice(0, 5)}–${fmtTime(b.x + d.tp.bucket_seconds).slice(0, 5)}`,
    ariaLabel: "Rollouts finished per minute over the last hour",
    emptyText: "No rollouts finished in the last hour. Bars appear here as runners finish rollouts.",
  });
  return card("Throughput", chart, { id: "throughput-card", subtitle: `Rollouts finished per minute, last hour · ${fmtInt(total)} in total` });
}

function runnersCard(d, ctx) {
  const lease = ctx.info()?.lease_seconds;
  if (!d.workers.length) {
    return card("Runners", empty("No runners yet", h("span", {}, "Start one with ", h("code", {}, "agentbolt runner"), "; it appears here on its first dequeue.")), { id: "runners" });
  }
  const label = { busy: "Busy", idle: "Idle", gone: "Gone", revoked: "Revoked" };
  const rows = d.workers.map((w) => {
    const s = runnerState(w, d.now, lease);
    return [mono(truncate(w.id, 28)), h("span", { class: `runner-state rs-${s}` }, h("span", { class: "dot", "aria-hidden": "true" }), label[s]),
      fmtInt(w.running), fmtInt(w.claims), ago(w.last_seen, d.now)];
  });
  return card("Runners", table([
    { label: "Runner" }, { label: "State" }, { label: "Running", cls: "num" }, { label: "Claims", cls: "num" }, { label: "Last heartbeat" },
  ], rows, { caption: "Runners", key: (i) => d.workers[i].id }), { id: "runners", subtitle: "Alive: seen within two lease lengths" });
}

function recentCard(d) {
  if (!d.recent.length) {
    return card("Latest rollouts", empty("No rollouts yet", "Rollouts appear here as soon as an algorithm or a client enqueues tasks."), { id: "recent" });
  }
  const rows = d.recent.map((r) => [
    h("a", { href: hrefFor(`/rollouts/${encodeURIComponent(r.id)}`), class: "mono link", title: r.id }, shortId(r.id).slice(0, 10)),
    badge(r.status), modeTag(r.mode), r.reward === null ? h("span", { class: "faint" }, "—") : h("span", { class: "mono" }, fmtNum(r.reward)),
    ago(r.updated_at, d.now),
  ]);
  return card("Latest rollouts", table([
    { label: "Rollout" }, { label: "Status" }, { label: "Mode" }, { label: "Reward", cls: "num" }, { label: "Updated" },
  ], rows, { caption: "Latest rollouts", key: (i) => d.recent[i].id }), {
    id: "recent", actions: h("a", { href: "#/rollouts", class: "btn btn-sm" }, "All rollouts"),
  });
}

export default {
  title: "Overview",
  load,
  view(d, ctx) {
    return h("div", { class: "page page-overview" },
      statCards(d, ctx),
      throughputCard(d),
      h("div", { class: "grid-2" }, runnersCard(d, ctx), recentCard(d)));
  },
};
