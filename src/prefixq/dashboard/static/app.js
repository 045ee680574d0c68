// The prefixq dashboard: polls the server's /api/ and draws the overview (#/) and a burst's page
// (#/burst/<id>). Every value from the server is put into the page as text (textContent and
// setAttribute), never as HTML. The API key, when the server has keys, lives in this tab's
// sessionStorage and goes in the Authorization header; no cookie is used.
"use strict";
(function () {
  const Charts = window.PrefixqCharts;
  const KEY = "prefixq-api-key";
  const POLL_MS = 2000;
  const SLOW_MS = 10000;
  const state = {
    key: sessionStorage.getItem(KEY) || "",
    session: null,
    timers: [],
    errors: new Map(),
    lastOk: 0,
    filters: { status: "", tenant: "", q: "" },
    failedSeen: -1,
    window: 3600,
  };
  const $main = document.getElementById("main");

  // ---- building the page ---------------------------------------------------------------
  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") e.className = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? "" : String(v));
    }
    for (const k of kids.flat(Infinity)) {
      if (k === null || k === undefined || k === false) continue;
      e.append(k instanceof Node ? k : document.createTextNode(String(k)));
    }
    return e;
  }
  function fill(target, ...kids) {
    target.replaceChildren(...kids.flat(Infinity).filter((k) => k !== null && k !== undefined && k !== false));
  }
  function section(title, id, ...kids) {
    return el("section", { class: "panel", id, "aria-labelledby": id + "-h" }, el("h2", { id: id + "-h" }, title), ...kids);
  }
  function table(head, rows, opts) {
    const cols = head.map((h) => (typeof h === "string" ? { label: h } : h));
    return el("div", { class: "scroll" },
      el("table", { class: (opts && opts.cls) || "" },
        el("thead", {}, el("tr", {}, cols.map((c) => el("th", { scope: "col", class: c.num ? "num" : null }, c.label)))),
        el("tbody", {}, rows.length ? rows : el("tr", {}, el("td", { colspan: cols.length, class: "muted" }, (opts && opts.empty) || "none")))));
  }
  function row(cells, attrs) {
    return el("tr", attrs || {}, cells.map((c) => (c instanceof Node && c.tagName === "TD" ? c : el("td", {}, c))));
  }
  function num(v) { return el("td", { class: "num" }, v); }

  // ---- formatting ----------------------------------------------------------------------
  const fmtInt = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"));
  function fmtNum(v) {
    if (v === null || v === undefined) return "–";
    if (v >= 100) return fmtInt(Math.round(v));
    if (v >= 10) return v.toFixed(1);
    if (v >= 1) return v.toFixed(2);
    return v ? v.toPrecision(2) : "0";
  }
  function fmtDur(s) {
    if (s === null || s === undefined || Number.isNaN(s)) return "–";
    if (s < 0.001) return s ? (s * 1e6).toFixed(0) + " µs" : "0";
    if (s < 1) return (s * 1000).toFixed(s < 0.01 ? 2 : 0) + " ms";
    if (s < 60) return s.toFixed(s < 10 ? 2 : 1) + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
    if (s < 86400) return Math.floor(s / 3600) + " h " + Math.round((s % 3600) / 60) + " min";
    return Math.floor(s / 86400) + " d " + Math.round((s % 86400) / 3600) + " h";
  }
  const fmtPct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(x >= 0.995 || x === 0 ? 0 : 1) + "%");
  function fmtWhen(t) {
    if (!t) return "–";
    const d = new Date(t * 1000);
    return d.toLocaleString("en-GB", { hour12: false });
  }
  const ago = (t) => (t ? fmtDur(Math.max(0, Date.now() / 1000 - t)) + " ago" : "–");
  const bucketLabel = (e) => (e === 0 ? "0" : e < 1 ? e * 1000 + "ms" : e < 60 ? e + "s" : e / 60 + "min");

  const MARK = { queued: "◌", running: "▶", finished: "✓", cancelled: "✕", cancelling: "…", expired: "⌛", expiring: "…", lost: "?" };
  function badge(status) {
    return el("span", { class: "badge st-" + String(status).replace(/[^a-z]/g, "") }, (MARK[status] || "•") + " " + status);
  }
  function progress(done, failed, total) {
    const settled = done + failed;
    const bar = el("div", {
      class: "progress", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": total,
      "aria-valuenow": settled, "aria-label": `${settled} of ${total} requests have a result, ${failed} failed`,
    });
    const ok = el("span", { class: "ok" }), bad = el("span", { class: "bad" });
    ok.style.width = total ? (100 * done) / total + "%" : "0";
    bad.style.width = total ? (100 * failed) / total + "%" : "0";
    bar.append(ok, bad);
    return el("div", { class: "progress-wrap" }, bar,
      el("span", { class: "progress-label" }, `${fmtInt(settled)} / ${fmtInt(total)} (${fmtPct(total ? settled / total : 0)})`));
  }
  const burstLink = (id) => el("a", { href: "#/burst/" + encodeURIComponent(id), class: "mono" }, id);

  // ---- talking to the server -----------------------------------------------------------
  class HttpError extends Error {
    constructor(status, message, code) { super(message); this.status = status; this.code = code; }
  }
  async function api(path, opts) {
    opts = opts || {};
    const headers = { Accept: "application/json" };
    if (state.key) headers.Authorization = "Bearer " + state.key;
    if (opts.method === "POST") {
      headers["Content-Type"] = "application/json";
      headers["X-Prefixq-Action"] = "1";
    }
    let resp;
    try {
      resp = await fetch(path, {
        method: opts.method || "GET", headers, cache: "no-store", credentials: "omit",
        body: opts.body === undefined ? undefined : JSON.stringify(opts.body),
      });
    } catch (e) {
      throw new HttpError(0, "The dashboard's server does not answer.", "offline");
    }
    if (opts.raw) {
      if (!resp.ok) throw new HttpError(resp.status, "HTTP " + resp.status, null);
      return resp;
    }
    let body = null;
    try { body = await resp.json(); } catch (e) { body = null; }
    if (!resp.ok) {
      const err = (body && body.error) || {};
      throw new HttpError(resp.status, err.message || "HTTP " + resp.status, err.code || null);
    }
    return body;
  }

  function showBanner() {
    const banner = document.getElementById("banner");
    const errs = [...state.errors.values()];
    document.body.classList.toggle("stale", errs.length > 0);
    if (!errs.length) { banner.hidden = true; banner.replaceChildren(); return; }
    const e = errs[0];
    const what = e.status === 503 ? "Redis cannot be reached: " : e.status === 0 ? "" : `Error ${e.status}: `;
    const since = state.lastOk ? ` The figures below are from ${new Date(state.lastOk).toLocaleTimeString("en-GB", { hour12: false })}.` : "";
    fill(banner, el("strong", {}, "⚠ Not up to date. "), what + e.message + " Retrying." + since);
    banner.hidden = false;
  }
  function ok(name) {
    state.errors.delete(name);
    state.lastOk = Date.now();
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString("en-GB", { hour12: false });
    showBanner();
  }
  function failed(name, e) {
    if (e.status === 401) { askKey(e.message); return; }
    state.errors.set(name, e);
    showBanner();
  }
  // run fn now and then every ms, one call at a time, until the page changes
  function every(name, ms, fn) {
    let alive = true, timer = null;
    const tick = async () => {
      if (!alive) return;
      try { await fn(); ok(name); } catch (e) { if (alive) failed(name, e); }
      if (alive) timer = setTimeout(tick, ms);
    };
    tick();
    state.timers.push(() => { alive = false; clearTimeout(timer); });
  }
  function stopAll() { state.timers.forEach((stop) => stop()); state.timers = []; state.errors.clear(); showBanner(); }

  function askKey(message) {
    stopAll();
    const input = el("input", { type: "password", id: "key", autocomplete: "off", required: true, "aria-describedby": "key-help" });
    const form = el("form", {
      class: "panel keyform",
      onsubmit: (ev) => {
        ev.preventDefault();
        state.key = input.value.trim();
        sessionStorage.setItem(KEY, state.key);
        start();
      },
    },
    el("h2", {}, "API key"),
    el("p", { id: "key-help" }, "This server has API keys. Enter yours: the page shows its namespace. It is kept in this tab only (sessionStorage) and sent as a bearer token."),
    message ? el("p", { class: "error" }, message) : null,
    el("label", { for: "key" }, "Key "), input, " ", el("button", { type: "submit" }, "Show"));
    fill($main, form);
    input.focus();
  }

  // ---- actions -------------------------------------------------------------------------
  const canAct = () => state.session && !state.session.read_only;
  // the outcome goes to the #<noteId> element, which the polls never redraw
  async function act(button, what, path, body, done, noteId) {
    if (!window.confirm(what + "?")) return;
    button.disabled = true;
    const note = document.getElementById(noteId);
    note.textContent = what + "…";
    note.className = "action-note";
    try {
      const rep = await api(path, { method: "POST", body });
      note.textContent = done(rep);
      note.className = "action-note done";
    } catch (e) {
      note.textContent = "Refused: " + e.message;
      note.className = "action-note error";
    } finally {
      button.disabled = false;
    }
  }
  async function download(burst, fmt, button) {
    button.disabled = true;
    try {
      const resp = await api(`api/bursts/${encodeURIComponent(burst)}/results?format=${fmt}`, { raw: true });
      const blob = await resp.blob();
      const a = el("a", { href: URL.createObjectURL(blob), download: `${burst}-${fmt}.jsonl` });
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(a.href), 10000);
    } catch (e) {
      window.alert("Download failed: " + e.message);
    } finally {
      button.disabled = false;
    }
  }

  // ---- overview ------------------------------------------------------------------------
  function overview() {
    const totals = el("div", { class: "cards", id: "totals" });
    const charts = el("div", { class: "charts", id: "history" }, el("p", { class: "muted" }, "Loading…"));
    const shards = el("div", { id: "shards-body" }, el("p", { class: "muted" }, "Loading…"));
    const bursts = el("div", { id: "bursts-body" }, el("p", { class: "muted" }, "Loading…"));
    const tenants = el("div", { id: "tenants-body" });
    const dead = el("div", { id: "dead-body" });
    const f = state.filters;
    const status = el("select", { id: "f-status", "aria-label": "status" },
      ["", "active", "queued", "running", "finished", "cancelled", "expired"].map((s) =>
        el("option", { value: s, selected: f.status === s }, s || "any status")));
    const tenant = el("select", { id: "f-tenant", "aria-label": "tenant" }, el("option", { value: "" }, "any tenant"));
    const text = el("input", { id: "f-text", type: "search", placeholder: "burst id or tenant", value: f.q, "aria-label": "text" });
    let refreshBursts = () => {};
    status.addEventListener("change", () => { f.status = status.value; refreshBursts(); });
    tenant.addEventListener("change", () => { f.tenant = tenant.value; refreshBursts(); });
    text.addEventListener("input", () => { f.q = text.value; refreshBursts(); });
    const windowSel = el("select", { id: "f-window", "aria-label": "time window" },
      [[900, "last 15 min"], [3600, "last hour"], [21600, "last 6 hours"]].map(([v, label]) =>
        el("option", { value: v, selected: state.window === v }, label)));
    let refreshHistory = () => {};
    windowSel.addEventListener("change", () => { state.window = Number(windowSel.value); refreshHistory(); });
    fill($main,
      totals,
      section("Throughput and queue depth", "over-time", el("div", { class: "filters" }, windowSel), charts),
      section("Shards and workers", "shards", shards),
      section("Bursts", "bursts", el("div", { class: "filters" }, status, tenant, text), bursts),
      el("div", { class: "grid" },
        section("Tenants and priorities", "tenants", tenants),
        section("Dead letters", "dead", el("p", { id: "dead-note", class: "action-note", role: "status" }), dead)));

    let last = { shards: null, history: null, bursts: null };
    every("shards", POLL_MS, async () => {
      const snap = await api("api/shards");
      last.shards = snap;
      fill(shards, renderShards(snap));
      fill(tenants, renderTenants(snap.sharing));
      fill(totals, renderTotals(last));
    });
    const loadHistory = async () => {
      const h = await api("api/history?window_s=" + state.window);
      last.history = h;
      fill(charts, renderHistory(h));
      fill(totals, renderTotals(last));
    };
    refreshHistory = () => loadHistory().then(() => ok("history"), (e) => failed("history", e));
    every("history", SLOW_MS, loadHistory);
    let seq = 0;
    const loadBursts = async () => {
      const mine = ++seq;
      const q = new URLSearchParams({ status: f.status, tenant: f.tenant, q: f.q, limit: "25" });
      const got = await api("api/bursts?" + q.toString());
      if (mine !== seq) return;
      last.bursts = got;
      const chosen = tenant.value;
      fill(tenant, el("option", { value: "" }, "any tenant"),
        got.tenants.map((t) => el("option", { value: t, selected: t === chosen }, t)));
      fill(bursts, renderBursts(got));
      fill(totals, renderTotals(last));
    };
    refreshBursts = () => loadBursts().then(() => ok("bursts"), (e) => failed("bursts", e));
    every("bursts", POLL_MS, loadBursts);
    every("dead", 5000, async () => fill(dead, renderDead(await api("api/dead?limit=100"))));
  }

  function card(label, value, detail) {
    return el("div", { class: "card" }, el("div", { class: "card-value" }, value), el("div", { class: "card-label" }, label), detail ? el("div", { class: "card-detail" }, detail) : null);
  }
  function renderTotals(last) {
    const sh = (last.shards && last.shards.shards) || [];
    const sum = (k) => sh.reduce((a, s) => a + (s[k] || 0), 0);
    const quiet = sh.reduce((a, s) => a + s.worker_detail.filter((w) => w.quiet).length, 0);
    const gone = sh.reduce((a, s) => a + s.workers_gone.length, 0);
    let rate = null;
    if (last.history) {
      const v = last.history.total.done_per_s.filter((x) => x !== null);
      rate = v.length ? v[v.length - 1] : null;
    }
    const active = last.bursts ? ["queued", "running", "cancelling"].reduce((a, s) => a + (last.bursts.counts[s] || 0), 0) : null;
    return [
      card("queued", fmtInt(sum("waiting")), "oldest " + fmtDur(Math.max(0, ...sh.map((s) => s.oldest_waiting_s)))),
      card("in flight", fmtInt(sum("pending"))),
      card("finished / s", rate === null ? "–" : fmtNum(rate), "last sample"),
      card("workers", fmtInt(sum("workers")), !sh.length ? null : !sum("workers") ? "✕ none serving" :
        (quiet ? `⚠ ${quiet} quiet ` : "") + (gone ? `✕ ${gone} gone` : quiet ? "" : "all beating")),
      card("dead letters", fmtInt(sum("dead_letters"))),
      card("active bursts", fmtInt(active)),
    ];
  }

  function renderHistory(h) {
    const shards = h.shards.length <= 8 ? h.shards : [];
    const series = (key) => [
      { name: "all shards", values: h.total[key], style: 0 },
      ...(h.shards.length > 1 ? shards.map((s, i) => ({ name: "shard " + s.shard, values: s[key], style: i + 1 })) : []),
    ];
    return [el("div", { class: "grid charts-grid" },
      Charts.line({ label: "Requests finished per second", t: h.t, series: series("done_per_s"), format: fmtNum }),
      Charts.line({ label: "Failed per second", t: h.t, series: series("failed_per_s"), format: fmtNum }),
      Charts.line({
        label: "Queued (waiting) and in flight, all shards", t: h.t, format: fmtNum,
        series: [{ name: "queued", values: h.total.waiting, style: 0 }, { name: "in flight", values: h.total.pending, style: 1 }],
      }),
      h.shards.length > 1 ? Charts.line({ label: "Queued per shard", t: h.t, series: shards.map((s, i) => ({ name: "shard " + s.shard, values: s.waiting, style: i + 1 })), format: fmtNum }) : null),
      el("p", { class: "caption" }, `Samples the workers keep in Redis: one per worker every ${fmtDur(state.session ? state.session.history_every_s : 5)}, shown in steps of ${fmtDur(h.step_s)}. Gaps: no worker sampled.`),
    ];
  }

  function byPriority(s) {
    const q = { high: 0, normal: 0, low: 0 };
    for (const x of s.queues) q[x.priority] = (q[x.priority] || 0) + x.waiting;
    return `${fmtInt(q.high)} / ${fmtInt(q.normal)} / ${fmtInt(q.low)}`;
  }
  function renderShards(snap) {
    if (!snap.shards.length) {
      return el("p", { class: "muted" }, `No shard in namespace ${snap.namespace} yet: no worker has started there.`);
    }
    const fleet = snap.fleet || { shards: [], moves: {} };
    const orphaned = new Set(fleet.shards.filter((x) => x.orphaned).map((x) => x.shard));
    const moves = Object.entries(fleet.moves || {}).map(([why, m]) => row([why, num(fmtInt(m.groups)), num(fmtInt(m.requests)), num(fmtInt(m.tokens))]));
    const shardRows = snap.shards.map((s) => row([
      num(s.shard), num(fmtInt(s.waiting)), num(byPriority(s)), num(fmtInt(s.pending)), num(fmtDur(s.oldest_waiting_s)),
      num(fmtInt(s.outstanding_prefill_tokens)), num(fmtInt(s.lanes)),
      num(s.dead_letters ? el("span", { class: "warn" }, "⚠ " + fmtInt(s.dead_letters)) : "0"),
      num(s.workers ? fmtInt(s.workers) : el("span", { class: "bad-text" }, orphaned.has(s.shard) ? "✕ none: queue moving" : "✕ none")),
      num(s.prompt_tokens ? `${fmtPct(s.cached_tokens / s.prompt_tokens)} / ${fmtPct(s.predicted_cached_tokens / s.prompt_tokens)}` : "–"),
    ], { class: s.workers ? null : "row-bad" }));
    const workers = [];
    for (const s of snap.shards) {
      for (const w of s.worker_detail) {
        const state_ = !w.engine_up ? el("span", { class: "warn" }, "◌ engine loading") :
          w.stopping ? el("span", { class: "warn" }, "… stopping") :
          w.quiet ? el("span", { class: "bad-text" }, "⚠ quiet") : el("span", { class: "good" }, "✓ serving");
        workers.push(row([
          el("td", { class: "mono" }, w.name), num(s.shard), state_, [w.host, " ", el("span", { class: "muted" }, w.gpu)],
          num(el("span", { class: w.quiet ? "bad-text" : null }, fmtDur(w.beat_age_s))),
          num(`${fmtInt(w.inflight_at_beat)} / ${fmtInt(w.max_inflight)}`), num(fmtInt(w.pending)),
          num(`${fmtInt(w.finished)} / ${fmtInt(w.failed)}`),
          num(`${fmtNum(w.loop_lag_p99_ms)} / ${fmtNum(w.loop_lag_max_ms)} ms`),
          num(`${fmtNum(w.gc_max_pause_ms)} ms (${fmtInt(w.gc_pauses)})`),
        ], { class: w.quiet ? "row-bad" : null }));
      }
      for (const g of s.workers_gone) {
        workers.push(row([el("td", { class: "mono" }, g.name), num(s.shard), el("span", { class: "bad-text" }, "✕ gone"),
          "", num(fmtDur(g.last_beat_age_s)), "", "", "", "", ""], { class: "row-gone" }));
      }
    }
    return [
      table(["shard", { label: "queued", num: 1 }, { label: "high / normal / low", num: 1 }, { label: "in flight", num: 1 },
        { label: "oldest wait", num: 1 }, { label: "prefill backlog (tokens)", num: 1 }, { label: "lanes", num: 1 },
        { label: "dead letters", num: 1 }, { label: "workers", num: 1 }, { label: "cached / predicted", num: 1 }], shardRows),
      el("h3", {}, "Moves between shards"),
      table(["why", { label: "prefix groups", num: 1 }, { label: "requests", num: 1 }, { label: "prompt tokens", num: 1 }], moves,
        { cls: "moves", empty: "nothing moved: every queue is served where it was placed" }),
      el("p", { class: "caption" }, "orphaned: a shard without a live worker had its queue moved; steal: an idle worker took whole prefix groups from a backlogged shard; drain: a stopping worker handed its queue over; guard: placement sent a new group away from an overloaded shard."),
      el("h3", {}, "Workers"),
      table(["worker", "shard", "state", "host", { label: "heartbeat age", num: 1 }, { label: "in engine / max", num: 1 },
        { label: "pending", num: 1 }, { label: "finished / failed", num: 1 }, { label: "loop lag p99 / max", num: 1 },
        { label: "worst GC pause (count)", num: 1 }], workers, { empty: "no live worker" }),
      el("p", { class: "caption" }, "A worker is quiet when it missed three heartbeats, gone once its heartbeat expired. Loop lag and GC figures are since the worker started."),
    ];
  }

  function renderTenants(rows) {
    return table(["priority", "tenant", { label: "queued", num: 1 }, { label: "in flight", num: 1 }, { label: "oldest wait", num: 1 },
      { label: "bursts", num: 1 }, { label: "admitted", num: 1 }, { label: "mean queue wait", num: 1 }],
    rows.map((x) => row([x.priority, el("td", { class: "mono" }, x.tenant), num(fmtInt(x.waiting)), num(fmtInt(x.in_flight)),
      num(fmtDur(x.oldest_waiting_s)), num(fmtInt(x.bursts)), num(fmtInt(x.admitted)), num(fmtDur(x.mean_queue_wait_s))])),
    { empty: "nothing queued or admitted yet" });
  }

  function renderBursts(got) {
    const counts = Object.entries(got.counts).map(([k, v]) => `${v} ${k}`).join(", ");
    return [
      table(["burst", "status", "progress", { label: "ok / failed", num: 1 }, { label: "req/s", num: 1 }, { label: "ETA", num: 1 },
        "priority", "tenant", { label: "cache served / predicted", num: 1 }, { label: "submitted", num: 1 }],
      got.bursts.map((b) => b.status === "lost"
        ? row([el("td", {}, burstLink(b.burst)), el("td", {}, badge("lost")), el("td", { colspan: 8, class: "muted" }, b.error)])
        : row([el("td", {}, burstLink(b.burst)), el("td", {}, badge(b.status)), el("td", { class: "progress-cell" }, progress(b.done, b.failed, b.total)),
          num(`${fmtInt(b.done)} / ${fmtInt(b.failed)}`), num(fmtNum(b.requests_per_s)), num(b.eta_s === null ? "–" : fmtDur(b.eta_s)),
          b.priority, el("td", { class: "mono" }, b.tenant), num(`${fmtPct(b.cached_ratio)} / ${fmtPct(b.predicted_ratio)}`), num(ago(b.created))])),
      { empty: "no burst matches" }),
      el("p", { class: "caption" }, `Newest ${fmtInt(got.scanned)} of ${fmtInt(got.indexed)} bursts looked at${counts ? ": " + counts : ""}. Rates: results recorded in the last minute.`),
    ];
  }

  function renderDead(got) {
    const acting = canAct();
    const rows = got.dead.map((d) => {
      const cells = [el("td", { class: "mono" }, d.id), num(d.shard),
        el("td", {}, d.burst ? [burstLink(d.burst), ":" + d.index] : "–"), num(d.delivered), num(ago(d.at)), el("td", { class: "reason" }, d.reason)];
      if (acting) {
        const b = el("button", { type: "button", class: "small" }, "requeue");
        b.addEventListener("click", () => act(b, "Requeue dead letter " + d.id, "api/dead/requeue", { ids: [d.id] },
          (rep) => `requeued ${rep.requeued}, resolved ${rep.resolved}` + (rep.skipped.length ? `, skipped: ${rep.skipped.map((s) => s[1]).join("; ")}` : ""), "dead-note"));
        cells.push(el("td", {}, b));
      }
      return row(cells);
    });
    const total = got.per_shard.reduce((a, b) => a + b, 0);
    const head = ["dead letter", { label: "shard", num: 1 }, "request", { label: "deliveries", num: 1 }, { label: "when", num: 1 }, "reason"];
    if (acting) head.push("");
    const all = acting && got.dead.length ? el("button", { type: "button", id: "requeue-all" }, "Requeue all") : null;
    if (all) {
      all.addEventListener("click", () => act(all, `Requeue all ${total} dead letters`, "api/dead/requeue", { all: true },
        (rep) => `requeued ${rep.requeued}, resolved ${rep.resolved}, skipped ${rep.skipped.length}`, "dead-note"));
    }
    return [
      el("div", { class: "toolbar" }, el("span", {}, `${fmtInt(total)} dead letters`), all),
      table(head, rows, { empty: "no dead letter" }),
    ];
  }

  // ---- a burst's page ------------------------------------------------------------------
  function burstPage(id) {
    const head = el("div", { id: "burst-head" }, el("h1", { class: "mono" }, id));
    const body = el("div", { id: "burst-body" }, el("p", { class: "muted" }, "Loading…"));
    const failedBox = el("div", { id: "failed-body" });
    fill($main, el("p", {}, el("a", { href: "#/" }, "← all bursts")), head,
      el("p", { id: "burst-note", class: "action-note", role: "status" }), body, section("Failed requests", "failed", failedBox));
    state.failedSeen = -1;
    if (!/^[A-Za-z0-9_.:@+-]{1,200}$/.test(id)) {  // what the server would refuse: no request
      fill(body, el("p", { class: "error" }, "No such burst (not a burst id)."));
      return;
    }
    const path = "api/bursts/" + encodeURIComponent(id);
    every("burst", POLL_MS, async () => {
      let got;
      try {
        got = await api(path);
      } catch (e) {
        if (e.status === 404) {
          fill(head, el("h1", { class: "mono" }, id));
          fill(body, el("p", { class: "error" }, e.message));
          fill(failedBox);
          return;
        }
        throw e;
      }
      fill(head, renderBurstHead(got));
      fill(body, renderBurst(got));
      if (got.burst.failed !== state.failedSeen) {
        state.failedSeen = got.burst.failed;
        if (got.burst.failed) fill(failedBox, renderFailed(await api(path + "/failed?limit=100")));
        else fill(failedBox, el("p", { class: "muted" }, "No request failed."));
      }
    });
  }

  function renderBurstHead(got) {
    const b = got.burst, s = got.summary;
    const active = ["queued", "running", "cancelling"].includes(b.status);
    const actions = el("div", { class: "toolbar" });
    for (const [fmt, label] of [["prefixq", "Download results (prefixq JSONL)"], ["openai", "Download results (OpenAI batch output)"]]) {
      const btn = el("button", { type: "button", class: "download", "data-format": fmt }, label);
      btn.addEventListener("click", () => download(b.burst, fmt, btn));
      actions.append(btn);
    }
    if (active) actions.append(el("span", { class: "muted" }, "(results recorded so far)"));
    if (active && canAct()) {
      const c = el("button", { type: "button", id: "cancel", class: "danger" }, "Cancel burst");
      c.addEventListener("click", () => act(c, "Cancel burst " + b.burst, `api/bursts/${encodeURIComponent(b.burst)}/cancel`, {},
        (rep) => rep.already_finished ? `it had ended already (${rep.status})` : `${rep.status}: ${rep.cancelled} requests cancelled`, "burst-note"));
      actions.append(c);
    }
    return [
      el("h1", {}, el("span", { class: "mono" }, b.burst), " ", badge(b.status)),
      el("p", { class: "meta" }, `priority ${b.priority} · tenant `, el("span", { class: "mono" }, b.tenant),
        ` · placement ${b.placement || "–"} · submitted ${fmtWhen(b.created)}` + (b.finished_at ? ` · ended ${fmtWhen(b.finished_at)}` : "")),
      el("div", { class: "burst-progress" }, progress(b.done, b.failed, b.total)),
      el("div", { class: "cards" },
        card("ok", fmtInt(b.done)), card("failed", fmtInt(b.failed), s.cancelled || s.expired ? `${s.cancelled} cancelled, ${s.expired} expired` : null),
        card("req/s", fmtNum(active ? s.requests_per_s : b.requests_per_s), active ? "last minute" : "over the burst"),
        card("ETA", s.eta_s === null ? "–" : fmtDur(s.eta_s)),
        card("cache served / predicted", `${fmtPct(b.cached_ratio)} / ${fmtPct(s.predicted_ratio)}`, `${fmtInt(b.cached_tokens)} of ${fmtInt(b.prompt_tokens)} prompt tokens`),
        card("span", fmtDur(b.span_s))),
      actions,
    ];
  }

  function renderBurst(got) {
    const b = got.burst;
    const stages = [["queue wait (enqueued → admitted)", "queue_wait_s"], ["admitted → first token", "first_token_s"], ["end to end (enqueued → finished)", "end_to_end_s"]];
    const pct = table(["stage", { label: "p50", num: 1 }, { label: "p95", num: 1 }, { label: "p99", num: 1 }, { label: "max", num: 1 }],
      stages.map(([label, k]) => row([label, num(fmtDur(b[k].p50)), num(fmtDur(b[k].p95)), num(fmtDur(b[k].p99)), num(fmtDur(b[k].max))])), { cls: "percentiles" });
    const sampled = b.sampled < b.results ? `From a random sample of ${fmtInt(b.sampled)} of its ${fmtInt(b.results)} results.` : `From all ${fmtInt(b.results)} results.`;
    const labels = b.histograms.edges_s.map(bucketLabel);
    const tl = b.timeline;
    const tlT = tl.ok_per_s.map((_, i) => tl.start + i * tl.step_s);
    const shards = b.per_shard.length ? table(["shard", { label: "requests", num: 1 }], b.per_shard.map((n, k) => row([num(k), num(fmtInt(n))]))) : el("p", { class: "muted" }, "–");
    const byWorker = Object.entries(b.workers || {});
    const workers = byWorker.length ? table(["worker", { label: "results", num: 1 }, { label: "share", num: 1 }],
      byWorker.map(([w, n]) => row([el("td", { class: "mono" }, w), num(fmtInt(n)), num(fmtPct(n / Math.max(1, b.results)))])), { cls: "burst-workers" }) : null;
    return [
      el("div", { class: "grid" },
        section("Latency percentiles", "latency", pct, el("p", { class: "caption" }, sampled + " Successful requests only.")),
        section("Throughput over time", "throughput",
          Charts.line({ label: "Requests finished per second", t: tlT, format: fmtNum, empty: "nothing finished yet",
            xFormat: (t, t0) => "+" + fmtDur(t - t0),
            series: [{ name: "ok", values: tl.ok_per_s, style: 0 }, { name: "failed", values: tl.failed_per_s, style: 1 }] }),
          el("p", { class: "caption" }, `Estimated from the sample, in steps of ${fmtDur(tl.step_s)}.`))),
      section("Latency histograms", "histograms", el("div", { class: "grid tight" },
        stages.map(([label, k]) => Charts.bars({ label, labels, counts: b.histograms[k] })))),
      el("div", { class: "grid" },
        section("Shards and workers", "burst-shards", el("p", { class: "caption" }, "Requests placed on each shard; results recorded by each worker (a moved or stolen group is served where it went)."), shards, workers),
        section("Tokens and bytes", "tokens", table(["", { label: "", num: 1 }], [
          row(["prompt tokens", num(fmtInt(b.prompt_tokens))]), row(["served from the prefix cache", num(`${fmtInt(b.cached_tokens)} (${fmtPct(b.cached_ratio)})`)]),
          row(["predicted cached", num(fmtInt(b.predicted_cached_tokens))]), row(["output tokens", num(fmtInt(b.output_tokens))]),
          row(["enqueued bytes (raw → encoded)", num(`${fmtInt(b.raw_bytes)} → ${fmtInt(b.encoded_bytes)} (×${b.compression})`)])]))),
    ];
  }

  function renderFailed(got) {
    return [
      table([{ label: "index", num: 1 }, "id", "code", "error", { label: "shard", num: 1 }, "worker"],
        got.failed.map((f) => row([num(f.index), el("td", { class: "mono" }, f.id), el("td", { class: "mono" }, f.error_code || "–"),
          el("td", { class: "reason", title: f.error }, f.error), num(f.shard), el("td", { class: "mono" }, f.worker)]))),
      el("p", { class: "caption" }, `${fmtInt(got.found)} failed among ${fmtInt(got.scanned)} results looked at` + (got.complete ? "" : " (not all of them)") + (got.found > got.failed.length ? `; the first ${got.failed.length} shown.` : ".")),
    ];
  }

  // ---- start ---------------------------------------------------------------------------
  async function start() {
    stopAll();
    let session;
    try {
      session = await api("api/session");
    } catch (e) {
      if (e.status !== 401) {
        fill($main, el("p", { class: "error" }, "The dashboard cannot start: " + e.message), el("button", { type: "button", onclick: start }, "Try again"));
        return;
      }
      session = { authenticated: false, keys: true, message: e.message };
    }
    if (session.keys && !session.authenticated) {
      askKey(state.key ? session.message || "That key is not accepted." : "");
      return;
    }
    state.session = session;
    document.getElementById("ns").textContent = "namespace " + session.namespace;
    const mode = document.getElementById("mode");
    mode.replaceChildren();
    if (session.read_only) mode.append(el("span", { class: "badge" }, "read-only"));
    if (session.keys) {
      mode.append(" ", el("button", { type: "button", class: "small", onclick: () => { sessionStorage.removeItem(KEY); state.key = ""; start(); } }, "forget key"));
    }
    const m = (location.hash || "#/").match(/^#\/burst\/(.+)$/);
    if (m) {
      let id;
      try { id = decodeURIComponent(m[1]); } catch (e) { id = m[1]; }
      burstPage(id);
    } else {
      overview();
    }
  }
  window.addEventListener("hashchange", start);
  start();
})();
