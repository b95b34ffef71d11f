// The review queue: finished rollouts awaiting a person's score (GET /rewards/pending with
// source=reviewer), each shown with its task, final answer and trace, and a score form.
//
// A score is sent once per form: the form holds one Idempotency-Key until its score is stored,
// so a double click or a retry after a lost answer is stored once. It says which revision it
// replaces; if someone scored meanwhile the server answers 409 naming them, and the page
// reloads to show their score. A scored rollout can be rescored (#/review?rollout=ID): every
// score is kept as a revision. Event data is shown as text only, never as HTML.

import { ApiError, AuthError, NetworkError, get, getAll, newKey, post } from "../api.js";
import { ago, fmtInt, fmtNum, h, hrefFor, json, shortId, truncate } from "../dom.js";
import { card, codeBlock, empty } from "../ui.js";
import { turnsOf } from "./events.js";
import { scaleText, scoreCell, slotDetail, statePill } from "./rewards.js";
import { eventList, jump, rewardHistory } from "./rollout.js";

const QUEUE_SIZE = 50;
const MAX_EVENTS = 2000;
const MAX_BUTTONS = 21; // a stepped scale with more steps than this gets a number field
const CAN_SCORE = new Set(["admin", "reviewer"]);

async function load(ctx) {
  const name = ctx.query.get("name") || null;
  const queue = await get("/rewards/pending", { source: "reviewer", name, limit: QUEUE_SIZE }, { signal: ctx.signal });
  const skipped = ctx.state.skipped || new Set();
  const wanted = ctx.query.get("rollout");
  const id = wanted || queue.items.find((r) => !skipped.has(r.id))?.id || null;
  const selected = id ? await loadRollout(id, ctx) : null;
  return { queue, name, selected, explicit: Boolean(wanted), now: ctx.now() };
}

async function loadRollout(id, ctx) {
  const path = `/rollouts/${encodeURIComponent(id)}`;
  const [rollout, attempts, events, history] = await Promise.all([
    get(path, null, { signal: ctx.signal }),
    get(`${path}/attempts`, null, { signal: ctx.signal }),
    getAll(`${path}/events`, {}, { signal: ctx.signal, maxItems: MAX_EVENTS }),
    rewardHistory(id, ctx.signal),
  ]);
  return { rollout, attempts, events: events.items, turns: turnsOf(events.items), history };
}

// ------------------------------------------------------------------ form state

/** Per form (rollout and reward name): the key, the score picked, the comment, in flight or not. */
function formState(ctx, rolloutId, name, revision, scale) {
  ctx.state.forms ||= new Map();
  const id = `${rolloutId}|${name}`;
  let st = ctx.state.forms.get(id);
  if (!st || st.revision !== revision) {
    // A new revision (ours or someone else's): a new form, with a key of its own.
    st = { id, rolloutId, name, revision, scale, key: newKey(), picked: null, comment: st?.comment ?? "", busy: false };
    ctx.state.forms.set(id, st);
  }
  return st;
}

function findForm(ctx, id) {
  return ctx.state.forms?.get(id) || null;
}

function canScore(info) {
  if (!info) return true; // unknown: the server decides, and a 403 says why
  return !info.auth || CAN_SCORE.has(info.role);
}

/** The steps of a scale, when it has few enough to be buttons. */
function steps(scale) {
  if (!scale.step) return null;
  const n = Math.round((scale.high - scale.low) / scale.step);
  if (n + 1 > MAX_BUTTONS) return null;
  return Array.from({ length: n + 1 }, (_, k) => Number((scale.low + k * scale.step).toPrecision(12)));
}

/** Why ``score`` is not on ``scale`` (the same rule the server applies), or null. */
function offScale(score, scale) {
  if (!Number.isFinite(score)) return "Enter a number.";
  if (score < scale.low || score > scale.high) return `Score ${fmtNum(score, 6)} is outside the scale ${scaleText(scale)}.`;
  if (scale.step) {
    const k = (score - scale.low) / scale.step;
    if (Math.abs(k - Math.round(k)) > 1e-9) return `Score ${fmtNum(score, 6)} is not on the scale's steps (${scaleText(scale)}).`;
  }
  return null;
}

