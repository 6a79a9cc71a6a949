"""The codec's Triton kernels (gift_compile.kernels) against the reference codec, bit for bit.

On a machine without CUDA the kernels run on CPU tensors in Triton's interpreter
(`TRITON_INTERPRET=1`, switched on by tests/conftest.py before the package is imported); with
CUDA they run compiled on the GPU. Either way every result is compared with what the reference
codec (`gift_compile.codec`, eager on the CPU) computes for the same input: scale codes and
tensor scale, packed payload bytes, decoded values and their sum over senders, compared as
bits (NaN where the reference has NaN), never with the kernels themselves. Shapes are small
(the interpreter runs a kernel program by program in numpy) and cover columns that are not a
multiple of the block, a single row, all-zero blocks, tiny and huge blocks, and blocks
holding NaN or Inf, which must decode to NaN as the reference's do.

Also here: what `torch.compile` makes of a registered kernel (one operator node in the
traced graph), the exchange's per-item codec emitting the operators for CUDA tensors (traced
on fake CUDA tensors, no GPU needed) and not for CPU ones, the logged path choice, and the
operators' input checks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from bit_checks import edge_gradient, exchange_round_trip, fake_cuda, kernel_ops, on_kernel_path, same_bits
from conftest import require

require("triton", "the codec kernels need Triton (the `test` extra installs it)")

from gift_compile import codec, kernels  # noqa: E402  (after the Triton check)
from gift_compile.codec import FormatSpec  # noqa: E402
from gift_compile.codec.scales import _e4m3_code, _global_max, _tensor_scale  # noqa: E402
from gift_compile.exchange.item_codec import ItemTensors, Shared, decode_item, encode_item, item_width  # noqa: E402
from gift_compile.exchange.plan import BucketPlan, ItemPlan  # noqa: E402
from gift_compile.kernels import ops  # noqa: E402
from gift_compile.kernels.formats import FP8_KERNEL_FORMATS  # noqa: E402

# numpy's warnings from the interpreter running the NaN/Inf cases (inf * 0 and the like), intended
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# every kernel format at each block length it takes (nvfp4's block is fixed at 16)
CASES = [("nvfp4", 16), ("int6", 16), ("int6", 32), ("int4", 16), ("int4", 32), ("int3", 16), ("int3", 32),
         ("int2", 16), ("int2", 32), ("ternary", 16), ("ternary", 32)]
IDS = [f"{f}-b{b}" for f, b in CASES]


def test_the_cpu_runs_the_kernels_in_the_interpreter() -> None:
    if DEVICE.type == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1"


def test_every_kernel_compiles_for_hopper(tmp_path: Path) -> None:
    """The interpreter runs code the compiler may reject: tests/kernel_compile.py compiles each
    kernel, for every format, block and mode, to an sm_90 cubin (Triton's own compiler and its
    bundled ptxas; no GPU needed), in a process without the interpreter, and reads which
    arguments torch's analysis of the kernels finds written."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    script = Path(__file__).with_name("kernel_compile.py")
    res = subprocess.run([sys.executable, str(script)], env=env, cwd=script.parent.parent, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    lines = [line for line in res.stdout.splitlines() if not line.startswith("mutates ")]
    # six per format and block, three more (the fused sender's two, the fused receiver's) for
    # every one but ternary; per fp8 format five at each of its three scalings, the scales and
    # codes in one kernel for two of them and the fused sender's two and receiver's one at each
    # scaling; the map's two kernels at each of their three precisions
    fused = sum(ops.fused_reason(fmt, block) is None for fmt, block in CASES)
    assert fused == len(CASES) - 2
    want = len(CASES) * 6 + 3 * fused + len(FP8_KERNEL_FORMATS) * (3 * 5 + 2 + 3 * 3) + 6
    assert len(lines) == want and all(int(line.split()[-2]) > 1000 for line in lines), lines
    # Inductor's analysis of each kernel's TTIR finds it stores to its output only, so under
    # torch.compile no input is copied before a kernel runs (its traffic stays its arguments')
    mutates = dict(line.removeprefix("mutates ").split(": ") for line in res.stdout.splitlines()
                   if line.startswith("mutates "))
    assert mutates == {"block_stat": "stat_ptr", "scale_codes": "code_ptr", "encode": "out_ptr", "decode": "out_ptr",
                       "lowrank_expand": "out_ptr", "lowrank_project": "p_ptr", "lowrank_block_stat": "stat_ptr",
                       "lowrank_encode": "out_ptr", "fp8_scales": "out_ptr",
                       "fp8_scales[block]": "out_ptr", "fp8_scale_encode": "scale_ptr out_ptr",
                       "fp8_scale_encode[block]": "scale_ptr out_ptr", "fp8_encode": "out_ptr",
                       "fp8_decode": "out_ptr", "lowrank_fp8_scales": "out_ptr",
                       "lowrank_fp8_scales[block]": "out_ptr", "lowrank_fp8_encode": "out_ptr",
                       "lowrank_decode_expand": "out_ptr", "lowrank_fp8_decode_expand": "out_ptr"}




def _kernel_scales(x: torch.Tensor, fmt: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale codes and tensor scale the way the kernel path chooses them (kernels.choose_scales
    on CUDA): block statistics kernel, their maximum, the tensor scale, the code kernel."""
    stat = ops.block_stat(x.to(DEVICE), fmt, block)
    tscale = _tensor_scale(_global_max(stat), FormatSpec(fmt).family.level)
    return ops.scale_codes(stat, tscale, fmt, block).cpu(), tscale.cpu()


@pytest.mark.parametrize(("fmt", "block"), CASES, ids=IDS)
@pytest.mark.parametrize(("rows", "cols"), [(7, 83), (1, 7)], ids=["7x83", "1x7"])
def test_scales_and_encode_write_the_reference_bytes(fmt: str, block: int, rows: int, cols: int) -> None:
    spec = FormatSpec(fmt, block_size=block)
    x = edge_gradient(rows, cols, seed=rows * cols + block)
    ref_scales, ref_tscale = codec.choose_scales(x, spec)
    scales, tscale = _kernel_scales(x, fmt, block)
    assert same_bits(tscale, ref_tscale)
    assert torch.equal(scales, ref_scales)
    for t in (x, edge_gradient(rows, cols, seed=rows + block, nonfinite=False),
              edge_gradient(rows, cols, seed=cols + block, huge=False, nonfinite=False)):
        s, ts = codec.choose_scales(t, spec)
        ref = codec.encode(t, spec, s, ts)
        got = ops.encode(t.to(DEVICE), s.to(DEVICE), ts.to(DEVICE), fmt, block).cpu()
        assert torch.equal(got, ref), f"{fmt}: {(got != ref).sum()} of {ref.numel()} payload bytes differ"
    if rows > 1:  # the comparison has codes to compare: many distinct bytes, not a constant payload
        assert torch.unique(ref).numel() > 8


@pytest.mark.parametrize(("fmt", "block"), CASES, ids=IDS)
def test_encode_on_scales_of_another_tensor_matches_the_reference(fmt: str, block: int) -> None:
    """`encode` takes any agreed scales (another rank's maximum): values far past the grid
    (saturation), zero units under nonzero values, and NaN/Inf values under finite units, where
    the reference's comparisons decide every code."""
    spec = FormatSpec(fmt, block_size=block)
    scales, tscale = codec.choose_scales(edge_gradient(7, 83, seed=21, huge=False, nonfinite=False), spec)
    x = edge_gradient(7, 83, seed=22, huge=False, nonfinite=False) * 40.0
    x[0, :5] = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0])
    x[1, :5] = x[0, :5]
    scales[1, 0] = 0  # a zero block scale under the values of row 1 (and under NaN, +-inf, +-0)
    ref = codec.encode(x, spec, scales, tscale)
    got = ops.encode(x.to(DEVICE), scales.to(DEVICE), tscale.to(DEVICE), fmt, block).cpu()
    assert torch.equal(got, ref), f"{fmt}: {(got != ref).sum()} of {ref.numel()} payload bytes differ"


@pytest.mark.parametrize(("fmt", "block"), CASES, ids=IDS)
def test_subnormal_units_code_like_the_reference(fmt: str, block: int) -> None:
    """A gradient near fp32's smallest values: its tensor scale sits at its floor (2**-126), so
    block units are subnormal and the thresholds (k + 0.5) unit round; the codes still count
    them as the reference does (and decode to the same values)."""
    spec = FormatSpec(fmt, block_size=block)
    g = torch.Generator().manual_seed(31)
    x = torch.randn(4, 64, generator=g) * torch.tensor([1e-38, 3e-40, 2e-42, 1e-44]).unsqueeze(1)
    scales, tscale = codec.choose_scales(x, spec)
    k_scales, k_tscale = _kernel_scales(x, fmt, block)
    assert torch.equal(k_scales, scales) and same_bits(k_tscale, tscale)
    ref = codec.encode(x, spec, scales, tscale)
    got = ops.encode(x.to(DEVICE), scales.to(DEVICE), tscale.to(DEVICE), fmt, block).cpu()
    assert torch.equal(got, ref), f"{fmt}: {(got != ref).sum()} of {ref.numel()} payload bytes differ"
    dec = ops.decode(got.unsqueeze(0).to(DEVICE), scales.unsqueeze(0).to(DEVICE), tscale.to(DEVICE), fmt, block, 64,
                     False, False).cpu()
    assert same_bits(dec[0], codec.decode(ref, spec, scales, tscale, 64))
    assert (dec != 0).any()


@pytest.mark.parametrize(("fmt", "block"), CASES, ids=IDS)
def test_decode_and_sum_over_senders_match_the_reference(fmt: str, block: int) -> None:
    """Three senders, each with its own payload, block codes and tensor scale (one of them
    holding a NaN/Inf block: its whole contribution decodes to NaN)."""
    spec = FormatSpec(fmt, block_size=block)
    rows, cols = 7, 83
    payloads, scales, tscales = [], [], []
    for seed in range(3):
        x = edge_gradient(rows, cols, seed=100 + seed, huge=False, nonfinite=seed == 1)
        s, ts = codec.choose_scales(x, spec)
        payloads.append(codec.encode(x, spec, s, ts))
        scales.append(s)
        tscales.append(ts)
    p, s, ts = torch.stack(payloads), torch.stack(scales), torch.cat(tscales)
    ref = codec.decode(p, spec, s, ts.reshape(3, 1, 1), cols)
    args = (p.to(DEVICE), s.to(DEVICE), ts.to(DEVICE), fmt, block, cols)
    each = ops.decode(*args, False, False).cpu()
    assert same_bits(each, ref)
    assert torch.isnan(each[1]).all() and not torch.isnan(each[0]).any()
    assert same_bits(ops.decode(*args, True, False).cpu(), ref.sum(dim=0))
    assert same_bits(ops.decode(*args, True, True).cpu(), (ref / 3).sum(dim=0))  # each sender's share first
    finite = ops.decode(p[[0, 2]].to(DEVICE), s[[0, 2]].to(DEVICE), ts[[0, 2]].to(DEVICE), fmt, block, cols,
                        True, True).cpu()
    assert same_bits(finite, (ref[[0, 2]] / 2).sum(dim=0)) and torch.isfinite(finite).all()
    assert (finite != 0).float().mean() > 0.3  # real values were compared, not a zero sum


def test_scale_codes_round_like_the_float8_conversion() -> None:
    """The E4M3 code the scale kernel builds from the bits, against torch's float8 conversion
    (`codec.scales._e4m3_code`): every E4M3 value, the midpoints between neighbours (ties to
    even), one float either side of each, log-uniform values across and below the subnormal
    range, values past 448 (saturation), +inf and NaN."""
    values = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (values[1:] + values[:-1]) / 2
    around = torch.cat([torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9))])
    logu = torch.exp2(torch.empty(4000).uniform_(-14, 10, generator=torch.Generator().manual_seed(3)))
    stat = torch.cat([values, mids, around, logu, torch.tensor([448.0, 460.0, 464.0, 1e6, 3e38, 1e-45,
                                                                  float("inf"), float("nan")])])
    stat = stat.reshape(1, -1)
    one = torch.ones(1)
    got = ops.scale_codes(stat.to(DEVICE), one.to(DEVICE), "int2", 16).cpu()  # int2: grid level 1
    assert torch.equal(got, _e4m3_code(stat))
    # a level-6 format multiplies by fp32(1/6) first; a tensor scale of 2**-4 by its exact inverse
    t = torch.tensor([2.0**-4])
    got = ops.scale_codes(stat.to(DEVICE), t.to(DEVICE), "nvfp4", 16).cpu()
    assert torch.equal(got, _e4m3_code(stat * 16.0 * (1.0 / 6.0)))


