"""The Triton kernels compile for Hopper (sm_90: H100/H200) on a machine without a GPU: Triton's
compiler and the ptxas it ships need no device. The CPU interpreter runs the kernels' arithmetic;
this catches what only the real compiler sees (types, float8 conversions, constexpr branches,
layouts of ``tl.dot``), for the variants a CPU run cannot execute."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("the interpreter replaces the compiler; run without TRITON_INTERPRET", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from steerable.layers import fused, fused_moe, gemv, logit_kernels  # noqa: E402
from steerable.layers.attention_backends import triton_paged  # noqa: E402

_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float8_e4m3fn: "*fp8e4nv",
          torch.int64: "*i64", torch.int32: "*i32"}


def compile_for_hopper(kernel, **args) -> str:
    """PTX of ``kernel`` for sm_90: tensors give pointer types, ints and floats scalar types; the
    kernel's constexpr parameters take their values from ``args``."""
    return _compile(kernel, args).asm["ptx"]


def _compile(kernel, args: dict, aligned: frozenset = frozenset(), num_stages: int = 3):
    """``aligned``: the integer parameters the JIT would see divisible by 16 (pointers always are
    then, and ints of 1 become constants), as a launch specialises them: what decides whether
    Triton's pipeliner copies tiles asynchronously, so shared memory is counted as on a GPU."""
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = args[param.name]
        if param.is_constexpr or (aligned and value == 1 and not isinstance(value, (float, torch.dtype))):
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.dtype):
            signature[param.name] = _TYPES[value]
            if aligned:
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = "fp32" if isinstance(value, float) else "i64"
            if param.name in aligned:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": args.get("num_warps", 4), "num_stages": num_stages})


BF16, FP32, FP8, I64, I32 = torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int64, torch.int32


def _site(suffix: str) -> dict:
    return {f"i{suffix}_ptr": I64, f"a{suffix}_ptr": BF16, f"stride_a{suffix}": 1, f"d{suffix}_ptr": BF16,
            f"b{suffix}_ptr": FP32, f"w{suffix}_ptr": BF16, f"g{suffix}_ptr": FP32, f"stride_d{suffix}r": 1,
            f"stride_d{suffix}k": 1}


@pytest.mark.parametrize("add1, clamps1, add2, clamps2, layer_norm, split", [
    (True, 0, False, 0, False, False), (True, 1, True, 2, False, False), (False, 1, True, 0, False, True),
    (True, 1, False, 0, True, False), (True, 2, False, 1, False, True)])
def test_fused_steering_kernels(add1, clamps1, add2, clamps2, layer_norm, split):
    """``split``: feature clamps (own write direction and gate) at the clamped sites."""
    norm = dict(res_ptr=BF16, delta_ptr=BF16, w_ptr=BF16, bias_ptr=BF16, out_ptr=BF16, y_ptr=BF16, stride_res=1,
                stride_delta=1, stride_out=1, stride_y=1, H=1, eps=1.0, pre_w_ptr=BF16, pre_eps=1.0, **_site("1"),
                **_site("2"), HAS_DELTA=True, PRE_NORM=not layer_norm,  # Gemma's post-norm inside, on RMSNorm variants
                ADD1=add1, CLAMPS1=clamps1, SPLIT1=split and clamps1 > 0, ADD2=add2, CLAMPS2=clamps2,
                SPLIT2=split and clamps2 > 0, BLOCK=1024,
                UNIT_OFFSET=add2 and not layer_norm,  # Gemma's (1 + w) as well
                LAYER_NORM=layer_norm, PDL=add1)
    assert "ld.global" in compile_for_hopper(fused._add_norm_kernel, **norm)
    plain = dict(x_ptr=BF16, w_ptr=BF16, b_ptr=BF16, y_ptr=BF16, stride_x=1, stride_y=1, H=1, eps=1.0, BLOCK=1024,
                 UNIT_OFFSET=False, LAYER_NORM=layer_norm, PDL=add1)
    compile_for_hopper(fused._norm_kernel, **plain)
    steer = dict(x_ptr=BF16, out_ptr=BF16, stride_x=1, stride_out=1, H=1, index_ptr=I64, add_ptr=BF16, stride_add=1,
                 dir_ptr=BF16, bounds_ptr=FP32, write_ptr=BF16, gate_ptr=FP32, stride_dir_row=1, stride_dir_slot=1,
                 ADD=add1, CLAMPS=clamps1, SPLIT=split and clamps1 > 0, BLOCK=1024)
    compile_for_hopper(fused._steer_kernel, **steer)


