// Small SVG charts: lines over a numeric x axis, stacked bars over time buckets.
//
// A chart is a <figure> with a legend, an SVG and a visually hidden data table (what a screen
// reader reads). Hover, or focus the plot and use the arrow keys, to read values in a tooltip.

import { fmtNum, h, svg } from "./dom.js";

const MARGIN = { top: 26, right: 18, bottom: 30, left: 56 };
const models = new Map(); // chart id -> what the tooltip needs
let active = null; // the tooltip shown now: {id, index, clientX, clientY}

/** A formatter with as many decimals as the tick step has (0.015, 0.02 — not 0.02, 0.02). */
export function tickFormat(values) {
  if (values.length < 2) return (v) => fmtNum(v, 3);
  const step = Number(Math.abs(values[1] - values[0]).toPrecision(6)).toString();
  if (step.includes("e")) return (v) => (v === 0 ? "0" : v.toExponential(1));
  const decimals = step.includes(".") ? step.split(".")[1].length : 0;
  return (v) => v.toLocaleString("en-US", { minimumFractionDigits: 0, maximumFractionDigits: decimals });
}

/** Round tick values covering [lo, hi] (at most about ``count``). */
export function ticks(lo, hi, count = 5, integer = false) {
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) return [];
  if (lo === hi) return [lo];
  const raw = (hi - lo) / Math.max(1, count);
  const mag = 10 ** Math.floor(Math.log10(raw));
  let step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || 10 * mag;
  if (integer) step = Math.max(1, Math.ceil(step));
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toFixed(10)));
  return out;
}

function domain(values, { zero = false, pad = 0.08 } = {}) {
  const finite = values.filter((v) => v !== null && v !== undefined && Number.isFinite(v));
  if (!finite.length) return [0, 1];
  let lo = Math.min(...finite);
  let hi = Math.max(...finite);
  if (zero) lo = Math.min(0, lo);
  if (lo === hi) {
    const d = Math.abs(lo) > 0 ? Math.abs(lo) * 0.5 : 1;
    return [zero ? Math.min(0, lo - d) : lo - d, hi + d];
  }
  const span = hi - lo;
  return [zero && lo === 0 ? 0 : lo - span * pad, hi + span * pad];
}

function scale([d0, d1], [r0, r1]) {
  const k = d1 === d0 ? 0 : (r1 - r0) / (d1 - d0);
  return (v) => r0 + (v - d0) * k;
}

function frame({ width, height, xTicks, yTicks, xScale, yScale, xFormat, yFormat, xLabel, yLabel }) {
  const plotBottom = height - MARGIN.bottom;
  const grid = svg("g", { class: "grid", "aria-hidden": "true" });
  for (const t of yTicks) {
    const y = yScale(t);
    grid.append(
      svg("line", { x1: MARGIN.left, x2: width - MARGIN.right, y1: y, y2: y }),
      svg("text", { x: MARGIN.left - 8, y: y + 4, class: "tick tick-y" }, yFormat(t)),
    );
  }
  for (const t of xTicks) {
    const x = xScale(t);
    grid.append(svg("text", { x, y: plotBottom + 18, class: "tick tick-x" }, xFormat(t)));
  }
  grid.append(svg("line", { class: "axis", x1: MARGIN.left, x2: width - MARGIN.right, y1: plotBottom, y2: plotBottom }));
  // The y unit sits above the axis; the x axis is named by its tick labels and the caption.
  if (yLabel) grid.append(svg("text", { class: "axis-label", x: MARGIN.left - 8, y: 12, "text-anchor": "end" }, yLabel));
  void xLabel;
  return grid;
}

function legend(items) {
  if (items.length < 2) return null;
  return h("ul", { class: "legend", "aria-hidden": "true" },
    items.map((it) => h("li", {}, h("span", { class: `swatch ${it.cls}` }), it.name)));
}

