"""The static-shape MoE dispatch (``layers.fused_moe``) vs the PyTorch expert loop it replaces on the
GPU: the layout puts every assignment exactly once in a block of its own expert, and the grouped
GEMMs give the loop's outputs. On CUDA, or under ``TRITON_INTERPRET=1``."""

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not torch.cuda.is_available() and not INTERPRET:
    pytest.skip("no CUDA GPU: run `TRITON_INTERPRET=1 python -m pytest tests/test_fused_moe.py`",
                allow_module_level=True)

from steerable.hook_points import HookPoints  # noqa: E402
from steerable.layers.fused_moe import BLOCK_M, fused_experts, moe_align  # noqa: E402
from steerable.models.qwen3_moe import MoeConfig, Qwen3MoeSparseBlock  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (7, 8, 2), (40, 16, 4), (3, 64, 8)])
def test_moe_align_places_every_assignment_once(tokens, experts, top_k):
    g = torch.Generator().manual_seed(tokens * experts)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(DEVICE)
    ids, block_expert = moe_align(chosen, experts)
    ids, block_expert = ids.cpu(), block_expert.cpu()
    assignments = tokens * top_k
    real = ids[ids < assignments]
    assert sorted(real.tolist()) == list(range(assignments))  # each exactly once
    flat = chosen.reshape(-1).cpu()
    for b, expert in enumerate(block_expert.tolist()):
        block = ids[b * BLOCK_M:(b + 1) * BLOCK_M]
        members = block[block < assignments]
        if expert == experts:  # unused block: padding only
            assert not len(members)
            continue
        assert (flat[members.long()] == expert).all()
        assert members.tolist() == sorted(members.tolist())  # ascending within an expert
    assert len(ids) >= assignments + experts * (BLOCK_M - 1)  # a static bound, whatever the routing


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
    ctx = type("Ctx", (), {"capture": None})()
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
