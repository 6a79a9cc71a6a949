"""Which formats have explicit kernels, and the compile-time parameters a kernel takes for each.

Read off the codec's format table (`gift_compile.codec.formats`), so a format's kernels cannot
drift from its reference: the code width and word layout come from the family's element grid
(`codec.codes.Grid.word_layout`), the block statistic, mean-|x| multiplier and grid level from
the `TwoLevel` family, the integer range from the grid's `imax`.

Kernels exist for the two-level formats (E4M3 block scale x power-of-two tensor scale): nvfp4,
int6, int4, int3, int2 and ternary (`KERNEL_FORMATS`, `kernel_format`), and for the fp8
formats fp8_e4m3 and fp8_e5m2 (a power-of-two fp32 scale per tensor, row or block of at most
`FP8_MAX_BLOCK` elements, a float8 code per element: `FP8_KERNEL_FORMATS`, `fp8_kernel_format`),
round to nearest: the formats whose Inductor-generated codec's bytes moved 1.6-3.8x off the
floor between torch releases (issue 26). The E8M0 formats (mxfp8, mxint4), stochastic rounding
and fp8 blocks longer than `FP8_MAX_BLOCK` have none: they keep the Inductor-generated codec
(`gift_compile.kernels.dispatch` says so, per format).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from gift_compile.codec.codes import E2M1, Int2, IntGrid, Ternary
from gift_compile.codec.formats import FORMAT_TABLE, Float8, TwoLevel
from gift_compile.codec.layout import Scaling
from gift_compile.codec.scales import _pow2_limits
from gift_compile.codec.spec import FormatSpec

__all__ = ["FP8_KERNEL_FORMATS", "FP8_MAX_BLOCK", "FP8_SCALINGS", "Fp8KernelFormat", "KERNEL_FORMATS", "KernelFormat",
           "fp8_kernel_format", "kernel_format"]

# The kernels' `KIND` constexpr (`triton_codec.KIND_*`) of each element grid they implement.
_KIND = {E2M1: 0, IntGrid: 1, Int2: 2, Ternary: 3}
# Every two-level format on one of those grids has kernels.
KERNEL_FORMATS = tuple(name for name, fam in FORMAT_TABLE.items()
                       if isinstance(fam, TwoLevel) and type(fam.grid) in _KIND)
# Every fp8 format (`Float8`: fp8_e4m3, fp8_e5m2) has kernels, for each scaling.
FP8_KERNEL_FORMATS = tuple(name for name, fam in FORMAT_TABLE.items() if isinstance(fam, Float8))
# The kernels' `SCALING` constexpr of each scaling (`triton_fp8.TENSOR` / `ROW` / `BLOCK`).
FP8_SCALINGS = {Scaling.TENSOR: 0, Scaling.ROW: 1, Scaling.BLOCK: 2}
# The longest fp8 scale block the block-statistic kernel takes: its tile holds whole blocks
# (one program, `ops_fp8.ELEMENTS_PER_PROGRAM` elements); longer blocks (block_size is any even
# number for fp8) keep the generated codec.
FP8_MAX_BLOCK = 1024


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class KernelFormat:
    """The constexprs of one format's kernels (`gift_compile.kernels.triton_codec`).

    `kind` (E2M1 / integer / int2 / ternary), `bits` per code (0 for ternary's base-3 digits),
    `per` codes per word and `per_p2` its next power of two (the tile's digit axis), `nbytes`
    per word (1, or 3 for 3- and 6-bit codes), `imax` the largest integer magnitude (the
    integer formats' threshold count), `block` the scale block, `mean_abs_step` the
    multiplier of a mean-|x| statistic (`(fp64 block sum * step) / real values`; None for
    amax), `inv_level`
    the fp32 multiplier mapping a statistic onto the grid level (1.0 where the level is 1).
    """

    name: str
    kind: int
    bits: int
    per: int
    per_p2: int
    nbytes: int
    imax: int
    block: int
    mean_abs_step: float | None
    inv_level: float


def kernel_format(spec: FormatSpec) -> KernelFormat:
    """The kernel parameters of `spec`; ValueError naming the format when it has no kernels."""
    fam = spec.family
    if spec.name not in KERNEL_FORMATS or not isinstance(fam, TwoLevel):
        raise ValueError(f"format {spec.name!r} has no explicit codec kernels; kernels exist for "
                         f"{', '.join(KERNEL_FORMATS)} (the others run as Inductor-generated code)")
    per, nbytes = fam.grid.word_layout()
    block = spec.block
    assert block is not None
    step = fam.mean_abs_step
    # the kernel multiplies an fp64 sum by this constant, which Triton carries as fp32: exact
    # for the steps the codec has (0.625, 1.5)
    assert step is None or _as_fp32(step) == step, step
    return KernelFormat(spec.name, _KIND[type(fam.grid)], fam.grid.bits, per, _next_pow2(per), nbytes,
                        fam.grid.imax, block, step, 1.0 / fam.level)


def _as_fp32(x: float) -> float:
    """`x` rounded to fp32 (the precision Triton gives a Python float constant)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class Fp8KernelFormat:
    """The constexprs of one fp8 format's kernels (`gift_compile.kernels.triton_fp8`), read off
    its `Float8` family: `mbits` mantissa bits (3 for E4M3, 2 for E5M2; the exponent has the
    other 7 - mbits), `emin` the smallest normal exponent, `fmax` the largest finite value the
    encoder saturates at, `ieee_specials` whether the top exponent holds +-inf and NaNs (E5M2)
    rather than one NaN per sign (E4M3 "fn"), `max_exp` / `max_mant` `fmax`'s exponent and
    mantissa bits (`codec.scales._pow2_limits`, the scale choice's constants), `scaling` the
    `FP8_SCALINGS` constexpr, `block` the scale block (0 for tensor and row scaling)."""

    name: str
    mbits: int
    emin: int
    fmax: float
    ieee_specials: bool
    max_exp: int
    max_mant: int
    scaling: int
    block: int


def fp8_kernel_format(spec: FormatSpec) -> Fp8KernelFormat:
    """The fp8 kernel parameters of `spec`; ValueError naming the format (or its block) when the
    fp8 kernels do not serve it."""
    fam = spec.family
    if not isinstance(fam, Float8):
        raise ValueError(f"format {spec.name!r} has no explicit fp8 codec kernels; they exist for "
                         f"{', '.join(FP8_KERNEL_FORMATS)}")
    block = spec.block or 0
    if block > FP8_MAX_BLOCK:
        raise ValueError(f"format {spec.name!r} with block_size={block}: the fp8 kernels take scale blocks of at most "
                         f"{FP8_MAX_BLOCK} elements")
    el = fam.elements
    max_exp, max_mant = _pow2_limits(el.fmax)
    return Fp8KernelFormat(spec.name, el.mbits, el.emin, el.fmax, el.dtype == torch.float8_e5m2, max_exp, max_mant,
                           FP8_SCALINGS[spec.scaling], block)
