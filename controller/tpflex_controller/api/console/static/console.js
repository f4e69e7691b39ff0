// tpflex operator console: plain JavaScript, no build step, no dependencies.
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
  ui.scope = (await resp.json()).scope;
  sessionStorage.setItem(TOKEN_KEY, token);
  $("login-screen").hidden = true;
  $("console").hidden = false;
  $("signout").hidden = false;
  const badge = $("scope");
  badge.hidden = false;
  badge.textContent = isAdmin() ? "admin" : "read-only";
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

// ---------- the rack map (virtualised: only racks in view are in the DOM) ----------

function layout() {
  const maxGpus = Math.max(1, ...ui.racks.map((r) => r.s.length));
  ui.cols = Math.min(12, maxGpus);
  const rows = Math.ceil(maxGpus / ui.cols);
  ui.cardW = Math.max(124, ui.cols * CELL + 14);
  ui.cardH = rows * CELL + 46;
}

function applyFilter() {
  const mode = $("filter").value;
  const q = $("search").value.trim().toLowerCase();
  ui.shown = ui.racks.filter((r) => (mode !== "problems" || r.problem) && (!q || r.name.toLowerCase().includes(q)));
  $("shown").textContent = `${ui.shown.length} of ${ui.racks.length} racks shown`;
  for (const card of ui.rendered.values()) card.remove();
  ui.rendered.clear();
  drawWindow();
}

function drawWindow() {
  const map = $("map");
  ui.perRow = Math.max(1, Math.floor((map.clientWidth - GAP) / (ui.cardW + GAP)));
  const rows = Math.ceil(ui.shown.length / ui.perRow);
  $("map-inner").style.height = `${rows * (ui.cardH + GAP) + GAP}px`;
  const first = Math.max(0, Math.floor(map.scrollTop / (ui.cardH + GAP)) - 1);
  const last = Math.min(rows - 1, Math.ceil((map.scrollTop + map.clientHeight) / (ui.cardH + GAP)) + 1);
  const want = new Set();
  for (let row = first; row <= last; row++) {
    for (let col = 0; col < ui.perRow; col++) {
      const rack = ui.shown[row * ui.perRow + col];
      if (!rack) break;
      want.add(rack.name);
      if (!ui.rendered.has(rack.name)) {
        const card = rackCard(rack);
        card.style.top = `${GAP + row * (ui.cardH + GAP)}px`;
        card.style.left = `${GAP + col * (ui.cardW + GAP)}px`;
        $("map-inner").append(card);
        ui.rendered.set(rack.name, card);
      }
    }
  }
  for (const [name, card] of ui.rendered) {
    if (!want.has(name) && !card.contains(document.activeElement)) { card.remove(); ui.rendered.delete(name); }
  }
}

function rackCounts(r) {
  const n = { h: 0, g: 0, f: 0, d: 0 };
  for (const c of r.s) n[c]++;
  const parts = [`${n.h + n.g}/${r.s.length} usable`];
  for (const c of "fdg") if (n[c]) parts.push(`${n[c]} ${STATES[c]}`);
  if (r.boosted) parts.push(`${r.boosted} boosted`);
  return parts.join(", ");
}

function cellLabel(r, i) {
  const node = r.nodes[Math.floor(i / r.gpn)], idx = i % r.gpn;
  const cap = r.caps[i] !== undefined ? r.caps[i] : r.tdp;
  const boost = cap > r.tdp ? `, boosted ${((cap / r.tdp - 1) * 100).toFixed(0)}% over TDP` : "";
  return `${node} GPU ${idx}: ${STATES[r.s[i]]}, cap ${watts(cap)}${boost}`;
}

function cellClass(r, i) {
  const cap = r.caps[i];
  // boosted colours a healthy GPU; a degraded one stays amber (its label says boosted)
  return `cell s-${r.s[i]}${cap !== undefined && cap > r.tdp && r.s[i] === "h" ? " boost" : ""}`;
}

