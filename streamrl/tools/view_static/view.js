// StreamRL view: the run at a glance, a sample browser, one sample's tokens coloured by policy version.
// Served by `streamrl view` (data from /api/*, with the URL's token) or inlined in a static report
// (`--html`: data embedded in #embedded). Every value from the pool is set as text, never as HTML.
"use strict";

const EMBEDDED = JSON.parse(document.getElementById("embedded").textContent);
const QUERY = new URLSearchParams(location.search);
const TOKEN = QUERY.get("token") || "";
const START_STEP = QUERY.get("as_of_step");  // `streamrl view --as-of-step N` opens the page there
const state = { asOf: START_STEP && !EMBEDDED ? Number(START_STEP) : null, offset: 0, limit: 50, xaxis: "step", summary: null };

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (k === "style") e.style.cssText = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c instanceof Node ? c : String(c));
  return e;
}

function fmt(v, digits = 3) {
  if (v === null || v === undefined) return "-";
  if (typeof v === "number" && !Number.isInteger(v)) return v.toFixed(digits);
  return String(v);
}

// Policy version -> colour: hues spread by the golden angle, so neighbouring versions differ.
function versionColour(v) {
  if (v === null || v === undefined) return "#ddd";
  return `hsl(${Math.round((v * 137.508) % 360)}, 75%, 82%)`;
}

// ------------------------------------------------------------------ data: the server, or the embedded report

async function api(name, params) {
  if (EMBEDDED) return fromReport(name, params);
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) if (v !== null && v !== undefined && v !== "") q.set(k, v);
  if (state.asOf !== null) q.set("as_of_step", state.asOf);
  const r = await fetch(`api/${name}?${q}`, { headers: { Authorization: `Bearer ${TOKEN}` } });
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || `HTTP ${r.status}`);
  return body;
}

function fromReport(name, p) {
  const R = EMBEDDED;
  if (name === "summary") return R.summary;
  if (name === "samples") {
    const num = (x) => (x === undefined || x === null || x === "" ? null : Number(x));
    const [step, version, rmin, rmax] = [num(p.step), num(p.version), num(p.reward_min), num(p.reward_max)];
    const rows = R.rows.filter((r) => (step === null || r.consumed_step === step)
      && (version === null || (r.min_version <= version && r.max_version >= version))
      && (rmin === null || (r.reward !== null && r.reward >= rmin)) && (rmax === null || (r.reward !== null && r.reward <= rmax)));
    return { total: rows.length, offset: p.offset, limit: p.limit, rows: rows.slice(p.offset, p.offset + p.limit) };
  }
  if (name === "group") return R.groups[p.group_id] || Promise.reject(new Error("this group is not in the report"));
  if (name === "sample") {
    const gid = p.uid.slice(0, p.uid.lastIndexOf("/"));
    const g = R.groups[gid];
    const s = g && g.samples.find((x) => x.uid === p.uid);
    return s || Promise.reject(new Error("this sample is not in the report"));
  }
  if (name === "prompt") return R.prompts[p.prompt_id] || Promise.reject(new Error("this prompt is not in the report"));
  throw new Error(name);
}

// ------------------------------------------------------------------ tabs and the as-of selector

function show(tab) {
  for (const b of document.querySelectorAll("nav .tab")) b.classList.toggle("on", b.dataset.tab === tab);
  for (const s of document.querySelectorAll(".pane")) s.classList.toggle("on", s.id === tab);
}

for (const b of document.querySelectorAll("nav .tab")) b.addEventListener("click", () => show(b.dataset.tab));

$("asof").addEventListener("submit", (e) => {
  e.preventDefault();
  const v = $("asof-step").value;
  state.asOf = v === "" ? null : Number(v);
  state.offset = 0;
  loadSummary();
  loadRows();
});

// ------------------------------------------------------------------ the run at a glance