def _lowrank_map(cols: int, rank: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A low-rank map's tensors (`LowRank`'s five) with a strong rank-r term: an orthonormal V,
    coefficients far from 0, a non-trivial diagonal."""
    gen = torch.Generator().manual_seed(seed)
    dinv = torch.rand(cols, generator=gen) + 0.5
    v = torch.linalg.qr(torch.randn(cols, rank, generator=gen))[0]
    cf = -0.9 * torch.rand(rank, generator=gen)
    return dinv, v, cf, 1 / (1 + cf) - 1, 1 / dinv


@pytest.mark.parametrize(("rows", "cols", "rank"), [(70, 200, 8), (1, 129, 32), (33, 300, 20)])
def test_the_map_kernels_compute_the_low_rank_map_both_ways(rows: int, cols: int, rank: int) -> None:
    """`map_dispatch.lowrank_map` (projection kernel, then expansion kernel) at fp32 operands is
    `LowRank.apply_forward` and `apply_inverse`: not bitwise (tl.dot sums in its own order),
    within a few times the reference's own fp32 error against the map in fp64; shapes that fill
    no whole tile (odd rows and columns, a rank that is no power of two, columns past one
    128-wide step of the projection)."""
    from gift_compile.geometry.maps import LowRank
    from gift_compile.kernels.map_dispatch import lowrank_map

    tensors = _lowrank_map(cols, rank, rows + rank)
    dinv, v, cf, ci, dsq = tensors
    g = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    t64 = tuple(t.double() for t in tensors)
    u, v_d, cf_d, ci_d, dinv_d, dsq_d = (t.to(DEVICE) for t in (v * dinv.unsqueeze(1), v, cf, ci, dinv, dsq))
    for fn, out in ((LowRank.apply_forward, lowrank_map(g.to(DEVICE), u, cf_d, dinv_d, dsq_d, "ieee").cpu()),
                    (LowRank.apply_inverse, lowrank_map(g.to(DEVICE), v_d, ci_d, dsq_d, dsq_d, "ieee").cpu())):
        exact = fn(g.double(), t64)
        ref_error = float((fn(g, tensors).double() - exact).norm() / exact.norm())
        error = float((out.double() - exact).norm() / exact.norm())
        assert error < max(4 * ref_error, 1e-7), (fn.__name__, error, ref_error)
        assert float((out - fn(g, (dinv, torch.zeros_like(v), cf, ci, dsq))).norm() / out.norm()) > 0.05  # rank-r term


def test_the_projection_kernel_is_the_matmul() -> None:
    """`lowrank_project` at fp32 operands: `g @ basis` within fp32 rounding, over several
    column steps and a ragged last one; the same bits on a second call (one fixed order)."""
    gen = torch.Generator().manual_seed(5)
    g, basis = torch.randn(45, 333, generator=gen), torch.randn(333, 12, generator=gen)
    out = ops.lowrank_project(g.to(DEVICE), basis.to(DEVICE), "ieee").cpu()
    exact = g.double() @ basis.double()
    assert float((out.double() - exact).norm() / exact.norm()) < 1e-6
    assert torch.equal(out, ops.lowrank_project(g.to(DEVICE), basis.to(DEVICE), "ieee").cpu())
    with pytest.raises(ValueError, match="precision='fp16'; allowed: ieee, tf32, bf16"):
        ops.lowrank_project(g, basis, "fp16")
    with pytest.raises(ValueError, match=r"basis has shape \(332, 12\), expected \(333, 12\)"):
        ops.lowrank_project(g, basis[:332], "ieee")


def test_a_zero_tensor_and_an_empty_one() -> None:
    spec = FormatSpec("int4", block_size=16)
    for x in (torch.zeros(3, 20), torch.zeros(0, 20)):
        s, ts = codec.choose_scales(x, spec)
        k_s, k_ts = _kernel_scales(x, "int4", 16)
        assert torch.equal(k_s, s) and same_bits(k_ts, ts)
        ref = codec.encode(x, spec, s, ts)
        assert torch.equal(ops.encode(x.to(DEVICE), s.to(DEVICE), ts.to(DEVICE), "int4", 16).cpu(), ref)
        dec = ops.decode(ref.unsqueeze(0).to(DEVICE), s.unsqueeze(0).to(DEVICE), ts.to(DEVICE), "int4", 16, 20,
                         True, False).cpu()
        assert same_bits(dec, codec.decode(ref, spec, s, ts, 20))


def test_the_dispatch_on_the_cpu_is_the_reference_codec() -> None:
    """On CPU tensors `gift_compile.kernels` runs the reference codec (Inductor compiles it):
    the functions give its results, and a traced encode holds no kernel operator."""
    spec = FormatSpec("nvfp4")
    x = edge_gradient(7, 83, seed=5)
    assert not kernels.codec_path(spec, x.device).kernels
    s, ts = kernels.choose_scales(x, spec)
    ref_s, ref_ts = codec.choose_scales(x, spec)
    assert torch.equal(s, ref_s) and same_bits(ts, ref_ts)
    item = ItemPlan(name="w", rows=8, cols=40, format="nvfp4")
    plan = BucketPlan((item,), 2, None, True, "reduce_scatter")
    gm = make_fx(lambda g: encode_item(g, ItemTensors(()), Shared(), item, plan))(torch.randn(8, 40))
    assert not [n for n in gm.graph.nodes if "gift_kernels" in str(n.target)]


@pytest.mark.parametrize("fmt", ["nvfp4", "int3"])
def test_the_exchange_on_the_kernel_path_sends_and_sums_the_reference_bytes(fmt: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The exchange's stages on the kernel path, run in the interpreter: the dispatch is told that
    CPU tensors take the CUDA choice, so `kernels.choose_scales` / `encode` / `decode` /
    `decode_sum` compose the operators exactly as on a GPU (statistics, their maximum, codes;
    2-D and per-sender decodes; the averaged sum). The send blocks, the error-feedback residual,
    the reduce-scatter's averaged shard, the all-reduce's re-encoded shard and the gathered
    result must equal, bit for bit, those of the reference codec (the same stages unpatched)."""
    item = ItemPlan(name="w", rows=6, cols=40, format=fmt, block_size=16, error_feedback=True)
    reference = exchange_round_trip(item)
    calls = on_kernel_path(monkeypatch, ops, ("block_stat", "scale_codes", "encode", "decode"))
    on_kernels = exchange_round_trip(item)
    assert sorted(set(calls)) == ["block_stat", "decode", "encode", "scale_codes"]  # the kernel path did run
    for got, want in zip(on_kernels, reference):
        assert same_bits(got, want)
    assert reference[3].abs().sum() > 0 and reference[2].abs().sum() > 0




