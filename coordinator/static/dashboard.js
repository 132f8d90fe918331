// Bagel's live dashboard: polls /api/state once a second and redraws in place.
// Hand-written, no dependencies. Every string from the run (worker names, reasons) is put
// into the page as text (textContent), never as markup: names come from volunteers.
"use strict";

const POLL_MS = 1000;
const SVG_NS = "http://www.w3.org/2000/svg";
let updates = 0;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, String(v));
    else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function fmtNum(x, digits = 1) {
  if (x === null || x === undefined || !Number.isFinite(x)) return "—";
  const a = Math.abs(x);
  if (a >= 1e9) return (x / 1e9).toFixed(digits) + "G";
  if (a >= 1e6) return (x / 1e6).toFixed(digits) + "M";
  if (a >= 1e4) return (x / 1e3).toFixed(digits) + "k";
  return x.toFixed(a < 10 && digits > 0 ? digits + 1 : digits);
}

function fmtBytes(b) {
  if (b === null || b === undefined) return "—";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (b >= 1000 && i < units.length - 1) { b /= 1000; i++; }
  return b.toFixed(i ? 1 : 0) + " " + units[i];
}

function fmtAge(s) {
  if (s === null || s === undefined) return "—";
  if (s < 60) return s.toFixed(1) + " s";
  if (s < 3600) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}

function fmtTime(ms) {
  return new Date(ms).toLocaleTimeString([], { hour12: false });
}

// A line chart of several series over shared x values, with a y axis from 0 to the max.
function lineChart(container, xs, lines, opts) {
  const W = opts.width || 800, H = opts.height || 180, L = 48, R = 8, T = 8, B = 20;
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img" });
  const title = svg("title");
  title.textContent = opts.title || "";
  root.append(title);
  const ymax = Math.max(1e-9, ...lines.flatMap((l) => l.values.filter((v) => v !== null && Number.isFinite(v))));
  const ymin = opts.fromZero === false
    ? Math.min(...lines.flatMap((l) => l.values.filter((v) => v !== null && Number.isFinite(v))), ymax)
    : 0;
  const span = ymax - ymin || 1;
  const x0 = xs.length ? xs[0] : 0, x1 = xs.length ? xs[xs.length - 1] : 1;
  const px = (x) => L + ((x - x0) / ((x1 - x0) || 1)) * (W - L - R);
  const py = (y) => T + (1 - (y - ymin) / span) * (H - T - B);
  const ticks = opts.small ? 1 : 4;
  for (let i = 0; i <= ticks; i++) {
    const y = ymin + (span * i) / ticks;
    root.append(svg("line", { x1: L, x2: W - R, y1: py(y), y2: py(y), stroke: "#e3e6ea" }));
    const label = svg("text", { x: L - 4, y: py(y) + 4, "text-anchor": "end", "font-size": 11, fill: "#6b7280" });
    label.textContent = fmtNum(y, opts.small ? 2 : 1);
    root.append(label);
  }
  if (opts.timeAxis && xs.length) {
    const marks = [[x0, "start"], [(x0 + x1) / 2, "middle"], [x1, "end"]];
    for (const [x, anchor] of marks) {
      const t = svg("text", { x: px(x), y: H - 4, "text-anchor": anchor, "font-size": 11, fill: "#6b7280" });
      t.textContent = fmtTime(x);
      root.append(t);
    }
  }
  for (const line of lines) {
    const pts = [];
    line.values.forEach((v, i) => {
      if (v !== null && Number.isFinite(v)) pts.push([px(xs[i]), py(v)]);
    });
    if (pts.length === 1) pts.push([pts[0][0] + 1, pts[0][1]]);
    if (!pts.length) continue;
    const coords = pts.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(" ");
    if (line.area) {
      // the area under the line, down to the axis: a line drawn over it stays visible when equal
      const base = py(ymin).toFixed(1);
      root.append(svg("polygon", {
        points: `${pts[0][0].toFixed(1)},${base} ${coords} ${pts[pts.length - 1][0].toFixed(1)},${base}`,
        fill: line.color, "fill-opacity": 0.18, stroke: "none", class: line.name + "-area",
      }));
    }
    root.append(svg("polyline", {
      points: coords, fill: "none", stroke: line.color, "stroke-width": line.width || 2,
      "vector-effect": "non-scaling-stroke", class: line.name,
    }));
  }
  if (!xs.length) {
    const t = svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", "font-size": 13, fill: "#6b7280" });
    t.textContent = opts.empty || "no data yet";
    root.append(t);
  }
  container.replaceChildren(root);
}

function renderHealth(s) {
  document.getElementById("run-id").textContent = `${s.run_id} · spec ${s.spec_hash.slice(0, 12)} · up ${fmtAge(s.uptime_s)}`;
  const h = s.health;
  const staffed = h.cells - h.unstaffed.length;
  let text = `[${h.active}/${h.expected} workers healthy] ${staffed}/${h.cells} cells with members · standby ${h.standby}`;
  if (h.unstaffed.length) text += ` · no members: ${h.unstaffed.join(", ")}`;
  document.getElementById("health").textContent = text;
}

