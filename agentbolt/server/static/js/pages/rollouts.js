// Rollouts: a table filtered by status, mode and resources version, newest first, paged by
// the API's cursor. Filters and the cursor live in the URL, so a view can be linked to.

import { get } from "../api.js";
import { allResources } from "../data.js";
import { ago, fmtDuration, fmtInt, fmtNum, h, hrefFor, json, shortId, truncate } from "../dom.js";
import { MODE_NAMES, MODES, STATUSES, badge, card, empty, modeTag, segmented, table } from "../ui.js";

const PAGE_SIZES = [25, 50, 100];
const FIRST = "first"; // stands for "no cursor" in the list of previous pages

function filters(query) {
  const limit = Number(query.get("limit"));
  return {
    status: query.getAll("status").filter((s) => STATUSES.includes(s)),
    mode: MODES.includes(query.get("mode")) ? query.get("mode") : null,
    version: /^\d+$/.test(query.get("version") || "") ? Number(query.get("version")) : null,
    limit: PAGE_SIZES.includes(limit) ? limit : PAGE_SIZES[0],
    cursor: query.get("cursor") || null,
    prev: (query.get("prev") || "").split(",").filter(Boolean),
  };
}

async function load(ctx) {
  const f = filters(ctx.query);
  const opts = { signal: ctx.signal };
  const [page, stats, res] = await Promise.all([
    get("/rollouts", {
      status: f.status, mode: f.mode, resources_version: f.version, limit: f.limit, cursor: f.cursor, newest_first: true,
    }, opts),
    get("/stats", null, opts),
    allResources(ctx.state, ctx.signal),
  ]);
  const versions = new Set(res.items.map((r) => r.version));
  for (const v of stats.by_version) if (v.resources_version !== null) versions.add(v.resources_version);
  if (f.version !== null) versions.add(f.version);
  return { f, page, counts: stats.rollouts, versions: [...versions].sort((a, b) => b - a), now: ctx.now() };
}

function filterBar(d) {
  const { f, counts } = d;
  const total = STATUSES.reduce((s, k) => s + (counts[k] || 0), 0);
  const statusOptions = [{ value: "all", label: h("span", {}, "All ", h("span", { class: "count" }, fmtInt(total))) },
    ...STATUSES.map((s) => ({ value: s, label: h("span", {}, s[0].toUpperCase() + s.slice(1), " ", h("span", { class: "count" }, fmtInt(counts[s] || 0))) }))];
  const selected = f.status.length ? f.status : ["all"];
  const anyFilter = f.status.length || f.mode || f.version !== null;
  return h("div", { class: "filters", role: "search", "aria-label": "Filter rollouts" },
    h("div", { class: "filter" }, h("span", { class: "field-label", id: "status-label" }, "Status"),
      segmented("Status", statusOptions, selected, "status")),
    h("div", { class: "filter" }, h("label", { class: "field-label", for: "f-mode" }, "Mode"),
      h("select", { id: "f-mode", class: "select", "data-action": "mode", value: f.mode || "" },
        h("option", { value: "" }, "All modes"), MODES.map((m) => h("option", { value: m }, MODE_NAMES[m])))),
    h("div", { class: "filter" }, h("label", { class: "field-label", for: "f-version" }, "Resources version"),
      h("select", { id: "f-version", class: "select", "data-action": "version", value: f.version === null ? "" : String(f.version) },
        h("option", { value: "" }, "All versions"), d.versions.map((v) => h("option", { value: String(v) }, `v${v}`)))),
    anyFilter ? h("div", { class: "filter filter-end" }, h("a", { class: "btn btn-ghost", href: hrefFor("/rollouts", { limit: f.limit === PAGE_SIZES[0] ? null : f.limit }) }, "Clear filters")) : null);
}

function duration(r, now) {
  if (!r.started_at || (!r.ended_at && r.status !== "running")) return h("span", { class: "faint" }, "—");
  const secs = (r.ended_at || now) - r.started_at;
  return r.ended_at ? fmtDuration(secs) : h("span", { class: "muted", title: "still running" }, `${fmtDuration(secs)}…`);
}