def test_the_exchange_emits_the_kernel_operators_for_cuda_tensors() -> None:
    """The per-item codec traced as the FX pass traces it (`make_fx` on fake tensors) over
    CUDA tensors: the sender's scales and encode and the receiver's decode-and-sum are the
    registered operators."""
    item = ItemPlan(name="w", rows=8, cols=40, format="nvfp4")
    plan = BucketPlan((item,), 2, None, True, "reduce_scatter")

    def trace(plan_item: ItemPlan, p: BucketPlan) -> tuple[list[str], list[str]]:
        mode = FakeTensorMode()
        with mode:
            enc = make_fx(lambda g: encode_item(g, ItemTensors(()), Shared(), plan_item, p))(
                fake_cuda(mode, (8, 40), torch.float32))
            dec = make_fx(lambda r: decode_item(r, 0, ItemTensors(()), plan_item, p)[0])(
                fake_cuda(mode, (2, item_width(plan_item, p)), torch.uint8))
        return kernel_ops(enc), kernel_ops(dec)

    enc, dec = trace(item, plan)
    assert enc == ["gift_kernels.block_stat.default", "gift_kernels.scale_codes.default",
                   "gift_kernels.encode.default"]
    assert dec == ["gift_kernels.decode.default"]
    # the reference codec's spelling does not trace on fake CUDA tensors in a CPU-only torch
    # (it indexes on the device), so the other choices are read off the same decision
    cuda = torch.device("cuda")
    assert kernels.codec_path(item.spec, cuda).kernels
    with kernels.use_kernels(False):
        assert not kernels.codec_path(item.spec, cuda).kernels
    assert kernels.codec_path(item.spec, cuda).kernels
    assert not kernels.codec_path(FormatSpec("mxfp8"), cuda).kernels
    assert not kernels.codec_path(item.spec, cuda, stochastic_rounding=True).kernels


