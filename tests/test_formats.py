"""Numerics of the low-bit formats: error levels, exactness, padding, bytes, edge values,
leading-dim decoding, clear errors, compile parity."""

import math

import pytest
import torch

from gift_compile import GiftConfig
from gift_compile.codec import (
    FormatSpec, choose_scales, decode, dequantize, encode, quantize, wire_bytes, wire_bytes_for,
)

FP32_MAX = torch.finfo(torch.float32).max
# (format, scaling, block_size): every distinct code path.
ALL = [("fp32", "row", 32), ("bf16", "row", 32),
       ("fp8_e4m3", "tensor", 32), ("fp8_e4m3", "row", 32), ("fp8_e4m3", "block", 32),
       ("fp8_e5m2", "tensor", 32), ("fp8_e5m2", "row", 32), ("fp8_e5m2", "block", 16),
       ("mxfp8", "row", 32), ("nvfp4", "row", 32), ("mxint4", "row", 32),
       ("int6", "row", 16), ("int6", "row", 32), ("int4", "row", 16), ("int4", "row", 32),
       ("int3", "row", 16), ("int3", "row", 32), ("int2", "row", 16), ("int2", "row", 32),
       ("ternary", "row", 16), ("ternary", "row", 32)]
LOSSY = [c for c in ALL if c[0] != "fp32"]
# Relative L2 error of one round trip of standard Gaussian data (256 x 1024, seed 0):
# (lo, hi) around the measured value (docs/design.md, the formats table of bench.pages.blocks.formats).
LEVELS = {
    ("bf16", 32): (0.001, 0.003), ("fp8_e4m3", 32): (0.024, 0.029), ("fp8_e4m3", 16): (0.024, 0.029),
    ("fp8_e5m2", 32): (0.049, 0.057), ("fp8_e5m2", 16): (0.049, 0.057), ("mxfp8", 32): (0.026, 0.034),
    ("nvfp4", 32): (0.088, 0.102), ("mxint4", 32): (0.128, 0.139),
    ("int6", 16): (0.020, 0.023), ("int6", 32): (0.022, 0.025),
    ("int4", 16): (0.083, 0.090), ("int4", 32): (0.094, 0.102),
    ("int3", 16): (0.192, 0.207), ("int3", 32): (0.219, 0.235),
    ("int2", 16): (0.326, 0.346), ("int2", 32): (0.331, 0.351),
    ("ternary", 16): (0.416, 0.438), ("ternary", 32): (0.421, 0.443),
}
# Largest |decoded - x| / (max |x| over the element's scale group) for groups in the
# format's range, from each grid: bf16 half an ulp (2**-8 relative); e4m3 / e5m2 half an ulp
# (2**-4 / 2**-3); mxfp8 saturation of [256, 512) at 448 (1/8); nvfp4 half the top E2M1 step
# (1) times a block scale up to 1.0625 * amax / 6; mxint4 half a step of amax / [4, 8) and
# saturation at 7 (1/8); int4 / int3 half a step of 1.0625 * amax / 7 (/ 3), int6 of 1.0625 *
# amax / 29 (its maximum maps onto 29 of 31). int2 and ternary clip at a
# multiple of the block's mean |x|, so only "never more than the group maximum" holds.
GROUP_TOL = {"bf16": 2.0**-8, "fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3, "mxfp8": 0.125, "nvfp4": 1.0625 / 6,
             "mxint4": 0.125, "int4": 1.0625 * 0.5 / 7,
             "int6": 1.0625 * 0.5 / 29, "int3": 1.0625 * 0.5 / 3, "int2": 1.0, "ternary": 1.0}
# Smallest group maximum with the full grid: fp32's normal range, except mxint4, whose
# smallest E8M0 scale 2**-127 needs amax >= 4 * 2**-127 to put the amax in [4, 8).
FULL_RANGE = {"mxint4": 2.0**-125}
TWO_LEVEL_AMAX = ("nvfp4", "int6", "int4", "int3")  # E4M3 block scale under a tensor scale: 2**14 of range


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def gauss() -> torch.Tensor:
    return torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))


# The same with stochastic rounding (seed 1): measured value +-4% (bf16: sqrt(2) x nearest, as unbiased
# rounding to the same grid should be: variance ulp^2/6 against ulp^2/12).
SR_LEVELS = {
    "bf16": 0.00235, "fp8_e4m3": 0.0376, "fp8_e5m2": 0.0748, "mxfp8": 0.0394, "nvfp4": 0.1372, "mxint4": 0.1872,
    ("int6", 16): 0.0300, ("int6", 32): 0.0337, ("int4", 16): 0.1225, ("int4", 32): 0.1383,
    ("int3", 16): 0.2839, ("int3", 32): 0.3222, ("int2", 16): 0.4338, ("int2", 32): 0.4354,
    ("ternary", 16): 0.5284, ("ternary", 32): 0.5307,
}


