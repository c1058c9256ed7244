// This server's API as the page calls it: the key from sessionStorage (never the page, a URL or a
// cookie), errors as the server words them, and the base64 little-endian data it sends.

export const KEY = "steerable.apiKey";
export const $ = (id) => document.getElementById(id);

export class ApiError extends Error {
  constructor(status, message, param) {
    super(message);
    this.status = status;
    this.param = param;
  }
}

export async function api(method, path, body, signal) {
  const headers = {};
  const key = sessionStorage.getItem(KEY);
  if (key) headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { method, headers, signal,
    body: body === undefined ? undefined : JSON.stringify(body) });
  if (!response.ok) {
    let error = {};
    try { error = (await response.json()).error || {}; } catch { /* not the API's JSON error shape */ }
    throw new ApiError(response.status, error.message || `HTTP ${response.status} ${response.statusText}`, error.param);
  }
  return response;
}

export async function apiJson(method, path, body) {
  return (await api(method, path, body)).json();
}

// The server's message goes next to the control its `param` names: the first [prefix, element id]
// of `slots` whose prefix matches, else `fallback` (next to the button that sent the request).
export function showError(err, slots, fallback) {
  const param = err.param || "";
  const slot = slots.find(([prefix]) => param === prefix || param.startsWith(`${prefix}.`) || param.startsWith(`${prefix}[`));
  $(slot ? slot[1] : fallback).textContent = err.message;
}

export function clearErrors(...ids) {
  for (const id of ids) $(id).textContent = "";
}

export function bytesBase64(bytes) {
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(text);
}

// Base64 of little-endian values: `read` is a DataView getter of `size` bytes (getFloat32, getInt32).
export function littleEndian(text, read, size) {
  const view = new DataView(Uint8Array.from(atob(text), (c) => c.charCodeAt(0)).buffer);
  return Array.from({ length: view.byteLength / size }, (_, i) => read.call(view, i * size, true));
}
