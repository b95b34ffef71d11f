// The dashboard shell: hash routing, polling, the token dialog and connection state.
//
// A page module exports {title, load(ctx), view(data, ctx), live?(data), crumbs?(ctx, data),
// actions?}. load() fetches, view() builds DOM (no listeners), and every 2 s — while the tab
// is visible, updates are not paused and live() says so — the page is loaded again and the
// new view is morphed into the old one. Actions run on click and change of an element with
// data-action, and on submit of a form with data-action; ctx.reload() loads the page again now.

import { AuthError, NetworkError, ApiError, get, getToken, setToken } from "./api.js";
import { installChartInteractions, restoreTooltip } from "./charts.js";
import { fmtTime, h, hrefFor, morph, replace } from "./dom.js";
import { empty } from "./ui.js";
import overview from "./pages/overview.js";
import rollouts from "./pages/rollouts.js";
import rolloutDetail from "./pages/rollout.js";
import training from "./pages/training.js";
import resources from "./pages/resources.js";
import review from "./pages/review.js";

const POLL_MS = 2000;

const ROUTES = [
  { re: /^\/?$/, page: overview, nav: "overview" },
  { re: /^\/rollouts\/?$/, page: rollouts, nav: "rollouts" },
  { re: /^\/rollouts\/([^/?]+)\/?$/, page: rolloutDetail, nav: "rollouts" },
  { re: /^\/training\/?$/, page: training, nav: "training" },
  { re: /^\/resources(?:\/(\d+))?\/?$/, page: resources, nav: "resources" },
  { re: /^\/review\/?$/, page: review, nav: "review" },
];

const $ = (id) => document.getElementById(id);

const app = {
  ctx: null, // the current page's context (route, query, state, abort signal)
  data: null, // what the current page last loaded
  rendered: false,
  timer: null,
  paused: false,
  info: null,
  skew: 0, // server clock minus browser clock, seconds
  conn: "connecting",
  lastUpdate: null,
};

// ------------------------------------------------------------------ routing

