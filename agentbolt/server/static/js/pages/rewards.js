// A rollout's named rewards: the agent's own (Rollout.reward) and every slot given after the run
// by an evaluator (a judge, a scoring function) or a reviewer (a person). Each is shown with
// where it came from, its state (a pending reward is shown as pending, never as 0), its score on
// its scale and the 0-1 value algorithms read, and — open — a judge's reason and recorded calls,
// the cut its transcript took, and every revision it has had (GET /rollouts/{id}/rewards).

import { fmtFull, fmtInt, fmtNum, fmtTime, h, json, truncate } from "../dom.js";
import { card, codeBlock, empty, facts, table } from "../ui.js";

const SOURCE_LABEL = { agent: "agent", evaluator: "evaluator", reviewer: "reviewer" };
const STATE_LABEL = { pending: "Pending", scored: "Scored", error: "Error" };

/** The slots of a rollout in name order (the agent's own reward is not one of them). */
export function slotsOf(rollout) {
  return Object.values(rollout?.rewards || {}).sort((a, b) => a.name.localeCompare(b.name));
}

/** Names of the slots still pending on a run that succeeded (only those can still be scored:
 * a failed or cancelled run keeps its slots pending, with nothing to judge). */
export function pendingNames(rollout) {
  if (rollout?.status !== "succeeded") return [];
  return slotsOf(rollout).filter((s) => s.state === "pending").map((s) => s.name);
}

/** A pending slot of a run that did not succeed: it will never be scored. */
function unscorable(rollout, slot) {
  return slot.state === "pending" && rollout?.status !== "succeeded";
}

function notScored() {
  return h("span", { class: "faint", "data-testid": "reward-unscorable" }, "not scored: the run did not succeed");
}

/** "1 to 5 in steps of 1", "0 to 1". */
export function scaleText(scale) {
  const s = scale || { low: 0, high: 1 };
  return `${fmtNum(s.low, 4)} to ${fmtNum(s.high, 4)}${s.step ? ` in steps of ${fmtNum(s.step, 4)}` : ""}`;
}

/** A reward's state as a pill; a pending one says so in words, it never reads as a number. */
export function statePill(state) {
  const s = String(state || "pending");
  return h("span", { class: `badge badge-reward-${s}`, "data-testid": "reward-state" }, STATE_LABEL[s] || s);
}

/** The score as given, on its scale ("4 of 1–5"); "pending" or "error" while it has none. */
export function scoreCell(slot) {
  if (slot.state === "pending") return h("span", { class: "muted" }, "pending");
  if (slot.state === "error" || slot.score === null || slot.score === undefined) return h("span", { class: "error-text" }, "no score");
  return h("span", { class: "mono" }, fmtNum(slot.score, 4), h("span", { class: "faint" }, ` of ${fmtNum(slot.scale.low, 4)}–${fmtNum(slot.scale.high, 4)}`));
}

function valueCell(value) {
  return value === null || value === undefined ? h("span", { class: "faint" }, "—") : h("span", { class: "mono" }, fmtNum(value, 4));
}

function sourceTag(source) {
  return h("span", { class: `tag tag-source-${source}` }, SOURCE_LABEL[source] || source);
}

function agentRow(rollout) {
  const r = rollout.reward;
  return [
    h("span", { class: "strong mono" }, "agent"),
    sourceTag("agent"),
    r === null || r === undefined ? h("span", { class: "faint" }, "none") : statePill("scored"),
    r === null || r === undefined ? h("span", { class: "faint" }, "—") : h("span", { class: "mono" }, fmtNum(r, 4)),
    valueCell(r),
    h("span", { class: "faint" }, "the agent's own"),
    h("span", { class: "faint" }, "—"),
  ];
}

function slotRow(rollout, slot) {
  const never = unscorable(rollout, slot);
  return [
    h("span", { class: "strong mono" }, slot.name),
    sourceTag(slot.source),
    never ? notScored() : statePill(slot.state),
    never ? h("span", { class: "faint" }, "—") : scoreCell(slot),
    valueCell(slot.value),
    slot.author ? h("span", {}, truncate(slot.author, 40)) : h("span", { class: "faint" }, "—"),
    h("span", { class: "mono" }, String(slot.revision)),
  ];
}

