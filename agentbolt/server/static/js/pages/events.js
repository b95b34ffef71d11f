// How each event type is shown (the formats are in docs/events.md).

import { fmtInt, fmtMs, fmtNum, h, json, truncate } from "../dom.js";
import { codeBlock, scrolls } from "../ui.js";

export const KNOWN = ["llm_call", "tool_call", "span", "message", "reward", "state", "exception"];

export const TYPE_LABEL = {
  llm_call: "LLM call", tool_call: "Tool call", span: "Span", message: "Message", reward: "Reward",
  state: "State", exception: "Exception", other: "Other",
};

export function typeOf(e) {
  return KNOWN.includes(e.type) ? e.type : "other";
}

const isObj = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
const callOf = (d) => (Number.isInteger(d?.llm_call_id) ? d.llm_call_id : null);

/**
 * The turns of a rollout: one per LLM call, numbered within its attempt in time order, with the
 * per-call rewards that name it (their sum is the turn's step reward) and the state declared
 * for it (the last `state` event naming it). Map: LLM call id -> turn.
 */
export function turnsOf(events) {
  const turns = new Map();
  const perAttempt = new Map();
  for (const e of events) {
    if (e.type !== "llm_call") continue;
    const n = (perAttempt.get(e.attempt_id) || 0) + 1;
    perAttempt.set(e.attempt_id, n);
    turns.set(e.id, { id: e.id, turn: n, attempt_id: e.attempt_id, call: e, rewards: [], stepReward: null, state: null });
  }
  for (const e of events) {
    const t = turns.get(callOf(e.data));
    if (!t) continue;
    if (e.type === "reward" && Number.isFinite(Number(e.data.value))) {
      t.rewards.push(e);
      t.stepReward = (t.stepReward ?? 0) + Number(e.data.value);
    } else if (e.type === "state" && typeof e.data.key === "string") {
      t.state = e.data.key;
    }
  }
  return turns;
}

/** Text of a chat message's content: a string, or a list of parts ({type: "text", text}). */
function contentText(content) {
  if (content === null || content === undefined) return "";
  if (typeof content === "string") return content;
  if (Array.isArray(content)) {
    return content.map((p) => (typeof p === "string" ? p : p?.type === "text" ? p.text : p?.type ? `[${p.type}]` : json(p))).join("\n");
  }
  return json(content);
}

export function llmTokens(data) {
  const u = data?.usage || {};
  const prompt = u.prompt_tokens ?? data?.prompt_token_ids?.length ?? null;
  const ids = (data?.choices || []).map((c) => c.token_ids?.length).filter((n) => n !== undefined && n !== null);
  const completion = u.completion_tokens ?? (ids.length ? ids.reduce((a, b) => a + b, 0) : null);
  return { prompt, completion };
}

function spanSeconds(data) {
  const start = Number(data?.start_time);
  const end = Number(data?.end_time);
  if (!Number.isFinite(start) || !Number.isFinite(end)) return null;
  const scale = start > 1e14 ? 1e9 : start > 1e11 ? 1e3 : 1; // nanoseconds from OTLP, or ms, or s
  return { start: start / scale, end: end / scale };
}

/** [start, end] in Unix seconds for events that last (LLM and tool calls, spans), else null. */
export function interval(e) {
  const d = e.data || {};
  if (e.type === "span") {
    const s = spanSeconds(d);
    return s && s.end >= s.start ? [s.start, s.end] : null;
  }
  const ms = e.type === "llm_call" ? d.latency_ms : e.type === "tool_call" ? d.duration_ms : null;
  return typeof ms === "number" && ms >= 0 ? [e.timestamp - ms / 1000, e.timestamp] : null;
}

export function eventTiming(e) {
  const iv = interval(e);
  return iv ? h("span", { class: "mono muted", title: "Duration" }, fmtMs((iv[1] - iv[0]) * 1000)) : null;
}

