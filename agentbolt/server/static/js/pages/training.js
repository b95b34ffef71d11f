// Training: mean reward (train) and validation score per resources version or training step,
// the metrics algorithms publish in resources metadata ({"step": n, "metrics": {...}}), and,
// for multi-turn agents, the mean step reward per turn (metrics.turn_reward_by_index).

import { get } from "../api.js";
import { lineChart } from "../charts.js";
import { allResources } from "../data.js";
import { fmtInt, fmtNum, fmtPct, fmtTime, h, truncate } from "../dom.js";
import { card, empty, segmented, stat, table } from "../ui.js";

const MAX_METRIC_CHARTS = 12;
const MAX_TURN_ROWS = 10;
const MAX_TURNS = 16;
const SERIES = [
  { mode: "train", name: "Train reward", cls: "s1" },
  { mode: "val", name: "Validation score", cls: "s2" },
  { mode: "test", name: "Test score", cls: "s3" },
];

async function load(ctx) {
  const [stats, res] = await Promise.all([get("/stats", null, { signal: ctx.signal }), allResources(ctx.state, ctx.signal)]);
  return { stats, resources: res.items };
}

function numeric(v) {
  return typeof v === "number" && Number.isFinite(v) ? v : null;
}

/** One row per resources version: step, metrics and the reward stats of each mode. */
function rows(d) {
  const byVersion = new Map();
  const row = (v) => {
    if (!byVersion.has(v)) byVersion.set(v, { version: v, step: null, created: null, metrics: {}, turns: null, modes: {} });
    return byVersion.get(v);
  };
  for (const r of d.resources) {
    const x = row(r.version);
    x.created = r.created_at;
    const meta = r.metadata || {};
    x.step = numeric(meta.step);
    for (const [k, v] of Object.entries(meta.metrics || {})) if (numeric(v) !== null) x.metrics[k] = v;
    const turns = meta.metrics?.turn_reward_by_index;
    if (Array.isArray(turns) && turns.length && turns.every((v) => v === null || numeric(v) !== null)) x.turns = turns;
  }
  for (const b of d.stats.by_version) {
    if (b.resources_version === null) continue;
    row(b.resources_version).modes[b.mode] = b;
  }
  return [...byVersion.values()].sort((a, b) => a.version - b.version);
}

function xOf(r, axis) {
  return axis === "step" ? r.step : r.version;
}

function rewardChart(all, axis) {
  const series = SERIES.map((s) => ({
    name: s.name, cls: s.cls,
    points: all.filter((r) => xOf(r, axis) !== null && r.modes[s.mode]).map((r) => ({ x: xOf(r, axis), y: r.modes[s.mode].mean_reward })),
  })).filter((s) => s.points.length);
  return lineChart({
    id: "reward", title: null, series, height: 280, xInteger: true,
    xLabel: axis === "step" ? "step" : "version", xFormat: (v) => (axis === "step" ? fmtNum(v) : `v${v}`),
    yLabel: "mean reward", ariaLabel: `Mean reward and validation score by ${axis === "step" ? "training step" : "resources version"}`,
    emptyText: "No finished rollouts yet. Mean rewards appear here once rollouts finish.",
  });
}

function metricCharts(all, axis) {
  const keys = [...new Set(all.flatMap((r) => Object.keys(r.metrics)))].sort();
  if (!keys.length) return null;
  const charts = keys.slice(0, MAX_METRIC_CHARTS).map((k, i) => {
    const points = all.filter((r) => xOf(r, axis) !== null && r.metrics[k] !== undefined).map((r) => ({ x: xOf(r, axis), y: r.metrics[k] }));
    return h("div", { class: "metric-chart", "data-key": `m-${k}` }, lineChart({
      id: `metric-${k}`, title: k, series: [{ name: k, cls: `s${((i + 3) % 6) + 1}`, points }], width: 470, height: 200, xInteger: true,
      xLabel: axis === "step" ? "step" : "version", xFormat: (v) => (axis === "step" ? fmtNum(v) : `v${v}`), ariaLabel: `${k} by ${axis}`,
      emptyText: axis === "step" ? "No versions with a step for this metric." : "No values.",
    }));
  });
  return card("Algorithm metrics", h("div", { class: "grid-2 metric-grid" }, charts), {
    id: "metrics", subtitle: `From the metadata that training published with each resources version${keys.length > MAX_METRIC_CHARTS ? ` (first ${MAX_METRIC_CHARTS} of ${keys.length})` : ""}`,
  });
}

