"""The codec kernels as registered operators: `torch.ops.gift_kernels.*`.

Each operator is a `torch.library.triton_op` whose body allocates its outputs and launches one
kernel of `gift_compile.kernels.triton_codec` through `wrap_triton`. That registration is what
keeps a kernel a kernel under compilation: Dynamo records the operator as one node, AOTAutograd
decomposes it into Triton's kernel-call higher-order op (so Inductor schedules the user kernel
as written, with no fusion decision of its own that a release could undo), and `make_fx` (the
FX pass's splice, `passes.inductor_internals.splice`) records the operator node itself, which Inductor
then calls. The bytes a kernel moves are therefore those of its loads and stores
(`gift_compile.kernels.traffic` counts them from the same shapes).

Each operator also has an explicit fake (shape) implementation: its outputs' shapes and dtypes
without launching anything. Under Triton's interpreter (`TRITON_INTERPRET=1`, the CPU tests),
`wrap_triton` hands back the plain interpreted function, which cannot run on fake tensors; the
explicit fake is what lets Dynamo trace the operators there too.

Inputs are checked (dtype, rank, shape, unit column stride) with errors naming the operator and
the argument; the kernels themselves assume them.
"""

from __future__ import annotations

import torch
import triton
from torch.library import triton_op, wrap_triton

from gift_compile.codec.spec import FormatSpec
from gift_compile.kernels import triton_codec as k
from gift_compile.kernels.formats import KERNEL_FORMATS, KernelFormat, _next_pow2, kernel_format

__all__ = ["MAP_PRECISIONS", "block_stat", "decode", "encode", "fused_reason", "lowrank_block_stat",
           "lowrank_decode_expand", "lowrank_encode", "lowrank_expand", "lowrank_project", "scale_codes"]

# Elements one program covers (a power of two): large enough that a program's loads are long
# contiguous runs, small enough that a 600M-sized gradient still gives thousands of programs.
ELEMENTS_PER_PROGRAM = 1024


def _format(fmt: str, block_size: int) -> KernelFormat:
    return kernel_format(FormatSpec(fmt, block_size=block_size))


