"""GIFT's fused sender (gift_compile.kernels.fused_sender): the low-rank map's expansion computed
inside the block statistics and the encode instead of written out.

The fused operators (`lowrank_block_stat`, `lowrank_encode`; for the fp8 formats
`lowrank_fp8_scales`, `lowrank_fp8_encode`) are compared with the unfused chain they replace
(`lowrank_expand`, then `block_stat`, `scale_codes`, `encode`; for fp8 `fp8_scale_encode`, or
per tensor `fp8_scales`, their maximum, `fp8_encode`) bit for bit: on
inputs whose every product and partial sum is exact in fp32 (small integers times powers of two,
so no summation order can change a bit),
and on random ones with NaN/Inf, one row, and widths that fill no whole tile or block. On the
CPU they run in Triton's interpreter (tests/conftest.py), with "ieee" operands; with CUDA,
compiled. The exchange's choice of path (fused for a low-rank item on the kernel path, the
unfused chain with error feedback, block rotation, ternary's words, or an fp8 block that does not
divide the fused tile) is read off the
operators a trace on fake CUDA tensors emits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from bit_checks import fake_cuda, kernel_ops, same_bits
from conftest import require

require("triton", "the codec kernels need Triton (the `test` extra installs it)")

from gift_compile.codec import FormatSpec  # noqa: E402
from gift_compile.codec import residual as residual_store  # noqa: E402
from gift_compile.codec.scales import _global_max, _tensor_scale  # noqa: E402
from gift_compile.exchange.item_codec import ItemTensors, Shared, encode_item  # noqa: E402
from gift_compile.exchange.plan import BucketPlan, ItemPlan  # noqa: E402
from gift_compile.kernels import choose_scales, ops, ops_fp8  # noqa: E402
from gift_compile.kernels.formats import FP8_KERNEL_FORMATS, KERNEL_FORMATS  # noqa: E402
from gift_compile.kernels.fused_sender import encode_lowrank, sender_path  # noqa: E402
from gift_compile.kernels.map_dispatch import lowrank_map  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's inf * 0 in the NaN cases

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# every format the fused kernels serve, at each block it takes; ternary keeps the unfused chain
FUSED = [("nvfp4", 16), ("int6", 16), ("int6", 32), ("int4", 16), ("int4", 32), ("int3", 16), ("int3", 32),
         ("int2", 16), ("int2", 32)]
IDS = [f"{f}-b{b}" for f, b in FUSED]


def test_every_kernel_format_but_ternary_is_fused() -> None:
    """Which path each kernel format's sender takes, a static property of its word layout:
    words of a power-of-two digit count tile the fused kernels' 128 columns, ternary's five
    digits per byte do not (its ops refuse it by name)."""
    fused = {(f, b) for f in KERNEL_FORMATS for b in ((16,) if f == "nvfp4" else (16, 32))
             if ops.fused_reason(f, b) is None}
    assert fused == set(FUSED)
    assert "5 codes per word" in ops.fused_reason("ternary", 32)
    g, p, d, c, b = torch.zeros(2, 40), torch.zeros(2, 4), torch.ones(40), torch.zeros(4), torch.zeros(40, 4)
    with pytest.raises(ValueError, match="lowrank_block_stat: ternary packs 5"):
        ops.lowrank_block_stat(g, p, d, c, b, d, "ieee", "ternary", 32)


def _chain(g: torch.Tensor, p: torch.Tensor, dinv: torch.Tensor, coef: torch.Tensor, basis: torch.Tensor,
           dsq: torch.Tensor, fmt: str, block: int) -> tuple[torch.Tensor, ...]:
    """The unfused sender: the expansion written out, then its statistics, scales and codes."""
    y = ops.lowrank_expand(g, p, dinv, coef, basis, dsq, "ieee")
    stat = ops.block_stat(y, fmt, block)
    tscale = _tensor_scale(_global_max(stat), FormatSpec(fmt).family.level)
    scales = ops.scale_codes(stat, tscale, fmt, block)
    return y, stat, tscale, scales, ops.encode(y, scales, tscale, fmt, block)



def _check_fused_matches_chain(g: torch.Tensor, p: torch.Tensor, dinv: torch.Tensor, coef: torch.Tensor,
                               basis: torch.Tensor, dsq: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """Assert the fused ops give the chain's statistics and codes bit for bit; return the chain's y."""
    args = [t.to(DEVICE) for t in (g, p, dinv, coef, basis, dsq)]
    y, stat, tscale, scales, codes = _chain(*args, fmt, block)
    fstat = ops.lowrank_block_stat(*args, "ieee", fmt, block)
    assert same_bits(fstat.cpu(), stat.cpu()), (fmt, block)
    fcodes = ops.lowrank_encode(*args, scales, tscale, "ieee", fmt, block)
    assert same_bits(fcodes.cpu(), codes.cpu()), (fmt, block, int((fcodes != codes).sum()))
    return y.cpu()


def _exact_inputs(seed: int) -> tuple[torch.Tensor, ...]:
    """`(g, p, dinv, coef, basis, dsq)` of a 70x150 map whose every product and partial sum is
    exact in fp32 (integers up to 2**6 times powers of two, rank 8), so no summation order can
    change the expansion: 150 columns give a partial second tile and a partial last block, 70
    rows a partial second row tile."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols, rank = 70, 150, 8

    def ints(*shape: int, lo: int = -8, hi: int = 9) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=gen).float()

    g = ints(rows, cols) * 2.0 ** ints(rows, 1, lo=-4, hi=5)
    basis, coef = ints(cols, rank) * 0.125, 2.0 ** ints(rank, lo=-3, hi=1)
    dinv, dsq = 2.0 ** ints(cols, lo=-2, hi=3), 2.0 ** ints(cols, lo=-2, hi=3)
    p = g @ basis  # exact: integer multiples of one power of two per row, far below 2**24
    return g, p, dinv, coef, basis, dsq


