"""Element grids of the low-bit formats: rounding onto a grid (to nearest, or stochastic with
counter-based uniforms), the per-element codes of the integer and E2M1 formats, and their
packing into bytes and back.

Split out of `gift_compile.codec` because the code layouts and the bit packing do not depend
on how scales are chosen (`gift_compile.codec.scales`); `encode` / `decode` in the package
(`gift_compile.codec`) put the two together.
"""

from __future__ import annotations

import math

import torch

from gift_compile.codec.spec import (
    E2M1_MAX, INT4_MAX, _CODE_BITS, _GROUP_BITS, _INT_MAX, _TRITS_PER_BYTE, FormatSpec,
)

# Round-to-nearest-even decision thresholds between neighbouring grid magnitudes, as
# (threshold in units of the scale, whether a value equal to it rounds up).
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
# integer formats (mxint4 shares int4's grid): magnitudes 0..max, ties to the even one
_INT_LEVELS = {**_INT_MAX, "mxint4": INT4_MAX}
_INT_STEPS = {n: tuple((k + 0.5, k % 2 == 1) for k in range(m)) for n, m in _INT_LEVELS.items()}
_INT2_STEPS = ((2.0, False),)  # magnitudes {1, 3}; a tie goes to the smaller one
_TERNARY_STEPS = ((0.5, False),)


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
    Code layouts: nvfp4 sign bit 3 + E2M1 magnitude; int6/int4/mxint4/int3 two's complement
    of their width in [-max, max]; int2 bit 0 = magnitude 3 (else 1), bit 1 = sign; ternary
    digit value + 1.
    """
    name = spec.name
    neg = x2 < 0
    if u is None:
        a = x2.abs()
        steps = {"nvfp4": _E2M1_STEPS, "int2": _INT2_STEPS, "ternary": _TERNARY_STEPS}.get(name) or _INT_STEPS[name]
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
            top = 1.0 if name == "ternary" else float(_INT_LEVELS[name])
            mag = torch.floor(a + u).clamp(max=top).to(torch.int32)
    neg = neg.to(torch.int32)
    if name == "nvfp4":
        return mag + neg * 8
    if name == "int2":
        return mag + neg * 2
    if name == "ternary":
        return 1 + mag * (1 - 2 * neg)
    return (mag * (1 - 2 * neg)) & ((1 << _CODE_BITS[name]) - 1)


def _word_layout(spec: FormatSpec) -> tuple[int, int]:
    """`(codes per word, bytes per word)` of a packed format, the one layout `_pack` writes and
    `_unpack` reads: a byte of 1/2/4-bit codes or of five trits, or a 24-bit group of 3- or
    6-bit codes (widths that do not divide a byte)."""
    if spec.name == "ternary":
        return _TRITS_PER_BYTE, 1
    bits = _CODE_BITS[spec.name]
    return (8 // bits, 1) if 8 % bits == 0 else (_GROUP_BITS // bits, _GROUP_BITS // 8)


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
    per, nbytes = _word_layout(spec)
    c = codes.reshape(rows, cp // per, per)
    word = c[..., 0]
    for i in range(1, per):
        word = word | (c[..., i] << (bits * i))
    if nbytes == 1:
        return word.to(torch.uint8)
    # a multi-byte word -> its bytes, low byte first
    return torch.stack([(word >> (8 * i)) & 0xFF for i in range(nbytes)], dim=-1).reshape(
        rows, nbytes * (cp // per)).to(torch.uint8)


def _unpack(payload: torch.Tensor, spec: FormatSpec, cp: int) -> torch.Tensor:
    """uint8 payload `[..., rows, payload_cols]` -> int32 codes `[..., rows, cp]`.

    Code j of a row is digit `j % per` of byte `j // per`: each byte is broadcast to its
    `per` codes (an expand and a reshape, which Inductor indexes rather than copies) and the
    digit picked by its position, so the decode kernel reads the packed bytes directly; a
    stack of the digits would be written out full size first (4 bytes per code) and read back.
    """
    lead, pc = payload.shape[:-1], payload.shape[-1]
    per, nbytes = _word_layout(spec)
    words = payload.to(torch.int32)
    if nbytes > 1:
        # multi-byte words: each word's bytes (low byte first) become one int, unpacked like a byte
        g = words.reshape(*lead, pc // nbytes, nbytes)
        words, pc = g[..., 0], pc // nbytes
        for i in range(1, nbytes):
            words = words | (g[..., i] << (8 * i))
    b = words.unsqueeze(-1).expand(*lead, pc, per).reshape(*lead, pc * per)
    pos = torch.arange(pc * per, dtype=torch.int32, device=payload.device) % per
    if spec.name == "ternary":
        digits = (b // torch.pow(3, pos)) % 3
    else:
        bits = _CODE_BITS[spec.name]
        digits = (b >> (pos * bits)) & ((1 << bits) - 1)
    return digits[..., :cp]


def _grid_values(codes: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """fp32 grid values of int32 codes (in units of the block scale), by arithmetic."""
    if spec.name == "nvfp4":
        mag = _e2m1_magnitude(codes & 7)
        return torch.where(codes >= 8, -mag, mag)
    if spec.name == "int2":
        return ((1 + 2 * (codes & 1)) * (1 - 2 * (codes >> 1))).to(torch.float32)
    if spec.name == "ternary":
        return (codes - 1).to(torch.float32)
    half = 1 << (_CODE_BITS[spec.name] - 1)
    return ((codes ^ half) - half).to(torch.float32)  # sign-extend a two's complement code
