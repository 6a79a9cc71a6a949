"""The device code of the codec kernels: Triton functions, one per step of the two-level formats.

Each kernel restates, operation by operation, what the reference codec (`gift_compile.codec`)
computes for one element or one block, so that its bytes are the reference's bytes: the same
fp32 multiplies in the same order, comparisons with exact multiples of the block unit instead
of a division, the E4M3 scale codes built from the exponent and mantissa bits instead of a
float8 conversion (whose rounding and NaN handling Triton's interpreter, its CUDA lowering
and ATen need not share), NaN/Inf kept by explicit `where`s rather than by the NaN semantics
of `max`/`min`, which Triton does not promise, and negation as a multiply by -1 (Triton's
unary minus is 0 - v, which turns -0.0 into +0.0). The launch wrappers and the
registered ops are in `gift_compile.kernels.ops`; the format parameters (the constexprs
below) in `gift_compile.kernels.formats`.

Layout shared by the kernels: a gradient is the `[rows, cols]` fp32 row view of the codec
(`codec.as_rows`), read in place (row stride given, unit column stride); the columns past
`cols` up to the padded width `cp` (a whole number of blocks) read as zeros, which is what the
reference's zero padding gives. One program handles one row and `TILE` packed words of it,
a word being the `PER` codes that share one byte (or one 3-byte group for 3- and 6-bit
codes); the `PER` digits of a word are a `[TILE, PER_P2]` tile (`PER_P2` the next power of two,
the extra digits masked), so the loads of a program are contiguous.

The low-rank map's expansion and the two kernels that consume it on the sender
(`lowrank_block_stat_kernel`, `lowrank_encode_kernel`) work on `[BM, BN]` tiles of rows and
columns instead (`_expand_tile`, one function for all three, so they compute the same values):
the consumers view a tile as `[BM, BN / BLOCK, BLOCK]` blocks or `[BM, BN / PER, PER]` words,
which needs BN to be a multiple of both (`ops.fused_reason`). The all-reduce's receiver
(`lowrank_decode_expand_kernel`) takes the same tile's values from the gathered codes,
decoded as `decode_kernel` decodes them (`_decoded_value`), instead of from memory.

Why one module: every kernel here restates the reference codec operation by operation, and the
plain and the low-rank fused kernels share the same `@triton.jit` steps (`_e4m3_code`,
`_magnitude`, `_digit_code`, `_grid_value`, `_block_stat`); one file is the one place where that
arithmetic is read against `gift_compile.codec`, so no copy of a step can drift from another.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Format kinds (`KIND` constexpr): E2M1 with a sign bit, two's complement integers, int2's
# sign-and-magnitude levels {+-1, +-3}, ternary digits.
KIND_NVFP4 = tl.constexpr(0)
KIND_INT = tl.constexpr(1)
KIND_INT2 = tl.constexpr(2)
KIND_TERNARY = tl.constexpr(3)
FP32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _is_finite(v):
    """Finite test that also holds in the interpreter: NaN and +-inf fail `|v| < inf`."""
    return tl.abs(v) < float("inf")


@triton.jit
def _pow2_inverse(s):
    """Exact 1 / s for a power of two in [2**-127, 2**127] (0 for +inf), on the exponent bits:
    `codec.scales._pow2_inverse`."""
    e = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF
    bits = tl.where(e == 0, 254 << 23, (254 - e) << 23)
    bits = tl.where(e == 254, 1 << 22, bits)
    bits = tl.where(e == 255, 0, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_value(code):
    """fp32 value of E4M3 (fn) bytes given as int32 in [0, 255]: sign, 4 exponent bits (bias 7),
    3 mantissa bits; exponent 0 is subnormal (m * 2**-9); 0x7F / 0xFF are NaN."""
    e = (code >> 3) & 15
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    v = tl.where((code & 127) == 127, float("nan"), v)
    return tl.where(code >= 128, v * -1.0, v)  # not `-v`: Triton negates as 0 - v, which loses -0.0


@triton.jit
def _e4m3_code(v):
    """E4M3 byte (int32) of a non-negative fp32 value: round to nearest even, saturating at 448;
    a non-finite value gives the NaN code 127 (`codec.scales._e4m3_code`). Normal results round
    the fp32 bits (the carry of a round-up moves into the exponent as it should); subnormal ones
    (below 2**-6) round v * 2**9, exact, to an integer, ties to even."""
    fin = _is_finite(v)
    w = tl.where(fin, tl.minimum(v, 448.0), 0.0)
    bits = w.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - 960  # 960 = (127 - 7) << 3
    t = w * 512.0
    whole = t.to(tl.int32)
    frac = t - whole.to(tl.float32)
    sub = whole + ((frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))).to(tl.int32)
    code = tl.where(w >= 0.015625, normal, sub)
    return tl.where(fin, code, 127)


@triton.jit
def _block_count(b, cols, BLOCK: tl.constexpr):
    """fp64 count of real values in blocks `b` of a row of `cols` columns: BLOCK, fewer in a
    ragged row's last block, at least 1 (a block past the row is masked out by the caller)."""
    return tl.minimum(tl.maximum(cols - b * BLOCK, 1), BLOCK).to(tl.float64)


