"""``y = x W^T (+ b)`` for a single row (a batch-1 decode step) as one Triton kernel.

At batch 1 a decode step streams every weight once and does almost no arithmetic. cuBLAS tiles
the product for many rows: on the H200, for a 0.6B model's projections, its one-row kernels took
4-12 us where this kernel takes 3-4 us (``docs/benchmarks.md``), and some add a split-K reduction
kernel. Those projections, not attention, set the batch-1 step time. Here each program owns a few
output features and streams their weight rows in long contiguous chunks; it accumulates in float32
and rounds once, as cuBLAS does, so results agree with ``F.linear`` to the last bit or two.

More rows read each weight tile once for all of them, which is what cuBLAS does well, so
``linear`` takes this path for exactly one row. The LM head keeps cuBLAS: at 150k rows of weights
it already streams them at full bandwidth. On a CPU, ``linear`` gives one row the CPU kernels'
streaming product and more rows oneDNN's prepacked weights (``cpu_linear``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from steerable.layers import cpu_kernels, fused
from steerable.layers.activation import GATED_ACTIVATIONS

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: callers use the PyTorch path
    triton = None


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_w, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                     GELU_TANH: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            w = tl.load(w_ptr + offs_n[:, None] * stride_w + offs_k[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            # The weights do not depend on the kernel before: under programmatic dependent launch
            # the first tile streams in while that kernel finishes, and only ``x`` waits for it.
            fused.pdl_enter(PDL)
            if GATED:  # x holds [gate | up]: the input is act(gate) * up, as fused.silu_and_mul computes it
                gate = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
                up = tl.load(x_ptr + K + offs_k, mask=k_mask, other=0.0).to(tl.float32)
                x = fused.gated_act(gate, up, y_ptr.dtype.element_ty, GELU_TANH).to(tl.float32)
            else:
                x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


def eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` takes the kernel: a fused-path device, one row, row-major weights."""
    return (fused.enabled(x) and x.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype
            and weight.dim() == 2 and weight.stride(1) == 1 and x.stride(1) == 1)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: str | None = None
         ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [1, K] and ``weight`` [N, K]; with ``gated`` ("silu" or
    "gelu_tanh") ``x`` is [1, 2K] (gate | up) and the input is ``act(gate) * up``, one kernel fewer per
    MLP. Tile sizes from a sweep on the H200: narrow outputs (o_proj, down_proj) want more programs,
    hence 2 rows each, whose whole weight rows (up to 4096 wide) load before the input is needed."""
    n, k = weight.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_n = 2 if n <= 2048 else 8
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, bias if bias is not None else weight, y, n, k,
                                             weight.stride(0), HAS_BIAS=bias is not None, GATED=gated is not None,
                                             GELU_TANH=gated == "gelu_tanh", BLOCK_N=block_n,
                                             BLOCK_K=min(4096 if block_n == 2 else 1024, triton.next_power_of_2(k)),
                                             num_warps=4, num_stages=3, **fused.pdl_args(x))
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through the one-row kernel where it applies (a batch-1 decode step), or on a CPU
    engine (not the fused GPU path run there) through oneDNN's prepacked weights
    (``packed_cpu_linear``)."""
    if eligible(x, weight):
        return gemv(x, weight, bias)
    if cpu_packed_eligible(x, weight):
        return cpu_linear(x, weight, bias)
    return F.linear(x, weight, bias)


_ONEDNN = torch.backends.mkldnn.is_available()


def cpu_packed_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product takes ``packed_cpu_linear``: float32 rows on a CPU engine with oneDNN."""
    return (x.is_cpu and _ONEDNN and not fused.enabled(x) and x.dim() == 2 and x.shape[0] > 0
            and x.dtype is torch.float32 and weight.dtype is torch.float32 and weight.dim() == 2)


CPU_MLP_ROWS = 512


def cpu_row_chunks(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``x`` in slices of ``CPU_MLP_ROWS`` rows where a CPU engine's gated MLP should take it so
    (``(x,)`` otherwise): at 2,048 rows of SmolLM2 the gate/up product alone is 25 MB, mapped afresh
    and faulted in at every layer, and out of cache before the down projection reads it; in slices of
    512 rows a 2,048-token prefill step took 3.32-3.43 against 3.51-3.68 s on one core of an AMX Xeon
    (256 rows: no better). Rows are independent, so the slices give the rows of the whole."""
    if x.shape[0] <= CPU_MLP_ROWS or not cpu_packed_eligible(x, weight):
        return (x,)
    return x.split(CPU_MLP_ROWS)


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A ``cpu_packed_eligible`` product: one row (a batch-1 decode step, memory-bound) through the
    streaming kernel where the CPU kernels have it (SmolLM2's weights read at 19-25 against oneDNN's
    12-14 GB/s on one Zen 4 core), more rows through ``packed_cpu_linear`` (at two rows and up the
    two were even or oneDNN ahead)."""
    if x.shape[0] == 1 and x.stride(1) == 1 and weight.stride(1) == 1:
        built = cpu_kernels.kernels()
        if built is not None and built.LINEAR_ROW:
            return built.linear_row(x, weight, bias)
    return packed_cpu_linear(x, weight, bias)


def packed_cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with ``weight`` in oneDNN's blocked layout, reordered once (kept on the weight,
    again after an in-place change of it) rather than by BLAS on every call. One packed copy serves
    every row count: on one core of the 2-core EPYC (Zen 4) box, SmolLM2's 30 layers of projections
    took 35 against 39 ms at one row (memory-bound), 142-183 against 199-213 ms at 64 rows and 4.0-4.4
    against 5.1 s at 2048 rows, and its 49,152-row LM head 36 against 73 ms (50 sliced) at 64 rows
    and 10.3 against 11.4 ms at one row. The packed copy holds the weight's bytes a second time."""
    packed = getattr(weight, "_onednn_packed", None)
    if packed is None or packed[0] != weight._version:
        packed = (weight._version, torch.ops.mkldnn._reorder_linear_weight(weight, 64))
        weight._onednn_packed = packed
    return torch.ops.mkldnn._linear_pointwise.default(x, packed[1], bias, "none", [], "")


def gated_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: str) -> torch.Tensor:
    """``F.linear(act(gate) * up, weight, bias)`` for ``gate_up`` [N, 2K] (gate | up), ``gated`` the
    activation ("silu": SwiGLU, "gelu_tanh": GeGLU): one kernel at batch 1, the gated kernel then
    ``linear`` otherwise."""
    if eligible(gate_up, weight) and gate_up.shape[1] == 2 * weight.shape[1] and gate_up.is_contiguous():
        return gemv(gate_up, weight, bias, gated)
    return linear(GATED_ACTIVATIONS[gated](gate_up), weight, bias)