@pytest.mark.parametrize("kv", [BF16, FP8])
def test_kv_cache_kernels(kv):
    rope = dict(qkv_ptr=BF16, q_ptr=BF16, k_ptr=BF16, pos_ptr=I64, cos_ptr=FP32, sin_ptr=FP32, qw_ptr=BF16,
                kw_ptr=BF16, kc_ptr=kv, vc_ptr=kv, slot_ptr=I64, stride_qkv=1, stride_q=1, stride_k=1, stride_cos=1,
                eps=1.0, stride_kcb=1, stride_kco=1, stride_kch=1, stride_vcb=1, stride_vco=1, stride_vch=1,
                stride_vcd=1, k_scale=1.0, v_scale=1.0, NUM_Q=16, NUM_QK=24, HEADS_PAD=32, HEAD_D=128, HALF=64, QK_NORM=True,
                STORE_KV=True, KV_PAD=8, D_PAD=128, BLOCK_SIZE=16, KV_FP8=kv == FP8, UNIT_OFFSET=kv == FP8,
                PDL=kv == BF16)
    ptx = compile_for_hopper(fused._qk_norm_rope_kernel, **rope)
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == (kv == FP8)  # the hardware's rounding, saturated
    store = dict(key_ptr=BF16, value_ptr=BF16, k_cache_ptr=kv, v_cache_ptr=kv, slot_ptr=I64, stride_kt=1,
                 stride_kh=1, stride_vt=1, stride_vh=1, stride_kcb=1, stride_kco=1, stride_kch=1, stride_vcb=1,
                 stride_vco=1, stride_vch=1, stride_vcd=1, k_scale=1.0, v_scale=1.0, NUM_HEADS=8, HEAD_D=128, H_PAD=8, D_PAD=128,
                 BLOCK_SIZE=16, FP8=kv == FP8)
    compile_for_hopper(triton_paged._store_kv_kernel, **store)
    # a float8 cache as the engine lays it out on a GPU: V position-major, tiles converted to float16
    cache = dict(k_cache_ptr=kv, v_cache_ptr=kv, stride_kb=1, stride_ko=1, stride_kh=1, stride_vb=1, stride_vo=1,
                 stride_vh=1, stride_vd=1, block_table_ptr=I32, stride_bt=1, qsl_ptr=I32, seq_lens_ptr=I32,
                 qk_scale=1.0, softcap=1.0, window=1, HEAD_D=128, D_PAD=128, BLOCK_SIZE=16, USE_WINDOW=False,
                 DOT_PREC="tf32", FP16_TILES=kv == FP8, V_BY_BLOCK=kv == FP8,
                 SOFTCAP=kv == BF16)  # Gemma 2's soft-capped scores, on the bf16 variant
    unified = dict(cache, q_ptr=BF16, out_ptr=BF16, num_seqs=1, v_scale=1.0, stride_qt=1, stride_qh=1, stride_ot=1,
                   stride_oh=1, prefix_lens_ptr=I32, ws_acc_ptr=FP32, ws_max_ptr=FP32, ws_sum_ptr=FP32, stride_wab=1,
                   stride_wah=1, stride_wmb=1, stride_wmh=1, NUM_Q_PER_KV=2, GQA_PAD=2, BLOCK_Q=1, BLOCK_M=16, TILE_N=64,
                   NUM_KV_HEADS=8, ONE_TOKEN_PER_SEQ=True,
                   RESUME=kv == BF16)  # a shared-prefix group's resume, on the bf16 variant
    ptx = compile_for_hopper(triton_paged._unified_attention_kernel, **unified)
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) == (kv == FP8)  # one packed conversion per two float8 values
    split = dict(cache, q_ptr=BF16, ws_acc_ptr=FP32, ws_max_ptr=FP32, ws_sum_ptr=FP32, stride_qt=1, stride_qh=1,
                 stride_wab=1, stride_wah=1, stride_was=1, stride_wmb=1, stride_wmh=1, NUM_Q_PER_KV=2, BLOCK_M=16,
                 TILE_N=64, NUM_SEGMENTS=16, PDL=kv == BF16)
    ptx = compile_for_hopper(triton_paged._split_kv_decode_kernel, **split)
    assert ("griddepcontrol.wait" in ptx) == (kv == BF16)
    reduce = dict(out_ptr=BF16, ws_acc_ptr=FP32, ws_max_ptr=FP32, ws_sum_ptr=FP32, qsl_ptr=I32, v_scale=1.0,
                  stride_ot=1, stride_oh=1, stride_wab=1, stride_wah=1, stride_was=1, stride_wmb=1, stride_wmh=1,
                  HEAD_D=128, D_PAD=128, NUM_SEGMENTS=16, SEG_PAD=16, PDL=kv == BF16)
    compile_for_hopper(triton_paged._split_kv_reduce_kernel, **reduce)