function renderRates(s) {
  const xs = s.series.t_ms;
  lineChart(document.getElementById("rate-chart"), xs, [
    { name: "throughput", values: s.series.throughput, color: "#2563eb", area: true, width: 3 },
    { name: "goodput", values: s.series.goodput, color: "#16a34a" },
  ], { title: "samples per second", timeAxis: true, empty: "waiting for the first reports" });
  const t = s.totals;
  const share = t.trained ? ` (${((100 * t.committed) / t.trained).toFixed(0)}% committed)` : "";
  document.getElementById("totals").textContent =
    ` · total: ${fmtNum(t.trained, 0)} trained, ${fmtNum(t.committed, 0)} committed${share}`;
}

function renderCells(s) {
  const grid = document.getElementById("cells");
  const cards = [];
  for (const c of s.cells) {
    const dl = el("dl", {},
      el("dt", {}, "committed"), el("dd", { class: "committed" }, `round ${c.committed_round}`),
      el("dt", {}, "open round"), el("dd", {}, c.round_state === "none" ? "—" : `${c.round} (${c.round_state})`),
      el("dt", {}, "members"), el("dd", { class: "members", title: c.members.join(", ") },
        c.member_count ? `${c.member_count}: ${c.members.join(", ")}` : "none"),
      el("dt", {}, "bytes/round"), el("dd", {}, fmtBytes(c.bytes_per_round)),
      el("dt", {}, "last commit"), el("dd", {}, c.last_commit_age_s === null ? "—" : fmtAge(c.last_commit_age_s) + " ago"),
      el("dt", {}, "loss"), el("dd", {},
        c.heldout_loss !== null ? `held-out ${fmtNum(c.heldout_loss, 3)}` : c.loss !== null ? `train ${fmtNum(c.loss, 3)}` : "—"),
    );
    const card = el("div", {
      class: "cell" + (c.member_count ? "" : " unstaffed"),
      "data-cell-id": c.cell_id, "data-committed-round": c.committed_round, "data-members": c.member_count,
    }, el("h3", {}, c.cell_id, el("span", { class: "kind" }, c.kind)), dl);
    const chart = el("div", { class: "curve" });
    const hasHeldout = c.curve.some((p) => p.heldout_loss !== null);
    lineChart(chart, c.curve.map((p) => p.round), [
      hasHeldout
        ? { name: "heldout", values: c.curve.map((p) => p.heldout_loss), color: "#ea580c" }
        : { name: "loss", values: c.curve.map((p) => p.loss), color: "#9333ea" },
    ], { width: 300, height: 60, fromZero: false, small: true, title: hasHeldout ? "held-out loss by round" : "training loss by round",
      empty: c.member_count ? "no commit yet" : "no members: not training" });
    card.append(chart);
    if (!c.member_count) card.append(el("div", { class: "note" }, "no members: this cell trains nothing"));
    if (c.rollbacks) {
      card.append(el("div", { class: "note rollbacks" },
        `fell back to its checkpoint ${c.rollbacks}× (no live worker held its committed state)`));
    }
    cards.push(card);
  }
  grid.replaceChildren(...cards);
  const trained = s.cells.filter((c) => c.committed_round > 0).length;
  document.getElementById("cells-note").textContent = `${trained}/${s.cells.length} have committed a round`;
}

function renderWorkers(s) {
  const body = document.querySelector("#workers tbody");
  const rows = s.workers.map((w) => el("tr", { class: w.state, "data-worker-id": w.worker_id },
    el("td", { title: w.worker_id }, w.name ? `${w.name} (${w.worker_id.slice(0, 9)})` : w.worker_id),
    el("td", { title: w.reason }, w.state),
    el("td", { class: "phase" }, w.phase || "—"),
    el("td", {}, w.cell_id || (w.state === "active" ? "standby" : "—")),
    el("td", { class: "num" }, w.cell_id ? fmtNum(w.samples_per_s, 1) : "—"),
    el("td", { class: "num" }, fmtAge(w.heartbeat_age_s)),
    el("td", { class: "num" }, fmtNum(w.reputation, 2)),
    el("td", {}, w.reachability || "—"),
  ));
  body.replaceChildren(...rows);
  const more = s.workers_total > s.workers.length ? ` (showing ${s.workers.length})` : "";
  document.getElementById("workers-note").textContent = `${s.workers_total} known${more}`;
}

function renderEvents(s) {
  const list = document.getElementById("events");
  const items = s.events.slice().reverse().map((e) => el("li", { class: e.kind, "data-seq": e.seq, "data-kind": e.kind },
    el("time", {}, fmtTime(e.at_ms)), el("span", { class: "kind" }, e.kind), e.text));
  list.replaceChildren(...items);
}

async function poll() {
  try {
    const r = await fetch("/api/state", { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const s = await r.json();
    renderHealth(s);
    renderRates(s);
    renderCells(s);
    renderWorkers(s);
    renderEvents(s);
    updates += 1;
    document.body.dataset.updates = String(updates);
    document.getElementById("conn").textContent = `updated ${fmtTime(s.now_ms)}`;
  } catch (err) {
    document.getElementById("conn").textContent = `coordinator unreachable (${err.message}); retrying`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
