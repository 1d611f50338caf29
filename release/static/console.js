// Flywheel release console (served by release/console.py).
//
// Polls the release controller's JSON API every 2 s with the bearer token typed in the header and
// draws what it answers: the routing, the candidates, the focused candidate's analysis (charts,
// guardrails, verdict, reasons), the audit log, Approve / Reject for a version a person must
// decide on, and Undo: stable back to an earlier promoted version (POST /api/undo, after a second
// click that says what will happen). Rules kept throughout:
// - every string from the API reaches the page as text (textContent, text nodes, SVG <text>),
//   never as markup, so a reason or actor name cannot inject anything;
// - a section is rebuilt only when its data changed, so a poll never steals focus or wipes what a
//   person is typing (the reason fields are never rebuilt at all);
// - a refused action (401, 403, 409, ...) is shown with the server's own words, never swallowed.
"use strict";

const POLL_MS = 2000;
const TOKEN_KEY = "flywheel.release.token";
const LIVE = new Set(["canary", "awaiting_approval", "held"]);
const DECIDABLE = new Set(["awaiting_approval", "held"]);
const SVG_NS = "http://www.w3.org/2000/svg";

const ui = {
  selected: null,  // a version a person clicked; null: follow the live canary
  focus: null,     // the version the detail panel shows
  live: null,      // the version serving canary traffic, if any
  focusState: null,
  timer: null,
  busy: false,
  again: false,
  drawn: {},       // section -> JSON of the data it was last drawn from
  stable: null,    // the stable version, as last polled
  undoTo: null,    // the version an Undo waits to be confirmed for
};

const $ = (id) => document.getElementById(id);

// -- small DOM helpers (text only) ---------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "onclick") node.addEventListener("click", v);
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);  // strings become text nodes
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

const cssToken = (s) => String(s ?? "none").toLowerCase().replace(/[^a-z0-9_-]/g, "");

function badge(value, prefix) {
  const text = value === null || value === undefined ? "—" : String(value).replace(/_/g, " ");
  return el("span", { class: `badge ${prefix}-${cssToken(value)}` }, text);
}

function fill(id, nodes) {
  $(id).replaceChildren(...nodes);
}

/** Redraw a section only when its data changed (keeps focus and scroll where they are). */
function changed(section, data) {
  const json = JSON.stringify(data);
  if (ui.drawn[section] === json) return false;
  ui.drawn[section] = json;
  return true;
}

// -- formatting -----------------------------------------------------------------------------------

const pad = (n) => String(n).padStart(2, "0");