def _random_inputs(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, ...]:
    """`(g, p, dinv, coef, basis)` of a rank-20 map on Gaussian rows of different magnitudes,
    with (from 7 rows) a NaN row 3, an Inf row 4 and an all-zero row 5; `p` is the kernel
    projection."""
    gen = torch.Generator().manual_seed(seed)
    rank = 20
    g = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 2, rows).unsqueeze(1)
    if rows > 6:
        g[3, 5], g[4, cols - 1], g[5] = float("nan"), float("-inf"), 0.0
    basis = torch.linalg.qr(torch.randn(cols, rank, generator=gen))[0]
    coef, dinv = -0.9 * torch.rand(rank, generator=gen), torch.rand(cols, generator=gen) + 0.5
    p = ops.lowrank_project(g.to(DEVICE), basis.to(DEVICE), "ieee").cpu()
    return g, p, dinv, coef, basis


@pytest.mark.parametrize(("fmt", "block"), FUSED, ids=IDS)
def test_the_fused_ops_are_the_chain_on_exact_inputs(fmt: str, block: int) -> None:
    """Inputs whose every product and partial sum is exact in fp32 (integers up to 2**6 times
    powers of two): the expansion is the exact map whatever order a kernel sums in, so any
    difference would be the fused kernels' rounding, masking or packing (a few values per
    format also sit exactly on a threshold of the grid, a tie to even). 150 columns: a partial
    second tile and a partial last block; 70 rows: a partial second row tile."""
    g, p, dinv, coef, basis, dsq = _exact_inputs(block + len(fmt))
    y = _check_fused_matches_chain(g, p, dinv, coef, basis, dsq, fmt, block)
    assert torch.equal(y, g * dinv + ((p * coef) @ basis.T) * dsq)  # the exact map, so no order mattered
    assert (y != g * dinv).float().mean() > 0.5  # the rank-r term is there


@pytest.mark.parametrize(("fmt", "block"), FUSED, ids=IDS)
@pytest.mark.parametrize(("rows", "cols"), [(70, 300), (1, 37)], ids=["70x300", "1x37"])
def test_the_fused_ops_are_the_chain_on_random_inputs(fmt: str, block: int, rows: int, cols: int) -> None:
    """Gaussian rows of different magnitudes with a NaN and an Inf row (their projection makes
    the whole mapped row non-finite: every block statistic +inf, codes as the chain's), an
    all-zero row (int2's parity rule on exact zeros), one row alone, widths that fill no whole
    tile or block: bit for bit the chain's, the tile arithmetic being the same function."""
    g, p, dinv, coef, basis = _random_inputs(rows, cols, rows + cols + block)
    y = _check_fused_matches_chain(g, p, dinv, coef, basis, 1 / dinv, fmt, block)
    if rows > 6:
        stat = ops.lowrank_block_stat(*(t.to(DEVICE) for t in (g, p, dinv, coef, basis, 1 / dinv)), "ieee", fmt, block)
        assert torch.isinf(stat[3:5]).all() and torch.isfinite(stat[6:]).all()
        assert (y[5] == 0).all()


