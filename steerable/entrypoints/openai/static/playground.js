// The playground page: the controls, the two streamed runs and the sweep, wired to this server's
// public API like any client (api.js); the heatmap, the SAE features, the feature page, the
// attention view and the plot are drawn by their own modules.

import { $, KEY, ApiError, api, apiJson, bytesBase64, clearErrors, littleEndian, showError } from "./api.js";
import { wireDashboard } from "./dashboard.js";
import { attachFeatures, featureCapture, featureRows, featureSteering, heatByFeature, heatFeature, loadSaes,
  wireFeatures } from "./features.js";
import { setEditorModel, wireEditor } from "./editor.js";
import { drawHeatmaps, forgetTokens, projectionRows, wireHeatmapRow } from "./heatmap.js";
import { clearPatterns, drawPatterns, fillPatternLayers, patternCapture, wirePatterns } from "./patterns.js";
import { plot, table } from "./sweep.js";

const state = { module: null, controller: null };  // the chosen module's directions; the run's AbortController

// Where a server error goes: the first [param prefix, element id] whose prefix names its param.
const RUN_SLOTS = [["prompt", "prompt-error"], ["messages", "prompt-error"], ["max_tokens", "max-tokens-error"],
  ["temperature", "temperature-error"], ["seed", "seed-error"], ["steering_module_ref", "module-error"],
  ["steering_vectors.features", "sae-error"], ["steering_vectors", "steer-error"], ["capture.saes", "sae-error"],
  ["capture.top_k", "sae-error"], ["capture.heads", "pattern-error"], ["capture", "heat-error"]];
const TRAIN_SLOTS = [["positives", "positives-error"], ["negatives", "negatives-error"],
  ["layers", "train-layers-error"], ["hook", "train-hook-error"]];
const SWEEP_SLOTS = [["items", "items-error"], ["scales", "scales-error"], ["module", "module-error"]];

// ---------------------------------------------------------------- key and model

// On load (`quiet`), a server that wants a key is not an error yet: the page just asks for one.
async function connect(quiet = false) {
  clearErrors("api-key-error");
  forgetTokens();
  try {
    const who = await apiJson("GET", "v1/auth");
    const card = (await apiJson("GET", "v1/models")).data[0];
    $("model-info").textContent = `${card.id}: ${card.num_layers} layers, width ${card.hidden_size}`;
    setAdmin(who);
    setEditorModel(card);
    fillPatternLayers(card.num_layers);
    await Promise.all([loadModules(), loadSaes()]);
    // Said last: once it shows, the module and SAE lists are the server's (a choice made earlier
    // would be replaced when they arrive).
    $("key-status").textContent = who.role === "admin" ? "Admin key: every control is available."
      : "User key: run and sweep with registered modules.";
  } catch (err) {
    setAdmin(null);
    $("key-status").textContent = quiet && err.status === 401 ? "This server needs an API key." : "";
    if (!(quiet && err.status === 401)) showError(err, [], "api-key-error");
  }
}

function setAdmin(who) {
  const admin = who?.role === "admin";
  $("upload-fieldset").disabled = !admin;
  $("train-fieldset").disabled = !admin;
  $("editor-fieldset").disabled = !admin;
  const reason = $("admin-reason");
  reason.hidden = admin;
  if (!who) reason.textContent = "Enter an API key first.";
  else if (!who.admin_routes) reason.textContent = "Uploading, training and writing modules are disabled: this "
    + "server has no admin key (start it with --admin-api-key).";
  else reason.textContent = "Uploading, training and writing modules are disabled for a user key: they register "
    + "modules that every user of this server gets, so they need the admin key.";
}

function useKey(event) {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("api-key").value);
  $("api-key").value = "";
  connect();
}

function forgetKey() {
  sessionStorage.removeItem(KEY);
  setAdmin(null);
  $("key-status").textContent = "Key forgotten.";
}

// ---------------------------------------------------------------- modules

async function loadModules(wanted) {
  clearErrors("module-error");
  try {
    const names = Object.keys((await apiJson("GET", "v1/steering/modules")).modules);
    const box = $("module");
    const keep = wanted ?? box.value;
    box.replaceChildren(...names.map((name) => new Option(name, name)),
      new Option(names.length ? "(none: a feature only)" : "(no modules registered)", ""));
    box.value = names.includes(keep) ? keep : names[0] ?? "";
    await chooseModule();
  } catch (err) {
    showError(err, [], "module-error");
  }
}

