"""Fused Triton elementwise kernels vs the PyTorch arithmetic they replace (HF's formulas).

On CUDA they run on the GPU; without CUDA, under `TRITON_INTERPRET=1` (set before Triton loads).
"""

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not torch.cuda.is_available() and not INTERPRET:
    pytest.skip("no CUDA GPU: run `TRITON_INTERPRET=1 python -m pytest tests/test_fused_ops.py`",
                allow_module_level=True)

from steerable.hook_points import SiteWrite  # noqa: E402
from steerable.layers import fused, gemv, logit_kernels  # noqa: E402
from steerable.layers.rotary import RotaryEmbedding  # noqa: E402
from steerable.steering.ops import add_rows, clamp_rows  # noqa: E402
from steerable.step import NO_CLAMP  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])
# The interpreter converts float32 to bfloat16 by truncation (CUDA rounds to nearest even), so
# kernels whose point is their rounding are checked there in float32 and float16.
ROUNDING_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _ref_rms(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _ref_gemma_rms(x, w, eps):
    """Gemma's norm: (1 + w) applied in float32 before the downcast."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).to(x.dtype)


def _close(out, ref, dtype):
    """Against a float32 reference computed from the same (rounded) inputs: float32 agrees to
    rounding; 16-bit outputs within their precision (relative norm error, METHOD.md's bands)."""
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    return err.item() <= (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 64), (7, 576), (33, 1024), (4, 1000)])
def test_rms_norm(dtype, rows, width):
    g = torch.Generator().manual_seed(rows * width)
    x = (torch.randn(rows, width, generator=g) * 3).to(DEVICE, dtype)
    w = (torch.randn(width, generator=g) + 1).to(DEVICE, dtype)
    assert _close(fused.rms_norm(x, w, 1e-6), _ref_rms(x.float(), w.float(), 1e-6), dtype)
    strided = torch.randn(rows, 2 * width, generator=g).to(DEVICE, dtype)[:, :width]
    assert _close(fused.rms_norm(strided, w, 1e-6), _ref_rms(strided.float(), w.float(), 1e-6), dtype)


def _site_write(g, rows, width, dtype, add, clamps, split=False):
    """Random steering writes at one site: an additive table and/or ``clamps`` clamp slots (row 0 of
    every table is 'no steering'), indexed by a padded row index. ``split``: feature clamps, with
    write directions and gates (row 2's first slot stays a projection clamp)."""
    index = torch.randint(0, 4, (rows + 3,), generator=g).to(DEVICE)
    table = directions = bounds = None
    if add:
        table = torch.randn(4, width, generator=g).to(DEVICE, dtype)
        table[0] = 0
    if clamps:
        directions = torch.nn.functional.normalize(torch.randn(4, clamps, width, generator=g), dim=-1).to(DEVICE, dtype)
        directions[0] = 0
        lo = torch.randn(4, clamps, generator=g)
        bounds = torch.stack([lo, lo + torch.rand(4, clamps, generator=g), torch.rand(4, clamps, generator=g) + 0.5,
                              torch.ones(4, clamps)], -1)
        bounds[0] = torch.tensor(NO_CLAMP)
        bounds[1, 0, :2] = 0.0  # an ablation: min = max = 0
        bounds[3, :, :2] = torch.tensor([-float("inf"), float("inf")])  # projection scalings (factor != 1)
        bounds[3, :, 3] = torch.randn(clamps, generator=g) * 2
        bounds = bounds.to(DEVICE)
    if not split:
        return SiteWrite(index, table, directions, bounds)
    write = torch.randn(4, clamps, width, generator=g).to(DEVICE, dtype)
    gate = torch.stack([torch.randn(4, clamps, generator=g), torch.rand(4, clamps, generator=g) * 0.5], -1)
    write[0], gate[0] = 0, torch.tensor([0.0, -float("inf")])
    write[2, 0], gate[2, 0] = directions[2, 0], torch.tensor([0.0, -float("inf")])
    return SiteWrite(index, table, directions, bounds, write, gate.to(DEVICE))


