// tpflex console: the rack map (virtualised) and GPU cells; loaded after console.js.
"use strict";

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
