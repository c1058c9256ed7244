"""The SAE plane on the worker: each registered SAE's and transcoder's encoders on the device, the
feature capture math (encode the gathered rows, keep each row's highest features) run inside the
step, and a transcoder's reconstruction for its error node.

The driver ships an SAE once, when it is registered (``SaeUpdate`` in the next step's message,
keyed by name and registration, so a CUDA graph that baked in one SAE's tables never reads
another's); a transcoder's decoders follow when an error capture first asks for them. A pipeline
stage keeps only the dictionaries at its own layers. Weights stay in the model dtype; the products
accumulate and the activation runs in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from steerable.step import SaeUpdate, SaeWeights, Site, TranscoderDecoders, TranscoderWeights

# Rows encoded at once: bounds the float32 [rows, d_sae] temporaries of a long prefill chunk.
ENCODE_CHUNK = 2048


def _mm_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight`` accumulated and returned in float32 (``x`` cast to the weight's dtype)."""
    x = x.to(weight.dtype)
    if x.is_cuda and x.dtype != torch.float32:  # cuBLAS accumulates and writes float32 directly
        return torch.mm(x, weight, out_dtype=torch.float32)
    return torch.mm(x, weight).float()


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
        pre = _mm_float32(x, self.W_enc)
        pre += self.bias
        if self.threshold is not None:
            pre.mul_(pre > self.threshold)
        return pre.relu_()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [rows, d_sae]: ``SAE.encode``, a top-k SAE's top-k included."""
        acts = self.activations(x)
        if self.architecture == "topk" and self.k < self.d_sae:
            values, indices = torch.topk(acts, self.k, dim=-1, sorted=False)
            acts = torch.zeros_like(acts).scatter_(-1, indices, values)
        return acts

    def top_features(self, x: torch.Tensor, top_k: int, out: torch.Tensor, offset: int = 0) -> None:
        """Write each row's ``top_k`` highest activations into ``out`` (float32 [rows, 2 * top_k]):
        int32 indices (plus ``offset``, as float32 bits) then values, highest first; inactive slots
        are -1 / 0."""
        keep = min(top_k, self.k) if self.architecture == "topk" else top_k
        for start in range(0, x.shape[0], ENCODE_CHUNK):
            rows = x[start:start + ENCODE_CHUNK]
            values, indices = torch.topk(self.activations(rows), keep, dim=-1, sorted=True)
            active = values > 0
            chunk = out[start:start + ENCODE_CHUNK]
            chunk[:, :keep].copy_(torch.where(active, indices + offset, -1).to(torch.int32).view(torch.float32))
            chunk[:, top_k:top_k + keep].copy_(torch.where(active, values, 0.0))
            if keep < top_k:  # a top-k SAE with k below the requested count: the rest stay empty
                chunk[:, keep:top_k].copy_(torch.full_like(chunk[:, keep:top_k], -1, dtype=torch.int32)
                                           .view(torch.float32))
                chunk[:, top_k + keep:].zero_()


class _DeviceTranscoder:
    """A transcoder's encoders on the device (one per source layer from ``layer`` on) and, once an
    error capture has asked, its decoders."""

    def __init__(self, weights: TranscoderWeights, device: torch.device, dtype: torch.dtype):
        self.layer = weights.layer
        self.hook = weights.hook
        self.device, self.dtype = device, dtype
        self.encoders = [_DeviceSae(w, device, dtype) for w in weights.encoders]
        self.W_dec: list[torch.Tensor] | None = None
        self.b_dec: torch.Tensor | None = None
        self.W_skip: torch.Tensor | None = None

    @property
    def d_transcoder(self) -> int:
        return self.encoders[0].d_sae

    def set_decoders(self, decoders: TranscoderDecoders) -> None:
        self.W_dec = [w.to(self.device, self.dtype) for w in decoders.W_dec]
        self.b_dec = decoders.b_dec.to(self.device, torch.float32)
        self.W_skip = None if decoders.W_skip is None else decoders.W_skip.to(self.device, self.dtype)

    def top_features(self, layer: int, x: torch.Tensor, top_k: int, out: torch.Tensor) -> None:
        source = layer - self.layer
        self.encoders[source].top_features(x, top_k, out, offset=source * self.d_transcoder)

    def reconstruct_from(self, layer: int, x: torch.Tensor, recon: torch.Tensor, position: int) -> None:
        """Add what the input ``x`` [rows, d_in] read at ``layer`` contributes to the reconstruction
        ``recon`` (float32 [layers, rows, d_out], ``position`` = this layer's index in it): its
        features' decoder rows at each output layer they reach, and this layer's bias and skip term."""
        source = layer - self.layer
        acts = self.encoders[source].encode(x)
        decoders = self.W_dec[source]  # [d_tc, span, d_out]
        span, d_out = decoders.shape[1:]
        contribution = _mm_float32(acts, decoders.reshape(decoders.shape[0], span * d_out))
        recon[position:position + span] += contribution.view(-1, span, d_out).transpose(0, 1)
        recon[position] += self.b_dec[source]
        if self.W_skip is not None:
            recon[position] += _mm_float32(x, self.W_skip[source])


class SaeTables:
    """The worker's SAEs and transcoders by key. ``owns(site)``: whether this rank runs that site
    (pipeline stage)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, owns: Callable[[Site], bool] = lambda site: True):
        self.device = device
        self.dtype = dtype
        self.owns = owns
        self.saes: dict[str, _DeviceSae] = {}
        self.transcoders: dict[str, _DeviceTranscoder] = {}

    def apply(self, update: SaeUpdate) -> None:
        for key in update.remove:
            self.saes.pop(key, None)
            self.transcoders.pop(key, None)
        for key, weights in update.add.items():
            if self.owns((weights.hook, weights.layer)):
                self.saes[key] = _DeviceSae(weights, self.device, self.dtype)
        for key, transcoder in update.transcoders.items():
            if any(self.owns((transcoder.hook, w.layer)) for w in transcoder.encoders):
                self.transcoders[key] = _DeviceTranscoder(transcoder, self.device, self.dtype)
        for key, decoders in update.decoders.items():
            if key in self.transcoders:
                self.transcoders[key].set_decoders(decoders)

    def top_features(self, key: str, layer: int, x: torch.Tensor, top_k: int, out: torch.Tensor) -> None:
        if key in self.saes:
            self.saes[key].top_features(x, top_k, out)
        else:
            self.transcoders[key].top_features(layer, x, top_k, out)