/** What a judge's data says about the cut of its transcript, in one sentence. */
export function cutNote(cut) {
  if (!cut || typeof cut !== "object") return null;
  const parts = [`The transcript was cut from ${fmtInt(cut.chars_before)} to ${fmtInt(cut.chars_after)} characters`];
  if (cut.turns_cut) parts.push(`${fmtInt(cut.turns_cut)} middle turn${cut.turns_cut === 1 ? "" : "s"} left out`);
  if (cut.chars_cut) parts.push(`${fmtInt(cut.chars_cut)} characters cut`);
  return h("p", { class: "callout reward-cut", "data-testid": "reward-cut" }, `${parts.join("; ")} before the judge saw it.`);
}

function callTokens(usage) {
  if (!usage || typeof usage !== "object") return "—";
  const total = usage.total_tokens ?? ((usage.prompt_tokens ?? 0) + (usage.completion_tokens ?? 0));
  return `${fmtInt(usage.prompt_tokens ?? null)} → ${fmtInt(usage.completion_tokens ?? null)} (${fmtInt(total)})`;
}

function callMessages(request) {
  const messages = Array.isArray(request) ? request : Array.isArray(request?.messages) ? request.messages : null;
  if (!messages) return codeBlock(json(request ?? null), { label: "Judge request" });
  return h("div", { class: "conversation" }, messages.map((m) => h("div", { class: ["msg", `msg-${m?.role || "message"}`] },
    h("div", { class: "msg-role" }, String(m?.role || "message")),
    h("div", { class: "msg-content" }, typeof m?.content === "string" ? m.content : json(m?.content ?? null)))));
}

/** The judge calls a score rests on: each request, its answer, tokens, latency, cost, cache. */
function callsList(calls) {
  if (!Array.isArray(calls) || !calls.length) return null;
  return h("div", { class: "reward-calls", "data-testid": "reward-calls" },
    h("h4", { class: "sub-title" }, `Judge calls (${calls.length})`),
    h("ol", { class: "reward-call-list" }, calls.map((c, i) => h("li", { class: "reward-call" },
      h("dl", { class: "chips" },
        [["Call", String(i + 1)], ["Tokens", callTokens(c?.usage)],
          ["Latency", typeof c?.latency_s === "number" ? `${fmtNum(c.latency_s, 3)} s` : "—"],
          ["Cost", typeof c?.cost_usd === "number" ? `$${fmtNum(c.cost_usd, 6)}` : "unknown"],
          ["Cached", c?.cached ? "yes" : "no"]].map(([k, v]) => h("div", { class: "chip" }, h("dt", {}, k), h("dd", {}, v)))),
      h("details", { class: "more", "data-key": `call-${i}` }, h("summary", {}, "Request and answer"),
        h("div", { class: "more-body" },
          h("h4", { class: "sub-title" }, "Request"), callMessages(c?.request),
          h("h4", { class: "sub-title" }, "Answer"), codeBlock(typeof c?.answer === "string" ? c.answer : json(c?.answer ?? null), { label: "Judge answer" })))))));
}

function historyTable(revisions) {
  if (revisions === null) return h("p", { class: "faint" }, "History unavailable.");
  if (!revisions.length) return h("p", { class: "faint", "data-testid": "reward-history-empty" }, "No score given yet.");
  const rows = [...revisions].reverse().map((r) => [
    h("span", { class: "mono" }, String(r.revision)),
    statePill(r.state),
    r.score === null || r.score === undefined ? h("span", { class: "faint" }, "—") : h("span", { class: "mono" }, fmtNum(r.score, 4)),
    valueCell(r.value),
    r.author ? truncate(r.author, 40) : h("span", { class: "faint" }, "—"),
    r.comment ? h("span", { title: r.comment }, truncate(r.comment, 80)) : r.error ? h("span", { class: "error-text", title: r.error }, truncate(r.error, 80)) : h("span", { class: "faint" }, "—"),
    h("span", { title: fmtFull(r.created_at) }, fmtTime(r.created_at)),
  ]);
  return h("div", { "data-testid": "reward-history" },
    h("h4", { class: "sub-title" }, `History (${revisions.length} revision${revisions.length === 1 ? "" : "s"}, newest first)`),
    table([{ label: "Rev.", cls: "num" }, { label: "State" }, { label: "Score", cls: "num" }, { label: "Value", cls: "num" }, { label: "By" }, { label: "Comment" }, { label: "When" }],
      rows, { caption: "Revisions of this reward", key: (i) => `rev-${revisions[revisions.length - 1 - i].id}` }));
}