async function chooseModule() {
  clearErrors("module-error", "steer-error", "heat-error");
  state.module = null;
  $("module-info").textContent = "";
  const name = $("module").value;
  let layers = [];
  if (name) {
    try {
      const { spec } = await apiJson("GET", `v1/steering/modules/${encodeURIComponent(name)}`);
      state.module = moduleDirections(name, spec);
      layers = [...state.module.directions.keys()].sort((a, b) => a - b);
      $("module-info").textContent = (layers.length ? `Adds at ${state.module.hooks.join(", ")}, layers ${layers.join(", ")}.`
        : "This module adds no vector (it clamps, edits or routes): there is no direction for the heatmap.")
        + (fixedPlacement(state.module) ? " It steers as registered (it clamps, edits, gates, routes, or adds at several "
          + "hooks)." : "");
      if (state.module.hooks.length) {
        $("heat-hook").value = state.module.hooks[0];
        $("steer-hook").value = state.module.hooks[0];
      }
    } catch (err) {
      showError(err, [], "module-error");
    }
  }
  $("steer-layers").value = layers.join(", ");
  $("steer-layers").disabled = $("steer-hook").disabled = $("steer-method").disabled =
    !state.module || fixedPlacement(state.module);
  if ($("steer-method").disabled) $("steer-method").value = "add";
  describeMethod();
  const select = $("heat-layer");
  const keep = Number(select.value);
  select.replaceChildren(...layers.map((layer) => new Option(`layer ${layer}`, layer)));
  if (layers.length) select.value = layers.includes(keep) ? keep : layers[Math.floor(layers.length / 2)];
}

// Per layer, the sum of what the module adds there (at any hook), as float64; its additions as the
// server sent them (to steer at other layers or another hook), and how many other items (clamps,
// edits, gates, router biases) it has.
function moduleDirections(name, spec) {
  const directions = new Map();
  const hooks = new Set();
  const adds = [];
  let others = 0;
  for (const item of spec.interventions || []) {
    if (item.type !== "add") {
      others += 1;
      continue;
    }
    adds.push(item);
    const vector = littleEndian(item.vector.data, DataView.prototype.getFloat32, 4);
    const sum = directions.get(item.layer);
    directions.set(item.layer, sum ? sum.map((x, i) => x + vector[i]) : vector);
    hooks.add(item.hook);
  }
  return { name, directions, hooks: [...hooks], adds, others };
}

// A module with more than adds, or adds at more than one hook, has no single placement to move: it runs as registered.
function fixedPlacement(module) {
  return module.others > 0 || module.hooks.length > 1;
}

// What the chosen method does with the module's vector v at each layer (Neuronpedia's steer methods).
const METHODS = {
  add: "Adds scale times the module's vector (the module's own steering).",
  decompose: "Clamp(factor = scale) along the module's vector at each layer: the component of the stream "
    + "along it is multiplied by scale, h + (scale - 1)(h·v̂)v̂ (Neuronpedia's ORTHOGONAL_DECOMP).",
  cap: "Clamp(max = scale) along the module's vector at each layer: the component of the stream along it "
    + "is capped at scale, h + (min(h·v̂, scale) - h·v̂)v̂ (Neuronpedia's PROJECTION_CAP).",
};

function describeMethod() {
  $("steer-method-info").textContent = METHODS[$("steer-method").value];
}

// The steered run's steering: the module by reference where it steers as registered; where the
// layers or the hook were changed, its additions at those layers and that hook, inline, with the
// same scale (the server multiplies either form alike); with a projection method, a clamp along
// what the module adds at each of those layers instead. Null, with the reason shown, when the
// layers name one the module adds nothing at.
function steering(module, scale) {
  const own = [...module.directions.keys()].sort((a, b) => a - b);
  const text = $("steer-layers").value.trim();
  const layers = new Set(text ? parseLayers(text) : own);
  const missing = [...layers].filter((layer) => !module.directions.has(layer));
  if (missing.length) {
    $("steer-error").textContent = `The module adds nothing at layer ${missing.join(", ")}; it adds at ${own.join(", ")}.`;
    return null;
  }
  const hook = $("steer-hook").value;
  const method = $("steer-method").value;
  if (method === "add" && (fixedPlacement(module) || (layers.size === own.length && hook === module.hooks[0]))) {
    return { steering_module_ref: { name: module.name, scale } };
  }
  const interventions = method === "add"
    ? module.adds.filter((item) => layers.has(item.layer)).map((item) => ({ ...item, hook, scale }))
    : [...layers].map((layer) => ({ type: "clamp", layer, direction: module.directions.get(layer), hook,
      ...(method === "decompose" ? { factor: scale } : { max: scale }) }));
  return { steering_vectors: { interventions } };
}

