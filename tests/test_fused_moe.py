"""The static-shape MoE dispatch (``layers.fused_moe``) vs the PyTorch expert loop it replaces on the
GPU: the layout puts every assignment exactly once in a block of its own expert, and the grouped
GEMMs give the loop's outputs; so do the one-token GEMV kernels. The one-kernel router
(``layers.moe_routing``) vs softmax + topk. On CUDA, or under ``TRITON_INTERPRET=1``."""

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not torch.cuda.is_available() and not INTERPRET:
    pytest.skip("no CUDA GPU: run `TRITON_INTERPRET=1 python -m pytest tests/test_fused_moe.py`",
                allow_module_level=True)

from steerable.hook_points import HookPoints  # noqa: E402
from steerable.layers import fused, moe_configs  # noqa: E402
from steerable.layers import fused_moe as fused_moe_module  # noqa: E402
from steerable.layers.fused_moe import GemvTile, fused_experts, fused_moe, moe_align  # noqa: E402
from steerable.layers.fused_moe import moe_align_reference, num_blocks  # noqa: E402
from steerable.layers.moe_routing import route_topk, route_topk_reference  # noqa: E402
from steerable.models import qwen3_moe  # noqa: E402
from steerable.models.qwen3_moe import MoeConfig, Qwen3MoeSparseBlock  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (7, 8, 2), (40, 16, 4), (3, 64, 8), (300, 8, 2)])
def test_moe_align_places_every_assignment_once(tokens, experts, top_k, block_m):
    g = torch.Generator().manual_seed(tokens * experts)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(DEVICE)
    ids, block_expert = moe_align(chosen, experts, block_m)
    ref_ids, ref_block_expert = moe_align_reference(chosen, experts, block_m)
    assert torch.equal(ids.cpu(), ref_ids.cpu()) and torch.equal(block_expert.cpu(), ref_block_expert.cpu())
    ids, block_expert = ids.cpu(), block_expert.cpu()
    assignments = tokens * top_k
    real = ids[ids < assignments]
    assert sorted(real.tolist()) == list(range(assignments))  # each exactly once
    flat = chosen.reshape(-1).cpu()
    for b, expert in enumerate(block_expert.tolist()):
        block = ids[b * block_m:(b + 1) * block_m]
        members = block[block < assignments]
        if expert == experts:  # unused block: padding only
            assert not len(members)
            continue
        assert (flat[members.long()] == expert).all()
        assert members.tolist() == sorted(members.tolist())  # ascending within an expert
    assert len(block_expert) == num_blocks(assignments, experts, block_m)


def test_align_bound_holds_when_every_expert_is_one_past_a_block():
    """The worst case of the static bound: every expert gets block_m + 1 assignments."""
    experts, block_m = 8, 16  # one expert per token (top-k = 1)
    chosen = torch.arange(experts).repeat_interleave(block_m + 1)[:, None].to(DEVICE)
    ids, block_expert = moe_align(chosen, experts, block_m)
    assert (block_expert < experts).sum().item() == 2 * experts == len(block_expert)
    assert torch.equal(ids.cpu(), moe_align_reference(chosen, experts, block_m)[0].cpu())


def _block(dtype, experts=8, top_k=2, hidden=64, inter=48, norm_topk=True):
    cfg = MoeConfig(hf_config=None, architecture="Qwen3MoeForCausalLM", hidden_size=hidden, num_layers=1, num_heads=4,
                    num_kv_heads=2, head_dim=16, intermediate_size=0, vocab_size=32, rms_norm_eps=1e-6,
                    rope_theta=1e4, rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False,
                    eos_token_ids=[], num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
                    norm_topk_prob=norm_topk)
    block = Qwen3MoeSparseBlock(cfg, 0, HookPoints())
    g = torch.Generator().manual_seed(experts + top_k)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return block.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (13, 8, 2), (33, 16, 4)])