function parseHash() {
  const raw = location.hash.replace(/^#/, "") || "/";
  const cut = raw.indexOf("?");
  const path = cut < 0 ? raw : raw.slice(0, cut);
  const query = new URLSearchParams(cut < 0 ? "" : raw.slice(cut + 1));
  return { path: path.startsWith("/") ? path : `/${path}`, query };
}

function makeCtx(route, match, path, query, previous) {
  const controller = new AbortController();
  const samePage = previous && previous.page === route.page && previous.path === path;
  const ctx = {
    page: route.page,
    nav: route.nav,
    path,
    params: match.slice(1),
    query,
    signal: controller.signal,
    abort: () => controller.abort(),
    state: samePage ? previous.state : {}, // survives query changes (filters, cursors)
    now: () => Date.now() / 1000 + app.skew,
    info: () => app.info,
    /** Load and show the page again now (after a write), or as soon as the load under way ends. */
    reload() {
      if (ctx.loading) ctx.again = true;
      else if (ctx === app.ctx) {
        clearTimeout(app.timer);
        refresh();
      }
    },
    /** Change query parameters (null removes one) and navigate. */
    setQuery(updates, { keep = true } = {}) {
      const q = new URLSearchParams(keep ? query : "");
      for (const [k, v] of Object.entries(updates)) {
        q.delete(k);
        if (v === null || v === undefined || v === "") continue;
        for (const item of Array.isArray(v) ? v : [v]) q.append(k, item);
      }
      location.hash = hrefFor(path, q);
    },
  };
  return { ctx, samePage };
}

async function navigate() {
  const { path, query } = parseHash();
  const found = ROUTES.map((r) => ({ r, m: path.match(r.re) })).find((x) => x.m);
  const previous = app.ctx;
  previous?.abort();
  clearTimeout(app.timer);
  if (!found) {
    app.ctx = null;
    setChrome({ title: "Not found", nav: null, crumbs: [] });
    replace($("content"), empty("Page not found", `There is no page at “${path}”.`, h("a", { class: "btn", href: "#/" }, "Go to the overview"), { icon: "search" }));
    return;
  }
  const { ctx, samePage } = makeCtx(found.r, found.m, path, query, previous);
  app.ctx = ctx;
  if (!samePage) {
    app.data = null;
    app.rendered = false;
    setChrome({ title: titleOf(ctx, null), nav: ctx.nav, crumbs: ctx.page.crumbs?.(ctx, null) || [] });
    replace($("content"), h("div", { class: "loading", role: "status" }, h("span", { class: "spinner", "aria-hidden": "true" }), "Loading…"));
    if (previous) $("page-title").focus({ preventScroll: true }); // tell screen readers the page changed
    window.scrollTo(0, 0);
  }
  await refresh();
}

function titleOf(ctx, data) {
  const t = ctx.page.title;
  return typeof t === "function" ? t(ctx, data) : t;
}

function setChrome({ title, nav, crumbs }) {
  $("page-title").textContent = title;
  document.title = `${title} · agentbolt`;
  for (const a of document.querySelectorAll("[data-nav]")) {
    if (a.dataset.nav === nav) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  const parts = crumbs.flatMap((c, i) => [i ? h("span", { class: "crumb-sep", "aria-hidden": "true" }, "/") : null, h("a", { href: c.href }, c.label)]);
  replace($("crumbs"), h("span", {}, parts));
  $("crumbs").hidden = !crumbs.length;
}

// ------------------------------------------------------------------ loading and polling

async function refresh() {
  const ctx = app.ctx;
  if (!ctx || ctx.loading) return; // per context: a load cancelled by navigation must not block the next page
  ctx.loading = true;
  try {
    const data = await ctx.page.load(ctx);
    if (ctx !== app.ctx) return;
    app.data = data;
    render(ctx, data);
    app.lastUpdate = Date.now();
    if (!app.info) loadInfo(); // the server was down or locked when the page opened
    setConn(app.paused ? "paused" : ctx.page.live && !ctx.page.live(data, ctx) ? "idle" : "live");
    setBanner(null);
  } catch (err) {
    if (ctx !== app.ctx || ctx.signal.aborted) return;
    handleError(ctx, err);
  } finally {
    ctx.loading = false;
    if (ctx === app.ctx && ctx.again) {
      ctx.again = false;
      refresh();
    } else if (ctx === app.ctx) schedule();
  }
}

function render(ctx, data) {
  const node = ctx.page.view(data, ctx);
  setChrome({ title: titleOf(ctx, data), nav: ctx.nav, crumbs: ctx.page.crumbs?.(ctx, data) || [] });
  if (app.rendered) morph($("content"), node);
  else replace($("content"), node);
  app.rendered = true;
  restoreTooltip();
}

function handleError(ctx, err) {
  if (err instanceof AuthError) {
    setConn("locked");
    app.rendered = false;
    app.data = null;
    replace($("content"), lockedState(err.hadToken));
    openTokenDialog(err.hadToken ? "rejected" : "required");
    return;
  }
  if (err instanceof NetworkError) {
    setConn("offline");
    if (app.data) {
      setBanner(`Connection to the server lost — showing data from ${fmtTime(app.lastUpdate / 1000)}. Retrying every ${POLL_MS / 1000} s…`);
    } else {
      app.rendered = false;
      replace($("content"), empty("Can’t reach the agentbolt server",
        `${err.message} Is it running at ${location.origin}? This page retries every ${POLL_MS / 1000} seconds.`,
        h("button", { type: "button", class: "btn", "data-global": "retry" }, "Retry now"), { icon: "plug" }));
    }
    return;
  }
  setConn("error");
  app.rendered = false;
  app.data = null;
  const notFound = err instanceof ApiError && err.status === 404;
  const view = notFound && ctx.page.notFound ? ctx.page.notFound(ctx, err)
    : empty(notFound ? "Not found" : "Something went wrong", err instanceof ApiError ? `${err.message} (HTTP ${err.status})` : String(err?.message || err),
      h("button", { type: "button", class: "btn", "data-global": "retry" }, "Try again"), { icon: "alert" });
  replace($("content"), view);
  console.error(err);
}

function lockedState(hadToken) {
  return empty(hadToken ? "Your access token was rejected" : "An access token is required",
    hadToken ? "The server answered 401 Unauthorized for the saved token. It may have been rotated or mistyped."
      : "This server only answers requests that carry a bearer token. A read-only (reader) token is enough.",
    h("button", { type: "button", class: "btn btn-primary", "data-global": "token" }, "Enter access token"), { icon: "lock" });
}

function schedule() {
  clearTimeout(app.timer);
  const ctx = app.ctx;
  if (!ctx || app.conn === "locked") return;
  const keepGoing = app.conn === "offline" || app.conn === "error" || !ctx.page.live || ctx.page.live(app.data, ctx);
  if (!keepGoing || app.conn === "error") return;
  app.timer = setTimeout(tick, POLL_MS);
}

function tick() {
  if (document.hidden || app.paused) {
    setConn("paused");
    return; // resumed by visibilitychange or the pause button
  }
  refresh();
}

// ------------------------------------------------------------------ status line

const CONN_TEXT = {
  connecting: "Connecting…", live: "Live", idle: "Up to date", paused: "Updates paused",
  offline: "Offline", locked: "Token needed", error: "Error",
};

function setConn(state) {
  if (state === "paused" && !app.paused && !document.hidden) state = "live";
  app.conn = state;
  const el = $("live");
  el.dataset.state = state;
  const text = el.querySelector(".live-text");
  if (text.textContent !== (CONN_TEXT[state] || state)) text.textContent = CONN_TEXT[state] || state; // a status region: speak changes only
  el.title = app.lastUpdate ? `Last updated ${fmtTime(app.lastUpdate / 1000)}` : "";
}

function setBanner(text) {
  const el = $("banner");
  if (!text) {
    el.hidden = true;
    el.textContent = "";
  } else if (el.textContent !== text) {
    el.hidden = false;
    el.textContent = text;
  }
}

// ------------------------------------------------------------------ server info and token

async function loadInfo() {
  try {
    app.info = await get("/dashboard/info");
    app.skew = app.info.server_time - Date.now() / 1000;
  } catch {
    app.info = null;
  }
  renderInfo();
}

function renderInfo() {
  const info = app.info;
  const rows = info ? [
    ["Server", `v${info.version}`],
    ["Store", info.backend],
    ["Access", info.auth ? (info.role === "reader" ? "read-only token" : `${info.role} token`) : "no auth"],
    info.name ? ["Signed in as", info.name] : null,
  ].filter(Boolean) : [["Server", "—"]];
  replace($("server-info"), h("div", {}, rows.map(([k, v]) => h("div", { class: "info-row" }, h("dt", {}, k), h("dd", {}, v)))));
  $("token-button").hidden = Boolean(info && !info.auth);
}

function openTokenDialog(reason) {
  const dialog = $("token-dialog");
  const error = $("token-error");
  const messages = {
    rejected: "The server rejected the saved token (401 Unauthorized). Enter a valid token.",
    required: null,
    manual: null,
  };
  error.hidden = !messages[reason];
  error.textContent = messages[reason] || "";
  $("token-input").value = "";
  $("token-forget")?.toggleAttribute("hidden", !getToken());
  if (!dialog.open) dialog.showModal();
  $("token-input").focus();
}

async function submitToken(e) {
  e.preventDefault();
  const token = $("token-input").value.trim();
  const error = $("token-error");
  const show = (text) => {
    error.textContent = text;
    error.hidden = false;
    $("token-input").focus();
  };
  if (!token) return show("Enter a token.");
  $("token-submit").disabled = true;
  try {
    await get("/dashboard/info", null, { token });
    setToken(token);
    $("token-dialog").close();
    await restart();
  } catch (err) {
    if (err instanceof AuthError) show("The server rejected this token (401 Unauthorized).");
    else if (err instanceof NetworkError) show("The server could not be reached. Try again in a moment.");
    else show(err.message);
  } finally {
    $("token-submit").disabled = false;
  }
}

async function restart() {
  await loadInfo();
  app.ctx = null;
  await navigate();
}

// ------------------------------------------------------------------ theme and global controls

const THEMES = ["auto", "dark", "light"];

function applyTheme(theme) {
  document.documentElement.dataset.theme = theme;
  $("theme-button").textContent = `Theme: ${theme}`;
  try {
    localStorage.setItem("agentbolt.theme", theme);
  } catch {
    /* ignore */
  }
}

function globalAction(name) {
  if (name === "token") openTokenDialog("manual");
  else if (name === "retry") {
    clearTimeout(app.timer);
    refresh();
  } else if (name === "pause") {
    app.paused = !app.paused;
    $("pause-button").setAttribute("aria-pressed", String(app.paused));
    if (app.paused) setConn("paused");
    else refresh();
  } else if (name === "theme") {
    const cur = document.documentElement.dataset.theme || "auto";
    applyTheme(THEMES[(THEMES.indexOf(cur) + 1) % THEMES.length]);
  } else if (name === "forget-token") {
    setToken("");
    $("token-dialog").close();
    restart();
  }
}

function installHandlers() {
  document.addEventListener("click", (e) => {
    const global = e.target.closest("[data-global]");
    if (global) {
      e.preventDefault();
      globalAction(global.dataset.global);
      return;
    }
    const action = e.target.closest("[data-action]");
    if (action && app.ctx?.page.actions?.[action.dataset.action] && !["SELECT", "INPUT", "TEXTAREA", "FORM"].includes(action.tagName)) {
      e.preventDefault();
      app.ctx.page.actions[action.dataset.action](action, app.ctx);
    }
  });
  document.addEventListener("change", (e) => {
    const el = e.target.closest("[data-action]");
    if (el && el.tagName !== "FORM" && app.ctx?.page.actions?.[el.dataset.action]) app.ctx.page.actions[el.dataset.action](el, app.ctx);
  });
  document.addEventListener("submit", (e) => {
    const form = e.target.closest("form[data-action]");
    if (!form) return;
    e.preventDefault(); // never a page load: the page's action sends it
    app.ctx?.page.actions?.[form.dataset.action]?.(form, app.ctx);
  });
  document.querySelector(".skip-link").addEventListener("click", (e) => {
    e.preventDefault();
    $("content").focus();
  });
  $("token-form").addEventListener("submit", submitToken);
  $("token-cancel").addEventListener("click", () => $("token-dialog").close());
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && !app.paused && app.ctx && !app.ctx.loading) {
      clearTimeout(app.timer);
      refresh();
    } else if (document.hidden) setConn("paused");
  });
  window.addEventListener("hashchange", () => {
    if (location.hash.startsWith("#/") || location.hash === "" || location.hash === "#") navigate();
  });
  installChartInteractions(document);
}

function addForgetButton() {
  const actions = document.querySelector("#token-form .dialog-actions");
  actions.prepend(h("button", { type: "button", class: "btn btn-ghost", id: "token-forget", "data-global": "forget-token" }, "Forget saved token"));
}

async function main() {
  let theme = "auto";
  try {
    theme = localStorage.getItem("agentbolt.theme") || "auto";
  } catch {
    /* ignore */
  }
  applyTheme(THEMES.includes(theme) ? theme : "auto");
  addForgetButton();
  installHandlers();
  $("page-title").setAttribute("tabindex", "-1");
  await loadInfo();
  await navigate();
}

main();
