// The module editor: a module's steering spec as JSON (what `steering_vectors` takes), every kind of
// intervention insertable from a template sized for the served model, registered through the admin
// route like an uploaded or trained vector.

import { $, apiJson, bytesBase64, clearErrors, showError } from "./api.js";

const model = { layers: 1, width: 1 };  // the served model's shape

// Little-endian float32 values as the API's base64 array form.
function encoded(values, shape) {
  return { dtype: "float32", shape, data: bytesBase64(new Uint8Array(new Float32Array(values).buffer)) };
}

// `rows` unit basis rows (orthonormal), [rows, width].
function basis(rows, width) {
  const values = new Array(rows * width).fill(0);
  for (let r = 0; r < rows; r += 1) values[r * width + r] = 1;
  return encoded(values, [rows, width]);
}

const zeros = (rows, cols) => encoded(new Array(rows * cols).fill(0), [rows, cols]);
const zeroVector = (width) => encoded(new Array(width).fill(0), [width]);

// One template per intervention type, at the middle layer: replace the zeros and unit vectors with your own.
export const TEMPLATES = {
  add: () => ({ type: "add", layer: middle(), vector: zeroVector(model.width), hook: "post_mlp", scale: 1 }),
  clamp: () => ({ type: "clamp", layer: middle(), direction: unit(0), hook: "post_mlp", min: 0, max: 0, strength: 1 }),
  feature: () => ({ type: "feature", sae: $("sae").value || "(a registered SAE)", index: 0, scale: 4 }),
  lowrank: () => ({ type: "lowrank", layer: middle(), R: basis(4, model.width), W: zeros(4, model.width),
    b: [0, 0, 0, 0], hook: "post_mlp" }),
  affine: () => ({ type: "affine", layer: middle(), U: zeros(model.width, 1), V: zeros(1, model.width),
    c: zeroVector(model.width), hook: "post_mlp" }),
  when: () => ({ type: "when", items: [TEMPLATES.add()], layer: Math.max(middle() - 1, 0), direction: unit(0),
    threshold: 0, hook: "post_mlp", scope: "token", compare: ">" }),
  router_bias: () => ({ type: "router_bias", layer: 0, expert: 0, bias: 2 }),
};

function middle() {
  return Math.floor(model.layers / 2);
}

function unit(index) {
  const values = new Array(model.width).fill(0);
  values[index] = 1;
  return encoded(values, [model.width]);
}

export function setEditorModel(card) {
  model.layers = card.num_layers;
  model.width = card.hidden_size;
}

// The spec in the text box, or null (with the reason shown) when it is not a JSON object.
function currentSpec() {
  const text = $("editor-json").value.trim();
  if (!text) return { interventions: [] };
  try {
    const spec = JSON.parse(text);
    if (spec && typeof spec === "object" && !Array.isArray(spec)) return spec;
  } catch { /* shown below */ }
  $("editor-error").textContent = "The module is not a JSON object: fix it, or empty the box to start again.";
  return null;
}

function insert() {
  clearErrors("editor-error");
  const spec = currentSpec();
  if (!spec) return;
  spec.interventions = [...(spec.interventions ?? []), TEMPLATES[$("editor-item").value]()];
  $("editor-json").value = JSON.stringify(spec, null, 1);
}

async function register(event, onRegistered) {
  event.preventDefault();
  clearErrors("editor-error");
  const spec = currentSpec();
  const name = $("editor-name").value.trim();
  if (!spec) return;
  if (!name) {
    $("editor-error").textContent = "Name the module first.";
    return;
  }
  try {
    await apiJson("POST", "v1/steering/modules", { [name]: spec });
    await onRegistered(name);
  } catch (err) {
    showError(err, [], "editor-error");
  }
}

export function wireEditor(onRegistered) {
  $("editor-insert").addEventListener("click", insert);
  $("editor-form").addEventListener("submit", (event) => register(event, onRegistered));
}