@pytest.mark.parametrize(("fmt", "block"), [("nvfp4", 16), ("int2", 32), ("int3", 16)])
def test_encode_lowrank_is_the_map_then_the_kernel_codec(fmt: str, block: int) -> None:
    """`fused_sender.encode_lowrank` (what the exchange calls) gives the scale codes, tensor
    scale and codes of the kernel path's unfused sender: `lowrank_map`, then
    the kernel path's statistics, scale codes and encode."""
    gen = torch.Generator().manual_seed(block)
    g = torch.randn(9, 100, generator=gen).to(DEVICE)
    basis = torch.randn(100, 6, generator=gen).to(DEVICE)
    coef, pre = torch.randn(6, generator=gen).to(DEVICE), (torch.rand(100, generator=gen) + 0.5).to(DEVICE)
    spec = FormatSpec(fmt, block_size=block)
    scales, tscale, codes = encode_lowrank(g, basis, coef, pre, 1 / pre, "ieee", spec)
    y = lowrank_map(g, basis, coef, pre, 1 / pre, "ieee")
    # the kernel path's unfused sender by hand (on CPU tensors the dispatch would run the reference codec)
    stat = ops.block_stat(y, fmt, block)
    ref_tscale = _tensor_scale(_global_max(stat), spec.family.level)
    ref_scales = ops.scale_codes(stat, ref_tscale, fmt, block)
    ref_codes = ops.encode(y, ref_scales, ref_tscale, fmt, block)
    if DEVICE.type == "cuda":
        assert torch.equal(choose_scales(y, spec)[0], ref_scales)
    assert torch.equal(scales, ref_scales) and torch.equal(tscale, ref_tscale) and torch.equal(codes, ref_codes)



class _Stop(Exception):
    """Raised by `_KernelCalls` at the error-feedback residual's decode: the sender is recorded."""


