"""The exact, mergeable binning that lets one pass build histograms and quantile bins without
knowing a feature's maximum in advance, and the seeded keys that make its samples independent of
the order the corpus is read in.

A feature's ``n`` bins are ``[j * 2**e, (j + 1) * 2**e)`` for ``j < n``, with ``e`` the smallest
integer such that ``n * 2**e > max`` (the feature's largest activation). While a pass runs, ``max``
only grows, and each time ``e`` grows by ``d`` the bins merge ``2**d`` at a time (bin ``j`` becomes
bin ``j >> d``), which is exact: counts add up, and a sample's bottom-``k`` keys over the merged
bins is the bottom-``k`` over their own bottom-``k`` lists. The final bins therefore depend on the
corpus only, never on batch size, chunking or shards. The price is resolution: the activations
fill between half and all of the ``n`` bins.

Every value and edge is computed in float64 from float32 activations, where multiplying by a power
of two and taking the floor are exact.
"""

from __future__ import annotations

import torch

from steerable.layers import fused

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch path
    triton = None

NO_EXPONENT = -(2**20)  # a feature that has not fired yet: every bin is empty
_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # below 2**27: a 32-bit value times it stays within int64


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponent`` in float64, exactly, built from the bits (``exponent`` in [-1022, 1023])."""
    return ((exponent.long() + 1023) << 52).view(torch.float64)


def grid_exponent(peak: torch.Tensor, bins: int) -> torch.Tensor:
    """Per entry the smallest ``e`` with ``bins * 2**e > peak`` (int64); ``NO_EXPONENT`` where
    ``peak`` is 0. With ``2**(L-1) <= bins < 2**L`` and ``2**(x-1) <= peak < 2**x`` the answer is
    ``x - L`` or ``x - L + 1``."""
    peak = peak.double()
    _, x = torch.frexp(peak)
    guess = x.long() - int(bins).bit_length()
    exponent = torch.where(bins * pow2(guess.clamp(-1022, 1023)) > peak, guess, guess + 1)
    return torch.where(peak > 0, exponent.clamp(-1000, 1000), NO_EXPONENT)


def bin_index(values: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """``floor(value / 2**exponent)`` (int64), exact; ``exponent`` per value."""
    return torch.floor(values.double() * pow2(-exponent.clamp(-1000, 1000))).long()


def coarsen(counts: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Rows of bin counts ``[k, n]`` moved to a grid ``2**shift[k]`` times coarser (bin ``j`` into
    ``j >> shift``); ``shift >= 0``."""
    n = counts.shape[1]
    target = torch.arange(n, device=counts.device) >> shift.clamp(0, 62).unsqueeze(1)
    return torch.zeros_like(counts).scatter_add_(1, target, counts)


def regrid(counts: torch.Tensor, old_peak: torch.Tensor, new_peak: torch.Tensor, bins: int) -> torch.Tensor:
    """``counts`` ``[F, bins]`` kept on the grid of ``old_peak``, moved to the grid of ``new_peak``
    (``>= old_peak``)."""
    return move_to_grid(counts, grid_exponent(old_peak, bins), grid_exponent(new_peak, bins))


def move_to_grid(counts: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``regrid`` from the two grids' exponents. Every row goes through ``coarsen`` (a shift of 0
    leaves a row as it is), so nothing waits for the device to learn which rows moved."""
    return coarsen(counts, torch.where(old != NO_EXPONENT, new - old, 0))


def edges(peak: float, bins: int) -> list[float]:
    """The ``bins + 1`` edges of a feature whose largest activation is ``peak`` (> 0)."""
    width = float(pow2(grid_exponent(torch.tensor([peak]), bins))[0])
    return [j * width for j in range(bins + 1)]


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = ((x ^ (x >> 16)) * _MIX) & _M32
    x = ((x ^ (x >> 16)) * _MIX) & _M32
    return x ^ (x >> 16)


if triton is not None:
    @triton.jit
    def _mix_kernel(x):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit
    def _sample_keys_kernel(feature_ptr, example_ptr, position_ptr, out_ptr, n, seed_lo, seed_hi,
                            BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        feature = tl.load(feature_ptr + i, mask=inside, other=0).to(tl.int64)
        example = tl.load(example_ptr + i, mask=inside, other=0).to(tl.int64)
        position = tl.load(position_ptr + i, mask=inside, other=0).to(tl.int64)
        h = _mix_kernel((feature & 0xFFFFFFFF) ^ seed_lo.to(tl.int64))
        h = _mix_kernel(h ^ (example & 0xFFFFFFFF) ^ seed_hi.to(tl.int64))
        h = _mix_kernel(h ^ ((example >> 32) & 0xFFFFFFFF))
        tl.store(out_ptr + i, _mix_kernel(h ^ (position & 0xFFFFFFFF)), mask=inside)


def sample_keys(seed: int, feature: torch.Tensor, example: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """A 32-bit pseudo-random key (int64) for each (feature, corpus index, position), fixed by
    ``seed``: a quantile bin keeps the activations with the smallest keys (ties by corpus order),
    a uniform sample without replacement that no reading order can change. On a GPU one kernel
    (a dashboards pass hashes every non-zero activation: dozens of elementwise ops otherwise)."""
    seed = int(seed)
    if not (fused.enabled(feature) and len(feature)):
        return sample_keys_torch(seed, feature, example, position)
    out = torch.empty(len(feature), dtype=torch.long, device=feature.device)
    _sample_keys_kernel[(triton.cdiv(len(feature), 1024),)](
        feature.contiguous(), example.contiguous(), position.contiguous(), out, len(feature),
        seed & _M32, (seed >> 32) & _M32, BLOCK=1024)
    return out


def sample_keys_torch(seed: int, feature: torch.Tensor, example: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """``sample_keys`` in PyTorch ops: the CPU path and the kernel's reference."""
    h = _mix((feature.long() & _M32) ^ (seed & _M32))
    h = _mix(h ^ (example.long() & _M32) ^ ((seed >> 32) & _M32))
    h = _mix(h ^ ((example.long() >> 32) & _M32))
    return _mix(h ^ (position.long() & _M32))
