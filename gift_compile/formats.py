"""Low-bit gradient formats: quantize to a uint8 payload plus scales, and back.

Every format is expressed on a 2-D view `[rows, cols]` of the tensor (the last dimension is
`cols`), because the gradients GIFT sends are weight matrices sharded by rows: scales per row
or per block of a row stay with the rows they describe when a collective splits dim 0.

Scales are chosen in two steps, `choose_scales` then `encode`, so that a collective can agree
on them across ranks (all-reduce MAX) *before* encoding: every rank then writes codes on the
same grid and a receiver decodes any rank's codes with the same scales. Scale statistics are
kept in a form whose element-wise maximum is the right agreed value: fp32 amax for the fp8
formats, and for mxfp8/nvfp4 the scale *codes* themselves (E8M0 and positive E4M3 codes are
monotone as unsigned bytes), which keeps the agreement traffic at one byte per block.

A non-finite input never becomes a finite number: its scale statistic becomes +inf (or the
format's NaN scale code, which is also the largest byte), and decoding turns every element
that shares that scale into NaN, identically on every rank.

Wire layout (bytes per element): fp32 4, bf16 2, fp8 1 (+ 4 bytes per scale), mxfp8 1 +
1/32, nvfp4 1/2 + 1/16 (+ one fp32 tensor scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from gift_compile.config import FORMATS, SCALINGS

Agree = Callable[[torch.Tensor], torch.Tensor]

_FP8 = {
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0, 3, -6),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0, 2, -14),
}
MX_BLOCK = 32
NVFP4_BLOCK = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# Decision thresholds between neighbouring E2M1 magnitudes {0,.5,1,1.5,2,3,4,6}; `>` vs `>=`
# implements round-half-to-even on the 3-bit code.
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_E8M0_NAN = 255
_E4M3_NAN = 127


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
        if self.block_size < 2 or self.block_size % 2:
            raise ValueError(f"block_size={self.block_size} must be an even integer >= 2")

    @property
    def block(self) -> int | None:
        """Block length along the last dim, or None for tensor/row scaling."""
        if self.name == "mxfp8":
            return MX_BLOCK
        if self.name == "nvfp4":
            return NVFP4_BLOCK
        if self.name in _FP8 and self.scaling == "block":
            return self.block_size
        return None

    @property
    def passthrough(self) -> bool:
        return self.name in ("fp32", "bf16")

    def padded_cols(self, cols: int) -> int:
        b = self.block
        return cols if b is None else -(-cols // b) * b

    def payload_cols(self, cols: int) -> int:
        """Bytes of payload per row."""
        cp = self.padded_cols(cols)
        return {"fp32": 4 * cp, "bf16": 2 * cp, "nvfp4": cp // 2}.get(self.name, cp)

    def bits_per_element(self, cols: int, rows: int = 1) -> float:
        """Exact wire bits per element for a [rows, cols] tensor (payload plus scales)."""
        return 8.0 * wire_bytes_for(self, rows, cols) / (rows * cols)


@dataclass
class QuantizedTensor:
    """Low-bit codes of a tensor: what goes on the wire, and how to read it back.

    `payload` is uint8 `[rows, payload_cols]`; `scales` holds the per-tensor/row/block scale
    (fp32 for fp8, uint8 E8M0 codes for mxfp8, uint8 E4M3 codes for nvfp4, empty for the
    pass-through formats); `tensor_scale` is nvfp4's fp32 second-level scale.
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
    """The 2-D view every format works on: `[prod(leading dims), last dim]`."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    if x.dim() == 1:
        return x.reshape(1, -1)
    return x.reshape(-1, x.shape[-1])


def _pad_cols(x2: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    cp = spec.padded_cols(x2.shape[-1])
    if cp == x2.shape[-1]:
        return x2
    return torch.nn.functional.pad(x2, (0, cp - x2.shape[-1]))


def _blocks(x2: torch.Tensor, block: int) -> torch.Tensor:
    """`[..., rows, cols]` (cols a multiple of block) as `[..., rows, nblocks, block]`."""
    return x2.reshape(*x2.shape[:-1], x2.shape[-1] // block, block)


def _finite_amax(t: torch.Tensor, dims: tuple[int, ...] | int, keepdim: bool = True) -> torch.Tensor:
    """amax of |t| with NaN/Inf mapped to +inf, so an all-reduce MAX keeps the marker."""
    a = t.abs().amax(dim=dims, keepdim=keepdim)
    return torch.where(torch.isfinite(a), a, torch.full_like(a, math.inf))


def _pow2_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """Smallest power of two `s` with `amax / s <= fmax`, by exponent arithmetic.

    Power-of-two scales make scaling exact: eager and compiled code (which may rewrite a
    division as a reciprocal multiply) produce the same codes even on the exact rounding
    ties that sums of decoded codes create, and no transcendental function is involved.
    Zero maps to 1.
    """
    mant, exp2 = math.frexp(fmax)  # fmax = mant * 2**exp2, mant in [0.5, 1)
    max_exp, max_mant_bits = exp2 - 1, int((2 * mant - 1) * (1 << 23))
    bits = amax.contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 127
    k = exp - max_exp + ((bits & 0x7FFFFF) > max_mant_bits).to(torch.int32)
    k = torch.where(amax > 0, k, torch.zeros_like(k)).clamp(-126, 127)
    return ((k + 127) << 23).view(torch.float32)


def _e4m3_code(v: torch.Tensor) -> torch.Tensor:
    """Positive fp32 -> E4M3 byte (round to nearest even, saturating); +inf -> NaN code."""
    code = v.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isinf(v), torch.full_like(code, _E4M3_NAN), code)


def _e4m3_decode(code: torch.Tensor) -> torch.Tensor:
    return code.view(torch.float8_e4m3fn).to(torch.float32)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def choose_scales(
    x: torch.Tensor, spec: FormatSpec, agree: Agree = _identity
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales for `x` (any shape; its 2-D row view is used), agreed through `agree`.

    `agree` receives each scale statistic and must return its element-wise maximum over the
    participants (identity for a single tensor). Returns `(scales, tensor_scale)`; see
    `QuantizedTensor` for their dtypes.
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
    if spec.name == "mxfp8":
        amax = _finite_amax(_blocks(x2, MX_BLOCK), -1, keepdim=False)
        # OCP MX: shared exponent floor(log2(amax)) - emax(E4M3 = 8), biased by 127.
        exp = torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - 8.0 + 127.0
        code = exp.clamp(0, 254).to(torch.uint8)
        code = torch.where(torch.isinf(amax), torch.full_like(code, _E8M0_NAN), code)
        return agree(code), None
    # nvfp4: an fp32 tensor scale maps the largest block scale onto E4M3's range, then each
    # 16-element block gets an E4M3 scale so that its amax maps onto E2M1's maximum 6.
    bamax = _finite_amax(_blocks(x2, NVFP4_BLOCK), -1, keepdim=False)
    gamax = agree(bamax.amax().reshape(1))
    gscale = torch.where(torch.isinf(gamax), gamax, _pow2_scale(gamax, E4M3_MAX * E2M1_MAX))
    code = _e4m3_code(bamax / (E2M1_MAX * gscale))
    return agree(code), gscale


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


def _e2m1_code(v: torch.Tensor) -> torch.Tensor:
    """fp32 (already scaled to |v| <= 6) -> 4-bit E2M1 code in a uint8 (sign in bit 3)."""
    a = v.abs()
    mag = torch.zeros_like(a, dtype=torch.uint8)
    for thr, inclusive in _E2M1_STEPS:
        mag = mag + (a >= thr if inclusive else a > thr).to(torch.uint8)
    return mag + (v < 0).to(torch.uint8) * 8


def _e2m1_magnitude(m: torch.Tensor) -> torch.Tensor:
    """|value| of 3-bit E2M1 magnitude codes, by exact arithmetic rather than a table.

    A lookup table would be a tensor constant, which the FX pass cannot splice into a
    graph it does not own; this spelling is all elementwise ops (Inductor fuses it).
    Codes 0-1 are subnormal (0, 0.5); code m >= 2 is (2 + (m & 1)) * 2^(m >> 1) / 4.
    """
    m = m.to(torch.int32)
    normal = ((2 + (m & 1)) << (m >> 1)).to(torch.float32) * 0.25
    return torch.where(m < 2, m.to(torch.float32) * 0.5, normal)


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
    x2 = _pad_cols(as_rows(x).float(), spec)
    if spec.name == "fp32":
        return x2.contiguous().view(torch.uint8)
    if spec.name == "bf16":
        return x2.to(torch.bfloat16).contiguous().view(torch.uint8)
    rows, cols = x2.shape
    u = _hash_uniform(x2.shape, seed, x2.device) if stochastic_rounding else None
    if spec.name in _FP8 or spec.name == "mxfp8":
        if spec.name == "mxfp8":
            dtype, fmax, mbits, emin = _FP8["fp8_e4m3"]
            s = torch.exp2(scales.to(torch.float32) - 127.0).unsqueeze(-1)
            v = _blocks(x2, MX_BLOCK) / s
        else:
            dtype, fmax, mbits, emin = _FP8[spec.name]
            # Multiply by an explicit reciprocal: Inductor may rewrite `x / s` as `x * (1/s)`,
            # which moves exact rounding ties (frequent after summing decoded codes) to one
            # side; spelling it this way keeps compiled codes bit-identical to eager ones.
            inv = 1.0 / scales
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
    # nvfp4
    bscale = _e4m3_decode(scales) * tensor_scale
    v = _blocks(x2, NVFP4_BLOCK) * (1.0 / bscale).unsqueeze(-1)
    v = torch.where(bscale.unsqueeze(-1) > 0, v, torch.zeros_like(v)).reshape(rows, cols)
    if u is not None:
        a = v.abs()
        ulp = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
        v = torch.copysign(torch.floor(a / ulp + u) * ulp, v)
    nib = _e2m1_code(v.clamp(-E2M1_MAX, E2M1_MAX)).reshape(rows, cols // 2, 2)
    return nib[..., 0] | (nib[..., 1] << 4)


def decode(
    payload: torch.Tensor,
    spec: FormatSpec,
    scales: torch.Tensor,
    tensor_scale: torch.Tensor | None,
    cols: int,
) -> torch.Tensor:
    """fp32 values of `payload` (`[..., rows, payload_cols]`), cropped to `cols` columns.

    Leading dims of `payload` (e.g. one slice per sending rank) broadcast against `scales`.
    """
    lead = payload.shape[:-1]
    if spec.name == "fp32":
        return payload.contiguous().view(torch.float32)[..., :cols]
    if spec.name == "bf16":
        return payload.contiguous().view(torch.bfloat16).to(torch.float32)[..., :cols]
    if spec.name == "nvfp4":
        lo = payload & 0xF
        hi = payload >> 4
        nib = torch.stack([lo, hi], dim=-1).reshape(*lead, -1)
        mag = _e2m1_magnitude(nib & 7)
        vals = torch.where(nib >= 8, -mag, mag)
        bscale = _e4m3_decode(scales) * tensor_scale
        bscale = torch.where(scales == _E4M3_NAN, math.nan, bscale)
        out = _blocks(vals, NVFP4_BLOCK) * bscale.unsqueeze(-1)
        return out.reshape(*lead, -1)[..., :cols]
    dtype = torch.float8_e4m3fn if spec.name == "mxfp8" else _FP8[spec.name][0]
    vals = payload.contiguous().view(dtype).to(torch.float32)
    if spec.name == "mxfp8":
        s = torch.exp2(scales.to(torch.float32) - 127.0)
        s = torch.where(scales == _E8M0_NAN, math.nan, s)
        out = (_blocks(vals, MX_BLOCK) * s.unsqueeze(-1)).reshape(vals.shape)
    else:
        s = torch.where(torch.isinf(scales), math.nan, scales)
        if spec.scaling == "block":
            out = (_blocks(vals, spec.block_size) * s.unsqueeze(-1)).reshape(vals.shape)
        elif spec.scaling == "row":
            out = vals * s.unsqueeze(-1)
        else:
            out = vals * s
    return out[..., :cols]


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
    """Quantize `x` (fp32/bf16/fp16, any shape) to `format`.

    Columns that do not fill the last block are zero-padded (never truncated); `dequantize`
    crops them again. `nonfinite="error"` raises on NaN/Inf in eager mode; otherwise (and
    always under compilation) the rows sharing a scale with a non-finite value decode as NaN.
    """
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
    payload = rows * spec.payload_cols(cols)
    if spec.passthrough:
        return payload
    if spec.name in _FP8:
        nscale = {"tensor": 1, "row": rows}.get(spec.scaling, rows * spec.padded_cols(cols) // spec.block_size)
        return payload + 4 * nscale
    nblocks = rows * spec.padded_cols(cols) // spec.block
    return payload + nblocks + (4 if spec.name == "nvfp4" else 0)
