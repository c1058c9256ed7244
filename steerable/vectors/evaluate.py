"""``evaluate``: two-choice items (CAA's A/B protocol or two completions, see ``items``) swept
over steering scales, plus a side-effect check on neutral text.

The engine returns the log-probabilities of both answer tokens at the answer position
(``SamplingParams.logprob_token_ids``). Per scale ``s`` (a per-request steering spec; every scale
of every item in one batched ``generate``, after one unsteered pass):

- ``p_match``: mean over items of p(matching) / (p(matching) + p(other));
- ``logit_diff``: mean over items of log p(matching) - log p(other) (the logit difference);
- ``wrong_way``: fraction of items whose logit difference moved against the sign of ``s``
  relative to the unsteered run (0 at ``s = 0``);
- ``kl``: mean over neutral prompts of KL(steered || unsteered) in nats, over the full next-token
  distribution at the end of each prompt (``logprobs=-1``); None when no neutral prompts are given.

The report also gives each item's steerability (least-squares slope of its logit difference over
the scales) and the fraction of anti-steerable items (negative slope), as Tan et al. recommend.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from steerable.errors import InvalidRequestError
from steerable.sampling_params import SamplingParams
from steerable.selection import SelectSpec
from steerable.vectors.control_vector import ControlVector
from steerable.vectors.items import ABItem

# Rows steered under each ``positions`` mode: every token (a llama.cpp control vector), or from
# the last prompt token (the answer's opening) on, as CAA steers.
POSITIONS = {"all": None, "answer": SelectSpec(prompt_positions=[-1], generation="all")}


@dataclass(frozen=True)
class EvalRow:
    scale: float
    p_match: float
    logit_diff: float
    wrong_way: float
    kl: float | None


@dataclass
class EvalReport:
    rows: list[EvalRow]
    logit_diffs: np.ndarray  # [items, scales], in the order of ``rows``
    relative: bool

    @property
    def scales(self) -> list[float]:
        return [row.scale for row in self.rows]

    @property
    def slopes(self) -> np.ndarray:
        """Per item: least-squares slope of the logit difference over the scales."""
        x = np.asarray(self.scales) - np.mean(self.scales)
        return (self.logit_diffs - self.logit_diffs.mean(axis=1, keepdims=True)) @ x / max(float(x @ x), 1e-12)

    @property
    def steerability(self) -> float:
        return float(self.slopes.mean())

    @property
    def anti_steerable(self) -> float:
        return float((self.slopes < 0).mean())

    def to_markdown(self) -> str:
        unit = " (x residual norm)" if self.relative else ""
        lines = [f"| scale{unit} | p(matching) | logit diff | wrong way | KL on neutral text |",
                 "|---:|---:|---:|---:|---:|"]
        for r in self.rows:
            kl = "n/a" if r.kl is None else f"{r.kl:.4f}"
            lines.append(f"| {r.scale:g} | {r.p_match:.3f} | {r.logit_diff:+.3f} | {r.wrong_way:.2f} | {kl} |")
        lines.append(f"\n{len(self.logit_diffs)} items; steerability (mean slope of the logit difference) "
                     f"{self.steerability:+.3f} per unit of scale; {self.anti_steerable:.0%} anti-steerable")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike) -> None:
        """p(matching) and KL against the scale, one PNG (a bare matplotlib Figure: no display, no
        change to the global pyplot backend)."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6, 4))
        left = fig.subplots()
        left.plot(self.scales, [r.p_match for r in self.rows], "o-", color="tab:blue")
        left.set_xlabel("scale" + (" (x residual norm)" if self.relative else ""))
        left.set_ylabel("p(matching)", color="tab:blue")
        left.set_ylim(0, 1)
        left.axhline(0.5, color="grey", lw=0.5)
        if all(r.kl is not None for r in self.rows):
            right = left.twinx()
            right.plot(self.scales, [r.kl for r in self.rows], "s--", color="tab:red")
            right.set_ylabel("KL on neutral text (nats)", color="tab:red")
        fig.tight_layout()
        fig.savefig(path, dpi=120)


