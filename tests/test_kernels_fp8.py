"""The fp8 formats' Triton kernels (gift_compile.kernels.ops_fp8) against the reference codec, bit for bit.

As in tests/test_kernels.py: on a machine without CUDA the kernels run in Triton's interpreter
(`TRITON_INTERPRET=1`, set by tests/conftest.py), with CUDA compiled on the GPU, and every
result is compared with the reference codec (`gift_compile.codec`, eager on the CPU): scales
(as fp32 bits), payload bytes, decoded values and their sum over senders, for fp8_e4m3 and
fp8_e5m2 at tensor, row and block scaling (a block that is not a power of two included). The
inputs cover columns that are not a multiple of the block, one row, zeros and -0.0, tiny values
(subnormal fp32 and subnormal float8 codes), huge ones (saturation, and decoded values past
fp32's range) and NaN/Inf; the float8 code is also checked against ATen's cast on every float8
value and the ties between them. Also here: the exchange's per-item codec on the kernel path
(the same bytes as the reference), the operators it emits for CUDA tensors, the path choice
for what the kernels do not serve, and the operators' input checks.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from bit_checks import edge_gradient, exchange_round_trip, fake_cuda, kernel_ops, on_kernel_path, same_bits
from conftest import require

require("triton", "the codec kernels need Triton (the `test` extra installs it)")

from gift_compile import codec, kernels  # noqa: E402  (after the Triton check)
from gift_compile.codec import FormatSpec  # noqa: E402
from gift_compile.codec.scales import _global_max  # noqa: E402
from gift_compile.exchange.item_codec import ItemTensors, Shared, decode_item, encode_item, item_width  # noqa: E402
from gift_compile.exchange.plan import BucketPlan, ItemPlan  # noqa: E402
from gift_compile.kernels import ops_fp8  # noqa: E402
from gift_compile.kernels.formats import FP8_MAX_BLOCK  # noqa: E402

# numpy's warnings from the interpreter running the NaN/Inf cases (inf * 0 and the like), intended
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = ("fp8_e4m3", "fp8_e5m2")
# every scaling; block scaling at the default block and at one that is not a power of two
SCALINGS = [("tensor", 32), ("row", 32), ("block", 32), ("block", 6)]
CASES = [(f, s, b) for f in FP8 for s, b in SCALINGS]
IDS = [f"{f}-{s}-b{b}" for f, s, b in CASES]




def _same_codes(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Equal payload bytes. Exactly so on the CPU (the interpreter against the eager reference).
    Run on CUDA against the CPU's reference, a NaN code's sign bit is left out: it is the sign
    of the scaled value's NaN (ATen's cast writes it, and so do the kernels), which each device's
    multiply sets its own way (the CPU keeps a NaN operand's sign and makes inf * 0 a negative
    NaN, CUDA returns a positive canonical NaN), so the reference on CUDA writes the kernels'."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return False
    if DEVICE.type == "cuda":
        got, ref = (torch.where((t & 127) == 127, 127, t) for t in (got, ref))  # the one NaN code both write
    return torch.equal(got, ref)


def _kernel_scales(x: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """The scales the kernel path chooses (`kernels.choose_scales` on CUDA): the scale kernel,
    and for a per-tensor scale the maximum of its row statistics and `Float8.scales_of`."""
    s = ops_fp8.fp8_scales(x.to(DEVICE), spec.name, spec.scaling.value, spec.block_size)
    return (spec.family.scales_of(_global_max(s)) if spec.single_scale else s).cpu()


def _encode(x: torch.Tensor, scales: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    return ops_fp8.fp8_encode(x.to(DEVICE), scales.to(DEVICE), spec.name, spec.scaling.value, spec.block_size).cpu()


def _decode(payload: torch.Tensor, scales: torch.Tensor, spec: FormatSpec, cols: int, reduce: bool = False,
            average: bool = False) -> torch.Tensor:
    """The decode operator on `[senders, rows, padded cols]` payloads with per-sender scales."""
    return ops_fp8.fp8_decode(payload.to(DEVICE), scales.to(DEVICE), spec.name, spec.scaling.value, spec.block_size,
                              cols, reduce, average).cpu()


def _sender_scales(scales: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """One sender's scales with a leading sender dim, as the decode operator takes them."""
    return scales.reshape(1) if spec.single_scale else scales.unsqueeze(0)


