"""The device code of the fp8 formats' codec kernels (fp8_e4m3, fp8_e5m2): scale choice, encode, decode.

`codec.formats.Float8` scales a group (the tensor, a row, or a block of a row) by the power of
two that maps its amax onto the element range, and writes each scaled value as a float8 byte
(`Float8Elements.encode`: saturated at the largest finite value, then ATen's float8 cast).
These kernels restate that operation by operation, as `gift_compile.kernels.triton_codec` does
for the two-level formats and for the same reasons (its docstring): the float8 bytes are built
from the fp32 bits (`_fp8_code`: round to nearest even on the mantissa, subnormals by an exact
integer rounding, saturation, the NaN code with the value's sign, as ATen's conversion writes
them) and read back from them (`_fp8_value`), never by a Triton float8 conversion, whose
rounding and NaN handling the interpreter, the CUDA lowering and ATen need not share; NaN and
Inf are told by integer tests on the bits and kept by explicit `where`s; negation is a
multiply by -1. `_fp8_code` is a per-element function of the scaled value, so a kernel that
produces the value itself (a fused map and encode) can call it as the encode kernels do.

With row or block scaling a group's scale is known once its own values are read, so one
kernel chooses the scales and writes the codes (`fp8_row_scale_encode_kernel`,
`fp8_block_scale_encode_kernel`): the gradient is read from memory once. A per-tensor scale
needs every row before the first code: the rows' statistics (`fp8_row_scale_kernel`), their
maximum, then `fp8_encode_kernel`, which also encodes under any given (agreed) scales.

GIFT's fused sender for the fp8 formats (`lowrank_fp8_row_scale_kernel`,
`lowrank_fp8_block_scale_kernel`, `lowrank_fp8_encode_kernel`) takes its values from the
low-rank map's expansion tile (`triton_codec._expand_tile`, the `[64, 128]` tile
`lowrank_expand_kernel` writes) instead of from memory: the same scale choice
(`_finite_amax`, `_pow2_scale`) and codes (`_fp8_code`) of the same values, the mapped gradient
never written. A row's scale needs all its column tiles, so the row-scale kernel walks them in
one program per 64 rows; a block's needs one tile (the block divides its 128 columns).

Layout: the gradient is the `[rows, cols]` fp32 row view (`codec.as_rows`), read in place (row
stride given, unit column stride); with block scaling the columns past `cols` up to the padded
width `cp` read as zeros (the reference's zero padding) and get codes; the payload is one byte
per padded column, `[rows, cp]`. The scales are fp32: one (`TENSOR`), one per row (`ROW`) or
`[rows, nblocks]` (`BLOCK`), +inf for a group holding NaN/Inf. The launch wrappers and the
registered ops are in `gift_compile.kernels.ops_fp8`; the format constants (the constexprs
below) in `gift_compile.kernels.formats.Fp8KernelFormat`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gift_compile.kernels.triton_codec import FP32_MAX, _expand_tile, _expand_values, _is_finite, _pow2_inverse

# The `SCALING` constexpr (`formats.FP8_SCALINGS`): one scale per tensor, per row, per block.
TENSOR = tl.constexpr(0)
ROW = tl.constexpr(1)
BLOCK_SCALING = tl.constexpr(2)


@triton.jit
def _fp8_code(v, MBITS: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr):
    """Float8 byte (int32 in [0, 255]) of fp32 values `v`: `Float8Elements.encode` (clamp to
    +-FMAX, then ATen's cast). The magnitude is saturated at FMAX (+-inf included); normal
    results (from 2**EMIN) round the fp32 bits to MBITS mantissa bits, ties to even, the carry
    of a round-up moving into the exponent; subnormal ones round v * 2**(MBITS - EMIN), exact,
    to an integer, ties to even (code 2**MBITS is then the smallest normal, as it should be).
    NaN gives 0x7F; the sign bit of v (-0.0 and NaN included) sets bit 7."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    a = mag.to(tl.float32, bitcast=True)
    w = tl.where(a < FMAX, a, FMAX)  # +inf saturates; NaN (false here) is replaced below
    wb = w.to(tl.int32, bitcast=True)
    SHIFT: tl.constexpr = 23 - MBITS
    BIAS: tl.constexpr = (1 << (6 - MBITS)) - 1  # 7 for E4M3, 15 for E5M2
    normal = ((wb + ((1 << (SHIFT - 1)) - 1) + ((wb >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MBITS)
    t = w * (2.0 ** (MBITS - EMIN))
    whole = t.to(tl.int32)
    frac = t - whole.to(tl.float32)
    sub = whole + ((frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))).to(tl.int32)
    code = tl.where(w >= 2.0 ** EMIN, normal, sub)
    code = tl.where(mag > 0x7F800000, 0x7F, code)
    return tl.where(bits < 0, code | 0x80, code)


@triton.jit
def _fp8_value(code, MBITS: tl.constexpr, EMIN: tl.constexpr, IEEE_SPECIALS: tl.constexpr):
    """fp32 value of float8 bytes given as int32 in [0, 255] (exact): sign, 7 - MBITS exponent
    bits, MBITS mantissa bits; exponent 0 is subnormal (m * 2**(EMIN - MBITS)). The top
    exponent holds +-inf (mantissa 0) and NaN with IEEE_SPECIALS (E5M2), else only the all-ones
    NaN (E4M3 "fn": 0x7F / 0xFF)."""
    EMASK: tl.constexpr = (1 << (7 - MBITS)) - 1
    BIAS: tl.constexpr = (1 << (6 - MBITS)) - 1
    e = (code >> MBITS) & EMASK
    m = code & ((1 << MBITS) - 1)
    normal = (((e + (127 - BIAS)) << 23) | (m << (23 - MBITS))).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * (2.0 ** (EMIN - MBITS)), normal)
    if IEEE_SPECIALS:
        v = tl.where(e == EMASK, tl.where(m == 0, float("inf"), float("nan")), v)
    else:
        v = tl.where((code & 127) == 127, float("nan"), v)
    return tl.where(code >= 128, v * -1.0, v)  # not `-v`: Triton negates as 0 - v, which loses -0.0


@triton.jit
def _pow2_scale(amax, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr):
    """`Float8.scales_of` of non-negative statistics: the smallest power of two `s` with
    amax / s <= fmax (`codec.scales._pow2_scale`: fmax's exponent MAX_EXP and mantissa bits
    MAX_MANT compared with amax's bits), 1 for 0, within [2**-126, 2**127]; +inf kept."""
    bits = amax.to(tl.int32, bitcast=True)
    k = ((bits >> 23) & 0xFF) - 127 - MAX_EXP + ((bits & 0x7FFFFF) > MAX_MANT).to(tl.int32)
    k = tl.where(amax > 0, k, 0)
    k = tl.minimum(tl.maximum(k, -126), 127)
    s = ((k + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(amax == float("inf"), amax, s)


@triton.jit
def _row_amax(x_ptr, row, cols, row_stride, CHUNK: tl.constexpr, STEPS: tl.constexpr):
    """The amax of |x| over one row, +inf for a row holding NaN/Inf (`codec.scales._finite_amax`),
    walking the row in `STEPS` (`cdiv(cols, CHUNK)`, a constexpr as in
    `triton_codec.lowrank_project_kernel`) chunks of CHUNK columns."""
    m = tl.zeros([CHUNK], tl.float32)
    bad = tl.zeros([CHUNK], tl.int32)
    for step in range(0, STEPS):  # a loop, not unrolled
        j = step * CHUNK + tl.arange(0, CHUNK)
        a = tl.abs(tl.load(x_ptr + row * row_stride + j, mask=j < cols, other=0.0))
        fin = _is_finite(a)
        bad = bad | (~fin).to(tl.int32)
        m = tl.maximum(m, tl.where(fin, a, 0.0))
    return tl.where(tl.max(bad, axis=0) > 0, float("inf"), tl.max(m, axis=0))


@triton.jit
def fp8_row_scale_kernel(x_ptr, out_ptr, cols, row_stride, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr,
                         AMAX_ONLY: tl.constexpr, CHUNK: tl.constexpr, STEPS: tl.constexpr):
    """Per row (one program each): its amax (`_row_amax`), stored as is with AMAX_ONLY (the
    statistics whose maximum is the tensor scale's), else as the row's scale (`_pow2_scale`)."""
    row = tl.program_id(0).to(tl.int64)
    s = _row_amax(x_ptr, row, cols, row_stride, CHUNK, STEPS)
    if not AMAX_ONLY:
        s = _pow2_scale(s, MAX_EXP, MAX_MANT)
    tl.store(out_ptr + row, s)


@triton.jit
def fp8_row_scale_encode_kernel(x_ptr, scale_ptr, out_ptr, cols, row_stride, MAX_EXP: tl.constexpr,
                                MAX_MANT: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr,
                                CHUNK: tl.constexpr, STEPS: tl.constexpr):
    """Row scaling's scales and codes in one kernel: a program takes its row's scale
    (`_row_amax`, `_pow2_scale`), stores it, and walks the row again writing its float8 bytes
    (`[rows, cols]`, as `fp8_encode_kernel` writes them). The second walk reads the row its own
    first walk just read (a few KB to tens of KB), which the cache is there to serve, as for a
    row reduction fused with its consumer: the traffic model (`gift_compile.kernels.traffic`)
    counts the gradient once (not yet timed on a GPU)."""
    row = tl.program_id(0).to(tl.int64)
    s = _pow2_scale(_row_amax(x_ptr, row, cols, row_stride, CHUNK, STEPS), MAX_EXP, MAX_MANT)
    tl.store(scale_ptr + row, s)
    inv = _pow2_inverse(s)
    for step in range(0, STEPS):
        j = step * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * row_stride + j, mask=j < cols, other=0.0)
        tl.store(out_ptr + row * cols + j, _fp8_code(x * inv, MBITS, EMIN, FMAX).to(tl.uint8), mask=j < cols)


@triton.jit
def _finite_amax(x, AXIS: tl.constexpr):
    """The amax of |x| along AXIS, +inf where the reduced values hold NaN/Inf
    (`codec.scales._finite_amax`): a group's statistic, never NaN, so a running `tl.maximum`
    over partial ones is exact and keeps the +inf marker."""
    a = tl.abs(x)
    fin = _is_finite(a)
    bad = tl.max((~fin).to(tl.int32), axis=AXIS) > 0
    return tl.where(bad, float("inf"), tl.max(tl.where(fin, a, 0.0), axis=AXIS))


@triton.jit
def _block_scales(x_ptr, row, j, inside, cols, row_stride, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr):
    """One row's blocks (the `[TILE, BLOCK_P2]` tile of padded columns `j`, BLOCK's next power of
    two wide, `inside` masking the extra lanes and blocks; columns past `cols` read as 0) and
    each block's scale: `_pow2_scale` of its amax, +inf for a block holding NaN/Inf. The kernels
    compute the columns themselves: an address built from a called function's result makes
    torch's analysis of the kernel count every pointer argument as written."""
    x = tl.load(x_ptr + row * row_stride + j, mask=inside & (j < cols), other=0.0)
    return x, _pow2_scale(_finite_amax(x, 1), MAX_EXP, MAX_MANT)


@triton.jit
def fp8_block_scale_kernel(x_ptr, out_ptr, cols, nblocks, row_stride, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr,
                           BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, TILE: tl.constexpr):
    """Per block of BLOCK columns (`[rows, nblocks]`): its scale (`_block_scales`). A program
    covers TILE blocks of one row."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * TILE + tl.arange(0, TILE)
    lane = tl.arange(0, BLOCK_P2)
    j = b[:, None] * BLOCK + lane[None, :]
    _, s = _block_scales(x_ptr, row, j, (lane < BLOCK)[None, :] & (b < nblocks)[:, None], cols, row_stride,
                         MAX_EXP, MAX_MANT)
    tl.store(out_ptr + row * nblocks + b, s, mask=b < nblocks)


@triton.jit
def fp8_block_scale_encode_kernel(x_ptr, scale_ptr, out_ptr, cols, nblocks, row_stride, MAX_EXP: tl.constexpr,
                                  MAX_MANT: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr,
                                  BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, TILE: tl.constexpr):
    """Block scaling's scales and codes in one kernel: a program loads TILE blocks of one row
    once, stores their scales (`_block_scales`) and the float8 bytes of the tile under them
    (`[rows, nblocks * BLOCK]`, the padded columns' codes included, as `fp8_encode_kernel`)."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * TILE + tl.arange(0, TILE)
    lane = tl.arange(0, BLOCK_P2)
    j = b[:, None] * BLOCK + lane[None, :]
    inside = (lane < BLOCK)[None, :] & (b < nblocks)[:, None]
    x, s = _block_scales(x_ptr, row, j, inside, cols, row_stride, MAX_EXP, MAX_MANT)
    tl.store(scale_ptr + row * nblocks + b, s, mask=b < nblocks)
    code = _fp8_code(x * _pow2_inverse(s)[:, None], MBITS, EMIN, FMAX)
    tl.store(out_ptr + row * (nblocks * BLOCK) + j, code.to(tl.uint8), mask=inside)


@triton.jit
def _scale_at(scale_ptr, group, row, j, nblocks, SCALING: tl.constexpr, BLOCK: tl.constexpr, mask):
    """The fp32 scale of column `j` of `row` in scale group `group` (a sender's, or 0): the one
    per tensor, the row's, or its block's."""
    if SCALING == TENSOR:
        s = tl.load(scale_ptr + group)
    elif SCALING == ROW:
        s = tl.load(scale_ptr + row)
    else:
        s = tl.load(scale_ptr + row * nblocks + j // BLOCK, mask=mask, other=1.0)
    return s


@triton.jit
def fp8_encode_kernel(x_ptr, scale_ptr, out_ptr, cols, cp, nblocks, row_stride, SCALING: tl.constexpr,
                      BLOCK: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr,
                      TILE: tl.constexpr):
    """Float8 bytes (`[rows, cp]`) of x under the given scales (`Float8.encode`, round to
    nearest): x times the scale's exact inverse (`_pow2_inverse`; 0 for +inf, so a non-finite
    group's finite values write +-0 and its NaN/Inf write NaN, as the reference's), then
    `_fp8_code`. A program covers TILE columns of one row."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * TILE + tl.arange(0, TILE)
    inside = j < cp
    x = tl.load(x_ptr + row * row_stride + j, mask=j < cols, other=0.0)
    v = x * _pow2_inverse(_scale_at(scale_ptr, 0, row, j, nblocks, SCALING, BLOCK, inside))
    tl.store(out_ptr + row * cp + j, _fp8_code(v, MBITS, EMIN, FMAX).to(tl.uint8), mask=inside)


@triton.jit
def _fp8_decoded(code, scale, MBITS: tl.constexpr, EMIN: tl.constexpr, IEEE_SPECIALS: tl.constexpr):
    """`fp8_decode_kernel`'s value of each float8 byte (int32) under its fp32 scale: the code's
    value times the scale, NaN for a +inf scale, saturated at fp32's largest value. The
    receiver's fused expansion decodes with it too, so both give the same bits."""
    scale = tl.where(_is_finite(scale), scale, float("nan"))
    v = _fp8_value(code, MBITS, EMIN, IEEE_SPECIALS) * scale
    return tl.where(v > FP32_MAX, FP32_MAX, tl.where(v < -FP32_MAX, -FP32_MAX, v))


@triton.jit
def fp8_decode_kernel(payload_ptr, scale_ptr, out_ptr, rows, cols, cp, nblocks, SENDERS: tl.constexpr,
                      SCALING: tl.constexpr, BLOCK: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                      IEEE_SPECIALS: tl.constexpr, TILE: tl.constexpr, SUM: tl.constexpr, AVERAGE: tl.constexpr):
    """Decode every sender's `[rows, cp]` payload (SENDERS of them, a plan constant) with its own
    scales (`codec.decode`: the code's value times the scale, NaN for a +inf scale, saturated at
    fp32's largest value). SUM: one fp32 sum over the senders in rank order, starting from 0
    (with AVERAGE of each value divided by their count, a correctly rounded division, so the mean
    of values near fp32's largest does not overflow), stored `[rows, cols]`; otherwise each
    sender's values, stored `[senders, rows, cols]`."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * TILE + tl.arange(0, TILE)
    valid = j < cols
    acc = tl.zeros([TILE], tl.float32)
    for s in range(SENDERS):
        at = s * rows + row
        code = tl.load(payload_ptr + at * cp + j, mask=valid, other=0).to(tl.int32)
        v = _fp8_decoded(code, _scale_at(scale_ptr, s, at, j, nblocks, SCALING, BLOCK, valid), MBITS, EMIN,
                         IEEE_SPECIALS)
        if SUM:
            if AVERAGE:  # each sender's share first: a sum of finite values must not overflow
                v = tl.math.div_rn(v, tl.full([TILE], SENDERS, tl.float32))
            acc += v
        else:
            tl.store(out_ptr + at * cols + j, v, mask=valid)
    if SUM:
        tl.store(out_ptr + row * cols + j, acc, mask=valid)


@triton.jit
def lowrank_fp8_row_scale_kernel(g_ptr, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr, out_ptr, rows, cols, rank,
                                 MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr, AMAX_ONLY: tl.constexpr,
                                 BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, STEPS: tl.constexpr,
                                 PRECISION: tl.constexpr):
    """`fp8_row_scale_kernel` of the low-rank map's expansion, computed in the tile
    (`triton_codec._expand_tile`) and never written: a program walks its BM rows' `[BM, BN]`
    tiles across the columns (`STEPS` = `cdiv(cols, BN)`, a constexpr as in
    `lowrank_project_kernel`), keeping each row's running `_finite_amax`, then stores the
    rows' amax (AMAX_ONLY: the tensor scale's statistics) or their scales (`_pow2_scale`).
    The tiles are the expansion's own, so the values are `lowrank_expand`'s bit for bit."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    amax = tl.zeros([BM], tl.float32)
    for step in range(0, STEPS):  # a loop, not unrolled
        n = step * BN + tl.arange(0, BN)
        y = _expand_tile(g_ptr, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr, m, n, rows, cols, rank, BM, BN, BR,
                         PRECISION)
        amax = tl.maximum(amax, _finite_amax(y, 1))
    if not AMAX_ONLY:
        amax = _pow2_scale(amax, MAX_EXP, MAX_MANT)
    tl.store(out_ptr + m, amax, mask=m < rows)


@triton.jit
def lowrank_fp8_block_scale_kernel(g_ptr, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr, out_ptr, rows, cols, rank,
                                   nblocks, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr, BLOCK: tl.constexpr,
                                   BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, PRECISION: tl.constexpr):
    """`fp8_block_scale_kernel` of the low-rank map's expansion, computed in the tile and never
    written: the `[BM, BN]` tile's `BN / BLOCK` blocks of each row (BLOCK dividing BN,
    `ops_fp8.lowrank_fp8_reason`; the columns past `cols` are the tile's zeros, the
    reference's padding), their scales stored `[rows, nblocks]`."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    y = _expand_tile(g_ptr, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr, m, n, rows, cols, rank, BM, BN, BR,
                     PRECISION)
    s = _pow2_scale(_finite_amax(tl.reshape(y, [BM, BN // BLOCK, BLOCK]), 2), MAX_EXP, MAX_MANT)
    b = tl.program_id(1) * (BN // BLOCK) + tl.arange(0, BN // BLOCK)
    tl.store(out_ptr + m[:, None].to(tl.int64) * nblocks + b[None, :], s,
             mask=(m < rows)[:, None] & (b < nblocks)[None, :])


@triton.jit
def lowrank_fp8_encode_kernel(g_ptr, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr, scale_ptr, out_ptr, rows, cols,
                              rank, cp, nblocks, SCALING: tl.constexpr, BLOCK: tl.constexpr, MBITS: tl.constexpr,
                              EMIN: tl.constexpr, FMAX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                              BR: tl.constexpr, PRECISION: tl.constexpr):
    """`fp8_encode_kernel` of the low-rank map's expansion, computed in the tile and never
    written: each value of the `[BM, BN]` tile times its scale's exact inverse, then
    `_fp8_code`, stored `[rows, cp]` (the padded columns' codes of the tile's zeros included).
    Rows past `rows` read row 0's scale (`_scale_at` loads a row's scale unmasked) and store
    nothing."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    y = _expand_tile(g_ptr, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr, m, n, rows, cols, rank, BM, BN, BR,
                     PRECISION)
    inside = (m < rows)[:, None] & (n < cp)[None, :]
    row = tl.where(m < rows, m, 0).to(tl.int64)[:, None]
    v = y * _pow2_inverse(_scale_at(scale_ptr, 0, row, n[None, :], nblocks, SCALING, BLOCK, inside))
    tl.store(out_ptr + m[:, None].to(tl.int64) * cp + n[None, :], _fp8_code(v, MBITS, EMIN, FMAX).to(tl.uint8),
             mask=inside)


@triton.jit
def lowrank_fp8_decode_expand_kernel(payload_ptr, scale_ptr, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr, out_ptr,
                                     rows, cols, rank, cp, nblocks, rows_per_sender, SCALING: tl.constexpr,
                                     BLOCK: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                                     IEEE_SPECIALS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                     BR: tl.constexpr, PRECISION: tl.constexpr):
    """`triton_codec.lowrank_expand_kernel` of the gathered float8 bytes, decoded in the tile
    instead of read as fp32: the all-reduce's receiver. The payload is `[rows, cp]` (every
    sender's shard of `rows_per_sender` rows, one after another); the scales one per sender
    (TENSOR: row m's is sender `m // rows_per_sender`'s), `[rows]` (ROW) or `[rows, nblocks]`
    (BLOCK_SCALING), each value decoded as `fp8_decode_kernel` decodes it (`_fp8_decoded`), then
    expanded (`_expand_values`). Rows past `rows` read row 0's scale (`_scale_at` loads a row's
    scale unmasked) and store nothing."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    both = (m < rows)[:, None] & (n < cols)[None, :]
    code = tl.load(payload_ptr + m[:, None].to(tl.int64) * cp + n[None, :], mask=both, other=0).to(tl.int32)
    row = tl.where(m < rows, m, 0).to(tl.int64)[:, None]
    scale = _scale_at(scale_ptr, row // rows_per_sender, row, n[None, :], nblocks, SCALING, BLOCK, both)
    g = _fp8_decoded(code, scale, MBITS, EMIN, IEEE_SPECIALS)
    y = _expand_values(g, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr, m, n, rows, cols, rank, BM, BN, BR,
                       PRECISION)
    tl.store(out_ptr + m[:, None].to(tl.int64) * cols + n[None, :], y, mask=both)
