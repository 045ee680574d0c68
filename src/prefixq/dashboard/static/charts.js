// Small SVG charts for the prefixq dashboard: a line chart over time and a bar histogram.
// No library, no network. Series differ by dash pattern and marker as well as by colour, and
// every chart has a text legend and an aria-label, so they read without colour.
"use strict";
(function () {
  const NS = "http://www.w3.org/2000/svg";
  const W = 640;
  const PAD = { left: 56, right: 12, top: 12, bottom: 28 };

  function svg(tag, attrs, text) {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== null && v !== undefined) e.setAttribute(k, String(v));
    }
    if (text !== undefined) e.textContent = String(text);
    return e;
  }

  // 1, 2, 2.5, 5 x 10^n at or above x
  function nice(x) {
    if (!(x > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(x)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= x * (1 - 1e-9)) return m * p;
    return 10 * p;
  }
  // the top of an axis of `ticks` equal steps, each a nice number, covering x
  function niceMax(x, ticks) {
    return nice((x > 0 ? x : 1) / ticks) * ticks;
  }
  function fmtTick(v) {
    return Math.abs(v) >= 1000 ? Math.round(v).toLocaleString("en-US") : String(+v.toPrecision(3));
  }

  function clock(t) {
    const d = new Date(t * 1000);
    return String(d.getHours()).padStart(2, "0") + ":" + String(d.getMinutes()).padStart(2, "0");
  }

  function legend(series) {
    const box = document.createElement("div");
    box.className = "legend";
    series.forEach((s, i) => {
      const item = document.createElement("span");
      item.className = "legend-item";
      const sample = svg("svg", { width: 34, height: 12, viewBox: "0 0 34 12", "aria-hidden": "true" });
      sample.append(svg("line", { x1: 1, y1: 6, x2: 33, y2: 6, class: "series s" + (s.style ?? i) }));
      sample.append(marker(17, 6, s.style ?? i));
      item.append(sample, document.createTextNode(" " + s.name));
      box.append(item);
    });
    return box;
  }

  // a shape per series (circle, square, triangle, diamond, ...), drawn at the last point
  function marker(x, y, i) {
    const cls = "marker s" + i;
    switch (i % 4) {
      case 0: return svg("circle", { cx: x, cy: y, r: 3.5, class: cls });
      case 1: return svg("rect", { x: x - 3.5, y: y - 3.5, width: 7, height: 7, class: cls });
      case 2: return svg("path", { d: `M${x},${y - 4.5}L${x + 4.5},${y + 3.5}L${x - 4.5},${y + 3.5}Z`, class: cls });
      default: return svg("path", { d: `M${x},${y - 4.5}L${x + 4.5},${y}L${x},${y + 4.5}L${x - 4.5},${y}Z`, class: cls });
    }
  }

  // opts: {t: [epoch s], series: [{name, values: [number|null], style?}], height, format, label}
  function line(opts) {
    const H = opts.height || 220;
    const t = opts.t || [];
    const fmt = opts.format || ((v) => String(v));
    const xfmt = opts.xFormat || clock;
    let max = 0;
    for (const s of opts.series) for (const v of s.values) if (v !== null && v > max) max = v;
    const top = niceMax(max, 4);
    const x0 = PAD.left, x1 = W - PAD.right, y0 = H - PAD.bottom, y1 = PAD.top;
    const n = Math.max(t.length - 1, 1);
    const X = (i) => x0 + (x1 - x0) * (i / n);
    const Y = (v) => y0 - (y0 - y1) * (v / top);
    const root = svg("svg", {
      viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img",
      "aria-label": opts.label + ": " + opts.series.map((s) => {
        const last = [...s.values].reverse().find((v) => v !== null);
        return s.name + " " + (last === undefined ? "no data" : "now " + fmt(last));
      }).join("; "),
    });
    for (let k = 0; k <= 4; k++) {
      const v = (top * k) / 4, y = Y(v);
      root.append(svg("line", { x1: x0, x2: x1, y1: y, y2: y, class: k ? "gridline" : "axis" }));
      root.append(svg("text", { x: x0 - 6, y: y + 4, class: "tick", "text-anchor": "end" }, fmtTick(v)));
    }
    if (t.length) {
      for (let k = 0; k <= 4; k++) {
        const i = Math.round((k * (t.length - 1)) / 4);
        const anchor = k === 0 ? "start" : k === 4 ? "end" : "middle";
        root.append(svg("text", { x: X(i), y: H - 8, class: "tick", "text-anchor": anchor }, xfmt(t[i], t[0])));
      }
    }
    opts.series.forEach((s, idx) => {
      const style = s.style ?? idx;
      let d = "", open = false, last = null;
      s.values.forEach((v, i) => {
        if (v === null || v === undefined) { open = false; return; }
        d += (open ? "L" : "M") + X(i).toFixed(1) + "," + Y(v).toFixed(1);
        open = true; last = i;
      });
      if (d) root.append(svg("path", { d, class: "series s" + style, fill: "none" }));
      if (last !== null) root.append(marker(X(last), Y(s.values[last]), style));
    });
    if (!opts.series.some((s) => s.values.some((v) => v !== null))) {
      root.append(svg("text", { x: (x0 + x1) / 2, y: (y0 + y1) / 2, class: "empty", "text-anchor": "middle" }, opts.empty || "no samples yet"));
    }
    const wrap = document.createElement("figure");
    wrap.className = "figure";
    const cap = document.createElement("figcaption");
    cap.textContent = opts.label;
    wrap.append(cap, root, legend(opts.series));
    return wrap;
  }

  // opts: {labels: [string], counts: [int], label}: one bar per bucket, counts written on top
  function bars(opts) {
    const H = opts.height || 200;
    const W = opts.width || 380;
    let lo = opts.counts.findIndex((c) => c > 0);
    let hi = opts.counts.length - 1 - [...opts.counts].reverse().findIndex((c) => c > 0);
    if (lo < 0) { lo = 0; hi = Math.min(2, opts.counts.length - 1); }
    while (hi - lo < 3 && (lo > 0 || hi < opts.counts.length - 1)) {
      if (lo > 0) lo--;
      if (hi - lo < 3 && hi < opts.counts.length - 1) hi++;
    }
    const counts = opts.counts.slice(lo, hi + 1), labels = opts.labels.slice(lo, hi + 1);
    const top = niceMax(Math.max(...counts, 1), 2);
    const x0 = PAD.left, x1 = W - PAD.right, y0 = H - PAD.bottom, y1 = PAD.top + 8;
    const bw = (x1 - x0) / counts.length;
    const total = counts.reduce((a, b) => a + b, 0);
    const root = svg("svg", {
      viewBox: `0 0 ${W} ${H}`, class: "chart bars", role: "img",
      "aria-label": opts.label + ": " + counts.map((c, i) => labels[i] + ": " + c).join(", "),
    });
    for (let k = 0; k <= 2; k++) {
      const v = (top * k) / 2, y = y0 - (y0 - y1) * (v / top);
      root.append(svg("line", { x1: x0, x2: x1, y1: y, y2: y, class: k ? "gridline" : "axis" }));
      root.append(svg("text", { x: x0 - 6, y: y + 4, class: "tick", "text-anchor": "end" }, fmtTick(v)));
    }
    counts.forEach((c, i) => {
      const h = (y0 - y1) * (c / top), x = x0 + i * bw;
      const bar = svg("rect", { x: x + 2, y: y0 - h, width: Math.max(bw - 4, 1), height: h, class: "bar" });
      bar.append(svg("title", {}, `${labels[i]}: ${c}`));
      root.append(bar);
      if (c) root.append(svg("text", { x: x + bw / 2, y: y0 - h - 3, class: "tick", "text-anchor": "middle" }, String(c)));
      if (counts.length <= 7 || i % 2 === 0) {  // every other label when they would touch
        root.append(svg("text", { x: x + bw / 2, y: H - 8, class: "tick", "text-anchor": "middle" }, labels[i]));
      }
    });
    if (!total) root.append(svg("text", { x: (x0 + x1) / 2, y: (y0 + y1) / 2, class: "empty", "text-anchor": "middle" }, "no successful request sampled yet"));
    const wrap = document.createElement("figure");
    wrap.className = "figure";
    const cap = document.createElement("figcaption");
    cap.textContent = opts.label;
    wrap.append(cap, root);
    return wrap;
  }

  window.PrefixqCharts = { line, bars, niceMax };
})();
