"""The fp8 formats' codec kernels as registered operators: `torch.ops.gift_kernels.fp8_*`.

Registered as `gift_compile.kernels.ops` registers the two-level formats' kernels, and for the
same reason (its docstring): each operator is a `torch.library.triton_op` launching one kernel
of `gift_compile.kernels.triton_fp8` through `wrap_triton`, so a trace keeps it one operator
whose bytes are its arguments' and its output's (`gift_compile.kernels.traffic`), whatever the
installed Inductor would fuse; an explicit fake gives its output's shape without launching it
(what lets Dynamo trace it under Triton's interpreter). Inputs are checked, with errors naming
the operator and the argument.

The scaling (`"tensor"`, `"row"`, `"block"`) is an argument, as the format and block are: the
scales' shapes follow from it (`[1]`, `[rows]`, `[rows, nblocks]` per sender).

`lowrank_fp8_scales` and `lowrank_fp8_encode` are GIFT's fused sender for the fp8 formats
(`gift_compile.kernels.fused_sender`): `fp8_scales` and `fp8_encode` of the low-rank map's
expansion, each tile of which they compute as `ops.lowrank_expand` does, so the mapped gradient
is never written.
"""

from __future__ import annotations

import torch
import triton
from torch.library import triton_op, wrap_triton

from gift_compile.codec.layout import Scaling
from gift_compile.codec.spec import FormatSpec
from gift_compile.kernels import triton_fp8 as k
from gift_compile.kernels.formats import Fp8KernelFormat, _next_pow2, fp8_kernel_format
from gift_compile.kernels.ops import (_EXPAND_TILE, ELEMENTS_PER_PROGRAM, _check, _check_map_operands,
                                      _check_payload_cols, _check_precision, _check_receiver_map, _check_shape,
                                      _rank_tile, _rows_per_sender)

__all__ = ["fp8_decode", "fp8_encode", "fp8_scale_encode", "fp8_scales", "lowrank_fp8_decode_expand",
           "lowrank_fp8_encode", "lowrank_fp8_reason", "lowrank_fp8_scales"]


def _format(op: str, fmt: str, scaling: str, block_size: int) -> tuple[FormatSpec, Fp8KernelFormat]:
    """The spec and kernel constants of an operator's format arguments; ValueError naming the
    operator where they name no fp8 format the kernels serve."""
    try:
        spec = FormatSpec(fmt, scaling, block_size)
        return spec, fp8_kernel_format(spec)
    except ValueError as exc:
        raise ValueError(f"gift_kernels.{op}: {exc}") from None


