// Building blocks shared by the pages.

import { h, svg } from "./dom.js";

export const STATUSES = ["queued", "running", "succeeded", "failed", "cancelled"];
export const MODES = ["train", "val", "test"];
export const MODE_NAMES = { train: "Train", val: "Validation", test: "Test" };

const STATUS_LABEL = {
  queued: "Queued", running: "Running", succeeded: "Succeeded", failed: "Failed", cancelled: "Cancelled",
  timed_out: "Timed out", lease_expired: "Lease expired", released: "Released",
};

/** A status pill; the shape of its icon differs too, so status never rests on colour alone. */
export function badge(status) {
  const s = String(status || "unknown");
  return h("span", { class: `badge badge-${s}` }, statusIcon(s), STATUS_LABEL[s] || s);
}

function statusIcon(s) {
  const shapes = {
    succeeded: svg("path", { d: "M2.5 6.2 5 8.7l4.5-5" }),
    failed: svg("path", { d: "M3 3l6 6M9 3 3 9" }),
    running: svg("circle", { cx: 6, cy: 6, r: 3.2 }),
    queued: clock(),
    cancelled: svg("path", { d: "M2.8 6h6.4" }),
    timed_out: clock(),
    lease_expired: clock(),
    released: svg("path", { d: "M2.8 6h6.4" }),
  };
  return svg("svg", { class: "badge-icon", viewBox: "0 0 12 12", "aria-hidden": "true", focusable: "false" }, shapes[s] || svg("circle", { cx: 6, cy: 6, r: 2 }));
}

function clock() {
  return svg("g", {}, svg("circle", { cx: 6, cy: 6, r: 4.3 }), svg("path", { d: "M6 3.8V6l1.5 1" }));
}

export function modeTag(mode) {
  return h("span", { class: `tag tag-${mode}` }, MODE_NAMES[mode] || mode);
}

export function card(title, body, { actions = null, cls = "", id = null, subtitle = null } = {}) {
  const headingId = id ? `${id}-title` : null;
  return h("section", { class: ["card", cls], "aria-labelledby": headingId, id },
    title ? h("div", { class: "card-head" },
      h("div", {}, h("h2", { class: "card-title", id: headingId }, title), subtitle ? h("p", { class: "card-sub" }, subtitle) : null),
      actions ? h("div", { class: "card-actions" }, actions) : null) : null,
    body);
}

export function stat(label, value, { sub = null, tone = "", testid = null } = {}) {
  return h("div", { class: ["stat", tone && `stat-${tone}`], "data-testid": testid },
    h("div", { class: "stat-label" }, label),
    h("div", { class: "stat-value" }, value),
    sub ? h("div", { class: "stat-sub" }, sub) : null);
}

/** A message where content would be: nothing yet, nothing matches, not found. */
export function empty(title, text, action = null, { icon = "inbox" } = {}) {
  return h("div", { class: "empty", role: "status" },
    emptyIcon(icon),
    h("p", { class: "empty-title" }, title),
    text ? h("p", { class: "empty-text" }, text) : null,
    action ? h("div", { class: "empty-action" }, action) : null);
}

function emptyIcon(kind) {
  const paths = {
    inbox: "M4 13h4l1.5 2.5h5L16 13h4M4 13l2.5-7h11L20 13v5H4z",
    alert: "M12 4 2.5 20h19zM12 10v4.5M12 17.3v.2",
    lock: "M6 11h12v9H6zM8.5 11V8a3.5 3.5 0 0 1 7 0v3",
    plug: "M9 3v5M15 3v5M6 8h12v3a6 6 0 0 1-12 0zM12 17v4",
    chart: "M4 20h16M6 16l4-5 3 3 5-7",
    search: "M10.5 4a6.5 6.5 0 1 0 0 13 6.5 6.5 0 0 0 0-13zM15.5 15.5 20 20",
  };
  return svg("svg", { class: "empty-icon", viewBox: "0 0 24 24", "aria-hidden": "true", focusable: "false" }, svg("path", { d: paths[kind] || paths.inbox }));
}

/** A table with a header row; ``rows`` are arrays of cells (nodes or text). */
export function table(columns, rows, { caption = null, cls = "", key = null } = {}) {
  return h("div", { class: "table-wrap" },
    h("table", { class: ["table", cls] },
      caption ? h("caption", { class: "sr-only" }, caption) : null,
      h("thead", {}, h("tr", {}, columns.map((c) => h("th", { scope: "col", class: c.cls || null }, c.label ?? c)))),
      h("tbody", {}, rows.map((cells, i) => h("tr", { "data-key": key ? key(i) : null },
        cells.map((cell, j) => h("td", { class: columns[j]?.cls || null }, cell)))))));
}

/** A definition list of label/value pairs (skips pairs whose value is null). */
export function facts(pairs, cls = "") {
  return h("dl", { class: ["facts", cls] },
    pairs.filter(([, v]) => v !== null && v !== undefined).map(([k, v]) => h("div", { class: "fact" }, h("dt", {}, k), h("dd", {}, v))));
}

export function mono(text, cls = "") {
  return h("code", { class: ["mono", cls] }, text);
}

/** Long enough to scroll inside its box (max-height in the CSS)? */
export function scrolls(text, lines = 16, chars = 1500) {
  const s = String(text ?? "");
  return s.length > chars || s.split("\n").length > lines;
}

export function codeBlock(text, { label = null, cls = "" } = {}) {
  // A region that scrolls must be reachable by keyboard; short ones stay out of the tab order.
  return h("pre", { class: ["code", cls], tabindex: scrolls(text) ? "0" : null, "aria-label": label }, text);
}

/** A segmented group of toggle buttons (aria-pressed) that run ``action`` with data-value. */
export function segmented(label, options, selected, action) {
  return h("div", { class: "segmented", role: "group", "aria-label": label },
    options.map((o) => h("button", {
      type: "button", class: "seg", "data-action": action, "data-value": o.value,
      "aria-pressed": selected.includes(o.value) ? "true" : "false",
    }, o.icon || null, o.label)));
}

export function linkButton(href, text, cls = "btn") {
  return h("a", { href, class: cls }, text);
}
