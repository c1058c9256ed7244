// The per-token heatmap: each captured hidden state projected on the vector's unit direction,
// one cell per token the model read, the value on hover and by keyboard.

import { $, apiJson, littleEndian } from "./api.js";

const tokenTexts = new Map();  // token id -> its text, from /detokenize

export function forgetTokens() {
  tokenTexts.clear();
}

// One row of the wire format (float32, as the page asks) per token read, projected on `direction`.
export function projections(wire, direction) {
  if (wire.dtype !== "torch.float32") throw new Error(`capture: expected float32 rows, got ${wire.dtype}`);
  const [rows, width] = wire.shape;
  const values = littleEndian(wire.data, DataView.prototype.getFloat32, 4);
  const tokens = littleEndian(wire.meta.token_ids, DataView.prototype.getInt32, 4);
  const positions = littleEndian(wire.meta.positions, DataView.prototype.getInt32, 4);
  const norm = Math.hypot(...direction) || 1;
  return Array.from({ length: rows }, (_, r) => {
    let dot = 0;
    for (let i = 0; i < width; i++) dot += values[r * width + i] * direction[i];
    return { token: tokens[r], position: positions[r], value: dot / norm };
  });
}

async function loadTokenTexts(ids) {
  const missing = [...new Set(ids)].filter((id) => !tokenTexts.has(id));
  await Promise.all(missing.map(async (id) => {
    tokenTexts.set(id, (await apiJson("POST", "detokenize", { tokens: [id] })).prompt);
  }));
}

// `finals`: the unsteered and the steered final choices, which carry the captures.
export async function drawHeatmaps(finals, direction, site) {
  const rows = finals.map((final) => {
    const layers = final?.captures?.hidden_states;
    if (!layers) throw new Error("capture: the server returned no captured hidden states");
    return projections(Object.values(layers)[0], direction);
  });
  await loadTokenTexts(rows.flat().map((cell) => cell.token));
  // Residual streams share a large offset along most directions: colour around the unsteered mean.
  const centre = rows[0].reduce((sum, cell) => sum + cell.value, 0) / Math.max(1, rows[0].length);
  const spread = Math.max(1e-12, ...rows.flat().map((cell) => Math.abs(cell.value - centre)));
  $("heat-legend").textContent = `${site}. White: the unsteered mean, ${centre.toFixed(3)}; full red or blue: `
    + `${spread.toFixed(3)} above or below it.`;
  drawRow($("heat-base"), rows[0], centre, spread);
  drawRow($("heat-steered"), rows[1], centre, spread);
}

function drawRow(container, cells, centre, spread) {
  container.replaceChildren(...cells.map((cell, i) => {
    const text = tokenTexts.get(cell.token);
    const span = document.createElement("span");
    span.setAttribute("role", "listitem");
    span.textContent = text.replace(/\n/g, "⏎").replace(/\t/g, "⇥") || "∅";
    const label = `${JSON.stringify(text)} at position ${cell.position}: ${cell.value.toFixed(4)}`;
    span.title = label;
    span.setAttribute("aria-label", label);
    const t = (cell.value - centre) / spread;
    span.style.backgroundColor = colour(t);
    span.classList.toggle("light", Math.abs(t) > 0.6);
    span.tabIndex = i === 0 ? 0 : -1;
    return span;
  }));
}

// White at 0, red (+1) or blue (-1) at the ends.
function colour(t) {
  const end = t >= 0 ? [215, 48, 39] : [69, 117, 180];
  const a = Math.min(1, Math.abs(t));
  return `rgb(${end.map((c) => Math.round(255 + (c - 255) * a)).join(", ")})`;
}

// One tab stop per row; arrow keys, Home and End move between its cells; the focused or hovered
// cell's value is read out below the map.
export function wireHeatmapRow(row) {
  row.addEventListener("keydown", (event) => {
    const cells = [...row.children];
    const i = cells.indexOf(document.activeElement);
    const moves = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: cells.length - 1 };
    if (i < 0 || !(event.key in moves)) return;
    event.preventDefault();
    const next = cells[Math.max(0, Math.min(cells.length - 1, moves[event.key]))];
    cells[i].tabIndex = -1;
    next.tabIndex = 0;
    next.focus();
  });
  const readout = (event) => {
    if (event.target.title) $("heat-readout").textContent = event.target.title;
  };
  row.addEventListener("focusin", readout);
  row.addEventListener("mouseover", readout);
}