function clock(epochS) {
  if (typeof epochS !== "number") return "—";
  const d = new Date(epochS * 1000);
  const hms = `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  const today = new Date().toDateString() === d.toDateString();
  return today ? hms : `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${hms}`;
}

function timeCell(epochS) {
  const iso = typeof epochS === "number" ? new Date(epochS * 1000).toISOString() : "";
  return el("td", { class: "nowrap" }, el("time", { datetime: iso, title: iso }, clock(epochS)));
}

const num = (x, digits = 3) => (typeof x === "number" && isFinite(x) ? x.toFixed(digits) : "—");
const pct = (x) => (typeof x === "number" && isFinite(x) ? `${(100 * x).toFixed(1)}%` : "—");

function evalue(x) {
  if (typeof x !== "number" || !isFinite(x)) return "—";
  return x >= 1e4 ? x.toExponential(1) : x.toFixed(x >= 100 ? 0 : 2);
}

// -- the API ----------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

const token = () => sessionStorage.getItem(TOKEN_KEY) || "";

async function api(path, init = {}) {
  const headers = { Authorization: `Bearer ${token()}`, Accept: "application/json", ...(init.headers || {}) };
  let res;
  try {
    res = await fetch(path, { ...init, headers, cache: "no-store" });
  } catch (err) {
    throw new ApiError(0, `cannot reach the release controller (${err.message})`);
  }
  const text = await res.text();
  let body = text;
  try { body = text ? JSON.parse(text) : null; } catch { /* not JSON: keep the text */ }
  if (!res.ok) throw new ApiError(res.status, detailOf(body, res));
  return body;
}

/** The server's reason: FastAPI's {"detail": "..."}, or its validation list, or the raw body. */
function detailOf(body, res) {
  const d = body && typeof body === "object" && "detail" in body ? body.detail : body;
  if (Array.isArray(d)) {
    return d.map((x) => (x && x.msg ? `${(x.loc || []).slice(1).join(".") || "request"}: ${x.msg}` : JSON.stringify(x)))
      .join("; ");
  }
  if (typeof d === "string" && d.trim()) return d.trim();
  if (d) return JSON.stringify(d);
  return res.statusText || "no reason given";
}

/** A sentence for a person: what was refused, and the server's own reason. */
function explain(err, doing) {
  switch (err.status) {
    case 0: return `${doing} failed: ${err.message}.`;
    case 401: return `${doing} refused (401, token not accepted): ${err.message}`;
    case 403: return `${doing} refused (403, not allowed for this token): ${err.message}`;
    case 409: return `${doing} refused (409, not possible now): ${err.message}`;
    default: return `${doing} failed (HTTP ${err.status}): ${err.message}`;
  }
}

// -- polling ----------------------------------------------------------------------------------------

async function poll() {
  if (ui.busy) { ui.again = true; return; }
  ui.busy = true;
  clearTimeout(ui.timer);
  let refused = false;
  try {
    const [status, cands, log] = await Promise.all([
      api("api/status"), api("api/candidates"), api("api/audit?limit=50"),
    ]);
    // The API wraps its lists ({"candidates": [...]}, {"entries": [...]}); a bare list is taken too.
    const candidates = Array.isArray(cands) ? cands : (cands && cands.candidates) || [];
    const audit = Array.isArray(log) ? log : (log && log.entries) || [];
    const focus = focusVersion(status, candidates);
    const detail = focus === null ? null : await api(`api/candidates/${encodeURIComponent(focus)}`);
    render(status, candidates, audit, detail);
    setConn("ok", "Connected", ` · updated ${clock(Date.now() / 1000)}`);
  } catch (err) {
    refused = err.status === 401;
    setConn("error", explain(err, "Loading") + (refused ? " (enter another token)" : ""));
  } finally {
    ui.busy = false;
    // a refused token stays refused: stop asking until another one is entered
    if (token() && !refused) ui.timer = setTimeout(poll, ui.again ? 0 : POLL_MS);
    ui.again = false;
  }
}

/** The selected version when it still exists, else the live canary, else none. */
function focusVersion(status, candidates) {
  const versions = new Set(candidates.map((c) => c.version));
  const live = candidates.filter((c) => LIVE.has(c.state));
  ui.live = live.length ? live[live.length - 1].version
    : status && status.canary && versions.has(status.canary.version) ? status.canary.version : null;
  if (ui.selected !== null && versions.has(ui.selected)) return ui.selected;
  ui.selected = null;
  return ui.live;
}

/** The connection line: its state is a live region (announced when it changes), the time of the
 * last update is not (it changes every poll). */
function setConn(kind, text, updated = "") {
  $("conn").className = `conn conn-${kind}`;
  if ($("conn-state").textContent !== text) $("conn-state").textContent = text;
  $("conn-time").textContent = updated;
}

function render(status, candidates, audit, detail) {
  $("main").hidden = false;
  $("intro").hidden = true;
  // the server's clock moves every poll; the status line is redrawn (and announced) only when
  // something else in it changes
  if (changed("status", { ...status, time: null })) renderStatus(status);
  if (changed("candidates", [candidates, ui.selected, ui.live, detail && detail.version])) renderCandidates(candidates, detail);
  if (changed("audit", audit)) renderAudit(audit);
  if (changed("detail", detail)) renderDetail(detail);
  const promoted = candidates.filter((c) => c.state === "promoted").map((c) => c.version);
  if (changed("undo", [promoted, status.stable_version])) renderUndo(promoted, status.stable_version);
}

/** The versions undo can go back to, as suggestions: the form's own fields are never rebuilt. */
function renderUndo(promoted, stable) {
  const newest = [...promoted].sort((a, b) => b - a);
  const label = (v) => (v === stable ? `v${v} (stable now)` : `v${v}`);
  fill("undo-versions", newest.filter((v) => v !== stable).map((v) => el("option", { value: String(v) })));
  $("undo-hint").textContent = newest.length ? `Promoted before: ${newest.map(label).join(", ")}. ` +
    "The version is verified against its manifest again before serving loads it; refused while a canary is live."
    : "No version has been promoted yet.";
}

// -- status line, candidates, audit -------------------------------------------------------------

function renderStatus(s) {
  ui.stable = typeof s.stable_version === "number" ? s.stable_version : null;
  const items = [el("span", { class: "item" }, "Stable ", el("strong", {}, `v${s.stable_version}`),
    s.stable_version === 0 ? el("span", { class: "muted" }, " (the model serving started on)") : null)];
  if (s.canary) {
    items.push(el("span", { class: "item" }, "Canary ", el("strong", {}, `v${s.canary.version}`),
      ` on ${pct(s.canary.share)} of users`));
  } else {
    items.push(el("span", { class: "item muted" }, "No canary"));
  }
  items.push(el("span", { class: "item" }, "Pipeline ",
    s.paused ? el("span", { class: "badge s-paused" }, "paused") : el("span", { class: "badge s-running" }, "running")));
  if (s.revision && s.revision.revision !== undefined) {
    items.push(el("span", { class: "item muted", title: s.revision.reason || "" }, `Revision ${s.revision.revision}`,
      s.revision.skipped === true ? " (cannot be published: see the audit log)"
        : s.revision.published === false ? " (not published yet)" : ""));
  }
  const now = typeof s.time === "number" ? s.time : Date.now() / 1000;
  if (typeof s.next_promotion_at === "number" && s.next_promotion_at > now) {
    items.push(el("span", { class: "item" }, `Next promotion from ${clock(s.next_promotion_at)}`));
  }
  if (s.auto_promote !== undefined) {
    items.push(el("span", { class: "item muted" }, s.auto_promote ? "Auto-promote on" : "Approver promotes"));
  }
  const lease = s.lease || (s.lease_holder ? { holder: s.lease_holder } : null);
  items.push(el("span", { class: "item muted" }, !lease ? "No controller lease"
    : lease.live === false ? `Controller lease lapsed (last: ${lease.holder})` : `Controller: ${lease.holder}`));
  const signing = s.controller && s.controller.signing;
  if (signing) items.push(...signingItems(signing));
  fill("status", items);
}

// Whether checkpoint announcements are verified and routings signed (docs/signing.md): running
// with signing off is shown to everyone who looks, not only said once in the start-up log.
function signingItems(sg) {
  const out = [];
  const cp = sg.checkpoints || {};
  if (cp.verified === false) {
    out.push(el("span", { class: "item", id: "signing" }, el("span", {
      class: "badge s-unverified",
      title: "release.trusted_checkpoint_keys is empty: whoever can write the checkpoints topic can announce weights",
    }, "Checkpoints not verified")));
  } else if (cp.verified === true) {
    const ids = cp.trusted_key_ids || [];
    out.push(el("span", { class: "item muted", id: "signing" },
      `Checkpoints verified (${ids.length ? ids.join(", ") : "no usable key"})`));
  }
  for (const f of cp.refused_key_files || []) {
    out.push(el("span", { class: "item refused-key", title: f.reason },
      el("span", { class: "badge s-unverified" }, "Key file refused"), ` ${f.path}`));
  }
  out.push(sg.releases_signed_with
    ? el("span", { class: "item muted" }, `Routings signed with ${sg.releases_signed_with}`)
    : el("span", { class: "item" }, el("span", {
      class: "badge s-unverified", title: "release.signing_key is not set: a serving that verifies refuses them",
    }, "Routings unsigned")));
  return out;
}

function renderCandidates(list, detail) {
  const focus = detail ? detail.version : null;
  const rows = [...list].sort((a, b) => b.version - a.version).map((c) => {
    const pick = el("button", {
      class: "link", type: "button", "aria-pressed": String(c.version === focus),
      "aria-label": `Show version ${c.version}`,
      onclick: () => { ui.selected = c.version; poll(); },
    }, `v${c.version}`);
    return el("tr", { class: c.version === focus ? "focus" : "", "data-version": String(c.version) },
      el("td", { class: "nowrap" }, pick, c.parent !== null && c.parent !== undefined
        ? el("span", { class: "muted", title: `trained from v${c.parent}` }, ` ← v${c.parent}`) : null),
      el("td", {}, badge(c.state, "s")),
      verdictCell(c.gate || c.gate_summary),
      verdictCell(c.analysis || c.analysis_summary),
      timeCell(c.updated_at));
  });
  fill("candidates-body", rows);
  $("candidates-empty").hidden = list.length > 0;
  $("follow-live").hidden = ui.live === null || ui.selected === null || ui.selected === ui.live;
}

/** A verdict badge; its first reason as the cell's tooltip. */
function verdictCell(v) {
  const reason = v ? v.reason || (Array.isArray(v.reasons) ? v.reasons[0] : "") : "";
  return el("td", reason ? { title: reason } : {}, badge(v ? v.outcome : null, "o"));
}

function renderAudit(entries) {
  // Two lines per entry (what changed, by whom; then why): the reasons are long and the panel narrow.
  const rows = [...entries].sort((a, b) => b.id - a.id).map((e) => {
    const state = (x) => (x ? String(x).replace(/_/g, " ") : "new");
    const version = e.version === null || e.version === undefined ? "pipeline" : `v${e.version}`;
    const change = e.to_state ? ` ${state(e.from_state)} → ${state(e.to_state)}` : " note";
    return el("tr", {},
      timeCell(e.at),
      el("td", {},
        el("div", { class: "entry-head" }, el("strong", {}, version), change, el("span", { class: "muted" }, " by "),
          el("span", { class: "actor" }, e.actor)),
        el("div", { class: "reason" }, e.reason)));
  });
  fill("audit-body", rows);
}

// -- the focused candidate ------------------------------------------------------------------------

function renderDetail(c) {
  const prev = ui.focus;
  ui.focus = c ? c.version : null;
  ui.focusState = c ? c.state : null;
  if (prev !== ui.focus) hideMessage();
  $("detail-empty").hidden = c !== null;
  $("detail-h").textContent = c ? `Version ${c.version}` : "No candidate selected";
  fill("detail-state", c ? [badge(c.state, "s")] : []);
  const decidable = c !== null && DECIDABLE.has(c.state);
  $("decide").hidden = !decidable;
  if (decidable) {
    $("approve").textContent = `Approve v${c.version}`;
    $("reject").textContent = `Reject v${c.version}`;
  }
  const a = c && c.analysis;
  $("analysis").hidden = !a;
  $("analysis-none").hidden = !c || Boolean(a);
  if (a) renderAnalysis(a);
  $("gate").hidden = !(c && c.gate);
  if (c && c.gate) renderGate(c.gate);
}

function renderAnalysis(a) {
  fill("verdict", [badge(a.outcome, "o")]);
  const p = a.pairs || {};
  // PASS at this canary's level (the deployment's budget across canaries), FAIL at alpha
  const passAt = typeof a.pass_alpha === "number" ? a.pass_alpha : a.alpha;
  const threshold = typeof a.alpha === "number"
    ? ` (PASS at ${+(1 / passAt).toFixed(2)}, FAIL at ${+(1 / a.alpha).toFixed(2)})` : "";
  // users counted apart from the comparison, and why (release/README.md, "Outcome-blind pairs")
  const apart = [[a.excluded_users, "users flagged by reward's guards left out"],
    [a.new_users, "users new since the canary started left out"], [a.late_users, "users whose answers came late left out"],
    [a.unjudged_users, "users whose signal reward never judged left out"],
    [a.switched_users, "users answered by both arms left out"],
    [a.before_routing_users, "users answered before the canary's first answer left out"]];
  const left = apart.filter(([n]) => n).map(([n, what]) => ` · ${n} ${what}`).join("");
  $("evidence").textContent = `${p.pairs ?? 0} pairs: ${p.wins ?? 0} won by canary, ${p.losses ?? 0} by stable · ` +
    `e-value better ${evalue(a.e_better)}, worse ${evalue(a.e_worse)}${threshold}${left}`;
  fill("reasons", (a.reasons || []).map((r) => el("li", {}, r)));
  fill("guardrails-body", guardrailRows(a));  // first: the charts take the width the table leaves
  const h = (a.history || []).filter((pt) => typeof pt.t === "number");
  $("rate-chart").replaceChildren(rateChart(h, a));
  $("band-chart").replaceChildren(bandChart(h, a));
}

function renderGate(g) {
  fill("gate-verdict", [badge(g.outcome, "o")]);
  fill("gate-reasons", (g.reasons || []).map((r) => el("li", {}, r)));
  const m = g.measurement || {};
  // each held-out eval scored each way (release/evals.py): both versions' scores, side by side
  const evals = m.evals || [];
  $("gate-evals").hidden = evals.length === 0;
  fill("gate-evals-body", evals.map((e) => {
    const score = (right, wrong) => (right + (e.items - right - wrong) / 2) / e.items;
    return el("tr", {},
      el("th", { scope: "row" }, `${e.name} (${e.method})`),
      el("td", {}, num(score(e.stable_right, e.stable_wrong))),
      el("td", {}, num(score(e.candidate_right, e.candidate_wrong))),
      el("td", {}, `${e.candidate_right} / ${e.candidate_wrong} against ${e.stable_right} / ${e.stable_wrong}`),
      el("td", {}, String(e.items)));
  }));
  // the answers' profiles are sums for the judge, not figures to read: the reasons name what moved
  const shown = Object.entries(m).filter(([k]) => k !== "evals" && !/_(text|meaning)$/.test(k));
  fill("gate-measurement", shown.flatMap(([k, v]) => [
    el("dt", {}, k.replace(/_/g, " ")),
    el("dd", {}, typeof v === "number" ? num(v) : JSON.stringify(v)),
  ]));
}

// The guardrails judge.py checks, each named as its reasons name it ("guardrail <name>: ..."), so a
// breached one can be marked from the verdict's own reasons.
const GUARDRAILS = [
  { key: "accept_rate", label: "accept rate", fmt: pct, change: "diff" },
  // the rate guardrails are judged on each user's own rate, averaged over users (judge.py): the
  // per-user mean where the analysis has it, the per-request share for an analysis of older code
  { key: "user_error_rate", old: "error_rate", label: "error rate (mean over users)", fmt: pct, change: "diff",
    rule: "error rate" },
  { key: "latency_ms_p95", label: "latency p95", fmt: (x) => `${num(x, 0)} ms`, change: "ratio", rule: "latency" },
  { key: "completion_tokens_mean", label: "output length", fmt: (x) => `${num(x, 1)} tok`, change: "ratio", rule: "output length" },
  { key: "user_reject_share", old: "reject_share", label: "share of rejects (mean over users)", fmt: pct,
    change: "diff", rule: "share of rejects" },
  { key: "user_flag_rate", old: "flag_rate", label: "reward-guard flags (mean over users)", fmt: pct, change: "diff",
    rule: "reward-guard flags" },
  { key: "repetition", label: "character repetition", fmt: (x) => num(x, 3), change: "diff", rule: "character repetition" },
  { key: "char_class_share", label: (a) => `${a.char_class || "character class"} share`, fmt: pct, change: "diff",
    rule: "character-class stuffing" },
  { key: "collapsed_share", label: "collapsed answers", fmt: pct, change: "diff", rule: "length collapse" },
  { key: "outcomes", label: "outcomes", fmt: (x) => num(x, 0) },
  { key: "users", label: "users (the split: sample-ratio check)", fmt: (x) => num(x, 0) },
  { key: "requests", label: "requests", fmt: (x) => num(x, 0) },
];

function guardrailRows(a) {
  const s = a.stable || {};
  const c = a.canary || {};
  const reasons = a.reasons || [];
  // Guardrails are judged only once both arms have their minimum outcomes, and never after a
  // measurement error (judge.py's rules 1 and 2): before that, say so rather than "ok".
  const judged = ["pass", "fail", "inconclusive", "hold"].includes(a.outcome) ||
    (a.outcome === "running" && !reasons.some((r) => r.includes("outcomes needed")));
  return GUARDRAILS.map((row) => {
    const g = row.old && s[row.key] === undefined ? { ...row, key: row.old } : row;
    let change = "";
    if (g.change === "diff" && typeof s[g.key] === "number" && typeof c[g.key] === "number") {
      const d = 100 * (c[g.key] - s[g.key]);
      change = `${d >= 0 ? "+" : "−"}${Math.abs(d).toFixed(1)} pt`;
    } else if (g.change === "ratio" && s[g.key] > 0 && typeof c[g.key] === "number") {
      change = `×${(c[g.key] / s[g.key]).toFixed(2)}`;
    }
    let check = el("span", { class: "muted" }, "");
    if (g.rule) {
      const breached = reasons.some((r) => r.startsWith(`guardrail ${g.rule}`));
      check = breached ? el("span", { class: "badge o-fail" }, "breached")
        : judged ? el("span", { class: "badge o-pass" }, "within") : el("span", { class: "muted" }, "not judged yet");
    }
    return el("tr", { class: g.rule ? "" : "muted-row" },
      el("th", { scope: "row" }, typeof g.label === "function" ? g.label(a) : g.label),
      el("td", { class: "num" }, g.fmt(s[g.key])),
      el("td", { class: "num" }, g.fmt(c[g.key])),
      el("td", { class: "num" }, change),
      el("td", {}, check));
  });
}

// -- charts (inline SVG, drawn from numbers only) --------------------------------------------------

/** A chart frame: scales, gridlines with y labels, x labels as clock times. */
function frame(w, h, xs, [y0, y1], yTicks, yFmt, titleText) {
  const m = { l: 42, r: 10, t: 8, b: 20 };
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  if (!(x1 > x0)) { x0 -= 30; x1 += 30; }
  const X = (x) => m.l + ((x - x0) / (x1 - x0)) * (w - m.l - m.r);
  const Y = (y) => m.t + (1 - (y - y0) / (y1 - y0)) * (h - m.t - m.b);
  const root = svg("svg", { viewBox: `0 0 ${w} ${h}`, role: "img", class: "chart", preserveAspectRatio: "xMidYMid meet" });
  root.append(svg("title", {}, titleText));
  for (const t of yTicks) {
    root.append(svg("line", { x1: m.l, x2: w - m.r, y1: Y(t), y2: Y(t), class: "grid" }));
    root.append(svg("text", { x: m.l - 6, y: Y(t) + 4, class: "tick", "text-anchor": "end" }, yFmt(t)));
  }
  const n = 4;
  for (let i = 0; i <= n; i++) {
    const t = x0 + ((x1 - x0) * i) / n;
    const d = new Date(t * 1000);
    const anchor = i === 0 ? "start" : i === n ? "end" : "middle";
    root.append(svg("text", { x: X(t), y: h - 5, class: "tick", "text-anchor": anchor },
      `${pad(d.getHours())}:${pad(d.getMinutes())}${x1 - x0 < 600 ? `:${pad(d.getSeconds())}` : ""}`));
  }
  return { root, X, Y };
}

function linePath(points, X, Y) {
  return points.map(([x, y], i) => `${i ? "L" : "M"}${X(x).toFixed(1)},${Y(y).toFixed(1)}`).join("");
}

function niceTicks(lo, hi, count) {
  const raw = (hi - lo) / count;
  const step = [0.01, 0.02, 0.05, 0.1, 0.2, 0.25, 0.5].find((s) => s >= raw) || 0.5;
  const ticks = [];
  for (let t = Math.ceil(lo / step - 1e-9) * step; t <= hi + 1e-9; t += step) ticks.push(+t.toFixed(4));
  return { step, ticks };
}

/** The drawing width of a chart: its box in CSS pixels, so 11px labels stay 11px. */
function widthOf(id) {
  return Math.max(240, Math.round($(id).clientWidth || 640));
}

function noData(text) {
  return el("p", { class: "empty" }, text);
}

function rateChart(h, a) {
  const pts = h.filter((p) => typeof p.stable_rate === "number" && typeof p.canary_rate === "number");
  if (!pts.length) return noData("No accept-rate history yet.");
  const ys = pts.flatMap((p) => [p.stable_rate, p.canary_rate]);
  let lo = Math.max(0, Math.min(...ys) - 0.03);
  let hi = Math.min(1, Math.max(...ys) + 0.03);
  const { step } = niceTicks(lo, hi, 4);
  lo = Math.max(0, Math.floor(lo / step) * step);
  hi = Math.min(1, Math.ceil(hi / step) * step);
  if (!(hi > lo)) { lo = 0; hi = 1; }
  const last = pts[pts.length - 1];
  const title = `Accept rate over time: canary ${pct(last.canary_rate)}, stable ${pct(last.stable_rate)} at the latest point`;
  const { root, X, Y } = frame(widthOf("rate-chart"), 180, pts.map((p) => p.t), [lo, hi], niceTicks(lo, hi, 4).ticks,
    (t) => `${Math.round(t * 100)}%`, title);
  for (const [key, cls] of [["stable_rate", "stable"], ["canary_rate", "canary"]]) {
    root.append(svg("path", { d: linePath(pts.map((p) => [p.t, p[key]]), X, Y), class: `line ${cls}` }));
    root.append(svg("circle", { cx: X(last.t), cy: Y(last[key]), r: 3, class: `dot ${cls}` }));
  }
  const legend = el("div", { class: "legend" },
    el("span", { class: "key canary" }, `canary ${pct(last.canary_rate)}`),
    el("span", { class: "key stable" }, `stable ${pct(last.stable_rate)}`),
    el("span", { class: "muted" }, `outcomes: ${a.canary ? a.canary.outcomes : "?"} canary, ${a.stable ? a.stable.outcomes : "?"} stable`));
  return el("div", {}, root, legend);
}

function bandChart(h, a) {
  const pts = h.filter((p) => typeof p.band_lo === "number" && typeof p.band_hi === "number");
  if (!pts.length) return noData("No band history yet.");
  const band = a.band || [pts[pts.length - 1].band_lo, pts[pts.length - 1].band_hi];
  const title = `Always-valid band of the canary's win share: ${num(band[0], 2)} to ${num(band[1], 2)}; 0.5 means no difference`;
  const w = widthOf("band-chart");
  const { root, X, Y } = frame(w, 150, pts.map((p) => p.t), [0, 1], [0, 0.25, 0.5, 0.75, 1], (t) => t.toFixed(2), title);
  const upper = pts.map((p) => [p.t, p.band_hi]);
  const lower = pts.map((p) => [p.t, p.band_lo]).reverse();
  if (pts.length === 1) {  // one point: a bar, so it still shows
    const x = X(pts[0].t);
    root.append(svg("rect", { x: x - 3, y: Y(pts[0].band_hi), width: 6, height: Y(pts[0].band_lo) - Y(pts[0].band_hi), class: "band" }));
  } else {
    root.append(svg("path", { d: `${linePath(upper, X, Y)}L${linePath(lower, X, Y).slice(1)}Z`, class: "band" }));
  }
  root.append(svg("path", { d: linePath(upper, X, Y), class: "band-edge" }));
  root.append(svg("path", { d: linePath(pts.map((p) => [p.t, p.band_lo]), X, Y), class: "band-edge" }));
  const [x0, x1] = [X(Math.min(...pts.map((p) => p.t))), X(Math.max(...pts.map((p) => p.t)))];
  root.append(svg("line", { x1: Math.min(x0, 42), x2: Math.max(x1, w - 10), y1: Y(0.5), y2: Y(0.5), class: "ref" }));
  root.append(svg("text", { x: 48, y: Y(0.5) - 4, class: "tick ref-label" }, "0.5 = no difference"));
  const side = band[0] > 0.5 ? "above 0.5: canary accepted more often"
    : band[1] < 0.5 ? "below 0.5: canary accepted less often" : "0.5 is inside the band";
  const legend = el("div", { class: "legend" },
    el("span", { class: "key band" }, `band ${num(band[0], 3)} – ${num(band[1], 3)}`),
    el("span", { class: "muted" }, side));
  return el("div", {}, root, legend);
}

