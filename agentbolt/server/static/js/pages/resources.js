// Resources: every published version; prompts with a line diff against the version before,
// LLM endpoints, and the history of model weights.

import { allResources } from "../data.js";
import { diffLines, diffStats, withContext } from "../diff.js";
import { ago, fmtFull, fmtInt, fmtNum, fmtTime, h, hrefFor, json, truncate } from "../dom.js";
import { card, codeBlock, empty, facts, mono, segmented, table } from "../ui.js";

const KIND_LABEL = { prompt_template: "Prompt template", llm: "LLM endpoint", model_weights: "Model weights" };
const TRIAL_NOTE = "never the latest version; only rollouts pinned to it run it";

async function load(ctx) {
  const res = await allResources(ctx.state, ctx.signal);
  return { items: res.items, truncated: res.truncated, byVersion: res.byVersion, now: ctx.now() };
}

/** The newest version older than ``version`` that has a resource called ``name``. */
function previousOf(items, version, name) {
  return items.find((r) => r.version < version && r.resources[name] !== undefined) || null;
}

function changedNames(items, r) {
  return Object.keys(r.resources).filter((name) => {
    const prev = previousOf(items, r.version, name);
    return !prev || json(prev.resources[name]) !== json(r.resources[name]);
  });
}

function versionList(d, selected) {
  return h("nav", { class: "version-list", "aria-label": "Resources versions" },
    h("ol", {}, d.items.map((r) => {
      const changed = changedNames(d.items, r);
      const step = r.metadata?.step;
      const val = apoScores(r)?.val;
      return h("li", { "data-key": `v${r.version}` },
        h("a", { href: `#/resources/${r.version}`, class: "version-link", "aria-current": r.version === selected.version ? "page" : null },
          h("span", { class: "version-line" }, h("span", { class: "version-num" }, `v${r.version}`),
            r.trial ? h("span", { class: "faint", title: TRIAL_NOTE }, "trial") : null,
            step !== undefined && step !== null ? h("span", { class: "faint" }, `step ${fmtNum(step)}`) : null,
            typeof val === "number" ? h("span", { class: "faint apo-score", title: "validation score of this prompt (APO)" }, `val ${fmtNum(val)}`) : null,
            h("span", { class: "version-time" }, ago(r.created_at, d.now))),
          h("span", { class: "version-changes" }, changed.length ? changed.map((n) => h("span", { class: `mini-tag mk-${r.resources[n].type}` }, n)) : h("span", { class: "faint" }, "no changes"))));
    })));
}

/** An APO record's scores ({train, val}), or null for any other version. */
function apoScores(r) {
  const meta = r.metadata || {};
  return meta.algorithm === "apo" && meta.scores && typeof meta.scores === "object" ? meta.scores : null;
}

/** Chips of an APO record: its scores, the version its rollouts ran with, its worked examples. */
function apoChips(meta) {
  const scores = meta.scores || {};
  const chip = (label, value) => h("div", { class: "chip" }, h("dt", {}, label), h("dd", {}, value));
  return [
    meta.stage ? chip("APO", meta.stage) : null,
    typeof scores.val === "number" ? chip("Validation score", fmtNum(scores.val)) : chip("Validation score", "—"),
    typeof scores.train === "number" ? chip("Training score", fmtNum(scores.train)) : null,
    meta.candidate ? chip("Rollouts ran with", h("a", { class: "link", href: `#/resources/${meta.candidate}` }, `v${meta.candidate}`)) : null,
    Array.isArray(meta.demos) ? chip("Worked examples", meta.demos.length ? meta.demos.join(", ") : "none") : null,
  ];
}

function diffView(oldText, newText) {
  const ops = diffLines(oldText, newText);
  const stats = diffStats(ops);
  if (!stats.added && !stats.removed) return { stats, node: null };
  const rows = withContext(ops, 3).map((o, i) => (o.op === "skip"
    ? h("tr", { class: "diff-skip", "data-key": `s${i}` }, h("td", { colspan: "3" }, `⋯ ${fmtInt(o.count)} unchanged line${o.count === 1 ? "" : "s"}`))
    : h("tr", { class: `diff-${o.op}` },
      h("td", { class: "ln" }, o.a ?? ""), h("td", { class: "ln" }, o.b ?? ""),
      h("td", { class: "diff-text" }, h("span", { class: "diff-sign", "aria-label": o.op === "add" ? "added" : o.op === "del" ? "removed" : null }, o.op === "add" ? "+" : o.op === "del" ? "−" : " "), o.text || " "))));
  return {
    stats,
    node: h("div", { class: "diff-wrap", tabindex: "0", "aria-label": "Line diff" },
      h("table", { class: "diff" }, h("caption", { class: "sr-only" }, `Changes: ${stats.added} lines added, ${stats.removed} removed`),
        h("thead", { class: "sr-only" }, h("tr", {}, h("th", { scope: "col" }, "Old line"), h("th", { scope: "col" }, "New line"), h("th", { scope: "col" }, "Text"))),
        h("tbody", {}, rows))),
  };
}