def test_the_exchange_runs_a_low_rank_map_on_cuda_as_the_map_kernels() -> None:
    """A low-rank item traced on fake CUDA tensors: with the default `map_precision` ("auto")
    the sender's forward map is the projection operator and the expansion fused into the block
    statistics and the encode (tests/test_fused_sender.py), the receiver's inverse the
    projection and expansion operators after the decode; "exact" would run torch's matmul and
    pointwise map instead."""
    rank = 4
    p_item = ItemPlan(name="w", rows=8, cols=40, format="nvfp4", kind="lowrank", n_tensors=5)
    plan = BucketPlan((p_item,), 2, None, True, "reduce_scatter")
    shapes = ((40,), (40, rank), (rank,), (rank,), (40,))

    def trace(item: ItemPlan) -> tuple[list[str], list[str]]:
        p = BucketPlan((item,), 2, None, True, "reduce_scatter")
        mode = FakeTensorMode()
        with mode:
            maps = ItemTensors(tuple(fake_cuda(mode, s, torch.float32) for s in shapes))
            enc = make_fx(lambda g: encode_item(g, maps, Shared(), item, p))(fake_cuda(mode, (8, 40), torch.float32))
            dec = make_fx(lambda r: decode_item(r, 0, maps, item, p)[0])(
                fake_cuda(mode, (2, item_width(item, p)), torch.uint8))
        return kernel_ops(enc), kernel_ops(dec)

    assert p_item.map_precision == "auto" and item_width(p_item, plan) > 0
    enc, dec = trace(p_item)
    assert enc == ["gift_kernels.lowrank_project.default", "gift_kernels.lowrank_block_stat.default",
                   "gift_kernels.scale_codes.default", "gift_kernels.lowrank_encode.default"]
    assert dec == ["gift_kernels.decode.default", "gift_kernels.lowrank_project.default",
                   "gift_kernels.lowrank_expand.default"]
    # the exact map's spelling does not trace on fake CUDA tensors in a CPU-only torch (its
    # transposed copy dispatches to a CUDA kernel), so "exact" is read off the same decision
    assert not kernels.map_path(dataclasses.replace(p_item, map_precision="exact").map_precision,
                                torch.device("cuda")).kernels