@pytest.mark.parametrize(("fmt", "scaling", "block"), CASES, ids=IDS)
@pytest.mark.parametrize(("rows", "cols"), [(7, 83), (1, 7)], ids=["7x83", "1x7"])
def test_scales_encode_and_decode_match_the_reference(fmt: str, scaling: str, block: int, rows: int,
                                                      cols: int) -> None:
    spec = FormatSpec(fmt, scaling, block)
    variants = (edge_gradient(rows, cols, seed=rows * cols + block, fp32_max=True),
                edge_gradient(rows, cols, seed=rows + block, nonfinite=False, fp32_max=True),
                edge_gradient(rows, cols, seed=cols + block, huge=False, nonfinite=False))
    for x in variants:
        ref_scales, none = codec.choose_scales(x, spec)
        assert none is None
        scales = _kernel_scales(x, spec)
        assert same_bits(scales, ref_scales), (scales, ref_scales)
        ref = codec.encode(x, spec, ref_scales)
        got = _encode(x, ref_scales, spec)
        assert _same_codes(got, ref), f"{spec}: {(got != ref).sum()} of {ref.numel()} payload bytes differ"
        dec = _decode(ref.unsqueeze(0), _sender_scales(ref_scales, spec), spec, cols)
        assert same_bits(dec[0], codec.decode(ref, spec, ref_scales, None, cols))
    if rows > 1:  # many distinct bytes were compared, not a constant payload
        assert torch.unique(ref).numel() > 8
        assert torch.isinf(_kernel_scales(variants[0], spec)).any()  # the NaN/Inf group's marker


@pytest.mark.parametrize(("fmt", "scaling", "block"), [c for c in CASES if c[1] != "tensor"],
                         ids=[i for c, i in zip(CASES, IDS) if c[1] != "tensor"])
def test_one_kernel_chooses_the_scales_and_writes_the_reference_bytes(fmt: str, scaling: str, block: int) -> None:
    """Row and block scaling in one kernel (`fp8_scale_encode`): the reference's scales and
    bytes, for the same edge cases (a row of one column too); a per-tensor scale is refused."""
    spec = FormatSpec(fmt, scaling, block)
    for x in (edge_gradient(7, 83, seed=block, fp32_max=True),
              edge_gradient(7, 83, seed=block + 1, nonfinite=False, fp32_max=True), edge_gradient(1, 7, seed=2),
              torch.zeros(2, 9), torch.zeros(0, 9)):
        ref_scales, _ = codec.choose_scales(x, spec)
        codes, scales = ops_fp8.fp8_scale_encode(x.to(DEVICE), fmt, scaling, block)
        assert same_bits(scales.cpu(), ref_scales)
        assert _same_codes(codes.cpu(), codec.encode(x, spec, ref_scales))
    codes, _ = ops_fp8.fp8_scale_encode(edge_gradient(7, 83, seed=block, fp32_max=True).to(DEVICE), fmt, scaling, block)
    assert torch.unique(codes).numel() > 8  # many distinct bytes were compared, not a constant payload
    with pytest.raises(ValueError, match="gift_kernels.fp8_scale_encode: scaling='tensor' needs the whole tensor"):
        ops_fp8.fp8_scale_encode(torch.zeros(2, 4), fmt, "tensor", block)


@pytest.mark.parametrize("fmt", FP8)
def test_the_code_rounds_like_the_float8_cast(fmt: str) -> None:
    """Under a scale of 1, the code of every float8 value (both signs), the midpoints between
    neighbours (ties to even), one float either side of each, log-uniform values across and
    below the subnormal range, values past the largest (saturation), fp32 subnormals, +-0,
    +-inf and NaN, against the reference (the clamp and ATen's cast)."""
    spec = FormatSpec(fmt, "row")
    dtype = spec.family.elements.dtype
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = values[torch.isfinite(values)].sort().values
    mids = (values[1:] + values[:-1]) / 2
    around = torch.cat([torch.nextafter(mids, torch.tensor(-1e30)), torch.nextafter(mids, torch.tensor(1e30))])
    logu = torch.exp2(torch.empty(4000).uniform_(-20, 17, generator=torch.Generator().manual_seed(3)))
    fmax = spec.family.elements.fmax
    extra = torch.tensor([fmax, fmax * 1.03, fmax * 1.0625, fmax * 1.07, 1e6, 3e38, 1e-45, 1e-40, 0.0, -0.0,
                          float("inf"), float("-inf"), float("nan")])
    v = torch.cat([values, mids, around, logu, -logu, extra])
    x = v.reshape(1, -1)
    scales = torch.ones(1)
    ref = codec.encode(x, spec, scales)
    got = _encode(x, scales, spec)
    assert _same_codes(got, ref), v[(got != ref).reshape(-1)][:8]
    assert torch.unique(ref).numel() > 240  # every finite code (248 for E5M2, 254 for E4M3) and a NaN