/** Everything known about one slot: its facts, a judge's reason, calls and cut, and its history. */
export function slotDetail(slot, revisions, { extra = null } = {}) {
  const d = slot.data || {};
  const judge = d.judge && typeof d.judge === "object" ? d.judge : null;
  const group = d.group && typeof d.group === "object" ? d.group : null;
  return h("div", { class: "reward-detail" },
    facts([
      ["Source", sourceTag(slot.source)],
      ["Scale", scaleText(slot.scale)],
      ["State", statePill(slot.state)],
      ["Score", scoreCell(slot)],
      ["Value (0–1)", valueCell(slot.value)],
      ["Revision", String(slot.revision)],
      ["By", slot.author || null],
      ["Updated", slot.revision ? h("span", { title: fmtFull(slot.updated_at) }, fmtTime(slot.updated_at)) : null],
      ["Judge", judge ? `${judge.model || "model"}${judge.base_url ? ` at ${judge.base_url}` : ""}` : null],
      ["Group", group ? `${group.id ?? "?"} · ${(group.position ?? 0) + 1} of ${group.size ?? "?"}` : null],
    ], "facts-grid"),
    slot.comment ? h("div", { class: "reward-comment" }, h("h4", { class: "sub-title" }, "Comment"), h("p", { class: "reward-text" }, slot.comment)) : null,
    typeof d.reason === "string" && d.reason ? h("div", { class: "reward-reason", "data-testid": "reward-reason" }, h("h4", { class: "sub-title" }, "Judge's reason"), h("p", { class: "reward-text" }, d.reason)) : null,
    slot.error ? h("div", { class: "callout callout-error" }, h("div", { class: "callout-title" }, "Could not be scored"), codeBlock(slot.error, { label: "Reward error", cls: "code-error" })) : null,
    cutNote(d.cut),
    callsList(d.calls),
    extra,
    historyTable(revisions));
}

/**
 * The rewards card of the rollout page. ``history``: every revision of the rollout's slots
 * (oldest first), or null when it could not be read; ``actionFor(slot)`` adds a control (the
 * review link) to a reviewer's slot.
 */
export function rewardsCard(rollout, history, { actionFor = null } = {}) {
  const slots = slotsOf(rollout);
  const rows = [agentRow(rollout), ...slots.map((slot) => slotRow(rollout, slot))];
  const keys = ["agent", ...slots.map((s) => s.name)];
  const pending = pendingNames(rollout).length;
  const overview = table(
    [{ label: "Reward" }, { label: "Source" }, { label: "State" }, { label: "Score" }, { label: "Value (0–1)", cls: "num" }, { label: "By" }, { label: "Rev.", cls: "num" }],
    rows, { caption: "Named rewards of this rollout", cls: "rewards-table", key: (i) => `reward-${keys[i]}` });
  const byName = new Map();
  for (const r of history || []) {
    const list = byName.get(r.name) || [];
    list.push(r);
    byName.set(r.name, list);
  }
  const details = slots.map((slot) => h("details", { class: "reward-slot", "data-key": `slot-${slot.name}`, "data-testid": `reward-slot-${slot.name}` },
    h("summary", {}, h("span", { class: "strong mono" }, slot.name), " ", sourceTag(slot.source), " ",
      unscorable(rollout, slot) ? notScored() : [statePill(slot.state), " ", scoreCell(slot)],
      slot.revision > 1 ? h("span", { class: "faint" }, ` · ${slot.revision} revisions`) : null),
    slotDetail(slot, history === null ? null : byName.get(slot.name) || [], { extra: actionFor?.(slot) || null })));
  const subtitle = slots.length
    ? `The agent's own reward and ${slots.length} named reward${slots.length === 1 ? "" : "s"}${pending ? ` · ${pending} pending (not counted as 0)` : ""}`
    : "The agent's own reward; no named rewards were awaited or given";
  return card("Rewards", h("div", { class: "rewards" }, overview,
    slots.length ? h("div", { class: "reward-slots" }, details) : null,
    !slots.length && (rollout.reward === null || rollout.reward === undefined) ? empty("No rewards", "Neither the agent nor an evaluator or reviewer has scored this rollout.") : null),
  { id: "rewards", subtitle });
}