def _torch_steer(h, write):
    """The PyTorch ops of the unfused CPU path."""
    if write.add is not None:
        h = add_rows(h, write.add, write.index[:len(h)])
    if write.clamp_dir is not None:
        b = write.clamp_bounds
        h = clamp_rows(h, write.clamp_dir, b[..., 0], b[..., 1], b[..., 2], write.index[:len(h)], write.clamp_write,
                       write.clamp_gate, b[..., 3])
    return h


SITES = [[], [(True, 0)], [(False, 1)], [(True, 2)], [(True, 0), (False, 2)], [(False, 1), (True, 1)]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm(dtype):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 640, generator=g) * 3).to(DEVICE, dtype)
    w = torch.randn(640, generator=g).to(DEVICE, dtype)  # zero-centred, as Gemma stores it
    out = fused.rms_norm(x, w, 1e-6, unit_offset=True)
    assert _close(out, _ref_gemma_rms(x.float(), w.float(), 1e-6), dtype)
    assert not _close(out, _ref_rms(x.float(), w.float(), 1e-6), dtype)  # the offset did act


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sites", SITES, ids=lambda s: "-".join(f"{'a' if a else ''}c{c}" for a, c in s) or "none")
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(dtype, sites, with_delta):
    """The residual equals the standalone per-site steering kernel bit for bit (the unfused GPU
    path), which equals the PyTorch ops (adds exactly; clamps to float32 rounding, since their dot
    products sum in another order); the norm equals RMSNorm of it. Rows indexing row 0 of every
    table are left exactly unchanged."""
    g = torch.Generator().manual_seed(len(sites) * 2 + with_delta)
    rows, width = 9, 576
    residual = (torch.randn(rows, width, generator=g) * 3).to(DEVICE, dtype)
    delta = torch.randn(rows, width, generator=g).to(DEVICE, dtype) if with_delta else None
    w = (torch.randn(width, generator=g) + 1).to(DEVICE, dtype)
    writes = [_site_write(g, rows, width, dtype, add, clamps) for add, clamps in sites]
    start = residual if delta is None else residual + delta
    unfused, ref = start, start
    for write in writes:
        unfused, ref = fused.steer(unfused, write), _torch_steer(ref, write)
    out, normed = fused.add_rms_norm(residual, delta, writes, w, 1e-6)
    assert torch.equal(out, unfused)
    if not any(c for _, c in sites):
        assert torch.equal(out, ref)
    assert _close(out, ref, dtype)
    assert _close(normed, _ref_rms(out.float(), w.float(), 1e-6), dtype)
    gemma_out, gemma_normed = fused.add_rms_norm(residual, delta, writes, w, 1e-6, unit_offset=True)
    assert torch.equal(gemma_out, out)  # the offset changes the norm only
    assert _close(gemma_normed, _ref_gemma_rms(out.float(), w.float(), 1e-6), dtype)
    if writes:
        untouched = (torch.stack([wr.index[:rows] for wr in writes]) == 0).all(0)
        assert torch.equal(out[untouched], start[untouched])
        assert not torch.equal(out, start)  # the writes did act


@pytest.mark.parametrize("dtype", ROUNDING_DTYPES)
@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize("sites", [(), ((True, 1),)], ids=["none", "ac1"])
def test_add_rms_norm_normalises_the_delta_first(dtype, unit_offset, sites):
    """``delta_norm``: the branch output is normalised inside the kernel (Gemma's post-attention norm),
    bit for bit the standalone norm kernel followed by the fused add + steering + norm; the pre-norm
    has its own weight and eps, and it matters (effect size)."""
    g = torch.Generator().manual_seed(12 + unit_offset)
    rows, width = 7, 2304  # Gemma 2 2B's hidden size
    residual = (torch.randn(rows, width, generator=g) * 3).to(DEVICE, dtype)
    branch = (torch.randn(rows, width, generator=g) * 5).to(DEVICE, dtype)
    w, pre_w = ((torch.randn(width, generator=g) * 0.5).to(DEVICE, dtype) for _ in range(2))
    writes = [_site_write(g, rows, width, dtype, add, clamps) for add, clamps in sites]
    out, normed = fused.add_rms_norm(residual, branch, writes, w, 1e-6, unit_offset, delta_norm=(pre_w, 1e-5))
    separate = fused.add_rms_norm(residual, fused.rms_norm(branch, pre_w, 1e-5, unit_offset), writes, w, 1e-6,
                                  unit_offset)
    assert torch.equal(out, separate[0]) and torch.equal(normed, separate[1])
    assert not torch.equal(out, fused.add_rms_norm(residual, branch, writes, w, 1e-6, unit_offset)[0])
    with pytest.raises(ValueError, match="needs a delta"):
        fused.add_rms_norm(residual, None, writes, w, 1e-6, unit_offset, delta_norm=(pre_w, 1e-5))