function lineChart(title, series, xkey) {
  // series: [{name, points: [[x, y]], colour}]
  const W = 420, H = 180, L = 44, B = 22, T = 8, Rm = 8;
  const pts = series.flatMap((s) => s.points).filter((p) => p[0] !== null && p[1] !== null);
  const box = el("div", { class: "chart" }, el("h3", {}, title));
  if (!pts.length) { box.append(el("div", { class: "muted" }, "no data")); return box; }
  const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) x1 = x0 + 1;
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - Rm), Y = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - B - T);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const add = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.append(e);
  };
  add("line", { x1: L, y1: H - B, x2: W - Rm, y2: H - B, stroke: "#99a" });
  add("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#99a" });
  for (const [v, y] of [[y0, H - B], [y1, T + 8]]) add("text", { x: L - 4, y, "text-anchor": "end", "font-size": 10 }, fmt(v, 2));
  add("text", { x: L, y: H - 6, "font-size": 10 }, fmt(x0, 0));
  add("text", { x: W - Rm, y: H - 6, "text-anchor": "end", "font-size": 10 }, `${fmt(x1, 0)} ${xkey === "step" ? "step" : "s"}`);
  series.forEach((s, i) => {
    const p = s.points.filter((q) => q[0] !== null && q[1] !== null);
    if (!p.length) return;
    add("polyline", { points: p.map((q) => `${X(q[0])},${Y(q[1])}`).join(" "), fill: "none", stroke: s.colour, "stroke-width": 1.5 });
    add("text", { x: W - Rm, y: T + 10 + 12 * i, "text-anchor": "end", "font-size": 10, fill: s.colour }, s.name);
  });
  box.append(svg);
  return box;
}

function renderOverview() {
  const s = state.summary;
  $("uri").textContent = s.uri + (s.as_of ? ` — ${s.as_of.label}` : "");
  $("asof-label").textContent = s.steps_recorded ? `steps ${s.steps_recorded.first}..${s.steps_recorded.last}` : "";
  const cards = $("cards");
  cards.replaceChildren();
  const led = s.ledger;
  for (const [k, v] of [["rows", s.rows], ["groups", s.groups], ["versions", `${fmt(s.vmin)}..${fmt(s.vmax)}`],
    ["steps", s.per_step.length], ["ledger", led.balanced ? "balanced" : "NOT balanced"]]) {
    cards.append(el("div", { class: "card" }, k, el("b", {}, v)));
  }
  const x = state.xaxis;
  const pick = (rows, key) => rows.map((r) => [r[x], r[key]]);
  const charts = $("charts");
  charts.replaceChildren(
    lineChart("reward (mean over the step's samples)", [{ name: "pool", points: pick(s.per_step, "reward_mean"), colour: "#2a7" }], x),
    lineChart("response length (tokens)", [{ name: "mean", points: pick(s.per_step, "length_mean"), colour: "#37c" }], x),
    lineChart("staleness at consumption (versions)", [
      { name: "mean", points: pick(s.per_step, "staleness_mean"), colour: "#c63" },
      { name: "max", points: pick(s.per_step, "staleness_max"), colour: "#a3a" }], x),
    lineChart("held-out accuracy", [
      { name: "sampled", points: pick(s.evals, "accuracy"), colour: "#2a7" },
      { name: "greedy", points: pick(s.evals, "greedy_accuracy"), colour: "#37c" }], x),
  );
  const t = $("ledger");
  t.replaceChildren();
  const keys = ["admitted", "in_flight", "partial", "complete", "consumed", "dropped", "failed", "lost", "duplicated", "unadmitted"];
  t.append(el("tr", {}, ...keys.map((k) => el("th", {}, k))), el("tr", {}, ...keys.map((k) => el("td", {}, fmt(led[k])))));
}

for (const r of document.querySelectorAll("input[name=xaxis]")) {
  r.addEventListener("change", () => { state.xaxis = r.value; renderOverview(); });
}