class _KernelCalls(TorchDispatchMode):
    """Records the codec kernel operators a call dispatches (under the fake mode: no launch), up
    to the first `decode`: the error-feedback residual's, which runs after the encode, and whose
    update (a row slice) does not run on fake CUDA tensors in a CPU-only torch."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's protocol)
        if func.namespace == "gift_kernels":
            self.ops.append(func._opname)
            if func._opname in ("decode", "fp8_decode"):
                raise _Stop
        return func(*args, **(kwargs or {}))


def _sender_ops(item: ItemPlan, rank: int = 4) -> list[str]:
    """The kernel operators `encode_item` runs for `item` on fake CUDA tensors, with a
    rank-`rank` low-rank map and, with error feedback, its residual, up to the residual's
    decode (`_KernelCalls`); `test_the_fused_sender_traces_as_its_operators` traces the fused
    path with `make_fx`."""
    p = BucketPlan((item,), 2, None, True, "reduce_scatter")
    mode = FakeTensorMode()
    with mode:
        maps = tuple(fake_cuda(mode, s, torch.float32)
                     for s in ((item.cols,), (item.cols, rank), (rank,), (rank,), (item.cols,)))
        residual = None
        if item.error_feedback:
            residual = tuple(fake_cuda(mode, tuple(b.shape), b.dtype)
                             for b in residual_store.allocate(item.residual_format, item.rows, item.cols, "meta"))
        with _KernelCalls() as calls:
            try:
                encode_item(fake_cuda(mode, (item.rows, item.cols), torch.float32), ItemTensors(maps, residual),
                            Shared(), item, p)
            except _Stop:
                assert item.error_feedback
    return calls.ops


def test_the_fused_sender_traces_as_its_operators() -> None:
    """Traced as the FX pass traces it (`make_fx` on fake CUDA tensors), a low-rank item's
    sender is the four operators, which Inductor keeps as kernels (`bench.fidelity.kernel_traffic` counts
    their bytes from these nodes)."""
    item = ItemPlan(name="w", rows=8, cols=40, format="int4", kind="lowrank", n_tensors=5)
    p = BucketPlan((item,), 2, None, True, "all_reduce")
    mode = FakeTensorMode()
    with mode:
        maps = tuple(fake_cuda(mode, s, torch.float32) for s in ((40,), (40, 4), (4,), (4,), (40,)))
        gm = make_fx(lambda g: encode_item(g, ItemTensors(maps), Shared(), item, p))(
            fake_cuda(mode, (8, 40), torch.float32))
    assert kernel_ops(gm) == [
        f"gift_kernels.{op}.default" for op in ("lowrank_project", "lowrank_block_stat", "scale_codes",
                                                 "lowrank_encode")]


def test_the_exchange_sends_a_low_rank_item_through_the_fused_ops() -> None:
    """A low-rank item on the kernel path (CUDA, `map_precision` "auto", a fused format) sends
    through the projection, the fused statistics, the scale codes and the fused encode: no
    expansion written. With error feedback (its residual joins the mapped gradient), block
    rotation, ternary, or the exact map, the unfused chain as before."""
    item = ItemPlan(name="w", rows=8, cols=40, format="nvfp4", kind="lowrank", n_tensors=5)
    assert _sender_ops(item) == ["lowrank_project", "lowrank_block_stat", "scale_codes", "lowrank_encode"]
    assert _sender_ops(dataclasses.replace(item, format="int3", block_size=32))[1] == "lowrank_block_stat"
    chain = ["lowrank_project", "lowrank_expand", "block_stat", "scale_codes", "encode"]
    assert _sender_ops(dataclasses.replace(item, error_feedback=True)) == [*chain, "decode"]
    assert _sender_ops(dataclasses.replace(item, format="ternary", block_size=32)) == chain
    cuda = torch.device("cuda")
    assert not sender_path(item.spec, cuda, "auto", False, False, True).fused  # block rotation
    assert not sender_path(item.spec, cuda, "exact", False, False, False).fused
    assert not sender_path(item.spec, cuda, "auto", True, False, False).fused  # stochastic rounding
    assert not sender_path(item.spec, torch.device("cpu"), "auto", False, False, False).fused
    assert sender_path(item.spec, cuda, "bf16", False, False, False) == (
        True, "bf16", "nvfp4: the low-rank map fused into the block statistics and the encode (bf16 operands)")


# the fp8 formats at each scaling the fused fp8 sender serves (the default, row, first)
FP8_FUSED = [(f, scaling, block) for f in FP8_KERNEL_FORMATS
             for scaling, block in (("row", 32), ("block", 32), ("block", 16), ("tensor", 32))]
FP8_IDS = [f"{f}-{s}" + (f"-b{b}" if s == "block" else "") for f, s, b in FP8_FUSED]


def test_which_fp8_specs_are_fused() -> None:
    """Per tensor and per row every fp8 spec runs fused; per block where the block divides the
    fused tile's 128 columns (whole blocks per tile). The ops refuse the others by name."""
    for f in FP8_KERNEL_FORMATS:
        for scaling, block in (("tensor", 24), ("row", 24), ("block", 2), ("block", 16), ("block", 128)):
            assert ops_fp8.lowrank_fp8_reason(FormatSpec(f, scaling, block)) is None, (f, scaling, block)
        for block in (24, 256, 1024):
            assert f"block {block} does not divide" in ops_fp8.lowrank_fp8_reason(FormatSpec(f, "block", block))
    assert "ops_fp8" in ops.fused_reason("fp8_e4m3", 32)  # the two-level ops point at the fp8 ones
    g, p, d, c, b = torch.zeros(2, 40), torch.zeros(2, 4), torch.ones(40), torch.zeros(4), torch.zeros(40, 4)
    with pytest.raises(ValueError, match="lowrank_fp8_scales: fp8_e4m3 block 24 does not divide"):
        ops_fp8.lowrank_fp8_scales(g, p, d, c, b, d, "ieee", "fp8_e4m3", "block", 24)
    with pytest.raises(ValueError, match="lowrank_fp8_encode: scales has shape"):
        ops_fp8.lowrank_fp8_encode(g, p, d, c, b, d, torch.ones(3), "ieee", "fp8_e4m3", "row", 32)
    with pytest.raises(ValueError, match="lowrank_fp8_scales: precision='fp16'"):
        ops_fp8.lowrank_fp8_scales(g, p, d, c, b, d, "fp16", "fp8_e4m3", "row", 32)