// -- actions ------------------------------------------------------------------------------------------

function showMessage(kind, text) {
  const node = $("action-msg");
  node.className = `msg msg-${kind}`;
  node.textContent = text;
  node.hidden = false;
}

function hideMessage() {
  $("action-msg").hidden = true;
}

async function act(kind) {
  const v = ui.focus;
  if (v === null) return;
  const label = kind === "approve" ? "Approve" : "Reject";
  const reason = $("reason").value.trim();
  ui.selected = v;  // keep showing it (and this message) once it is no longer the live canary
  for (const id of ["approve", "reject"]) $(id).disabled = true;
  showMessage("pending", `${kind === "approve" ? "Approving" : "Rejecting"} v${v}…`);
  try {
    await api(`api/candidates/${encodeURIComponent(v)}/${kind}`, {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ reason }),
    });
    showMessage("ok", `v${v} ${kind === "approve" ? "approved" : "rejected"}.`);
    $("reason").value = "";
  } catch (err) {
    showMessage("error", explain(err, `${label} v${v}`));
  } finally {
    for (const id of ["approve", "reject"]) $(id).disabled = false;
    ui.drawn = {};
    poll();
  }
}

/** The first click of Undo: check the form, then ask to confirm, saying what will happen. */
function askUndo() {
  const raw = $("undo-to").value.trim();
  const reason = $("undo-reason").value.trim();
  $("undo-confirm").hidden = true;
  if (!/^[0-9]{1,18}$/.test(raw)) {
    undoMessage("error", "Give the number of the version stable goes back to (for v3, 3).");
    return;
  }
  if (!reason) {
    undoMessage("error", "Give a reason for the audit log.");
    return;
  }
  ui.undoTo = Number(raw);
  $("undo-msg").hidden = true;
  const stable = ui.stable === null ? "" : ` from v${ui.stable}`;
  $("undo-question").textContent = `Every user goes back${stable} to v${ui.undoTo}, once it is verified again.`;
  $("undo-yes").textContent = `Confirm: stable back to v${ui.undoTo}`;
  $("undo-confirm").hidden = false;
  $("undo-yes").focus();
}