@pytest.mark.parametrize("mul_weight, swiglu, block_m, group_m", [(False, True, 16, 1), (True, False, 16, 1),
                                                                  (False, True, 128, 8), (True, False, 64, 4)])
def test_grouped_moe_gemm(mul_weight, swiglu, block_m, group_m):
    args = dict(a_ptr=BF16, b_ptr=BF16, c_ptr=BF16, weight_ptr=BF16, ids_ptr=I32, block_expert_ptr=I32, N=1,
                K=1, num_assignments=1, num_m_blocks=1, stride_am=1, stride_be=1, stride_bn=1, stride_bk=1,
                stride_cm=1, NUM_EXPERTS=128, ROWS_PER_A=8, MUL_WEIGHT=mul_weight, SWIGLU=swiglu, DOT_PREC="tf32",
                BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, GROUP_M=group_m)
    assert "mma" in compile_for_hopper(fused_moe._moe_gemm_kernel, **args)  # tensor cores


def test_moe_align_kernels():
    compile_for_hopper(fused_moe._moe_count_kernel, experts_ptr=I64, counts_ptr=I32, num_assignments=1, CHUNK=1024)
    compile_for_hopper(fused_moe._moe_place_kernel, experts_ptr=I64, counts_ptr=I32, ids_ptr=I32,
                       block_expert_ptr=I32, num_assignments=1, total_blocks=1, NUM_EXPERTS=128, E_PAD=128,
                       BLOCK_M=16, CHUNK=1024, BLOCKS_CHUNK=64)


@pytest.mark.parametrize("pdl", [False, True])
def test_moe_gemv_kernels(pdl):
    """The one-token MoE kernels at the Qwen3-30B-A3B shape's tiles, with programmatic dependent
    launch (the wait before the expert ids are read) or without."""
    gate_up = dict(x_ptr=BF16, w_ptr=BF16, experts_ptr=I64, h_ptr=BF16, I=1, H=1, stride_we=1, stride_wn=1,
                   PDL=pdl, BLOCK_N=fused_moe.GEMV_GATE_UP.block_n, BLOCK_K=fused_moe.GEMV_GATE_UP.block_k)
    down = dict(h_ptr=BF16, w_ptr=BF16, experts_ptr=I64, weights_ptr=BF16, y_ptr=BF16, H=1, I=1, stride_we=1,
                stride_wn=1, TOP_K=6, K_PAD=8, PDL=pdl, BLOCK_N=fused_moe.GEMV_DOWN.block_n,
                BLOCK_K=fused_moe.GEMV_DOWN.block_k)
    for kernel, args in ((fused_moe._moe_gemv_gate_up_kernel, gate_up), (fused_moe._moe_gemv_down_kernel, down)):
        ptx = compile_for_hopper(kernel, **args)
        assert "ld.global" in ptx and "mma" not in ptx
        assert ("griddepcontrol.wait" in ptx) == pdl and ("griddepcontrol.launch_dependents" in ptx) == pdl