async function upload(event) {
  event.preventDefault();
  clearErrors("upload-error");
  const file = $("upload-file").files[0];
  if (!file) {
    $("upload-error").textContent = "Choose a .gguf or .safetensors file first.";
    return;
  }
  const name = $("upload-name").value.trim();
  try {
    const data = bytesBase64(new Uint8Array(await file.arrayBuffer()));
    await apiJson("POST", "v1/steering/modules", { [name]: { control_vector: data, scale: 1 } });
    await loadModules(name);
  } catch (err) {
    showError(err, [], "upload-error");
  }
}

function lines(id) {
  return $(id).value.split("\n").map((line) => line.trim()).filter(Boolean);
}

// "4-6,9" -> [4, 5, 6, 9]; anything else is sent as typed, for the server to name.
function parseLayers(text) {
  return text.split(",").flatMap((part) => {
    const range = part.trim().match(/^(\d+)\s*-\s*(\d+)$/);
    if (!range) return [Number(part)];
    return Array.from({ length: Math.max(0, range[2] - range[1] + 1) }, (_, i) => Number(range[1]) + i);
  });
}

async function trainVector(event) {
  event.preventDefault();
  clearErrors("positives-error", "negatives-error", "train-layers-error", "train-hook-error", "train-error");
  const body = { positives: lines("positives"), negatives: lines("negatives"), hook: $("train-hook").value,
    method: $("train-method").value, module: $("train-name").value.trim() };
  const layers = $("train-layers").value.trim();
  if (layers) body.layers = parseLayers(layers);
  $("train").disabled = true;
  try {
    await apiJson("POST", "v1/vectors/train", body);
    await loadModules(body.module);
  } catch (err) {
    showError(err, TRAIN_SLOTS, "train-error");
  } finally {
    $("train").disabled = false;
  }
}

// ---------------------------------------------------------------- run

function requestBody(capture) {
  if ($("seed").value === "") $("seed").value = Math.floor(Math.random() * 2 ** 31);  // both runs share it
  const number = (id) => ($(id).value === "" ? null : Number($(id).value));
  const body = { max_tokens: number("max-tokens"), temperature: number("temperature"), seed: number("seed"),
    stream: true, capture };
  if (document.querySelector("input[name=mode]:checked").value === "chat") {
    const system = $("system").value.trim();
    body.messages = [...(system ? [{ role: "system", content: system }] : []), { role: "user", content: $("prompt").value }];
  } else {
    body.prompt = $("prompt").value;
  }
  return body;
}

// Server-sent events through fetch: appends each delta to `pane`; resolves to the final choice
// (which carries the captures).
async function stream(path, body, pane, signal) {
  const response = await api("POST", path, body, signal);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let final = null;
  pane.setAttribute("aria-busy", "true");
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      const events = (buffer + value).split("\n\n");
      buffer = events.pop();
      for (const event of events) {
        const data = event.replace(/^data: /, "");
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(chunk.error.code, chunk.error.message, chunk.error.param);
        for (const choice of chunk.choices) {
          pane.append(choice.text ?? choice.delta?.content ?? "");
          if (choice.finish_reason) final = choice;
        }
      }
    }
  } finally {
    pane.removeAttribute("aria-busy");
  }
  return final;
}

// The steered run's steering: the module's (see steering), plus the SAE feature where one is
// given. Null, with the reason shown, when there is nothing to steer with or the placement is refused.
function steeredBy(module) {
  const feature = featureSteering();
  if (!module && !feature) {
    $("module-error").textContent = "Choose a module, or an SAE feature to steer, first.";
    return null;
  }
  const steer = module ? steering(module, Number($("scale").value)) : {};
  if (!steer || !feature) return steer;
  return { ...steer, steering_vectors: { ...steer.steering_vectors, features: [feature] } };
}

// What the heatmap colours by (a feature, or the projection on the module's vector and the hidden
// states that takes), checked before anything runs; null, with the reason shown.
function heatSource(module) {
  if (heatByFeature()) {
    const feature = heatFeature();
    return feature && { feature };
  }
  const layer = Number($("heat-layer").value);
  if (!module || !module.directions.has(layer)) {
    $("module-error").textContent = "Choose a module that adds a vector (or upload or train one), or colour the "
      + "heatmap by an SAE feature, first.";
    return null;
  }
  const hook = $("heat-hook").value;
  return { direction: module.directions.get(layer), site: `layer ${layer}, ${hook}`,
    capture: { layers: [layer], hook, select: "all", dtype: "float32" } };
}