function rackCard(r) {
  const id = `rack-${CSS.escape(r.name)}`;
  const grid = el("div", { class: "cells", role: "grid", "aria-label": `GPUs of rack ${r.name}` });
  grid.style.gridTemplateColumns = `repeat(${ui.cols}, 12px)`;
  let first = true;
  for (let n = 0; n < r.nodes.length; n++) {
    const row = el("div", { role: "row", "aria-label": r.nodes[n] });
    for (let g = 0; g < r.gpn; g++) {
      const i = n * r.gpn + g;
      row.append(el("div", {
        class: cellClass(r, i), role: "gridcell", tabindex: first ? "0" : "-1",
        "data-i": i, "data-gpu": `${r.nodes[n]}:${g}`, "data-state": STATES[r.s[i]], "aria-label": cellLabel(r, i),
      }));
      first = false;
    }
    grid.append(row);
  }
  const card = el("div", { class: "rack" + (r.problem ? " problem" : ""), role: "group", "aria-labelledby": id, "data-rack": r.name },
    el("h3", { id, text: r.name }), el("div", { class: "rc", text: rackCounts(r) }), grid);
  card.style.width = `${ui.cardW}px`;
  card.style.height = `${ui.cardH}px`;
  if (ui.selected && ui.selected.rack === r.name) markSelected(card);
  return card;
}

function updateCard(old, r) {
  const card = ui.rendered.get(r.name);
  if (!card) return;
  if (!old || old.s.length !== r.s.length || old.nodes.join() !== r.nodes.join()) {
    const fresh = rackCard(r);
    fresh.style.top = card.style.top; fresh.style.left = card.style.left;
    card.replaceWith(fresh); ui.rendered.set(r.name, fresh);
    return;
  }
  card.className = "rack" + (r.problem ? " problem" : "");
  card.querySelector(".rc").textContent = rackCounts(r);
  const now = Date.now();
  for (const cell of card.querySelectorAll(".cell")) {
    const i = Number(cell.dataset.i);
    const cls = cellClass(r, i);
    if (cell.dataset.state !== STATES[r.s[i]] || !cell.className.startsWith(cls)) {
      const changed = cell.dataset.state !== STATES[r.s[i]];
      cell.className = cls;
      cell.dataset.state = STATES[r.s[i]];
      cell.setAttribute("aria-label", cellLabel(r, i));
      if (changed) noteChange(cell.dataset.gpu, cell.dataset.state, now);
    }
  }
  if (ui.selected && ui.selected.rack === r.name) markSelected(card);
}

function noteChange(gpu, state, at) {
  // when the frame that shows the new colour is produced (read by bench/ui.py)
  requestAnimationFrame(() => { ui.cellChanged[gpu] = { state, at, painted: Date.now() }; });
}

function markSelected(card) {
  for (const c of card.querySelectorAll(".cell.sel")) c.classList.remove("sel");
  if (!ui.selected || card.dataset.rack !== ui.selected.rack) return;
  const cell = card.querySelector(`.cell[data-i="${ui.selected.i}"]`);
  if (cell) cell.classList.add("sel");
}

function cellOf(target) { return target && target.classList && target.classList.contains("cell") && target.closest(".rack") ? target : null; }

function showTip(cell) {
  const r = ui.byName.get(cell.closest(".rack").dataset.rack);
  if (!r) return;
  const tip = $("tip");
  tip.textContent = cellLabel(r, Number(cell.dataset.i));
  tip.hidden = false;
  const box = cell.getBoundingClientRect();
  tip.style.left = `${Math.min(box.left, window.innerWidth - 320)}px`;
  tip.style.top = `${box.bottom + 6}px`;
  cell.setAttribute("aria-describedby", "tip");
}
function hideTip() { $("tip").hidden = true; }

function moveFocus(cell, key) {
  const cells = [...cell.closest(".cells").querySelectorAll(".cell")];
  const i = cells.indexOf(cell);
  const step = { ArrowRight: 1, ArrowLeft: -1, ArrowDown: ui.cols, ArrowUp: -ui.cols }[key];
  let j = key === "Home" ? 0 : key === "End" ? cells.length - 1 : i + step;
  if (j < 0 || j >= cells.length) return;
  cell.tabIndex = -1; cells[j].tabIndex = 0; cells[j].focus();
}

