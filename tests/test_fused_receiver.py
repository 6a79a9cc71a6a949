"""GIFT's fused all-reduce receiver (gift_compile.kernels.fused_receiver): the inverse map's
expansion decodes the gathered codes itself instead of reading the decoded result back.

The receiver ops (`lowrank_decode_expand`; for the fp8 formats `lowrank_fp8_decode_expand`) are
compared bit for bit with the chain they replace (`decode`, then `lowrank_expand` of the decoded
values, with the same projection), on random gathered payloads: every code value, NaN block
codes (E4M3 0x7F / 0xFF) and non-finite fp8 scales, codes that decode to NaN or Inf, huge tensor
scales that saturate, several senders with their own tensor scales, widths that fill no whole
tile, word or block, and one row. On the CPU they run in Triton's interpreter
(tests/conftest.py), with "ieee" operands; with CUDA, compiled. The exchange's choice of path
(fused for a low-rank item on the kernel path; the unfused chain with block rotation, ternary's
words or the exact map) is read off the operators a trace of the all-reduce's gather-decode
stage on fake CUDA tensors emits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from bit_checks import fake_cuda, same_bits
from conftest import require

require("triton", "the codec kernels need Triton (the `test` extra installs it)")

from gift_compile.codec import FormatSpec  # noqa: E402
from gift_compile.exchange.item_codec import ItemTensors, gather_decode_stage, item_width  # noqa: E402
from gift_compile.exchange.plan import BucketPlan, ItemPlan  # noqa: E402
from gift_compile.kernels import ops, ops_fp8  # noqa: E402
from gift_compile.kernels.formats import FP8_KERNEL_FORMATS, KERNEL_FORMATS  # noqa: E402
from gift_compile.kernels.fused_receiver import decode_inverse_lowrank, receiver_path  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's inf * 0 in the NaN cases

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# every two-level format the fused receiver serves, at each block it takes; ternary keeps the chain
FUSED = [(f, b) for f in KERNEL_FORMATS for b in ((16,) if f == "nvfp4" else (16, 32))
         if ops.fused_reason(f, b) is None]
FP8 = [(f, scaling, block) for f in FP8_KERNEL_FORMATS
       for scaling, block in (("row", 32), ("block", 32), ("block", 24), ("tensor", 32))]
SHAPES = [(3, 24, 300), (2, 1, 37), (1, 1, 130)]  # (senders, rows per sender, cols)
SHAPE_IDS = ["3x24x300", "2x1x37", "1x1x130"]



def _map(gen: torch.Generator, cols: int, rank: int = 20) -> tuple[torch.Tensor, ...]:
    """Inverse-map operands `(basis, coef, pre, post)` as `LowRank.inverse_operands` gives them."""
    basis = torch.linalg.qr(torch.randn(cols, rank, generator=gen))[0]
    dsq = torch.rand(cols, generator=gen) + 0.5
    return basis, torch.rand(rank, generator=gen) * 3, dsq, dsq


def _check(full: torch.Tensor, fused: torch.Tensor, basis: torch.Tensor, coef: torch.Tensor, pre: torch.Tensor,
           post: torch.Tensor) -> None:
    """`fused` is `lowrank_expand` of the decoded `full` bit for bit, and the rank-r term is there."""
    p = ops.lowrank_project(full, basis, "ieee")
    want = ops.lowrank_expand(full, p, pre, coef, basis, post, "ieee")
    assert same_bits(fused.cpu(), want.cpu()), int((fused != want).sum())
    fin = torch.isfinite(want) & torch.isfinite(full)
    assert (want[fin] != (full * pre)[fin]).float().mean() > 0.5


@pytest.mark.parametrize(("fmt", "block"), FUSED, ids=[f"{f}-b{b}" for f, b in FUSED])
@pytest.mark.parametrize(("senders", "rows", "cols"), SHAPES, ids=SHAPE_IDS)
def test_decode_expand_is_decode_then_expand(fmt: str, block: int, senders: int, rows: int, cols: int) -> None:
    """Random bytes as codes (every digit value), random E4M3 block codes with NaN ones, one
    tensor scale per sender (one huge, so values saturate at fp32's largest): the fused op's
    output is `lowrank_expand` of `decode`'s values bit for bit."""
    gen = torch.Generator().manual_seed(senders + rows + cols + block + len(fmt))
    spec = FormatSpec(fmt, block_size=block)
    nb = -(-cols // block)
    payload = torch.randint(0, 256, (senders, rows, spec.payload_cols(cols)), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0x20, 0x50, (senders, rows, nb), generator=gen, dtype=torch.uint8)
    tscale = torch.logspace(-3, 2, senders).reshape(senders, 1, 1)
    edges = senders * rows > 2  # the small shapes stay finite, so their rank-r term can be seen
    if edges:
        scales[0, 1, -1], scales[-1, -1, 0] = 0x7F, 0xFF  # NaN block codes: two rows all NaN
        tscale[0] = 1e38  # a sender whose large codes saturate at fp32's largest value
    basis, coef, pre, post = (t.to(DEVICE) for t in _map(gen, cols))
    payload, scales, tscale = payload.to(DEVICE), scales.to(DEVICE), tscale.to(DEVICE)
    full = ops.decode(payload, scales, tscale.reshape(senders), fmt, block, cols, False, False)
    full = full.reshape(senders * rows, cols)
    fused = decode_inverse_lowrank(payload, scales, tscale, basis, coef, pre, post, "ieee", spec, cols)
    _check(full, fused, basis, coef, pre, post)
    if edges:
        assert torch.isnan(full).any() and (full.abs() == torch.finfo(torch.float32).max).any()


@pytest.mark.parametrize(("fmt", "scaling", "block"), FP8, ids=[f"{f}-{s}-b{b}" for f, s, b in FP8])
@pytest.mark.parametrize(("senders", "rows", "cols"), SHAPES, ids=SHAPE_IDS)
def test_fp8_decode_expand_is_decode_then_expand(fmt: str, scaling: str, block: int, senders: int, rows: int,
                                                 cols: int) -> None:
    """Random float8 bytes (NaN and, for e5m2, Inf codes among them), power-of-two scales with a
    +inf one (a non-finite group: NaN values) and a huge one (saturation), per tensor, row or
    block (24: a block that does not divide the tile): bit for bit `lowrank_expand` of
    `fp8_decode`'s values."""
    gen = torch.Generator().manual_seed(senders + rows + cols + block + len(scaling))
    spec = FormatSpec(fmt, scaling, block)
    n = senders * rows
    payload = torch.randint(0, 256, (senders, rows, spec.payload_cols(cols)), generator=gen, dtype=torch.uint8)
    # finite codes (the top exponent's low bit cleared) but in the first row, where NaN/Inf codes stay
    edges = n > 2  # the small shapes stay finite, so their rank-r term can be seen
    payload.view(n, -1)[1 if edges else 0:] &= 0xF7 if fmt == "fp8_e4m3" else 0xFB
    shape = {"tensor": (senders, 1, 1), "row": (senders, rows), "block": (senders, rows, -(-cols // block))}[scaling]
    scales = 2.0 ** torch.randint(-10, 10, shape, generator=gen).float()
    if edges:
        payload.view(-1)[0] = 0x7F
        scales.view(-1)[-1] = float("inf")  # a non-finite group: its values NaN
        scales.view(-1)[0] = 2.0 ** 127  # saturating values in the first group
    basis, coef, pre, post = (t.to(DEVICE) for t in _map(gen, cols))
    payload, scales = payload.to(DEVICE), scales.to(DEVICE)
    op_scales = scales.reshape(senders) if scaling == "tensor" else scales
    full = ops_fp8.fp8_decode(payload, op_scales, fmt, scaling, block, cols, False, False).reshape(n, cols)
    fused = decode_inverse_lowrank(payload, scales, None, basis, coef, pre, post, "ieee", spec, cols)
    _check(full, fused, basis, coef, pre, post)
    if edges:
        assert torch.isnan(full).any() and (full.abs() == torch.finfo(torch.float32).max).any()


def test_the_receiver_ops_check_their_inputs() -> None:
    """Bad inputs raise naming the operator and the argument; ternary's words are refused."""
    p, d, c, b = torch.zeros(4, 3), torch.ones(40), torch.zeros(3), torch.zeros(40, 3)
    pay, sc, ts = torch.zeros(4, 24, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8), torch.ones(2)
    with pytest.raises(ValueError, match="lowrank_decode_expand: ternary packs 5"):
        ops.lowrank_decode_expand(pay, sc, ts, p, d, c, b, d, "ieee", "ternary", 16, 40)
    with pytest.raises(ValueError, match="lowrank_decode_expand: scales has shape"):
        ops.lowrank_decode_expand(pay, sc[:, :2], ts, p, d, c, b, d, "ieee", "nvfp4", 16, 40)
    with pytest.raises(ValueError, match="lowrank_decode_expand: 4 payload rows do not split into 3"):
        ops.lowrank_decode_expand(pay, sc, torch.ones(3), p, d, c, b, d, "ieee", "nvfp4", 16, 40)
    with pytest.raises(ValueError, match="lowrank_decode_expand: p has shape"):
        ops.lowrank_decode_expand(pay, sc, ts, p[:3], d, c, b, d, "ieee", "nvfp4", 16, 40)
    with pytest.raises(ValueError, match="lowrank_decode_expand: payload has 24 bytes per row, but cols=70"):
        ops.lowrank_decode_expand(pay, sc, ts, p, d, c, b, d, "ieee", "nvfp4", 16, 70)
    pay8 = torch.zeros(4, 40, dtype=torch.uint8)
    with pytest.raises(ValueError, match="lowrank_fp8_decode_expand: scales has shape"):
        ops_fp8.lowrank_fp8_decode_expand(pay8, torch.ones(3), p, d, c, b, d, "ieee", "fp8_e4m3", "row", 32, 40)
    with pytest.raises(ValueError, match="lowrank_fp8_decode_expand: precision='fp16'"):
        ops_fp8.lowrank_fp8_decode_expand(pay8, torch.ones(4), p, d, c, b, d, "fp16", "fp8_e4m3", "row", 32, 40)



def _receiver_ops(item: ItemPlan, world: int = 2, rank: int = 4) -> list[str]:
    """The kernel operators of the all-reduce's gather-decode stage of `item`, traced as the FX
    pass traces it (`make_fx` on fake CUDA tensors), with a rank-`rank` low-rank map."""
    p = BucketPlan((item,), world, None, True, "all_reduce")
    mode = FakeTensorMode()
    with mode:
        maps = tuple(fake_cuda(mode, s, torch.float32)
                     for s in ((item.cols,), (item.cols, rank), (rank,), (rank,), (item.cols,)))
        gm = make_fx(lambda c: gather_decode_stage(c, ItemTensors(maps), p))(
            fake_cuda(mode, (world, item_width(item, p)), torch.uint8))
    return [n.target._opname for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "gift_kernels"]


def test_the_all_reduce_receives_a_low_rank_item_through_the_fused_op() -> None:
    """A low-rank item on the kernel path (CUDA, `map_precision` "auto") receives through the
    decode (for the projection), the projection and the fused decode-expand: the decoded
    result is not read back by the expansion. With ternary (or, by `receiver_path`, block
    rotation or the exact map): the unfused chain as before."""
    item = ItemPlan(name="w", rows=7, cols=40, format="nvfp4", kind="lowrank", n_tensors=5)
    assert _receiver_ops(item) == ["decode", "lowrank_project", "lowrank_decode_expand"]
    assert _receiver_ops(dataclasses.replace(item, format="int3", block_size=32)) == [
        "decode", "lowrank_project", "lowrank_decode_expand"]
    fp8 = ["fp8_decode", "lowrank_project", "lowrank_fp8_decode_expand"]
    for scaling, block in (("row", 32), ("tensor", 32), ("block", 24)):
        assert _receiver_ops(dataclasses.replace(item, format="fp8_e4m3", scaling=scaling, block_size=block)) == fp8
    chain = ["decode", "lowrank_project", "lowrank_expand"]
    assert _receiver_ops(dataclasses.replace(item, format="ternary", block_size=32)) == chain
    cuda = torch.device("cuda")
    # block rotation and the exact map (neither traces on fake CUDA tensors in a CPU-only torch)
    assert not receiver_path(item.spec, cuda, "exact", False).fused
    assert receiver_path(item.spec, cuda, "auto", True) == (
        False, "", "block rotation un-rotates the decoded result before the inverse map")
    assert not receiver_path(item.spec, torch.device("cpu"), "auto", False).fused
    assert "5 codes per word" in receiver_path(FormatSpec("ternary", block_size=32), cuda, "auto", False).reason
    assert receiver_path(item.spec, cuda, "bf16", False) == (
        True, "bf16", "nvfp4: the inverse map's expansion decodes the gathered codes itself (bf16 operands)")