@pytest.mark.parametrize("fmt", FP8)
def test_every_byte_decodes_like_the_reference(fmt: str) -> None:
    """All 256 bytes (NaN codes, E5M2's +-inf, subnormals, -0.0) under scales from 2**-126 to
    2**127 (products past fp32's range saturate) and +inf (the non-finite marker: NaN)."""
    spec = FormatSpec(fmt, "row")
    rows = 6
    payload = torch.arange(256, dtype=torch.uint8).repeat(rows, 1)
    scales = torch.tensor([2.0**-126, 2.0**-20, 1.0, 2.0**40, 2.0**127, float("inf")])
    ref = codec.decode(payload, spec, scales, None, 256)
    got = _decode(payload.unsqueeze(0), scales.unsqueeze(0), spec, 256)[0]
    assert same_bits(got, ref)
    assert (ref == torch.finfo(torch.float32).max).any() and torch.isnan(ref[5]).all()


@pytest.mark.parametrize(("fmt", "scaling", "block"), CASES, ids=IDS)
def test_encode_on_scales_of_another_tensor_matches_the_reference(fmt: str, scaling: str, block: int) -> None:
    """`encode` takes any agreed scales: values far past the range (saturation), NaN, +-inf and
    +-0 under finite scales, and finite values under a +inf scale (+-0 codes)."""
    spec = FormatSpec(fmt, scaling, block)
    scales, _ = codec.choose_scales(edge_gradient(7, 83, seed=21, huge=False, nonfinite=False), spec)
    x = edge_gradient(7, 83, seed=22, huge=False, nonfinite=False) * 40.0
    x[0, :5] = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0])
    if spec.single_scale:
        scales_inf = torch.full_like(scales, float("inf"))
    else:
        scales_inf = scales.clone()
        scales_inf[1] = float("inf")  # row 1 (or its blocks) under the non-finite marker
    for s in (scales, scales_inf):
        ref = codec.encode(x, spec, s)
        got = _encode(x, s, spec)
        assert _same_codes(got, ref), f"{spec}: {(got != ref).sum()} of {ref.numel()} payload bytes differ"


@pytest.mark.parametrize(("fmt", "scaling", "block"), CASES, ids=IDS)
def test_decode_and_sum_over_senders_match_the_reference(fmt: str, scaling: str, block: int) -> None:
    """Three senders, each with its own payload and scales (one holding NaN/Inf: its group, or
    its whole tensor, decodes to NaN): each sender's values, their sum in rank order, and the
    average, against the reference's decode and `.sum(0)`."""
    spec = FormatSpec(fmt, scaling, block)
    rows, cols = 7, 83
    payloads, scales = [], []
    for seed in range(3):
        x = edge_gradient(rows, cols, seed=100 + seed, huge=False, nonfinite=seed == 1)
        s, _ = codec.choose_scales(x, spec)
        payloads.append(codec.encode(x, spec, s))
        scales.append(s)
    p, s = torch.stack(payloads), torch.stack(scales)
    ref = codec.decode(p, spec, s.reshape(3, 1, 1) if spec.single_scale else s, None, cols)
    ks = s.reshape(3) if spec.single_scale else s
    each = _decode(p, ks, spec, cols)
    assert same_bits(each, ref)
    assert torch.isnan(each[1]).any() and not torch.isnan(each[0]).any()
    assert same_bits(_decode(p, ks, spec, cols, True), ref.sum(dim=0))
    assert same_bits(_decode(p, ks, spec, cols, True, True), (ref / 3).sum(dim=0))  # each sender's share first
    finite = _decode(p[[0, 2]], ks[[0, 2]], spec, cols, True, True)
    assert same_bits(finite, (ref[[0, 2]] / 2).sum(dim=0)) and torch.isfinite(finite).all()
    assert (finite != 0).float().mean() > 0.3  # real values were compared, not a zero sum


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
def test_tiny_values_and_zeros_code_like_the_reference(fmt: str, scaling: str) -> None:
    """Gradients near fp32's smallest values (scales at their floor, 2**-126, and subnormal
    float8 codes), an all-zero tensor (scale 1) and an empty one."""
    spec = FormatSpec(fmt, scaling, 16)
    g = torch.Generator().manual_seed(31)
    tiny = torch.randn(4, 40, generator=g) * torch.tensor([1e-38, 3e-40, 2e-42, 1e-44]).unsqueeze(1)
    for x in (tiny, torch.zeros(3, 20), torch.zeros(0, 20)):
        ref_scales, _ = codec.choose_scales(x, spec)
        assert same_bits(_kernel_scales(x, spec), ref_scales)
        ref = codec.encode(x, spec, ref_scales)
        assert _same_codes(_encode(x, ref_scales, spec), ref)
        if x.numel():
            dec = _decode(ref.unsqueeze(0), _sender_scales(ref_scales, spec), spec, x.shape[1], True)
            # the sum over the one sender: -0.0 codes sum to +0.0, as the reference's `.sum(0)`
            assert same_bits(dec, codec.decode(ref, spec, ref_scales, None, x.shape[1]).unsqueeze(0).sum(dim=0))
    assert (codec.encode(tiny, spec, codec.choose_scales(tiny, spec)[0]) & 127).unique().numel() > 4