function selectCell(cell) {
  const rack = cell.closest(".rack").dataset.rack;
  ui.selected = { rack, i: Number(cell.dataset.i) };
  for (const card of ui.rendered.values()) markSelected(card);
  renderGpuPanel(true);
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

// ---------- GPU panel and drain / undrain ----------

function selectedGpu() {
  const r = ui.byName.get(ui.selected.rack);
  if (!r || ui.selected.i >= r.s.length) return null;
  const i = ui.selected.i;
  return { r, i, node: r.nodes[Math.floor(i / r.gpn)], index: i % r.gpn, state: STATES[r.s[i]],
    cap: r.caps[i] !== undefined ? r.caps[i] : r.tdp };
}

function renderGpuPanel(fresh) {
  const g = selectedGpu();
  const panel = $("gpu-panel");
  if (!g) { panel.hidden = true; return; }
  panel.hidden = false;
  $("gpu-title").textContent = `GPU ${g.node}:${g.index}`;
  const facts = [["rack", g.r.name], ["state", g.state], ["power cap", watts(g.cap)], ["rack TDP", watts(g.r.tdp)]];
  $("gpu-facts").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v, "data-fact": k })]));
  const actionsKey = `${g.node}:${g.index}:${g.state}`;
  if (fresh || ui.actionsKey !== actionsKey) {  // drained <-> not drained: other actions
    ui.actionsKey = actionsKey;
    $("gpu-actions").replaceChildren(...gpuActions(g));
  }
  if (fresh) {
    $("gpu-preview").replaceChildren();
    api("GET", `/v1/nodes/${encodeURIComponent(g.node)}/gpus/${g.index}`).then((d) => {
      if (d.reason) $("gpu-facts").append(el("dt", { text: "reason" }), el("dd", { text: d.reason }));
    }).catch(() => {});
    panel.scrollIntoView({ block: "nearest" });
  }
}

function gpuActions(g) {
  if (!isAdmin()) return [];
  if (g.state === "drained") {
    return [el("div", { class: "row" }, el("button", { type: "button", class: "primary", "data-action": "undrain",
      onclick: () => commitUndrain(g) }, "Undrain this GPU"))];
  }
  const reason = el("input", { id: "drain-reason", type: "text", required: true, maxlength: "500", placeholder: "why (required)" });
  return [el("div", { class: "row" }, el("label", { for: "drain-reason", text: "Drain reason" }), reason,
    el("button", { type: "button", "data-action": "preview-drain", onclick: () => previewDrain(g, reason) }, "Preview drain"))];
}

async function previewDrain(g, reasonInput) {
  const out = $("gpu-preview");
  if (!reasonInput.value.trim()) { out.replaceChildren(el("p", { class: "error", role: "alert", text: "Give a reason for the drain." })); reasonInput.focus(); return; }
  const jobs = ui.jobs.filter((j) => j.replicas.some((r) => r.racks.includes(g.r.name)));
  out.replaceChildren(el("p", { text: "Planning (dry run)…" }));
  try {
    const results = await Promise.all(jobs.map((j) => api("POST", `/v1/jobs/${encodeURIComponent(j.name)}/dry-run`, { fail: [{ node: g.node, index: g.index }] })));
    const commit = el("button", { type: "button", class: "danger", "data-action": "commit-drain",
      onclick: () => commitDrain(g, reasonInput.value.trim()) }, "Commit drain");
    const cancel = el("button", { type: "button", onclick: () => out.replaceChildren() }, "Cancel");
    const diffs = results.length ? results.map(diffView) : [el("p", { text: "No job uses this rack: no plan changes." })];
    out.replaceChildren(...diffs, el("div", { class: "row" }, commit, cancel));
    commit.focus();
  } catch (err) { out.replaceChildren(el("p", { class: "error", role: "alert", text: err.message })); }
}

async function commitDrain(g, reason) {
  const out = $("gpu-preview");
  try {
    const before = generations();
    await api("POST", `/v1/nodes/${encodeURIComponent(g.node)}/gpus/${g.index}/drain`, { reason });
    awaitPlan(out, `Drain of ${g.node}:${g.index} stored`, before);
  } catch (err) { out.replaceChildren(el("p", { class: "error", role: "alert", text: err.message })); }
}

