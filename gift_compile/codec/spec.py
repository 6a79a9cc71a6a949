"""What a low-bit format is, before any tensor: `FormatSpec`, the format tables, byte sizes.

Split out of `gift_compile.codec` so that the scale machinery (`gift_compile.codec.scales`) and the
element codes (`gift_compile.codec.codes`) can read a format's description and tables without
importing the encoder built on them (no import cycle); the package re-exports the public names.
The format names (`FORMATS`, `SCALINGS`, the block-size formats and lengths) live here, the
lowest layer that knows formats; `GiftConfig` validates against them from above (`gift_compile.config`).
Also here: the 2-D row view every format works on (`as_rows`, padding to whole blocks) and
`wire_bytes_for`, the shape-only byte count behind `FormatSpec.bits_per_element`.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

FORMATS = ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "mxfp8", "nvfp4", "mxint4", "int6", "int4", "int3", "int2",
           "ternary")
# Formats whose block length is `block_size`; their block statistics are reduced by a
# pairwise tree and packed whole into bytes, hence a short list of power-of-two lengths.
BLOCK_SIZE_FORMATS = ("int6", "int4", "int3", "int2", "ternary")
BLOCK_SIZE_CHOICES = (16, 32)
SCALINGS = ("tensor", "row", "block")
FP32_MAX = torch.finfo(torch.float32).max
_FP8 = {
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0, 3, -6),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0, 2, -14),
}
MX_BLOCK = 32
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
INT4_MAX = 7
# The two-level integer formats: largest code magnitude (integers in [-max, max], stored as
# `bits`-bit two's complement; one code, -2**(bits-1), unused). int3 and int6 fill the
# frontier's holes between 2 and 4 bits and between 4 and 8.
_INT_MAX = {"int6": 31, "int4": INT4_MAX, "int3": 3}
# E8M0-scaled formats: scale = 2**(floor(log2(block amax)) - emax), emax the exponent of the
# element grid's largest binade (E4M3: 448 = 1.75 * 2**8; integers up to 7 = 1.75 * 2**2).
_E8M0_EMAX = {"mxfp8": 8, "mxint4": 2}
# Two-level formats: the per-block statistic, and the grid level it maps onto.
# int6 maps the block maximum onto 29, not 31: its E4M3 block scale rounds to nearest (up to
# 1/16 low), and 29 * 16/15 < 31 keeps the maximum inside the grid; at 31 it would saturate by
# up to two steps, more than the half step of rounding (int4/int3 lose at most a third of one).
_TWO_LEVEL = {"nvfp4": ("amax", E2M1_MAX), "int6": ("amax", 29.0), "int4": ("amax", float(INT4_MAX)),
              "int3": ("amax", 3.0), "int2": ("mean_abs", 1.0), "ternary": ("mean_abs", 1.0)}
_CODE_BITS = {"nvfp4": 4, "mxint4": 4, "int6": 6, "int4": 4, "int3": 3, "int2": 2}
# Code widths that do not divide a byte are packed in 24-bit groups (three bytes hold eight
# 3-bit or four 6-bit codes); a block (16 or 32 columns) is always a whole number of groups.
_GROUP_BITS = 24
_TRITS_PER_BYTE = 5  # 3**5 = 243 <= 256: 1.6 bits per trit


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
    def float8_codes(self) -> bool:
        """Whether the payload is float8 values seen as bytes (fp8 formats and mxfp8)."""
        return self.name in _FP8 or self.name == "mxfp8"

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