@pytest.mark.parametrize(("fmt", "scaling", "block"), [("fp8_e4m3", "row", 32), ("fp8_e4m3", "tensor", 32),
                                                       ("fp8_e5m2", "block", 16)])
def test_the_exchange_on_the_kernel_path_sends_and_sums_the_reference_bytes(fmt: str, scaling: str, block: int,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The exchange's stages with the dispatch told that CPU tensors take the CUDA choice, so
    `kernels.choose_scales` / `encode` / `decode` / `decode_sum` compose the fp8 operators as on
    a GPU: the send blocks, the non-finite flag, the error-feedback residual, the
    reduce-scatter's averaged shard, the all-reduce's re-encoded shard and the gathered result
    equal those of the reference codec bit for bit."""
    item = ItemPlan(name="w", rows=6, cols=40, format=fmt, scaling=scaling, block_size=block, error_feedback=True)
    reference = exchange_round_trip(item)
    calls = on_kernel_path(monkeypatch, ops_fp8, ("fp8_scales", "fp8_scale_encode", "fp8_encode", "fp8_decode"))
    on_kernels = exchange_round_trip(item)
    # the kernel path did run: one kernel for row and block scales and codes, two for a tensor scale
    encoders = ["fp8_encode", "fp8_scales"] if scaling == "tensor" else ["fp8_scale_encode"]
    assert sorted(set(calls)) == sorted(["fp8_decode", *encoders])
    for got, want in zip(on_kernels, reference):
        assert same_bits(got, want)
    assert reference[3].abs().sum() > 0 and reference[2].abs().sum() > 0



@pytest.mark.parametrize("scaling", ["row", "tensor", "block"])
def test_the_exchange_emits_the_fp8_operators_for_cuda_tensors(scaling: str) -> None:
    """The per-item codec traced as the FX pass traces it (`make_fx` on fake CUDA tensors), in
    the default format (fp8_e4m3) at each scaling: the sender's scales and encode (one operator
    for row and block scaling) and the receiver's decode-and-sum are the fp8 operators."""
    item = ItemPlan(name="w", rows=8, cols=40, format="fp8_e4m3", scaling=scaling)
    plan = BucketPlan((item,), 2, None, True, "reduce_scatter")
    mode = FakeTensorMode()
    with mode:
        enc = make_fx(lambda g: encode_item(g, ItemTensors(()), Shared(), item, plan))(
            fake_cuda(mode, (8, 40), torch.float32))
        dec = make_fx(lambda r: decode_item(r, 0, ItemTensors(()), item, plan)[0])(
            fake_cuda(mode, (2, item_width(item, plan)), torch.uint8))

    if scaling == "tensor":  # the rows' statistics, their maximum, then the codes
        assert kernel_ops(enc) == ["gift_kernels.fp8_scales.default", "gift_kernels.fp8_encode.default"]
    else:  # the scales and codes in one kernel
        assert kernel_ops(enc) == ["gift_kernels.fp8_scale_encode.default"]
    assert kernel_ops(dec) == ["gift_kernels.fp8_decode.default"]


