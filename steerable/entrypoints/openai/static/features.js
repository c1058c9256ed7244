// SAE features (issue 27): the server's SAEs and transcoders (GET /v1/saes), each token's top
// features captured in both runs (`capture: {"stream": "sae_features", ...}`), the heatmap coloured
// by one feature's activation, and one feature steered in the steered run with its own slider. A
// transcoder's features read the MLP's input and write its output; a cross-layer transcoder's (or a
// set's) indices run over its layers, `d_transcoder` each.

import { $, apiJson, clearErrors, littleEndian, showError } from "./api.js";
import { labels } from "./heatmap.js";

const saes = new Map();  // name -> {layer, hook, d_sae, architecture} (+ kind, layers, d_transcoder: a transcoder)

export async function loadSaes() {
  clearErrors("sae-error");
  saes.clear();
  try {
    for (const [name, info] of Object.entries((await apiJson("GET", "v1/saes")).saes)) saes.set(name, info);
  } catch (err) {
    showError(err, [], "sae-error");
  }
  const box = $("sae");
  const keep = box.value;
  const names = [...saes.keys()];
  box.replaceChildren(...names.map((name) => new Option(name, name)),
    new Option(names.length ? "(none: capture no features)" : "(no SAEs registered)", ""));
  box.value = names.includes(keep) ? keep : names[0] ?? "";
  chooseSae();
}

export function chooseSae() {
  clearErrors("sae-error");
  const sae = saes.get($("sae").value);
  $("sae-controls").disabled = !sae;
  if (!sae) document.querySelector("input[name=heat-by][value=projection]").checked = true;
  $("sae-info").textContent = sae ? describe(sae)
    : saes.size ? "No SAE chosen: the runs capture no features."
      : "This server has no SAE: start it with --sae NAME=PATH, or register one with POST /v1/saes (admin).";
}

const KINDS = { transcoder: "Transcoder", transcoder_set: "Per-layer transcoders", cross_layer_transcoder: "Cross-layer transcoder" };

function describe(sae) {
  if (!sae.kind) return `Reads layer ${sae.layer}, ${sae.hook}: ${sae.d_sae} features (${sae.architecture}).`;
  const layers = sae.layers.length > 1 ? `layers ${sae.layers[0]}-${sae.layers.at(-1)}` : `layer ${sae.layer}`;
  const per = sae.layers.length > 1 ? `, ${sae.d_transcoder} a layer (feature i reads layer ${sae.layer} + floor(i / `
    + `${sae.d_transcoder}))` : "";
  return `${KINDS[sae.kind]}: reads ${layers}, ${sae.hook}; writes ${sae.hook_out}: ${sae.d_sae} features `
    + `(${sae.architecture}${sae.skip ? ", skip term" : ""})${per}.`;
}

// Where feature `index` of `sae` reads: an SAE's own point; a transcoder's source layer.
function readsAt(sae, index) {
  const layer = sae.kind ? sae.layer + Math.floor(index / sae.d_transcoder) : sae.layer;
  return `layer ${layer}, ${sae.hook}`;
}

function chosen() {
  const name = $("sae").value;
  return name ? { name, ...saes.get(name) } : null;
}

export function heatByFeature() {
  return document.querySelector("input[name=heat-by]:checked").value === "feature";
}

// An empty box is null, else its number; one that does not parse (NaN) travels as null, for the server to name.
function typed(id) {
  const text = $(id).value.trim();
  return text === "" ? null : Number(text);
}

// The capture both runs add, when an SAE is chosen.
export function featureCapture() {
  const sae = chosen();
  return sae && { stream: "sae_features", saes: [sae.name], top_k: typed("sae-top-k"), select: "all" };
}

// The steered run's feature, `{sae, index, scale}` (steering_vectors.features), or null.
export function featureSteering() {
  const sae = chosen();
  const index = typed("steer-feature");
  return sae && index !== null ? { sae: sae.name, index, scale: Number($("feature-scale").value) } : null;
}

