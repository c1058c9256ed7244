"""The decode-batch GEMM kernel (steerable.layers.skinny_gemm) against ``F.linear``.

On CUDA it runs on the GPU (bf16, as the engine uses it, and float32); without CUDA, under
`TRITON_INTERPRET=1` in float32 (set before Triton loads).
"""

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not torch.cuda.is_available() and not INTERPRET:
    pytest.skip("no CUDA GPU: run `TRITON_INTERPRET=1 python -m pytest tests/test_skinny_gemm.py`",
                allow_module_level=True)

from steerable.layers import fused, gemv, skinny_gemm  # noqa: E402
from steerable.layers.skinny_gemm import Tiles  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
ACT = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


def _close(out, ref, dtype):
    """Relative norm error against a float32 reference from the same (rounded) inputs."""
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    return err.item() <= (1e-5 if dtype == torch.float32 else 1e-2)


def _reference(x, w, b, gated):
    x = x.float()
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = ACT[gated](gate) * up
    return F.linear(x, w.float(), None if b is None else b.float())


def _counters_zero():
    return all(int(c.abs().sum()) == 0 for c in skinny_gemm._COUNTER_SETS.values())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, out_features, in_features", [(2, 40, 48), (17, 70, 300), (33, 64, 256)])
@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("gated", [None, "silu", "gelu_tanh"])
def test_skinny_linear_equals_linear(dtype, rows, out_features, in_features, split_k, gated):
    """Every tile edge (rows, N and K not multiples of the tiles), split or not, with a bias and
    the gated prologue; a split call leaves its tile counters zero for the next one."""
    g = torch.Generator().manual_seed(rows * out_features + split_k)
    w = (torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).to(DEVICE, dtype)
    b = torch.randn(out_features, generator=g).to(DEVICE, dtype)
    x = torch.randn(rows, (2 if gated else 1) * in_features, generator=g).to(DEVICE, dtype)
    tiles = Tiles(16 if rows <= 16 else 32, 32, 32, split_k, 4, 2)
    out = skinny_gemm.skinny_linear(x, w, b, gated, tiles)
    assert out.shape == (rows, out_features) and out.dtype == dtype
    assert _close(out, _reference(x, w, b, gated), dtype)
    assert _counters_zero()


@pytest.mark.parametrize("split_k", [1, 4])
def test_split_sums_in_a_fixed_order(split_k):
    """The partial sums are added in split order whichever program finishes last: calls repeat
    bit for bit."""
    g = torch.Generator().manual_seed(split_k)
    dtype = DTYPES[-1]
    w = torch.randn(96, 512, generator=g).to(DEVICE, dtype)
    x = torch.randn(24, 512, generator=g).to(DEVICE, dtype)
    tiles = Tiles(32, 32, 32, split_k, 4, 2)
    first = skinny_gemm.skinny_linear(x, w, None, None, tiles)
    for _ in range(3):
        assert torch.equal(skinny_gemm.skinny_linear(x, w, None, None, tiles), first)


def test_picked_tiles_cover_every_decode_batch():
    """The tiles ``pick_tiles`` gives for a model's projections at 2 to 256 rows: valid, and the
    split grows only while it adds programs, not past the counters."""
    for n, k in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (40, 48)]:
        for m in [2, 3, 16, 17, 64, 100, 255, 256]:
            t = skinny_gemm.pick_tiles(m, n, k)
            assert t.block_m in (16, 32, 64) and t.split_k >= 1
            assert -(-n // t.block_n) * -(-m // t.block_m) <= skinny_gemm._COUNTERS
            assert t.split_k == 1 or t.block_k * t.split_k <= k


def test_eligibility():
    """A CUDA decode batch in a 16-bit dtype takes the kernel; one row (the GEMV's), more than
    ``MAX_ROWS`` rows, float32, a transposed weight or a CPU tensor do not."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = torch.randn(32, 16, device=dev, dtype=torch.bfloat16)
    batch = torch.randn(8, 16, device=dev, dtype=torch.bfloat16)
    assert skinny_gemm.eligible(batch, w) == (dev == "cuda")
    assert not skinny_gemm.eligible(batch[:1], w)
    assert not skinny_gemm.eligible(torch.randn(skinny_gemm.MAX_ROWS + 1, 16, device=dev, dtype=torch.bfloat16), w)
    assert not skinny_gemm.eligible(batch.float(), w.float())
    assert not skinny_gemm.eligible(batch, torch.randn(16, 32, device=dev, dtype=torch.bfloat16).t())
    assert not skinny_gemm.eligible(batch.cpu(), w.cpu())


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs and programmatic dependent launch need a GPU")
@pytest.mark.parametrize("rows", [2, 37, 128, 256])
def test_chained_projections_in_a_cuda_graph(rows):
    """A chain of projections, each reading the one before's output, as the layers of a decode
    step do: replayed from a CUDA graph (with programmatic dependent launch on Hopper, where a
    kernel starts before its predecessor ends) it equals the same chain run eagerly, and both
    are within bf16 rounding of float32."""
    g = torch.Generator().manual_seed(rows)
    dtype = torch.bfloat16
    shapes = [(4096, 1024, None), (1024, 4096, None), (6144, 1024, None), (1024, 3072, "silu"), (1024, 1024, None)]
    weights = [(torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype) for n, k, _ in shapes]
    x = torch.randn(rows, 1024, generator=g).to(DEVICE, dtype)

    def chain(h):
        for w, (_, _, gated) in zip(weights, shapes):
            h = gemv.gated_linear(h, w, None, gated) if gated else gemv.linear(h, w)
        return h

    assert skinny_gemm.eligible(x, weights[0])
    eager = chain(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = chain(x)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager)
    ref = x.float()
    for w, (_, _, gated) in zip(weights, shapes):
        ref = _reference(ref.to(dtype), w, None, gated)
    assert _close(eager, ref, dtype)
    assert _counters_zero()
    assert fused.pdl_args(x)["PDL"] == (torch.cuda.get_device_capability()[0] >= 9 and fused._PDL_ALLOWED)
