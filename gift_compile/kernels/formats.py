"""Which formats have explicit kernels, and the compile-time parameters a kernel takes for each.

Read off the codec's format table (`gift_compile.codec.formats`), so a format's kernels cannot
drift from its reference: the code width and word layout come from the family's element grid
(`codec.codes.Grid.word_layout`), the block statistic, mean-|x| multiplier and grid level from
the `TwoLevel` family, the integer range from the grid's `imax`.

Kernels exist for the two-level formats (E4M3 block scale x power-of-two tensor scale): nvfp4,
int6, int4, int3, int2 and ternary, round to nearest: the formats whose Inductor-generated
codec moved furthest from its floor on the H200 (issue 26). The fp8 formats (one fp32 scale
per tensor, row or block, a float8 cast per element), the E8M0 formats (mxfp8, mxint4) and
stochastic rounding have none yet: they keep the Inductor-generated codec
(`gift_compile.kernels.dispatch` says so, per format).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from gift_compile.codec.codes import E2M1, Int2, IntGrid, Ternary
from gift_compile.codec.formats import FORMAT_TABLE, TwoLevel
from gift_compile.codec.spec import FormatSpec

__all__ = ["KERNEL_FORMATS", "KernelFormat", "kernel_format"]

# The kernels' `KIND` constexpr (`triton_codec.KIND_*`) of each element grid they implement.
_KIND = {E2M1: 0, IntGrid: 1, Int2: 2, Ternary: 3}
# Every two-level format on one of those grids has kernels.
KERNEL_FORMATS = tuple(name for name, fam in FORMAT_TABLE.items()
                       if isinstance(fam, TwoLevel) and type(fam.grid) in _KIND)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class KernelFormat:
    """The constexprs of one format's kernels (`gift_compile.kernels.triton_codec`).

    `kind` (E2M1 / integer / int2 / ternary), `bits` per code (0 for ternary's base-3 digits),
    `per` codes per word and `per_p2` its next power of two (the tile's digit axis), `nbytes`
    per word (1, or 3 for 3- and 6-bit codes), `imax` the largest integer magnitude (the
    integer formats' threshold count), `block` the scale block, `mean_abs_factor` the
    multiplier of a mean-|x| statistic over the fp64 block sum (None for amax), `inv_level`
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
    mean_abs_factor: float | None
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
    factor = None
    if fam.mean_abs_step is not None:
        factor = fam.mean_abs_step / block
        # the kernel multiplies an fp64 sum by this constant, which Triton carries as fp32:
        # exact for the block lengths (powers of two) and multipliers the codec has
        assert _as_fp32(factor) == factor, factor
    return KernelFormat(spec.name, _KIND[type(fam.grid)], fam.grid.bits, per, _next_pow2(per), nbytes,
                        fam.grid.imax, block, factor, 1.0 / fam.level)


def _as_fp32(x: float) -> float:
    """`x` rounded to fp32 (the precision Triton gives a Python float constant)."""
    return struct.unpack("f", struct.pack("f", x))[0]