function promptCard(d, r, name, res, ctx) {
  const prev = previousOf(d.items, r.version, name);
  const prevText = prev?.resources[name]?.type === "prompt_template" ? prev.resources[name].template : null;
  const mode = ctx.query.get("view") === "full" ? "full" : "diff";
  const diff = prevText !== null ? diffView(prevText, res.template) : null;
  let body;
  let subtitle;
  if (prevText === null) {
    subtitle = "New in this version";
    body = codeBlock(res.template, { label: `${name} template`, cls: "prompt-text" });
  } else if (!diff.node) {
    subtitle = `Unchanged since v${prev.version}`;
    body = codeBlock(res.template, { label: `${name} template`, cls: "prompt-text" });
  } else {
    subtitle = h("span", {}, `Changed from `, h("a", { class: "link", href: `#/resources/${prev.version}` }, `v${prev.version}`), " · ",
      h("span", { class: "diff-stat-add" }, `+${diff.stats.added}`), " ", h("span", { class: "diff-stat-del" }, `−${diff.stats.removed}`), " lines");
    body = mode === "full" ? codeBlock(res.template, { label: `${name} template`, cls: "prompt-text" }) : diff.node;
  }
  const toggle = diff?.node ? segmented("Show", [{ value: "diff", label: "Diff" }, { value: "full", label: "Full text" }], [mode], "view") : null;
  return card(h("span", {}, mono(name), h("span", { class: "kind" }, `${KIND_LABEL[res.type]} · ${res.engine}`)), body, {
    id: `res-${name}`, subtitle, actions: toggle, cls: "resource-card",
  });
}

const ROLE = { user: "User", assistant: "Assistant", tool: "Tool" };

// example turns as the lines APO's report prints: "User: ..." / "Assistant: ..."
function turnsText(turns) {
  return turns.map((m) => `${ROLE[m.role] || m.role}: ${typeof m.content === "string" ? m.content : json(m.content ?? m.tool_calls ?? "", 0)}`).join("\n");
}

function llmCard(d, r, name, res) {
  const prev = previousOf(d.items, r.version, name);
  const changed = prev && json(prev.resources[name]) !== json(res);
  const turns = res.examples || [];
  return card(h("span", {}, mono(name), h("span", { class: "kind" }, KIND_LABEL[res.type])), h("div", {}, facts([
    ["Model", mono(res.model)],
    ["Base URL", mono(res.base_url)],
    ["Sampling", Object.keys(res.sampling_parameters || {}).length ? mono(json(res.sampling_parameters, 0)) : h("span", { class: "faint" }, "defaults")],
    ["Example turns", turns.length ? `${turns.length}, put into every call by the gateway` : h("span", { class: "faint" }, "none")],
  ]), turns.length ? codeBlock(turnsText(turns), { label: `${name} example turns`, cls: "prompt-text" }) : null), { id: `res-${name}`, subtitle: !prev ? "New in this version" : changed ? `Changed from v${prev.version}` : `Unchanged since v${prev.version}`, cls: "resource-card" });
}

function weightsCard(d, r, name, res) {
  const prev = previousOf(d.items, r.version, name);
  const changed = prev && json(prev.resources[name]) !== json(res);
  return card(h("span", {}, mono(name), h("span", { class: "kind" }, KIND_LABEL[res.type])), h("div", {}, facts([
    ["Path", mono(res.path)],
    ["Base model", res.base_model ? mono(res.base_model) : h("span", { class: "faint" }, "—")],
    ["Format", res.format === "lora" ? "LoRA adapter" : "Full weights"],
  ]), Object.keys(res.metadata || {}).length ? codeBlock(json(res.metadata), { label: "Weights metadata" }) : null), {
    id: `res-${name}`, subtitle: !prev ? "New in this version" : changed ? `Changed from v${prev.version}` : `Unchanged since v${prev.version}`, cls: "resource-card",
  });
}

