"""Element grids of the integer and E2M1 formats: one class per grid, each owning its rounding
(to nearest, or stochastic with counter-based uniforms), its per-element codes, their values,
and their packing into bytes and back.

Split out of the format families (`gift_compile.codec.formats`) because the code layouts and
the bit packing do not depend on how scales are chosen (`gift_compile.codec.scales`): a family
holds a `Grid` and hands it the block unit. mxint4 and int4 share one grid with different
scales, which is why the grids are their own small table rather than part of a family.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Steps = tuple[tuple[float, bool], ...]

# Code widths that do not divide a byte are packed in 24-bit groups (three bytes hold eight
# 3-bit or four 6-bit codes); a block (16 or 32 columns) is always a whole number of groups.
_GROUP_BITS = 24
_TRITS_PER_BYTE = 5  # 3**5 = 243 <= 256: 1.6 bits per trit
E2M1_MAX = 6.0


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


def _nearest_magnitude(a: torch.Tensor, unit: torch.Tensor, steps: Steps) -> torch.Tensor:
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


@dataclass(frozen=True)
class Grid:
    """A grid of signed levels in units of the block scale, with `bits`-bit codes packed low
    bits first into bytes (or 24-bit groups when `bits` does not divide 8).

    `steps` are the round-to-nearest-even thresholds between neighbouring magnitudes, as
    (threshold in units of the scale, whether a value equal to it rounds up); `imax` is the
    largest integer magnitude of an integer grid (0 for the others).
    """

    bits: int
    steps: Steps
    imax: int = 0

    def nearest_sign(self, x2: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        """The sign bit of a round-to-nearest code (a grid without a zero level decides zeros)."""
        return neg

    def stochastic(self, v: torch.Tensor, neg: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(negative, magnitude index)` of `v` (in units of the scale) rounded stochastically."""
        raise NotImplementedError

    def code(self, mag: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        """int32 codes from magnitude indices and int32 sign flags."""
        raise NotImplementedError

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        """fp32 grid values of int32 codes (in units of the block scale), by arithmetic."""
        raise NotImplementedError

    def word_layout(self) -> tuple[int, int]:
        """`(codes per word, bytes per word)`: the one layout `pack` writes and `unpack` reads, a
        byte of 1/2/4-bit codes or a 24-bit group of 3- or 6-bit codes."""
        return (8 // self.bits, 1) if 8 % self.bits == 0 else (_GROUP_BITS // self.bits, _GROUP_BITS // 8)

    def payload_cols(self, cp: int) -> int:
        """Bytes of `cp` packed codes."""
        return cp * self.bits // 8

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """int32 codes `[rows, cp]` -> uint8 payload `[rows, payload_cols]`, low bits first."""
        rows, cp = codes.shape
        per, nbytes = self.word_layout()
        c = codes.reshape(rows, cp // per, per)
        word = c[..., 0]
        for i in range(1, per):
            word = word | (c[..., i] << (self.bits * i))
        if nbytes == 1:
            return word.to(torch.uint8)
        # a multi-byte word -> its bytes, low byte first
        return torch.stack([(word >> (8 * i)) & 0xFF for i in range(nbytes)], dim=-1).reshape(
            rows, nbytes * (cp // per)).to(torch.uint8)

    def unpack(self, payload: torch.Tensor, cp: int) -> torch.Tensor:
        """uint8 payload `[..., rows, payload_cols]` -> int32 codes `[..., rows, cp]`.

        Code j of a row is digit `j % per` of byte `j // per`: each byte is broadcast to its
        `per` codes (an expand and a reshape, which Inductor indexes rather than copies) and the
        digit picked by its position, so the decode kernel reads the packed bytes directly; a
        stack of the digits would be written out full size first (4 bytes per code) and read back.
        """
        lead, pc = payload.shape[:-1], payload.shape[-1]
        per, nbytes = self.word_layout()
        words = payload.to(torch.int32)
        if nbytes > 1:
            # multi-byte words: each word's bytes (low byte first) become one int, unpacked like a byte
            g = words.reshape(*lead, pc // nbytes, nbytes)
            words, pc = g[..., 0], pc // nbytes
            for i in range(1, nbytes):
                words = words | (g[..., i] << (8 * i))
        b = words.unsqueeze(-1).expand(*lead, pc, per).reshape(*lead, pc * per)
        pos = torch.arange(pc * per, dtype=torch.int32, device=payload.device) % per
        return self._digits(b, pos)[..., :cp]

    def _digits(self, b: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Digit `pos` of each word `b`."""
        return (b >> (pos * self.bits)) & ((1 << self.bits) - 1)


@dataclass(frozen=True)
class E2M1(Grid):
    """nvfp4's elements: sign bit 3 + a 3-bit E2M1 magnitude (0, 0.5, 1, 1.5, 2, 3, 4, 6)."""

    bits: int = 4
    steps: Steps = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                    (5.0, False))

    def stochastic(self, v: torch.Tensor, neg: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = v.abs()
        ulp = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
        q = (torch.floor(a / ulp + u) * ulp).clamp(max=E2M1_MAX)
        return neg, _nearest_magnitude(q, torch.ones_like(q), self.steps)

    def code(self, mag: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        return mag + neg * 8

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        mag = _e2m1_magnitude(codes & 7)
        return torch.where(codes >= 8, -mag, mag)


def int_grid(bits: int, imax: int) -> IntGrid:
    """The integer grid [-imax, imax] in `bits`-bit two's complement (magnitudes 0..imax, ties
    to the even one; one code, -2**(bits-1), unused)."""
    return IntGrid(bits, tuple((k + 0.5, k % 2 == 1) for k in range(imax)), imax)


@dataclass(frozen=True)
class IntGrid(Grid):
    """Integers in [-imax, imax] as two's complement codes (int6, int4, mxint4, int3); build with
    `int_grid`."""

    def stochastic(self, v: torch.Tensor, neg: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return neg, torch.floor(v.abs() + u).clamp(max=float(self.imax)).to(torch.int32)

    def code(self, mag: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        return (mag * (1 - 2 * neg)) & ((1 << self.bits) - 1)

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        half = 1 << (self.bits - 1)
        return ((codes ^ half) - half).to(torch.float32)  # sign-extend a two's complement code


@dataclass(frozen=True)
class Int2(Grid):
    """Levels {-3, -1, 1, 3}: bit 0 = magnitude 3 (else 1), bit 1 = sign; no zero level."""

    bits: int = 2
    steps: Steps = ((2.0, False),)  # magnitudes {1, 3}; a tie goes to the smaller one

    def nearest_sign(self, x2: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        # No zero level: an exact 0 goes to -1 or +1 by column parity, so the zeros of a
        # sparse block add no net bias.
        odd = (torch.arange(x2.shape[-1], device=x2.device) & 1).bool()
        return neg | ((x2 == 0) & odd)

    def stochastic(self, v: torch.Tensor, neg: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Unbiased on the grid {-3, -1, 1, 3}: position (v + 3) / 2 in {0, 1, 2, 3}.
        p = torch.floor((v.clamp(-3.0, 3.0) + 3.0) * 0.5 + u).clamp(0, 3).to(torch.int32)
        return p < 2, ((p == 0) | (p == 3)).to(torch.int32)

    def code(self, mag: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        return mag + neg * 2

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        return ((1 + 2 * (codes & 1)) * (1 - 2 * (codes >> 1))).to(torch.float32)


@dataclass(frozen=True)
class Ternary(Grid):
    """Levels {-1, 0, 1} as base-3 digits (value + 1), five to a byte; `bits` 0 marks the
    base-3 packing (the kernels' convention)."""

    bits: int = 0
    steps: Steps = ((0.5, False),)

    def stochastic(self, v: torch.Tensor, neg: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return neg, torch.floor(v.abs() + u).clamp(max=1.0).to(torch.int32)

    def code(self, mag: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        return 1 + mag * (1 - 2 * neg)

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        return (codes - 1).to(torch.float32)

    def word_layout(self) -> tuple[int, int]:
        return _TRITS_PER_BYTE, 1

    def payload_cols(self, cp: int) -> int:
        return -(-cp // _TRITS_PER_BYTE)

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        rows, cp = codes.shape
        pad = (-cp) % _TRITS_PER_BYTE
        if pad:
            codes = torch.nn.functional.pad(codes, (0, pad), value=1)  # digit 1 is the value 0
        d = codes.reshape(rows, (cp + pad) // _TRITS_PER_BYTE, _TRITS_PER_BYTE)
        byte = d[..., 0]
        for i in range(1, _TRITS_PER_BYTE):
            byte = byte + d[..., i] * 3**i
        return byte.to(torch.uint8)

    def _digits(self, b: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return (b // torch.pow(3, pos)) % 3


def grid_codes(
    x2: torch.Tensor, unit: torch.Tensor, inv_unit: torch.Tensor, grid: Grid, u: torch.Tensor | None
) -> torch.Tensor:
    """Per-element codes (int32) of `x2` `[rows, cp]` on `grid`.

    `unit` is the block scale broadcast to `x2`'s shape (0 for blocks that underflowed,
    NaN for non-finite ones) and `inv_unit` its reciprocal (0 where `unit` is 0 or NaN);
    `u` the uniforms of stochastic rounding (None: round to nearest).
    """
    neg = x2 < 0
    if u is None:
        mag = _nearest_magnitude(x2.abs(), unit, grid.steps)
        neg = grid.nearest_sign(x2, neg)
    else:
        v = x2 * inv_unit
        v = torch.where(torch.isnan(v), 0.0, v)
        neg, mag = grid.stochastic(v, neg, u)
    return grid.code(mag, neg.to(torch.int32))
