"""What a low-bit format is, before any tensor: `FormatSpec`, the format names, byte sizes.

`FormatSpec` is a format name with its scaling granularity and block length; it resolves the
name to its family in the format table (`gift_compile.codec.formats.FORMAT_TABLE`) once, at
construction, and everything above asks the spec (`spec.family`, `spec.block`,
`spec.payload_cols`, ...) rather than comparing names. The name lists `GiftConfig` validates
against from above (`gift_compile.config`) are read off the table here. Also here:
`wire_bytes_for`, the shape-only byte count behind `FormatSpec.bits_per_element`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gift_compile.codec.codes import E2M1_MAX
from gift_compile.codec.formats import FORMAT_TABLE, MX_BLOCK, NVFP4_BLOCK, Format
from gift_compile.codec.layout import FP32_MAX, Choice, Nonfinite, Scaling, _count, as_rows

__all__ = ["BLOCK_SIZE_CHOICES", "BLOCK_SIZE_FORMATS", "E2M1_MAX", "FORMATS", "FP32_MAX", "INT4_MAX", "MX_BLOCK",
           "NVFP4_BLOCK", "SCALINGS", "Choice", "FormatSpec", "Nonfinite", "Scaling", "as_rows", "wire_bytes_for"]

FORMATS = tuple(FORMAT_TABLE)
# Formats whose block length is `block_size`; their block statistics are reduced by a
# pairwise tree and packed whole into bytes, hence a short list of power-of-two lengths.
BLOCK_SIZE_FORMATS = tuple(name for name, fam in FORMAT_TABLE.items() if fam.block_sized)
BLOCK_SIZE_CHOICES = (16, 32)
SCALINGS = tuple(s.value for s in Scaling)
INT4_MAX = 7


@dataclass(frozen=True)
class FormatSpec:
    """A format with its scaling granularity; hashable, so it can be a graph constant.

    `scaling` accepts its spelling ("row") and is stored as the `Scaling` member (which still
    equals and prints as the spelling); `family` is the format's entry in the format table,
    looked up once here so that the traced codec calls its methods without a name in sight
    (and is left out of equality and hashing: the name decides it).
    """

    name: str
    scaling: Scaling = Scaling.ROW
    block_size: int = 32
    family: Format = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        family = FORMAT_TABLE.get(self.name) if isinstance(self.name, str) else None
        if family is None:
            raise ValueError(f"unknown format {self.name!r}; allowed: {', '.join(FORMATS)}")
        object.__setattr__(self, "scaling", Scaling.parse(self.scaling))
        object.__setattr__(self, "family", family)
        b = self.block_size
        if not isinstance(b, int) or isinstance(b, bool) or b < 2 or b % 2:
            raise ValueError(f"block_size={b!r} must be an even integer >= 2")
        if family.block_sized and b not in BLOCK_SIZE_CHOICES:
            raise ValueError(
                f"block_size={b} is invalid for format {self.name!r}; allowed: "
                f"{', '.join(map(str, BLOCK_SIZE_CHOICES))}"
            )

    @property
    def block(self) -> int | None:
        """Block length along the last dim, or None for tensor/row scaling."""
        return self.family.block(self)

    @property
    def passthrough(self) -> bool:
        return self.family.passthrough

    @property
    def float8_codes(self) -> bool:
        """Whether the payload is float8 values seen as bytes (fp8 formats and mxfp8)."""
        return self.family.float8_codes

    @property
    def has_tensor_scale(self) -> bool:
        """Whether `choose_scales` also returns an fp32 tensor scale (two-level formats)."""
        return self.family.has_tensor_scale

    @property
    def single_scale(self) -> bool:
        """Whether one scale covers the whole tensor (fp8 per tensor): scales `[1]`, not per row."""
        return self.block is None and self.scaling is Scaling.TENSOR

    def padded_cols(self, cols: int) -> int:
        """`cols` rounded up to a whole number of blocks (the columns that get codes)."""
        cols = _count("cols", cols)
        b = self.block
        return cols if b is None else -(-cols // b) * b

    def payload_cols(self, cols: int) -> int:
        """Bytes of payload per row."""
        return self.family.payload_cols(self.padded_cols(cols))

    def bits_per_element(self, cols: int, rows: int = 1) -> float:
        """Exact wire bits per element for a [rows, cols] tensor (payload plus scales)."""
        if _count("cols", cols) * _count("rows", rows) == 0:
            raise ValueError(f"bits_per_element: a [{rows}, {cols}] tensor has no elements")
        return 8.0 * wire_bytes_for(self, rows, cols) / (rows * cols)


def _pad_cols(x2: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    cp = spec.padded_cols(x2.shape[-1])
    if cp == x2.shape[-1]:
        return x2
    return torch.nn.functional.pad(x2, (0, cp - x2.shape[-1]))


def wire_bytes_for(spec: FormatSpec, rows: int, cols: int) -> int:
    """`wire_bytes` of a `[rows, cols]` tensor without quantizing it."""
    rows = _count("rows", rows)
    return rows * spec.payload_cols(cols) + spec.family.scale_bytes(spec, rows, spec.padded_cols(cols))