function versionDetail(d, r, ctx) {
  const meta = r.metadata || {};
  const metrics = Object.entries(meta.metrics || {});
  const rest = Object.fromEntries(Object.entries(meta).filter(([k]) => k !== "step" && k !== "metrics"));
  const order = { prompt_template: 0, llm: 1, model_weights: 2 };
  const names = Object.keys(r.resources).sort((a, b) => (order[r.resources[a].type] ?? 3) - (order[r.resources[b].type] ?? 3) || a.localeCompare(b));
  return h("div", { class: "version-detail" },
    h("div", { class: "version-head" },
      h("h2", { class: "version-title" }, `Version ${r.version}`),
      r.trial ? h("span", { class: "faint" }, `trial: ${TRIAL_NOTE}`) : null,
      h("span", { class: "muted", title: fmtFull(r.created_at) }, `published ${fmtTime(r.created_at)} · ${ago(r.created_at, d.now).textContent}`),
      h("a", { class: "btn btn-sm", href: hrefFor("/rollouts", { version: r.version }) }, "Rollouts with this version")),
    meta.step !== undefined || metrics.length || apoScores(r) ? h("dl", { class: "chips" },
      apoScores(r) ? apoChips(meta) : null,
      meta.step !== undefined ? h("div", { class: "chip" }, h("dt", {}, "Step"), h("dd", {}, fmtNum(meta.step))) : null,
      metrics.map(([k, v]) => h("div", { class: "chip" }, h("dt", {}, k), h("dd", {}, typeof v === "number" ? fmtNum(v) : truncate(json(v, 0), 40))))) : null,
    Object.keys(rest).length ? h("details", { class: "more" }, h("summary", {}, "Other metadata"), codeBlock(json(rest), { label: "Version metadata" })) : null,
    names.map((name) => {
      const res = r.resources[name];
      if (res.type === "prompt_template") return promptCard(d, r, name, res, ctx);
      if (res.type === "llm") return llmCard(d, r, name, res);
      if (res.type === "model_weights") return weightsCard(d, r, name, res);
      return card(mono(name), codeBlock(json(res)), { id: `res-${name}` });
    }));
}

function weightsHistory(d) {
  const rows = [];
  for (const r of d.items) {
    for (const [name, res] of Object.entries(r.resources)) {
      if (res.type !== "model_weights") continue;
      const prev = previousOf(d.items, r.version, name);
      if (prev && json(prev.resources[name]) === json(res)) continue; // only versions that changed them
      rows.push({ r, name, res });
    }
  }
  if (!rows.length) {
    return card("Model weights", empty("No model weights published", "Fine-tuning (SFT) and RL (GRPO) publish a model_weights resource with each checkpoint; they are listed here."), { id: "weights" });
  }
  return card("Model weights", table([
    { label: "Version" }, { label: "Resource" }, { label: "Path" }, { label: "Base model" }, { label: "Step", cls: "num" }, { label: "Published" },
  ], rows.map(({ r, name, res }) => [
    h("a", { class: "link mono", href: `#/resources/${r.version}` }, `v${r.version}`),
    h("span", {}, mono(name), " ", h("span", { class: "mini-tag" }, res.format === "lora" ? "LoRA" : "full")),
    h("span", { class: "mono", title: res.path }, truncate(res.path, 36)),
    res.base_model ? h("span", { class: "mono", title: res.base_model }, truncate(res.base_model, 24)) : h("span", { class: "faint" }, "—"),
    r.metadata?.step !== undefined ? fmtNum(r.metadata.step) : h("span", { class: "faint" }, "—"), fmtTime(r.created_at),
  ]), { caption: "Model weights versions", key: (i) => `w${rows[i].r.version}-${rows[i].name}` }), { id: "weights", subtitle: "Versions that published new weights" });
}

export default {
  title: (ctx) => (ctx.params[0] ? `Resources v${ctx.params[0]}` : "Resources"),
  crumbs: (ctx) => (ctx.params[0] ? [{ href: "#/resources", label: "Resources" }] : []),
  load,
  view(d, ctx) {
    if (!d.items.length) {
      return h("div", { class: "page" }, card(null, empty("No resources published yet",
        "Algorithms and the Trainer publish versioned resources (prompt templates, LLM endpoints, model weights); each version appears here.")));
    }
    const wanted = ctx.params[0] ? Number(ctx.params[0]) : d.items[0].version;
    const selected = d.byVersion.get(wanted);
    const detail = selected ? versionDetail(d, selected, ctx)
      : card(null, empty(`Version ${wanted} not found`, "It may not have been published yet.", h("a", { class: "btn", href: "#/resources" }, "Show the latest version"), { icon: "search" }));
    return h("div", { class: "page page-resources" },
      h("div", { class: "split" },
        h("aside", { class: "split-side card card-flush" }, h("div", { class: "card-head" }, h("h2", { class: "card-title" }, "Versions"), h("span", { class: "muted" }, fmtInt(d.items.length))), versionList(d, selected || {})),
        h("div", { class: "split-main" }, detail, weightsHistory(d))));
  },
  actions: {
    view: (el, ctx) => ctx.setQuery({ view: el.dataset.value === "full" ? "full" : null }),
  },
};
