// The feature page (issue 49): one SAE feature's dashboard as the server computed it over a corpus
// (GET v1/saes/{name}/features/{i}, from `steerable serve --dashboards DIR`): its statistics, the
// histogram of its activations drawn as bars, its top and bottom logits, its top examples and
// quantile samples with each token coloured by the feature's activation, and a button that steers
// the current prompt by the feature (the steered pane) beside the unsteered run. Opened from the
// SAE box, or by clicking a feature in a heatmap cell's top-feature list.

import { $, apiJson, clearErrors, showError } from "./api.js";
import { RED, shade } from "./heatmap.js";

const SVG = "http://www.w3.org/2000/svg";
const shown = { sae: null, index: null };

export async function openDashboard(sae, index) {
  clearErrors("feature-page-error");
  const page = $("feature-page");
  page.hidden = false;
  $("feature-title").textContent = `Feature ${index} of SAE ${sae}`;
  for (const id of ["feature-stats", "feature-hist", "feature-pos", "feature-neg", "feature-top", "feature-quantiles"]) {
    $(id).replaceChildren();
  }
  $("steer-by-feature").disabled = true;
  $("feature-title").focus();
  try {
    const dash = await apiJson("GET", `v1/saes/${encodeURIComponent(sae)}/features/${encodeURIComponent(index)}`);
    Object.assign(shown, { sae, index });
    draw(dash);
    $("steer-by-feature").disabled = false;
  } catch (err) {
    showError(err, [], "feature-page-error");
  }
}

function draw(dash) {
  $("feature-stats").textContent = dash.dead ? `Dead: never active on the ${dash.tokens} tokens of the corpus.`
    : `Active on ${dash.count} of ${dash.tokens} tokens (density ${(100 * dash.density).toPrecision(3)} %); `
      + `max ${dash.max.toFixed(4)}, mean of the non-zero ${dash.mean.toFixed(4)}.`;
  drawHistogram($("feature-hist"), dash.histogram);
  fillLogits($("feature-pos"), dash.top_logits);
  fillLogits($("feature-neg"), dash.bottom_logits);
  $("feature-top").replaceChildren(...dash.top.map((example) => exampleRow(example, dash.max)));
  $("feature-quantiles").replaceChildren(...[...dash.quantiles].reverse().map((group) => {
    const details = document.createElement("details");
    const summary = document.createElement("summary");
    summary.textContent = `${group.low.toFixed(3)} to ${group.high.toFixed(3)}: ${group.count} tokens, `
      + `${group.examples.length} drawn`;
    details.append(summary, ...group.examples.map((example) => exampleRow(example, dash.max)));
    return details;
  }));
}

// Bars of the non-zero activations' counts per bin, the edges under the first and last bar.
function drawHistogram(svg, histogram) {
  const { counts, edges } = histogram;
  const used = counts.reduce((last, count, i) => (count ? i + 1 : last), 0);
  if (!used) return;
  const [width, height, bottom] = [480, 160, 18];
  const top = Math.max(...counts);
  const step = width / used;
  for (let i = 0; i < used; i++) {
    const bar = document.createElementNS(SVG, "rect");
    const h = (counts[i] / top) * (height - bottom - 4);
    bar.setAttribute("x", (i * step + 1).toFixed(1));
    bar.setAttribute("width", Math.max(1, step - 2).toFixed(1));
    bar.setAttribute("y", (height - bottom - h).toFixed(1));
    bar.setAttribute("height", h.toFixed(1));
    const tip = document.createElementNS(SVG, "title");
    tip.textContent = `${edges[i].toFixed(4)} to ${edges[i + 1].toFixed(4)}: ${counts[i]}`;
    bar.append(tip);
    svg.append(bar);
  }
  for (const [x, anchor, value] of [[0, "start", edges[0]], [width, "end", edges[used]]]) {
    const text = document.createElementNS(SVG, "text");
    text.setAttribute("x", x);
    text.setAttribute("y", height - 4);
    text.setAttribute("text-anchor", anchor);
    text.textContent = value.toFixed(3);
    svg.append(text);
  }
}

function fillLogits(body, entries) {
  body.replaceChildren(...entries.map(({ token_str: text, value }) => {
    const row = document.createElement("tr");
    const token = document.createElement("td");
    token.textContent = JSON.stringify(text);
    const number = document.createElement("td");
    number.textContent = value.toFixed(3);
    row.append(token, number);
    return row;
  }));
}

// One example: its window's tokens, white at 0 and full red at the feature's max; the activating
// token outlined. Each token's activation on hover.
function exampleRow(example, max) {
  const row = document.createElement("div");
  row.className = "heat example";
  row.setAttribute("role", "list");
  row.setAttribute("aria-label", `Text ${example.corpus_index}, position ${example.position}: ${example.max.toFixed(4)}`);
  row.append(...example.token_strs.map((text, i) => {
    const span = document.createElement("span");
    span.setAttribute("role", "listitem");
    span.textContent = text.replace(/\n/g, "⏎").replace(/\t/g, "⇥") || "∅";
    const value = example.activations[i];
    span.title = `${JSON.stringify(text)}: ${value.toFixed(4)}`;
    span.style.backgroundColor = shade(max > 0 ? value / max : 0, RED);
    span.classList.toggle("light", max > 0 && value / max > 0.6);
    span.classList.toggle("peak", i === example.position - example.start);
    return span;
  }));
  return row;
}

// Steer the current prompt by the shown feature: it becomes the steered run's feature and the
// heatmap's, and the form runs both panes (the existing feature steering).
function steerByFeature() {
  if (shown.sae === null) return;
  $("sae").value = shown.sae;
  $("sae").dispatchEvent(new Event("change"));
  $("steer-feature").value = shown.index;
  $("heat-feature").value = shown.index;
  document.querySelector("input[name=heat-by][value=feature]").checked = true;
  $("run-form").requestSubmit();
}

export function wireDashboard() {
  $("open-dashboard").addEventListener("click", () => {
    const index = $("dash-feature").value.trim();
    if (!$("sae").value || index === "") {
      $("sae-error").textContent = "Choose an SAE and a feature index to show its dashboard.";
      return;
    }
    clearErrors("sae-error");
    openDashboard($("sae").value, index);
  });
  $("steer-by-feature").addEventListener("click", steerByFeature);
  // A feature clicked in a heatmap cell's list (heatmap.js), of the SAE the runs captured.
  document.addEventListener("open-feature", (event) => openDashboard($("sae").value, event.detail.index));
}