@pytest.mark.parametrize("fmt,scaling,block", LOSSY)
def test_gaussian_error_levels(gauss, fmt, scaling, block):
    lo, hi = LEVELS[(fmt, block)]
    err = rel(dequantize(quantize(gauss, fmt, scaling=scaling, block_size=block)), gauss)
    assert lo < err < hi, f"{fmt}/{scaling}/{block}: relative L2 error {err:.4f} outside [{lo}, {hi}]"
    sr = rel(dequantize(quantize(gauss, fmt, scaling=scaling, block_size=block, stochastic_rounding=True, seed=1)), gauss)
    want = SR_LEVELS.get((fmt, block), SR_LEVELS.get(fmt))
    assert abs(sr / want - 1) < 0.04, f"{fmt}/{scaling}/{block}: stochastic-rounding error {sr:.4f}, expected ~{want}"


def test_fp32_is_lossless(gauss):
    assert torch.equal(dequantize(quantize(gauss, "fp32")), gauss)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "mxfp8", "nvfp4", "mxint4", "int6", "int4", "int3"])
def test_representable_values_round_trip_exactly(fmt):
    # Values on the format's grid whose block amax maps exactly onto the format maximum.
    if fmt == "nvfp4":
        grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 2)
        x = torch.cat([grid, -grid]).reshape(2, 16)
    elif fmt == "mxfp8":
        # amax 1.75 -> shared exponent 2^-8: 1.75 * 256 = 448, E4M3's maximum
        x = torch.tensor([1.0, 0.5, -0.25, 0.125, 1.75, -1.5, 0.0, 1.625] * 8).reshape(2, 32)
    elif fmt in ("mxint4", "int4"):
        # every integer in [-7, 7] in each block; amax 7 -> scale exactly 1
        x = torch.cat([torch.arange(-7.0, 8.0), torch.tensor([7.0]), torch.arange(7.0, -8.0, -1), torch.tensor([0.0])])
        x = torch.cat([x, x * 0.5]).reshape(2, 32)
    elif fmt == "int3":
        # every integer in [-3, 3]; amax 3 -> scale exactly 1
        x = torch.tensor([-3.0, -2, -1, 0, 1, 2, 3, 3] * 4).reshape(2, 16)
    elif fmt == "int6":
        # amax 29 -> scale exactly 1 (int6 maps the maximum onto 29), odd integers up to 29
        x = torch.cat([torch.arange(-29.0, 30.0, 2), torch.tensor([29.0, -29.0])]).reshape(2, 16)
    else:
        fmax = 448.0 if fmt == "fp8_e4m3" else 57344.0
        x = torch.tensor([fmax, 1.0, -2.0, 0.5, 0.0, -fmax / 4, 3.0, 1.5]).reshape(1, 8)
    y = dequantize(quantize(x, fmt, scaling="tensor", block_size=16))
    assert torch.equal(y, x), (fmt, (y - x).abs().max())


def _reference_int_formats(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """Plain float64 reading of the integer formats' documented semantics."""
    rows = x.shape[0]
    xb = x.double().reshape(rows, -1, block)

    def smallest_pow2_at_least(v: float) -> float:  # clamped to fp32's normal range
        if v == 0:
            return 1.0
        m, e = math.frexp(v)
        return 2.0 ** max(-126, e if m > 0.5 else e - 1)

    if fmt == "mxint4":
        _, e = torch.frexp(xb.abs().amax(-1))  # amax = m * 2^e, m in [0.5, 1): floor(log2) = e - 1
        unit = torch.exp2((e - 1 - 2).clamp(-127, 127).double())
    else:
        if fmt in ("int6", "int4", "int3"):
            stat, level = xb.abs().amax(-1), {"int6": 29.0, "int4": 7.0, "int3": 3.0}[fmt]
        else:
            stat, level = xb.abs().mean(-1) * {"int2": 0.625, "ternary": 1.5}[fmt], 1.0
        stat = stat.float()
        g = smallest_pow2_at_least(float(stat.max()) / (448.0 * level))
        # The block scale rounds the fp32 product stat * 2^-k * fl32(1 / level) to E4M3 (a
        # multiply, not a division, so that every device computes the same code).
        code = (stat * (1.0 / g) * torch.tensor(1.0 / level)).clamp(max=448).to(torch.float8_e4m3fn)
        unit = code.double() * g
    unit = unit.unsqueeze(-1)
    v = torch.where(unit > 0, xb / unit, 0.0)  # a block whose scale underflowed decodes to 0
    if fmt == "int2":
        odd = (torch.arange(x.shape[1]) % 2 == 1).reshape(-1, block)
        sign = torch.where((v < 0) | ((v == 0) & odd), -1.0, 1.0).double()
        q = torch.where(v.abs() > 2, 3.0, 1.0).double() * sign
    else:
        top = {"ternary": 1.0, "int6": 31.0, "int3": 3.0}.get(fmt, 7.0)
        q = torch.round(v).clamp(-top, top)  # round half to even
    return (q * unit).reshape(x.shape)


@pytest.mark.parametrize("fmt,block", [("mxint4", 32), ("int6", 16), ("int6", 32), ("int4", 16), ("int4", 32),
                                       ("int3", 16), ("int3", 32), ("int2", 16), ("int2", 32),
                                       ("ternary", 16), ("ternary", 32)])
def test_integer_formats_match_a_float64_reference(fmt, block):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 128, generator=g) * torch.rand(64, 1, generator=g) * 10
    x[::3] = (x[::3] * 4).bfloat16().float()  # few-bit values: exact rounding ties occur
    x[5, :40] = 0.0  # zeros inside and across blocks
    ref = _reference_int_formats(x, fmt, block)
    y = dequantize(quantize(x, fmt, block_size=block))
    assert torch.equal(y.double(), ref), (fmt, block, int((y.double() != ref).sum()))