def _ref_layer_norm(x, w, b, eps):
    return torch.nn.functional.layer_norm(x.float(), w.shape, w.float(), b.float(), eps).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 64), (7, 768), (4, 1000)])
def test_layer_norm(dtype, rows, width):
    """GPT-2 / GPT-NeoX's LayerNorm: centred, biased variance, weight and bias before one rounding;
    rows with a large mean (where a one-pass variance would lose digits) included."""
    g = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, width, generator=g) * 3 + torch.randn(rows, 1, generator=g) * 20).to(DEVICE, dtype)
    w = (torch.randn(width, generator=g) + 1).to(DEVICE, dtype)
    b = torch.randn(width, generator=g).to(DEVICE, dtype)
    out = fused.layer_norm(x, w, b, 1e-5)
    assert _close(out, _ref_layer_norm(x.float(), w, b, 1e-5), dtype)
    assert not _close(out, _ref_rms(x.float(), w.float(), 1e-5), dtype)
    strided = torch.randn(rows, 2 * width, generator=g).to(DEVICE, dtype)[:, :width]
    assert _close(fused.layer_norm(strided, w, b, 1e-5), _ref_layer_norm(strided.float(), w, b, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sites", SITES[:4] + SITES[5:], ids=lambda s: "-".join(f"{'a' if a else ''}c{c}" for a, c in s) or "none")
def test_add_layer_norm(dtype, sites):
    """The LayerNorm variant of the fused kernel: the same residual (bit for bit, as the standalone
    steering kernel), then LayerNorm of it."""
    g = torch.Generator().manual_seed(11 + len(sites))
    rows, width = 9, 768
    residual = (torch.randn(rows, width, generator=g) * 3).to(DEVICE, dtype)
    delta = torch.randn(rows, width, generator=g).to(DEVICE, dtype)
    w = (torch.randn(width, generator=g) + 1).to(DEVICE, dtype)
    b = torch.randn(width, generator=g).to(DEVICE, dtype)
    writes = [_site_write(g, rows, width, dtype, add, clamps) for add, clamps in sites]
    unfused = residual + delta
    for write in writes:
        unfused = fused.steer(unfused, write)
    out, normed = fused.add_layer_norm(residual, delta, writes, w, b, 1e-5)
    assert torch.equal(out, unfused)
    assert _close(normed, _ref_layer_norm(out.float(), w, b, 1e-5), dtype)
    rms_out, _ = fused.add_rms_norm(residual, delta, writes, w, 1e-5)
    assert torch.equal(rms_out, out)  # the norm differs, not the residual


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sites", [[(False, 1)], [(True, 2)], [(True, 1), (False, 2)]], ids=["c1", "ac2", "ac1-c2"])
def test_feature_clamps_fused_equal_unfused(dtype, sites):
    """Sites with feature clamps (read direction, bias and threshold apart from the written
    direction): the fused norm equals the standalone kernel bit for bit and the PyTorch ops to
    float32 rounding; a projection clamp in a split site's table acts as it did before."""
    g = torch.Generator().manual_seed(11 + len(sites))
    rows, width = 9, 576
    residual = (torch.randn(rows, width, generator=g) * 3).to(DEVICE, dtype)
    w = (torch.randn(width, generator=g) + 1).to(DEVICE, dtype)
    writes = [_site_write(g, rows, width, dtype, add, clamps, split=True) for add, clamps in sites]
    unfused, ref = residual, residual
    for write in writes:
        unfused, ref = fused.steer(unfused, write), _torch_steer(ref, write)
    out, normed = fused.add_rms_norm(residual, None, writes, w, 1e-6)
    assert torch.equal(out, unfused)
    assert _close(out, ref, dtype)
    assert _close(normed, _ref_rms(out.float(), w.float(), 1e-6), dtype)
    assert not torch.equal(out, residual)
    projection = SiteWrite(writes[0].index, None, writes[0].clamp_dir[:, :1].contiguous(),
                           writes[0].clamp_bounds[:, :1].contiguous())
    split = SiteWrite(projection.index, None, projection.clamp_dir, projection.clamp_bounds,
                      projection.clamp_dir.clone(), torch.tensor([0.0, -float("inf")]).repeat(4, 1, 1).to(DEVICE))
    assert torch.equal(fused.steer(residual, split), fused.steer(residual, projection))


def test_feature_clamp_sets_the_activation():
    """A feature clamp with strength 1 writes ``(value - a) * w``, ``a = p if p > threshold else 0``."""
    g = torch.Generator().manual_seed(6)
    width = 64
    h = (torch.randn(6, width, generator=g) * 2).to(DEVICE)
    e, wdir = torch.randn(width, generator=g), torch.randn(width, generator=g)
    zeros = torch.zeros(1, 1, width)
    write = SiteWrite(torch.ones(6, dtype=torch.int64, device=DEVICE), None,
                      torch.cat([zeros, e[None, None]]).to(DEVICE),
                      torch.tensor([[NO_CLAMP], [[0.7, 0.7, 1.0, 1.0]]]).to(DEVICE),
                      torch.cat([zeros, wdir[None, None]]).to(DEVICE),
                      torch.tensor([[[0.0, -float("inf")]], [[0.3, 0.5]]]).to(DEVICE))
    p = h.cpu() @ e + 0.3
    a = torch.where(p > 0.5, p, torch.zeros_like(p))
    assert 0 < (a > 0).sum() < 6  # some rows have the feature active, some not
    expected = h.cpu() + (0.7 - a)[:, None] * wdir
    assert torch.allclose(fused.steer(h, write).cpu(), expected, atol=1e-5)


def test_clamp_kernel_clips_the_projection():
    """After a clamp slot with strength 1 the projection on its direction lies within [lo, hi]."""
    g = torch.Generator().manual_seed(5)
    width = 64
    h = (torch.randn(6, width, generator=g) * 4).to(DEVICE)
    d = torch.nn.functional.normalize(torch.randn(width, generator=g), dim=0)
    directions = torch.stack([torch.zeros(1, width), d[None]]).to(DEVICE)
    bounds = torch.tensor([[NO_CLAMP], [[-0.5, 0.25, 1.0, 1.0]]]).to(DEVICE)
    out = fused.steer(h, SiteWrite(torch.ones(6, dtype=torch.int64, device=DEVICE), None, directions, bounds))
    p = out.cpu() @ d
    assert ((p >= -0.5 - 1e-5) & (p <= 0.25 + 1e-5)).all()
    orth = out.cpu() - p[:, None] * d
    assert torch.allclose(orth, h.cpu() - (h.cpu() @ d)[:, None] * d, atol=1e-5)  # nothing else moved


@pytest.mark.parametrize("factor, hi", [(0.25, float("inf")), (-1.5, float("inf")), (3.0, 2.0)])
def test_clamp_kernel_scales_the_projection(factor, hi):
    """A factor scales the projection before the clip: ``p' = clip(factor * p, lo, hi)``, so
    ``factor`` alone is Neuronpedia's ORTHOGONAL_DECOMP, ``h + (factor - 1) p d``."""
    g = torch.Generator().manual_seed(8)
    width = 64
    h = (torch.randn(6, width, generator=g) * 4).to(DEVICE)
    d = torch.nn.functional.normalize(torch.randn(width, generator=g), dim=0)
    directions = torch.stack([torch.zeros(1, width), d[None]]).to(DEVICE)
    bounds = torch.tensor([[NO_CLAMP], [[-float("inf"), hi, 1.0, factor]]]).to(DEVICE)
    out = fused.steer(h, SiteWrite(torch.ones(6, dtype=torch.int64, device=DEVICE), None, directions, bounds)).cpu()
    p = h.cpu() @ d
    expected = h.cpu() + ((factor * p).clamp(max=hi) - p)[:, None] * d
    assert torch.allclose(out, expected, atol=1e-5)
    assert not torch.allclose(out, h.cpu(), atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 128), (5, 1536), (3, 3000)])