@triton.jit
def _block_stat(a, count, AXIS: tl.constexpr, STEP: tl.constexpr, MEAN_ABS: tl.constexpr):
    """The statistic of each block of `|x|` values `a`, the blocks along axis AXIS: amax, or
    `(sum * STEP) / count` with the sum in fp64 and `count` the block's real values
    (`_block_count`, shaped like the result; `codec.scales._mean_abs`); +inf for a block
    holding NaN/Inf (its non-finite values are left out of the sum or max, whose result the
    +inf replaces). Padding reads as 0, so the sum and max are the real values' own."""
    fin = _is_finite(a)
    bad = tl.min(fin.to(tl.int32), axis=AXIS) == 0
    ok = tl.where(fin, a, 0.0)
    if MEAN_ABS:
        m = tl.sum(ok.to(tl.float64), axis=AXIS) * STEP / count
        s = tl.minimum(m, FP32_MAX).to(tl.float32)
    else:
        s = tl.max(ok, axis=AXIS)
    return tl.where(bad, float("inf"), s)


@triton.jit
def block_stat_kernel(x_ptr, stat_ptr, cols, nblocks, row_stride,
                      STEP: tl.constexpr, MEAN_ABS: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """Per-block statistic `stat[row, b]` (fp32, `_block_stat`) of one row's `TILE` blocks."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * TILE + tl.arange(0, TILE)
    j = b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    a = tl.abs(tl.load(x_ptr + row * row_stride + j, mask=(j < cols) & (b < nblocks)[:, None], other=0.0))
    s = _block_stat(a, _block_count(b, cols, BLOCK), 1, STEP, MEAN_ABS)
    tl.store(stat_ptr + row * nblocks + b, s, mask=b < nblocks)


@triton.jit
def scale_code_kernel(stat_ptr, tscale_ptr, code_ptr, n, INV_LEVEL: tl.constexpr, TILE: tl.constexpr):
    """E4M3 block-scale codes from the block statistics and the fp32 tensor scale:
    code(stat * (1 / tscale) [* INV_LEVEL]), the two multiplies of `codec.choose_scales`."""
    i = tl.program_id(0) * TILE + tl.arange(0, TILE)
    unit = tl.load(stat_ptr + i, mask=i < n, other=0.0) * _pow2_inverse(tl.load(tscale_ptr))
    if INV_LEVEL != 1.0:
        unit = unit * INV_LEVEL
    tl.store(code_ptr + i, _e4m3_code(unit).to(tl.uint8), mask=i < n)


@triton.jit
def _passes(a, unit, k, IMAX: tl.constexpr):
    """Whether `a` reaches the integer grid's threshold k (between magnitudes k and k + 1):
    `a > (k + 0.5) unit` for even k, `>=` for odd k (ties to even), False outside [0, IMAX)."""
    t = (k.to(tl.float32) + 0.5) * unit
    hit = tl.where((k & 1) == 1, a >= t, a > t)
    return hit & (k >= 0) & (k < IMAX)


@triton.jit
def _magnitude(a, unit, KIND: tl.constexpr, IMAX: tl.constexpr):
    """Index of the grid magnitude nearest to a / unit, ties to even, saturating, by comparing
    `a` with exact multiples of `unit` (`codec.codes._nearest_magnitude`); NaN gives 0.

    The integer grids (up to 31 thresholds for int6) take the estimate round(a / unit), which
    an approximate reciprocal puts within one step, and correct it with the two thresholds
    around it: two comparisons instead of one per level. That is exact where the thresholds
    (k + 0.5) unit are exact, i.e. for normal units (a few-bit scale times a few-bit
    threshold); a tile holding a subnormal unit, whose thresholds round (two may coincide,
    and the reference counts each), compares every threshold as the reference does. A zero
    unit (a block that underflowed) puts every threshold at 0: `a > 0` passes them all,
    `a == 0` the inclusive ones (odd k); a NaN unit or a NaN value passes none."""
    mag = tl.zeros(a.shape, tl.int32)
    if KIND == KIND_INT:
        if tl.max(((unit > 0) & (unit < 1.1754943508222875e-38)).to(tl.int32)) > 0:
            for k in tl.static_range(IMAX):
                if k % 2 == 1:
                    mag += (a >= unit * (k + 0.5)).to(tl.int32)
                else:
                    mag += (a > unit * (k + 0.5)).to(tl.int32)
        else:
            q = tl.minimum(tl.where(unit > 0, a * (1.0 / unit), 0.0), IMAX * 1.0)
            est = (q + 0.5).to(tl.int32)
            est = tl.where(_passes(a, unit, est, IMAX), est + 1, est)
            est = tl.where((est > 0) & ~_passes(a, unit, est - 1, IMAX), est - 1, est)
            zero_unit = tl.where(a > 0, IMAX, tl.where(a == 0, IMAX // 2, 0))
            mag = tl.where(unit == 0, zero_unit, tl.where((unit > 0) & (a == a), est, 0))
    elif KIND == KIND_NVFP4:
        mag += (a > unit * 0.25).to(tl.int32)
        mag += (a >= unit * 0.75).to(tl.int32)
        mag += (a > unit * 1.25).to(tl.int32)
        mag += (a >= unit * 1.75).to(tl.int32)
        mag += (a > unit * 2.5).to(tl.int32)
        mag += (a >= unit * 3.5).to(tl.int32)
        mag += (a > unit * 5.0).to(tl.int32)
    elif KIND == KIND_INT2:
        mag += (a > unit * 2.0).to(tl.int32)
    else:
        mag += (a > unit * 0.5).to(tl.int32)
    return mag


@triton.jit
def _digit_code(x, sc, tscale, j, KIND: tl.constexpr, BITS: tl.constexpr, IMAX: tl.constexpr):
    """Each value's int32 code (`codec.encode`, round to nearest) on the grid of its E4M3 block
    code `sc` (int32) and the fp32 tensor scale; `j` its padded column (int2's parity rule)."""
    unit = _e4m3_value(sc) * tscale
    unit = tl.where(_is_finite(unit), unit, float("nan"))
    mag = _magnitude(tl.abs(x), unit, KIND, IMAX)
    neg = x < 0
    if KIND == KIND_INT2:
        # no zero level: an exact 0 goes to -1 or +1 by column parity (`codec.codes.Int2.nearest_sign`)
        neg = neg | ((x == 0) & ((j & 1) == 1))
    sign = neg.to(tl.int32)
    if KIND == KIND_NVFP4:
        code = mag + sign * 8
    elif KIND == KIND_INT2:
        code = mag + sign * 2
    elif KIND == KIND_TERNARY:
        code = 1 + mag * (1 - 2 * sign)
    else:
        code = (mag * (1 - 2 * sign)) & ((1 << BITS) - 1)
    return code


@triton.jit
def encode_kernel(x_ptr, code_ptr, tscale_ptr, out_ptr, cols, cp, nblocks, nwords, out_cols, row_stride,
                  KIND: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, PER_P2: tl.constexpr,
                  NBYTES: tl.constexpr, IMAX: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """Packed codes of x on the grid of the given E4M3 block codes and tensor scale
    (`codec.encode`, round to nearest): every digit's code (`_digit_code`), then each word's
    digits joined low digit first, stored as one byte or as a 3-byte group, low byte first."""
    row = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1) * TILE + tl.arange(0, TILE)
    i = tl.arange(0, PER_P2)
    j = w[:, None] * PER + i[None, :]  # padded column of each digit
    digit = (i < PER)[None, :] & (w < nwords)[:, None]
    inside = digit & (j < cp)
    x = tl.load(x_ptr + row * row_stride + j, mask=inside & (j < cols), other=0.0)
    sc = tl.load(code_ptr + row * nblocks + j // BLOCK, mask=inside, other=0).to(tl.int32)
    code = _digit_code(x, sc, tl.load(tscale_ptr), j, KIND, BITS, IMAX)
    if KIND == KIND_TERNARY:
        code = tl.where(inside, code, 1)  # digits past the padded row: the value 0
        weight = tl.full([PER_P2], 1, tl.int32)
        for k in tl.static_range(1, PER_P2):
            weight = tl.where(i >= k, weight * 3, weight)
    else:
        weight = 1 << (i * BITS)
    word = tl.sum(tl.where(digit, code * weight[None, :], 0), axis=1)
    out = out_ptr + row * out_cols + w * NBYTES
    for k in tl.static_range(NBYTES):
        tl.store(out + k, ((word >> (8 * k)) & 0xFF).to(tl.uint8), mask=w < nwords)


@triton.jit
def _grid_value(code, KIND: tl.constexpr, BITS: tl.constexpr):
    """fp32 grid value (in units of the block scale) of int32 codes: the `values` of `codec.codes`'s grids."""
    if KIND == KIND_NVFP4:
        m = code & 7
        normal = ((2 + (m & 1)) << (m >> 1)).to(tl.float32) * 0.25
        mag = tl.where(m < 2, m.to(tl.float32) * 0.5, normal)
        v = tl.where(code >= 8, mag * -1.0, mag)  # -0.0 for the negative zero code, as the reference
    elif KIND == KIND_INT2:
        v = ((1 + 2 * (code & 1)) * (1 - 2 * (code >> 1))).to(tl.float32)
    elif KIND == KIND_TERNARY:
        v = (code - 1).to(tl.float32)
    else:
        v = ((code ^ (1 << (BITS - 1))) - (1 << (BITS - 1))).to(tl.float32)  # sign-extend
    return v


@triton.jit
def decode_kernel(payload_ptr, code_ptr, tscale_ptr, out_ptr, rows, cols, nblocks, nwords, pcols,
                  SENDERS: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr,
                  PER_P2: tl.constexpr, NBYTES: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
                  SUM: tl.constexpr, AVERAGE: tl.constexpr):
    """Decode every sender's `[rows, pcols]` payload (SENDERS of them, a plan constant) with its
    own block codes and tensor scale (`codec.decode`: code value times block scale times tensor
    scale, NaN for a non-finite scale, saturated at fp32's largest value). SUM: one fp32 sum over
    the senders in rank order, starting from 0 (with AVERAGE of each value divided by their count,
    a correctly rounded division, so the mean of values near fp32's largest does not overflow),
    stored `[rows, cols]`; otherwise each sender's values, stored `[senders, rows, cols]`."""
    row = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1) * TILE + tl.arange(0, TILE)
    i = tl.arange(0, PER_P2)
    j = w[:, None] * PER + i[None, :]
    valid = (i < PER)[None, :] & (w < nwords)[:, None] & (j < cols)
    if KIND == KIND_TERNARY:
        div = tl.full([PER_P2], 1, tl.int32)
        for k in tl.static_range(1, PER_P2):
            div = tl.where(i >= k, div * 3, div)
    acc = tl.zeros([TILE, PER_P2], tl.float32)
    for s in range(SENDERS):
        at = s * rows + row
        src = payload_ptr + at * pcols + w * NBYTES
        word = tl.load(src, mask=w < nwords, other=0).to(tl.int32)
        for k in tl.static_range(1, NBYTES):
            word = word | (tl.load(src + k, mask=w < nwords, other=0).to(tl.int32) << (8 * k))
        if KIND == KIND_TERNARY:
            code = (word[:, None] // div[None, :]) % 3
        else:
            code = (word[:, None] >> (i * BITS)[None, :]) & ((1 << BITS) - 1)
        sc = tl.load(code_ptr + at * nblocks + j // BLOCK, mask=valid, other=0).to(tl.int32)
        v = _decoded_value(code, sc, tl.load(tscale_ptr + s), KIND, BITS)
        if SUM:
            if AVERAGE:  # each sender's share first: a sum of finite values must not overflow
                v = tl.math.div_rn(v, tl.full([TILE, PER_P2], SENDERS, tl.float32))
            acc += v
        else:
            tl.store(out_ptr + at * cols + j, v, mask=valid)
    if SUM:
        tl.store(out_ptr + row * cols + j, acc, mask=valid)


@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr):
    """`acc + a @ b` on the tensor cores with fp32 accumulation: "bf16" rounds both operands to
    bf16 (to nearest even), "tf32" lets `tl.dot` round them to TF32, "ieee" keeps fp32 operands
    (no tensor cores: the interpreter tests' setting, and the rounding-free reference)."""
    if PRECISION == "bf16":
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc, out_dtype=tl.float32)
    else:
        out = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=tl.float32)
    return out


@triton.jit
def lowrank_project_kernel(g_ptr, basis_ptr, p_ptr, rows, cols, rank, BM: tl.constexpr, BK: tl.constexpr,
                           BR: tl.constexpr, STEPS: tl.constexpr, PRECISION: tl.constexpr):
    """The low-rank map's projection `p = g @ basis` (`g` `[rows, cols]`, `basis` `[cols, rank]`,
    both contiguous; `p` `[rows, rank]`) for `BM` rows per program: the columns are walked in
    `BK`-wide steps in one fixed order into one fp32 accumulator (`_mma`), with no split of the
    reduction across programs, so the result's bits depend only on the inputs and the compiled
    kernel, never on a library's algorithm choice or torch's global TF32 flags: every rank
    computes the same projection. The rank is padded to BR (>= 16) with zeros. The column walk's
    length `STEPS` (`cdiv(cols, BK)`) is a constexpr, one compile per input width (a model has a
    few): Triton's interpreter cannot loop to a runtime bound (its scalars are 1-element arrays,
    which numpy 2 no longer turns into an index)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    k = tl.arange(0, BR)
    rmask, kmask = m < rows, k < rank
    acc = tl.zeros([BM, BR], dtype=tl.float32)
    for step in range(0, STEPS):  # a loop, not unrolled (static_range would unroll it)
        n = step * BK + tl.arange(0, BK)
        cmask = n < cols
        g = tl.load(g_ptr + m[:, None].to(tl.int64) * cols + n[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0)
        basis = tl.load(basis_ptr + n[:, None] * rank + k[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
        acc = _mma(g, basis, acc, PRECISION)
    tl.store(p_ptr + m[:, None].to(tl.int64) * rank + k[None, :], acc, mask=rmask[:, None] & kmask[None, :])


@triton.jit
def _expand_tile(g_ptr, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr, m, n, rows, cols, rank,
                 BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, PRECISION: tl.constexpr):
    """The low-rank map's expansion `g * dinv + ((p * coef) @ basis.T) * dsq` on the `[BM, BN]`
    tile of rows `m` and columns `n` (`lowrank_expand_kernel`), with the rank padded to BR;
    0 outside `[rows, cols]` (the zero padding the codec's reference gives the columns past
    `cols`, whatever a NaN in the projection would make of the masked operands). The tile's
    arithmetic is `_expand_values`, its one spelling, shared by the expansion, the fused
    sender kernels and the fused receiver, so all of them compute the same values."""
    both = (m < rows)[:, None] & (n < cols)[None, :]
    g = tl.load(g_ptr + m[:, None].to(tl.int64) * cols + n[None, :], mask=both, other=0.0)
    return _expand_values(g, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr, m, n, rows, cols, rank, BM, BN, BR,
                          PRECISION)


@triton.jit
def _expand_values(g, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr, m, n, rows, cols, rank,
                   BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, PRECISION: tl.constexpr):
    """`_expand_tile` of the `[BM, BN]` tile `g` of rows `m` and columns `n` already in
    registers: read from memory (`_expand_tile`), or decoded from the gathered codes by the
    all-reduce's receiver (`lowrank_decode_expand_kernel`, `triton_fp8.lowrank_fp8_decode_expand_kernel`)."""
    k = tl.arange(0, BR)
    rmask, cmask, kmask = m < rows, n < cols, k < rank
    q = tl.load(p_ptr + m[:, None].to(tl.int64) * rank + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
    q = q * tl.load(coef_ptr + k, mask=kmask, other=0.0)[None, :]
    basis = tl.load(basis_ptr + n[None, :] * rank + k[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
    low = _mma(q, basis, tl.zeros([BM, BN], dtype=tl.float32), PRECISION)
    both = rmask[:, None] & cmask[None, :]
    dinv = tl.load(dinv_ptr + n, mask=cmask, other=0.0)[None, :]
    dsq = tl.load(dsq_ptr + n, mask=cmask, other=0.0)[None, :]
    return tl.where(both, g * dinv + low * dsq, 0.0)


@triton.jit
def lowrank_expand_kernel(g_ptr, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr, out_ptr, rows, cols, rank,
                          BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, PRECISION: tl.constexpr):
    """The low-rank map's expansion as a matmul epilogue (`geometry.maps.LowRank`, both
    directions): out = g * dinv + ((p * coef) @ basis.T) * dsq for a `[BM, BN]` tile
    (`_expand_tile`), the rank-r product on the tensor cores (`_mma`: fp32 accumulation,
    operands at PRECISION). `g` and `out` are `[rows, cols]`, `p` `[rows, rank]`, `basis`
    `[cols, rank]` (the projection's, read transposed: no transposed copy is made), all
    contiguous; the rank is padded to BR (>= 16, tl.dot's least) with zeros."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    y = _expand_tile(g_ptr, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr, m, n, rows, cols, rank, BM, BN, BR,
                     PRECISION)
    tl.store(out_ptr + m[:, None].to(tl.int64) * cols + n[None, :], y, mask=(m < rows)[:, None] & (n < cols)[None, :])


@triton.jit
def lowrank_block_stat_kernel(g_ptr, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr, stat_ptr, rows, cols, rank,
                              nblocks, STEP: tl.constexpr, MEAN_ABS: tl.constexpr, BLOCK: tl.constexpr,
                              BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, PRECISION: tl.constexpr):
    """`block_stat_kernel` of the low-rank map's expansion, computed in the tile
    (`_expand_tile`) and never written: the `[BM, BN]` tile's `BN / BLOCK` blocks of each row
    (BN a multiple of BLOCK), their statistics (`_block_stat`) stored `[rows, nblocks]`."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    y = _expand_tile(g_ptr, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr, m, n, rows, cols, rank, BM, BN, BR,
                     PRECISION)
    b = tl.program_id(1) * (BN // BLOCK) + tl.arange(0, BN // BLOCK)
    s = _block_stat(tl.reshape(tl.abs(y), [BM, BN // BLOCK, BLOCK]), _block_count(b, cols, BLOCK)[None, :], 2, STEP,
                    MEAN_ABS)
    tl.store(stat_ptr + m[:, None].to(tl.int64) * nblocks + b[None, :], s,
             mask=(m < rows)[:, None] & (b < nblocks)[None, :])


@triton.jit
def lowrank_encode_kernel(g_ptr, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr, code_ptr, tscale_ptr, out_ptr,
                          rows, cols, rank, cp, nblocks, nwords, out_cols,
                          KIND: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, NBYTES: tl.constexpr,
                          IMAX: tl.constexpr, BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          BR: tl.constexpr, PRECISION: tl.constexpr):
    """`encode_kernel` of the low-rank map's expansion, computed in the tile (`_expand_tile`)
    and never written: each value's code (`_digit_code`), the tile's `BN / PER` words of each
    row joined low digit first (`PER` a power of two dividing BN, so a word never straddles two
    tiles, and the padded width `cp` a whole number of words: no digit past it is stored),
    stored as one byte or a 3-byte group, low byte first. Not for ternary's 5-digit words
    (`ops.fused_reason`)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    y = _expand_tile(g_ptr, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr, m, n, rows, cols, rank, BM, BN, BR,
                     PRECISION)
    inside = (m < rows)[:, None] & (n < cp)[None, :]
    sc = tl.load(code_ptr + m[:, None].to(tl.int64) * nblocks + (n // BLOCK)[None, :], mask=inside, other=0)
    code = _digit_code(y, sc.to(tl.int32), tl.load(tscale_ptr), n[None, :], KIND, BITS, IMAX)
    weight = 1 << (tl.arange(0, PER) * BITS)
    word = tl.sum(tl.reshape(code, [BM, BN // PER, PER]) * weight[None, None, :], axis=2)
    w = tl.program_id(1) * (BN // PER) + tl.arange(0, BN // PER)
    out = out_ptr + m[:, None].to(tl.int64) * out_cols + w[None, :] * NBYTES
    for k in tl.static_range(NBYTES):
        tl.store(out + k, ((word >> (8 * k)) & 0xFF).to(tl.uint8), mask=(m < rows)[:, None] & (w < nwords)[None, :])


@triton.jit
def _decoded_value(code, sc, tscale, KIND: tl.constexpr, BITS: tl.constexpr):
    """`decode_kernel`'s value of each code (int32) under its E4M3 block code `sc` (int32) and
    the fp32 tensor scale: grid value times block scale times tensor scale, NaN for a
    non-finite scale, saturated at fp32's largest value. The receiver's fused expansion
    decodes with it too, so both give the same bits."""
    scale = _e4m3_value(sc) * tscale
    scale = tl.where(_is_finite(scale), scale, float("nan"))
    v = _grid_value(code, KIND, BITS) * scale
    return tl.where(v > FP32_MAX, FP32_MAX, tl.where(v < -FP32_MAX, -FP32_MAX, v))


@triton.jit
def lowrank_decode_expand_kernel(payload_ptr, code_ptr, tscale_ptr, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr,
                                 out_ptr, rows, cols, rank, nblocks, pcols, rows_per_sender,
                                 KIND: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, NBYTES: tl.constexpr,
                                 BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
                                 PRECISION: tl.constexpr):
    """`lowrank_expand_kernel` of the gathered codes, decoded in the tile instead of read as
    fp32: the all-reduce's receiver. The payload is `[rows, pcols]` packed words (every
    sender's shard of `rows_per_sender` rows, one after another), its E4M3 block codes
    `[rows, nblocks]`, one fp32 tensor scale per sender (row m's is sender
    `m // rows_per_sender`'s). Each row's `BN / PER` words of the tile are loaded once and
    split into their `PER` digits (`PER` a power of two dividing BN, as in
    `lowrank_encode_kernel`), each digit decoded as `decode_kernel` decodes it
    (`_decoded_value`), then expanded (`_expand_values`)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    w = tl.program_id(1) * (BN // PER) + tl.arange(0, BN // PER)
    rmask = m < rows
    both = rmask[:, None] & (n < cols)[None, :]
    src = payload_ptr + m[:, None].to(tl.int64) * pcols + w[None, :] * NBYTES
    wmask = rmask[:, None] & (w * PER < cols)[None, :]
    word = tl.load(src, mask=wmask, other=0).to(tl.int32)
    for k in tl.static_range(1, NBYTES):
        word = word | (tl.load(src + k, mask=wmask, other=0).to(tl.int32) << (8 * k))
    code = tl.reshape((word[:, :, None] >> (tl.arange(0, PER) * BITS)[None, None, :]) & ((1 << BITS) - 1), [BM, BN])
    sc = tl.load(code_ptr + m[:, None].to(tl.int64) * nblocks + (n // BLOCK)[None, :], mask=both, other=0)
    tscale = tl.load(tscale_ptr + m // rows_per_sender, mask=rmask, other=1.0)
    g = _decoded_value(code, sc.to(tl.int32), tscale[:, None], KIND, BITS)
    y = _expand_values(g, p_ptr, dinv_ptr, coef_ptr, basis_ptr, dsq_ptr, m, n, rows, cols, rank, BM, BN, BR,
                       PRECISION)
    tl.store(out_ptr + m[:, None].to(tl.int64) * cols + n[None, :], y, mask=both)