def evaluate(llm: Any, cv: ControlVector, items: Sequence[Any], scales: Sequence[float] = (-2, -1, 0, 1, 2),
             relative: bool = False, positions: str = "all", neutral: Sequence[str] | None = None,
             chat: bool | None = None) -> EvalReport:
    """Sweep ``cv.to_spec(scale, relative)`` over ``scales`` on two-choice ``items`` (dicts or
    ``ABItem``; see the module doc).

    ``positions="all"`` steers every token, as ``generate --control-vector`` does; ``"answer"``
    steers from the last prompt token on (CAA), so every scale reuses the unsteered prompt's KV
    through the prefix cache. ``neutral`` defaults to the packaged neutral prompts (``[]`` skips
    the KL); ``chat`` (default: when the tokenizer has a template) puts letter questions in a user turn.
    """
    parsed = [ABItem.parse(item, f"items[{i}]") for i, item in enumerate(items)]
    if not parsed:
        raise InvalidRequestError("items: at least one item is required")
    scale_list = [float(s) for s in scales]
    if not scale_list or not all(math.isfinite(s) for s in scale_list):
        raise InvalidRequestError(f"scales: expected finite numbers, got {list(scales)!r}")
    if positions not in POSITIONS:
        raise InvalidRequestError(f"positions: expected one of {list(POSITIONS)}, got {positions!r}")
    if neutral is None:
        from steerable.vectors.datafiles import neutral_prompts
        neutral = neutral_prompts()
    steered = sorted(set(scale_list) - {0.0})
    specs = {s: cv.to_spec(s, relative, POSITIONS[positions]) for s in steered}  # checked before any request
    tok = llm.get_tokenizer()
    if tok is None:
        raise InvalidRequestError("items: this model has no tokenizer, and items are text")
    chat = bool(getattr(tok, "chat_template", None)) if chat is None else chat
    tokens = [item.tokens(tok, chat, f"items[{i}]") for i, item in enumerate(parsed)]
    prompts = [ids for ids, _, _ in tokens] + [tok(text, add_special_tokens=True).input_ids for text in neutral]

    def run(spec: Any) -> list[SamplingParams]:
        full = SamplingParams(max_tokens=1, temperature=0, logprobs=-1, steering_vectors=spec)
        return [SamplingParams(max_tokens=1, temperature=0, logprob_token_ids=[m, o], steering_vectors=spec)
                for _, m, o in tokens] + [full] * len(neutral)

    # Unsteered first, on its own: its prompt blocks are cached before any steered request runs.
    outs = {0.0: llm.generate(prompts, run(None), use_tqdm=False)}
    if steered:
        flat = llm.generate(prompts * len(steered), [p for s in steered for p in run(specs[s])], use_tqdm=False)
        outs.update({s: flat[k * len(prompts):(k + 1) * len(prompts)] for k, s in enumerate(steered)})
    diffs = {s: np.array([_answer_diff(out, m, o) for out, (_, m, o) in zip(chunk, tokens)])
             for s, chunk in outs.items()}
    dists = {s: [_distribution(out) for out in chunk[len(parsed):]] for s, chunk in outs.items()}
    rows = []
    for s in scale_list:
        moved = (diffs[s] - diffs[0.0]) * np.sign(s)
        kl = float(np.mean([_kl(p, q) for p, q in zip(dists[s], dists[0.0])])) if neutral else None
        rows.append(EvalRow(s, float(np.mean(1 / (1 + np.exp(-diffs[s])))), float(diffs[s].mean()),
                            float((moved < 0).mean()), kl))
    return EvalReport(rows, np.stack([diffs[s] for s in scale_list], axis=1), relative)


def _answer_diff(out: Any, matching: int, other: int) -> float:
    entry = out.outputs[0].logprobs[0]
    return entry[matching].logprob - entry[other].logprob


def _distribution(out: Any) -> np.ndarray:
    entry = out.outputs[0].logprobs[0]
    logprobs = np.empty(len(entry))
    for token, lp in entry.items():
        logprobs[token] = lp.logprob
    return logprobs


def _kl(steered: np.ndarray, base: np.ndarray) -> float:
    """KL(steered || base) in nats from two full log-probability vectors."""
    return float(np.sum(np.exp(steered) * (steered - base)))