def test_silu_and_mul(dtype, rows, inter):
    x = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(DEVICE, dtype)
    gate, up = x.float().chunk(2, dim=-1)
    assert _close(fused.silu_and_mul(x), torch.nn.functional.silu(gate) * up, dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # sigmoid(-large) = 1 / (1 + inf) = 0, as meant
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 128), (5, 2048)])
def test_gelu_tanh_and_mul(dtype, rows, inter):
    x = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 3).to(DEVICE, dtype)
    gate, up = x.float().chunk(2, dim=-1)
    assert _close(fused.gelu_tanh_and_mul(x), torch.nn.functional.gelu(gate, approximate="tanh") * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True, "gemma"])  # none, Llama-style, Gemma (1 + w)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (9, 3, 64), (16, 8, 128), (4, 1, 256)])
def test_qk_norm_rope(dtype, qk_norm, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(heads * head_dim + bool(qk_norm))
    tokens = 11
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
    positions = torch.randint(0, 500, (tokens,), generator=g).to(DEVICE)
    rotary = RotaryEmbedding(head_dim, 512, 10000.0).to(DEVICE)
    qw = (torch.randn(head_dim, generator=g) + 1).to(DEVICE, dtype) if qk_norm else None
    kw = (torch.randn(head_dim, generator=g) + 1).to(DEVICE, dtype) if qk_norm else None
    gemma = qk_norm == "gemma"
    q, k, v = fused.qk_norm_rope(qkv, positions, rotary.cos, rotary.sin, heads, kv_heads, head_dim, qw, kw, 1e-6,
                                 unit_offset=gemma)
    rq, rk, rv = qkv.float().split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    rq, rk = rq.reshape(tokens, heads, head_dim), rk.reshape(tokens, kv_heads, head_dim)
    if qk_norm:
        norm = _ref_gemma_rms if gemma else _ref_rms
        rq, rk = norm(rq, qw.float(), 1e-6), norm(rk, kw.float(), 1e-6)
    rq, rk = rotary(positions, rq, rk)
    assert _close(q, rq, dtype) and _close(k, rk, dtype)
    assert torch.equal(v.float(), rv.reshape(tokens, kv_heads, head_dim))

    # Writing K/V straight into the paged cache gives the same q and exactly the same k and v,
    # at their slots; slot -1 (a padding row) writes nothing.
    block_size = 4
    k_cache = torch.zeros(6, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(6 * block_size, generator=g)[:tokens].to(DEVICE)
    slots[3] = -1
    q2, k2, v2 = fused.qk_norm_rope(qkv, positions, rotary.cos, rotary.sin, heads, kv_heads, head_dim, qw, kw,
                                    1e-6, kv_cache=(k_cache, v_cache, slots, 1.0, 1.0), unit_offset=gemma)
    assert k2 is None and v2 is None and torch.equal(q2, q)
    written = slots >= 0
    assert torch.equal(k_cache.flatten(0, 1)[slots[written]], k[written])
    assert torch.equal(v_cache.flatten(0, 1)[slots[written]], v[written])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == int(written.sum())  # nothing else was touched


def test_gumbel_argmax_greedy_and_distribution():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 20000, generator=g) * 2).to(DEVICE)  # three vocabulary chunks
    greedy = logit_kernels.gumbel_argmax(logits, torch.zeros(4, device=DEVICE), torch.arange(4, device=DEVICE))
    assert torch.equal(greedy, logits.argmax(-1))
    tied = torch.zeros(2, 20000, device=DEVICE)
    tied[0, [7, 5, 9000]] = 1.0  # maxima in different Philox lanes and chunks
    tied[1, [19999, 8193]] = 1.0
    ties = logit_kernels.gumbel_argmax(tied, torch.zeros(2, device=DEVICE), torch.arange(2, device=DEVICE))
    assert ties.tolist() == [5, 8193] == tied.argmax(-1).tolist()  # the lowest index, as torch
    if DEVICE == "cuda":  # 16-bit logits are read as they are, upcast in registers
        half = logits.bfloat16()
        assert torch.equal(logit_kernels.gumbel_argmax(half, torch.zeros(4, device=DEVICE), torch.arange(4, device=DEVICE)),
                           half.float().argmax(-1))
    # One row of 8 tokens sampled under n seeds: frequencies follow softmax(logits / T) (the
    # interpreter runs a program at a time, so it draws fewer and allows 3 standard deviations).
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0, 0.2], device=DEVICE)
    n, tolerance = (4000, 0.03) if DEVICE == "cuda" else (600, 0.06)
    tokens = logit_kernels.gumbel_argmax(row.expand(n, 8).contiguous(), torch.full((n,), 1.5, device=DEVICE),
                                 torch.arange(n, device=DEVICE) * 7919 + 1)
    freq = torch.bincount(tokens.cpu(), minlength=8).float() / n
    expected = torch.softmax(row.cpu() / 1.5, -1)
    assert (freq - expected).abs().max() < tolerance
    again = logit_kernels.gumbel_argmax(row.expand(n, 8).contiguous(), torch.full((n,), 1.5, device=DEVICE),
                                torch.arange(n, device=DEVICE) * 7919 + 1)
    assert torch.equal(tokens, again)  # same seeds, same samples


