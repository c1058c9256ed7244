"""Activations of the MLP: gated ones on a fused [gate | up] projection, and the ungated GELUs of
GPT-2 and GPT-NeoX, named as HF's ``hidden_act`` / ``activation_function`` name them."""

import math

import torch
import torch.nn.functional as F

from steerable.layers import cpu_kernels, fused


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Llama, Qwen)."""
    if fused.enabled(gate_up) and gate_up.dim() == 2:
        return fused.silu_and_mul(gate_up)
    if gate_up.dim() == 2 and cpu_kernels.applies(gate_up) and gate_up.stride(-1) == 1:
        return cpu_kernels.kernels().silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh-approximated GELU (Gemma's ``gelu_pytorch_tanh``)."""
    if fused.enabled(gate_up) and gate_up.dim() == 2:
        return fused.gelu_tanh_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU, op for op as HF's ``NewGELUActivation`` (so a bf16 run rounds where HF does)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """HF's ``gelu_pytorch_tanh``: torch's tanh GELU, one rounding."""
    return F.gelu(x, approximate="tanh")


# HF activation name -> function, for the ungated MLPs (GPT-2, GPT-NeoX).
ACTIVATIONS = {"gelu": F.gelu, "gelu_new": gelu_new, "gelu_pytorch_tanh": gelu_tanh, "relu": F.relu}


def activation(name: str, field: str):
    """The ungated activation HF calls ``name``; ``ValueError`` naming the config ``field`` otherwise."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{field}={name!r} is not supported (supported: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]