def test_the_map_path_follows_the_precision_the_device_and_the_switch(caplog: pytest.LogCaptureFixture,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`map_path`: "auto" is TF32 on CUDA and exact elsewhere, "tf32"/"bf16" run as asked on CUDA,
    "exact" everywhere; on the CPU a tensor-core precision runs the exact map with a warning
    logged once, and with the kernels switched off CUDA runs the exact map too."""
    from gift_compile.kernels import map_dispatch
    from gift_compile.kernels.map_dispatch import CUDA_DEFAULT, MapPrecision

    monkeypatch.setattr(map_dispatch, "_noted", set())  # logged once per process: whatever ran before
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert CUDA_DEFAULT is MapPrecision.TF32
    assert [kernels.map_path(p, cuda).precision for p in ("auto", "exact", "tf32", "bf16")] == ["tf32", "exact",
                                                                                                 "tf32", "bf16"]
    assert all(kernels.map_path(p, cpu).precision == "exact" for p in ("auto", "exact", "tf32", "bf16"))
    assert kernels.map_path("auto", cuda).kernels and not kernels.map_path("auto", cpu).kernels
    with kernels.use_kernels(False):
        assert kernels.map_path("bf16", cuda).precision == "exact"
    with pytest.raises(ValueError, match="map_precision='fp16'; allowed: auto, exact, tf32, bf16"):
        kernels.map_path("fp16", cuda)
    with caplog.at_level(logging.INFO, logger="gift_compile"):
        for _ in range(2):
            kernels.note_map_path("bf16", cpu)
            kernels.note_map_path("auto", cpu)
        kernels.note_map_path("bf16", cuda)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["GIFT low-rank map: map_precision='bf16' asks for tensor-core matmuls, which run on CUDA only: "
                        "cpu tensors run the fixed-order fp32 map (logged once)"]
    assert any("bf16 operands and fp32 accumulation" in r.getMessage() for r in caplog.records
               if r.levelno == logging.INFO)


def test_the_cuda_path_is_logged_once_with_its_reason(caplog: pytest.LogCaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from gift_compile.kernels import dispatch

    monkeypatch.setattr(dispatch, "_noted", set())  # logged once per process: whatever ran before
    cuda = torch.device("cuda")
    with caplog.at_level(logging.INFO, logger="gift_compile"):
        assert kernels.note_path(FormatSpec("int3", block_size=32), cuda).kernels
        path = kernels.note_path(FormatSpec("mxint4"), cuda)
        kernels.note_path(FormatSpec("mxint4"), cuda)
        sr = kernels.note_path(FormatSpec("int3", block_size=32), cuda, stochastic_rounding=True)
    assert not path.kernels and "has no explicit kernels" in path.reason
    assert not sr.kernels and "stochastic rounding" in sr.reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("mxint4" in m for m in warnings) == 1  # once per process, not per call
    assert any("int3: explicit Triton kernels" in r.getMessage() for r in caplog.records
               if r.levelno == logging.INFO)


def test_compile_keeps_a_kernel_as_one_operator() -> None:
    """`torch.compile(fullgraph=True)` of a function calling the encoder: Dynamo's graph holds
    the registered operator as a single node (not the kernel's Triton code, not a graph
    break), and the compiled function writes the reference bytes."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        graphs.append(gm)
        return gm.forward

    spec = FormatSpec("int4", block_size=32)
    x = edge_gradient(7, 83, seed=9, huge=False, nonfinite=False)
    s, ts = codec.choose_scales(x, spec)

    def fn(x: torch.Tensor, s: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
        return ops.encode(x * 1.0, s, ts, "int4", 32)

    out = torch.compile(fn, backend=backend, fullgraph=True)(x.to(DEVICE), s.to(DEVICE), ts.to(DEVICE))
    assert torch.equal(out.cpu(), codec.encode(x, spec, s, ts))
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls if "gift_kernels" in str(n.target)] == [torch.ops.gift_kernels.encode.default]
    assert len(calls) == 2  # the multiply and the operator


def test_compile_keeps_the_map_kernels_as_two_operators_without_recompiling() -> None:
    """`torch.compile(fullgraph=True)` of `lowrank_map` (what `LowRank` calls on CUDA): Dynamo's
    graph holds the projection and the expansion as one node each, the result is the eager
    one, and a second call with other data (other map tensors, same shapes) reuses the graph."""
    from gift_compile.kernels.map_dispatch import lowrank_map

    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda g, u, c, d, q: lowrank_map(g, u, c, d, q, "ieee"), backend=backend, fullgraph=True)
    for seed in (1, 2):
        dinv, v, cf, _, dsq = (t.to(DEVICE) for t in _lowrank_map(72, 8, seed))
        g = torch.randn(20, 72, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        u = v * dinv.unsqueeze(1)
        assert torch.equal(fn(g, u, cf, dinv, dsq).cpu(), lowrank_map(g, u, cf, dinv, dsq, "ieee").cpu())
    (gm,) = graphs
    assert kernel_ops(gm) == ["gift_kernels.lowrank_project.default", "gift_kernels.lowrank_expand.default"]


def test_the_low_rank_map_compiles_its_precision_choice_once() -> None:
    """`LowRank.apply_forward` / `apply_inverse` at every precision under
    `torch.compile(fullgraph=True)`: the choice (`map_path`: the spelling's lookup, the switch)
    traces without a graph break, and new map values or a new gradient recompile nothing. On
    the CPU every precision runs the exact map, so the results are the eager exact ones."""
    from gift_compile.geometry.maps import LowRank

    compiles = 0

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        nonlocal compiles
        compiles += 1
        return gm.forward

    for precision in ("auto", "exact", "tf32", "bf16"):
        fn = torch.compile(lambda g, t: LowRank.apply_inverse(LowRank.apply_forward(g, t, precision), t, precision),
                           backend=backend, fullgraph=True, dynamic=False)
        before = compiles
        for seed in (3, 4):
            t = _lowrank_map(64, 8, seed)
            g = torch.randn(16, 64, generator=torch.Generator().manual_seed(seed))
            want = LowRank.apply_inverse(LowRank.apply_forward(g, t), t)
            assert torch.allclose(fn(g, t), want, rtol=0, atol=1e-6)
        assert compiles == before + 1, precision


def test_the_operators_refuse_bad_inputs_by_name() -> None:
    x = torch.zeros(4, 32)
    s, ts = torch.zeros(4, 2, dtype=torch.uint8), torch.ones(1)
    with pytest.raises(ValueError, match="x must be torch.float32"):
        ops.encode(x.double(), s, ts, "int4", 16)
    with pytest.raises(ValueError, match=r"scales has shape \(4, 3\), expected \(4, 2\)"):
        ops.encode(x, torch.zeros(4, 3, dtype=torch.uint8), ts, "int4", 16)
    with pytest.raises(ValueError, match="unit stride"):
        ops.block_stat(torch.zeros(32, 4).t(), "int4", 16)
    with pytest.raises(ValueError, match="'fp8_e4m3' has no explicit codec kernels"):
        ops.block_stat(x, "fp8_e4m3", 16)
    with pytest.raises(ValueError, match="payload has 9 bytes per row, but cols=32 needs 16"):
        ops.decode(torch.zeros(1, 4, 9, dtype=torch.uint8), s.unsqueeze(0), ts, "int4", 16, 32, True, False)