def _torch_softcap(logits, cap):
    """HF's final logit soft-cap: three PyTorch ops, each rounding to the logits' dtype."""
    return torch.tanh(logits / cap) * cap


def _same_up_to_tanh(got, ref):
    """``got`` equals ``ref`` bit for bit on CUDA (``softcap_`` calls CUDA's tanhf, as PyTorch does).
    The interpreter's tanh (``fused.tanh_exp2``) is off by up to about 1e-7 absolute: float32 values
    agree to that (times the cap), and a 16-bit value at most one unit in the last place where it
    crosses a rounding boundary, which almost none do."""
    if DEVICE == "cuda":
        return torch.equal(got, ref)
    if ref.dtype == torch.float32:
        return bool(((got - ref).abs() <= 30 * 2e-7 + 1e-6 * ref.abs()).all())
    ulp = torch.finfo(ref.dtype).eps * ref.float().abs()
    return bool(((got.float() - ref.float()).abs() <= ulp).all()) and (got == ref).float().mean().item() >= 0.99


@pytest.mark.parametrize("dtype", ROUNDING_DTYPES)
def test_softcap_in_place_rounds_as_torch(dtype):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 3001, generator=g) * 40).to(DEVICE, dtype)  # well past the cap: it bends
    ref = _torch_softcap(logits, 30.0)
    got = logit_kernels.softcap_(logits.clone(), 30.0)
    assert _same_up_to_tanh(got, ref)
    assert (ref.float() - logits.float()).abs().max() > 5  # the cap changes the logits (effect size)
    with pytest.raises(ValueError, match="contiguous"):
        logit_kernels.softcap_(logits.t(), 30.0)


