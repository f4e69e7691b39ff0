// tpflex console: the GPU panel, drain / undrain, plan diffs, jobs and pins; loaded after
// console.js.
"use strict";

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
