"""The format table: one class per format family, one instance per format, keyed by name.

A family owns everything its formats do differently: the block length, the scale statistic
and scale codes (`choose_scales`), how elements become codes (`encode`) and back (`values`,
`decode_scales`), payload and scale bytes, the non-finite flag read off the scales, and how a
residual is stored (`residual_dtype`). `FORMAT_TABLE` is the only place that knows format
names; `FormatSpec` (`gift_compile.codec.spec`) resolves a name to its family once, and
`encode` / `decode` (`gift_compile.codec`) do the shared checks and broadcasting and call the
family's methods, so no caller compares names.

Families (the package docstring gives their bits per element and numerics):

- `Passthrough`: fp32, bf16 (no scales; bf16 saturates at its largest finite value);
- `Float8`: fp8_e4m3, fp8_e5m2, a power-of-two fp32 scale per tensor, row or block;
- `MxFloat8`, `MxInt`: E8M0 block scales (OCP MX, block 32) over E4M3 elements (mxfp8) or an
  integer grid (mxint4);
- `TwoLevel`: E4M3 block scales times a power-of-two fp32 tensor scale over an element grid
  (`gift_compile.codec.codes`): nvfp4 (E2M1, block 16), int6, int4, int3, int2, ternary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from gift_compile.codec.codes import E2M1, E2M1_MAX, Grid, Int2, Ternary, _stochastic_grid, grid_codes, int_grid
from gift_compile.codec.layout import Scaling, _blocks
from gift_compile.codec.scales import (
    E4M3_MAX, _E8M0_NAN, Agree, _e4m3_code, _e4m3_decode, _e8m0_code, _e8m0_decode, _finite_amax, _global_max,
    _mean_abs, _pow2_inverse, _pow2_scale, _tensor_scale,
)

# `codec.spec.FormatSpec` holds a family and imports this module; the families read only its
# fields, so they name it by this alias instead of importing it back (no cycle, even for typing).
FormatSpec = Any

__all__ = ["FORMAT_TABLE", "Float8", "Format", "MxFloat8", "MxInt", "Passthrough", "TwoLevel"]

MX_BLOCK = 32
NVFP4_BLOCK = 16
BF16_MAX = torch.finfo(torch.bfloat16).max


@dataclass(frozen=True)
class Float8Elements:
    """A float8 element type: torch dtype, largest finite value, mantissa bits, smallest normal
    exponent (the last two drive stochastic rounding)."""

    dtype: torch.dtype
    fmax: float
    mbits: int
    emin: int

    def encode(self, v: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        """Bytes of the scaled values `v`, rounded to nearest by the cast or stochastically."""
        if u is not None:
            v = _stochastic_grid(v, self.mbits, self.emin, u)
        return v.clamp(-self.fmax, self.fmax).to(self.dtype).view(torch.uint8)

    def values(self, payload: torch.Tensor) -> torch.Tensor:
        return payload.contiguous().view(self.dtype).to(torch.float32)


E4M3 = Float8Elements(torch.float8_e4m3fn, E4M3_MAX, 3, -6)
E5M2 = Float8Elements(torch.float8_e5m2, 57344.0, 2, -14)


@dataclass(frozen=True)
class Format:
    """A wire format. Class attributes describe the family; instance fields the format.

    `passthrough`: the payload is the values themselves, no scales; `lossless`: an fp32 tensor
    survives the round trip exactly (a hop in this format is the plain collective); `float8_codes`: the payload
    is float8 values seen as bytes; `has_tensor_scale`: `choose_scales` also returns an fp32
    tensor scale; `block_sized`: the block length is `FormatSpec.block_size` (restricted to
    `spec.BLOCK_SIZE_CHOICES`); `residual_dtype`: a residual in this format is one tensor of
    this dtype (None: codes plus scales, `gift_compile.codec.residual`); `rounds`: encoding
    rounds values (everything but fp32), so stochastic rounding has something to decide.
    """

    name: str

    passthrough = False
    lossless = False
    rounds = True
    float8_codes = False
    has_tensor_scale = False
    block_sized = False

    @property
    def residual_dtype(self) -> torch.dtype | None:
        return None

    def block(self, spec: FormatSpec) -> int | None:
        """Block length along the last dim, or None for tensor/row scaling."""
        return None

    def payload_cols(self, cp: int) -> int:
        """Payload bytes of a row of `cp` (padded) columns."""
        raise NotImplementedError

    def scale_bytes(self, spec: FormatSpec, rows: int, cp: int) -> int:
        """Bytes of every scale of a `[rows, cp]` (padded) tensor."""
        raise NotImplementedError

    def choose_scales(self, x2: torch.Tensor, spec: FormatSpec, agree: Agree,
                      cols: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(scales, tensor_scale)` of the padded row view `x2`, statistics agreed via `agree`.

        `cols` is the row view's width before padding: the zeros past it are not the tensor's,
        so a statistic that averages (int2's, ternary's) counts only the first `cols` columns."""
        raise NotImplementedError

    def encode(self, x2: torch.Tensor, spec: FormatSpec, scales: torch.Tensor, tensor_scale: torch.Tensor | None,
               u: torch.Tensor | None) -> torch.Tensor:
        """uint8 payload of the padded row view `x2` (`u`: stochastic-rounding uniforms or None)."""
        raise NotImplementedError

    def values(self, payload: torch.Tensor, cp: int) -> torch.Tensor:
        """fp32 element values of `payload` `[..., rows, payload_cols]` in units of their scale."""
        raise NotImplementedError

    def decode_scales(self, scales: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
        """fp32 scale each group's values are multiplied by (NaN for a non-finite group)."""
        raise NotImplementedError

    def nonfinite(self, scales: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
        """0-d bool: the scales carry the non-finite marker (`codec.scales_nonfinite`)."""
        raise NotImplementedError


def _stochastic_bf16(x2: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """fp32 values already on bf16's grid, each rounded up or down with probability given by
    its distance to the two neighbours (unbiased): a uniform 16-bit integer drawn from `u` is
    added to the fp32 bit pattern below bf16's mantissa and the low 16 bits are cleared, the
    integer form of `floor(x / ulp + u) * ulp` on the magnitude (exact, no float division;
    sign-magnitude bits make it the same for both signs). NaN keeps its value; a finite value
    carried past bf16's largest is saturated by the caller, +-inf is unchanged."""
    bits = x2.contiguous().view(torch.int32)
    dither = (u * 65536.0).to(torch.int32)  # in [0, 65535]: u < 1 with 24-bit resolution
    rounded = (bits.to(torch.int64) + dither) & 0xFFFF0000
    # back to the int32 bit pattern (values >= 2^31 are the negative numbers' patterns)
    rounded = torch.where(rounded >= 2**31, rounded - 2**32, rounded).to(torch.int32).view(torch.float32)
    keep = ~torch.isfinite(x2)
    return torch.where(keep, x2, rounded)


@dataclass(frozen=True)
class Passthrough(Format):
    """The values in `dtype`, no scales; `saturate` clamps finite values (bf16's largest)."""

    dtype: torch.dtype = torch.float32
    saturate: float | None = None

    passthrough = True

    @property
    def residual_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def lossless(self) -> bool:
        """Whether an fp32 tensor survives the round trip exactly (fp32 itself)."""
        return self.dtype == torch.float32

    def payload_cols(self, cp: int) -> int:
        return self.dtype.itemsize * cp

    def scale_bytes(self, spec: FormatSpec, rows: int, cp: int) -> int:
        return 0

    def choose_scales(self, x2: torch.Tensor, spec: FormatSpec, agree: Agree, cols: int) -> tuple[torch.Tensor, None]:
        return x2.new_zeros(0), None

    @property
    def rounds(self) -> bool:
        """Whether the cast rounds (bf16), so stochastic rounding has something to change."""
        return not self.lossless

    def encode(self, x2: torch.Tensor, spec: FormatSpec, scales: torch.Tensor, tensor_scale: torch.Tensor | None,
               u: torch.Tensor | None) -> torch.Tensor:
        infinite = torch.isinf(x2)
        if u is not None:
            x2 = _stochastic_bf16(x2, u)
        if self.saturate is not None:
            # Saturate finite values that would round past the dtype's largest value; +-inf stays.
            x2 = torch.where(infinite, x2, x2.clamp(-self.saturate, self.saturate))
        return x2.to(self.dtype).contiguous().view(torch.uint8)

    def values(self, payload: torch.Tensor, cp: int) -> torch.Tensor:
        return payload.contiguous().view(self.dtype).to(torch.float32)


@dataclass(frozen=True)
class Float8(Format):
    """float8 elements under a power-of-two fp32 scale per tensor, row or block of `block_size`
    (`FormatSpec.scaling`); the scale statistic is the group's amax, +inf when non-finite."""

    elements: Float8Elements = E4M3

    float8_codes = True

    def block(self, spec: FormatSpec) -> int | None:
        return spec.block_size if spec.scaling is Scaling.BLOCK else None

    def payload_cols(self, cp: int) -> int:
        return cp

    def scale_bytes(self, spec: FormatSpec, rows: int, cp: int) -> int:
        nscale = {Scaling.TENSOR: 1, Scaling.ROW: rows}.get(spec.scaling, rows * cp // spec.block_size)
        return 4 * nscale

    def choose_scales(self, x2: torch.Tensor, spec: FormatSpec, agree: Agree, cols: int) -> tuple[torch.Tensor, None]:
        if spec.scaling is Scaling.TENSOR:
            # The rows' maxima first, then theirs (the same value): a row reduction shares
            # the loops of a `[rows, cols]` producer such as the low-rank map's expansion, so
            # the kernel that writes the expansion takes the row maxima on the way instead of
            # a full-tensor reduction reading it back.
            amax = _global_max(_finite_amax(x2, 1, keepdim=False))
        elif spec.scaling is Scaling.ROW:
            amax = _finite_amax(x2, 1, keepdim=False)
        else:
            amax = _finite_amax(_blocks(x2, spec.block_size), -1, keepdim=False)
        return self.scales_of(agree(amax)), None

    def scales_of(self, amax: torch.Tensor) -> torch.Tensor:
        """The fp32 scales of the (agreed) group statistics `amax`: the power of two that maps
        each onto the element range, +inf kept as the non-finite marker. Shared with the
        explicit kernels' per-tensor scale (`gift_compile.kernels`), which reduce the rows'
        statistics in a kernel and take this one-element step here."""
        return torch.where(torch.isinf(amax), amax, _pow2_scale(amax, self.elements.fmax))

    def encode(self, x2: torch.Tensor, spec: FormatSpec, scales: torch.Tensor, tensor_scale: torch.Tensor | None,
               u: torch.Tensor | None) -> torch.Tensor:
        inv = _pow2_inverse(scales)
        if spec.scaling is Scaling.BLOCK:
            v = _blocks(x2, spec.block_size) * inv.unsqueeze(-1)
        elif spec.scaling is Scaling.ROW:
            v = x2 * inv.unsqueeze(-1)
        else:
            v = x2 * inv
        return self.elements.encode(v.reshape(x2.shape), u)

    def values(self, payload: torch.Tensor, cp: int) -> torch.Tensor:
        return self.elements.values(payload)

    def decode_scales(self, scales: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
        return torch.where(torch.isinf(scales), math.nan, scales)

    def nonfinite(self, scales: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
        return torch.isinf(scales).any()


@dataclass(frozen=True)
class _E8M0Scaled(Format):
    """E8M0 block scales (OCP MX, block 32): `2**(floor(log2(block amax)) - emax)`, one byte per
    block, `emax` the exponent of the element grid's largest binade (E4M3: 448 = 1.75 * 2**8;
    integers up to 7 = 1.75 * 2**2); the scale codes themselves are agreed (monotone bytes)."""

    emax: int = 0

    def block(self, spec: FormatSpec) -> int:
        return MX_BLOCK

    def scale_bytes(self, spec: FormatSpec, rows: int, cp: int) -> int:
        return rows * cp // MX_BLOCK

    def choose_scales(self, x2: torch.Tensor, spec: FormatSpec, agree: Agree, cols: int) -> tuple[torch.Tensor, None]:
        amax = _finite_amax(_blocks(x2, MX_BLOCK), -1, keepdim=False)
        return agree(_e8m0_code(amax, self.emax)), None

    def decode_scales(self, scales: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
        return _e8m0_decode(scales)

    def nonfinite(self, scales: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
        return (scales == _E8M0_NAN).any()


@dataclass(frozen=True)
class MxFloat8(_E8M0Scaled):
    """mxfp8: E4M3 elements under E8M0 block scales."""

    elements: Float8Elements = E4M3

    float8_codes = True

    def payload_cols(self, cp: int) -> int:
        return cp

    def encode(self, x2: torch.Tensor, spec: FormatSpec, scales: torch.Tensor, tensor_scale: torch.Tensor | None,
               u: torch.Tensor | None) -> torch.Tensor:
        v = _blocks(x2, MX_BLOCK) * _pow2_inverse(_e8m0_decode(scales)).unsqueeze(-1)
        return self.elements.encode(v.reshape(x2.shape), u)

    def values(self, payload: torch.Tensor, cp: int) -> torch.Tensor:
        return self.elements.values(payload)


def _grid_payload(x2: torch.Tensor, grid: Grid, block: int, unit: torch.Tensor, inv_unit: torch.Tensor,
                  u: torch.Tensor | None) -> torch.Tensor:
    """Packed `grid` codes of `x2` `[rows, cp]` given per-block `unit` and `inv_unit` `[rows, nblocks]`."""
    rows, cols = x2.shape
    unit = unit.unsqueeze(-1).expand(rows, cols // block, block).reshape(rows, cols)
    inv_unit = inv_unit.unsqueeze(-1).expand(rows, cols // block, block).reshape(rows, cols)
    return grid.pack(grid_codes(x2, unit, inv_unit, grid, u))


@dataclass(frozen=True)
class MxInt(_E8M0Scaled):
    """mxint4: an integer grid under E8M0 block scales."""

    grid: Grid = int_grid(4, 7)

    def payload_cols(self, cp: int) -> int:
        return self.grid.payload_cols(cp)

    def encode(self, x2: torch.Tensor, spec: FormatSpec, scales: torch.Tensor, tensor_scale: torch.Tensor | None,
               u: torch.Tensor | None) -> torch.Tensor:
        unit = _e8m0_decode(scales)
        inv_unit = torch.where(torch.isnan(unit), 0.0, _pow2_inverse(unit))
        return _grid_payload(x2, self.grid, MX_BLOCK, unit, inv_unit, u)

    def values(self, payload: torch.Tensor, cp: int) -> torch.Tensor:
        return self.grid.values(self.grid.unpack(payload, cp))


@dataclass(frozen=True)
class TwoLevel(Format):
    """NVIDIA's two-level scheme over an element grid: a power-of-two fp32 tensor scale maps the
    largest block statistic onto E4M3's range times `level`, then each block's statistic over
    the tensor scale becomes an E4M3 code.

    The statistic is the block amax, or `mean_abs_step * mean(|x|)` when `mean_abs_step` is
    set (int2, ternary: for a Gaussian block the MSE-optimal uniform 4-level quantizer has its
    outer levels at 1.49 sigma = 1.87 E|x|, here 3 * 0.625, and the optimal ternary level is
    1.22 sigma = 1.53 E|x|, here 1.5). `level` is the grid level the statistic maps onto: int6
    maps its maximum onto 29, not 31, because its E4M3 block scale rounds to nearest (up to
    1/16 low) and 29 * 16/15 < 31 keeps the maximum inside the grid. `fixed_block` is the block
    of a format whose block is not `block_size` (nvfp4: 16).
    """

    grid: Grid = E2M1()
    level: float = 1.0
    mean_abs_step: float | None = None
    fixed_block: int | None = None

    has_tensor_scale = True

    @property
    def block_sized(self) -> bool:  # type: ignore[override]
        return self.fixed_block is None

    def block(self, spec: FormatSpec) -> int:
        return spec.block_size if self.fixed_block is None else self.fixed_block

    def payload_cols(self, cp: int) -> int:
        return self.grid.payload_cols(cp)

    def scale_bytes(self, spec: FormatSpec, rows: int, cp: int) -> int:
        return rows * cp // self.block(spec) + 4

    def choose_scales(self, x2: torch.Tensor, spec: FormatSpec, agree: Agree,
                      cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        xb = _blocks(x2, self.block(spec))
        if self.mean_abs_step is None:
            stat = _finite_amax(xb, -1, keepdim=False)
        else:
            stat = _mean_abs(xb, self.mean_abs_step, cols)
        gscale = _tensor_scale(agree(_global_max(stat)), self.level)
        unit = stat * _pow2_inverse(gscale)
        if self.level != 1.0:
            unit = unit * (1.0 / self.level)  # a multiply, spelled out: compiled code would use one anyway
        return agree(_e4m3_code(unit)), gscale

    def encode(self, x2: torch.Tensor, spec: FormatSpec, scales: torch.Tensor, tensor_scale: torch.Tensor | None,
               u: torch.Tensor | None) -> torch.Tensor:
        # unit = E4M3 block scale * tensor scale; its reciprocal is taken factor by factor
        # (the tensor scale's exactly), so it stays finite however small the block is.
        bscale = _e4m3_decode(scales)
        unit = bscale * tensor_scale
        unit = torch.where(torch.isfinite(unit), unit, math.nan)
        inv_b = torch.where(bscale > 0, 1.0 / bscale, 0.0)  # NaN code: NaN > 0 is False
        inv_unit = inv_b * _pow2_inverse(tensor_scale)
        inv_unit = torch.where(torch.isnan(unit), 0.0, inv_unit)
        return _grid_payload(x2, self.grid, self.block(spec), unit, inv_unit, u)

    def values(self, payload: torch.Tensor, cp: int) -> torch.Tensor:
        return self.grid.values(self.grid.unpack(payload, cp))

    def decode_scales(self, scales: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
        s = _e4m3_decode(scales) * tensor_scale
        return torch.where(torch.isfinite(s), s, math.nan)

    def nonfinite(self, scales: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
        assert tensor_scale is not None, f"{self.name}: two-level formats have a tensor scale"
        return torch.isinf(tensor_scale).any()


# The one table: format name -> its family instance. Everything else asks it (through FormatSpec).
FORMAT_TABLE: dict[str, Format] = {f.name: f for f in (
    Passthrough("fp32", torch.float32),
    Passthrough("bf16", torch.bfloat16, BF16_MAX),
    Float8("fp8_e4m3", E4M3),
    Float8("fp8_e5m2", E5M2),
    MxFloat8("mxfp8", emax=8, elements=E4M3),
    TwoLevel("nvfp4", E2M1(), level=E2M1_MAX, fixed_block=NVFP4_BLOCK),
    MxInt("mxint4", emax=2, grid=int_grid(4, 7)),
    TwoLevel("int6", int_grid(6, 31), level=29.0),
    TwoLevel("int4", int_grid(4, 7), level=7.0),
    TwoLevel("int3", int_grid(3, 3), level=3.0),
    TwoLevel("int2", Int2(), mean_abs_step=0.625),
    TwoLevel("ternary", Ternary(), mean_abs_step=1.5),
)}
