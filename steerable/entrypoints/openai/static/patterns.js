// The attention view (issue 29): one head's attention pattern at one layer, in both runs. The runs
// capture every head of the layer (`capture: {"component": "attention_patterns", ...}`), so the
// head changes without running again. Hovering or focusing a token makes it the query: the
// tokens it attends to are coloured by their weights, its row of the softmax over its keys.

import { $, littleEndian } from "./api.js";
import { label, labels, loadTokenTexts, shade, tokenCell, tokenText, wireRow } from "./heatmap.js";

const GREEN = [27, 120, 55];
const ROWS = ["pattern-base", "pattern-steered"];
const view = { layer: null, runs: [], queries: [] };  // the drawn layer, each run's decoded rows and query

export function fillPatternLayers(numLayers) {
  const select = $("pattern-layer");
  const keep = select.value;
  select.replaceChildren(...Array.from({ length: numLayers }, (_, layer) => new Option(`layer ${layer}`, layer)));
  select.value = keep !== "" && Number(keep) < numLayers ? keep : Math.floor(numLayers / 2);
}

// The capture both runs add, when the view is on.
export function patternCapture() {
  if (!$("pattern-on").checked) return null;
  return { component: "attention_patterns", layers: [Number($("pattern-layer").value)], select: "all", dtype: "float32" };
}

// A ragged layer of the wire format: per row (query) its label and where its [heads, key_len]
// weights start in `values`; `heads` the query heads captured, in order.
export function decodePatterns(wire) {
  if (wire.dtype !== "torch.float32" || !wire.ragged) throw new Error("capture: expected float32 attention patterns");
  const { tokens, positions } = labels(wire);
  const starts = littleEndian(wire.ragged.key_starts, DataView.prototype.getInt32, 4);
  const lens = littleEndian(wire.ragged.key_lens, DataView.prototype.getInt32, 4);
  const heads = wire.ragged.heads;
  let offset = 0;
  const rows = tokens.map((token, r) => {
    const row = { token, position: positions[r], keyStart: starts[r], keyLen: lens[r], offset };
    offset += heads.length * lens[r];
    return row;
  });
  return { rows, heads, values: littleEndian(wire.data, DataView.prototype.getFloat32, 4) };
}

export function clearPatterns() {
  view.runs = [];
  for (const id of [...ROWS, "pattern-legend", "pattern-readout", "pattern-error"]) $(id).replaceChildren();
}

export async function drawPatterns(finals, layer) {
  view.layer = layer;
  view.runs = finals.map((final) => {
    const layers = final?.captures?.attention_patterns;
    if (!layers) throw new Error("capture: the server returned no attention patterns");
    return decodePatterns(Object.values(layers)[0]);
  });
  await loadTokenTexts(view.runs.flatMap((run) => run.rows.map((row) => row.token)));
  view.queries = view.runs.map((run) => run.rows.length - 1);  // the last token read, until one is hovered
  ROWS.forEach((id, run) => $(id).replaceChildren(...view.runs[run].rows.map((row, i) => tokenCell(row.token, i))));
  repaint();
}

// The chosen head's position among the captured ones, or null with the reason shown.
function headIndex() {
  const heads = view.runs[0].heads;
  const i = $("pattern-head").value.trim() === "" ? -1 : heads.indexOf(Number($("pattern-head").value));
  $("pattern-error").textContent = i < 0 ? `Layer ${view.layer} has heads ${heads[0]} to ${heads.at(-1)}.` : "";
  return i < 0 ? null : i;
}

function repaint() {
  if (!view.runs.length) return;
  const head = headIndex();
  if (head === null) return;
  view.runs.forEach((_, run) => { if (view.runs[run].rows.length) paint(run, view.queries[run], head); });
}

// Cell `q` of run `run` as the query: each key coloured by its weight (full green: the row's
// largest), its value on the cell; tokens that are not its keys (later, or before a window) muted.
function paint(run, q, head) {
  const { rows, heads, values } = view.runs[run];
  const query = rows[q];
  const start = query.offset + head * query.keyLen;
  const weights = values.slice(start, start + query.keyLen);
  const top = Math.max(1e-12, ...weights);
  const cells = [...$(ROWS[run]).children];
  rows.forEach((row, i) => {
    const cell = cells[i];
    const k = row.position - query.keyStart;
    const name = `${JSON.stringify(tokenText(row.token))} at position ${row.position}`;
    const key = k >= 0 && k < query.keyLen;
    cell.classList.toggle("query", i === q);
    cell.classList.toggle("outside", !key);
    cell.classList.toggle("light", key && weights[k] / top > 0.6);
    cell.style.backgroundColor = key ? shade(weights[k] / top, GREEN) : "";
    if (key) cell.dataset.weight = weights[k];
    else delete cell.dataset.weight;
    label(cell, key ? `${name}: weight ${weights[k].toFixed(4)}`
      : `${name}: not a key of this query (${row.position > query.position ? "later" : "before its window"})`);
  });
  const order = [...weights.keys()].sort((a, b) => weights[b] - weights[a]).slice(0, 5);
  const most = order.map((k) => {
    const key = rows.find((row) => row.position === query.keyStart + k);
    return `${JSON.stringify(tokenText(key.token))} ${weights[k].toFixed(4)}`;
  });
  $("pattern-legend").textContent = `Layer ${view.layer}, head ${heads[head]} (of ${heads.length}). The outlined token is `
    + "the query; each token it attends to is coloured by its weight, full green the largest.";
  $("pattern-readout").textContent = `${JSON.stringify(tokenText(query.token))} at position ${query.position} `
    + `attends most to ${most.join(", ")}`;
}

export function wirePatterns() {
  ROWS.forEach((id, run) => wireRow($(id), (_, i) => {
    view.queries[run] = i;
    const head = headIndex();
    if (head !== null) paint(run, i, head);
  }));
  $("pattern-head").addEventListener("input", repaint);
}
