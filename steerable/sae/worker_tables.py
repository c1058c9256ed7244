"""The SAE plane on the worker: each registered SAE's encoder on the device, and the feature
capture math (encode the gathered rows, keep each row's highest features) run inside the step.

The driver ships an SAE once, when it is registered (``SaeUpdate`` in the next step's message,
keyed by name and registration, so a CUDA graph that baked in one SAE's tables never reads
another's); a pipeline stage keeps only the SAEs at its own layers. Weights stay in the model
dtype; the products accumulate and the activation runs in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from steerable.step import SaeUpdate, SaeWeights, Site

# Rows encoded at once: bounds the float32 [rows, d_sae] temporaries of a long prefill chunk.
ENCODE_CHUNK = 2048


class _DeviceSae:
    """One SAE's encoder on the device, with ``b_dec`` folded into the bias (one GEMM per chunk)."""

    def __init__(self, weights: SaeWeights, device: torch.device, dtype: torch.dtype):
        self.architecture = weights.architecture
        self.k = weights.k
        self.W_enc = weights.W_enc.to(device=device, dtype=dtype)
        bias = weights.b_enc.to(device=device, dtype=torch.float32)
        if weights.b_dec_in is not None:  # (x - b) @ W + c == x @ W + (c - b @ W)
            bias = bias - weights.b_dec_in.to(device=device, dtype=torch.float32) @ self.W_enc.float()
        self.bias = bias
        self.threshold = None if weights.threshold is None else weights.threshold.to(device, torch.float32)

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [rows, d_sae]: the reference math of ``SAE.encode`` before a top-k SAE's top-k."""
        if x.is_cuda and x.dtype != torch.float32:  # cuBLAS accumulates and writes float32 directly
            pre = torch.mm(x, self.W_enc, out_dtype=torch.float32)
        else:
            pre = torch.mm(x, self.W_enc).float()
        pre += self.bias
        if self.threshold is not None:
            pre.mul_(pre > self.threshold)
        return pre.relu_()

    def top_features(self, x: torch.Tensor, top_k: int, out: torch.Tensor) -> None:
        """Write each row's ``top_k`` highest activations into ``out`` (float32 [rows, 2 * top_k]):
        int32 indices (as float32 bits) then values, highest first; inactive slots are -1 / 0."""
        keep = min(top_k, self.k) if self.architecture == "topk" else top_k
        for start in range(0, x.shape[0], ENCODE_CHUNK):
            rows = x[start:start + ENCODE_CHUNK]
            values, indices = torch.topk(self.activations(rows), keep, dim=-1, sorted=True)
            active = values > 0
            chunk = out[start:start + ENCODE_CHUNK]
            chunk[:, :keep].copy_(torch.where(active, indices, -1).to(torch.int32).view(torch.float32))
            chunk[:, top_k:top_k + keep].copy_(torch.where(active, values, 0.0))
            if keep < top_k:  # a top-k SAE with k below the requested count: the rest stay empty
                chunk[:, keep:top_k].copy_(torch.full_like(chunk[:, keep:top_k], -1, dtype=torch.int32)
                                           .view(torch.float32))
                chunk[:, top_k + keep:].zero_()


class SaeTables:
    """The worker's SAEs by key. ``owns(site)``: whether this rank runs that site (pipeline stage)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, owns: Callable[[Site], bool] = lambda site: True):
        self.device = device
        self.dtype = dtype
        self.owns = owns
        self.saes: dict[str, _DeviceSae] = {}

    def apply(self, update: SaeUpdate) -> None:
        for key in update.remove:
            self.saes.pop(key, None)
        for key, weights in update.add.items():
            if self.owns((weights.hook, weights.layer)):
                self.saes[key] = _DeviceSae(weights, self.device, self.dtype)

    def top_features(self, key: str, x: torch.Tensor, top_k: int, out: torch.Tensor) -> None:
        self.saes[key].top_features(x, top_k, out)
