// One rollout: its attempts, a timeline of its events, its turns (one per LLM call, with the
// step rewards and states the agent gave each), and every event in full — LLM calls with their
// messages, token counts and latency, rewards, tool calls, exceptions — and its named rewards
// (the agent's own, a judge's, a person's) with their history.

import { ApiError, get, getAll } from "../api.js";
import { FINAL } from "../data.js";
import { ago, fmtDuration, fmtFull, fmtInt, fmtMs, fmtNum, fmtTime, h, hrefFor, json, shortId, truncate } from "../dom.js";
import { badge, card, codeBlock, empty, facts, modeTag, mono, segmented, table } from "../ui.js";
import { eventBody, eventSummary, eventTiming, llmTokens, signed, turnsOf, TYPE_LABEL, typeOf } from "./events.js";
import { pendingNames, rewardsCard } from "./rewards.js";
import { timeline } from "./timeline.js";

const MAX_EVENTS = 5000;

async function load(ctx) {
  const id = ctx.params[0];
  const path = `/rollouts/${encodeURIComponent(id)}`;
  const opts = { signal: ctx.signal };
  const [rollout, attempts, events, history] = await Promise.all([
    get(path, null, opts),
    get(`${path}/attempts`, null, opts),
    getAll(`${path}/events`, {}, { signal: ctx.signal, maxItems: MAX_EVENTS }),
    rewardHistory(id, ctx.signal),
  ]);
  return { rollout, attempts, events: events.items, turns: turnsOf(events.items), truncated: events.truncated, history, now: ctx.now() };
}

/** Every revision of the rollout's named rewards, oldest first; null if the server has none to give. */
export async function rewardHistory(id, signal) {
  try {
    return await get(`/rollouts/${encodeURIComponent(id)}/rewards`, null, { signal });
  } catch (err) {
    if (err instanceof ApiError && err.status !== 401) return null; // the page still shows the rest
    throw err;
  }
}

/** A reviewer's slot links to the review page, where it can be scored or rescored. */
function reviewLink(rollout) {
  return (slot) => (slot.source === "reviewer"
    ? h("p", {}, h("a", { class: "btn btn-sm", href: hrefFor("/review", { rollout: rollout.id, name: slot.name }) }, slot.state === "pending" ? "Score in the review page" : "Rescore in the review page"))
    : null);
}

function header(d) {
  const r = d.rollout;
  const total = d.attempts.length;
  return h("div", { class: "detail-head" },
    h("div", { class: "detail-id" }, h("span", { class: "mono", title: "Rollout id" }, r.id), badge(r.status), modeTag(r.mode),
      r.resources_version !== null ? h("a", { class: "tag tag-link", href: `#/resources/${r.resources_version}` }, `resources v${r.resources_version}`) : null,
      r.group_id ? h("span", { class: "tag", title: `Group ${r.group_id}` }, `group ${truncate(r.group_id, 24)}`) : null),
    h("div", { class: "muted" }, `Attempt${total === 1 ? "" : "s"}: ${total} of at most ${r.max_attempts}`));
}

function summary(d) {
  const r = d.rollout;
  const end = r.ended_at || (FINAL.has(r.status) ? r.updated_at : d.now);
  const rewardEvents = d.events.filter((e) => e.type === "reward");
  const named = Object.keys(r.rewards || {}).length;
  const sub = rewardEvents.length ? `${rewardEvents.length} reward event${rewardEvents.length === 1 ? "" : "s"}` : "no reward events";
  return h("div", { class: "summary" },
    h("div", { class: "summary-reward" },
      h("div", { class: "stat-label" }, named ? "Agent's reward" : "Reward"),
      h("div", { class: "summary-reward-value", "data-testid": "rollout-reward" }, r.reward === null ? "—" : fmtNum(r.reward, 4)),
      h("div", { class: "stat-sub" }, named ? `${sub} · ${named} named below` : sub),
      claimsLine(d.events)),
    facts([
      ["Created", h("span", { title: fmtFull(r.created_at) }, fmtTime(r.created_at))],
      ["Started", r.started_at ? h("span", { title: fmtFull(r.started_at) }, fmtTime(r.started_at)) : "not yet"],
      ["Ended", r.ended_at ? h("span", { title: fmtFull(r.ended_at) }, fmtTime(r.ended_at)) : FINAL.has(r.status) ? "—" : "running"],
      ["Duration", r.started_at ? fmtDuration(end - r.started_at) : "—"],
      ["Task", mono(truncate(r.task.id, 40))],
      ["Timeout", r.timeout_seconds ? fmtDuration(r.timeout_seconds) : "none"],
      ["Events", fmtInt(d.events.length)],
      ["Updated", ago(r.updated_at, d.now)],
    ], "facts-grid"));
}