function dataTable(caption, head, rows) {
  // the wrapper hides it: a table sizes to its content whatever its own width and height say
  return h("div", { class: "sr-only" }, h("table", {},
    h("caption", {}, caption),
    h("thead", {}, h("tr", {}, head.map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, rows.map((r) => h("tr", {}, r.map((c, i) => (i === 0 ? h("th", { scope: "row" }, c) : h("td", {}, c))))))));
}

function emptyChart(title, text, height) {
  return h("figure", { class: "chart chart-empty" },
    title ? h("figcaption", { class: "chart-title" }, title) : null,
    h("div", { class: "chart-empty-body", style: { "min-height": `${Math.round(height * 0.6)}px` } }, text));
}

/**
 * Lines over a numeric x. ``series``: [{name, points: [{x, y}]}] (y null leaves a gap).
 * Options: id (stable, for the tooltip), title, width/height (SVG units), xLabel, yLabel,
 * xFormat, yFormat, xInteger (integer ticks), zero (y axis includes 0), emptyText.
 */
export function lineChart(opts) {
  const { id, title, series, width = 960, height = 260, xLabel, yLabel, xInteger = false, zero = false } = opts;
  const xFormat = opts.xFormat || ((v) => fmtNum(v));
  const all = series.flatMap((s) => s.points);
  const withY = all.filter((p) => p.y !== null && p.y !== undefined && Number.isFinite(p.y));
  if (!withY.length) return emptyChart(title, opts.emptyText || "No data yet.", height);

  const xd = domain(all.map((p) => p.x), { pad: 0.03 });
  const yd = domain(withY.map((p) => p.y), { zero });
  const xScale = scale(xd, [MARGIN.left + 8, width - MARGIN.right - 8]);
  const yScale = scale(yd, [height - MARGIN.bottom, MARGIN.top]);
  const xTicks = ticks(xd[0], xd[1], Math.min(8, Math.floor(width / 110)), xInteger).filter((t) => t >= xd[0] && t <= xd[1]);
  const yTicks = ticks(yd[0], yd[1], 4).filter((t) => t >= yd[0] && t <= yd[1]);
  const yTick = tickFormat(yTicks);
  const yFormat = opts.yFormat || ((v) => fmtNum(v, 4));

  const plot = svg("g", { class: "plot" });
  series.forEach((s, i) => {
    const cls = s.cls || `s${(i % 6) + 1}`;
    const pts = [...s.points].sort((a, b) => a.x - b.x);
    let d = "";
    let pen = false;
    for (const p of pts) {
      if (p.y === null || p.y === undefined || !Number.isFinite(p.y)) {
        pen = false;
        continue;
      }
      d += `${pen ? "L" : "M"}${xScale(p.x).toFixed(1)},${yScale(p.y).toFixed(1)}`;
      pen = true;
    }
    plot.append(svg("path", { class: `line ${cls}`, d }));
    if (pts.length <= 80) {
      for (const p of pts) {
        if (p.y === null || p.y === undefined || !Number.isFinite(p.y)) continue;
        plot.append(svg("circle", { class: `dot ${cls}`, cx: xScale(p.x).toFixed(1), cy: yScale(p.y).toFixed(1), r: 3.2 }));
      }
    }
  });
  const xs = [...new Set(all.map((p) => p.x))].sort((a, b) => a - b);
  const names = series.map((s) => s.name);
  const rows = xs.map((x) => [xFormat(x), ...series.map((s) => {
    const p = s.points.find((q) => q.x === x);
    return p && p.y !== null && p.y !== undefined ? yFormat(p.y) : "—";
  })]);
  if (id) {
    models.set(id, {
      width, xs: xs.map((x) => xScale(x)), xLabelFor: (i) => `${xLabel || "x"} ${xFormat(xs[i])}`,
      rowsFor: (i) => names.map((n, k) => ({ name: n, value: rows[i][k + 1], cls: series[k].cls || `s${(k % 6) + 1}` })),
      top: MARGIN.top, bottom: height - MARGIN.bottom,
    });
  }
  return figure({ id, title, width, height, label: opts.ariaLabel || title,
    body: [frame({ width, height, xTicks, yTicks, xScale, yScale, xFormat, yFormat: yTick, xLabel, yLabel }), plot],
    legendItems: series.map((s, i) => ({ name: s.name, cls: s.cls || `s${(i % 6) + 1}` })),
    table: dataTable(title || "Chart data", [xLabel || "x", ...names], rows) });
}

/**
 * Stacked bars. ``buckets``: [{x, values: {key: n}}]; ``stacks``: [{key, name, cls}].
 * ``xFormat`` labels a bucket (ticks are spread evenly); ``tooltipTitle(bucket)`` titles it.
 */
export function barChart(opts) {
  const { id, title, buckets, stacks, width = 960, height = 220, yLabel, xLabel } = opts;
  const xFormat = opts.xFormat || ((v) => String(v));
  const totals = buckets.map((b) => stacks.reduce((sum, s) => sum + (b.values[s.key] || 0), 0));
  if (!buckets.length || !totals.some((t) => t > 0)) return emptyChart(title, opts.emptyText || "No data yet.", height);

  const yd = [0, Math.max(...totals)];
  const yTicks = ticks(0, yd[1], 4, true);
  yd[1] = Math.max(yd[1], yTicks[yTicks.length - 1] || 1);
  const yScale = scale(yd, [height - MARGIN.bottom, MARGIN.top]);
  const inner = width - MARGIN.left - MARGIN.right;
  const slot = inner / buckets.length;
  const barW = Math.max(1, slot * 0.72);
  const xAt = (i) => MARGIN.left + slot * i + slot / 2;
  const every = Math.max(1, Math.ceil(buckets.length / Math.floor(width / 90)));
  const xTickIdx = buckets.map((_, i) => i).filter((i) => (buckets.length - 1 - i) % every === 0);

  const plot = svg("g", { class: "plot" });
  buckets.forEach((b, i) => {
    let y0 = yScale(0);
    for (const s of stacks) {
      const v = b.values[s.key] || 0;
      if (!v) continue;
      const hgt = yScale(0) - yScale(v);
      plot.append(svg("rect", { class: `bar ${s.cls}`, x: (xAt(i) - barW / 2).toFixed(1), y: (y0 - hgt).toFixed(1), width: barW.toFixed(1), height: Math.max(0.5, hgt).toFixed(1), rx: 1.5 }));
      y0 -= hgt;
    }
  });
  const grid = frame({ width, height, xTicks: [], yTicks, xScale: xAt, yScale, xFormat, yFormat: (v) => fmtNum(v), xLabel, yLabel });
  for (const i of xTickIdx) grid.append(svg("text", { x: xAt(i), y: height - MARGIN.bottom + 18, class: "tick tick-x" }, xFormat(buckets[i].x)));

  const tipTitle = opts.tooltipTitle || ((b) => xFormat(b.x));
  if (id) {
    models.set(id, {
      width, xs: buckets.map((_, i) => xAt(i)), xLabelFor: (i) => tipTitle(buckets[i]),
      rowsFor: (i) => stacks.map((s) => ({ name: s.name, value: fmtNum(buckets[i].values[s.key] || 0), cls: s.cls })),
      top: MARGIN.top, bottom: height - MARGIN.bottom,
    });
  }
  const rows = buckets.map((b) => [tipTitle(b), ...stacks.map((s) => String(b.values[s.key] || 0))]);
  return figure({ id, title, width, height, label: opts.ariaLabel || title, body: [grid, plot],
    legendItems: stacks.map((s) => ({ name: s.name, cls: s.cls })),
    table: dataTable(title || "Chart data", [xLabel || "Time", ...stacks.map((s) => s.name)], rows) });
}

function figure({ id, title, width, height, label, body, legendItems, table }) {
  const plotSvg = svg("svg", {
    class: "chart-svg", viewBox: `0 0 ${width} ${height}`, role: "img", tabindex: id ? "0" : null,
    "aria-label": `${label || "Chart"}. Use the left and right arrow keys to read values; the data table follows.`,
    "data-chart": id || null, preserveAspectRatio: "xMidYMid meet",
  }, ...body, svg("line", { class: "guide", x1: 0, x2: 0, y1: MARGIN.top, y2: height - MARGIN.bottom, visibility: "hidden" }));
  return h("figure", { class: "chart", "data-key": id ? `chart-${id}` : null },
    title || legendItems.length > 1 ? h("div", { class: "chart-head" },
      title ? h("figcaption", { class: "chart-title" }, title) : null, legend(legendItems)) : null,
    plotSvg, table);
}

// ------------------------------------------------------------------ tooltip (delegated, once)

function showTip(chartSvg, index, clientX, clientY) {
  const model = models.get(chartSvg.dataset.chart);
  const tip = document.getElementById("chart-tooltip");
  if (!model || !tip || index < 0 || index >= model.xs.length) return;
  const guide = chartSvg.querySelector(".guide");
  guide.setAttribute("x1", model.xs[index]);
  guide.setAttribute("x2", model.xs[index]);
  guide.setAttribute("visibility", "visible");
  chartSvg.dataset.index = String(index);
  active = { id: chartSvg.dataset.chart, index, clientX, clientY };
  tip.replaceChildren(
    h("div", { class: "tip-title" }, model.xLabelFor(index)),
    ...model.rowsFor(index).map((r) => h("div", { class: "tip-row" }, h("span", { class: `swatch ${r.cls}` }), h("span", { class: "tip-name" }, r.name), h("span", { class: "tip-value" }, r.value))),
  );
  tip.hidden = false;
  const rect = chartSvg.getBoundingClientRect();
  const px = clientX ?? rect.left + (model.xs[index] / model.width) * rect.width;
  const py = clientY ?? rect.top + rect.height * 0.3;
  const tw = tip.offsetWidth;
  const left = px + 14 + tw > window.innerWidth - 8 ? px - 14 - tw : px + 14;
  tip.style.setProperty("left", `${Math.max(8, left)}px`);
  tip.style.setProperty("top", `${Math.max(8, py - tip.offsetHeight / 2)}px`);
}

function hideTip(chartSvg) {
  active = null;
  const tip = document.getElementById("chart-tooltip");
  if (tip) tip.hidden = true;
  chartSvg?.querySelector(".guide")?.setAttribute("visibility", "hidden");
}

function nearest(model, svgX) {
  let best = 0;
  model.xs.forEach((x, i) => {
    if (Math.abs(x - svgX) < Math.abs(model.xs[best] - svgX)) best = i;
  });
  return best;
}

/** After a live update redrew the charts, show the open tooltip again on the new data. */
export function restoreTooltip() {
  if (!active) return;
  const chartSvg = document.querySelector(`svg[data-chart="${CSS.escape(active.id)}"]`);
  const model = models.get(active.id);
  if (!chartSvg || !model) return hideTip(null);
  showTip(chartSvg, Math.min(active.index, model.xs.length - 1), active.clientX, active.clientY);
}

export function installChartInteractions(root = document) {
  root.addEventListener("pointermove", (e) => {
    const chartSvg = e.target.closest?.("svg[data-chart]");
    if (!chartSvg) return;
    const model = models.get(chartSvg.dataset.chart);
    if (!model) return;
    const rect = chartSvg.getBoundingClientRect();
    const svgX = ((e.clientX - rect.left) / rect.width) * model.width;
    showTip(chartSvg, nearest(model, svgX), e.clientX, e.clientY);
  });
  root.addEventListener("pointerout", (e) => {
    const chartSvg = e.target.closest?.("svg[data-chart]");
    if (chartSvg && !chartSvg.contains(e.relatedTarget)) hideTip(chartSvg);
  });
  root.addEventListener("keydown", (e) => {
    const chartSvg = e.target.closest?.("svg[data-chart]");
    if (!chartSvg || !["ArrowLeft", "ArrowRight", "Home", "End", "Escape"].includes(e.key)) return;
    const model = models.get(chartSvg.dataset.chart);
    if (!model) return;
    e.preventDefault();
    if (e.key === "Escape") return hideTip(chartSvg);
    const cur = chartSvg.dataset.index === undefined ? -1 : Number(chartSvg.dataset.index);
    const last = model.xs.length - 1;
    const next = { ArrowLeft: Math.max(0, cur - 1), ArrowRight: Math.min(last, cur + 1), Home: 0, End: last }[e.key];
    showTip(chartSvg, next);
  });
  root.addEventListener("focusout", (e) => {
    const chartSvg = e.target.closest?.("svg[data-chart]");
    if (chartSvg) hideTip(chartSvg);
  });
}