// ------------------------------------------------------------------ view

function queueCard(d, ctx) {
  const items = d.queue.items;
  const selectedId = d.selected?.rollout.id;
  const skipped = ctx.state.skipped || new Set();
  const list = items.length
    ? h("ol", { class: "review-queue", "data-testid": "review-queue" }, items.map((r) => {
      const names = Object.values(r.rewards || {}).filter((s) => s.source === "reviewer" && s.state === "pending").map((s) => s.name);
      return h("li", { "data-key": `q-${r.id}` },
        h("a", { class: "version-link", href: hrefFor("/review", { rollout: r.id, name: d.name }), "aria-current": r.id === selectedId ? "page" : null },
          h("span", { class: "version-line" }, h("span", { class: "version-num" }, shortId(r.id)),
            skipped.has(r.id) ? h("span", { class: "faint" }, "skipped") : null,
            h("span", { class: "version-time" }, ago(r.ended_at || r.updated_at, d.now))),
          h("span", { class: "muted review-task" }, truncate(json(r.task.data, 0), 70)),
          h("span", { class: "version-changes" }, names.map((n) => h("span", { class: "mini-tag" }, n)))));
    }))
    : h("p", { class: "faint review-queue-empty" }, "Nothing awaits a score.");
  const more = d.queue.next_cursor ? ` (first ${fmtInt(items.length)} shown)` : "";
  return h("aside", { class: "card card-flush split-side" },
    h("div", { class: "card-head" }, h("div", {}, h("h2", { class: "card-title" }, "Queue"),
      h("p", { class: "card-sub", "data-testid": "review-count" }, `${fmtInt(items.length)} awaiting a score${more}`),
      d.name ? h("p", { class: "card-sub" }, "Only “", d.name, "” · ", h("a", { href: hrefFor("/review", {}) }, "all rewards")) : null)),
    h("div", { class: "version-list" }, list));
}

function flashBox(ctx) {
  const f = ctx.state.flash;
  if (!f) return null;
  return h("div", { class: ["callout", f.kind === "error" ? "callout-error" : "callout-ok"], role: f.kind === "error" ? "alert" : "status", "data-testid": "review-flash" },
    f.kind === "error" ? h("div", { class: "callout-title" }, f.title || "Not scored") : null,
    h("span", {}, f.text),
    f.rescore ? h("span", {}, " ", h("a", { href: hrefFor("/review", { rollout: f.rescore.rollout, name: f.rescore.name }) }, "Change this score")) : null);
}

function scoreForm(slot, rollout, ctx) {
  const st = formState(ctx, rollout.id, slot.name, slot.revision, slot.scale);
  const choices = steps(slot.scale);
  const fid = `score-${slot.name}`;
  const rescore = slot.revision > 0;
  const picker = choices
    ? h("div", { class: "segmented score-buttons", role: "group", "aria-label": `Score on ${scaleText(slot.scale)}` },
      choices.map((v) => h("button", {
        type: "button", class: "seg", "data-action": "pick", "data-form": st.id, "data-value": String(v),
        "aria-pressed": st.picked === v ? "true" : "false", disabled: st.busy,
      }, fmtNum(v, 4))))
    : h("input", {
      id: `${fid}-number`, name: "score", type: "number", class: "input score-number", "data-action": "number", "data-form": st.id,
      min: String(slot.scale.low), max: String(slot.scale.high), step: slot.scale.step ? String(slot.scale.step) : "any",
      value: st.picked === null ? "" : String(st.picked), required: true, disabled: st.busy,
    });
  return h("form", { class: "score-form", "data-action": "submit", "data-form": st.id, "data-key": `form-${st.id}|${slot.revision}`, "data-testid": `score-form-${slot.name}`, novalidate: true },
    h("div", { class: "score-form-head" },
      h("h3", { class: "sub-title" }, rescore ? `Rescore “${slot.name}”` : `Score “${slot.name}”`),
      h("span", { class: "muted" }, `on ${scaleText(slot.scale)}`),
      rescore ? h("span", { class: "muted" }, " · now ", scoreCell(slot), slot.author ? ` by ${slot.author}` : "", ` (revision ${slot.revision})`) : statePill(slot.state)),
    choices ? h("span", { class: "field-label" }, "Score") : h("label", { class: "field-label", for: `${fid}-number` }, "Score"),
    picker,
    h("label", { class: "field-label", for: `${fid}-comment` }, "Comment (optional)"),
    h("textarea", { id: `${fid}-comment`, name: "comment", class: "input textarea", rows: "2", maxlength: "10000", "data-action": "comment", "data-form": st.id, value: st.comment, disabled: st.busy }),
    h("div", { class: "score-actions" },
      h("button", { type: "submit", class: "btn btn-primary", disabled: st.busy }, st.busy ? "Sending…" : rescore ? "Submit new score" : "Submit score"),
      !ctx.query.get("rollout") ? h("button", { type: "button", class: "btn btn-ghost", "data-action": "skip", "data-rollout": rollout.id }, "Skip") : null));
}