async function commitUndrain(g) {
  const out = $("gpu-preview");
  try {
    const before = generations();
    await api("POST", `/v1/nodes/${encodeURIComponent(g.node)}/gpus/${g.index}/undrain`);
    awaitPlan(out, `Undrain of ${g.node}:${g.index} stored`, before);
  } catch (err) { out.replaceChildren(el("p", { class: "error", role: "alert", text: err.message })); }
}

const generations = () => new Map(ui.jobs.map((j) => [j.name, j.generation]));

function awaitPlan(out, what, before) {
  // ``before``: the generations seen before the request (the plan may arrive before its answer)
  out.replaceChildren(el("p", { "data-status": "pending", text: `${what}; waiting for the leader to commit a plan…` }));
  ui.onJobs = () => {
    const moved = ui.jobs.filter((j) => j.generation !== before.get(j.name));
    if (!moved.length) return;
    out.replaceChildren(el("p", { "data-status": "committed",
      text: `${what}; committed: ${moved.map((j) => `${j.name} generation ${j.generation}`).join(", ")}` }));
    ui.onJobs = null;
  };
  ui.onJobs();
}

// ---------- plan diffs ----------

function diffView(result) {
  const lines = [];
  const caps = new Map();
  for (const c of result.changes) {
    if (c.kind === "power_cap") {
      const key = `${c.before === null ? "TDP" : watts(c.before)} → ${c.after === null ? "TDP" : watts(c.after)}`;
      caps.set(key, (caps.get(key) || 0) + 1);
    } else if (c.kind === "replica" && c.field === "gpus") {
      const gone = c.before.filter((x) => !c.after.includes(x)), added = c.after.filter((x) => !c.before.includes(x));
      lines.push(`replica ${c.replica}: GPUs ${gone.length ? "−" + gone.join(", ") : ""}${added.length ? " +" + added.join(", ") : ""}`);
    } else if (c.kind === "replica") {
      lines.push(`replica ${c.replica}: ${c.field.replace("_", " ")} ${c.before} → ${c.after}`);
    } else {
      const show = (v) => (typeof v === "number" ? fmt(v) : v === null ? "none" : v);
      lines.push(`${c.field.replaceAll("_", " ")} ${show(c.before)} → ${show(c.after)}`);
    }
  }
  for (const [k, n] of caps) lines.push(`power cap of ${n} GPU${n > 1 ? "s" : ""}: ${k}`);
  return el("div", { class: "diff", "data-diff": result.job },
    el("strong", { text: `${result.job}: plan diff vs generation ${result.current_generation ?? "none"}` }),
    lines.length ? el("ul", {}, ...lines.map((t) => el("li", { text: t }))) : el("p", { text: "no change" }));
}

// ---------- jobs ----------

// Job cards are kept per job and updated in place (jobs are re-sent on every plan and ack):
// focus, what an admin typed, a preview and a pending commit stay put.
const jobCards = new Map();

function renderJobs() {
  const list = $("job-list");
  const names = new Set(ui.jobs.map((j) => j.name));
  for (const [name, card] of jobCards) if (!names.has(name)) { card.root.remove(); jobCards.delete(name); }
  ui.jobs.forEach((j, i) => {
    let card = jobCards.get(j.name);
    if (!card) { card = jobCard(j); jobCards.set(j.name, card); }
    updateJobCard(card, j);
    if (list.children[i] !== card.root) list.insertBefore(card.root, list.children[i] || null);
  });
  if (ui.onJobs) ui.onJobs();
}

function jobCard(j) {
  const facts = el("dl", { class: "facts" });
  const replicas = el("div");
  const root = el("article", { class: "job", "aria-labelledby": `job-${j.name}`, "data-job": j.name },
    el("h3", { id: `job-${j.name}`, text: `${j.name} (TP ${j.base_tp})` }), facts, replicas);
  if (isAdmin()) root.append(pinFormFor(j));
  return { root, facts, replicas };
}