export function eventSummary(e, env) {
  const d = e.data || {};
  switch (typeOf(e)) {
    case "llm_call": {
      const t = llmTokens(d);
      const choice = d.choices?.[0];
      const out = choice?.message ? contentText(choice.message.content) || (choice.message.tool_calls?.length ? `→ ${choice.message.tool_calls.map((c) => c.function?.name || "tool").join(", ")}()` : "") : choice?.text || "";
      const turn = env?.turns?.get(e.id);
      return h("span", {}, turn ? h("span", { class: "turn-tag", "data-testid": "turn-tag" }, `Turn ${turn.turn}`) : null,
        h("span", { class: "strong" }, d.model || d.request?.model || "model"),
        h("span", { class: "muted" }, ` · ${t.prompt ?? "?"} → ${t.completion ?? "?"} tokens`),
        d.error ? h("span", { class: "error-text" }, " · error") : null,
        turn && turn.stepReward !== null ? h("span", { class: "step-reward mono", title: "Step reward: the sum of the rewards for this call" }, ` · step ${signed(turn.stepReward)}`) : null,
        turn && turn.state !== null ? h("span", { class: "muted", title: `State: ${turn.state}` }, " · state ", h("code", { class: "mono" }, truncate(turn.state, 40))) : null,
        out ? h("span", { class: "muted" }, ` · ${truncate(out.replace(/\s+/g, " "), 80)}`) : null);
    }
    case "reward": {
      const linked = callOf(d) !== null;
      const turn = linked ? env?.turns?.get(d.llm_call_id) : null;
      return h("span", {}, h("span", { class: "strong mono" }, fmtNum(Number(d.value), 4)),
        d.name ? h("span", { class: "muted" }, ` · ${d.name}`) : null,
        d.final ? h("span", { class: "muted" }, " · final") : null,
        linked ? h("span", { class: "muted" }, ` · for ${turn ? `turn ${turn.turn}, ` : ""}LLM call #${d.llm_call_id}`) : null);
    }
    case "reward_claim":
      return h("span", {}, h("span", { class: "strong mono" }, fmtNum(Number(d.value), 4)),
        h("span", { class: "muted" }, ` · claimed by ${d.name}, not used`),
        d.disputed ? h("span", { class: "error-text" }, " · disputed") : null);
    case "state": {
      const turn = env?.turns?.get(callOf(d));
      return h("span", {}, h("code", { class: "strong mono" }, truncate(String(d.key ?? ""), 80)),
        callOf(d) !== null ? h("span", { class: "muted" }, ` · for ${turn ? `turn ${turn.turn}, ` : ""}LLM call #${d.llm_call_id}`) : null);
    }
    case "tool_call":
      return h("span", {}, h("span", { class: "strong mono" }, `${d.name || "tool"}(`), h("span", { class: "muted mono" }, truncate(json(d.arguments ?? {}, 0), 60)), h("span", { class: "strong mono" }, ")"),
        d.error ? h("span", { class: "error-text" }, " · error") : null);
    case "message":
      return h("span", {}, h("span", { class: "strong" }, d.role || "message"), h("span", { class: "muted" }, ` · ${truncate(contentText(d.content).replace(/\s+/g, " "), 100)}`));
    case "exception":
      return h("span", { class: "error-text" }, h("span", { class: "strong" }, d.type || "Exception"), `: ${truncate(d.message || "", 100)}`);
    case "span":
      return h("span", {}, h("span", { class: "strong" }, d.name || "span"), d.status?.code && d.status.code !== "OK" && d.status.code !== "UNSET" ? h("span", { class: "error-text" }, ` · ${d.status.code}`) : null);
    default:
      return h("span", {}, h("span", { class: "strong mono" }, e.type), h("span", { class: "muted mono" }, ` ${truncate(json(d, 0), 80)}`));
  }
}

// ------------------------------------------------------------------ bodies

const ROLE_LABEL = { system: "System", user: "User", assistant: "Assistant", tool: "Tool", developer: "Developer", function: "Function", log: "Log" };

function toolCalls(calls) {
  if (!calls?.length) return null;
  return h("div", { class: "tool-calls" }, calls.map((c) => {
    const fn = c.function || {};
    let args = fn.arguments;
    try {
      args = typeof args === "string" ? json(JSON.parse(args)) : json(args);
    } catch {
      /* not JSON: show as sent */
    }
    return h("div", { class: "tool-call" }, h("div", { class: "tool-call-head mono" }, `${fn.name || c.type || "tool"}(…)`, c.id ? h("span", { class: "faint" }, `  ${c.id}`) : null),
      codeBlock(String(args ?? ""), { label: `Arguments of ${fn.name || "tool call"}` }));
  }));
}

