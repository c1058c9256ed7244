// The sweep's report: p(matching) against scale as an SVG line (drawn here, no charting library),
// and every row of the report in a table.

import { $ } from "./api.js";

function svg(tag, attributes, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

export function plot(rows) {
  const box = { left: 48, right: 464, top: 16, bottom: 220 };
  const scales = rows.map((row) => row.scale);
  const lo = Math.min(...scales);
  const hi = Math.max(...scales) === lo ? lo + 1 : Math.max(...scales);
  const x = (s) => box.left + (s - lo) / (hi - lo) * (box.right - box.left);
  const y = (p) => box.bottom - p * (box.bottom - box.top);
  const parts = [];
  for (const p of [0, 0.25, 0.5, 0.75, 1]) {
    parts.push(svg("line", { class: "grid", x1: box.left, x2: box.right, y1: y(p), y2: y(p) }),
      svg("text", { x: box.left - 6, y: y(p) + 4, "text-anchor": "end" }, p.toFixed(2)));
  }
  for (const s of scales) parts.push(svg("text", { x: x(s), y: box.bottom + 16, "text-anchor": "middle" }, `${s}`));
  parts.push(svg("text", { x: (box.left + box.right) / 2, y: box.bottom + 34, "text-anchor": "middle" }, "scale"),
    svg("line", { class: "axis", x1: box.left, x2: box.left, y1: box.top, y2: box.bottom }),
    svg("line", { class: "axis", x1: box.left, x2: box.right, y1: box.bottom, y2: box.bottom }));
  const sorted = [...rows].sort((a, b) => a.scale - b.scale);
  parts.push(svg("polyline", { class: "curve", points: sorted.map((r) => `${x(r.scale)},${y(r.p_match)}`).join(" ") }));
  for (const row of sorted) {
    const point = svg("circle", { cx: x(row.scale), cy: y(row.p_match), r: 4 });
    point.append(svg("title", {}, `scale ${row.scale}: p(matching) ${row.p_match.toFixed(4)}`));
    parts.push(point);
  }
  $("sweep-plot").replaceChildren(...parts);
}

export function table(rows) {
  $("sweep-table").tBodies[0].replaceChildren(...rows.map((row) => {
    const tr = document.createElement("tr");
    const kl = row.kl === null ? "n/a" : row.kl.toFixed(4);
    for (const text of [`${row.scale}`, row.p_match.toFixed(4), row.logit_diff.toFixed(4), row.wrong_way.toFixed(2), kl]) {
      tr.append(Object.assign(document.createElement("td"), { textContent: text }));
    }
    return tr;
  }));
}