def _simulated_error(x: torch.Tensor, block: int, stat, level: float, grid) -> float:
    """Relative L2 error of a two-level (E4M3 block x power-of-two tensor) scheme, float64."""
    xb = x.double().reshape(x.shape[0], -1, block)
    st = stat(xb)
    g = 2.0 ** math.ceil(math.log2(float(st.max()) / (448.0 * level)))
    unit = (st / (level * g)).float().to(torch.float8_e4m3fn).double() * g
    return rel((grid(xb / unit.unsqueeze(-1)) * unit.unsqueeze(-1)).reshape(x.shape), x)


def test_scale_choices_beat_the_alternatives(gauss):
    """The measurements behind the grids and scalings of int4, mxint4, int2 and ternary."""
    amax = lambda b: b.abs().amax(-1)  # noqa: E731
    mean_abs = lambda c: (lambda b: c * b.abs().mean(-1))  # noqa: E731
    sym7 = lambda v: v.round().clamp(-7, 7)  # noqa: E731
    midrise = lambda v: (torch.floor(v / 2) * 2 + 1).clamp(-3, 3)  # noqa: E731
    ternary = lambda v: v.round().clamp(-1, 1)  # noqa: E731
    for block in (16, 32):
        ours = rel(dequantize(quantize(gauss, "int4", block_size=block)), gauss)
        assert ours == pytest.approx(_simulated_error(gauss, block, amax, 7.0, sym7), rel=1e-3)
        # [-8, 7] grids: within 5% either way, but they treat the two signs differently.
        for level in (7.5, 8.0):
            alt = _simulated_error(gauss, block, amax, level, lambda v: v.round().clamp(-8, 7))
            assert abs(alt / ours - 1) < 0.05, (block, level, alt, ours)
        # A zero-free mid-rise grid (+-0.5 .. +-7.5) is a few percent better but cannot send 0.
        alt = _simulated_error(gauss, block, amax, 7.5, lambda v: (torch.floor(v) + 0.5).clamp(-7.5, 7.5))
        assert 0.9 < alt / ours < 1.0
        int2 = rel(dequantize(quantize(gauss, "int2", block_size=block)), gauss)
        assert int2 == pytest.approx(_simulated_error(gauss, block, mean_abs(0.625), 1.0, midrise), rel=1e-3)
        assert int2 * 1.15 < _simulated_error(gauss, block, amax, 3.0, midrise)  # absmax
        tern = rel(dequantize(quantize(gauss, "ternary", block_size=block)), gauss)
        assert tern == pytest.approx(_simulated_error(gauss, block, mean_abs(1.5), 1.0, ternary), rel=1e-3)
        assert tern * 1.3 < _simulated_error(gauss, block, amax, 1.0, ternary)  # absmax
        assert tern * 1.1 < _simulated_error(gauss, block, mean_abs(1.0), 1.0, ternary)  # BitNet's mean |x|
    # mxint4: the saturating floor-based E8M0 scale beats the non-saturating ceil-based one.
    xb = gauss.double().reshape(256, -1, 32)
    s = torch.exp2(torch.ceil(torch.log2(xb.abs().amax(-1) / 7))).unsqueeze(-1)
    ceil_err = rel((sym7(xb / s) * s).reshape(gauss.shape), gauss)
    assert rel(dequantize(quantize(gauss, "mxint4")), gauss) * 1.05 < ceil_err


def test_int2_zeros_alternate_sign():
    x = torch.zeros(1, 32)
    x[0, :16] = torch.linspace(-2, 2, 16)  # columns 16-31 are zeros: eight even, eight odd
    y = dequantize(quantize(x, "int2"))
    zeros = y[x == 0]
    unit = zeros.abs().max()
    assert unit > 0 and torch.equal(zeros.abs(), torch.full_like(zeros, unit)) and float(zeros.sum()) == 0.0


