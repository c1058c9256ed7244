"""The formulas of LowRank, Affine, When and RouterBias applied by HF hooks (``hf_oracle.HFSteered``
edits), written from the issue's definitions and sharing no code with the engine; and the check
these items' test modules share (a batch under chunked prefill and under preemption).

A gate's reading is recorded by an edit placed before the gated ones at its hook point (HFSteered
applies a point's edits in order); greedy decoding recomputes every position each step, so the
gate sees all rows, the prompt's first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from steerable.selection import SelectSpec

Fn = Callable[[torch.Tensor], torch.Tensor]


def orthonormal_rows(rank: int, size: int, seed: int) -> torch.Tensor:
    """R [rank, size] with orthonormal rows."""
    q, _ = torch.linalg.qr(torch.randn(size, rank, generator=torch.Generator().manual_seed(seed)))
    return q.T.contiguous()


def rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def lowrank_delta(R: torch.Tensor, W: torch.Tensor, b: torch.Tensor) -> Fn:
    """LoReFT's change: ``R^T (W h + b - R h)``."""
    return lambda h: (h @ W.T + b - h @ R.T) @ R


def affine_delta(A, c: torch.Tensor | None = None) -> Fn:
    """``A h + c``, or ``U (V h) + c`` for ``A = (U, V)``."""
    c = 0.0 if c is None else c
    if isinstance(A, tuple):
        U, V = A
        return lambda h: (h @ V.T) @ U.T + c
    return lambda h: h @ A.T + c


def edits_at_once(*deltas: Fn) -> Fn:
    """Edits at one hook point read the same stream; their changes are summed."""
    return lambda h: h + sum(delta(h) for delta in deltas)


def plus(delta: Fn) -> Fn:
    return lambda h: h + delta(h)


class Gate:
    """A ``When``'s gate: ``read()`` is the edit recording each row's outcome at the gate's point,
    ``gated(fn, select)`` an edit applying ``fn`` only where the gate passed (and ``select`` holds).
    ``feature=(e, bias, floor)`` reads an SAE feature's activation instead of a projection."""

    def __init__(self, direction=None, threshold: float = 0.0, compare: str = ">", scope: str = "token",
                 prompt_len: int | None = None, feature: tuple | None = None):
        self.feature = feature
        self.direction = None if direction is None else torch.as_tensor(direction, dtype=torch.float32)
        self.threshold, self.compare, self.scope, self.prompt_len = threshold, compare, scope, prompt_len
        self.mask: torch.Tensor | None = None
        self.means: list[float] = []  # each forward's prompt mean (scope "prompt")

    def value(self, h: torch.Tensor) -> torch.Tensor:
        if self.feature is not None:
            e, bias, floor = self.feature
            p = h @ e + bias
            return torch.where(p > floor, p, torch.zeros_like(p))
        return h @ (self.direction / self.direction.norm())

    def passes(self, value: torch.Tensor) -> torch.Tensor:
        return value > self.threshold if self.compare == ">" else value < self.threshold

    def read(self) -> Fn:
        def fn(h: torch.Tensor) -> torch.Tensor:
            value = self.value(h)
            if self.scope == "token":
                self.mask = self.passes(value)
            else:
                mean = value[:self.prompt_len].mean()
                self.means.append(float(mean))
                self.mask = self.passes(mean) & (torch.arange(len(h)) >= self.prompt_len)
            return h
        return fn

    def gated(self, fn: Fn, select: SelectSpec | None = None) -> Fn:
        def apply(h: torch.Tensor) -> torch.Tensor:
            mask = self.mask
            if select is not None:
                mask = mask & select.mask(torch.arange(len(h)), self.prompt_len, torch.zeros(len(h), dtype=torch.long))
            return torch.where(mask[:, None], fn(h), h)
        return apply


def patch_router(model, layer: int, bias: torch.Tensor) -> Callable[[], None]:
    """Add ``bias`` to the router logits of HF Qwen3-MoE layer ``layer`` before softmax and top-k
    (the router computes and consumes them inside one forward, so the oracle replaces it);
    returns the undo."""
    gate = model.model.layers[layer].mlp.gate
    original = gate.forward

    def forward(hidden_states):
        hidden_states = hidden_states.reshape(-1, gate.hidden_dim)
        logits = F.linear(hidden_states, gate.weight) + bias
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top, indices = torch.topk(probs, gate.top_k, dim=-1)
        if gate.norm_topk_prob:
            top /= top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), indices

    gate.forward = forward
    return lambda: setattr(gate, "forward", original)


def check_chunked_and_preempted(path: str, prompts: list[list[int]], params: list, kv_cache_tokens: int) -> None:
    """The batch under 16-token prefill chunks, and with a KV cache of ``kv_cache_tokens`` (small
    enough to preempt), gives a cold engine's tokens (each request alone, no prefix cache) and frees
    every steering row."""
    from steerable import LLM

    ref = LLM(path, device="cpu", kv_cache_tokens=8192, enable_prefix_caching=False)
    expected = [ref.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    for kw in (dict(max_num_batched_tokens=16), dict(kv_cache_tokens=kv_cache_tokens)):
        llm = LLM(path, device="cpu", **{"kv_cache_tokens": 8192, **kw})
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
        if "max_num_batched_tokens" not in kw:
            assert llm.engine.stats()["num_preemptions"] > 0
        assert llm.get_steering_status()["rows_in_use"] == 0