// What the heatmap colours by, checked before anything runs: null, with the reason shown, if unset.
export function heatFeature() {
  const sae = chosen();
  const index = typed("heat-feature");
  if (!sae || index === null || !Number.isInteger(index) || index < 0 || index >= sae.d_sae) {
    $("heat-feature-error").textContent = sae ? `The heatmap's feature is an index in [0, ${sae.d_sae}).`
      : "Choose an SAE to colour the heatmap by one of its features.";
    return null;
  }
  return { ...sae, index };
}

// One SAE's wire rows ("encoding": "sparse"): per row, its position, token and [[index, value]]
// highest first, the padding (index -1) left out; `full`: all top_k slots hold a feature.
export function topFeatures(wire) {
  if (wire.encoding !== "sparse") throw new Error(`capture: expected sparse SAE features, got ${wire.encoding}`);
  const [rows, k] = wire.shape;
  const indices = littleEndian(wire.indices, DataView.prototype.getInt32, 4);
  const values = littleEndian(wire.values, DataView.prototype.getFloat32, 4);
  const { tokens, positions } = labels(wire);
  return Array.from({ length: rows }, (_, r) => {
    const features = [];
    for (let j = r * k; j < (r + 1) * k; j++) if (indices[j] >= 0) features.push([indices[j], values[j]]);
    return { token: tokens[r], position: positions[r], features, full: features.length === k, k };
  });
}

function captured(final, name) {
  const wire = final?.captures?.sae_features?.[name];
  if (!wire) throw new Error(`capture: the server returned no features of the SAE ${name}`);
  return topFeatures(wire);
}

// Both runs' cells coloured by `feature`'s activation, white at 0 and full red at the largest of
// both runs after the first token: the first token's residual stream is an outlier on most models
// (an attention sink), and would leave every other cell white; it is capped at full red. A token
// whose top k leave the feature out shows the bound the k-th value puts on it (coloured as 0); one
// with fewer than k active features has it at exactly 0.
export function featureRows(finals, feature) {
  const rows = finals.map((final) => captured(final, feature.name).map((row) => {
    const hit = row.features.find(([index]) => index === feature.index);
    const cell = { token: row.token, position: row.position, value: hit ? hit[1] : 0, features: row.features };
    if (!hit && row.full) cell.shown = `≤ ${row.features[row.k - 1][1].toFixed(4)} (not among its top ${row.k})`;
    return cell;
  }));
  const cells = rows.flat();
  const later = Math.max(0, ...cells.filter((cell) => cell.position > 0).map((cell) => cell.value));
  const spread = Math.max(1e-12, later || Math.max(...cells.map((cell) => cell.value)));
  const first = Math.max(...cells.filter((cell) => cell.position === 0).map((cell) => cell.value));
  const legend = `${feature.kind ? "Transcoder" : "SAE"} ${feature.name}, feature ${feature.index} `
    + `(${readsAt(feature, feature.index)}). White: 0; `
    + `full red: ${spread.toFixed(3)}, its largest activation in both runs after the first token.`
    + (first > spread ? ` The first token's ${first.toFixed(3)} is capped at full red.` : "");
  return { rows, centre: 0, spread, legend };
}

// Each heatmap cell gets its token's top features (the same position of the same run), for the readout.
export function attachFeatures(heat, finals, name) {
  heat.rows.forEach((cells, run) => {
    const byPosition = new Map(captured(finals[run], name).map((row) => [row.position, row.features]));
    for (const cell of cells) cell.features = byPosition.get(cell.position) ?? [];
  });
}

export function wireFeatures() {
  $("sae").addEventListener("change", chooseSae);
  $("refresh-saes").addEventListener("click", () => loadSaes());
  $("feature-scale").addEventListener("input", () => { $("feature-scale-value").value = $("feature-scale").value; });
}
