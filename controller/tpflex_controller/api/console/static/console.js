// tpflex operator console: plain JavaScript, no build step, no dependencies. This file:
// state, sign-in, the live stream, summary, events, wiring; console-map.js: the rack map;
// console-actions.js: the GPU panel, drain/undrain, plan diffs, jobs and pins.
// Data: GET /v1/console/stream (server-sent events read with fetch, so that the token
// travels in the Authorization header and never in a URL). Actions: the REST API.
"use strict";

const STATES = { h: "healthy", g: "degraded", f: "failed", d: "drained" };
const CELL = 14; // px per GPU cell (12 + 2 gap)
const GAP = 8;
const TOKEN_KEY = "tpflex-console-token";
const $ = (id) => document.getElementById(id);

const ui = {
  token: null, scope: null, abort: null, retry: 0,
  racks: [], byName: new Map(), jobs: [], events: [], shown: [],
  cols: 12, cardW: 0, cardH: 0, perRow: 1, rendered: new Map(), selected: null,
  firstPaintMs: null, cellChanged: {}, frame: 0,
};
window.tpflexConsole = ui; // read by the browser tests and bench/ui.py

// ---------- helpers ----------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}
const fmt = (x, d = 3) => (x === null || x === undefined ? "-" : Number(x).toFixed(d));
const watts = (w) => `${Math.round(w)} W`;
const isAdmin = () => ui.scope === "admin";

async function api(method, path, body) {
  const headers = { Authorization: `Bearer ${ui.token}`, Accept: "application/json" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const data = await resp.json().catch(() => null);
  if (resp.status === 401) { signOut("The token is no longer accepted; sign in again."); }
  if (!resp.ok) throw new Error((data && data.error && data.error.message) || `HTTP ${resp.status}`);
  return data;
}

// ---------- sign in / out ----------

async function signIn(token) {
  const resp = await fetch("/v1/console/session", { headers: { Authorization: `Bearer ${token}` } });
  if (resp.status === 401) return "This token is not accepted by the controller.";
  if (!resp.ok) return `The controller answered HTTP ${resp.status}; try again.`;
  ui.token = token;
  const session = await resp.json();
  ui.scope = session.scope;
  sessionStorage.setItem(TOKEN_KEY, token);
  $("login-screen").hidden = true;
  $("console").hidden = false;
  $("signout").hidden = false;
  const badge = $("scope");
  badge.hidden = false;
  badge.textContent = `${session.name ? `${session.name}: ` : ""}${isAdmin() ? "admin" : "read-only"}`;
  badge.className = "badge" + (isAdmin() ? " admin" : "");
  connect();
  return null;
}

function signOut(message) {
  if (ui.abort) ui.abort.abort();
  ui.token = null; ui.scope = null;
  sessionStorage.removeItem(TOKEN_KEY);
  ui.racks = []; ui.byName.clear(); ui.jobs = []; ui.events = []; pinForms.clear(); jobCards.clear();
  $("map-inner").replaceChildren(); ui.rendered.clear();
  $("job-list").replaceChildren(); $("event-list").replaceChildren(); $("counts").replaceChildren();
  $("gpu-panel").hidden = true;
  $("console").hidden = true; $("login-screen").hidden = false;
  $("signout").hidden = true; $("scope").hidden = true;
  setConn("signed out", "");
  $("login-error").textContent = message || "";
  $("token").value = "";
  $("token").focus();
}

function setConn(text, cls) { const c = $("conn"); c.textContent = text; c.className = "conn " + cls; }

// ---------- the live stream ----------

async function connect() {
  if (ui.abort) ui.abort.abort();
  const ctl = new AbortController();
  ui.abort = ctl;
  setConn("connecting", "");
  try {
    const resp = await fetch("/v1/console/stream", {
      headers: { Authorization: `Bearer ${ui.token}`, Accept: "text/event-stream" }, signal: ctl.signal,
    });
    if (resp.status === 401) { signOut("This token is not accepted by the controller."); return; }
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    await readStream(resp.body.getReader(), ctl);
  } catch (err) {
    if (ctl.signal.aborted) return;
  }
  if (ctl.signal.aborted || !ui.token) return;
  const delay = Math.min(10000, 500 * 2 ** ui.retry++) * (0.5 + Math.random() / 2);
  setConn(`disconnected; reconnecting in ${(delay / 1000).toFixed(1)} s`, "down");
  setTimeout(() => { if (ui.token && ui.abort === ctl) connect(); }, delay);
}

async function readStream(reader, ctl) {
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done || ctl.signal.aborted) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let name = "message"; const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) name = line.slice(7);
        else if (line.startsWith("data: ")) data.push(line.slice(6));
      }
      if (data.length) onMessage(name, JSON.parse(data.join("\n")));
    }
  }
}

function onMessage(name, data) {
  if (name === "snapshot") onSnapshot(data);
  else if (name === "racks") onRacks(data);
  else if (name === "jobs") { ui.jobs = data; renderJobs(); }
  else if (name === "events") { addEvents(data); }
  else if (name === "leader") renderLeader(data);
  else if (name === "revision") $("revision").textContent = `etcd revision ${data}`;
  else if (name === "error") setConn(`stream error: ${data.message}`, "down");
}

