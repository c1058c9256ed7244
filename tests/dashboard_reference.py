"""The brute-force oracle of feature dashboards: HF hidden states at the SAE's point, the SAE's
reference encoder (``SAE.encode``, float32), every activation of every feature held at once, and
each field computed straight from its definition (docs/dashboards.md) with plain Python where it
matters (bin widths, orders), so it shares no code path with the one-pass implementation. The only
shared piece is ``sample_keys``: the seeded key *is* the definition of a quantile sample."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from steerable.sae.dashboards.grid import sample_keys


def width(peak: float, n: int) -> float:
    """2**e for the smallest integer e with n * 2**e > peak."""
    e = math.frexp(peak)[1] - 60
    while n * 2.0 ** e <= peak:
        e += 1
    return 2.0 ** e


def hf_points(hf, texts_ids: list[list[int]], layer: int, hook: str) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for ids in texts_ids:
            states = hf(torch.tensor([ids]), output_hidden_states=True, use_cache=False).hidden_states
            out.append((states[layer + 1] if hook == "post_mlp" else states[layer])[0].float())
    return out


@dataclass
class RefExample:
    corpus_index: int
    position: int
    value: float
    window: list[float]  # the feature's activations on the window, clipped to the text
    tokens: list[int]


def window(acts: torch.Tensor, ids: list[int], f: int, p: int, before: int, after: int
           ) -> tuple[list[float], list[int]]:
    lo, hi = max(0, p - before), min(len(ids), p + after + 1)
    return acts[lo:hi, f].tolist(), ids[lo:hi]


def reference(acts_per_text: list[torch.Tensor], ids: list[list[int]], features: list[int], n_top: int,
              before: int, after: int, quantiles: int, n_quantile: int, bins: int, seed: int) -> dict[int, dict]:
    """Per feature: tokens, count, max, mean, hist (counts, width), top [RefExample], quantile bins."""
    tokens = sum(len(t) for t in ids)
    out = {}
    for f in features:
        items = [(float(a[p, f]), e, p) for e, a in enumerate(acts_per_text) for p in range(a.shape[0]) if a[p, f] > 0]
        count = len(items)
        peak = max((v for v, _, _ in items), default=0.0)
        ref = {"tokens": tokens, "count": count, "max": peak,
               "mean": math.fsum(v for v, _, _ in items) / count if count else 0.0}
        if count:
            w = width(peak, bins)
            hist = [0] * bins
            for v, _, _ in items:
                hist[int(math.floor(v / w))] += 1
            ref["hist"], ref["hist_width"] = hist, w
        ordered = sorted(items, key=lambda t: (-t[0], t[1], t[2]))[:n_top]
        ref["top"] = [RefExample(e, p, v, *window(acts_per_text[e], ids[e], f, p, before, after))
                      for v, e, p in ordered]
        groups = []
        if count and quantiles:
            q = width(peak, quantiles)
            by_bin: dict[int, list] = {}
            for v, e, p in items:
                by_bin.setdefault(int(math.floor(v / q)), []).append((v, e, p))
            for b in sorted(by_bin):
                members = by_bin[b]
                keys = sample_keys(seed, torch.full((len(members),), f), torch.tensor([m[1] for m in members]),
                                   torch.tensor([m[2] for m in members])).tolist()
                chosen = sorted(zip(keys, members), key=lambda km: (km[0], km[1][1], km[1][2]))[:n_quantile]
                groups.append({"low": b * q, "high": (b + 1) * q, "count": len(members),
                               "examples": [RefExample(e, p, v, *window(acts_per_text[e], ids[e], f, p, before, after))
                                            for _, (v, e, p) in chosen]})
        ref["quantiles"] = groups
        out[f] = ref
    return out


def reference_logits(hf, sae, features: list[int], n: int, unit_offset: bool) -> dict[int, tuple]:
    """Top and bottom ``n`` of ``(W_dec[f] * g) @ W_U.T`` from the HF model's own tensors."""
    g = hf.model.norm.weight.detach().float() + (1.0 if unit_offset else 0.0)
    W_U = hf.get_output_embeddings().weight.detach().float()
    logits = (sae.W_dec.float()[features] * g) @ W_U.T
    top, bottom = logits.topk(n, dim=1), logits.topk(n, dim=1, largest=False)
    return {f: (top.indices[i].tolist(), top.values[i].tolist(), bottom.indices[i].tolist(),
                bottom.values[i].tolist()) for i, f in enumerate(features)}


def ambiguous(acts_pre: torch.Tensor, threshold: torch.Tensor, f: int, n_top: int, grids: list[int],
              margin: float) -> bool:
    """Whether feature ``f`` has an activation within ``margin`` of a decision: its threshold, a bin
    edge of any grid, the grid's own switch (the max near ``n * 2**e``), or a near-tie in its top
    ``n_top + 1`` -- where float32 noise between the engine and HF could flip the outcome."""
    pre = acts_pre[:, f]
    if ((pre - threshold[f]).abs() < margin).any():
        return True
    active = pre[pre > threshold[f]].double()
    if len(active) == 0:
        return False
    peak = float(active.max())
    for n in grids:
        w = width(peak, n)
        frac = active / w
        if ((frac - frac.round()).abs() * w < margin).any() or abs(peak - n * w / 2) < margin:
            return True
    top = active.sort(descending=True).values[:n_top + 1]
    return bool(((top[:-1] - top[1:]) < margin).any())