@pytest.mark.parametrize("dtype", ROUNDING_DTYPES)
def test_gumbel_argmax_caps_in_registers(dtype):
    """The sampler capping in registers picks what it picks from the capped logits: greedy is the
    argmax of the capped values (ties the rounding makes go to the lowest index), and sampling
    draws the same tokens as from logits capped beforehand (same seeds, same values)."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(6, 9000, generator=g) * 20).to(DEVICE, dtype)
    logits[0, [4000, 17]] = torch.tensor([1000.0, 900.0], dtype=dtype)  # both cap to 30: the lowest index wins
    capped = logit_kernels.softcap_(logits.clone(), 30.0)
    zeros, seeds = torch.zeros(6, device=DEVICE), torch.arange(6, device=DEVICE) * 31 + 5
    greedy = logit_kernels.gumbel_argmax(logits, zeros, seeds, softcap=30.0)
    assert torch.equal(greedy, logit_kernels.gumbel_argmax(capped, zeros, seeds))
    assert int(greedy[0]) == 17
    temps = torch.full((6,), 0.7, device=DEVICE)
    sampled = logit_kernels.gumbel_argmax(logits, temps, seeds, softcap=30.0)
    assert torch.equal(sampled, logit_kernels.gumbel_argmax(capped, temps, seeds))
    assert not torch.equal(sampled, logit_kernels.gumbel_argmax(logits, temps, seeds))  # the cap matters


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features, in_features", [(64, 64), (1000, 300), (2050, 1536), (5, 2500)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_linear(dtype, out_features, in_features, bias):
    """The one-row kernel equals ``F.linear`` across tile edges (N, K not multiples of the tiles)."""
    g = torch.Generator().manual_seed(out_features + in_features)
    w = (torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).to(DEVICE, dtype)
    b = torch.randn(out_features, generator=g).to(DEVICE, dtype) if bias else None
    x = torch.randn(1, in_features, generator=g).to(DEVICE, dtype)
    assert gemv.eligible(x, w)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert _close(gemv.gemv(x, w, b), ref, dtype)
    assert _close(gemv.linear(x, w, b), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("in_features", [300, 2500])
def test_gated_gemv_equals_gated_kernel_then_gemv(dtype, gated, in_features):
    """The down projection with the gated activation inside equals the gated kernel followed by
    the one-row projection, bit for bit (they share the activation's rounding); several rows take
    the two ops."""
    g = torch.Generator().manual_seed(in_features)
    w = (torch.randn(96, in_features, generator=g) / in_features ** 0.5).to(DEVICE, dtype)
    gate_up = torch.randn(1, 2 * in_features, generator=g).to(DEVICE, dtype)
    act = {"silu": fused.silu_and_mul, "gelu_tanh": fused.gelu_tanh_and_mul}[gated]
    out = gemv.gated_linear(gate_up, w, None, gated)
    assert torch.equal(out, gemv.gemv(act(gate_up), w))
    gate, up = gate_up.float().chunk(2, dim=-1)
    ref_act = torch.nn.functional.silu(gate) if gated == "silu" else torch.nn.functional.gelu(gate, approximate="tanh")
    assert _close(out, torch.nn.functional.linear(ref_act * up, w.float()), dtype)
    rows = torch.randn(3, 2 * in_features, generator=g).to(DEVICE, dtype)
    assert torch.equal(gemv.gated_linear(rows, w, None, gated), torch.nn.functional.linear(act(rows), w))


def test_gemv_takes_one_row_only():
    """Several rows, a transposed weight or mixed dtypes go to ``F.linear``."""
    w = torch.randn(32, 16, device=DEVICE)
    assert not gemv.eligible(torch.randn(2, 16, device=DEVICE), w)
    assert not gemv.eligible(torch.randn(1, 16, device=DEVICE), torch.randn(16, 32, device=DEVICE).t())
    assert not gemv.eligible(torch.randn(1, 16, device=DEVICE, dtype=torch.float64), w)
    x = torch.randn(3, 16, device=DEVICE)
    assert torch.equal(gemv.linear(x, w), torch.nn.functional.linear(x, w))


def test_programmatic_dependent_launch_only_on_hopper_cuda():
    """Kernels that wait on their predecessor launch with PDL on Hopper and later GPUs only; the
    interpreter and older GPUs get the plain kernel (no griddepcontrol instructions)."""
    x = torch.zeros(1, 8, device=DEVICE)
    hopper = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    expected = {"PDL": True, "launch_pdl": True} if hopper and fused._PDL_ALLOWED else {"PDL": False}
    assert fused.pdl_args(x) == expected
    assert fused.pdl_args(torch.zeros(1, 8)) == {"PDL": False}