def _scale_shape(spec: FormatSpec, rows: int, cols: int) -> tuple[int, ...]:
    """One sender's scales: `[1]` per tensor, `[rows]` per row, `[rows, nblocks]` per block."""
    if spec.scaling is Scaling.TENSOR:
        return (1,)
    if spec.scaling is Scaling.ROW:
        return (rows,)
    return (rows, spec.padded_cols(cols) // spec.block)


def _nblocks(spec: FormatSpec, cols: int) -> int:
    """Scale blocks per row with block scaling (the kernels' scale index), 1 otherwise (unused)."""
    return spec.padded_cols(cols) // spec.block if spec.block else 1


def _tile(n: int) -> int:
    """Columns per program: `ELEMENTS_PER_PROGRAM`, or the row's width (a power of two) if less."""
    return min(_next_pow2(max(n, 1)), ELEMENTS_PER_PROGRAM)


@triton_op("gift_kernels::fp8_scales", mutates_args=())
def fp8_scales(x: torch.Tensor, fmt: str, scaling: str, block_size: int) -> torch.Tensor:
    """fp32 scales of `x` (`[rows, cols]`) as `codec.choose_scales` chooses them: per row
    (`[rows]`) or per block (`[rows, nblocks]`), +inf for a group holding NaN/Inf. For
    `scaling="tensor"`: the rows' amax statistics (`[rows]`, +inf marker), whose maximum
    `Float8.scales_of` turns into the one scale (the exact two-pass max)."""
    spec, f = _format("fp8_scales", fmt, scaling, block_size)
    _check("fp8_scales", "x", x, torch.float32, 2)
    rows, cols = x.shape
    block = spec.scaling is Scaling.BLOCK
    out = torch.empty((rows, spec.padded_cols(cols) // f.block) if block else (rows,), dtype=torch.float32,
                      device=x.device)
    if not out.numel():
        return out
    if block:
        nb = out.shape[1]
        bp2 = _next_pow2(f.block)
        tile = min(_next_pow2(nb), max(1, ELEMENTS_PER_PROGRAM // bp2))
        wrap_triton(k.fp8_block_scale_kernel)[(rows, triton.cdiv(nb, tile))](
            x, out, cols, nb, x.stride(0), MAX_EXP=f.max_exp, MAX_MANT=f.max_mant, BLOCK=f.block, BLOCK_P2=bp2,
            TILE=tile)
    else:
        chunk = _tile(cols)
        wrap_triton(k.fp8_row_scale_kernel)[(rows,)](
            x, out, cols, x.stride(0), MAX_EXP=f.max_exp, MAX_MANT=f.max_mant,
            AMAX_ONLY=spec.scaling is Scaling.TENSOR, CHUNK=chunk, STEPS=triton.cdiv(cols, chunk))
    return out


@fp8_scales.register_fake
def _fp8_scales_fake(x: torch.Tensor, fmt: str, scaling: str, block_size: int) -> torch.Tensor:
    spec, _ = _format("fp8_scales", fmt, scaling, block_size)
    shape = _scale_shape(spec, x.shape[0], x.shape[1])
    return x.new_empty((x.shape[0],) if spec.scaling is Scaling.TENSOR else shape, dtype=torch.float32)


@triton_op("gift_kernels::fp8_scale_encode", mutates_args=())
def fp8_scale_encode(x: torch.Tensor, fmt: str, scaling: str, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(codes, scales)` of `x` (`[rows, cols]` fp32) with row or block scaling in one kernel
    (one read of `x`): `fp8_scales`'s scales and the bytes `fp8_encode` writes under them.
    A per-tensor scale needs the whole tensor first: `fp8_scales`, then `fp8_encode`."""
    spec, f = _format("fp8_scale_encode", fmt, scaling, block_size)
    if spec.scaling is Scaling.TENSOR:
        raise ValueError("gift_kernels.fp8_scale_encode: scaling='tensor' needs the whole tensor's amax before the "
                         "first code; use fp8_scales, their maximum, then fp8_encode")
    _check("fp8_scale_encode", "x", x, torch.float32, 2)
    rows, cols = x.shape
    cp = spec.padded_cols(cols)
    codes = torch.empty((rows, cp), dtype=torch.uint8, device=x.device)
    scales = torch.empty(_scale_shape(spec, rows, cols), dtype=torch.float32, device=x.device)
    if not scales.numel():
        return codes, scales
    elements = dict(MAX_EXP=f.max_exp, MAX_MANT=f.max_mant, MBITS=f.mbits, EMIN=f.emin, FMAX=f.fmax)
    if spec.scaling is Scaling.BLOCK:
        nb = scales.shape[1]
        bp2 = _next_pow2(f.block)
        tile = min(_next_pow2(nb), max(1, ELEMENTS_PER_PROGRAM // bp2))
        wrap_triton(k.fp8_block_scale_encode_kernel)[(rows, triton.cdiv(nb, tile))](
            x, scales, codes, cols, nb, x.stride(0), **elements, BLOCK=f.block, BLOCK_P2=bp2, TILE=tile)
    else:
        chunk = _tile(cols)
        wrap_triton(k.fp8_row_scale_encode_kernel)[(rows,)](
            x, scales, codes, cols, x.stride(0), **elements, CHUNK=chunk, STEPS=triton.cdiv(cols, chunk))
    return codes, scales


@fp8_scale_encode.register_fake
def _fp8_scale_encode_fake(x: torch.Tensor, fmt: str, scaling: str,
                           block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    spec, _ = _format("fp8_scale_encode", fmt, scaling, block_size)
    rows, cols = x.shape
    return (x.new_empty((rows, spec.padded_cols(cols)), dtype=torch.uint8),
            x.new_empty(_scale_shape(spec, rows, cols), dtype=torch.float32))


@triton_op("gift_kernels::fp8_encode", mutates_args=())
def fp8_encode(x: torch.Tensor, scales: torch.Tensor, fmt: str, scaling: str, block_size: int) -> torch.Tensor:
    """Float8 bytes (uint8 `[rows, padded cols]`) of `x` (`[rows, cols]` fp32) under the fp32
    `scales` (`[1]`, `[rows]` or `[rows, nblocks]` for tensor, row, block scaling): the bytes
    `codec.encode` writes, round to nearest."""
    spec, f = _format("fp8_encode", fmt, scaling, block_size)
    _check("fp8_encode", "x", x, torch.float32, 2)
    rows, cols = x.shape
    want = _scale_shape(spec, rows, cols)
    _check("fp8_encode", "scales", scales, torch.float32, len(want))
    _check_shape("fp8_encode", "scales", scales, want)
    cp = spec.padded_cols(cols)
    out = torch.empty((rows, cp), dtype=torch.uint8, device=x.device)
    if out.numel():
        tile = _tile(cp)
        wrap_triton(k.fp8_encode_kernel)[(rows, triton.cdiv(cp, tile))](
            x, scales.contiguous(), out, cols, cp, _nblocks(spec, cols), x.stride(0), SCALING=f.scaling,
            BLOCK=max(f.block, 1), MBITS=f.mbits, EMIN=f.emin, FMAX=f.fmax, TILE=tile)
    return out


@fp8_encode.register_fake
def _fp8_encode_fake(x: torch.Tensor, scales: torch.Tensor, fmt: str, scaling: str, block_size: int) -> torch.Tensor:
    spec, _ = _format("fp8_encode", fmt, scaling, block_size)
    return x.new_empty((x.shape[0], spec.padded_cols(x.shape[1])), dtype=torch.uint8)


@triton_op("gift_kernels::fp8_decode", mutates_args=())
def fp8_decode(payload: torch.Tensor, scales: torch.Tensor, fmt: str, scaling: str, block_size: int, cols: int,
               reduce: bool, average: bool) -> torch.Tensor:
    """fp32 values of every sender's payload (`[senders, rows, padded cols]` uint8) with its
    scales (`[senders]`, `[senders, rows]` or `[senders, rows, nblocks]` for tensor, row, block
    scaling): their sum in rank order `[rows, cols]` with `reduce` (each divided by the number of
    senders with `average`), else `[senders, rows, cols]`; `codec.decode` (and its `.sum(0)`)
    bit for bit."""
    spec, f = _format("fp8_decode", fmt, scaling, block_size)
    _check("fp8_decode", "payload", payload, torch.uint8, 3)
    senders, rows, pcols = payload.shape
    _check_payload_cols("fp8_decode", pcols, spec, cols, f"format {fmt!r} with {scaling} scaling")
    one = _scale_shape(spec, rows, cols)
    want = (senders,) if spec.scaling is Scaling.TENSOR else (senders, *one)
    _check("fp8_decode", "scales", scales, torch.float32, len(want))
    _check_shape("fp8_decode", "scales", scales, want)
    if senders < 1:
        raise ValueError("gift_kernels.fp8_decode: payload has no sender (dim 0 is 0)")
    if average and not reduce:
        raise ValueError("gift_kernels.fp8_decode: average=True needs reduce=True (it divides the sum)")
    out = torch.empty((rows, cols) if reduce else (senders, rows, cols), dtype=torch.float32, device=payload.device)
    if out.numel():
        tile = _tile(cols)
        wrap_triton(k.fp8_decode_kernel)[(rows, triton.cdiv(cols, tile))](
            payload.contiguous(), scales.contiguous(), out, rows, cols, pcols, _nblocks(spec, cols), SENDERS=senders,
            SCALING=f.scaling, BLOCK=max(f.block, 1), MBITS=f.mbits, EMIN=f.emin, IEEE_SPECIALS=f.ieee_specials,
            TILE=tile, SUM=reduce, AVERAGE=average)
    return out


@fp8_decode.register_fake
def _fp8_decode_fake(payload: torch.Tensor, scales: torch.Tensor, fmt: str, scaling: str, block_size: int, cols: int,
                     reduce: bool, average: bool) -> torch.Tensor:
    senders, rows, _ = payload.shape
    return payload.new_empty((rows, cols) if reduce else (senders, rows, cols), dtype=torch.float32)


def lowrank_fp8_reason(spec: FormatSpec) -> str | None:
    """Why the fused fp8 sender ops (`lowrank_fp8_scales`, `lowrank_fp8_encode`) cannot serve an
    fp8 format spec, or None where they can: per tensor and per row always (a row's tiles are
    walked by one program); per block where the block divides the expansion tile's 128
    columns, so a tile holds whole blocks. A static property of the spec, never of the data."""
    bn = _EXPAND_TILE[1]
    if spec.scaling is Scaling.BLOCK and bn % spec.block:
        return f"{spec.name} block {spec.block} does not divide the fused tile's {bn} columns"
    return None


def _fused_format(op: str, fmt: str, scaling: str, block_size: int, precision: str) -> tuple[FormatSpec,
                                                                                             Fp8KernelFormat]:
    """The spec and kernel constants of a fused fp8 operator's arguments; ValueError naming the
    operator where the format, the precision or the block cannot be served."""
    _check_precision(op, precision)
    spec, f = _format(op, fmt, scaling, block_size)
    reason = lowrank_fp8_reason(spec)
    if reason is not None:
        raise ValueError(f"gift_kernels.{op}: {reason} (use lowrank_expand, then fp8_scales / fp8_encode)")
    return spec, f


@triton_op("gift_kernels::lowrank_fp8_scales", mutates_args=())
def lowrank_fp8_scales(g: torch.Tensor, p: torch.Tensor, dinv: torch.Tensor, coef: torch.Tensor, basis: torch.Tensor,
                       dsq: torch.Tensor, precision: str, fmt: str, scaling: str, block_size: int) -> torch.Tensor:
    """`fp8_scales(lowrank_expand(g, p, dinv, coef, basis, dsq, precision), fmt, scaling,
    block_size)` without writing the expansion: per row `[rows]` scales, per block
    `[rows, nblocks]`, per tensor the rows' amax statistics `[rows]` (+inf for a group holding
    NaN/Inf). A program covers 64 rows: with row scaling (and per tensor) it walks their column
    tiles, with block scaling one tile."""
    op = "lowrank_fp8_scales"
    spec, f = _fused_format(op, fmt, scaling, block_size, precision)
    basis = basis.contiguous()
    _check_map_operands(op, g, p, dinv, coef, basis, dsq)
    rows, cols = g.shape
    rank = basis.shape[1]
    block = spec.scaling is Scaling.BLOCK
    out = torch.empty((rows, spec.padded_cols(cols) // f.block) if block else (rows,), dtype=torch.float32,
                      device=g.device)
    if not out.numel():
        return out
    bm, bn = _EXPAND_TILE
    operands = (g.contiguous(), p.contiguous(), dinv, coef, basis, dsq, out, rows, cols, rank)
    tiles = dict(BM=bm, BN=bn, BR=_rank_tile(rank), PRECISION=precision)
    if block:
        wrap_triton(k.lowrank_fp8_block_scale_kernel)[(triton.cdiv(rows, bm), triton.cdiv(cols, bn))](
            *operands, out.shape[1], MAX_EXP=f.max_exp, MAX_MANT=f.max_mant, BLOCK=f.block, **tiles)
    else:
        wrap_triton(k.lowrank_fp8_row_scale_kernel)[(triton.cdiv(rows, bm),)](
            *operands, MAX_EXP=f.max_exp, MAX_MANT=f.max_mant, AMAX_ONLY=spec.scaling is Scaling.TENSOR,
            STEPS=triton.cdiv(cols, bn), **tiles)
    return out


@lowrank_fp8_scales.register_fake
def _lowrank_fp8_scales_fake(g: torch.Tensor, p: torch.Tensor, dinv: torch.Tensor, coef: torch.Tensor,
                             basis: torch.Tensor, dsq: torch.Tensor, precision: str, fmt: str, scaling: str,
                             block_size: int) -> torch.Tensor:
    spec, _ = _format("lowrank_fp8_scales", fmt, scaling, block_size)
    shape = _scale_shape(spec, g.shape[0], g.shape[1])
    return g.new_empty((g.shape[0],) if spec.scaling is Scaling.TENSOR else shape, dtype=torch.float32)


@triton_op("gift_kernels::lowrank_fp8_encode", mutates_args=())
def lowrank_fp8_encode(g: torch.Tensor, p: torch.Tensor, dinv: torch.Tensor, coef: torch.Tensor, basis: torch.Tensor,
                       dsq: torch.Tensor, scales: torch.Tensor, precision: str, fmt: str, scaling: str,
                       block_size: int) -> torch.Tensor:
    """`fp8_encode(lowrank_expand(g, p, dinv, coef, basis, dsq, precision), scales, fmt,
    scaling, block_size)` without writing the expansion: each `[64, 128]` tile of it computed
    and encoded in one program (uint8 `[rows, padded cols]`)."""
    op = "lowrank_fp8_encode"
    spec, f = _fused_format(op, fmt, scaling, block_size, precision)
    basis = basis.contiguous()
    _check_map_operands(op, g, p, dinv, coef, basis, dsq)
    rows, cols = g.shape
    want = _scale_shape(spec, rows, cols)
    _check(op, "scales", scales, torch.float32, len(want))
    _check_shape(op, "scales", scales, want)
    cp = spec.padded_cols(cols)
    out = torch.empty((rows, cp), dtype=torch.uint8, device=g.device)
    if out.numel():
        bm, bn = _EXPAND_TILE
        rank = basis.shape[1]
        wrap_triton(k.lowrank_fp8_encode_kernel)[(triton.cdiv(rows, bm), triton.cdiv(cp, bn))](
            g.contiguous(), p.contiguous(), dinv, coef, basis, dsq, scales.contiguous(), out, rows, cols, rank, cp,
            _nblocks(spec, cols), SCALING=f.scaling, BLOCK=max(f.block, 1), MBITS=f.mbits, EMIN=f.emin, FMAX=f.fmax,
            BM=bm, BN=bn, BR=_rank_tile(rank), PRECISION=precision)
    return out


@lowrank_fp8_encode.register_fake
def _lowrank_fp8_encode_fake(g: torch.Tensor, p: torch.Tensor, dinv: torch.Tensor, coef: torch.Tensor,
                             basis: torch.Tensor, dsq: torch.Tensor, scales: torch.Tensor, precision: str, fmt: str,
                             scaling: str, block_size: int) -> torch.Tensor:
    spec, _ = _format("lowrank_fp8_encode", fmt, scaling, block_size)
    return g.new_empty((g.shape[0], spec.padded_cols(g.shape[1])), dtype=torch.uint8)


@triton_op("gift_kernels::lowrank_fp8_decode_expand", mutates_args=())
def lowrank_fp8_decode_expand(payload: torch.Tensor, scales: torch.Tensor, p: torch.Tensor, dinv: torch.Tensor,
                              coef: torch.Tensor, basis: torch.Tensor, dsq: torch.Tensor, precision: str, fmt: str,
                              scaling: str, block_size: int, cols: int) -> torch.Tensor:
    """`lowrank_expand(fp8_decode(payload, ...), p, dinv, coef, basis, dsq, precision)` without
    reading the decoded values back: each `[64, 128]` tile of the gathered bytes decoded as
    `fp8_decode` decodes it and expanded as `lowrank_expand` expands it (fp32 `[rows, cols]`).
    `payload` (uint8 `[rows, padded cols]`) holds every sender's shard of `rows / senders` rows
    one after another; `scales` are fp32, one per sender (`[senders]`, tensor scaling), `[rows]`
    (row) or `[rows, nblocks]` (block): the all-reduce's gathered shards. Every fp8 spec the
    kernels serve (a value's scale is looked up per element, so any block size)."""
    op = "lowrank_fp8_decode_expand"
    _check_precision(op, precision)
    spec, f = _format(op, fmt, scaling, block_size)
    basis = basis.contiguous()
    _check(op, "payload", payload, torch.uint8, 2)
    rows, pcols = payload.shape
    _check_payload_cols(op, pcols, spec, cols, f"format {fmt!r} with {scaling} scaling")
    if spec.scaling is Scaling.TENSOR:
        _check(op, "scales", scales, torch.float32, 1)
        rps = _rows_per_sender(op, rows, scales.shape[0])
    else:
        want = _scale_shape(spec, rows, cols)
        _check(op, "scales", scales, torch.float32, len(want))
        _check_shape(op, "scales", scales, want)
        rps = max(rows, 1)  # read by tensor scaling only (the kernel's group of a row)
    _check_receiver_map(op, rows, cols, p, dinv, coef, basis, dsq)
    out = torch.empty((rows, cols), dtype=torch.float32, device=payload.device)
    if out.numel():
        bm, bn = _EXPAND_TILE
        rank = basis.shape[1]
        wrap_triton(k.lowrank_fp8_decode_expand_kernel)[(triton.cdiv(rows, bm), triton.cdiv(cols, bn))](
            payload.contiguous(), scales.contiguous(), p.contiguous(), dinv, coef, basis, dsq, out, rows, cols, rank,
            pcols, _nblocks(spec, cols), rps, SCALING=f.scaling, BLOCK=max(f.block, 1), MBITS=f.mbits, EMIN=f.emin,
            IEEE_SPECIALS=f.ieee_specials, BM=bm, BN=bn, BR=_rank_tile(rank), PRECISION=precision)
    return out


@lowrank_fp8_decode_expand.register_fake
def _lowrank_fp8_decode_expand_fake(payload: torch.Tensor, scales: torch.Tensor, p: torch.Tensor,
                                    dinv: torch.Tensor, coef: torch.Tensor, basis: torch.Tensor, dsq: torch.Tensor,
                                    precision: str, fmt: str, scaling: str, block_size: int,
                                    cols: int) -> torch.Tensor:
    return payload.new_empty((payload.shape[0], cols), dtype=torch.float32)
