"""Which formats have explicit kernels, and the compile-time parameters a kernel takes for each.

Read off the codec's own tables (`gift_compile.codec.spec`, `.scales`, `.codes`), so a format's
kernels cannot drift from its reference: the code width and word layout come from the packer
(`codec.codes._word_layout`), the block statistic and grid level from `_TWO_LEVEL`, the
mean-|x| multiplier from `_MEAN_ABS_STEP`, the integer range from `_INT_MAX`.

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

from gift_compile.codec.codes import _word_layout
from gift_compile.codec.scales import _MEAN_ABS_STEP
from gift_compile.codec.spec import _CODE_BITS, _INT_MAX, _TWO_LEVEL, FormatSpec

__all__ = ["KERNEL_FORMATS", "KernelFormat", "kernel_format"]

KERNEL_FORMATS = ("nvfp4", "int6", "int4", "int3", "int2", "ternary")
_KIND = {"nvfp4": 0, "int6": 1, "int4": 1, "int3": 1, "int2": 2, "ternary": 3}


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
    if spec.name not in KERNEL_FORMATS:
        raise ValueError(f"format {spec.name!r} has no explicit codec kernels; kernels exist for "
                         f"{', '.join(KERNEL_FORMATS)} (the others run as Inductor-generated code)")
    per, nbytes = _word_layout(spec)
    block = spec.block
    assert block is not None
    stat, level = _TWO_LEVEL[spec.name]
    factor = None
    if stat == "mean_abs":
        factor = _MEAN_ABS_STEP[spec.name] / block
        # the kernel multiplies an fp64 sum by this constant, which Triton carries as fp32:
        # exact for the block lengths (powers of two) and multipliers the codec has
        assert _as_fp32(factor) == factor, factor
    return KernelFormat(spec.name, _KIND[spec.name], _CODE_BITS.get(spec.name, 0), per, _next_pow2(per), nbytes,
                        _INT_MAX.get(spec.name, 0), block, factor, 1.0 / level)


def _as_fp32(x: float) -> float:
    """`x` rounded to fp32 (the precision Triton gives a Python float constant)."""
    return struct.unpack("f", struct.pack("f", x))[0]