def _check(op: str, name: str, t: torch.Tensor, dtype: torch.dtype, dim: int) -> None:
    if t.dtype != dtype or t.dim() != dim:
        raise ValueError(f"gift_kernels.{op}: {name} must be {dtype} with {dim} dims, got {t.dtype} {tuple(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"gift_kernels.{op}: {name} needs unit stride along its last dim, got strides {t.stride()}")


def _check_shape(op: str, name: str, t: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(t.shape) != want:
        raise ValueError(f"gift_kernels.{op}: {name} has shape {tuple(t.shape)}, expected {want}")


def _check_payload_cols(op: str, pcols: int, spec: FormatSpec, cols: int, what: str) -> None:
    """A received payload's bytes per row against what `cols` columns take in `spec` (`what`:
    the format as the error names it)."""
    if pcols != spec.payload_cols(cols):
        raise ValueError(f"gift_kernels.{op}: payload has {pcols} bytes per row, but cols={cols} needs "
                         f"{spec.payload_cols(cols)} in {what}")


def _check_block_codes(op: str, scales: torch.Tensor, tensor_scale: torch.Tensor, rows: int, nblocks: int) -> None:
    """The two-level scales an encoder takes: E4M3 block codes `[rows, nblocks]` and one fp32
    tensor scale `[1]`."""
    _check(op, "scales", scales, torch.uint8, 2)
    _check(op, "tensor_scale", tensor_scale, torch.float32, 1)
    _check_shape(op, "scales", scales, (rows, nblocks))
    _check_shape(op, "tensor_scale", tensor_scale, (1,))


def _word_tile(f: KernelFormat, nwords: int) -> int:
    """Packed words per program: about `ELEMENTS_PER_PROGRAM` digits, at most the row's words."""
    return min(_next_pow2(max(nwords, 1)), max(1, ELEMENTS_PER_PROGRAM // f.per_p2))


def _nblocks(f: KernelFormat, cols: int) -> int:
    return -(-cols // f.block)


def _nwords(f: KernelFormat, cols: int) -> int:
    """Packed words of a row of `cols` columns (padded to whole blocks, then to whole words)."""
    return -(-(_nblocks(f, cols) * f.block) // f.per)


@triton_op("gift_kernels::block_stat", mutates_args=())
def block_stat(x: torch.Tensor, fmt: str, block_size: int) -> torch.Tensor:
    """Block statistics of `x` (`[rows, cols]` fp32): fp32 `[rows, nblocks]`, the values
    `codec.choose_scales` reduces (amax or the mean-|x| step; +inf for a non-finite block)."""
    f = _format(fmt, block_size)
    _check("block_stat", "x", x, torch.float32, 2)
    rows, cols = x.shape
    nb = _nblocks(f, cols)
    stat = torch.empty((rows, nb), dtype=torch.float32, device=x.device)
    if stat.numel():
        tile = min(_next_pow2(nb), max(1, ELEMENTS_PER_PROGRAM // f.block))
        wrap_triton(k.block_stat_kernel)[(rows, triton.cdiv(nb, tile))](
            x, stat, cols, nb, x.stride(0), STEP=f.mean_abs_step or 0.0,
            MEAN_ABS=f.mean_abs_step is not None, BLOCK=f.block, TILE=tile)
    return stat


@block_stat.register_fake
def _block_stat_fake(x: torch.Tensor, fmt: str, block_size: int) -> torch.Tensor:
    f = _format(fmt, block_size)
    return x.new_empty((x.shape[0], _nblocks(f, x.shape[1])), dtype=torch.float32)


@triton_op("gift_kernels::scale_codes", mutates_args=())
def scale_codes(stat: torch.Tensor, tensor_scale: torch.Tensor, fmt: str, block_size: int) -> torch.Tensor:
    """E4M3 block-scale codes (uint8, `stat`'s shape) of the block statistics `stat` under the
    fp32 tensor scale `tensor_scale` (`[1]`, `codec.scales._tensor_scale` of their maximum)."""
    f = _format(fmt, block_size)
    _check("scale_codes", "stat", stat, torch.float32, 2)
    _check("scale_codes", "tensor_scale", tensor_scale, torch.float32, 1)
    _check_shape("scale_codes", "tensor_scale", tensor_scale, (1,))
    codes = torch.empty(stat.shape, dtype=torch.uint8, device=stat.device)
    n = stat.numel()
    if n:
        tile = min(_next_pow2(n), ELEMENTS_PER_PROGRAM)
        wrap_triton(k.scale_code_kernel)[(triton.cdiv(n, tile),)](
            stat.contiguous(), tensor_scale, codes, n, INV_LEVEL=f.inv_level, TILE=tile)
    return codes


@scale_codes.register_fake
def _scale_codes_fake(stat: torch.Tensor, tensor_scale: torch.Tensor, fmt: str, block_size: int) -> torch.Tensor:
    return stat.new_empty(stat.shape, dtype=torch.uint8)


@triton_op("gift_kernels::encode", mutates_args=())
def encode(x: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor, fmt: str,
           block_size: int) -> torch.Tensor:
    """Packed codes (uint8 `[rows, payload_cols]`) of `x` (`[rows, cols]` fp32) on the grid of
    the E4M3 block codes `scales` (`[rows, nblocks]`) and the fp32 tensor scale (`[1]`): the
    bytes `codec.encode` writes, round to nearest."""
    f = _format(fmt, block_size)
    spec = FormatSpec(fmt, block_size=block_size)
    _check("encode", "x", x, torch.float32, 2)
    rows, cols = x.shape
    nb = _nblocks(f, cols)
    _check_block_codes("encode", scales, tensor_scale, rows, nb)
    pcols = spec.payload_cols(cols)
    out = torch.empty((rows, pcols), dtype=torch.uint8, device=x.device)
    nwords = _nwords(f, cols)
    if out.numel():
        tile = _word_tile(f, nwords)
        wrap_triton(k.encode_kernel)[(rows, triton.cdiv(nwords, tile))](
            x, scales.contiguous(), tensor_scale, out, cols, nb * f.block, nb, nwords, pcols, x.stride(0),
            KIND=f.kind, BITS=f.bits, PER=f.per, PER_P2=f.per_p2, NBYTES=f.nbytes, IMAX=f.imax, BLOCK=f.block,
            TILE=tile)
    return out


@encode.register_fake
def _encode_fake(x: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor, fmt: str,
                 block_size: int) -> torch.Tensor:
    spec = FormatSpec(fmt, block_size=block_size)
    return x.new_empty((x.shape[0], spec.payload_cols(x.shape[1])), dtype=torch.uint8)


@triton_op("gift_kernels::decode", mutates_args=())
def decode(payload: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor, fmt: str, block_size: int,
           cols: int, reduce: bool, average: bool) -> torch.Tensor:
    """fp32 values of every sender's payload (`[senders, rows, payload_cols]` uint8) with its
    block codes (`[senders, rows, nblocks]`) and tensor scale (`[senders]`): their sum in rank
    order `[rows, cols]` with `reduce` (each value divided by the number of senders with `average`), else
    `[senders, rows, cols]`; `codec.decode` (and its `.sum(0)`) bit for bit."""
    f = _format(fmt, block_size)
    spec = FormatSpec(fmt, block_size=block_size)
    _check("decode", "payload", payload, torch.uint8, 3)
    _check("decode", "scales", scales, torch.uint8, 3)
    _check("decode", "tensor_scale", tensor_scale, torch.float32, 1)
    senders, rows, pcols = payload.shape
    nb = _nblocks(f, cols)
    _check_payload_cols("decode", pcols, spec, cols, f"format {fmt!r}")
    _check_shape("decode", "scales", scales, (senders, rows, nb))
    _check_shape("decode", "tensor_scale", tensor_scale, (senders,))
    if senders < 1:
        raise ValueError("gift_kernels.decode: payload has no sender (dim 0 is 0)")
    if average and not reduce:
        raise ValueError("gift_kernels.decode: average=True needs reduce=True (it divides the sum)")
    out = torch.empty((rows, cols) if reduce else (senders, rows, cols), dtype=torch.float32, device=payload.device)
    nwords = _nwords(f, cols)
    if out.numel():
        tile = _word_tile(f, nwords)
        wrap_triton(k.decode_kernel)[(rows, triton.cdiv(nwords, tile))](
            payload.contiguous(), scales.contiguous(), tensor_scale.contiguous(), out, rows, cols, nb, nwords,
            pcols, SENDERS=senders, KIND=f.kind, BITS=f.bits, PER=f.per, PER_P2=f.per_p2, NBYTES=f.nbytes,
            BLOCK=f.block, TILE=tile, SUM=reduce, AVERAGE=average)
    return out


@decode.register_fake
def _decode_fake(payload: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor, fmt: str, block_size: int,
                 cols: int, reduce: bool, average: bool) -> torch.Tensor:
    senders, rows, _ = payload.shape
    return payload.new_empty((rows, cols) if reduce else (senders, rows, cols), dtype=torch.float32)


# The operand precisions of the low-rank map's matmuls (`triton_codec._mma`): fp32 operands
# ("ieee": no tensor cores; the interpreter tests and the rounding-free reference), TF32 or bf16
# operands on the tensor cores, fp32 accumulation in all three.
MAP_PRECISIONS = ("ieee", "tf32", "bf16")
# the projection's tile: 32 rows (tl.dot's M is at least 16) walked over the columns 128 at a time
_PROJECT_TILE = (32, 128)
# the expansion's tile: 64 rows x 128 columns, the rank (<= 128 in practice) whole in each tile
_EXPAND_TILE = (64, 128)


def _check_precision(op: str, precision: str) -> None:
    if precision not in MAP_PRECISIONS:
        raise ValueError(f"gift_kernels.{op}: precision={precision!r}; allowed: {', '.join(MAP_PRECISIONS)}")


def _rank_tile(rank: int) -> int:
    """The rank padded for tl.dot: a power of two, at least 16."""
    return max(16, _next_pow2(rank))


@triton_op("gift_kernels::lowrank_project", mutates_args=())
def lowrank_project(g: torch.Tensor, basis: torch.Tensor, precision: str) -> torch.Tensor:
    """`g @ basis` (fp32 `[rows, rank]`) for `g` `[rows, cols]` and `basis` `[cols, rank]`: the
    low-rank map's projection (`LowRank`: `basis` is `U` forward, `V` inverse) on the
    tensor cores with fp32 accumulation and `precision` operands, summed in one fixed order
    (`triton_codec.lowrank_project_kernel`), so every rank gets the same bits whatever torch's
    matmul flags say."""
    _check_precision("lowrank_project", precision)
    basis = basis.contiguous()  # the map's `V` as a caller holds it (a QR factor is column-major)
    _check("lowrank_project", "g", g, torch.float32, 2)
    _check("lowrank_project", "basis", basis, torch.float32, 2)
    rows, cols = g.shape
    rank = basis.shape[1]
    _check_shape("lowrank_project", "basis", basis, (cols, rank))
    out = torch.empty((rows, rank), dtype=torch.float32, device=g.device)
    if out.numel():
        bm, bk = _PROJECT_TILE
        wrap_triton(k.lowrank_project_kernel)[(triton.cdiv(rows, bm),)](
            g.contiguous(), basis, out, rows, cols, rank, BM=bm, BK=bk, BR=_rank_tile(rank),
            STEPS=triton.cdiv(cols, bk), PRECISION=precision)
    return out


@lowrank_project.register_fake
def _lowrank_project_fake(g: torch.Tensor, basis: torch.Tensor, precision: str) -> torch.Tensor:
    return g.new_empty((g.shape[0], basis.shape[1]), dtype=torch.float32)


def _check_map_operands(op: str, g: torch.Tensor, p: torch.Tensor, dinv: torch.Tensor, coef: torch.Tensor,
                        basis: torch.Tensor, dsq: torch.Tensor) -> None:
    """The expansion's operands (`lowrank_expand` and the fused sender ops): fp32, contiguous
    along their last dim, shapes agreeing with `g` `[rows, cols]` and `basis` `[cols, rank]`."""
    for name, t, dim in (("g", g, 2), ("p", p, 2), ("dinv", dinv, 1), ("coef", coef, 1), ("basis", basis, 2),
                         ("dsq", dsq, 1)):
        _check(op, name, t, torch.float32, dim)
    rows, cols = g.shape
    rank = basis.shape[1]
    for name, t, want in (("p", p, (rows, rank)), ("dinv", dinv, (cols,)), ("coef", coef, (rank,)),
                          ("basis", basis, (cols, rank)), ("dsq", dsq, (cols,))):
        _check_shape(op, name, t, want)


@triton_op("gift_kernels::lowrank_expand", mutates_args=())
def lowrank_expand(g: torch.Tensor, p: torch.Tensor, dinv: torch.Tensor, coef: torch.Tensor, basis: torch.Tensor,
                   dsq: torch.Tensor, precision: str) -> torch.Tensor:
    """`g * dinv + ((p * coef) @ basis.T) * dsq` (fp32 `[rows, cols]`), the expansion of the
    low-rank map (`LowRank.apply_forward`: `p = g @ basis` its projection, `coef` the `C` of
    `(I+S^2)^{-1/2} - I`, `basis` `U` `[cols, rank]`; `apply_inverse`: `dinv = dsq = D^{1/2}`,
    `coef` the `C'`, `basis` `V`), with the rank-r product as a tensor-core matmul accumulating in fp32
    with `precision` operands. Not bitwise the reference's fixed-order chain of multiply-adds:
    a preconditioner's rounding (`python -m bench.fidelity.map_precision` measures what it does to the
    codec's error)."""
    _check_precision("lowrank_expand", precision)
    basis = basis.contiguous()
    _check_map_operands("lowrank_expand", g, p, dinv, coef, basis, dsq)
    rows, cols = g.shape
    out = torch.empty_like(g, memory_format=torch.contiguous_format)
    if out.numel():
        bm, bn = _EXPAND_TILE
        wrap_triton(k.lowrank_expand_kernel)[(triton.cdiv(rows, bm), triton.cdiv(cols, bn))](
            g.contiguous(), p.contiguous(), dinv, coef, basis, dsq, out, rows, cols, basis.shape[1], BM=bm, BN=bn,
            BR=_rank_tile(basis.shape[1]), PRECISION=precision)
    return out


@lowrank_expand.register_fake
def _lowrank_expand_fake(g: torch.Tensor, p: torch.Tensor, dinv: torch.Tensor, coef: torch.Tensor,
                         basis: torch.Tensor, dsq: torch.Tensor, precision: str) -> torch.Tensor:
    return torch.empty_like(g, memory_format=torch.contiguous_format)


def fused_reason(fmt: str, block_size: int) -> str | None:
    """Why the fused sender ops (`lowrank_block_stat`, `lowrank_encode`) and the fused receiver
    op (`lowrank_decode_expand`) cannot serve a kernel format, or None where they can. Their
    tile is the expansion's `[64, 128]`: its 128 columns must hold whole scale blocks and whole
    packed words, i.e. the block divides 128 and a word's digit count is a power of two
    (1/2/4-bit codes in a byte, 3/6-bit ones in a 3-byte group). Ternary's 5 digits per byte
    straddle tiles, so ternary keeps the unfused chain; a static property of the format, never
    of the data. The fp8 formats' fused sender ops are `ops_fp8.lowrank_fp8_scales` and
    `lowrank_fp8_encode` (`ops_fp8.lowrank_fp8_reason`)."""
    if fmt not in KERNEL_FORMATS:
        return (f"{fmt} has no two-level fused sender kernels (they exist for {', '.join(KERNEL_FORMATS)}; the fp8 "
                "formats' are ops_fp8's)")
    f = _format(fmt, block_size)
    bn = _EXPAND_TILE[1]
    if bn % f.block:
        return f"{fmt} block {f.block} does not divide the fused tile's {bn} columns"
    if f.per != f.per_p2 or bn % f.per:
        return f"{fmt} packs {f.per} codes per word, which does not divide the fused tile's {bn} columns"
    return None


def _check_fused(op: str, fmt: str, block_size: int) -> KernelFormat:
    reason = fused_reason(fmt, block_size)
    if reason is not None:
        raise ValueError(f"gift_kernels.{op}: {reason} (use the unfused chain: lowrank_expand beside block_stat / "
                         "encode / decode)")
    return _format(fmt, block_size)


@triton_op("gift_kernels::lowrank_block_stat", mutates_args=())
def lowrank_block_stat(g: torch.Tensor, p: torch.Tensor, dinv: torch.Tensor, coef: torch.Tensor, basis: torch.Tensor,
                       dsq: torch.Tensor, precision: str, fmt: str, block_size: int) -> torch.Tensor:
    """`block_stat(lowrank_expand(g, p, dinv, coef, basis, dsq, precision), fmt, block_size)`
    without writing the expansion: each tile of it is computed as `lowrank_expand` computes it
    and reduced to its blocks' statistics in the same kernel (fp32 `[rows, nblocks]`). For the
    formats `fused_reason` admits."""
    _check_precision("lowrank_block_stat", precision)
    f = _check_fused("lowrank_block_stat", fmt, block_size)
    basis = basis.contiguous()
    _check_map_operands("lowrank_block_stat", g, p, dinv, coef, basis, dsq)
    rows, cols = g.shape
    nb = _nblocks(f, cols)
    stat = torch.empty((rows, nb), dtype=torch.float32, device=g.device)
    if stat.numel():
        bm, bn = _EXPAND_TILE
        wrap_triton(k.lowrank_block_stat_kernel)[(triton.cdiv(rows, bm), triton.cdiv(cols, bn))](
            g.contiguous(), p.contiguous(), dinv, coef, basis, dsq, stat, rows, cols, basis.shape[1], nb,
            STEP=f.mean_abs_step or 0.0, MEAN_ABS=f.mean_abs_step is not None, BLOCK=f.block, BM=bm, BN=bn,
            BR=_rank_tile(basis.shape[1]), PRECISION=precision)
    return stat


@lowrank_block_stat.register_fake
def _lowrank_block_stat_fake(g: torch.Tensor, p: torch.Tensor, dinv: torch.Tensor, coef: torch.Tensor,
                             basis: torch.Tensor, dsq: torch.Tensor, precision: str, fmt: str,
                             block_size: int) -> torch.Tensor:
    return g.new_empty((g.shape[0], _nblocks(_format(fmt, block_size), g.shape[1])), dtype=torch.float32)


@triton_op("gift_kernels::lowrank_encode", mutates_args=())
def lowrank_encode(g: torch.Tensor, p: torch.Tensor, dinv: torch.Tensor, coef: torch.Tensor, basis: torch.Tensor,
                   dsq: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor, precision: str, fmt: str,
                   block_size: int) -> torch.Tensor:
    """`encode(lowrank_expand(g, p, dinv, coef, basis, dsq, precision), scales, tensor_scale,
    fmt, block_size)` without writing the expansion: each tile of it is computed as
    `lowrank_expand` computes it and encoded and packed in the same kernel (uint8
    `[rows, payload_cols]`). For the formats `fused_reason` admits."""
    _check_precision("lowrank_encode", precision)
    f = _check_fused("lowrank_encode", fmt, block_size)
    spec = FormatSpec(fmt, block_size=block_size)
    basis = basis.contiguous()
    _check_map_operands("lowrank_encode", g, p, dinv, coef, basis, dsq)
    rows, cols = g.shape
    nb = _nblocks(f, cols)
    _check_block_codes("lowrank_encode", scales, tensor_scale, rows, nb)
    pcols = spec.payload_cols(cols)
    out = torch.empty((rows, pcols), dtype=torch.uint8, device=g.device)
    if out.numel():
        bm, bn = _EXPAND_TILE
        wrap_triton(k.lowrank_encode_kernel)[(triton.cdiv(rows, bm), triton.cdiv(nb * f.block, bn))](
            g.contiguous(), p.contiguous(), dinv, coef, basis, dsq, scales.contiguous(), tensor_scale, out, rows, cols,
            basis.shape[1], nb * f.block, nb, _nwords(f, cols), pcols, KIND=f.kind, BITS=f.bits, PER=f.per,
            NBYTES=f.nbytes, IMAX=f.imax, BLOCK=f.block, BM=bm, BN=bn, BR=_rank_tile(basis.shape[1]),
            PRECISION=precision)
    return out


@lowrank_encode.register_fake
def _lowrank_encode_fake(g: torch.Tensor, p: torch.Tensor, dinv: torch.Tensor, coef: torch.Tensor,
                         basis: torch.Tensor, dsq: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor,
                         precision: str, fmt: str, block_size: int) -> torch.Tensor:
    return g.new_empty((g.shape[0], FormatSpec(fmt, block_size=block_size).payload_cols(g.shape[1])),
                       dtype=torch.uint8)


def _check_receiver_map(op: str, rows: int, cols: int, p: torch.Tensor, dinv: torch.Tensor, coef: torch.Tensor,
                        basis: torch.Tensor, dsq: torch.Tensor) -> None:
    """The inverse map's operands of a receiver op (`lowrank_decode_expand` and its fp8 twin)
    for a `[rows, cols]` result: as `_check_map_operands` checks them beside a `g`."""
    for name, t, dim in (("p", p, 2), ("dinv", dinv, 1), ("coef", coef, 1), ("basis", basis, 2), ("dsq", dsq, 1)):
        _check(op, name, t, torch.float32, dim)
    rank = basis.shape[1]
    for name, t, want in (("p", p, (rows, rank)), ("dinv", dinv, (cols,)), ("coef", coef, (rank,)),
                          ("basis", basis, (cols, rank)), ("dsq", dsq, (cols,))):
        _check_shape(op, name, t, want)


def _rows_per_sender(op: str, rows: int, senders: int) -> int:
    """Rows of each sender's shard of a gathered payload: `rows` split evenly over `senders`."""
    if senders < 1 or rows % senders:
        raise ValueError(f"gift_kernels.{op}: {rows} payload rows do not split into {senders} senders' shards")
    return rows // senders


@triton_op("gift_kernels::lowrank_decode_expand", mutates_args=())
def lowrank_decode_expand(payload: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor, p: torch.Tensor,
                          dinv: torch.Tensor, coef: torch.Tensor, basis: torch.Tensor, dsq: torch.Tensor,
                          precision: str, fmt: str, block_size: int, cols: int) -> torch.Tensor:
    """`lowrank_expand(decode(payload, ...), p, dinv, coef, basis, dsq, precision)` without
    reading the decoded values back: each tile of the gathered codes is decoded as `decode`
    decodes it and expanded as `lowrank_expand` expands it (fp32 `[rows, cols]`). `payload`
    (uint8 `[rows, payload_cols]`) and `scales` (`[rows, nblocks]`) hold every sender's shard of
    `rows / senders` rows one after another, `tensor_scale` (fp32 `[senders]`) one per sender:
    the all-reduce's gathered shards. For the formats `fused_reason` admits."""
    op = "lowrank_decode_expand"
    _check_precision(op, precision)
    f = _check_fused(op, fmt, block_size)
    spec = FormatSpec(fmt, block_size=block_size)
    basis = basis.contiguous()
    _check(op, "payload", payload, torch.uint8, 2)
    _check(op, "scales", scales, torch.uint8, 2)
    _check(op, "tensor_scale", tensor_scale, torch.float32, 1)
    rows, pcols = payload.shape
    _check_payload_cols(op, pcols, spec, cols, f"format {fmt!r}")
    nb = _nblocks(f, cols)
    _check_shape(op, "scales", scales, (rows, nb))
    rps = _rows_per_sender(op, rows, tensor_scale.shape[0])
    _check_receiver_map(op, rows, cols, p, dinv, coef, basis, dsq)
    out = torch.empty((rows, cols), dtype=torch.float32, device=payload.device)
    if out.numel():
        bm, bn = _EXPAND_TILE
        rank = basis.shape[1]
        wrap_triton(k.lowrank_decode_expand_kernel)[(triton.cdiv(rows, bm), triton.cdiv(cols, bn))](
            payload.contiguous(), scales.contiguous(), tensor_scale.contiguous(), p.contiguous(), dinv, coef, basis,
            dsq, out, rows, cols, rank, nb, pcols, rps, KIND=f.kind, BITS=f.bits, PER=f.per, NBYTES=f.nbytes,
            BLOCK=f.block, BM=bm, BN=bn, BR=_rank_tile(rank), PRECISION=precision)
    return out


@lowrank_decode_expand.register_fake
def _lowrank_decode_expand_fake(payload: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor,
                                p: torch.Tensor, dinv: torch.Tensor, coef: torch.Tensor, basis: torch.Tensor,
                                dsq: torch.Tensor, precision: str, fmt: str, block_size: int,
                                cols: int) -> torch.Tensor:
    return payload.new_empty((payload.shape[0], cols), dtype=torch.float32)
