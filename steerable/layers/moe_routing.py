"""MoE routing (softmax over the experts, top-k, optional renormalisation) in one kernel.

In eager PyTorch the router's softmax, ``topk`` (a gather and a sort), the sum and the divide are
5-6 kernels per layer; at batch-1 decode their launches, not their bytes, set the time. Here one
program per token reads its logits once and writes its ``k`` expert ids and weights, computed the
way the PyTorch code computes them (float32 softmax, then the selected probabilities divided by
their sum), so the two agree to float32 rounding. The PyTorch code stays the CPU path and the
reference in tests.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never take this path (fused.enabled is False)
    triton = None


def route_topk_reference(router_logits: torch.Tensor, top_k: int,
                         renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_topk`` in tensor ops (any device; the kernel's oracle)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights


if triton is not None:

    @triton.jit
    def _route_topk_kernel(logits_ptr, experts_ptr, weights_ptr, stride_t, NUM_EXPERTS: tl.constexpr,
                           E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                           RENORMALIZE: tl.constexpr):
        """Program t: token t's softmax over the experts in float32, then ``TOP_K`` rounds of
        argmax (ties to the lowest expert id), each taking its pick out of the running."""
        t = tl.program_id(0)
        offs = tl.arange(0, E_PAD)
        valid = offs < NUM_EXPERTS
        x = tl.load(logits_ptr + t.to(tl.int64) * stride_t + offs, mask=valid, other=-float("inf"))
        # float64 exp and sum, rounded once: a GPU's float32 exp is an approximation, torch's is not,
        # and the probabilities must agree with torch's to float32 rounding
        x = x.to(tl.float64)
        e = tl.exp(x - tl.max(x, 0))
        left = tl.where(valid, (e / tl.sum(e, 0)).to(tl.float32), -1.0)  # padding never wins
        slots = tl.arange(0, K_PAD)
        top = tl.zeros((K_PAD,), dtype=tl.float32)
        ids = tl.zeros((K_PAD,), dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best, pick = tl.max(left, 0, return_indices=True, return_indices_tie_break_left=True)
            top = tl.where(slots == j, best, top)
            ids = tl.where(slots == j, pick, ids)
            left = tl.where(offs == pick, -1.0, left)
        if RENORMALIZE:
            top = top / tl.sum(top, 0)  # the padding slots hold 0
        out = t.to(tl.int64) * TOP_K + slots
        tl.store(experts_ptr + out, ids.to(tl.int64), mask=slots < TOP_K)
        tl.store(weights_ptr + out, top.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
               weight_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k] int64, weights [T, k]) of router logits [T, E] (any float dtype): the
    ``top_k`` largest softmax probabilities in descending order (ties to the lowest expert id),
    divided by their sum with ``renormalize``, computed in float32 and stored as ``weight_dtype``
    (rounded as ``.to(weight_dtype)`` rounds: the cast is not a launch of its own). One launch,
    none for T = 0."""
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in 1..{num_experts}")
    device = router_logits.device
    experts = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    weights = torch.empty(num_tokens, top_k, dtype=weight_dtype, device=device)
    if num_tokens == 0:
        return experts, weights
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    e_pad = triton.next_power_of_2(num_experts)
    _route_topk_kernel[(num_tokens,)](logits, experts, weights, logits.stride(0), NUM_EXPERTS=num_experts,
                                      E_PAD=e_pad, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
                                      RENORMALIZE=renormalize, num_warps=min(4, max(1, e_pad // 256)))
    return experts, weights