function message(m, { output = false } = {}) {
  const role = m.role || "message";
  const text = contentText(m.content);
  return h("div", { class: ["msg", `msg-${role}`, output && "msg-output"] },
    h("div", { class: "msg-role" }, ROLE_LABEL[role] || role, m.name ? h("span", { class: "faint" }, ` · ${m.name}`) : null,
      m.tool_call_id ? h("span", { class: "faint mono" }, ` · ${m.tool_call_id}`) : null, output ? h("span", { class: "msg-flag" }, "response") : null),
    text ? h("div", { class: "msg-content", tabindex: scrolls(text, 14, 1200) ? "0" : null }, text) : m.tool_calls?.length ? null : h("div", { class: "msg-content faint" }, "(empty)"),
    toolCalls(m.tool_calls));
}

function meanLogprob(choices) {
  const lp = (choices || []).flatMap((c) => (Array.isArray(c.logprobs) ? c.logprobs : [])).filter((x) => typeof x === "number");
  return lp.length ? lp.reduce((a, b) => a + b, 0) / lp.length : null;
}

function llmBody(e, env) {
  const d = e.data || {};
  const t = llmTokens(d);
  const req = isObj(d.request) ? d.request : {};
  const params = Object.fromEntries(Object.entries(req).filter(([k]) => !["messages", "prompt", "model"].includes(k)));
  const turn = env.turns?.get(e.id);
  const rewards = env.rewardsFor.get(e.id) || [];
  const lp = meanLogprob(d.choices);
  const chips = [
    turn ? ["Turn", String(turn.turn)] : null,
    ["Model", d.model || req.model || "—"],
    ["Prompt tokens", fmtInt(t.prompt)],
    ["Completion tokens", fmtInt(t.completion)],
    ["Latency", fmtMs(d.latency_ms)],
    ["Finish", (d.choices || []).map((c) => c.finish_reason).filter(Boolean).join(", ") || "—"],
    d.model_version !== undefined && d.model_version !== null ? ["Model version", String(d.model_version)] : null,
    d.upstream_status && d.upstream_status !== 200 ? ["Upstream status", String(d.upstream_status)] : null,
    lp !== null ? ["Mean logprob", fmtNum(lp, 3)] : null,
    ...rewards.map((r) => [r.data.name ? `Reward · ${r.data.name}` : "Reward", fmtNum(Number(r.data.value), 4)]),
    rewards.length > 1 && turn?.stepReward !== null ? ["Step reward", fmtNum(turn.stepReward, 4)] : null,
    turn?.state !== null && turn?.state !== undefined ? ["State", h("code", { class: "mono", title: turn.state }, truncate(turn.state, 60))] : null,
  ].filter(Boolean);
  const input = Array.isArray(req.messages) ? req.messages.map((m) => message(m))
    : req.prompt !== undefined ? [message({ role: "prompt", content: contentText(req.prompt) })] : [];
  const output = (d.choices || []).map((c) => (c.message ? message(c.message, { output: true }) : message({ role: "completion", content: c.text ?? "" }, { output: true })));
  return h("div", { class: "event-body" },
    h("dl", { class: "chips", "data-testid": "llm-meta" }, chips.map(([k, v]) => h("div", { class: "chip" }, h("dt", {}, k), h("dd", {}, v)))),
    d.error ? h("div", { class: "callout callout-error" }, h("div", { class: "callout-title" }, "The model call failed"), codeBlock(json(d.error), { label: "Error" })) : null,
    h("div", { class: "conversation" }, input, output.length ? output : (!d.error ? h("p", { class: "faint" }, "No choices in the response.") : null)),
    h("details", { class: "more", "data-key": `more-${e.id}` }, h("summary", {}, "Request parameters, token ids and raw response"),
      h("div", { class: "more-body" },
        Object.keys(params).length ? h("div", {}, h("h4", { class: "sub-title" }, "Request parameters"), codeBlock(json(params), { label: "Request parameters" })) : null,
        h("h4", { class: "sub-title" }, "Token ids"),
        h("p", { class: "muted" }, d.prompt_token_ids ? `Prompt: ${fmtInt(d.prompt_token_ids.length)} ids` : "Prompt token ids: not returned by the upstream",
          " · ", (d.choices || []).some((c) => c.token_ids) ? `Completion: ${fmtInt((d.choices || []).reduce((s, c) => s + (c.token_ids?.length || 0), 0))} ids` : "completion token ids: not returned"),
        d.prompt_token_ids ? codeBlock(truncate(d.prompt_token_ids.join(" "), 4000), { label: "Prompt token ids", cls: "code-small" }) : null,
        d.response !== undefined ? h("div", {}, h("h4", { class: "sub-title" }, "Raw response"), codeBlock(truncate(json(d.response), 20000), { label: "Raw response" })) : null)));
}

