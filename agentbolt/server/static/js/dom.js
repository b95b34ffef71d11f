// Building and updating the page without a framework.
//
// Views are pure functions from data to DOM, built with h() / svg(). They never attach event
// listeners: links navigate, and buttons carry data-action, handled once at the page root
// (see app.js). That makes morph() safe: a poll builds a fresh tree and morph() patches the
// live one in place, so focus, scroll position, open <details> and text selection survive.

const SVG_NS = "http://www.w3.org/2000/svg";

function append(el, child) {
  if (child === null || child === undefined || child === false || child === true) return;
  if (Array.isArray(child)) {
    for (const c of child) append(el, c);
  } else if (child instanceof Node) {
    el.appendChild(child);
  } else {
    el.appendChild(document.createTextNode(String(child)));
  }
}

function setProps(el, props) {
  for (const [key, value] of Object.entries(props || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") {
      el.setAttribute("class", Array.isArray(value) ? value.filter(Boolean).join(" ") : value);
    } else if (key === "style") {
      // CSSOM, not a style attribute: the page's CSP forbids inline style attributes.
      for (const [prop, v] of Object.entries(value)) el.style.setProperty(prop, v);
    } else if (key === "value" && "value" in el) {
      el._value = String(value);
    } else {
      el.setAttribute(key, value === true ? "" : String(value));
    }
  }
}

/** An HTML element: h("a", {href: "#/"}, "text", child, [more]). Text is always text. */
export function h(tag, props, ...children) {
  const el = document.createElement(tag);
  setProps(el, props);
  append(el, children);
  if (el._value !== undefined) el.value = el._value; // after the <option>s exist
  return el;
}

/** An SVG element, same calling convention as h(). */
export function svg(tag, props, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  setProps(el, props);
  append(el, children);
  return el;
}

export function fragment(...children) {
  const frag = document.createDocumentFragment();
  append(frag, children);
  return frag;
}

// ------------------------------------------------------------------ morph

function syncAttributes(live, next) {
  for (const { name } of [...live.attributes]) {
    if (!next.hasAttribute(name) && !(name === "open" && live.tagName === "DETAILS")) {
      live.removeAttribute(name);
    }
  }
  for (const { name, value } of [...next.attributes]) {
    if (name === "open" && live.tagName === "DETAILS") continue; // the user's choice wins
    if (live.getAttribute(name) === value) continue;
    if (name === "style") live.style.cssText = next.style.cssText;
    else live.setAttribute(name, value);
  }
}

function syncValue(live, next) {
  if ((live.tagName === "INPUT" || live.tagName === "SELECT" || live.tagName === "TEXTAREA")
      && live !== document.activeElement && live.value !== next.value) {
    live.value = next.value;
  }
}

function sameKind(a, b) {
  if (a.nodeType !== b.nodeType || a.nodeName !== b.nodeName) return false;
  if (a.nodeType !== Node.ELEMENT_NODE) return true;
  return a.getAttribute("data-key") === b.getAttribute("data-key");
}

function morphChildren(live, next) {
  const liveKids = [...live.childNodes];
  const nextKids = [...next.childNodes];
  const keyed = new Map();
  for (const kid of liveKids) {
    const key = kid.nodeType === Node.ELEMENT_NODE && kid.getAttribute("data-key");
    if (key) keyed.set(`${kid.nodeName}|${key}`, kid);
  }
  let cursor = live.firstChild;
  for (const want of nextKids) {
    const key = want.nodeType === Node.ELEMENT_NODE && want.getAttribute("data-key");
    let match = key ? keyed.get(`${want.nodeName}|${key}`) : cursor && sameKind(cursor, want) ? cursor : null;
    if (match && key) keyed.delete(`${want.nodeName}|${key}`);
    if (match) {
      if (match !== cursor) live.insertBefore(match, cursor);
      else cursor = cursor.nextSibling;
      morphNode(match, want);
    } else {
      live.insertBefore(want, cursor);
    }
  }
  while (cursor) {
    const after = cursor.nextSibling;
    live.removeChild(cursor);
    cursor = after;
  }
}

function morphNode(live, next) {
  if (live.nodeType === Node.TEXT_NODE || live.nodeType === Node.COMMENT_NODE) {
    if (live.nodeValue !== next.nodeValue) live.nodeValue = next.nodeValue;
    return;
  }
  syncAttributes(live, next);
  morphChildren(live, next);
  syncValue(live, next);
}