@pytest.mark.parametrize("gelu_tanh", [False, True])
def test_gated_mul_kernel(gelu_tanh):
    """SwiGLU (Llama, Qwen) and GeGLU with the tanh GELU (Gemma 3)."""
    args = dict(x_ptr=BF16, y_ptr=BF16, stride_x=1, stride_y=1, I=1, BLOCK=1024, GELU_TANH=gelu_tanh)
    compile_for_hopper(fused._gated_mul_kernel, **args)


@pytest.mark.parametrize("bias, gated, pdl", [(False, None, False), (True, None, True), (False, "silu", True),
                                              (False, "gelu_tanh", False)])
def test_gemv_kernel(bias, gated, pdl):
    """Plain and gated (SwiGLU, GeGLU input), with programmatic dependent launch (a wait before
    reading the input, then a trigger for the next kernel) or without."""
    args = dict(x_ptr=BF16, w_ptr=BF16, b_ptr=BF16, y_ptr=BF16, N=1, K=1, stride_w=1, HAS_BIAS=bias,
                GATED=gated is not None, GELU_TANH=gated == "gelu_tanh", PDL=pdl, BLOCK_N=2, BLOCK_K=1024)
    ptx = compile_for_hopper(gemv._gemv_kernel, **args)
    assert "ld.global" in ptx
    assert ("griddepcontrol.wait" in ptx) == pdl and ("griddepcontrol.launch_dependents" in ptx) == pdl


@pytest.mark.parametrize("kv,softcap", [(BF16, False), (FP8, False), (BF16, True)])
def test_shared_prefix_kernels(kv, softcap):
    """The shared pass of shared-prefix decode attention (Qwen3-0.6B's heads: GQA 2, head size 128;
    the decode tile); its second launch is the unified kernel's resume, compiled above."""
    from steerable.layers.attention_backends import shared_prefix

    args = dict(q_ptr=BF16, k_cache_ptr=kv, v_cache_ptr=kv, ws_acc_ptr=FP32, ws_max_ptr=FP32, ws_sum_ptr=FP32,
                qsl_ptr=I32, prefix_lens_ptr=I32, block_table_ptr=I32, num_seqs=1, qk_scale=1.0, softcap=1.0,
                stride_qt=1, stride_qh=1, stride_kb=1, stride_ko=1, stride_kh=1, stride_vb=1, stride_vo=1, stride_vh=1,
                stride_vd=1, stride_bt=1, stride_wab=1, stride_wah=1, stride_wmb=1, stride_wmh=1, NUM_Q_PER_KV=2,
                GQA_PAD=2, BLOCK_Q=8, BLOCK_M=16, HEAD_D=128, D_PAD=128, BLOCK_SIZE=16, TILE_N=128, DOT_PREC="tf32",
                FP16_TILES=kv == FP8, V_BY_BLOCK=kv == FP8, SOFTCAP=softcap)
    assert "mma" in compile_for_hopper(shared_prefix._shared_pass_kernel, **args)  # an MMA over 8 rows' queries


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_final_softcap_kernels(dtype):
    """Gemma's final soft-cap with CUDA's tanhf (libdevice), in place and inside the sampler."""
    ptx = compile_for_hopper(logit_kernels._softcap_kernel, x_ptr=dtype, n=1, inv_cap=1.0, cap=1.0, BLOCK=4096, LIBDEVICE=True)
    assert "tanh" in ptx or "ex2" in ptx  # libdevice's tanhf, inlined
    sampler = dict(logits_ptr=dtype, temp_ptr=FP32, seed_ptr=I64, val_ptr=FP32, idx_ptr=I64, stride=1, V=1,
                   inv_cap=1.0, cap=1.0, CHUNK=8192, BLOCK=512, SOFTCAP=True, LIBDEVICE=True)
    compile_for_hopper(logit_kernels._gumbel_argmax_kernel, **sampler)