/** What the program claimed but was not rewarded by (a scorer decided): a disagreement is a
 * reward-hacking signal, so it is said beside the reward. */
function claimsLine(events) {
  const claims = events.filter((e) => e.type === "reward_claim").map((e) => e.data || {});
  if (!claims.length) return null;
  const said = claims.map((c) => `${c.name} ${fmtNum(Number(c.value), 4)}`).join(", ");
  const disputed = claims.some((c) => c.disputed === true);
  return h("div", { class: disputed ? "stat-sub error-text" : "stat-sub", "data-testid": "rollout-claims",
    title: "What the program claimed; not trained on" }, `claimed ${said}${disputed ? " · disputed" : ""}`);
}

function errorBox(r) {
  if (!r.error) return null;
  return h("div", { class: "callout callout-error", role: "note" },
    h("div", { class: "callout-title" }, "Error"),
    codeBlock(r.error, { label: "Rollout error", cls: "code-error" }));
}

function taskCard(r) {
  return h("details", { class: "card details-card", "data-key": "task" },
    h("summary", {}, h("span", { class: "card-title" }, "Task input"), h("span", { class: "muted mono" }, truncate(json(r.task.data, 0), 90))),
    h("div", { class: "details-body" },
      codeBlock(json(r.task.data), { label: "Task data" }),
      Object.keys(r.task.metadata || {}).length ? h("div", {}, h("h3", { class: "sub-title" }, "Task metadata"), codeBlock(json(r.task.metadata), { label: "Task metadata" })) : null,
      Object.keys(r.metadata || {}).length ? h("div", {}, h("h3", { class: "sub-title" }, "Rollout metadata"), codeBlock(json(r.metadata), { label: "Rollout metadata" })) : null));
}

function attemptsCard(d) {
  if (!d.attempts.length) {
    return card("Attempts", empty("Not started yet", "This rollout is waiting in the queue for a runner."), { id: "attempts" });
  }
  const rows = d.attempts.map((a) => [
    h("span", { class: "mono" }, `#${a.number}`),
    mono(shortId(a.id)),
    mono(truncate(a.worker_id, 26)),
    badge(a.status),
    h("span", { title: fmtFull(a.started_at) }, fmtTime(a.started_at)),
    fmtDuration((a.ended_at || d.now) - a.started_at),
    a.status === "running" ? ago(a.heartbeat_at, d.now) : h("span", { class: "faint" }, "—"),
    a.reward === null ? h("span", { class: "faint" }, "—") : mono(fmtNum(a.reward)),
    a.error ? h("span", { class: "error-text", title: a.error }, truncate(a.error.split("\n").filter(Boolean).pop() || a.error, 60)) : h("span", { class: "faint" }, "—"),
  ]);
  return card("Attempts", table([
    { label: "#" }, { label: "Attempt" }, { label: "Runner" }, { label: "Status" }, { label: "Started" }, { label: "Duration" },
    { label: "Heartbeat" }, { label: "Reward", cls: "num" }, { label: "Error" },
  ], rows, { caption: "Attempts", key: (i) => d.attempts[i].id }), { id: "attempts" });
}

function selectedTypes(ctx) {
  return ctx.query.getAll("type");
}

function eventFilters(d, ctx, counts) {
  const types = Object.keys(counts);
  const sel = selectedTypes(ctx);
  const options = [{ value: "all", label: h("span", {}, "All ", h("span", { class: "count" }, fmtInt(d.events.length))) },
    ...types.map((t) => ({ value: t, label: h("span", {}, TYPE_LABEL[t] || t, " ", h("span", { class: "count" }, fmtInt(counts[t]))) }))];
  const attemptSel = ctx.query.get("attempt") || "";
  return h("div", { class: "filters filters-compact" },
    h("div", { class: "filter" }, h("span", { class: "field-label" }, "Event type"), segmented("Event type", options, sel.length ? sel : ["all"], "type")),
    d.attempts.length > 1 ? h("div", { class: "filter" }, h("label", { class: "field-label", for: "f-attempt" }, "Attempt"),
      h("select", { id: "f-attempt", class: "select", "data-action": "attempt", value: attemptSel },
        h("option", { value: "" }, "All attempts"), d.attempts.map((a) => h("option", { value: a.id }, `#${a.number} · ${a.status}`)))) : null);
}