async function undo() {
  const v = ui.undoTo;
  if (v === null) return;
  const reason = $("undo-reason").value.trim();
  for (const id of ["undo-yes", "undo-no", "undo-ask"]) $(id).disabled = true;
  undoMessage("pending", `Verifying v${v} and sending stable back to it…`);
  try {
    const done = await api("api/undo", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ to: v, reason }),
    });
    const rev = done && done.revision && done.revision.revision;
    undoMessage("ok", `Stable is v${v} again${rev === undefined ? "" : ` (revision ${rev})`}.`);
    $("undo-reason").value = "";
    $("undo-to").value = "";
  } catch (err) {
    undoMessage("error", explain(err, `Undo to v${v}`));
  } finally {
    for (const id of ["undo-yes", "undo-no", "undo-ask"]) $(id).disabled = false;
    $("undo-confirm").hidden = true;
    ui.undoTo = null;
    ui.drawn = {};
    poll();
  }
}

function undoMessage(kind, text) {
  const node = $("undo-msg");
  node.className = `msg msg-${kind}`;
  node.textContent = text;
  node.hidden = false;
}

// -- the token ------------------------------------------------------------------------------------------

function useToken(value) {
  clearTimeout(ui.timer);
  ui.drawn = {};
  hideMessage();
  $("undo-msg").hidden = true;
  $("undo-confirm").hidden = true;
  ui.undoTo = null;
  if (value) {
    sessionStorage.setItem(TOKEN_KEY, value);
    setConn("pending", "Connecting…");
    poll();
  } else {
    sessionStorage.removeItem(TOKEN_KEY);
    $("token").value = "";
    $("main").hidden = true;
    $("intro").hidden = false;
    fill("status", []);
    setConn("idle", "Not connected: enter a token.");
  }
}