_ALIGNED = frozenset({"stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_ko", "stride_kh",
                      "stride_vb", "stride_vo", "stride_vh", "stride_bt", "stride_wab", "stride_wah", "stride_was",
                      "stride_wmb", "stride_wmh", "window"})
_SMEM_SM90 = 227 * 1024  # the most shared memory a block may take on an H100 / H200


@pytest.mark.parametrize("split", [False, True], ids=["unified", "split_kv"])
@pytest.mark.parametrize("tile_n, num_warps, num_stages", [(64, 4, 2), (32, 4, 5), (16, 4, 5), (16, 4, 8),
                                                           (32, 8, 5), (64, 4, 5)])
def test_wide_head_decode_candidates_fit_hopper(split, tile_n, num_warps, num_stages):
    """Gemma 2's decode attention (heads of 256, GQA 2, soft-capped, windowed) at the tiles
    ``benchmarks/probes/gemma2_decode.py`` replays: each compiles with the launch's specialisations,
    copies its tiles asynchronously and fits an SM's shared memory."""
    cache = dict(k_cache_ptr=BF16, v_cache_ptr=BF16, stride_kb=16384, stride_ko=1024, stride_kh=256,
                 stride_vb=16384, stride_vo=1024, stride_vh=256, stride_vd=1, block_table_ptr=I32, stride_bt=512,
                 qsl_ptr=I32, seq_lens_ptr=I32, qk_scale=1.0, softcap=1.0, window=4096, HEAD_D=256, D_PAD=256,
                 BLOCK_SIZE=16, USE_WINDOW=True, DOT_PREC="tf32", FP16_TILES=False, V_BY_BLOCK=False, SOFTCAP=True,
                 TILE_N=tile_n, num_warps=num_warps, q_ptr=BF16, ws_acc_ptr=FP32, ws_max_ptr=FP32, ws_sum_ptr=FP32,
                 stride_qt=2048, stride_qh=256, stride_wab=2048 * 16, stride_wah=256 * 16, stride_wmb=8 * 16,
                 stride_wmh=16, NUM_Q_PER_KV=2, BLOCK_M=16)
    if split:
        kernel, args = triton_paged._split_kv_decode_kernel, dict(cache, stride_was=256, NUM_SEGMENTS=4, PDL=True)
    else:
        kernel, args = triton_paged._unified_attention_kernel, dict(
            cache, out_ptr=BF16, num_seqs=2, v_scale=1.0, stride_ot=2048, stride_oh=256, prefix_lens_ptr=I32,
            GQA_PAD=2, BLOCK_Q=1, NUM_KV_HEADS=4, ONE_TOKEN_PER_SEQ=True, RESUME=False)
    compiled = _compile(kernel, args, _ALIGNED, num_stages)
    assert "cp.async" in compiled.asm["ptx"]
    assert compiled.metadata.shared <= _SMEM_SM90


@pytest.mark.parametrize("position", [I64, I32])
def test_dashboard_sample_keys_kernel(position):
    """The dashboards' key hash: 64-bit integer arithmetic throughout (the 32-bit masks and the
    multiplier widened, never truncated), on the int64 and int32 label columns a pass hands it."""
    from steerable.sae.dashboards import grid

    ptx = compile_for_hopper(grid._sample_keys_kernel, feature_ptr=I64, example_ptr=I64, position_ptr=position,
                             out_ptr=I64, n=1, seed_lo=1, seed_hi=1, BLOCK=1024)
    assert "mul.lo.s64" in ptx and "st.global" in ptx