function eventsCard(d, ctx) {
  if (!d.events.length) {
    const text = FINAL.has(d.rollout.status) ? "This rollout recorded no events." : "Events appear here as the runner reports them.";
    return card("Events", empty("No events", text), { id: "events" });
  }
  const counts = {};
  for (const e of d.events) counts[typeOf(e)] = (counts[typeOf(e)] || 0) + 1;
  const sel = selectedTypes(ctx);
  const attempt = ctx.query.get("attempt");
  const shown = d.events.filter((e) => (!sel.length || sel.includes(typeOf(e))) && (!attempt || e.attempt_id === attempt));
  return card("Events", h("div", {},
    eventFilters(d, ctx, counts),
    d.truncated ? h("p", { class: "callout" }, `Showing the first ${fmtInt(MAX_EVENTS)} events.`) : null,
    shown.length ? eventList(d, shown) : empty("No events of this kind", null, h("a", { class: "btn", href: hrefFor(ctx.path) }, "Show all events"), { icon: "search" })), {
    id: "events", subtitle: `${fmtInt(d.events.length)} events, in time order`,
  });
}

/**
 * The trace: ``shown`` events of the rollout ``d`` ({rollout, attempts, events, turns}) in
 * order, each with its summary and body (messages, calls, rewards). The review page shows it too.
 */
export function eventList(d, shown = d.events) {
  const numbers = new Map(d.attempts.map((a) => [a.id, a.number]));
  const origin = d.rollout.started_at || d.events[0]?.timestamp || 0;
  const byId = new Map(d.events.map((e) => [e.id, e]));
  const rewardsFor = new Map();
  for (const e of d.events) {
    if (e.type === "reward" && e.data?.llm_call_id !== undefined && e.data?.llm_call_id !== null) {
      const list = rewardsFor.get(e.data.llm_call_id) || [];
      list.push(e);
      rewardsFor.set(e.data.llm_call_id, list);
    }
  }
  const env = { byId, rewardsFor, turns: d.turns, multiAttempt: d.attempts.length > 1, numbers };
  return h("ol", { class: "events" }, shown.map((e) => h("li", { class: `event ev-${typeOf(e)}`, id: `ev-${e.id}`, "data-key": `ev-${e.id}`, tabindex: "-1" },
    h("div", { class: "event-head" },
      h("span", { class: `ev-type et-${typeOf(e)}` }, TYPE_LABEL[typeOf(e)] || e.type),
      h("span", { class: "event-summary" }, eventSummary(e, env)),
      h("span", { class: "event-meta" },
        env.multiAttempt ? h("span", { class: "faint" }, `attempt #${numbers.get(e.attempt_id) ?? "?"}`) : null,
        eventTiming(e),
        h("time", { class: "mono muted", datetime: new Date(e.timestamp * 1000).toISOString(), title: fmtFull(e.timestamp) }, `+${fmtDuration(Math.max(0, e.timestamp - origin))}`))),
    eventBody(e, env))));
}

function timelineCard(d) {
  if (!d.events.length && !d.attempts.length) return null;
  return card("Timeline", timeline(d), { id: "timeline", subtitle: "Time since the rollout started; select a mark to jump to its event" });
}

function turnOutput(e) {
  const choice = e.data?.choices?.[0];
  const m = choice?.message;
  const text = m ? (typeof m.content === "string" ? m.content : "") || (m.tool_calls?.length ? `→ ${m.tool_calls.map((c) => c.function?.name || "tool").join(", ")}()` : "") : choice?.text || "";
  return String(text).replace(/\s+/g, " ");
}

/** One row per model call: the turn's number, its step reward (with a bar) and its state. */
function turnsCard(d) {
  const turns = [...d.turns.values()];
  const labelled = turns.some((t) => t.stepReward !== null || t.state !== null);
  if (turns.length < 2 && !labelled) return null;
  const multi = d.attempts.length > 1;
  const numbers = new Map(d.attempts.map((a) => [a.id, a.number]));
  const top = Math.max(1e-12, ...turns.map((t) => Math.abs(t.stepReward ?? 0)));
  const bar = (v) => {
    if (v === null) return h("span", { class: "faint" }, "—");
    const width = `${Math.round((Math.abs(v) / top) * 100)}%`;
    return h("span", { class: "turn-reward" },
      h("span", { class: "mono" }, signed(v)),
      h("span", { class: "turn-bar", "aria-hidden": "true" }, h("span", { class: v < 0 ? "turn-bar-fill turn-bar-neg" : "turn-bar-fill", style: { width } })));
  };
  const rows = turns.map((t) => {
    const tokens = llmTokens(t.call.data);
    return [
      h("span", { class: "mono strong" }, String(t.turn)),
      ...(multi ? [h("span", { class: "mono" }, `#${numbers.get(t.attempt_id) ?? "?"}`)] : []),
      h("button", { type: "button", class: "btn btn-sm btn-link mono", "data-action": "jump", "data-target": `ev-${t.id}` }, `#${t.id}`),
      t.state === null ? h("span", { class: "faint" }, "—") : h("code", { class: "mono", title: t.state }, truncate(t.state, 48)),
      bar(t.stepReward),
      h("span", { class: "mono muted" }, `${tokens.prompt ?? "?"} → ${tokens.completion ?? "?"}`),
      t.call.data?.error ? h("span", { class: "error-text" }, "error") : h("span", { class: "muted" }, truncate(turnOutput(t.call), 60)),
    ];
  });
  const total = turns.reduce((s, t) => s + (t.stepReward ?? 0), 0);
  const rewarded = turns.filter((t) => t.stepReward !== null).length;
  return card("Turns", table([
    { label: "Turn", cls: "num" }, ...(multi ? [{ label: "Attempt" }] : []), { label: "LLM call" }, { label: "State" },
    { label: "Step reward" }, { label: "Tokens" }, { label: "Output" },
  ], rows, { caption: "Turns: one per model call, with its step reward and state", cls: "turns-table", key: (i) => `turn-${turns[i].id}` }), {
    id: "turns",
    subtitle: rewarded ? `${turns.length} model calls · ${rewarded} with step rewards, summing to ${signed(total)} (not part of the rollout's reward)` : `${turns.length} model calls · no per-call rewards`,
  });
}