function start() {
  $("token-form").addEventListener("submit", (ev) => { ev.preventDefault(); useToken($("token").value.trim()); });
  $("token-forget").addEventListener("click", () => useToken(""));
  $("follow-live").addEventListener("click", () => { ui.selected = null; poll(); });
  // Once a person starts writing a reason, the panel stays on that version: a new canary going
  // live meanwhile must not put another version under their Approve button.
  $("reason").addEventListener("input", () => { if (ui.focus !== null) ui.selected = ui.focus; });
  $("approve").addEventListener("click", () => act("approve"));
  $("reject").addEventListener("click", () => act("reject"));
  $("undo").addEventListener("submit", (ev) => { ev.preventDefault(); askUndo(); });
  $("undo-yes").addEventListener("click", undo);
  $("undo-no").addEventListener("click", () => { $("undo-confirm").hidden = true; ui.undoTo = null; $("undo-to").focus(); });
  // a changed version or reason must be confirmed again
  for (const id of ["undo-to", "undo-reason"]) {
    $(id).addEventListener("input", () => { $("undo-confirm").hidden = true; ui.undoTo = null; });
  }
  // Charts are drawn to their box's width: draw them again when it changes.
  let resized = null;
  window.addEventListener("resize", () => {
    clearTimeout(resized);
    resized = setTimeout(() => { ui.drawn.detail = null; if (token()) poll(); }, 150);
  });
  if (token()) {
    $("token").value = token();
    useToken(token());
  }
}

document.addEventListener("DOMContentLoaded", start);