@pytest.mark.parametrize("fmt,scaling,block", ALL)
def test_padding_and_wire_bytes(fmt, scaling, block):
    x = torch.randn(3, 5, 37)  # 37 columns: not a multiple of any block
    q = quantize(x, fmt, scaling=scaling, block_size=block)
    y = dequantize(q)
    assert y.shape == x.shape and torch.isfinite(y).all()
    if fmt not in ("fp32", "bf16"):
        assert rel(y, x) < 1.2 * LEVELS[(fmt, block)][1] + 0.05
    sent = q.payload.numel() + q.scales.numel() * q.scales.element_size()
    sent += 0 if q.tensor_scale is None else 4 * q.tensor_scale.numel()
    assert wire_bytes(q) == sent == wire_bytes_for(q.spec, 15, 37)


def test_bits_per_element():
    rows, cols = 8, 1024
    assert FormatSpec("fp8_e4m3", "row").bits_per_element(cols, rows) == pytest.approx(8 + 32 / cols)
    assert FormatSpec("mxfp8").bits_per_element(cols, rows) == pytest.approx(8.25)
    assert FormatSpec("nvfp4").bits_per_element(cols, rows) == pytest.approx(4.5 + 32 / 8192)
    assert FormatSpec("bf16").bits_per_element(cols) == 16
    assert FormatSpec("mxint4").bits_per_element(cols, rows) == pytest.approx(4.25)
    tensor_scale = 32 / (rows * cols)
    for block in (16, 32):
        assert FormatSpec("int4", block_size=block).bits_per_element(cols, rows) == pytest.approx(4 + 8 / block + tensor_scale)
        assert FormatSpec("int2", block_size=block).bits_per_element(cols, rows) == pytest.approx(2 + 8 / block + tensor_scale)
        # three bytes per eight 3-bit / four 6-bit codes
        assert FormatSpec("int3", block_size=block).bits_per_element(cols, rows) == pytest.approx(3 + 8 / block + tensor_scale)
        assert FormatSpec("int6", block_size=block).bits_per_element(cols, rows) == pytest.approx(6 + 8 / block + tensor_scale)
        # five trits per byte: ceil(1024 / 5) = 205 bytes per row
        assert FormatSpec("ternary", block_size=block).bits_per_element(cols, rows) == pytest.approx(
            8 * 205 / cols + 8 / block + tensor_scale)
    assert FormatSpec("ternary", block_size=16).payload_cols(37) == 10  # 48 padded trits -> 10 bytes
    assert FormatSpec("int3", block_size=16).payload_cols(37) == 18  # 48 padded codes -> 6 groups of 3 bytes