/** Make ``container``'s children look like ``next`` (a node or fragment), reusing live nodes. */
export function morph(container, next) {
  const holder = document.createElement("div");
  holder.appendChild(next);
  morphChildren(container, holder);
}

/** Replace ``container``'s children outright (first render of a page). */
export function replace(container, next) {
  container.replaceChildren(next);
}

/** A hash route: hrefFor("/rollouts", {status: ["failed"]}) -> "#/rollouts?status=failed". */
export function hrefFor(path, query) {
  const q = new URLSearchParams();
  const entries = query instanceof URLSearchParams ? [...query.entries()] : Object.entries(query || {});
  for (const [k, v] of entries) {
    if (v === null || v === undefined || v === "") continue;
    for (const item of Array.isArray(v) ? v : [v]) q.append(k, item);
  }
  const qs = q.toString();
  return `#${path}${qs ? `?${qs}` : ""}`;
}

// ------------------------------------------------------------------ formatting

const nf = new Intl.NumberFormat("en-US");

export function fmtInt(n) {
  return n === null || n === undefined ? "—" : nf.format(n);
}

export function fmtNum(n, digits = 3) {
  if (n === null || n === undefined || Number.isNaN(n)) return "—";
  if (Number.isInteger(n)) return nf.format(n);
  const abs = Math.abs(n);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return n.toExponential(2);
  return Number(n.toFixed(digits)).toString();
}

export function fmtPct(x) {
  return x === null || x === undefined || Number.isNaN(x) ? "—" : `${Math.round(x * 100)}%`;
}

export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "—";
  if (seconds < 0) seconds = 0;
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 60) return `${seconds.toFixed(seconds < 10 ? 2 : 1)} s`;
  const m = Math.floor(seconds / 60);
  if (m < 60) return `${m} m ${String(Math.floor(seconds % 60)).padStart(2, "0")} s`;
  const hours = Math.floor(m / 60);
  if (hours < 48) return `${hours} h ${String(m % 60).padStart(2, "0")} m`;
  return `${Math.floor(hours / 24)} d ${hours % 24} h`;
}

export function fmtMs(ms) {
  return ms === null || ms === undefined ? "—" : fmtDuration(ms / 1000);
}

/** "12 s ago", "3 min ago"; ``now`` in Unix seconds (server clock when known). */
export function fmtAgo(ts, now) {
  if (!ts) return "—";
  const d = Math.max(0, now - ts);
  if (d < 2) return "just now";
  if (d < 60) return `${Math.floor(d)} s ago`;
  if (d < 3600) return `${Math.floor(d / 60)} min ago`;
  if (d < 86400) return `${Math.floor(d / 3600)} h ago`;
  return `${Math.floor(d / 86400)} d ago`;
}

const timeFmt = new Intl.DateTimeFormat(undefined, { hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false });
const dateTimeFmt = new Intl.DateTimeFormat(undefined, { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", hour12: false });
const fullFmt = new Intl.DateTimeFormat(undefined, { dateStyle: "medium", timeStyle: "medium" });

/** A short absolute time: "14:03:22" today, "Dec 2, 14:03" otherwise. */
export function fmtTime(ts) {
  if (!ts) return "—";
  const d = new Date(ts * 1000);
  return d.toDateString() === new Date().toDateString() ? timeFmt.format(d) : dateTimeFmt.format(d);
}

export function fmtFull(ts) {
  return ts ? fullFmt.format(new Date(ts * 1000)) : "";
}

/** <time> showing relative age, the exact moment in its title. */
export function ago(ts, now) {
  if (!ts) return h("span", { class: "faint" }, "—");
  return h("time", { datetime: new Date(ts * 1000).toISOString(), title: fmtFull(ts) }, fmtAgo(ts, now));
}

export function json(value, indent = 2) {
  try {
    return JSON.stringify(value, null, indent);
  } catch {
    return String(value);
  }
}

export function truncate(text, n) {
  const s = String(text ?? "");
  return s.length > n ? `${s.slice(0, n - 1)}…` : s;
}

export function shortId(id) {
  return String(id || "").replace(/^(ro|at|task)-/, "");
}