async function run(event) {
  event.preventDefault();
  clearErrors(...RUN_SLOTS.map(([, id]) => id), "heat-feature-error", "run-error");
  const module = state.module;
  const heat = heatSource(module);
  const steer = heat && steeredBy(module);
  if (!steer) return;
  const features = featureCapture();
  const pattern = patternCapture();
  const base = requestBody([heat.capture, features, pattern].filter(Boolean));
  const steered = { ...base, ...steer };
  const path = base.messages ? "v1/chat/completions" : "v1/completions";
  const controller = new AbortController();
  state.controller = controller;
  setRunning(true, "Running…");
  for (const id of ["pane-base", "pane-steered", "heat-base", "heat-steered", "heat-legend", "heat-readout",
    "heat-features"]) {
    $(id).replaceChildren();
  }
  clearPatterns();
  try {
    const finals = await Promise.all([stream(path, base, $("pane-base"), controller.signal),
      stream(path, steered, $("pane-steered"), controller.signal)]);
    const rows = heat.feature ? featureRows(finals, heat.feature) : projectionRows(finals, heat.direction, heat.site);
    if (features) attachFeatures(rows, finals, features.saes[0]);
    await drawHeatmaps(rows);
    if (pattern) await drawPatterns(finals, pattern.layers[0]);
    setRunning(false, "Done.");
  } catch (err) {
    controller.abort();  // the other run, if it still streams
    setRunning(false, err.name === "AbortError" ? "Stopped." : "");
    if (err.name !== "AbortError") showError(err, RUN_SLOTS, "run-error");
  }
}

function setRunning(running, status) {
  $("run").disabled = running;
  $("stop").disabled = !running;
  $("run-status").textContent = status;
}

// ---------------------------------------------------------------- sweep

async function sweep(event) {
  event.preventDefault();
  clearErrors("items-error", "scales-error", "module-error", "sweep-error");
  if (!state.module) {
    $("module-error").textContent = "Choose a module to sweep first.";
    return;
  }
  let items;
  try {
    items = lines("items").map((line, i) => {
      try { return JSON.parse(line); } catch (err) { throw new Error(`items[${i}]: not JSON (${err.message})`); }
    });
  } catch (err) {
    $("items-error").textContent = err.message;
    return;
  }
  const scales = $("scales").value.split(",").filter((s) => s.trim()).map(Number);  // NaN travels as null: a 400
  $("sweep").disabled = true;
  $("sweep-status").textContent = "Sweeping…";
  try {
    const report = await apiJson("POST", "v1/vectors/evaluate", { module: state.module.name, items, scales });
    plot(report.rows);
    table(report.rows);
    $("sweep-status").textContent = `${report.items} items; steerability ${report.steerability.toFixed(3)} per unit `
      + `of scale; ${Math.round(report.anti_steerable * 100)} % anti-steerable.`;
  } catch (err) {
    $("sweep-status").textContent = "";
    showError(err, SWEEP_SLOTS, "sweep-error");
  } finally {
    $("sweep").disabled = false;
  }
}

// ---------------------------------------------------------------- wiring

function setMode() {
  const chat = document.querySelector("input[name=mode]:checked").value === "chat";
  $("system-group").hidden = !chat;
  $("prompt-label").textContent = chat ? "User message" : "Prompt";
}

$("key-form").addEventListener("submit", useKey);
$("forget-key").addEventListener("click", forgetKey);
$("module").addEventListener("change", chooseModule);
$("refresh-modules").addEventListener("click", () => loadModules());
$("upload-file").addEventListener("change", () => {
  const file = $("upload-file").files[0];
  if (file && !$("upload-name").value) $("upload-name").value = file.name.replace(/\.(gguf|safetensors)$/, "");
});
$("upload-form").addEventListener("submit", upload);
$("train-form").addEventListener("submit", trainVector);
wireEditor((name) => loadModules(name));
$("run-form").addEventListener("submit", run);
$("stop").addEventListener("click", () => state.controller?.abort());
$("scale").addEventListener("input", () => { $("scale-value").value = $("scale").value; });
$("steer-method").addEventListener("change", describeMethod);
$("sweep-form").addEventListener("submit", sweep);
for (const radio of document.querySelectorAll("input[name=mode]")) radio.addEventListener("change", setMode);
wireHeatmapRow($("heat-base"));
wireHeatmapRow($("heat-steered"));
wireFeatures();
wirePatterns();
wireDashboard();
describeMethod();
connect(true);