def test_24_bit_packing_layout():
    """int3 / int6 codes sit low bits first in 24-bit groups, low byte first: a receiver built
    from this description (another language, another device) decodes the same values."""
    x = torch.tensor([[3.0, -3, 2, -2, 1, -1, 0, 3] + [0.0] * 8])  # amax 3: unit exactly 1
    q = quantize(x, "int3", block_size=16)
    codes = [v & 7 for v in (3, -3, 2, -2, 1, -1, 0, 3)]
    word = sum(c << (3 * i) for i, c in enumerate(codes))
    assert q.payload[0, :3].tolist() == [word & 0xFF, (word >> 8) & 0xFF, word >> 16]
    assert q.payload[0, 3:].tolist() == [0, 0, 0]
    y = torch.tensor([[29.0, -29, 5, -1] + [0.0] * 12])  # int6: amax 29 -> unit exactly 1
    word = sum((v & 63) << (6 * i) for i, v in enumerate((29, -29, 5, -1)))
    assert quantize(y, "int6", block_size=16).payload[0, :3].tolist() == [word & 0xFF, (word >> 8) & 0xFF, word >> 16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_input_dtypes(dtype):
    x = torch.randn(8, 64).to(dtype)
    y = dequantize(quantize(x, "fp8_e4m3"))
    assert y.dtype == torch.float32 and rel(y, x.float()) < 0.04


def test_unsupported_dtype_and_nonfinite_are_errors():
    with pytest.raises(TypeError, match="unsupported dtype"):
        quantize(torch.ones(4, 4, dtype=torch.int32), "fp8_e4m3")
    x = torch.randn(4, 64)
    x[2, 3] = math.nan
    for fmt in ("fp8_e4m3", "int4", "ternary"):
        with pytest.raises(ValueError, match="non-finite"):
            quantize(x, fmt)
    with pytest.raises(ValueError, match="unknown format"):
        quantize(torch.ones(4), "fp6")


@pytest.mark.parametrize("fmt,scaling", [("fp8_e4m3", "row"), ("mxfp8", "row"), ("nvfp4", "row"), ("fp8_e5m2", "tensor"),
                                         ("mxint4", "row"), ("int6", "row"), ("int4", "row"), ("int3", "row"),
                                         ("int2", "row"), ("ternary", "row")])
def test_nonfinite_propagates_as_nan_never_finite(fmt, scaling):
    x = torch.randn(4, 64)
    x[1, 5] = math.inf
    x[2, 40] = math.nan
    y = dequantize(quantize(x, fmt, scaling=scaling, nonfinite="propagate"))
    assert torch.isnan(y[1, 5]) and torch.isnan(y[2, 40])
    if scaling == "row" and fmt.startswith("fp8"):
        assert torch.isnan(y[[1, 2]]).all() and torch.isfinite(y[[0, 3]]).all()
    if fmt in ("mxfp8", "mxint4"):  # block-local scales: exactly the two 32-element blocks
        assert torch.isnan(y[1, :32]).all() and torch.isnan(y[2, 32:]).all()
        assert int(torch.isnan(y).sum()) == 64
    if fmt in ("nvfp4", "int6", "int4", "int3", "int2", "ternary"):  # the shared tensor scale is non-finite
        assert torch.isnan(y).all()


def test_stochastic_rounding_is_seeded_and_unbiased():
    x = torch.full((64, 256), 1.0 + 1.0 / 32)  # between the E4M3 grid points 1.0 and 1.125
    x[0, 0] = 448.0  # per-tensor scale exactly 1
    a = dequantize(quantize(x, "fp8_e4m3", scaling="tensor", stochastic_rounding=True, seed=1))
    b = dequantize(quantize(x, "fp8_e4m3", scaling="tensor", stochastic_rounding=True, seed=1))
    c = dequantize(quantize(x, "fp8_e4m3", scaling="tensor", stochastic_rounding=True, seed=2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    nearest = dequantize(quantize(x, "fp8_e4m3", scaling="tensor"))
    assert abs(float(a.mean() - x.mean())) < 0.2 * abs(float(nearest.mean() - x.mean())) + 1e-4


def test_bf16_stochastic_rounding_is_seeded_unbiased_and_on_the_grid():
    # 1 + 3/1024 lies 3/8 of a bf16 step (1/128) above 1.0: nearest always rounds down
    x = torch.full((8192, 8), 1.0 + 3.0 / 1024)
    x[:, 1] = -x[:, 1]
    x[:, 2], x[:, 3], x[:, 4] = 3.395e38, float("inf"), float("nan")  # past bf16's largest, +inf, NaN
    x[:, 5], x[:, 6], x[:, 7] = 1e-40, -3.395e38, 0.0
    def codes(seed: int) -> torch.Tensor:
        return quantize(x, "bf16", stochastic_rounding=True, seed=seed, nonfinite="propagate").payload

    assert torch.equal(codes(3), codes(3)) and not torch.equal(codes(3), codes(4))
    sr = dequantize(quantize(x, "bf16", stochastic_rounding=True, seed=3, nonfinite="propagate"))
    finite = torch.isfinite(sr)
    assert torch.equal(sr[finite].bfloat16().float(), sr[finite])  # every value on bf16's grid
    up = 1.0 + 1.0 / 128
    assert set(sr[:, 0].unique().tolist()) == {1.0, up} and set((-sr[:, 1]).unique().tolist()) == {1.0, up}
    nearest = dequantize(quantize(x[:, :2].contiguous(), "bf16"))
    for col in (0, 1):
        bias = abs(float(sr[:, col].mean() - x[0, col]))
        assert bias < abs(float(nearest[0, col] - x[0, col])) / 20, (col, bias)
    big = torch.finfo(torch.bfloat16).max
    assert float(sr[:, 2].max()) == big and float(sr[:, 6].min()) == -big  # saturated, never +-inf
    assert torch.isinf(sr[:, 3]).all() and torch.isnan(sr[:, 4]).all() and not sr[:, 7].any()
    assert abs(float(sr[:, 5].mean()) - 1e-40) < 0.02e-40  # subnormals are rounded without bias too


def test_stochastic_rounding_of_an_exact_format_is_refused():
    with pytest.raises(ValueError, match="does not round"):
        quantize(torch.ones(4, 4), "fp32", stochastic_rounding=True)


@pytest.mark.parametrize("fmt", ["mxint4", "int6", "int4", "int3", "int2", "ternary"])
def test_integer_stochastic_rounding_is_seeded_and_unbiased(fmt):
    # Identical rows, so every row has the same scales; 24 values of +-1 keep every test
    # value inside the grid of each format (no clipping), 8 test values sit between levels.
    probe = torch.tensor([0.1, 0.3, 0.45, 0.62, -0.2, -0.77, 0.9, -0.05])
    row = torch.cat([torch.tensor([1.0, -1.0]).repeat(12), probe])
    x = row.repeat(4096, 1)
    sr = dequantize(quantize(x, fmt, stochastic_rounding=True, seed=3))
    assert torch.equal(sr, dequantize(quantize(x, fmt, stochastic_rounding=True, seed=3)))
    assert not torch.equal(sr, dequantize(quantize(x, fmt, stochastic_rounding=True, seed=4)))
    sr_bias = (sr.mean(0) - row).abs()[24:].max()
    nearest_bias = (dequantize(quantize(x, fmt)).mean(0) - row).abs()[24:].max()
    step = (sr[:, 24:] - sr[:, 24:].roll(1, 0)).abs().max()  # at most two grid steps
    assert sr_bias < step / 16 and sr_bias < nearest_bias / 5, (fmt, sr_bias, nearest_bias, step)


@pytest.mark.parametrize("fmt,scaling,block", LOSSY)
def test_decode_with_a_leading_sender_dim(fmt, scaling, block):
    """What the collectives do: decode every sender's rows at once, with one leading dim."""
    spec = FormatSpec(fmt, scaling, block)
    world, rows, cols = 3, 4, 40
    xs = [torch.randn(rows, cols, generator=torch.Generator().manual_seed(i)) * 10.0**i for i in range(world)]
    qs = [choose_scales(x, spec) for x in xs]
    payloads = torch.stack([encode(x, spec, s, t) for x, (s, t) in zip(xs, qs)])
    one_by_one = torch.stack([decode(p, spec, s, t, cols) for p, (s, t) in zip(payloads, qs)])
    scales = torch.stack([s for s, _ in qs])
    if scales.numel() and spec.block is None and scaling == "tensor":
        scales = scales.reshape(world, 1, 1)
    tscale = None if qs[0][1] is None else torch.stack([t for _, t in qs]).reshape(world, 1, 1)
    stacked = decode(payloads, spec, scales, tscale, cols)
    assert stacked.shape == (world, rows, cols) and torch.equal(stacked, one_by_one)
    # Reduce-scatter style: one agreed set of scales broadcast over the senders.
    s0, t0 = choose_scales(xs[-1], spec)
    shared = torch.stack([encode(x, spec, s0, t0) for x in xs])
    expected = torch.stack([decode(p, spec, s0, t0, cols) for p in shared])
    assert torch.equal(decode(shared, spec, s0, t0, cols), expected)


@pytest.mark.parametrize("fmt,scaling,block", ALL)
@pytest.mark.parametrize("shape", [(), (7,), (0,), (5, 0), (0, 5), (2, 0, 3)])
def test_empty_zero_dim_and_one_dim_inputs(fmt, scaling, block, shape):
    spec = FormatSpec(fmt, scaling, block)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    q = quantize(x, fmt, scaling=scaling, block_size=block)
    y = dequantize(q)
    assert y.shape == x.shape and torch.isfinite(y).all()
    rows = 1 if x.dim() < 2 else math.prod(shape[:-1])
    cols = 1 if x.dim() == 0 else shape[-1]
    assert q.payload.shape == (rows, spec.payload_cols(cols))
    assert wire_bytes(q) == wire_bytes_for(spec, rows, cols)
    if x.numel():
        gm = x.abs().max()
        assert float((y - x).abs().max()) <= GROUP_TOL.get(fmt, 0.0) * float(gm) * (1 + 1e-6)


def test_bad_arguments_raise_value_errors_naming_them():
    spec = FormatSpec("int4", block_size=16)
    x = torch.randn(4, 32)
    scales, tscale = choose_scales(x, spec)
    payload = encode(x, spec, scales, tscale)
    with pytest.raises(ValueError, match="payload"):
        decode(payload, spec, scales, tscale, 48)
    with pytest.raises(ValueError, match="payload"):
        decode(payload.float(), spec, scales, tscale, 32)
    with pytest.raises(ValueError, match="scales"):
        decode(payload, spec, scales[:, :1].repeat(1, 3), tscale, 32)
    with pytest.raises(ValueError, match="tensor_scale"):
        decode(payload, spec, scales, None, 32)
    with pytest.raises(ValueError, match="tensor_scale"):
        encode(x, spec, scales, None)
    with pytest.raises(ValueError, match="scales"):
        encode(x, spec, scales[:2], tscale)
    with pytest.raises(ValueError, match="cols"):
        decode(payload, spec, scales, tscale, -1)
    with pytest.raises(ValueError, match="rows"):
        wire_bytes_for(spec, -1, 32)
    with pytest.raises(ValueError, match="cols"):
        spec.padded_cols(2.5)
    with pytest.raises(ValueError, match="no elements"):
        spec.bits_per_element(0, 4)
    with pytest.raises(ValueError, match="x must be a torch.Tensor"):
        quantize([1.0, 2.0], "int4")
    for fmt in ("int6", "int4", "int3", "int2", "ternary"):
        with pytest.raises(ValueError, match="block_size=64 is invalid for format"):
            FormatSpec(fmt, block_size=64)
        with pytest.raises(ValueError, match=r"GiftConfig\.block_size=64 is invalid; allowed: 16 or 32"):
            GiftConfig(format=fmt, block_size=64)
        assert GiftConfig(format=fmt, block_size=16).block_size == 16
    with pytest.raises(ValueError, match="block_size"):
        FormatSpec("fp8_e4m3", "block", 3)


# --- magnitude sweep -----------------------------------------------------------------------

def _group_max(x: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """max |x| over each element's scale group (the element itself for bf16), float64."""
    a = x.abs().double()
    if spec.passthrough:
        return a
    b = spec.block
    if b is None:
        return a.amax().expand_as(a) if spec.scaling == "tensor" else a.amax(1, keepdim=True).expand_as(a)
    r, c = a.shape
    return a.reshape(r, c // b, b).amax(-1, keepdim=True).expand(r, c // b, b).reshape(r, c)


def _check_bounds(x: torch.Tensor, fmt: str, scaling: str, block: int) -> tuple[float, float, float]:
    """Round trip `x`, assert the error bounds, return (worst in-range error / group max,
    worst absolute error of groups below the range, relative L2 error or nan)."""
    spec = FormatSpec(fmt, scaling, block)
    y = dequantize(quantize(x, fmt, scaling=scaling, block_size=block)).double()
    assert torch.isfinite(y).all(), f"{fmt}/{scaling}/{block}: a finite input decoded as inf/nan"
    err = (y - x.double()).abs()
    gm = _group_max(x, spec)
    in_range = gm >= FULL_RANGE.get(fmt, 2.0**-126)
    if fmt in TWO_LEVEL_AMAX:  # blocks 2**13 below the tensor max underflow the E4M3 block scale
        in_range &= gm >= float(x.abs().max()) * 2.0**-13
    tol = GROUP_TOL[fmt]
    assert (err[in_range] <= tol * gm[in_range] * (1 + 1e-6)).all(), \
        f"{fmt}/{scaling}/{block}: error {float((err / gm)[in_range].max()):.4f} x group max > {tol:.4f}"
    # Outside the range: never more than the group's own magnitude (decoding to zero is
    # allowed, decoding to a spurious block maximum is not), and never above 2**-126 for
    # groups below fp32's normal range.
    out = ~in_range
    assert (err[out] <= gm[out] * (1 + 1e-6)).all(), f"{fmt}/{scaling}/{block}: small group decoded above its magnitude"
    tiny = gm < 2.0**-126
    assert (err[tiny] <= 2.0**-126).all()
    worst_in = float((err / gm.clamp(min=1e-300))[in_range].max()) if in_range.any() else 0.0
    worst_tiny = float(err[tiny].max()) if tiny.any() else 0.0
    level = rel(y, x) if in_range.all() else math.nan
    return worst_in, worst_tiny, level


@pytest.mark.parametrize("fmt,scaling,block", LOSSY)
def test_magnitude_sweep_error_bounds(fmt, scaling, block):
    """Whole tensors at 1e-45..3e38 and fp32's maximum, then blocks mixing two magnitudes.

    Groups in range meet the format's grid bound and, when every group is in range, the
    Gaussian error level; smaller groups stay within their own magnitude (and below
    2**-126 in absolute terms); nothing finite decodes as inf or NaN.
    """
    g = torch.randn(16, 256, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    g = g / g.abs().max()  # max |g| = 1: the magnitude is the tensor maximum
    mags = torch.logspace(-45, math.log10(3e38), 84, dtype=torch.float64).tolist() + [FP32_MAX]
    hi = LEVELS[(fmt, block)][1]
    for m in mags:
        _, _, level = _check_bounds((g * m).float(), fmt, scaling, block)
        assert math.isnan(level) or level < hi, (fmt, m, level)
        _check_bounds((g.sign() * m).float(), fmt, scaling, block)  # every |x| = m: block means = block maxima
    # Mixed: rows 0-7 alternate a large and a small magnitude element by element (inside
    # every block), rows 8-11 are all small (tiny blocks in a large tensor), rows 12-15 large.
    coarse = torch.logspace(-44, 38, 12, dtype=torch.float64).tolist() + [FP32_MAX]
    for i, big in enumerate(coarse):
        for small in coarse[:i]:
            scale = torch.full((16, 256), big, dtype=torch.float64)
            scale[:8, 1::2] = small
            scale[8:12] = small
            _check_bounds((g * scale).float(), fmt, scaling, block)


def test_near_fp32_max_saturates_instead_of_inf():
    x = torch.tensor([[FP32_MAX, -FP32_MAX, 3.4e38, 1.0] * 8])
    for fmt, scaling, block in LOSSY:
        y = dequantize(quantize(x, fmt, scaling=scaling, block_size=block))
        assert torch.isfinite(y).all(), fmt
        assert float(y[0, 0]) >= (1 - GROUP_TOL[fmt]) * FP32_MAX, (fmt, float(y[0, 0]))
    assert torch.isinf(dequantize(quantize(torch.tensor([math.inf, 1.0]), "bf16", nonfinite="propagate"))[0])


def test_compiled_is_bit_identical_to_eager():
    x = torch.randn(32, 96, generator=torch.Generator().manual_seed(3))
    x[1] *= 1e-39  # a tiny row (below fp32's normal range)
    x[2] *= FP32_MAX / x[2].abs().max()  # up to fp32's maximum: codes that round past it saturate
    x[3] = (x[3] * 4).bfloat16().float()  # exact rounding ties
    x[4, :32] = 0.0
    bad = x.clone()
    bad[6, 50] = math.inf
    # Every distinct code path once (mxint4 and ternary share int4's stochastic branch).
    cases = [("fp8_e5m2", 16, (True,)), ("mxfp8", 32, (False,)), ("nvfp4", 16, (False, True)),
             ("mxint4", 32, (False,)), ("int4", 16, (False, True)), ("int2", 32, (False, True)),
             ("ternary", 16, (False,)), ("int3", 16, (False, True)), ("int6", 32, (False,))]

    def round_trips(x: torch.Tensor, bad: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for fmt, block, modes in cases:
            for sr in modes:
                q = quantize(x, fmt, scaling="block", block_size=block, stochastic_rounding=sr, seed=7,
                             nonfinite="propagate")
                out += [q.payload, q.scales, dequantize(q)]
        for fmt in ("mxint4", "int4"):
            out.append(dequantize(quantize(bad, fmt, nonfinite="propagate")))
        return out

    compiled = torch.compile(round_trips, fullgraph=True, dynamic=False)
    eager, comp = round_trips(x, bad), compiled(x, bad)
    for i, (a, b) in enumerate(zip(eager[:-2], comp[:-2])):
        assert torch.equal(a, b), i
    for a, b in zip(eager[-2:], comp[-2:]):  # non-finite input: the same NaN groups, never finite
        assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.isnan(b[6, 50])
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    assert torch.isnan(comp[-2][6, 32:64]).all() and torch.isfinite(comp[-2][:6]).all()


def test_ragged_mean_abs_blocks_compile_to_the_eager_bits():
    """int2's and ternary's block mean counts only a ragged row's real values (`_mean_abs`'s
    `cols`): the compiled codec computes the same division, bit for bit, on widths that leave
    8 and 1 real values in the last block of 32 and on a single column."""
    x = torch.randn(7, 83, generator=torch.Generator().manual_seed(5))

    def round_trips(x: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for fmt in ("int2", "ternary"):
            for t in (x[:, :72], x[:, :65], x[:, :1]):
                q = quantize(t, fmt, scaling="block", block_size=32)
                out += [q.scales, q.tensor_scale, q.payload, dequantize(q)]
        return out

    compiled = torch.compile(round_trips, fullgraph=True, dynamic=False)
    for i, (a, b) in enumerate(zip(round_trips(x), compiled(x))):
        assert torch.equal(a, b), i


def test_mean_abs_statistic_is_order_free_within_24_binades():
    """The int2/ternary block statistic sums |x| in fp64 as a reduction: exact, hence the
    same in any order, for blocks whose magnitudes span up to 2**24 (an fp32 sum would not
    be: it rounds after every add)."""
    from gift_compile.codec.scales import _mean_abs

    g = torch.Generator().manual_seed(11)
    mant = 1.0 + torch.rand(512, 32, generator=g)
    xb = mant * torch.exp2(torch.randint(-12, 12, (512, 32), generator=g).float())  # 24 binades
    xb = xb * torch.where(torch.rand(512, 32, generator=g) < 0.5, -1.0, 1.0)
    perm = torch.argsort(torch.rand(512, 32, generator=g), dim=1)
    n = xb.numel()  # one row of 512 full blocks
    a, b = _mean_abs(xb, 0.625, n), _mean_abs(torch.gather(xb, 1, perm), 0.625, n)
    assert torch.equal(a, b)
    ref = (xb.double().abs().sum(-1) * (0.625 / 32)).float()
    assert torch.equal(a, ref)
    naive = (xb.abs().sum(-1) * (0.625 / 32), torch.gather(xb, 1, perm).abs().sum(-1) * (0.625 / 32))
    assert not torch.equal(*naive)  # fp32 accumulation would depend on the order