async function loadSummary() {
  try {
    state.summary = await api("summary");
    renderOverview();
  } catch (e) {
    $("cards").replaceChildren(el("div", { class: "error" }, e.message));
  }
}

// ------------------------------------------------------------------ the sample browser

function filterParams() {
  return { where: $("f-where").value, step: $("f-step").value, version: $("f-version").value,
    reward_min: $("f-rmin").value, reward_max: $("f-rmax").value, offset: state.offset, limit: state.limit };
}

const COLUMNS = [["uid", "sample"], ["consumed_step", "step"], ["min_version", "min v"], ["max_version", "max v"],
  ["reward", "reward"], ["num_tokens", "tokens"], ["status", "status"], ["finish_reason", "finish"]];

async function loadRows() {
  $("f-error").textContent = "";
  let page;
  try {
    page = await api("samples", filterParams());
  } catch (e) {
    $("f-error").textContent = e.message;
    $("rows").replaceChildren();
    $("f-count").textContent = "";
    return;
  }
  const end = page.offset + page.rows.length;
  $("f-count").textContent = `${page.total} samples; ${page.rows.length ? page.offset + 1 : 0}-${end} shown`;
  $("prev").disabled = page.offset === 0;
  $("next").disabled = end >= page.total;
  const body = el("tbody");
  for (const r of page.rows) {
    body.append(el("tr", { "data-uid": r.uid, onclick: () => openSample(r.uid) }, ...COLUMNS.map(([k]) => el("td", {}, fmt(r[k])))));
  }
  $("rows").replaceChildren(el("thead", {}, el("tr", {}, ...COLUMNS.map(([, h]) => el("th", {}, h)))), body);
}