function onSnapshot(snap) {
  ui.retry = 0;
  setConn("live", "live");
  ui.racks = snap.racks.map(prepRack);
  ui.byName = new Map(ui.racks.map((r) => [r.name, r]));
  ui.jobs = snap.jobs;
  ui.events = [];
  $("event-list").replaceChildren();
  addEvents(snap.events);
  renderLeader(snap.leader);
  $("revision").textContent = `etcd revision ${snap.revision}`;
  layout(); applyFilter(); renderSummary(); renderJobs();
  if (ui.selected) renderGpuPanel();
  if (ui.firstPaintMs === null) requestAnimationFrame(() => { ui.firstPaintMs = performance.now(); });
}

function prepRack(r) {
  r.boosted = Object.entries(r.caps).filter(([, w]) => w > r.tdp).length;
  r.problem = r.boosted > 0 || /[gfd]/.test(r.s);
  return r;
}

function onRacks(msg) {
  for (const name of msg.removed) ui.byName.delete(name);
  const changed = [];
  for (const fresh of msg.racks) {
    const old = ui.byName.get(fresh.name);
    prepRack(fresh);
    ui.byName.set(fresh.name, fresh);
    changed.push([old, fresh]);
  }
  const names = [...ui.byName.keys()].sort();
  ui.racks = names.map((n) => ui.byName.get(n));
  const relayout = msg.removed.length || changed.some(([old]) => !old);
  if (relayout) { layout(); applyFilter(); }
  else {
    for (const [old, fresh] of changed) updateCard(old, fresh);
    if ($("filter").value === "problems") applyFilter();
  }
  renderSummary();
  if (ui.selected && ui.byName.has(ui.selected.rack)) renderGpuPanel();
}

// ---------- summary, leader ----------

function renderSummary() {
  const n = { h: 0, g: 0, f: 0, d: 0 };
  let boosted = 0, problems = 0;
  for (const r of ui.racks) {
    for (const c of r.s) n[c]++;
    boosted += r.boosted; problems += r.problem ? 1 : 0;
  }
  const total = n.h + n.g + n.f + n.d;
  const items = [["racks", ui.racks.length], ["racks with problems", problems], ["GPUs", total],
    ["healthy", n.h], ["degraded", n.g], ["failed", n.f], ["drained", n.d], ["boosted", boosted]];
  $("counts").replaceChildren(...items.map(([k, v]) => el("div", {}, el("dt", { text: k }), el("dd", { text: v.toLocaleString(), "data-count": k }))));
}

function renderLeader(leader) {
  $("leader").textContent = leader ? `leader ${leader.id}` : "no leader elected";
}

// ---------- events ----------

function addEvents(events) {
  const list = $("event-list");
  for (const e of events) {
    ui.events.push(e);
    list.prepend(eventItem(e));
  }
  while (list.children.length > 100) list.lastElementChild.remove();
}

function eventItem(e) {
  const at = new Date(e.at * 1000).toLocaleTimeString();
  const detected = (e.phases.find((p) => p.phase === "detected") || {}).at;
  const phases = e.phases.filter((p) => p.phase !== "detected")
    .map((p) => `${p.phase.replace("_", " ")} +${detected ? Math.round((p.at - detected) * 1000) : "?"} ms`).join(", ");
  const head = `#${e.seq} ${at} ${e.kind}${e.job ? ` ${e.job}` : ""}${e.generation ? ` gen ${e.generation}` : ""}: ${e.cause || "-"}${e.by ? ` by ${e.by}` : ""}`;
  return el("li", { "data-seq": e.seq }, el("div", { text: head }),
    phases ? el("div", { class: "muted", text: `timings from detection: ${phases}` }) : null,
    e.reasons.length ? el("ul", { class: "reasons" }, ...e.reasons.map((r) => el("li", { text: r }))) : null);
}

// ---------- wiring ----------

function wire() {
  $("login").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const token = $("token").value.trim();
    $("login-error").textContent = token ? "" : "Paste a token first.";
    if (!token) return;
    const err = await signIn(token).catch(() => "Cannot reach the controller; try again.");
    if (err) { $("login-error").textContent = err; $("token").select(); }
  });
  $("signout").addEventListener("click", () => signOut(""));
  $("filter").addEventListener("change", applyFilter);
  $("search").addEventListener("input", applyFilter);
  const map = $("map");
  map.addEventListener("scroll", () => {
    if (!ui.frame) ui.frame = requestAnimationFrame(() => { ui.frame = 0; drawWindow(); });
  });
  window.addEventListener("resize", () => { if (ui.racks.length) drawWindow(); });
  map.addEventListener("mouseover", (ev) => { const c = cellOf(ev.target); if (c) showTip(c); });
  map.addEventListener("mouseout", (ev) => { if (cellOf(ev.target)) hideTip(); });
  map.addEventListener("focusin", (ev) => { const c = cellOf(ev.target); if (c) showTip(c); });
  map.addEventListener("focusout", hideTip);
  map.addEventListener("click", (ev) => { const c = cellOf(ev.target); if (c) { c.focus(); selectCell(c); } });
  map.addEventListener("keydown", (ev) => {
    const c = cellOf(ev.target);
    if (!c) return;
    if (["ArrowRight", "ArrowLeft", "ArrowUp", "ArrowDown", "Home", "End"].includes(ev.key)) { ev.preventDefault(); moveFocus(c, ev.key); }
    else if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); selectCell(c); }
    else if (ev.key === "Escape") hideTip();
  });
  const saved = sessionStorage.getItem(TOKEN_KEY);
  if (saved) signIn(saved).then((err) => { if (err) signOut(err); }).catch(() => signOut("Cannot reach the controller."));
  else $("token").focus();
}

document.addEventListener("DOMContentLoaded", wire);
