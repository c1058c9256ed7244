"""Gated activations on a fused [gate | up] projection."""

import torch
import torch.nn.functional as F

from steerable.layers import fused


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Llama, Qwen)."""
    if fused.enabled(gate_up) and gate_up.dim() == 2:
        return fused.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh-approximated GELU (Gemma's ``gelu_pytorch_tanh``)."""
    if fused.enabled(gate_up) and gate_up.dim() == 2:
        return fused.gelu_tanh_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}
