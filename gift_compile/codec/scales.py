"""Scale machinery of the low-bit formats: scale statistics, power-of-two scales, the E4M3 and
E8M0 scale codes.

Split out of the format families (`gift_compile.codec.formats`, which combine these pieces
into each family's `choose_scales`) because the statistics and scale codes are shared by
several families and are restated by the explicit kernels (`gift_compile.kernels`); the
package's docstring (`gift_compile.codec`) states the numerics.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from gift_compile.codec.layout import FP32_MAX

Agree = Callable[[torch.Tensor], torch.Tensor]

E4M3_MAX = 448.0
_E8M0_NAN = 255
_E4M3_NAN = 127


def _finite_amax(t: torch.Tensor, dims: tuple[int, ...] | int, keepdim: bool = True) -> torch.Tensor:
    """amax of |t| with NaN/Inf mapped to +inf, so an all-reduce MAX keeps the marker.

    An empty reduction (a `[5, 0]` tensor's rows) gives 0, the statistic of an all-zero group.
    """
    dims = (dims,) if isinstance(dims, int) else dims
    dims = tuple(d % t.dim() for d in dims)
    if any(t.shape[d] == 0 for d in dims):
        shape = [1 if i in dims else n for i, n in enumerate(t.shape) if keepdim or i not in dims]
        return t.new_zeros(shape)
    a = t.abs().amax(dim=dims, keepdim=keepdim)
    return torch.where(torch.isfinite(a), a, torch.full_like(a, math.inf))


def _global_max(stat: torch.Tensor) -> torch.Tensor:
    """Largest entry of a non-negative statistic as a `[1]` tensor (0 when empty)."""
    if stat.numel() == 0:
        return stat.new_zeros(1)
    return stat.amax().reshape(1)


def _mean_abs(xb: torch.Tensor, step: float, cols: int) -> torch.Tensor:
    """`step * mean(|x|)` of each block (the last dim of `xb`, `[..., nblocks, block]`) over the
    block's real elements: fp32, +inf if non-finite.

    `cols` is the row's width before it was zero-padded to whole blocks: a row's last block
    holds `cols - (nblocks - 1) * block` real values, and its mean is taken over those only
    (averaging the padding's zeros in would shrink the scale of a `[64, 40]` gradient's last
    block by 4x under a block of 32, and a `[64, 1]` one's by 32x). The mean is
    `(sum * step) / count` in fp64, a correctly rounded division (the explicit kernels,
    `gift_compile.kernels.triton_codec._block_stat`, compute the same expression); for a full
    block of 32 it has the bits of `sum * (step / 32)`.

    The sum is an fp64 reduction, exact wherever a block's nonzero magnitudes span at most
    29 - log2(n) binades (24 for n = 32 values): fp32 values, each a multiple of the smallest
    one's ulp, then add up within fp64's 53 bits, so every summation order (eager ATen's,
    Inductor's vectorized loop) gives the same bits. A block with a wider spread may differ
    in the last fp64 bit between orders, which reaches its fp32 statistic only on an fp32
    rounding boundary; every rank runs the same kernel either way. A reduction, unlike a
    spelled-out pairwise tree (16 loads per block statistic, past Inductor's inlining
    limit), is computed in the loop that reads the block, without a partial sum written out
    and read back. fp64 also keeps the sum of values near fp32's maximum finite; the result
    saturates at fp32's maximum instead of becoming the non-finite marker.
    """
    t = xb.abs().double()
    block = t.shape[-1]
    # real values per block: `block`, except in a ragged row's last block (at least 1: a row
    # with columns has a value in each of its blocks)
    starts = torch.arange(t.shape[-2], device=t.device, dtype=torch.float64) * block
    count = (cols - starts).clamp(1, block)
    m = t.sum(-1) * step / count
    m = torch.where(torch.isfinite(m), m.clamp(max=FP32_MAX), math.inf)
    return m.float()


def _pow2_limits(fmax: float) -> tuple[int, int]:
    """`fmax`'s unbiased exponent and its 23 mantissa bits (as an int): `_pow2_scale` compares
    a statistic's bits with these, and the explicit fp8 kernels take them as constants."""
    mant, exp2 = math.frexp(fmax)  # fmax = mant * 2**exp2, mant in [0.5, 1)
    return exp2 - 1, int((2 * mant - 1) * (1 << 23))


def _pow2_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """Smallest power of two `s` with `amax / s <= fmax`, by exponent arithmetic.

    Power-of-two scales make scaling exact: eager and compiled code (which may rewrite a
    division as a reciprocal multiply) produce the same codes even on the exact rounding
    ties that sums of decoded codes create, and no transcendental function is involved.
    Zero maps to 1; the result lies in [2**-126, 2**127].
    """
    max_exp, max_mant_bits = _pow2_limits(fmax)
    bits = amax.contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 127
    k = exp - max_exp + ((bits & 0x7FFFFF) > max_mant_bits).to(torch.int32)
    k = torch.where(amax > 0, k, torch.zeros_like(k)).clamp(-126, 127)
    return ((k + 127) << 23).view(torch.float32)


def _pow2_inverse(s: torch.Tensor) -> torch.Tensor:
    """Exact `1 / s` for powers of two in [2**-127, 2**127] (0 for +inf), on the exponent bits.

    A division would be correct too on CPU, but CUDA kernels generated by Inductor divide
    approximately; flipping the biased exponent is exact everywhere.
    """
    e = (s.contiguous().view(torch.int32) >> 23) & 0xFF
    bits = torch.where(e == 0, 254 << 23, (254 - e) << 23)  # e == 0: the subnormal 2**-127
    bits = torch.where(e == 254, 1 << 22, bits)  # 1 / 2**127 = 2**-127, subnormal
    bits = torch.where(e == 255, 0, bits)
    return bits.view(torch.float32)


def _e4m3_code(v: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 -> E4M3 byte (round to nearest even, saturating); non-finite -> NaN code."""
    code = v.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isfinite(v), code, torch.full_like(code, _E4M3_NAN))


def _e4m3_decode(code: torch.Tensor) -> torch.Tensor:
    return code.view(torch.float8_e4m3fn).to(torch.float32)


def _e8m0_code(amax: torch.Tensor, emax: int) -> torch.Tensor:
    """Biased E8M0 exponent `floor(log2(amax)) - emax + 127`, from the exponent bits.

    Blocks below 2**-126 share the smallest code; +inf (non-finite) gives the NaN code.
    """
    bits = amax.clamp(min=2.0**-126).contiguous().view(torch.int32)
    code = (((bits >> 23) & 0xFF) - emax).clamp(0, 254)
    return torch.where(torch.isinf(amax), _E8M0_NAN, code).to(torch.uint8)


def _e8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """fp32 `2**(code - 127)` (code 0 is the subnormal 2**-127), NaN for the NaN code."""
    c = code.to(torch.int32)
    s = torch.where(c > 0, c << 23, 1 << 22).view(torch.float32)
    return torch.where(c == _E8M0_NAN, math.nan, s)


def _tensor_scale(gmax: torch.Tensor, level: float) -> torch.Tensor:
    """A two-level format's fp32 tensor scale from the largest block statistic `gmax` (`[1]`):
    the power of two that maps it onto E4M3's range times the grid `level`, +inf kept.

    Capped at 2**119 so that no E4M3 code times the tensor scale overflows (448 * 2**119 <
    2**128); only statistics near fp32's maximum are affected, and their codes saturate.
    Shared with the explicit kernels' scale choice (`gift_compile.kernels`), which computes
    the statistics in a kernel and this one-element step here.
    """
    return torch.where(torch.isinf(gmax), gmax, _pow2_scale(gmax, E4M3_MAX * level).clamp(max=2.0**119))


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t