$("filter").addEventListener("submit", (e) => { e.preventDefault(); state.offset = 0; loadRows(); });
$("prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - state.limit); loadRows(); });
$("next").addEventListener("click", () => { state.offset += state.limit; loadRows(); });

// ------------------------------------------------------------------ one sample

const tip = $("tip");

function tokens(d, compact) {
  // The response split into model turns (trained on) and environment/tool output (loss mask 0).
  const box = el("div", { class: "tokens" });
  const t = d.tokens;
  const agent = d.turns !== null && d.turns !== undefined;
  for (const seg of d.segments) {
    const label = seg.kind === "model" ? (agent ? "model turn" : "response") : (agent ? "tool / environment output (not trained on)" : "not trained on (loss mask 0)");
    const part = el("span", { class: `seg ${seg.kind}` });
    if (!compact || d.segments.length > 1) part.append(el("span", { class: "seg-label" }, label));
    for (let i = seg.start; i < seg.end; i++) {
      const span = el("span", { class: "tok" + (t.mask[i] ? "" : " masked"), "data-version": t.version[i] ?? "",
        "data-i": i, style: `background:${versionColour(t.version[i])}` }, t.text[i]);
      span.addEventListener("mouseenter", (e) => {
        tip.textContent = [`token ${i}: id ${t.ids[i]}`, `version   ${fmt(t.version[i])}`,
          `log-prob  ${fmt(t.logprob[i], 4)} (rollout)`,
          `learner   ${t.learner_logprob ? fmt(t.learner_logprob[i], 4) : "not stored"}`,
          `advantage ${fmt(d.advantage, 4)} (${d.advantage_method})`, `loss mask ${t.mask[i]}`].join("\n");
        tip.hidden = false;
        tip.style.left = `${e.clientX + 12}px`;
        tip.style.top = `${e.clientY + 12}px`;
      });
      span.addEventListener("mouseleave", () => { tip.hidden = true; });
      part.append(span);
    }
    box.append(part);
  }
  return box;
}

function legend(versions) {
  const vs = [...new Set(versions.filter((v) => v !== null))].sort((a, b) => a - b);
  return el("div", { class: "legend" }, "policy versions: ", ...vs.map((v) => el("span", { style: `background:${versionColour(v)}` }, `v${v}`)));
}

function meta(pairs) {
  const dl = el("dl", { class: "meta" });
  for (const [k, v] of pairs) dl.append(el("dt", {}, k), el("dd", {}, typeof v === "object" && v !== null ? JSON.stringify(v) : fmt(v, 4)));
  return dl;
}

function renderSample(d) {
  const pane = $("detail");
  pane.replaceChildren(
    el("h2", {}, `sample ${d.uid}`),
    el("div", { class: "links" },
      el("button", { id: "open-group", onclick: () => openGroup(d.group_id) }, `group side by side (${d.group_id})`),
      el("button", { id: "open-prompt", onclick: () => openPrompt(d.prompt_id) }, `prompt ${d.prompt_id} across versions`)),
    meta([["reward", d.reward], ["reward components", d.rewards], ["advantage", d.advantage], ["status", d.status],
      ["trained by step", d.consumed_step], ["learner version", d.consumed_version], ["versions", `${fmt(d.min_version)}..${fmt(d.max_version)}`],
      ["finish", d.finish_reason], ["agent turns / tool calls", d.turns === null || d.turns === undefined ? "-" : `${d.turns} / ${fmt(d.tool_calls)}`],
      ["error", d.error], ["producer", d.producer_id], ["metadata", d.metadata]]),
    el("h3", {}, "prompt"), el("div", { class: "tokens" }, d.prompt.text.join("")),
    el("h3", {}, "response"), legend(d.tokens.version), tokens(d, false));
}

async function openSample(uid) {
  try {
    renderSample(await api("sample", { uid }));
  } catch (e) {
    $("detail").replaceChildren(el("div", { class: "error" }, e.message));
  }
  $("detail-tab").disabled = false;
  show("detail");
}

async function openGroup(gid) {
  try {
    const g = await api("group", { group_id: gid });
    $("detail").replaceChildren(el("h2", {}, `group ${g.group_id} (prompt ${g.prompt_id}, ${g.status})`),
      el("div", { class: "tokens" }, g.samples.length ? g.samples[0].prompt.text.join("") : ""),
      legend(g.samples.flatMap((s) => s.tokens.version)),
      el("div", { class: "side" }, ...g.samples.map((s) => el("div", {},
        el("b", {}, `#${s.index} reward ${fmt(s.reward)} adv ${fmt(s.advantage)}`),
        el("div", { class: "muted" }, `${s.tokens.ids.length} tokens, ${s.finish_reason || "-"}`), tokens(s, true)))));
  } catch (e) {
    $("detail").replaceChildren(el("div", { class: "error" }, e.message));
  }
  show("detail");
}

async function openPrompt(pid) {
  try {
    const p = await api("prompt", { prompt_id: pid });
    const rows = p.groups.map((g) => el("tr", { onclick: () => openGroup(g.group_id) },
      el("td", {}, g.group_id), el("td", {}, `${fmt(g.min_version)}..${fmt(g.max_version)}`), el("td", {}, fmt(g.consumed_step)),
      el("td", {}, g.status), el("td", {}, fmt(g.reward_mean)), el("td", { class: "tokens" }, g.best ? g.best.text : "-")));
    $("detail").replaceChildren(el("h2", {}, `prompt ${p.prompt_id} across versions`),
      el("table", {}, el("tr", {}, ...["group", "versions", "step", "status", "mean reward", "best answer"].map((h) => el("th", {}, h))), ...rows));
  } catch (e) {
    $("detail").replaceChildren(el("div", { class: "error" }, e.message));
  }
  show("detail");
}

// ------------------------------------------------------------------ start

if (state.asOf !== null) $("asof-step").value = state.asOf;
if (EMBEDDED) {
  $("f-where").value = EMBEDDED.where || "";
  $("f-where").disabled = true;
  $("f-where").title = "a static report holds the samples this filter selected when it was written";
  $("asof").hidden = true;
}
// Both at once: the sample list does not wait for the summary's ledger.
loadSummary();
loadRows();
