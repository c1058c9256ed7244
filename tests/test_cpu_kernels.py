"""The compiled CPU kernels (``steerable.layers.cpu_kernels``) against the PyTorch ops they replace:
rotary bit for bit, norms and SwiGLU to float32 rounding, the KV store into a position-minor K and
skipping padding slots; and the engine's KV cache laid out for them. The attention kernel is
tested in ``test_cpu_attention.py``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from steerable.layers import cpu_kernels
from steerable.layers.activation import silu_and_mul
from steerable.layers.attention import key_cache_view
from steerable.layers.attention_backends import torch_ref
from steerable.layers.norm import RMSNorm
from steerable.layers.rotary import RotaryEmbedding, _rotate

# CI sets STEERABLE_REQUIRE_CPU_KERNELS: there a failed build fails these tests instead of skipping them.
pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None and not os.environ.get("STEERABLE_REQUIRE_CPU_KERNELS"),
                                reason="no CPU kernels here (no compiler)")


def test_rotary_is_bit_exact():
    rotary = RotaryEmbedding(64, 512, 10000.0)
    qkv = torch.randn(37, 960)
    q, k = qkv[:, :576].view(37, 9, 64), qkv[:, 576:768].view(37, 3, 64)  # strided views, as a layer has them
    positions = torch.randint(0, 512, (37,))
    q_out, k_out = rotary(positions, q, k)
    cos, sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)
    assert torch.equal(q_out, _rotate(q, cos, sin)) and torch.equal(k_out, _rotate(k, cos, sin))


def test_norms_and_swiglu_match_pytorch():
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    h, delta = torch.randn(70, 576), torch.randn(70, 576)

    def reference(x):
        return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))

    torch.testing.assert_close(norm(h), reference(h), rtol=2e-6, atol=2e-6)
    hidden, normed = norm.fused_add_norm(h, delta, [])
    assert torch.equal(hidden, h + delta)
    torch.testing.assert_close(normed, reference(h + delta), rtol=2e-6, atol=2e-6)
    gate_up = torch.randn(70, 3072) * 4
    expected = F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    torch.testing.assert_close(silu_and_mul(gate_up), expected, rtol=2e-6, atol=2e-6)


def test_store_kv_into_position_minor_cache():
    blocks, block_size, heads, dim = 6, 4, 2, 8
    k_cache = key_cache_view(torch.zeros(blocks * block_size * heads * dim), blocks, block_size, heads, dim)
    assert k_cache.stride(1) == 1  # laid out for the kernel
    v_cache = torch.zeros(blocks, block_size, heads, dim)
    key, value = torch.randn(5, heads, dim), torch.randn(5, heads, dim)
    slots = torch.tensor([9, -1, 0, 23, 14])  # -1: a padding row, not stored
    torch_ref.store_kv(key, value, k_cache, v_cache, slots)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // block_size, slot % block_size], key[row])
            assert torch.equal(v_cache[slot // block_size, slot % block_size], value[row])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 4


def test_greedy_tokens_are_argmax_first_maximum():
    from steerable.worker.sampler import greedy_tokens

    torch.manual_seed(0)
    for width in [1, 15, 16, 17, 49152, 49157]:
        logits = torch.randn(9, width)
        assert torch.equal(cpu_kernels.kernels().argmax_rows(logits), logits.argmax(-1))
    ties = torch.randint(-2, 2, (64, 100)).float()  # many rows with their maximum at several places
    assert torch.equal(greedy_tokens(ties), ties.argmax(-1))
    special = torch.zeros(4, 40)
    special[0, [3, 33]] = 1.0  # a tie across lanes: the first
    special[1] = float("-inf")  # nothing above -inf: position 0, as torch
    special[2, [5, 30]] = float("nan")  # NaN is the maximum, its first place
    special[3, 39] = 2.0  # in the tail past the last whole group of lanes
    assert greedy_tokens(special).tolist() == special.argmax(-1).tolist() == [3, 0, 5, 39]
    wide = torch.randn(3, 64)[:, ::2]  # strided rows: the PyTorch path, same answer
    assert torch.equal(greedy_tokens(wide), wide.argmax(-1))
