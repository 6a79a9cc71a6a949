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
  nvfp4 (4.5, E2M1 elements, block 16), int6 (integers in [-31, 31], the block maximum on 29;
  6.5 / 6.25 for block 16 / 32), int4 (integers in [-7, 7]; 4.5 / 4.25), int3 (integers in
  [-3, 3]; 3.5 / 3.25; 3- and 6-bit codes packed in 24-bit groups), int2 (levels {-3, -1, 1, 3} x step; 2.5 / 2.25), ternary (levels {-1, 0, 1}
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

The codec is split by concern: `gift_compile.codec.formats` (the format table: one class per
family, each owning its scales, codes, bytes and residual storage), `gift_compile.codec.spec`
(`FormatSpec`, which resolves a name to its family once; the name lists; byte sizes),
`gift_compile.codec.scales` (scale statistics and codes), `gift_compile.codec.codes` (element
grids, codes, packing) and `gift_compile.codec.layout` (the row view, `Scaling`). This package
module does the checks and broadcasting every format shares and calls the family's methods
(`choose_scales`, `encode`, `decode`, `quantize`, `dequantize`, `wire_bytes`); it is the public entry point:
every public name of the codec is importable from here. `gift_compile.codec.residual` stores
error-feedback residuals in a format. The codec is the lowest layer (docs/architecture.md): it
imports nothing else of GIFT.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gift_compile.codec.codes import _hash_uniform
from gift_compile.codec.formats import BF16_MAX
from gift_compile.codec.layout import Nonfinite, Scaling, _blocks
from gift_compile.codec.scales import E4M3_MAX, Agree, _identity
from gift_compile.codec.spec import (
    E2M1_MAX, FP32_MAX, INT4_MAX, MX_BLOCK, NVFP4_BLOCK, FormatSpec, _count, _pad_cols, as_rows, wire_bytes_for,
)

__all__ = [
    "BF16_MAX", "E2M1_MAX", "E4M3_MAX", "FP32_MAX", "INT4_MAX", "MX_BLOCK", "NVFP4_BLOCK", "Agree", "FormatSpec",
    "Nonfinite", "QuantizedTensor", "Scaling", "as_rows", "choose_scales", "decode", "dequantize", "encode", "quantize",
    "scales_nonfinite", "wire_bytes", "wire_bytes_for",
]


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

def _expected_scales_shape(spec: FormatSpec, rows: int, cols: int) -> tuple[int, ...]:
    if spec.passthrough:
        return (0,)
    if spec.block is not None:
        return (rows, spec.padded_cols(cols) // spec.block)
    return (1,) if spec.single_scale else (rows,)


def _check_broadcast(name: str, t: torch.Tensor, want: tuple[int, ...], spec: FormatSpec) -> None:
    """ValueError naming `name` unless `t` broadcasts to the shape `want` (static shapes only)."""
    try:
        ok = torch.broadcast_shapes(t.shape, want) == torch.Size(want)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"decode({spec.name}): {name} of shape {tuple(t.shape)} does not broadcast to {tuple(want)}")


def _check_tensor_scale(spec: FormatSpec, tensor_scale: torch.Tensor | None, where: str) -> None:
    if spec.has_tensor_scale and tensor_scale is None:
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
    if stochastic_rounding and not spec.family.rounds:
        raise ValueError(f"encode({spec.name}): stochastic rounding asked for a format that does not round")
    if spec.passthrough:
        u = _hash_uniform(x2.shape, seed, x2.device) if stochastic_rounding else None
        return spec.family.encode(x2, spec, scales, None, u)
    expected = _expected_scales_shape(spec, x2.shape[0], xr.shape[-1])
    if tuple(scales.shape) != expected:
        raise ValueError(f"encode({spec.name}): scales has shape {tuple(scales.shape)}, expected {expected}")
    _check_tensor_scale(spec, tensor_scale, f"encode({spec.name})")
    u = _hash_uniform(x2.shape, seed, x2.device) if stochastic_rounding else None
    return spec.family.encode(x2, spec, scales, tensor_scale, u)


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
    cp, b = spec.padded_cols(cols), spec.block
    if spec.passthrough:
        return spec.family.values(payload, cp)[..., :cols]
    _check_tensor_scale(spec, tensor_scale, f"decode({spec.name})")
    per_tensor = (*lead[:-1], 1, 1)
    if b is not None:
        want = (*lead, cp // b)
    else:
        want = per_tensor if spec.single_scale else lead
    _check_broadcast("scales", scales, want, spec)
    if tensor_scale is not None:
        _check_broadcast("tensor_scale", tensor_scale, per_tensor, spec)
    vals = spec.family.values(payload, cp)
    s = spec.family.decode_scales(scales, tensor_scale)
    if b is not None:
        out = (_blocks(vals, b) * s.unsqueeze(-1)).reshape(vals.shape)
    elif spec.single_scale:
        out = vals * s
    else:
        out = vals * s.unsqueeze(-1)
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


def choose_scales(
    x: torch.Tensor, spec: FormatSpec, agree: Agree = _identity
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales for `x` (any shape; its 2-D row view is used), agreed through `agree`.

    `agree` receives each scale statistic and must return its element-wise maximum over the
    participants (identity for a single tensor). Returns `(scales, tensor_scale)`: scales
    `[1]` (tensor), `[rows]` (row) or `[rows, nblocks]`; see `QuantizedTensor` for dtypes.
    """
    xr = as_rows(x).float()
    return spec.family.choose_scales(_pad_cols(xr, spec), spec, agree, xr.shape[-1])


def scales_nonfinite(spec: FormatSpec, scales: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
    """Whether the tensor `choose_scales` chose `(scales, tensor_scale)` for held a NaN or Inf
    (a 0-d bool), read off the scales instead of another pass over the tensor.

    Every statistic maps a non-finite group to +inf and a finite one to a finite value
    (`scales._finite_amax`, `scales._mean_abs`), and each scale keeps that marker: fp8 scales
    are +inf, E8M0 codes are the NaN code, and a two-level format's tensor scale is +inf (its
    maximum over the blocks). So the flag is exactly `~isfinite(x).all()`, without the
    full-size read that an `all` reduction of another shape than the scales' costs in
    generated code.
    """
    if spec.passthrough:
        raise ValueError(f"scales_nonfinite: format {spec.name!r} has no scales to read the flag from")
    return spec.family.nonfinite(scales, tensor_scale)


def quantize(
    x: torch.Tensor,
    format: str,
    *,
    scaling: str = "row",
    block_size: int = 32,
    stochastic_rounding: bool = False,
    seed: torch.Tensor | int = 0,
    nonfinite: Nonfinite | str = Nonfinite.ERROR,
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
    policy = Nonfinite.parse(nonfinite, "nonfinite")
    spec = FormatSpec(format, scaling, block_size)
    if policy is Nonfinite.ERROR:
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