function readOnlyNote(info) {
  return h("div", { class: "callout", role: "note", "data-testid": "review-readonly" },
    `Your token is a ${info?.role || "read-only"} token: it can read this queue but not score. Scoring needs a reviewer token (ask the server's admin for one) — enter it with “Access token”.`);
}

function finalAnswer(sel) {
  const last = sel.attempts.length ? sel.attempts[sel.attempts.length - 1].id : null;
  const calls = sel.events.filter((e) => e.type === "llm_call" && (!last || e.attempt_id === last));
  const message = calls.length ? calls[calls.length - 1].data?.choices?.[0]?.message : null;
  const text = typeof message?.content === "string" ? message.content : message ? json(message.content ?? message.tool_calls ?? null) : null;
  return text;
}

function selectedView(d, ctx) {
  const sel = d.selected;
  const r = sel.rollout;
  const info = ctx.info();
  const slots = Object.values(r.rewards || {}).filter((s) => s.source === "reviewer" && (!d.name || s.name === d.name));
  const answer = finalAnswer(sel);
  const forms = !slots.length
    ? h("p", { class: "callout" }, "This rollout awaits no reviewer's score.")
    : canScore(info) ? slots.map((s) => scoreForm(s, r, ctx)) : readOnlyNote(info);
  const byName = new Map();
  for (const rev of sel.history || []) byName.set(rev.name, [...(byName.get(rev.name) || []), rev]);
  return h("div", { class: "split-main", "data-testid": "review-selected", "data-rollout": r.id },
    card(null, h("div", { class: "review-head" },
      h("div", { class: "detail-id" }, h("a", { class: "mono", href: `#/rollouts/${encodeURIComponent(r.id)}`, title: "Open the rollout page" }, r.id)),
      h("div", { class: "review-body" },
        h("h3", { class: "sub-title" }, "Task"), codeBlock(json(r.task.data), { label: "Task data" }),
        h("h3", { class: "sub-title" }, "Final answer"),
        answer === null ? h("p", { class: "faint" }, "No model answer recorded.") : h("div", { class: "msg msg-output" }, h("div", { class: "msg-content", "data-testid": "review-answer" }, answer)),
        r.error ? h("div", { class: "callout callout-error" }, h("div", { class: "callout-title" }, "Error"), codeBlock(r.error, { label: "Rollout error" })) : null),
      h("div", { class: "review-forms" }, forms)), { cls: "review-card" }),
    slots.map((s) => card(`History of “${s.name}”`, slotDetail(s, sel.history === null ? null : byName.get(s.name) || []), { id: `review-slot-${s.name}` })),
    card("Trace", sel.events.length ? eventList(sel) : empty("No events", "This rollout recorded no events."), { id: "trace", subtitle: `${fmtInt(sel.events.length)} events, in time order` }));
}

