// A rollout's events on one time axis, one lane per event type: calls and spans as bars as
// long as they took, instant events as marks, attempts as shaded bands.

import { fmtDuration, fmtMs, fmtNum, h, svg, truncate } from "../dom.js";
import { ticks } from "../charts.js";
import { interval, KNOWN, llmTokens, TYPE_LABEL, typeOf } from "./events.js";

const W = 960;
const LANE = 26;
const LEFT = 104;
const RIGHT = 16;
const TOP = 8;
const AXIS = 24;

function markTitle(e) {
  const d = e.data || {};
  const iv = interval(e);
  const took = iv ? ` · ${fmtMs((iv[1] - iv[0]) * 1000)}` : "";
  switch (typeOf(e)) {
    case "llm_call": {
      const t = llmTokens(d);
      return `LLM call #${e.id} · ${d.model || "model"} · ${t.prompt ?? "?"} → ${t.completion ?? "?"} tokens${took}`;
    }
    case "reward":
      return `Reward ${fmtNum(Number(d.value), 4)}${d.name ? ` (${d.name})` : ""}${Number.isInteger(d.llm_call_id) ? ` for LLM call #${d.llm_call_id}` : ""}`;
    case "state":
      return `State ${truncate(String(d.key ?? ""), 60)}${Number.isInteger(d.llm_call_id) ? ` for LLM call #${d.llm_call_id}` : ""}`;
    case "tool_call":
      return `Tool call ${d.name || ""}${took}`;
    case "exception":
      return `${d.type || "Exception"}: ${truncate(d.message || "", 80)}`;
    case "message":
      return `Message (${d.role || "?"})`;
    case "span":
      return `Span ${d.name || ""}${took}`;
    default:
      return e.type;
  }
}

export function timeline(d) {
  const events = d.events;
  const lanes = [...KNOWN, "other"].filter((t) => events.some((e) => typeOf(e) === t));
  const starts = [d.rollout.started_at, ...d.attempts.map((a) => a.started_at), ...events.map((e) => (interval(e) || [e.timestamp])[0])].filter(Boolean);
  const ends = [d.rollout.ended_at, ...d.attempts.map((a) => a.ended_at || d.now), ...events.map((e) => e.timestamp)].filter(Boolean);
  if (!starts.length) return h("p", { class: "muted" }, "Nothing has happened yet.");
  const t0 = Math.min(...starts);
  const t1 = Math.max(t0 + 0.001, ...ends);
  const height = TOP + Math.max(1, lanes.length) * LANE + AXIS;
  const x = (t) => LEFT + ((t - t0) / (t1 - t0)) * (W - LEFT - RIGHT);
  const laneY = (type) => TOP + lanes.indexOf(type) * LANE;

  const g = svg("g", {});
  // attempts as bands behind everything, labelled when there are several
  d.attempts.forEach((a, i) => {
    const xa = x(a.started_at);
    const xb = x(a.ended_at || d.now);
    g.append(svg("rect", { class: `tl-attempt ${i % 2 ? "tl-attempt-alt" : ""} tl-att-${a.status}`, x: xa, y: TOP - 4, width: Math.max(1, xb - xa), height: lanes.length * LANE + 4 }));
    if (d.attempts.length > 1) g.append(svg("text", { class: "tl-attempt-label", x: xa + 4, y: height - 4 }, `#${a.number}`));
  });
  lanes.forEach((type, i) => {
    const y = TOP + i * LANE;
    g.append(svg("text", { class: "tl-lane-label", x: 0, y: y + LANE / 2 + 4 }, TYPE_LABEL[type]));
    g.append(svg("line", { class: "tl-lane-line", x1: LEFT, x2: W - RIGHT, y1: y + LANE, y2: y + LANE }));
  });
  for (const t of ticks(0, t1 - t0, 6)) {
    g.append(svg("text", { class: "tick tl-tick", x: x(t0 + t), y: height - 6, "text-anchor": "middle" }, fmtDuration(t).replace(" ", "\u202f")));
  }
  for (const e of events) {
    const type = typeOf(e);
    const y = laneY(type);
    const iv = interval(e);
    let mark;
    if (iv) {
      const xa = x(iv[0]);
      mark = svg("rect", { class: `tl-bar et-fill-${type}${e.data?.error ? " tl-error" : ""}`, x: xa, y: y + 6, width: Math.max(3, x(iv[1]) - xa), height: LANE - 12, rx: 2 });
    } else if (type === "reward") {
      const cx = x(e.timestamp);
      const cy = y + LANE / 2;
      mark = svg("path", { class: "tl-mark et-fill-reward", d: `M${cx} ${cy - 6}L${cx + 6} ${cy}L${cx} ${cy + 6}L${cx - 6} ${cy}Z` });
    } else if (type === "exception") {
      const cx = x(e.timestamp);
      const cy = y + LANE / 2;
      mark = svg("path", { class: "tl-mark et-fill-exception", d: `M${cx} ${cy - 7}L${cx + 7} ${cy + 6}L${cx - 7} ${cy + 6}Z` });
    } else {
      mark = svg("circle", { class: `tl-mark et-fill-${type}`, cx: x(e.timestamp), cy: y + LANE / 2, r: 4.5 });
    }
    // Marks are for the mouse; the event list below is the keyboard path to the same events.
    g.append(svg("g", { class: "tl-hit", "data-action": "jump", "data-target": `ev-${e.id}` }, svg("title", {}, markTitle(e)), mark));
  }
  return h("div", { class: "timeline" },
    svg("svg", { class: "timeline-svg", viewBox: `0 0 ${W} ${height}`, role: "img", "aria-label": `Timeline of ${events.length} events over ${fmtDuration(t1 - t0)}` }, g));
}