function updateJobCard(card, j) {
  const gp = j.goodput;
  const facts = [["generation", j.generation ?? "not planned"], ["policy", j.policy],
    ["expected throughput", fmt(j.ratio)],
    ["goodput", gp && gp.ratio !== null ? `${fmt(gp.ratio)} (${fmt(gp.achieved_samples_per_s, 1)} samples/s)` : gp ? `${fmt(gp.achieved_samples_per_s, 1)} samples/s` : "no step reports yet"],
    ["acked", `${j.acked_current} ranks`], ["cause", j.cause || "-"]];
  const pins = Object.entries(j.pins).map(([r, t]) => `replica ${r} → TP ${t}`).join(", ");
  if (pins) facts.push(["pinned", pins]);
  card.facts.replaceChildren(...facts.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: String(v) })]));
  card.replicas.replaceChildren(replicaList(j));
  if (isAdmin()) pinFormFor(j);
}

function replicaList(j) {
  const full = j.replicas.filter((r) => r.state === "healthy" && r.tp === j.base_tp);
  const many = j.replicas.length > 24;
  const shown = many ? j.replicas.filter((r) => !full.includes(r)) : j.replicas;
  const list = el("ul", { class: "replicas", "aria-label": `replicas of ${j.name}` },
    ...shown.map((r) => el("li", { class: r.state, "data-replica": r.index, "data-tp": r.tp,
      title: r.reason, text: `r${r.index} ${r.racks.join("+")} TP ${r.tp} ${r.state}` })));
  if (many) list.append(el("li", { text: `${full.length} more replicas healthy at TP ${j.base_tp}` }));
  return list;
}

// One pin form per job, kept across re-renders (jobs are re-sent on every plan and ack):
// what an admin typed, a preview and a pending commit stay put.
const pinForms = new Map();

function pinFormFor(j) {
  let f = pinForms.get(j.name);
  if (!f) { f = pinForm(j.name); pinForms.set(j.name, f); }
  f.replica.max = String(Math.max(0, j.replicas.length - 1));
  f.degree.max = String(j.base_tp);
  f.clear.hidden = Object.keys(j.pins).length === 0;
  return f.node;
}

function pinForm(name) {
  const rid = `pin-r-${name}`, tid = `pin-t-${name}`;
  const job = () => ui.jobs.find((x) => x.name === name);
  const replica = el("input", { id: rid, type: "number", min: "0", value: "0" });
  const degree = el("input", { id: tid, type: "number", min: "1", value: String(job().base_tp) });
  const out = el("div", { "aria-live": "polite" });
  const path = `/v1/jobs/${encodeURIComponent(name)}`;
  const pin = () => ({ replica: Number(replica.value), tp_degree: Number(degree.value) });
  const fail = (err) => out.replaceChildren(el("p", { class: "error", role: "alert", text: err.message }));
  const commit = async (p) => {
    try {
      const before = generations();
      await api("POST", `${path}/reconfigure`, { pins: [p], reason: "pinned from the console" });
      awaitPlan(out, `Pin of ${name} replica ${p.replica} to TP ${p.tp_degree} stored`, before);
    } catch (err) { fail(err); }
  };
  const preview = async () => {
    const p = pin();
    out.replaceChildren(el("p", { text: "Planning (dry run)…" }));
    try {
      const res = await api("POST", `${path}/dry-run`, { pins: [p] });
      const go = el("button", { type: "button", class: "danger", "data-action": "commit-pin", onclick: () => commit(p) }, "Commit pin");
      out.replaceChildren(diffView(res), el("div", { class: "row" }, go,
        el("button", { type: "button", onclick: () => out.replaceChildren() }, "Cancel")));
      go.focus();
    } catch (err) { fail(err); }
  };
  const clear = el("button", { type: "button", "data-action": "clear-pins", onclick: async () => {
    try {
      const before = generations();
      await api("POST", `${path}/reconfigure`, { clear: true });
      awaitPlan(out, "Pins cleared", before);
    } catch (err) { fail(err); }
  } }, "Clear pins");
  const node = el("div", {}, el("div", { class: "row" },
    el("label", { for: rid, text: "Pin replica" }), replica, el("label", { for: tid, text: "to TP" }), degree,
    el("button", { type: "button", "data-action": "preview-pin", onclick: preview }, "Preview"), clear), out);
  return { node, replica, degree, clear };
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
  const head = `#${e.seq} ${at} ${e.kind}${e.job ? ` ${e.job}` : ""}${e.generation ? ` gen ${e.generation}` : ""}: ${e.cause || "-"}`;
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