function rewardBody(e, env) {
  const d = e.data || {};
  const target = d.llm_call_id !== undefined && d.llm_call_id !== null ? env.byId.get(d.llm_call_id) : null;
  const extra = Object.fromEntries(Object.entries(d).filter(([k]) => !["value", "name", "final", "llm_call_id"].includes(k)));
  return h("div", { class: "event-body event-body-inline" },
    target ? h("button", { type: "button", class: "btn btn-sm", "data-action": "jump", "data-target": `ev-${target.id}` }, `Go to LLM call #${target.id}`) : null,
    Object.keys(extra).length ? codeBlock(json(extra), { label: "Reward data" }) : null);
}

function stateBody(e, env) {
  const target = env.byId.get(callOf(e.data));
  const key = String(e.data?.key ?? "");
  return h("div", { class: "event-body event-body-inline" },
    target ? h("button", { type: "button", class: "btn btn-sm", "data-action": "jump", "data-target": `ev-${target.id}` }, `Go to LLM call #${target.id}`) : null,
    key.length > 40 ? codeBlock(key, { label: "State key" }) : null);
}

/** A number with its sign: step rewards read as gains and losses. */
export function signed(n) {
  return n > 0 ? `+${fmtNum(n, 4)}` : fmtNum(n, 4);
}

function toolBody(e) {
  const d = e.data || {};
  return h("div", { class: "event-body" },
    h("div", { class: "kv-grid" },
      h("div", {}, h("h4", { class: "sub-title" }, "Arguments"), codeBlock(json(d.arguments ?? null), { label: "Arguments" })),
      h("div", {}, h("h4", { class: "sub-title" }, d.error ? "Error" : "Result"),
        codeBlock(typeof (d.error ?? d.result) === "string" ? d.error ?? d.result : json(d.error ?? d.result ?? null), { label: d.error ? "Error" : "Result", cls: d.error ? "code-error" : "" }))));
}

function exceptionBody(e) {
  const d = e.data || {};
  return h("div", { class: "event-body" },
    h("p", { class: "exception-line" }, h("span", { class: "strong" }, d.type || "Exception"), `: ${d.message || ""}`),
    d.traceback ? codeBlock(d.traceback, { label: "Traceback", cls: "code-error traceback" }) : h("p", { class: "faint" }, "No traceback recorded."));
}

function spanBody(e) {
  const d = e.data || {};
  const iv = interval(e);
  const fields = [["Trace", d.trace_id], ["Span", d.span_id], ["Parent", d.parent_span_id], ["Duration", iv ? fmtMs((iv[1] - iv[0]) * 1000) : null]].filter(([, v]) => v);
  return h("div", { class: "event-body" },
    h("dl", { class: "chips" }, fields.map(([k, v]) => h("div", { class: "chip" }, h("dt", {}, k), h("dd", { class: "mono" }, truncate(String(v), 40))))),
    d.attributes && Object.keys(d.attributes).length ? codeBlock(json(d.attributes), { label: "Span attributes" }) : null);
}

export function eventBody(e, env) {
  switch (typeOf(e)) {
    case "llm_call":
      return llmBody(e, env);
    case "reward":
      return rewardBody(e, env);
    case "state":
      return stateBody(e, env);
    case "tool_call":
      return toolBody(e);
    case "exception":
      return exceptionBody(e);
    case "message":
      return h("div", { class: "event-body" }, message(e.data || {}));
    case "span":
      return spanBody(e);
    default:
      return h("div", { class: "event-body" }, codeBlock(json(e.data), { label: `${e.type} data` }));
  }
}
