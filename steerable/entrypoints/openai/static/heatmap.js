// The per-token heatmap: one cell per token the model read, coloured by a captured quantity (the
// hidden state's projection on the vector, or one SAE feature's activation), the value and the
// token's top SAE features on hover and by keyboard. The token rows and their keyboard handling
// are shared with the attention view (patterns.js).

import { $, apiJson, littleEndian } from "./api.js";

const tokenTexts = new Map();  // token id -> its text, from /detokenize
const cellFeatures = new WeakMap();  // heatmap cell -> its top SAE features, [[index, value]]

export function forgetTokens() {
  tokenTexts.clear();
}

// The label columns every capture carries: the input token and the absolute position of each row.
export function labels(wire) {
  return { tokens: littleEndian(wire.meta.token_ids, DataView.prototype.getInt32, 4),
    positions: littleEndian(wire.meta.positions, DataView.prototype.getInt32, 4) };
}

// One row of the wire format (float32, as the page asks) per token read, projected on `direction`.
export function projections(wire, direction) {
  if (wire.dtype !== "torch.float32") throw new Error(`capture: expected float32 rows, got ${wire.dtype}`);
  const [rows, width] = wire.shape;
  const values = littleEndian(wire.data, DataView.prototype.getFloat32, 4);
  const { tokens, positions } = labels(wire);
  const norm = Math.hypot(...direction) || 1;
  return Array.from({ length: rows }, (_, r) => {
    let dot = 0;
    for (let i = 0; i < width; i++) dot += values[r * width + i] * direction[i];
    return { token: tokens[r], position: positions[r], value: dot / norm };
  });
}

// Both runs' cells coloured by the projection, white at the unsteered run's mean: residual streams
// share a large offset along most directions.
export function projectionRows(finals, direction, site) {
  const rows = finals.map((final) => {
    const layers = final?.captures?.hidden_states;
    if (!layers) throw new Error("capture: the server returned no captured hidden states");
    return projections(Object.values(layers)[0], direction);
  });
  const centre = rows[0].reduce((sum, cell) => sum + cell.value, 0) / Math.max(1, rows[0].length);
  const spread = Math.max(1e-12, ...rows.flat().map((cell) => Math.abs(cell.value - centre)));
  const legend = `Projection on the vector, ${site}. White: the unsteered mean, ${centre.toFixed(3)}; full red or `
    + `blue: ${spread.toFixed(3)} above or below it.`;
  return { rows, centre, spread, legend };
}

export async function loadTokenTexts(ids) {
  const missing = [...new Set(ids)].filter((id) => !tokenTexts.has(id));
  await Promise.all(missing.map(async (id) => {
    tokenTexts.set(id, (await apiJson("POST", "detokenize", { tokens: [id] })).prompt);
  }));
}

export function tokenText(id) {
  return tokenTexts.get(id);
}

// A token as a cell shows it: line breaks and tabs as symbols, the empty string as ∅.
export function tokenCell(token, i) {
  const span = document.createElement("span");
  span.setAttribute("role", "listitem");
  span.textContent = tokenText(token).replace(/\n/g, "⏎").replace(/\t/g, "⇥") || "∅";
  span.tabIndex = i === 0 ? 0 : -1;
  return span;
}

export function label(span, text) {
  span.title = text;
  span.setAttribute("aria-label", text);
}

// `heat`: projectionRows or features.js's featureRows. A cell may carry `shown` (its value as text)
// and `features` (its top SAE features, [[index, value]]).
export async function drawHeatmaps(heat) {
  await loadTokenTexts(heat.rows.flat().map((cell) => cell.token));
  $("heat-legend").textContent = heat.legend;
  drawRow($("heat-base"), heat.rows[0], heat);
  drawRow($("heat-steered"), heat.rows[1], heat);
}

function drawRow(container, cells, { centre, spread }) {
  container.replaceChildren(...cells.map((cell, i) => {
    const span = tokenCell(cell.token, i);
    label(span, `${JSON.stringify(tokenText(cell.token))} at position ${cell.position}: `
      + (cell.shown ?? cell.value.toFixed(4)));
    if (cell.features) cellFeatures.set(span, cell.features);
    const t = (cell.value - centre) / spread;
    span.style.backgroundColor = t >= 0 ? shade(t, RED) : shade(-t, BLUE);
    span.classList.toggle("light", Math.abs(t) > 0.6);
    return span;
  }));
}

// The readout's list: each feature a button that opens its dashboard (dashboard.js listens).
function showFeatures(features) {
  const box = $("heat-features");
  if (!features) {
    box.replaceChildren();
    return;
  }
  if (!features.length) {
    box.textContent = "Top SAE features: none active.";
    return;
  }
  const items = features.flatMap(([index, value], i) => {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "link";
    button.textContent = `#${index} ${value.toFixed(4)}`;
    button.addEventListener("click", () => document.dispatchEvent(new CustomEvent("open-feature", { detail: { index } })));
    return i ? [", ", button] : [button];
  });
  box.replaceChildren("Top SAE features: ", ...items);
}

export const RED = [215, 48, 39];
export const BLUE = [69, 117, 180];

// White at 0, `end` at 1 (and beyond).
export function shade(a, end) {
  const t = Math.min(1, Math.max(0, a));
  return `rgb(${end.map((c) => Math.round(255 + (c - 255) * t)).join(", ")})`;
}

// One tab stop per row; arrow keys, Home and End move between its cells; `onCell(cell, index)`
// runs for the focused or hovered cell.
export function wireRow(row, onCell) {
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
  const pick = (event) => {
    const cells = [...row.children];
    const i = cells.indexOf(event.target);
    if (i >= 0) onCell(event.target, i);
  };
  row.addEventListener("focusin", pick);
  row.addEventListener("mouseover", pick);
}

// The heatmap's readout: the cell's value, then its top features where an SAE was captured.
export function wireHeatmapRow(row) {
  wireRow(row, (cell) => {
    $("heat-readout").textContent = cell.title;
    showFeatures(cellFeatures.get(cell));
  });
}