function rolloutsTable(d) {
  const rows = d.page.items.map((r) => [
    h("a", { href: hrefFor(`/rollouts/${encodeURIComponent(r.id)}`), class: "mono link", title: r.id }, shortId(r.id)),
    badge(r.status),
    modeTag(r.mode),
    r.resources_version === null ? h("span", { class: "faint" }, "—") : h("a", { href: `#/resources/${r.resources_version}`, class: "link" }, `v${r.resources_version}`),
    r.reward === null ? h("span", { class: "faint" }, "—") : h("span", { class: "mono" }, fmtNum(r.reward)),
    h("span", { class: "mono" }, `${r.attempts} / ${r.max_attempts}`),
    ago(r.created_at, d.now),
    duration(r, d.now),
    h("span", { class: "mono faint task-preview", title: truncate(json(r.task.data, 0), 500) }, truncate(json(r.task.data, 0), 56)),
  ]);
  return table([
    { label: "Rollout" }, { label: "Status" }, { label: "Mode" }, { label: "Version" }, { label: "Reward", cls: "num" },
    { label: "Attempts", cls: "num" }, { label: "Created" }, { label: "Duration" }, { label: "Task" },
  ], rows, { caption: "Rollouts, newest first", key: (i) => d.page.items[i].id, cls: "rollouts-table" });
}

function pager(d) {
  const { f, page } = d;
  const pageNo = f.prev.length + 1;
  const n = page.items.length;
  return h("nav", { class: "pager", "aria-label": "Pages" },
    h("span", { class: "muted", "data-testid": "page-info" }, n ? `Page ${pageNo} · ${n} rollout${n === 1 ? "" : "s"}` : `Page ${pageNo}`),
    h("div", { class: "pager-buttons" },
      h("label", { class: "muted", for: "f-limit" }, "Rows per page"),
      h("select", { id: "f-limit", class: "select select-sm", "data-action": "limit", value: String(f.limit) },
        PAGE_SIZES.map((n) => h("option", { value: String(n) }, String(n)))),
      h("button", { type: "button", class: "btn btn-sm", "data-action": "newer", disabled: !f.cursor }, "← Newer"),
      h("button", { type: "button", class: "btn btn-sm", "data-action": "older", disabled: !page.next_cursor, "data-cursor": page.next_cursor || "" }, "Older →")));
}

function view(d) {
  const anyFilter = d.f.status.length || d.f.mode || d.f.version !== null;
  let body;
  if (d.page.items.length) body = h("div", {}, rolloutsTable(d), pager(d));
  else if (anyFilter || d.f.cursor) {
    body = empty("No rollouts match these filters", "Try another status, mode or version.", h("a", { class: "btn", href: "#/rollouts" }, "Clear filters"), { icon: "search" });
  } else {
    body = empty("No rollouts yet", "Rollouts appear here once an algorithm or a client enqueues tasks; this page updates live.");
  }
  return h("div", { class: "page page-rollouts" }, card(null, h("div", {}, filterBar(d), body), { cls: "card-flush" }));
}

// A filter change starts again from the newest page.
const reset = { cursor: null, prev: null };

export default {
  title: "Rollouts",
  load,
  view,
  actions: {
    status(el, ctx) {
      const f = filters(ctx.query);
      const value = el.dataset.value;
      let next = value === "all" ? [] : f.status.includes(value) ? f.status.filter((s) => s !== value) : [...f.status, value];
      if (next.length === STATUSES.length) next = [];
      ctx.setQuery({ status: next, ...reset });
    },
    mode: (el, ctx) => ctx.setQuery({ mode: el.value || null, ...reset }),
    version: (el, ctx) => ctx.setQuery({ version: el.value || null, ...reset }),
    limit: (el, ctx) => ctx.setQuery({ limit: el.value === String(PAGE_SIZES[0]) ? null : el.value, ...reset }),
    older(el, ctx) {
      const f = filters(ctx.query);
      if (!el.dataset.cursor) return;
      ctx.setQuery({ cursor: el.dataset.cursor, prev: [...f.prev, f.cursor || FIRST].join(",") });
    },
    newer(el, ctx) {
      const f = filters(ctx.query);
      const prev = [...f.prev];
      const back = prev.pop();
      ctx.setQuery({ cursor: back && back !== FIRST ? back : null, prev: prev.length ? prev.join(",") : null });
    },
  },
};