function view(d, ctx) {
  const main = d.selected ? selectedView(d, ctx)
    : h("div", { class: "split-main" }, card(null, empty("Nothing to review", "No finished rollout awaits a reviewer's score. Rollouts enqueued with a reviewer reward (await_rewards) appear here when they succeed.")));
  return h("div", { class: "page page-review" }, flashBox(ctx), h("div", { class: "split" }, queueCard(d, ctx), main));
}

// ------------------------------------------------------------------ actions

function setBusy(form, busy) {
  for (const el of form.querySelectorAll("button, input, textarea")) el.disabled = busy;
}

async function submit(form, ctx) {
  const st = findForm(ctx, form.dataset.form);
  if (!st || st.busy) return; // a second click while the first is on its way sends nothing new
  const raw = form.elements.score ? form.elements.score.value : st.picked;
  if (raw === null || raw === "") return flash(ctx, { kind: "error", title: "No score", text: "Pick a score first." });
  const score = Number(raw);
  const problem = offScale(score, st.scale);
  if (problem) return flash(ctx, { kind: "error", title: "Not on the scale", text: problem });
  const comment = form.elements.comment?.value.trim() || null;
  st.busy = true;
  st.comment = form.elements.comment?.value || "";
  setBusy(form, true);
  try {
    const body = { name: st.name, score, comment, replaces: st.revision };
    const saved = await post(`/rollouts/${encodeURIComponent(st.rolloutId)}/rewards`, body, { idempotencyKey: st.key });
    ctx.state.forms.delete(st.id); // stored: the next score of this reward is a new form
    ctx.state.flash = {
      kind: "ok",
      text: `Scored ${fmtNum(saved.score, 4)} for “${saved.name}” of ${st.rolloutId} (revision ${saved.revision}).`,
      rescore: { rollout: st.rolloutId, name: st.name },
    };
  } catch (err) {
    ctx.state.flash = failure(err, st);
  } finally {
    st.busy = false;
    ctx.reload();
  }
}

/** What went wrong with a score, for the person who gave it. */
function failure(err, st) {
  if (err instanceof ApiError && err.status === 409) {
    st.revision = -1; // start again from the slot as it now stands (a new key on reload)
    return { kind: "error", title: "Scored meanwhile", text: `${err.message} — reloaded: the score shown is the current one.` };
  }
  if (err instanceof ApiError && err.status === 403) {
    return { kind: "error", title: "Not a reviewer token", text: `This token is not a reviewer token, so it cannot score (the server said: ${err.message}).` };
  }
  if (err instanceof AuthError) return { kind: "error", title: "Token rejected", text: `${err.message} Enter a reviewer token with “Access token”.` };
  if (err instanceof NetworkError) {
    return { kind: "error", title: "Not confirmed", text: `${err.message} Your score may not be stored: submit again — the same request is sent, and it is stored once.` };
  }
  return { kind: "error", title: "Not scored", text: err instanceof ApiError ? `${err.message} (HTTP ${err.status})` : String(err?.message || err) };
}

function flash(ctx, f) {
  ctx.state.flash = f;
  ctx.reload();
}

export default {
  title: "Review",
  load,
  view,
  live: () => true,
  actions: {
    jump,
    submit,
    pick(el, ctx) {
      const st = findForm(ctx, el.dataset.form);
      if (!st || st.busy) return;
      st.picked = Number(el.dataset.value);
      for (const b of el.parentElement.querySelectorAll("button")) b.setAttribute("aria-pressed", b === el ? "true" : "false");
    },
    number(el, ctx) {
      const st = findForm(ctx, el.dataset.form);
      if (st) st.picked = el.value === "" ? null : Number(el.value);
    },
    comment(el, ctx) {
      const st = findForm(ctx, el.dataset.form);
      if (st) st.comment = el.value;
    },
    skip(el, ctx) {
      ctx.state.skipped ||= new Set();
      ctx.state.skipped.add(el.dataset.rollout);
      ctx.state.flash = null;
      ctx.reload();
    },
  },
};