function llmTotals(events) {
  const calls = events.filter((e) => e.type === "llm_call");
  let prompt = 0;
  let completion = 0;
  let latency = 0;
  for (const c of calls) {
    const u = c.data?.usage || {};
    prompt += u.prompt_tokens ?? c.data?.prompt_token_ids?.length ?? 0;
    completion += u.completion_tokens ?? (c.data?.choices || []).reduce((s, ch) => s + (ch.token_ids?.length || 0), 0);
    latency += c.data?.latency_ms || 0;
  }
  return { calls: calls.length, prompt, completion, latency };
}

function llmStrip(d) {
  const t = llmTotals(d.events);
  if (!t.calls) return null;
  return h("div", { class: "strip", "data-testid": "llm-totals" },
    h("div", {}, h("span", { class: "strip-label" }, "LLM calls"), h("span", { class: "strip-value" }, fmtInt(t.calls))),
    h("div", {}, h("span", { class: "strip-label" }, "Prompt tokens"), h("span", { class: "strip-value" }, fmtInt(t.prompt))),
    h("div", {}, h("span", { class: "strip-label" }, "Completion tokens"), h("span", { class: "strip-value" }, fmtInt(t.completion))),
    h("div", {}, h("span", { class: "strip-label" }, "Model time"), h("span", { class: "strip-value" }, fmtMs(t.latency))));
}

/** Scroll to the event a button names (data-target) and flash it. */
export function jump(el) {
  const target = document.getElementById(el.dataset.target);
  if (!target) return;
  if (target.tagName === "DETAILS") target.open = true;
  target.scrollIntoView({ block: "start", behavior: window.matchMedia("(prefers-reduced-motion: reduce)").matches ? "auto" : "smooth" });
  target.focus({ preventScroll: true });
  target.classList.add("flash");
  setTimeout(() => target.classList.remove("flash"), 1200);
}

export default {
  title: (ctx, d) => (d ? `Rollout ${shortId(d.rollout.id)}` : "Rollout"),
  crumbs: () => [{ href: "#/rollouts", label: "Rollouts" }],
  load,
  // A finished rollout still changes while a named reward is pending (a judge, a person).
  live: (d) => !d || !FINAL.has(d.rollout.status) || pendingNames(d.rollout).length > 0,
  notFound: (ctx) => empty("Rollout not found", `No rollout has the id “${ctx.params[0]}”.`, h("a", { class: "btn", href: "#/rollouts" }, "Back to rollouts"), { icon: "search" }),
  view(d, ctx) {
    return h("div", { class: "page page-rollout" },
      header(d),
      card(null, h("div", {}, summary(d), llmStrip(d)), { cls: "summary-card" }),
      errorBox(d.rollout),
      rewardsCard(d.rollout, d.history, { actionFor: reviewLink(d.rollout) }),
      taskCard(d.rollout),
      attemptsCard(d),
      timelineCard(d),
      turnsCard(d),
      eventsCard(d, ctx));
  },
  actions: {
    jump,
    type(el, ctx) {
      const value = el.dataset.value;
      const cur = selectedTypes(ctx);
      const next = value === "all" ? [] : cur.includes(value) ? cur.filter((t) => t !== value) : [...cur, value];
      ctx.setQuery({ type: next });
    },
    attempt: (el, ctx) => ctx.setQuery({ attempt: el.value || null }),
  },
};