def test_grouped_gemm_equals_expert_loop(dtype, tokens, experts, top_k):
    block = _block(dtype, experts, top_k)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)).to(DEVICE, dtype)
    ctx = type("Ctx", (), {"capture": None, "steering": None})()
    with torch.no_grad():
        chosen, weights = block.route(x, ctx)
        fast = fused_experts(x, chosen, weights, block.experts_gate_up, block.experts_down)
        ref = block._experts_loop(x, chosen, weights)
    err = ((fast.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err <= (1e-6 if dtype == torch.float32 else 1e-2), err
    # A token's outputs do not depend on the batch: alone, the first token gets the same rows.
    with torch.no_grad():
        alone = fused_experts(x[:1], chosen[:1], weights[:1], block.experts_gate_up, block.experts_down)
    assert torch.equal(alone, fast[:top_k])


# Tiles narrower than the test shape (hidden 72, intermediate 44), so every loop of the one-token
# kernels runs several steps and ends on a partial tile, in the rows and in the reduction (the
# default tiles run in the other tests).
SMALL_TILES = (GemvTile(block_n=8, block_k=32), GemvTile(block_n=16, block_k=16))


def _one_token(dtype, experts, top_k, seed):
    """A block, one token, and its routing with a distinct expert per slot, except that for k > 1
    the last slot is another rank's under tensor parallelism: expert 0 with weight exactly 0."""
    block = _block(dtype, experts, top_k, hidden=72, inter=44)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 72, generator=g).to(DEVICE, dtype)
    chosen = torch.randperm(experts, generator=g)[:top_k][None]
    weights = torch.rand(1, top_k, generator=g)
    if top_k > 1:
        chosen[0, -1], weights[0, -1] = 0, 0.0
    return block, x, chosen.to(DEVICE), weights.to(DEVICE, dtype)


def _token_sums(block, x, chosen, weights):
    """The reference: the expert loop's k outputs, summed per token as the PyTorch path sums them."""
    return block._experts_loop(x, chosen, weights).view(x.shape[0], chosen.shape[1], -1).sum(dim=1)


def _rel_err(got, ref):
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


# The interpreter truncates float32 -> bfloat16 where a GPU rounds to nearest: each of the seven
# roundings on the way (gate, up, activation, hidden, expert output, weighted output, sum) loses up
# to 2^-7 towards zero, 1-2.5% in all against the PyTorch loop; float16 it rounds as a GPU does.
BF16_TOL = 5e-2 if INTERPRET else 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("experts, top_k", [(8, 1), (8, 2), (8, 3), (16, 8)])
def test_one_token_kernels_equal_expert_loop(dtype, experts, top_k):
    """One token in 16 bits: two GEMV kernels give the expert loop's token sum, zero weights
    included (k = 3 also pads the down kernel's tile of assignments to 4). Float16, which the
    interpreter rounds as a GPU does, shows that they round where the loop rounds: the sums agree
    to the bit but for float32 summation order."""
    block, x, chosen, weights = _one_token(dtype, experts, top_k, seed=experts + top_k)
    with torch.no_grad():
        fast = fused_moe(x, chosen, weights, block.experts_gate_up, block.experts_down, tiles=SMALL_TILES)
        ref = _token_sums(block, x, chosen, weights)
    assert fast.shape == (1, 72) and fast.dtype == dtype
    if dtype == torch.float16:
        torch.testing.assert_close(fast, ref, rtol=2 ** -10, atol=2 ** -14)
    else:
        assert _rel_err(fast, ref) <= BF16_TOL


def _grouped_unavailable(*args, **kwargs):
    raise AssertionError("the grouped GEMM path ran")


def test_one_token_takes_the_gemv_kernels(monkeypatch):
    """One 16-bit token never reaches the layout or the grouped GEMMs; more tokens do, and give
    each token the sum the one-token kernels give it alone."""
    block, x, chosen, weights = _one_token(torch.float16, 8, 2, seed=1)
    args = (block.experts_gate_up, block.experts_down)
    with torch.no_grad():
        batch = fused_moe(x.repeat(3, 1), chosen.repeat(3, 1), weights.repeat(3, 1), *args)
        monkeypatch.setattr(fused_moe_module, "moe_align", _grouped_unavailable)
        monkeypatch.setattr(fused_moe_module, "fused_experts", _grouped_unavailable)
        alone = fused_moe(x, chosen, weights, *args)
    torch.testing.assert_close(alone, _token_sums(block, x, chosen, weights), rtol=2 ** -10, atol=2 ** -14)
    torch.testing.assert_close(batch, alone.expand(3, -1), rtol=2 ** -10, atol=2 ** -14)


def test_float32_one_token_keeps_the_grouped_gemm(monkeypatch):
    """Float32 results must not depend on the batch: one token takes the grouped GEMM too, and
    gets exactly what it gets inside a batch."""
    block, x, chosen, weights = _one_token(torch.float32, 8, 2, seed=2)
    others = torch.randn(4, 72, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    args = (block.experts_gate_up, block.experts_down)
    monkeypatch.setattr(fused_moe_module, "moe_gemv", _grouped_unavailable)
    with torch.no_grad():
        alone = fused_moe(x, chosen, weights, *args)
        batch = fused_moe(torch.cat([x, others]), chosen.repeat(5, 1), weights.repeat(5, 1), *args)
        ref = _token_sums(block, x, chosen, weights)
    assert torch.equal(alone, batch[:1])
    assert _rel_err(alone, ref) <= 1e-6


class _Capture:
    def __init__(self):
        self.rows = {}

    def record(self, site, value):
        self.rows[site] = value.clone()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sparse_block_one_token_uses_the_gemv_kernels(dtype, monkeypatch):
    """``Qwen3MoeSparseBlock.forward`` at one token, as rank 1 of 2 under tensor parallelism
    (experts 4-7 local; the others' assignments add exact zeros): the router's logits come from the
    GEMV kernel (still observed by the hook), the experts from the one-token kernels, and the
    output is the expert loop's."""
    block = _block(dtype, experts=8, top_k=4, hidden=72, inter=44)
    block.first_expert = 4
    block.experts_gate_up = torch.nn.Parameter(block.experts_gate_up[4:].clone())
    block.experts_down = torch.nn.Parameter(block.experts_down[4:].clone())
    x = torch.randn(1, 1, 72, generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype)
    if not fused.enabled(x):
        pytest.skip("CPU tensors take the fused path only with STEERABLE_FUSED_ON_CPU=1")
    ctx = type("Ctx", (), {"capture": _Capture(), "steering": None})()
    with torch.no_grad():
        logits = torch.nn.functional.linear(x[0], block.gate.weight)
        chosen, weights = block.route(x[0], ctx)
        ref = _token_sums(block, x[0], chosen, weights)
        monkeypatch.setattr(fused_moe_module, "fused_experts", _grouped_unavailable)
        monkeypatch.setattr(torch.nn.functional, "linear", _grouped_unavailable)
        out = block(x, ctx)
    owners = (chosen >= 4).flatten().tolist()
    assert any(owners) and not all(owners)  # some assignments local, some another rank's
    assert out.shape == x.shape
    tol = BF16_TOL if dtype == torch.bfloat16 else 1e-2
    assert _rel_err(ctx.capture.rows[("router_logits", 0)], logits) <= tol
    assert _rel_err(out.reshape(1, -1), ref) <= tol


def _table_configs() -> list[tuple[str, int, tuple]]:
    """Every configuration the shipped tables hold (each device, shape and token count)."""
    import json

    found = []
    for path in sorted(moe_configs.TABLES.glob("*.json")):
        for shape, entries in json.loads(path.read_text()).items():
            for tokens, entry in entries.items():
                found.append((f"{path.stem}:{shape}:{tokens}", int(tokens), moe_configs.parse_entry(entry)))
    return found


@pytest.mark.parametrize("name, tokens, config", _table_configs() or [("default", 5, moe_configs.DEFAULT)],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_every_table_config_equals_expert_loop(name, tokens, config):
    """Each tuned tile configuration gives the expert loop's outputs (masks at the tile edges: the
    small shape here is narrower than most tiles)."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    block = _block(dtype, experts=16, top_k=4, hidden=96, inter=80)
    x = torch.randn(min(tokens, 40), 96, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    ctx = type("Ctx", (), {"capture": None, "steering": None})()
    with torch.no_grad():
        chosen, weights = block.route(x, ctx)
        fast = fused_experts(x, chosen, weights, block.experts_gate_up, block.experts_down, configs=config)
        ref = block._experts_loop(x, chosen, weights)
    err = ((fast.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err <= (1e-6 if dtype == torch.float32 else 1e-2), (name, err)


def test_table_lookup_takes_the_nearest_token_count(tmp_path, monkeypatch):
    import json

    entry = lambda bm, bn: {"block_m": bm, "gate_up": {"block_n": bn}, "down": {"block_n": bn}}  # noqa: E731
    key = moe_configs.shape_key(16, 96, 80, torch.bfloat16)
    (tmp_path / "Fake_GPU.json").write_text(json.dumps({key: {"1": entry(16, 32), "256": entry(64, 128)}}))
    monkeypatch.setattr(moe_configs, "TABLES", tmp_path)
    moe_configs._table.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    cuda = torch.device("cuda")
    try:
        assert moe_configs.tile_configs(3, 16, 96, 80, torch.bfloat16, cuda)[0] == 16
        assert moe_configs.tile_configs(200, 16, 96, 80, torch.bfloat16, cuda)[1].block_n == 128
        assert moe_configs.tile_configs(200, 16, 96, 80, torch.float32, cuda) == moe_configs.DEFAULT
        assert moe_configs.tile_configs(200, 8, 96, 80, torch.bfloat16, cuda) == moe_configs.DEFAULT
    finally:
        moe_configs._table.cache_clear()


def _assert_routes_equal(logits, top_k, renormalize):
    experts, weights = route_topk(logits, top_k, renormalize)
    ref_experts, ref_weights = route_topk_reference(logits, top_k, renormalize)
    assert experts.dtype == torch.int64 and weights.dtype == torch.float32
    assert experts.shape == weights.shape == (logits.shape[0], top_k)
    assert torch.equal(experts.cpu(), ref_experts.cpu())
    torch.testing.assert_close(weights.cpu(), ref_weights.cpu(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("experts", [60, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_topk_equals_softmax_topk(dtype, experts, top_k, renormalize):
    """Float32 and bf16 logits, a power-of-two expert count and one that is not, 1 and 37 tokens."""
    g = torch.Generator().manual_seed(experts * top_k)
    for tokens in (1, 37):
        if dtype == torch.float32:
            logits = torch.randn(tokens, experts, generator=g) * 3
        else:  # distinct multiples of 1/16, exact in bf16: random bf16 logits tie, and torch breaks ties its own way
            logits = torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)]) / 16 - 4
        _assert_routes_equal(logits.to(DEVICE, dtype), top_k, renormalize)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_topk_layouts(renormalize):
    """No tokens (no launch), k up to 16, and logits whose rows or columns are strided."""
    g = torch.Generator().manual_seed(5)
    experts, weights = route_topk(torch.empty(0, 60, device=DEVICE), 8, renormalize)
    assert experts.shape == weights.shape == (0, 8)
    _assert_routes_equal(torch.randn(9, 60, generator=g).to(DEVICE), 16, renormalize)
    wide = torch.randn(7, 80, generator=g).to(DEVICE)
    _assert_routes_equal(wide[:, 3:63], 4, renormalize)  # row stride 80
    _assert_routes_equal(torch.randn(60, 7, generator=g).to(DEVICE).t(), 4, renormalize)  # column stride 7


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_topk_ties_go_to_the_lowest_expert(renormalize):
    """Equal probabilities are picked lowest expert first. A tie inside the top k: torch's set, in
    our order; a tie across the cut (all logits equal): experts 0..k-1 (torch's CPU topk picks
    another subset of the tied ones), with torch's weights."""
    logits = torch.randn(2, 128, generator=torch.Generator().manual_seed(9))
    logits[0, [99, 7, 30]] = 5.0
    logits[1] = 0.25
    logits = logits.to(DEVICE)
    experts, weights = route_topk(logits, 5, renormalize)
    ref_experts, ref_weights = route_topk_reference(logits, 5, renormalize)
    experts, weights, ref_experts, ref_weights = experts.cpu(), weights.cpu(), ref_experts.cpu(), ref_weights.cpu()
    assert experts[0, :3].tolist() == [7, 30, 99]
    assert sorted(experts[0].tolist()) == sorted(ref_experts[0].tolist())
    assert experts[1].tolist() == [0, 1, 2, 3, 4]
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=0)


def _unavailable(*args, **kwargs):
    raise AssertionError("the PyTorch routing ran")


def test_route_topk_runs_the_kernel(monkeypatch):
    """The kernel gives the answer on its own: with softmax and topk unavailable, it still routes."""
    logits = torch.randn(5, 60, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ref_experts, ref_weights = route_topk_reference(logits, 8, True)
    monkeypatch.setattr(torch, "softmax", _unavailable)
    monkeypatch.setattr(torch, "topk", _unavailable)
    experts, weights = route_topk(logits, 8, True)
    assert torch.equal(experts.cpu(), ref_experts.cpu())
    torch.testing.assert_close(weights.cpu(), ref_weights.cpu(), rtol=1e-6, atol=0)


def test_fused_block_routes_with_the_kernel(monkeypatch):
    """On the fused path the sparse block routes with the kernel, never the PyTorch reference, and
    keeps the reference's contract: int64 ids, weights in the activation dtype."""
    block = _block(torch.float32, experts=16, top_k=4)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    if not fused.enabled(x):
        pytest.skip("CPU tensors take the fused path only with STEERABLE_FUSED_ON_CPU=1")
    ctx = type("Ctx", (), {"capture": None, "steering": None})()
    with torch.no_grad():
        ref_experts, ref_weights = route_topk_reference(block.gate(x), 4, True)
        monkeypatch.setattr(qwen3_moe, "route_topk_reference", _unavailable)
        experts, weights = block.route(x, ctx)
    assert experts.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(experts, ref_experts)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=0)


def test_route_topk_stores_the_activation_dtype():
    """Weights stored as bf16 equal the float32 weights cast to bf16: on a GPU the kernel rounds as
    ``.to`` does."""
    logits = (torch.stack([torch.randperm(128, generator=torch.Generator().manual_seed(s)) for s in range(6)])
              / 16 - 4).to(DEVICE, torch.bfloat16)
    experts, weights = route_topk(logits, 8, True, torch.bfloat16)
    ref_experts, ref_weights = route_topk_reference(logits, 8, True)
    assert weights.dtype == torch.bfloat16
    assert torch.equal(experts.cpu(), ref_experts.cpu())
    expected = ref_weights.to(torch.bfloat16).cpu()
    if INTERPRET:  # the CPU interpreter truncates float32 -> bfloat16 where a GPU rounds to nearest
        torch.testing.assert_close(weights.cpu(), expected, rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(weights.cpu(), expected)