/** Mean step reward per turn index, per training step: a row per version that has them. */
function turnCard(all) {
  const withTurns = all.filter((r) => r.turns);
  if (!withTurns.length) return null;
  const shown = withTurns.slice(-MAX_TURN_ROWS).reverse();
  const width = Math.min(MAX_TURNS, Math.max(...shown.map((r) => r.turns.length)));
  const top = Math.max(1e-12, ...shown.flatMap((r) => r.turns.slice(0, width).map((v) => Math.abs(v ?? 0))));
  const cell = (v) => {
    if (v === null || v === undefined) return h("span", { class: "faint" }, "—");
    return h("span", { class: "turn-reward", title: `mean step reward ${fmtNum(v, 4)}` },
      h("span", { class: "mono" }, fmtNum(v, 3)),
      h("span", { class: "turn-bar", "aria-hidden": "true" },
        h("span", { class: v < 0 ? "turn-bar-fill turn-bar-neg" : "turn-bar-fill", style: { width: `${Math.round((Math.abs(v) / top) * 100)}%` } })));
  };
  const rowsOut = shown.map((r) => [
    h("a", { class: "link mono", href: `#/resources/${r.version}` }, `v${r.version}`),
    r.step === null ? h("span", { class: "faint" }, "—") : h("span", { class: "mono" }, fmtNum(r.step)),
    ...Array.from({ length: width }, (_, i) => cell(r.turns[i])),
  ]);
  const cols = [{ label: "Version" }, { label: "Step", cls: "num" }, ...Array.from({ length: width }, (_, i) => ({ label: `Turn ${i + 1}` }))];
  return card("Per-turn step reward", table(cols, rowsOut, { caption: "Mean step reward per turn index", cls: "turn-grid", key: (i) => `tv${shown[i].version}` }), {
    id: "turn-rewards",
    subtitle: `Mean per-call reward at each turn of the step's rollouts, latest first${withTurns.length > MAX_TURN_ROWS ? ` (last ${MAX_TURN_ROWS} of ${withTurns.length})` : ""}`,
  });
}

function modeCell(m) {
  if (!m) return h("span", { class: "faint" }, "—");
  return h("span", {}, h("span", { class: "mono" }, fmtNum(m.mean_reward)), h("span", { class: "faint" }, ` · n=${fmtInt(m.count)}`));
}

function versionTable(all) {
  const keys = [...new Set(all.flatMap((r) => Object.keys(r.metrics)))].sort().slice(0, 3);
  const shown = [...all].reverse();
  const rowsOut = shown.map((r) => {
    const done = Object.values(r.modes).reduce((s, m) => s + m.succeeded + m.failed, 0);
    const ok = Object.values(r.modes).reduce((s, m) => s + m.succeeded, 0);
    return [
      h("a", { class: "link mono", href: `#/resources/${r.version}` }, `v${r.version}`),
      r.step === null ? h("span", { class: "faint" }, "—") : h("span", { class: "mono" }, fmtNum(r.step)),
      r.created ? fmtTime(r.created) : h("span", { class: "faint" }, "—"),
      modeCell(r.modes.train), modeCell(r.modes.val),
      done ? fmtPct(ok / done) : h("span", { class: "faint" }, "—"),
      ...keys.map((k) => (r.metrics[k] === undefined ? h("span", { class: "faint" }, "—") : h("span", { class: "mono" }, fmtNum(r.metrics[k])))),
    ];
  });
  return table([
    { label: "Version" }, { label: "Step", cls: "num" }, { label: "Published" }, { label: "Train reward" }, { label: "Validation score" },
    { label: "Success", cls: "num" }, ...keys.map((k) => ({ label: truncate(k, 18), cls: "num" })),
  ], rowsOut, { caption: "Reward and metrics per resources version", key: (i) => `v${shown[i].version}` });
}

function summary(all) {
  const withVal = all.filter((r) => r.modes.val?.mean_reward !== null && r.modes.val?.mean_reward !== undefined);
  const best = withVal.reduce((b, r) => (!b || r.modes.val.mean_reward >= b.modes.val.mean_reward ? r : b), null);
  const lastTrain = [...all].reverse().find((r) => r.modes.train?.mean_reward !== null && r.modes.train?.mean_reward !== undefined);
  const steps = all.filter((r) => r.step !== null);
  return h("div", { class: "stats-grid stats-grid-4" },
    stat("Resources versions", fmtInt(all.length), { sub: all.length ? `latest v${all[all.length - 1].version}` : "none published" }),
    stat("Training steps", steps.length ? fmtNum(Math.max(...steps.map((r) => r.step))) : "—", { sub: steps.length ? `${steps.length} versions carry a step` : "no step metadata" }),
    stat("Latest train reward", lastTrain ? fmtNum(lastTrain.modes.train.mean_reward) : "—", { sub: lastTrain ? `v${lastTrain.version} · n=${lastTrain.modes.train.count}` : "no train rollouts finished" }),
    stat("Best validation score", best ? fmtNum(best.modes.val.mean_reward) : "—", { sub: best ? `v${best.version}` : "no validation rollouts finished", tone: best ? "succeeded" : "" }));
}

export default {
  title: "Training",
  load,
  view(d, ctx) {
    const all = rows(d);
    if (!all.length) {
      return h("div", { class: "page" }, card(null, empty("No training data yet",
        "Rewards appear here once rollouts finish; algorithms that publish resources with {\"step\": n, \"metrics\": {…}} metadata add their curves.", null, { icon: "chart" })));
    }
    const hasSteps = all.some((r) => r.step !== null);
    const axis = hasSteps && ctx.query.get("x") === "step" ? "step" : "version";
    const axisControl = segmented("X axis", [
      { value: "version", label: "Resources version" },
      ...(hasSteps ? [{ value: "step", label: "Training step" }] : []),
    ], [axis], "axis");
    return h("div", { class: "page page-training" },
      summary(all),
      card("Reward and validation score", rewardChart(all, axis), {
        id: "reward-card", actions: axisControl,
        subtitle: "Mean reward of finished rollouts per resources version, by mode",
      }),
      metricCharts(all, axis),
      turnCard(all),
      card("Per version", versionTable(all), { id: "versions" }));
  },
  actions: {
    axis: (el, ctx) => ctx.setQuery({ x: el.dataset.value === "step" ? "step" : null }),
  },
};
