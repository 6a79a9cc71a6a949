"""Low-bit gradient formats: quantize to a uint8 payload plus scales, and back.

Every format is expressed on a 2-D view `[rows, cols]` of the tensor (the last dimension is
`cols`), because the gradients GIFT sends are weight matrices sharded by rows: scales per row
or per block of a row stay with the rows they describe when a collective splits dim 0.

Scales are chosen in two steps, `choose_scales` then `encode`, so that a collective can agree
on them across ranks (all-reduce MAX) *before* encoding: every rank then writes codes on the
same grid and a receiver decodes any rank's codes with the same scales. Scale statistics are
kept in a form whose element-wise maximum is the right agreed value: fp32 amax for the fp8
formats, and for the block formats the scale *codes* themselves (E8M0 and positive E4M3
codes are monotone as unsigned bytes), which keeps the agreement traffic at one byte per block.

Families (bits per element on the wire, scales included, for long rows):

- pass-through: fp32 (32), bf16 (16, saturating at bf16's largest finite value);
- fp8_e4m3 / fp8_e5m2 (8 + 32 per tensor/row/block of `block_size`): power-of-two fp32 scale;
- E8M0 block scale (OCP MX style, block 32): mxfp8 (8.25, E4M3 elements), mxint4 (4.25,
  integers in [-7, 7]);
- E4M3 block scale times a power-of-two fp32 tensor scale (NVIDIA's two-level scheme):
  nvfp4 (4.5, E2M1 elements, block 16), int4 (integers in [-7, 7]; 4.5 / 4.25 for block
  16 / 32), int2 (levels {-3, -1, 1, 3} x step; 2.5 / 2.25), ternary (levels {-1, 0, 1}
  x step, five trits per byte; 2.1 / 1.85).

Numerics shared by every format:

- a non-finite input never becomes a finite number: its scale statistic becomes +inf (or
  the format's NaN scale code, which is also the largest byte), and decoding turns every
  element that shares that scale into NaN, identically on every rank;
- a finite input never decodes as +-inf: codes that round past fp32's largest value
  saturate there;
- scales are applied by multiplying with exact power-of-two reciprocals (computed on the
  exponent bits) and round-to-nearest integer codes are found by comparing |x| with exact
  multiples of the block scale, so no reciprocal overflows on tiny blocks, and eager and
  compiled code (which rewrites divisions) write the same codes;
- the grid's precision (relative to the scale group's maximum) holds for groups whose maximum
  is a normal fp32 number (>= 2**-126, about 1.2e-38; mxint4 2**-125) and, in the two-level
  formats, within 2**13 of the tensor maximum; other groups lose precision gradually and
  decode within their own magnitude, or to zero, never to a spurious block maximum.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable

import torch

from gift_compile.config import BLOCK_SIZE_CHOICES, BLOCK_SIZE_FORMATS, FORMATS, SCALINGS

Agree = Callable[[torch.Tensor], torch.Tensor]

FP32_MAX = torch.finfo(torch.float32).max
BF16_MAX = torch.finfo(torch.bfloat16).max
_FP8 = {
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0, 3, -6),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0, 2, -14),
}
MX_BLOCK = 32
NVFP4_BLOCK = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
INT4_MAX = 7
# E8M0-scaled formats: scale = 2**(floor(log2(block amax)) - emax), emax the exponent of the
# element grid's largest binade (E4M3: 448 = 1.75 * 2**8; integers up to 7 = 1.75 * 2**2).
_E8M0_EMAX = {"mxfp8": 8, "mxint4": 2}
# Two-level formats: the per-block statistic, and the grid level it maps onto.
_TWO_LEVEL = {"nvfp4": ("amax", E2M1_MAX), "int4": ("amax", float(INT4_MAX)),
              "int2": ("mean_abs", 1.0), "ternary": ("mean_abs", 1.0)}
# Mean-|x| multipliers giving the unit step of int2/ternary. For a Gaussian block the
# MSE-optimal uniform 4-level quantizer has its outer levels at 1.49 sigma = 1.87 E|x|
# (here 3 * 0.625 = 1.875), and the optimal ternary level is 1.22 sigma = 1.53 E|x| (1.5).
_MEAN_ABS_STEP = {"int2": 0.625, "ternary": 1.5}
_CODE_BITS = {"nvfp4": 4, "mxint4": 4, "int4": 4, "int2": 2}
_TRITS_PER_BYTE = 5  # 3**5 = 243 <= 256: 1.6 bits per trit
# Round-to-nearest-even decision thresholds between neighbouring grid magnitudes, as
# (threshold in units of the scale, whether a value equal to it rounds up).
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_INT4_STEPS = tuple((k + 0.5, k % 2 == 1) for k in range(INT4_MAX))
_INT2_STEPS = ((2.0, False),)  # magnitudes {1, 3}; a tie goes to the smaller one
_TERNARY_STEPS = ((0.5, False),)
_E8M0_NAN = 255
_E4M3_NAN = 127


def _count(name: str, value: object) -> int:
    """`value` as a non-negative int, or a ValueError naming `name`."""
    try:
        n = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} must be a non-negative integer") from None
    if n < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative integer")
    return n


@dataclass(frozen=True)
class FormatSpec:
    """A format with its scaling granularity; hashable, so it can be a graph constant."""

    name: str
    scaling: str = "row"
    block_size: int = 32

    def __post_init__(self) -> None:
        if self.name not in FORMATS:
            raise ValueError(f"unknown format {self.name!r}; allowed: {', '.join(FORMATS)}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"unknown scaling {self.scaling!r}; allowed: {', '.join(SCALINGS)}")
        b = self.block_size
        if not isinstance(b, int) or isinstance(b, bool) or b < 2 or b % 2:
            raise ValueError(f"block_size={b!r} must be an even integer >= 2")
        if self.name in BLOCK_SIZE_FORMATS and b not in BLOCK_SIZE_CHOICES:
            raise ValueError(
                f"block_size={b} is invalid for format {self.name!r}; allowed: "
                f"{', '.join(map(str, BLOCK_SIZE_CHOICES))}"
            )

    @property
    def block(self) -> int | None:
        """Block length along the last dim, or None for tensor/row scaling."""
        if self.name in _E8M0_EMAX:
            return MX_BLOCK
        if self.name == "nvfp4":
            return NVFP4_BLOCK
        if self.name in BLOCK_SIZE_FORMATS or (self.name in _FP8 and self.scaling == "block"):
            return self.block_size
        return None

    @property
    def passthrough(self) -> bool:
        return self.name in ("fp32", "bf16")

    @property
    def has_tensor_scale(self) -> bool:
        """Whether `choose_scales` also returns an fp32 tensor scale (two-level formats)."""
        return self.name in _TWO_LEVEL

    def padded_cols(self, cols: int) -> int:
        """`cols` rounded up to a whole number of blocks (the columns that get codes)."""
        cols = _count("cols", cols)
        b = self.block
        return cols if b is None else -(-cols // b) * b

    def payload_cols(self, cols: int) -> int:
        """Bytes of payload per row."""
        cp = self.padded_cols(cols)
        if self.name == "fp32":
            return 4 * cp
        if self.name == "bf16":
            return 2 * cp
        if self.name == "ternary":
            return -(-cp // _TRITS_PER_BYTE)
        return cp * _CODE_BITS.get(self.name, 8) // 8

    def bits_per_element(self, cols: int, rows: int = 1) -> float:
        """Exact wire bits per element for a [rows, cols] tensor (payload plus scales)."""
        if _count("cols", cols) * _count("rows", rows) == 0:
            raise ValueError(f"bits_per_element: a [{rows}, {cols}] tensor has no elements")
        return 8.0 * wire_bytes_for(self, rows, cols) / (rows * cols)


@dataclass
class QuantizedTensor:
    """Low-bit codes of a tensor: what goes on the wire, and how to read it back.

    `payload` is uint8 `[rows, payload_cols]`; `scales` holds the per-tensor/row/block scale
    (fp32 for fp8, uint8 E8M0 codes for mxfp8/mxint4, uint8 E4M3 codes for nvfp4/int4/int2/
    ternary, empty for the pass-through formats); `tensor_scale` is the fp32 second-level
    scale of the E4M3-scaled formats (None otherwise).
    """

    payload: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None
    shape: torch.Size
    dtype: torch.dtype
    spec: FormatSpec

    @property
    def format(self) -> str:
        return self.spec.name


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """The 2-D view every format works on: `[prod(leading dims), last dim]` (0-d: `[1, 1]`)."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    if x.dim() == 1:
        return x.reshape(1, x.shape[0])
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _pad_cols(x2: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    cp = spec.padded_cols(x2.shape[-1])
    if cp == x2.shape[-1]:
        return x2
    return torch.nn.functional.pad(x2, (0, cp - x2.shape[-1]))


def _blocks(x2: torch.Tensor, block: int) -> torch.Tensor:
    """`[..., rows, cols]` (cols a multiple of block) as `[..., rows, nblocks, block]`."""
    return x2.reshape(*x2.shape[:-1], x2.shape[-1] // block, block)


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


def _mean_abs(xb: torch.Tensor, factor: float) -> torch.Tensor:
    """`factor * mean(|x|)` over the last dim (a power of two long): fp32, +inf if non-finite.

    The sum runs in fp64 along an explicit pairwise tree: a library reduction may add in
    any order, and a one-ulp difference between eager and compiled sums would change a
    scale code. fp64 also keeps the sum of values near fp32's maximum finite; the result
    saturates at fp32's maximum instead of becoming the non-finite marker.
    """
    t = xb.abs().double()
    n = t.shape[-1]
    while t.shape[-1] > 1:
        h = t.shape[-1] // 2
        t = t[..., :h] + t[..., h:]
    m = t[..., 0] * (factor / n)
    m = torch.where(torch.isfinite(m), m.clamp(max=FP32_MAX), math.inf)
    return m.float()


def _pow2_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """Smallest power of two `s` with `amax / s <= fmax`, by exponent arithmetic.

    Power-of-two scales make scaling exact: eager and compiled code (which may rewrite a
    division as a reciprocal multiply) produce the same codes even on the exact rounding
    ties that sums of decoded codes create, and no transcendental function is involved.
    Zero maps to 1; the result lies in [2**-126, 2**127].
    """
    mant, exp2 = math.frexp(fmax)  # fmax = mant * 2**exp2, mant in [0.5, 1)
    max_exp, max_mant_bits = exp2 - 1, int((2 * mant - 1) * (1 << 23))
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


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def choose_scales(
    x: torch.Tensor, spec: FormatSpec, agree: Agree = _identity
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales for `x` (any shape; its 2-D row view is used), agreed through `agree`.

    `agree` receives each scale statistic and must return its element-wise maximum over the
    participants (identity for a single tensor). Returns `(scales, tensor_scale)`: scales
    `[1]` (tensor), `[rows]` (row) or `[rows, nblocks]`; see `QuantizedTensor` for dtypes.
    """
    x2 = _pad_cols(as_rows(x).float(), spec)
    if spec.passthrough:
        return x2.new_zeros(0), None
    if spec.name in _FP8:
        _, fmax, _, _ = _FP8[spec.name]
        if spec.scaling == "tensor":
            amax = _finite_amax(x2, (0, 1)).reshape(1)
        elif spec.scaling == "row":
            amax = _finite_amax(x2, 1, keepdim=False)
        else:
            amax = _finite_amax(_blocks(x2, spec.block_size), -1, keepdim=False)
        amax = agree(amax)
        scale = _pow2_scale(amax, fmax)
        return torch.where(torch.isinf(amax), amax, scale), None
    xb = _blocks(x2, spec.block)
    if spec.name in _E8M0_EMAX:
        amax = _finite_amax(xb, -1, keepdim=False)
        return agree(_e8m0_code(amax, _E8M0_EMAX[spec.name])), None
    # Two-level: a power-of-two fp32 tensor scale maps the largest block statistic onto
    # E4M3's range, then each block's statistic, over the tensor scale, becomes an E4M3 code.
    stat_kind, level = _TWO_LEVEL[spec.name]
    if stat_kind == "amax":
        stat = _finite_amax(xb, -1, keepdim=False)
    else:
        stat = _mean_abs(xb, _MEAN_ABS_STEP[spec.name])
    gmax = agree(_global_max(stat))
    # Capped at 2**119 so that no E4M3 code times the tensor scale overflows (448 * 2**119 <
    # 2**128); only statistics near fp32's maximum are affected, and their codes saturate.
    gscale = torch.where(torch.isinf(gmax), gmax, _pow2_scale(gmax, E4M3_MAX * level).clamp(max=2.0**119))
    unit = stat * _pow2_inverse(gscale)
    if level != 1.0:
        unit = unit * (1.0 / level)  # a multiply, spelled out: compiled code would use one anyway
    return agree(_e4m3_code(unit)), gscale


def _hash_uniform(shape: torch.Size, seed: torch.Tensor | int, device: torch.device) -> torch.Tensor:
    """Counter-based uniforms in [0, 1): reproducible, traceable, no generator state."""
    n = math.prod(shape)
    idx = torch.arange(n, dtype=torch.int64, device=device)
    h = (idx + seed * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF
    h = (((h >> 16) ^ h) * 0x45D9F3B) & 0xFFFFFFFF
    h = (((h >> 16) ^ h) * 0x45D9F3B) & 0xFFFFFFFF
    h = (h >> 16) ^ h
    return ((h & 0xFFFFFF).to(torch.float32) * (1.0 / 16777216.0)).reshape(shape)


def _stochastic_grid(v: torch.Tensor, mbits: int, emin: int, u: torch.Tensor) -> torch.Tensor:
    """Round |v| stochastically onto a float grid with `mbits` mantissa bits."""
    a = v.abs()
    e = torch.floor(torch.log2(a.clamp(min=2.0**emin))).clamp(min=float(emin))
    ulp = torch.exp2(e - mbits)
    return torch.copysign(torch.floor(a / ulp + u) * ulp, v)


def _nearest_magnitude(a: torch.Tensor, unit: torch.Tensor, steps: tuple[tuple[float, bool], ...]) -> torch.Tensor:
    """Index (int32) of the grid magnitude nearest to `a / unit`, ties to even, saturating.

    Compares `a` with `threshold * unit`, which is exact (few-bit threshold times a
    few-bit scale), so the result is the exact rounding of `a / unit` with no reciprocal:
    nothing overflows on tiny blocks and no device's division changes a code. NaN gives 0.
    """
    m = torch.zeros_like(a, dtype=torch.int32)
    for thr, inclusive in steps:
        t = unit * thr
        m = m + (a >= t if inclusive else a > t).to(torch.int32)
    return m


def _e2m1_magnitude(m: torch.Tensor) -> torch.Tensor:
    """|value| of 3-bit E2M1 magnitude codes, by exact arithmetic rather than a table.

    A lookup table would be a tensor constant, which the FX pass cannot splice into a
    graph it does not own; this spelling is all elementwise ops (Inductor fuses it).
    Codes 0-1 are subnormal (0, 0.5); code m >= 2 is (2 + (m & 1)) * 2^(m >> 1) / 4.
    """
    m = m.to(torch.int32)
    normal = ((2 + (m & 1)) << (m >> 1)).to(torch.float32) * 0.25
    return torch.where(m < 2, m.to(torch.float32) * 0.5, normal)


def _grid_codes(
    x2: torch.Tensor, unit: torch.Tensor, inv_unit: torch.Tensor, spec: FormatSpec, u: torch.Tensor | None
) -> torch.Tensor:
    """Per-element codes (int32) of the integer/E2M1 formats for `x2` `[rows, cp]`.

    `unit` is the block scale broadcast to `x2`'s shape (0 for blocks that underflowed,
    NaN for non-finite ones) and `inv_unit` its reciprocal (0 where `unit` is 0 or NaN).
    Code layouts: nvfp4 sign bit 3 + E2M1 magnitude; int4/mxint4 4-bit two's complement in
    [-7, 7]; int2 bit 0 = magnitude 3 (else 1), bit 1 = sign; ternary digit value + 1.
    """
    name = spec.name
    neg = x2 < 0
    if u is None:
        a = x2.abs()
        steps = {"nvfp4": _E2M1_STEPS, "int2": _INT2_STEPS, "ternary": _TERNARY_STEPS}.get(name, _INT4_STEPS)
        mag = _nearest_magnitude(a, unit, steps)
        if name == "int2":
            # No zero level: an exact 0 goes to -1 or +1 by column parity, so the zeros of a
            # sparse block add no net bias.
            odd = (torch.arange(x2.shape[-1], device=x2.device) & 1).bool()
            neg = neg | ((x2 == 0) & odd)
    else:
        v = x2 * inv_unit
        v = torch.where(torch.isnan(v), 0.0, v)
        a = v.abs()
        if name == "nvfp4":
            ulp = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
            q = (torch.floor(a / ulp + u) * ulp).clamp(max=E2M1_MAX)
            mag = _nearest_magnitude(q, torch.ones_like(q), _E2M1_STEPS)
        elif name == "int2":
            # Unbiased on the grid {-3, -1, 1, 3}: position (v + 3) / 2 in {0, 1, 2, 3}.
            p = torch.floor((v.clamp(-3.0, 3.0) + 3.0) * 0.5 + u).clamp(0, 3).to(torch.int32)
            neg, mag = p < 2, ((p == 0) | (p == 3)).to(torch.int32)
        else:
            top = 1.0 if name == "ternary" else float(INT4_MAX)
            mag = torch.floor(a + u).clamp(max=top).to(torch.int32)
    neg = neg.to(torch.int32)
    if name == "nvfp4":
        return mag + neg * 8
    if name == "int2":
        return mag + neg * 2
    if name == "ternary":
        return 1 + mag * (1 - 2 * neg)
    return (mag * (1 - 2 * neg)) & 0xF


def _pack(codes: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """int32 codes `[rows, cp]` -> uint8 payload `[rows, payload_cols]`, low bits first."""
    rows, cp = codes.shape
    if spec.name == "ternary":
        pad = (-cp) % _TRITS_PER_BYTE
        if pad:
            codes = torch.nn.functional.pad(codes, (0, pad), value=1)  # digit 1 is the value 0
        d = codes.reshape(rows, (cp + pad) // _TRITS_PER_BYTE, _TRITS_PER_BYTE)
        byte = d[..., 0]
        for i in range(1, _TRITS_PER_BYTE):
            byte = byte + d[..., i] * 3**i
        return byte.to(torch.uint8)
    bits = _CODE_BITS[spec.name]
    per = 8 // bits
    c = codes.reshape(rows, cp // per, per)
    byte = c[..., 0]
    for i in range(1, per):
        byte = byte | (c[..., i] << (bits * i))
    return byte.to(torch.uint8)


def _unpack(payload: torch.Tensor, spec: FormatSpec, cp: int) -> torch.Tensor:
    """uint8 payload `[..., rows, payload_cols]` -> int32 codes `[..., rows, cp]`."""
    lead = payload.shape[:-1]
    b = payload.to(torch.int32)
    if spec.name == "ternary":
        digits = [(b // 3**i) % 3 for i in range(_TRITS_PER_BYTE)]
    else:
        bits = _CODE_BITS[spec.name]
        mask = (1 << bits) - 1
        digits = [(b >> (bits * i)) & mask for i in range(8 // bits)]
    return torch.stack(digits, dim=-1).reshape(*lead, len(digits) * payload.shape[-1])[..., :cp]


def _grid_values(codes: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """fp32 grid values of int32 codes (in units of the block scale), by arithmetic."""
    if spec.name == "nvfp4":
        mag = _e2m1_magnitude(codes & 7)
        return torch.where(codes >= 8, -mag, mag)
    if spec.name == "int2":
        return ((1 + 2 * (codes & 1)) * (1 - 2 * (codes >> 1))).to(torch.float32)
    if spec.name == "ternary":
        return (codes - 1).to(torch.float32)
    return ((codes ^ 8) - 8).to(torch.float32)  # sign-extend a 4-bit two's complement code


def _expected_scales_shape(spec: FormatSpec, rows: int, cols: int) -> tuple[int, ...]:
    if spec.passthrough:
        return (0,)
    if spec.block is not None:
        return (rows, spec.padded_cols(cols) // spec.block)
    return (1,) if spec.scaling == "tensor" else (rows,)


def _check_broadcast(name: str, t: torch.Tensor, want: tuple[int, ...], spec: FormatSpec) -> None:
    """ValueError naming `name` unless `t` broadcasts to the shape `want` (static shapes only)."""
    try:
        ok = torch.broadcast_shapes(t.shape, want) == torch.Size(want)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"decode({spec.name}): {name} of shape {tuple(t.shape)} does not broadcast to {tuple(want)}")


def _check_tensor_scale(spec: FormatSpec, tensor_scale: torch.Tensor | None, where: str) -> None:
    if spec.name in _TWO_LEVEL and tensor_scale is None:
        raise ValueError(f"{where}: tensor_scale is required for format {spec.name!r} (from choose_scales)")


def encode(
    x: torch.Tensor,
    spec: FormatSpec,
    scales: torch.Tensor,
    tensor_scale: torch.Tensor | None = None,
    *,
    stochastic_rounding: bool = False,
    seed: torch.Tensor | int = 0,
) -> torch.Tensor:
    """Codes of `x` on the grid given by `scales` (from `choose_scales`): uint8 `[rows, payload_cols]`."""
    xr = as_rows(x).float()
    x2 = _pad_cols(xr, spec)
    rows, cols = x2.shape
    if spec.name == "fp32":
        return x2.contiguous().view(torch.uint8)
    if spec.name == "bf16":
        # Saturate finite values that would round past bf16's largest value; +-inf stays.
        sat = torch.where(torch.isinf(x2), x2, x2.clamp(-BF16_MAX, BF16_MAX))
        return sat.to(torch.bfloat16).contiguous().view(torch.uint8)
    expected = _expected_scales_shape(spec, rows, xr.shape[-1])
    if tuple(scales.shape) != expected:
        raise ValueError(f"encode({spec.name}): scales has shape {tuple(scales.shape)}, expected {expected}")
    _check_tensor_scale(spec, tensor_scale, f"encode({spec.name})")
    u = _hash_uniform(x2.shape, seed, x2.device) if stochastic_rounding else None
    if spec.name in _FP8 or spec.name == "mxfp8":
        if spec.name == "mxfp8":
            dtype, fmax, mbits, emin = _FP8["fp8_e4m3"]
            v = _blocks(x2, MX_BLOCK) * _pow2_inverse(_e8m0_decode(scales)).unsqueeze(-1)
        else:
            dtype, fmax, mbits, emin = _FP8[spec.name]
            inv = _pow2_inverse(scales)
            if spec.scaling == "block":
                v = _blocks(x2, spec.block_size) * inv.unsqueeze(-1)
            elif spec.scaling == "row":
                v = x2 * inv.unsqueeze(-1)
            else:
                v = x2 * inv
        v = v.reshape(rows, cols)
        if u is not None:
            v = _stochastic_grid(v, mbits, emin, u)
        return v.clamp(-fmax, fmax).to(dtype).view(torch.uint8)
    if spec.name == "mxint4":
        unit = _e8m0_decode(scales)
        inv_unit = torch.where(torch.isnan(unit), 0.0, _pow2_inverse(unit))
    else:
        # unit = E4M3 block scale * tensor scale; its reciprocal is taken factor by factor
        # (the tensor scale's exactly), so it stays finite however small the block is.
        bscale = _e4m3_decode(scales)
        unit = bscale * tensor_scale
        unit = torch.where(torch.isfinite(unit), unit, math.nan)
        inv_b = torch.where(bscale > 0, 1.0 / bscale, 0.0)  # NaN code: NaN > 0 is False
        inv_unit = inv_b * _pow2_inverse(tensor_scale)
        inv_unit = torch.where(torch.isnan(unit), 0.0, inv_unit)
    b = spec.block
    unit = unit.unsqueeze(-1).expand(rows, cols // b, b).reshape(rows, cols)
    inv_unit = inv_unit.unsqueeze(-1).expand(rows, cols // b, b).reshape(rows, cols)
    return _pack(_grid_codes(x2, unit, inv_unit, spec, u), spec)


def decode(
    payload: torch.Tensor,
    spec: FormatSpec,
    scales: torch.Tensor,
    tensor_scale: torch.Tensor | None,
    cols: int,
) -> torch.Tensor:
    """fp32 values of `payload` (`[..., rows, payload_cols]`), cropped to `cols` columns.

    Leading dims of `payload` (e.g. one slice per sending rank) broadcast against `scales`
    (`[..., rows]` per row, `[..., rows, nblocks]` per block, per-tensor scales and
    `tensor_scale` `[1]` or `[..., 1, 1]`). Finite codes never decode as +-inf: products
    past fp32's range saturate at its largest value.
    """
    cols = _count("cols", cols)
    if payload.dtype != torch.uint8 or payload.dim() < 2:
        raise ValueError(f"decode({spec.name}): payload must be uint8 [..., rows, payload_cols], "
                         f"got {payload.dtype} {tuple(payload.shape)}")
    if payload.shape[-1] != spec.payload_cols(cols):
        raise ValueError(f"decode({spec.name}): payload has {payload.shape[-1]} bytes per row, but cols={cols} "
                         f"needs {spec.payload_cols(cols)}")
    lead = payload.shape[:-1]
    if spec.name == "fp32":
        return payload.contiguous().view(torch.float32)[..., :cols]
    if spec.name == "bf16":
        return payload.contiguous().view(torch.bfloat16).to(torch.float32)[..., :cols]
    _check_tensor_scale(spec, tensor_scale, f"decode({spec.name})")
    cp, b = spec.padded_cols(cols), spec.block
    per_tensor = (*lead[:-1], 1, 1)
    if b is not None:
        want = (*lead, cp // b)
    else:
        want = per_tensor if spec.scaling == "tensor" else lead
    _check_broadcast("scales", scales, want, spec)
    if tensor_scale is not None:
        _check_broadcast("tensor_scale", tensor_scale, per_tensor, spec)
    if spec.name in _FP8 or spec.name == "mxfp8":
        dtype = torch.float8_e4m3fn if spec.name == "mxfp8" else _FP8[spec.name][0]
        vals = payload.contiguous().view(dtype).to(torch.float32)
        if spec.name == "mxfp8":
            s = _e8m0_decode(scales)
        else:
            s = torch.where(torch.isinf(scales), math.nan, scales)
    else:
        vals = _grid_values(_unpack(payload, spec, cp), spec)
        if spec.name == "mxint4":
            s = _e8m0_decode(scales)
        else:
            s = _e4m3_decode(scales) * tensor_scale
            s = torch.where(torch.isfinite(s), s, math.nan)
    if b is not None:
        out = (_blocks(vals, b) * s.unsqueeze(-1)).reshape(vals.shape)
    elif spec.scaling == "row":
        out = vals * s.unsqueeze(-1)
    else:
        out = vals * s
    return out[..., :cols].clamp(-FP32_MAX, FP32_MAX)


def _check_finite(x: torch.Tensor, what: str) -> None:
    if torch.compiler.is_compiling():
        return
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        n = int(bad.sum())
        raise ValueError(
            f"{what}: input has {n} non-finite value(s) (NaN/Inf) of {x.numel()}; refusing to "
            "quantize. Fix the gradient, or pass nonfinite='propagate' to get NaN rows instead."
        )


def quantize(
    x: torch.Tensor,
    format: str,
    *,
    scaling: str = "row",
    block_size: int = 32,
    stochastic_rounding: bool = False,
    seed: torch.Tensor | int = 0,
    nonfinite: str = "error",
    agree: Agree = _identity,
) -> QuantizedTensor:
    """Quantize `x` (fp32/bf16/fp16, any shape, empty included) to `format`.

    Columns that do not fill the last block are zero-padded (never truncated); `dequantize`
    crops them again. `nonfinite="error"` raises on NaN/Inf in eager mode; otherwise (and
    always under compilation) the rows/blocks sharing a scale with a non-finite value
    decode as NaN.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"quantize: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"quantize: unsupported dtype {x.dtype}; expected float32, bfloat16 or float16")
    if nonfinite not in ("error", "propagate"):
        raise ValueError(f"nonfinite={nonfinite!r}; allowed: error, propagate")
    spec = FormatSpec(format, scaling, block_size)
    if nonfinite == "error":
        _check_finite(x, f"quantize({format})")
    scales, tscale = choose_scales(x, spec, agree)
    payload = encode(x, spec, scales, tscale, stochastic_rounding=stochastic_rounding, seed=seed)
    return QuantizedTensor(payload, scales, tscale, x.shape, x.dtype, spec)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """fp32 tensor of the original shape."""
    cols = as_rows(torch.empty(q.shape, device="meta")).shape[-1]
    return decode(q.payload, q.spec, q.scales, q.tensor_scale, cols).reshape(q.shape)


def wire_bytes(q: QuantizedTensor) -> int:
    """Bytes that sending `q` costs: payload plus every scale, exactly."""
    n = q.payload.numel() * q.payload.element_size() + q.scales.numel() * q.scales.element_size()
    if q.tensor_scale is not None:
        n += q.tensor_scale.numel() * q.tensor_scale.element_size()
    return n


def wire_bytes_for(spec: FormatSpec, rows: int, cols: int) -> int:
    """`wire_bytes` of a `[rows, cols]` tensor without quantizing it."""
    rows = _count("rows", rows)
    payload = rows * spec.payload_cols(cols)
    if spec.passthrough:
        return payload
    if spec.name in _FP8:
        nscale = {"tensor": 1, "row": rows}.get(spec.scaling, rows * spec.padded_cols(cols) // spec.block_size)
        return payload + 4 * nscale
    nblocks = rows * spec.padded_cols(cols) // spec.block
    return payload + nblocks + (4 if spec.name in _TWO_LEVEL else 0)