def _fp8_chain(y: torch.Tensor, fmt: str, scaling: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused fp8 sender after the expansion `y`: (statistics or scales, codes) as the kernel
    path's dispatch runs them (`fp8_scale_encode`; per tensor `fp8_scales`, their maximum, the
    scale, `fp8_encode`). Per tensor the statistics are the rows' amax, the codes under their
    maximum's scale."""
    if scaling != "tensor":
        codes, scales = ops_fp8.fp8_scale_encode(y, fmt, scaling, block)
        return scales, codes
    stat = ops_fp8.fp8_scales(y, fmt, scaling, block)
    scale = FormatSpec(fmt, scaling, block).family.scales_of(_global_max(stat))
    return stat, ops_fp8.fp8_encode(y, scale, fmt, scaling, block)


def _check_fp8_fused_matches_chain(g: torch.Tensor, p: torch.Tensor, dinv: torch.Tensor, coef: torch.Tensor,
                                   basis: torch.Tensor, dsq: torch.Tensor, fmt: str, scaling: str,
                                   block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assert the fused fp8 ops give the chain's scales (statistics) and codes bit for bit;
    return the chain's y and scales (statistics)."""
    args = [t.to(DEVICE) for t in (g, p, dinv, coef, basis, dsq)]
    y = ops.lowrank_expand(*args, "ieee")
    stat, codes = _fp8_chain(y, fmt, scaling, block)
    fstat = ops_fp8.lowrank_fp8_scales(*args, "ieee", fmt, scaling, block)
    assert same_bits(fstat.cpu(), stat.cpu()), (fmt, scaling, block)
    scales = FormatSpec(fmt, scaling, block).family.scales_of(_global_max(stat)) if scaling == "tensor" else stat
    fcodes = ops_fp8.lowrank_fp8_encode(*args, scales, "ieee", fmt, scaling, block)
    assert same_bits(fcodes.cpu(), codes.cpu()), (fmt, scaling, block, int((fcodes != codes).sum()))
    return y.cpu(), stat.cpu()


@pytest.mark.parametrize(("fmt", "scaling", "block"), FP8_FUSED, ids=FP8_IDS)
def test_the_fused_fp8_ops_are_the_chain_on_exact_inputs(fmt: str, scaling: str, block: int) -> None:
    """As `test_the_fused_ops_are_the_chain_on_exact_inputs`, for the fp8 formats: the
    expansion is exact whatever the summation order, so a difference would be the fused
    kernels' scale choice, masking or encode; its integer values hit fp8's rounding ties.
    150 columns: two column tiles for a row's amax, a partial last tile and block."""
    g, p, dinv, coef, basis, dsq = _exact_inputs(block + len(scaling))
    y, _ = _check_fp8_fused_matches_chain(g, p, dinv, coef, basis, dsq, fmt, scaling, block)
    assert torch.equal(y, g * dinv + ((p * coef) @ basis.T) * dsq)
    assert (y != g * dinv).float().mean() > 0.5
    # a row's amax sits in its second column tile for some rows: the walk over tiles matters
    assert (y[:, 128:].abs().amax(1) > y[:, :128].abs().amax(1)).any()


@pytest.mark.parametrize(("fmt", "scaling", "block"), FP8_FUSED, ids=FP8_IDS)
@pytest.mark.parametrize(("rows", "cols"), [(70, 300), (1, 37)], ids=["70x300", "1x37"])
def test_the_fused_fp8_ops_are_the_chain_on_random_inputs(fmt: str, scaling: str, block: int, rows: int,
                                                          cols: int) -> None:
    """Gaussian rows of different magnitudes with a NaN and an Inf row (the whole mapped row
    non-finite: its scales +inf, its codes NaN, as the chain's), an all-zero row (scale 1, zero
    codes), one row alone, widths that fill no whole tile or block: bit for bit the chain's."""
    g, p, dinv, coef, basis = _random_inputs(rows, cols, rows + cols + block + len(scaling))
    y, stat = _check_fp8_fused_matches_chain(g, p, dinv, coef, basis, 1 / dinv, fmt, scaling, block)
    if rows > 6:
        assert torch.isinf(stat[3:5]).all() and torch.isfinite(stat[6:]).all()
        assert (y[5] == 0).all() and (stat[5] == (0.0 if scaling == "tensor" else 1.0)).all()


@pytest.mark.parametrize(("fmt", "scaling", "block"), [("fp8_e4m3", "row", 32), ("fp8_e5m2", "block", 32),
                                                       ("fp8_e4m3", "tensor", 32)])
def test_encode_lowrank_is_the_map_then_the_fp8_kernel_codec(fmt: str, scaling: str, block: int) -> None:
    """`fused_sender.encode_lowrank` for an fp8 spec gives the scales and codes of the kernel
    path's unfused sender (`lowrank_map`, then the fp8 kernels) and no tensor scale."""
    gen = torch.Generator().manual_seed(block + len(scaling))
    g = torch.randn(9, 100, generator=gen).to(DEVICE)
    basis = torch.randn(100, 6, generator=gen).to(DEVICE)
    coef, pre = torch.randn(6, generator=gen).to(DEVICE), (torch.rand(100, generator=gen) + 0.5).to(DEVICE)
    spec = FormatSpec(fmt, scaling, block)
    scales, tscale, codes = encode_lowrank(g, basis, coef, pre, 1 / pre, "ieee", spec)
    y = lowrank_map(g, basis, coef, pre, 1 / pre, "ieee")
    stat, ref_codes = _fp8_chain(y, fmt, scaling, block)
    ref_scales = spec.family.scales_of(_global_max(stat)) if scaling == "tensor" else stat
    assert tscale is None
    assert torch.equal(scales, ref_scales) and torch.equal(codes, ref_codes)


def test_the_fused_fp8_sender_traces_as_its_operators() -> None:
    """Traced as the FX pass traces it, a low-rank item of the default format (fp8_e4m3, row
    scaling) sends through three operators: the projection, the fused scales, the fused encode
    (no expansion written; `bench.fidelity.kernel_traffic` counts their bytes from these nodes)."""
    item = ItemPlan(name="w", rows=8, cols=40, format="fp8_e4m3", kind="lowrank", n_tensors=5)
    p = BucketPlan((item,), 2, None, True, "all_reduce")
    mode = FakeTensorMode()
    with mode:
        maps = tuple(fake_cuda(mode, s, torch.float32) for s in ((40,), (40, 4), (4,), (4,), (40,)))
        gm = make_fx(lambda g: encode_item(g, ItemTensors(maps), Shared(), item, p))(
            fake_cuda(mode, (8, 40), torch.float32))
    assert kernel_ops(gm) == [
        f"gift_kernels.{op}.default" for op in ("lowrank_project", "lowrank_fp8_scales", "lowrank_fp8_encode")]


def test_the_exchange_sends_an_fp8_low_rank_item_through_the_fused_ops() -> None:
    """fp8 low-rank items on the kernel path: fused at row, tensor and (a block dividing 128)
    block scaling; the unfused chain (expansion written, then the fp8 kernels) with error
    feedback or a block of 24 columns, which `sender_path` names."""
    item = ItemPlan(name="w", rows=8, cols=40, format="fp8_e5m2", kind="lowrank", n_tensors=5)
    fused = ["lowrank_project", "lowrank_fp8_scales", "lowrank_fp8_encode"]
    assert _sender_ops(item) == fused
    assert _sender_ops(dataclasses.replace(item, scaling="tensor")) == fused
    assert _sender_ops(dataclasses.replace(item, scaling="block", block_size=16)) == fused
    block24 = dataclasses.replace(item, scaling="block", block_size=24)
    assert _sender_ops(block24) == ["lowrank_project", "lowrank_expand", "fp8_scale_encode"]
    assert _sender_ops(dataclasses.replace(item, error_feedback=True)) == [
        "lowrank_project", "lowrank_expand", "fp8_scale_encode", "fp8_decode"]
    cuda = torch.device("cuda")
    assert sender_path(block24.spec, cuda, "auto", False, False, False) == (
        False, "", "fp8_e5m2 block 24 does not divide the fused tile's 128 columns")
    assert sender_path(item.spec, cuda, "bf16", False, False, False) == (
        True, "bf16", "fp8_e5m2: the low-rank map fused into the row scales and the encode (bf16 operands)")
