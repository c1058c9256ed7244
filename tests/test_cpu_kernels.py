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


@pytest.mark.skipif(cpu_kernels.kernels() is None or not cpu_kernels.kernels().LINEAR_ROW, reason="no AVX-512 here")
def test_one_row_linear_matches_f_linear():
    from steerable.layers import gemv

    torch.manual_seed(0)
    for n, k in [(960, 576), (7, 64), (33, 1), (5, 17), (300, 100), (2, 1536)]:  # tails of 16 and of 64 lanes
        x, weight, bias = torch.randn(1, k), torch.randn(n, k), torch.randn(n)
        for b in (None, bias):
            got = cpu_kernels.kernels().linear_row(x, weight, b)
            torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5 * k ** 0.5)
    wide = torch.randn(40, 150)
    strided = wide[:, :100]  # rows 150 apart, as a slice of a fused weight
    x = torch.randn(1, 100)
    torch.testing.assert_close(cpu_kernels.kernels().linear_row(x, strided, None), F.linear(x, strided))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # output rows split over threads: the same values
    try:
        big = torch.randn(4096, 64)
        torch.testing.assert_close(cpu_kernels.kernels().linear_row(x[:, :64], big, None), F.linear(x[:, :64], big))
    finally:
        torch.set_num_threads(previous)
    # the engine's linear takes it at one row only; more rows keep oneDNN's packed weights
    weight = torch.randn(96, 64)
    one, many = torch.randn(1, 64), torch.randn(3, 64)
    torch.testing.assert_close(gemv.linear(one, weight), F.linear(one, weight))
    assert not hasattr(weight, "_onednn_packed")
    torch.testing.assert_close(gemv.linear(many, weight), F.linear(many, weight))
    assert hasattr(weight, "_onednn_packed")
    with pytest.raises(RuntimeError, match="x \\[1, K\\]"):
        cpu_kernels.kernels().linear_row(many, weight, None)


def test_long_prefill_mlp_in_row_slices_equals_the_whole():
    """A CPU step of more than ``CPU_MLP_ROWS`` rows runs its gated MLP a slice of rows at a time:
    the same values as one product over all rows, and a short step is not sliced."""
    from steerable.layers import gemv
    from steerable.models.llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(64, 160)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.1)
    rows = 2 * gemv.CPU_MLP_ROWS + 76
    x = torch.randn(rows, 64)
    assert [len(p) for p in gemv.cpu_row_chunks(x, mlp.down_proj.weight)] == [gemv.CPU_MLP_ROWS] * 2 + [76]
    assert len(gemv.cpu_row_chunks(x[:gemv.CPU_MLP_ROWS], mlp.down_proj.weight)) == 1
    with torch.no_grad():
        whole = mlp.down_proj(mlp.gate_up_proj(x), gated="silu")
        assert torch.equal(mlp(x), whole)
        assert whole.abs().mean() > 0.01  # a real output, not zeros on both sides


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no C++ compiler here")
def test_a_builder_killed_midway_does_not_block_the_next():
    """PyTorch's builder leaves its ``lock`` file behind when it is killed mid-build; the next
    process must still load the kernels (before, it waited on that file forever)."""
    import subprocess
    import sys

    folder = cpu_kernels.build_directory()
    stale = os.path.join(folder, "lock")
    with cpu_kernels._one_builder(folder):  # made while no builder runs, as a killed one leaves it
        open(stale, "w").close()
    code = "from steerable.layers import cpu_kernels; assert cpu_kernels.kernels() is not None"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "STEERABLE_CPU_KERNELS": "1"})
    assert done.returncode == 0, done.stderr
    assert not os.path.exists(stale)