def test_what_the_fp8_kernels_do_not_serve_keeps_the_generated_codec(caplog: pytest.LogCaptureFixture,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA both fp8 formats take the kernels at every scaling (the default config's format
    included); a scale block longer than `FP8_MAX_BLOCK` and stochastic rounding's encoder keep
    the Inductor-generated codec, each with its reason logged once."""
    from gift_compile.kernels import dispatch

    monkeypatch.setattr(dispatch, "_noted", set())  # logged once per process: whatever ran before
    cuda = torch.device("cuda")
    for fmt in FP8:
        for scaling, block in SCALINGS:
            assert kernels.codec_path(FormatSpec(fmt, scaling, block), cuda).kernels
    long_block = FormatSpec("fp8_e4m3", "block", FP8_MAX_BLOCK + 2)
    with caplog.at_level(logging.INFO, logger="gift_compile"):
        for _ in range(2):
            path = kernels.note_path(long_block, cuda)
        sr = kernels.note_path(FormatSpec("fp8_e5m2", "row"), cuda, stochastic_rounding=True)
        assert kernels.note_path(FormatSpec("fp8_e5m2", "row"), cuda).kernels  # its scales and decode
    assert not path.kernels and f"at most {FP8_MAX_BLOCK} elements" in path.reason
    assert not sr.kernels and "stochastic rounding" in sr.reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum(f"block_size={FP8_MAX_BLOCK + 2}" in m for m in warnings) == 1
    with pytest.raises(ValueError, match=f"gift_kernels.fp8_scales: .*at most {FP8_MAX_BLOCK}"):
        ops_fp8.fp8_scales(torch.zeros(2, 2 * FP8_MAX_BLOCK), "fp8_e4m3", "block", FP8_MAX_BLOCK + 2)


def test_the_fp8_operators_refuse_bad_inputs_by_name() -> None:
    x = torch.zeros(4, 32)
    with pytest.raises(ValueError, match="gift_kernels.fp8_scales: unknown format 'fp9'"):
        ops_fp8.fp8_scales(x, "fp9", "row", 32)
    with pytest.raises(ValueError, match="gift_kernels.fp8_scales: .*'nvfp4' has no explicit fp8 codec kernels"):
        ops_fp8.fp8_scales(x, "nvfp4", "row", 32)
    with pytest.raises(ValueError, match="gift_kernels.fp8_encode: x must be torch.float32"):
        ops_fp8.fp8_encode(x.double(), torch.ones(4), "fp8_e4m3", "row", 32)
    with pytest.raises(ValueError, match=r"gift_kernels.fp8_encode: scales has shape \(1,\), expected \(4,\)"):
        ops_fp8.fp8_encode(x, torch.ones(1), "fp8_e4m3", "row", 32)
    with pytest.raises(ValueError, match=r"gift_kernels.fp8_encode: scales must be torch.float32 with 2 dims"):
        ops_fp8.fp8_encode(x, torch.ones(4, 2, dtype=torch.uint8), "fp8_e4m3", "block", 16)
    with pytest.raises(ValueError, match="unit stride"):
        ops_fp8.fp8_scales(torch.zeros(32, 4).t(), "fp8_e4m3", "row", 32)
    with pytest.raises(ValueError, match="payload has 30 bytes per row, but cols=32 needs 32"):
        ops_fp8.fp8_decode(torch.zeros(1, 4, 30, dtype=torch.uint8), torch.ones(1, 4), "fp8_e4m3", "row", 32, 32,
                           True, False)
    with pytest.raises(ValueError, match=r"gift_kernels.fp8_decode: scales has shape \(1, 4\), expected \(2, 4\)"):
        ops_fp8.fp8_decode(torch.zeros(2, 4, 32, dtype=torch.uint8), torch.ones(1, 4), "fp8_e4m3", "row", 32, 32,
                           True, False)
    with pytest.raises(ValueError, match="average=True needs reduce=True"):
        ops_fp8.fp8_decode(torch.zeros(1, 4, 32, dtype=torch.uint8), torch.ones(1), "fp8_e4m3", "tensor", 32, 32,
                           False, True)


def test_compile_keeps_the_scale_and_encode_kernel_as_one_operator() -> None:
    """`torch.compile(fullgraph=True)` of a function calling the one-kernel scales and codes
    (an operator with two outputs): Dynamo's graph holds it as a single node, not a graph
    break, and the compiled function gives the reference's scales and bytes."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        graphs.append(gm)
        return gm.forward

    spec = FormatSpec("fp8_e4m3", "row")
    x = edge_gradient(7, 83, seed=9, fp32_max=True)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ops_fp8.fp8_scale_encode(x * 1.0, "fp8_e4m3", "row", 32)

    codes, scales = torch.compile(fn, backend=backend, fullgraph=True)(x.to(DEVICE))
    ref_scales, _ = codec.choose_scales(x, spec)
    assert same_bits(scales.cpu(), ref_scales) and _same_codes(codes.cpu(), codec.encode(x, spec, ref_scales))
    (gm,) = graphs
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function" and "gift_kernels" in str(n.target)]
    assert calls == [torch.ops.gift_kernels.fp8_scale_encode.default]
