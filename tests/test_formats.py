"""Numerics of the low-bit formats: error levels, exactness, padding, bytes, compile parity."""

import math

import pytest
import torch

from gift_compile.formats import FormatSpec, dequantize, quantize, wire_bytes, wire_bytes_for

ALL = [("fp32", "row"), ("bf16", "row"), ("fp8_e4m3", "tensor"), ("fp8_e4m3", "row"), ("fp8_e4m3", "block"),
       ("fp8_e5m2", "tensor"), ("fp8_e5m2", "row"), ("fp8_e5m2", "block"), ("mxfp8", "row"), ("nvfp4", "row")]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def gauss() -> torch.Tensor:
    return torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("fmt,scaling,lo,hi", [
    ("fp8_e4m3", "tensor", 0.024, 0.029), ("fp8_e4m3", "row", 0.024, 0.029),
    ("fp8_e5m2", "tensor", 0.049, 0.057), ("fp8_e5m2", "row", 0.049, 0.057),
    ("mxfp8", "row", 0.026, 0.034), ("nvfp4", "row", 0.088, 0.102), ("bf16", "row", 0.001, 0.003),
])
def test_gaussian_error_levels(gauss, fmt, scaling, lo, hi):
    err = rel(dequantize(quantize(gauss, fmt, scaling=scaling)), gauss)
    assert lo < err < hi, f"{fmt}/{scaling}: relative L2 error {err:.4f} outside [{lo}, {hi}]"


def test_fp32_is_lossless(gauss):
    assert torch.equal(dequantize(quantize(gauss, "fp32")), gauss)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "mxfp8", "nvfp4"])
def test_representable_values_round_trip_exactly(fmt):
    # Values on the format's grid whose block amax maps exactly onto the format maximum.
    if fmt == "nvfp4":
        grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 2)
        x = torch.cat([grid, -grid]).reshape(2, 16)
    elif fmt == "mxfp8":
        # amax 1.75 -> shared exponent 2^-8: 1.75 * 256 = 448, E4M3's maximum
        x = torch.tensor([1.0, 0.5, -0.25, 0.125, 1.75, -1.5, 0.0, 1.625] * 8).reshape(2, 32)
    else:
        fmax = 448.0 if fmt == "fp8_e4m3" else 57344.0
        x = torch.tensor([fmax, 1.0, -2.0, 0.5, 0.0, -fmax / 4, 3.0, 1.5]).reshape(1, 8)
    y = dequantize(quantize(x, fmt, scaling="tensor"))
    assert torch.equal(y, x), (fmt, (y - x).abs().max())


@pytest.mark.parametrize("fmt,scaling", ALL)
def test_padding_and_wire_bytes(fmt, scaling):
    x = torch.randn(3, 5, 37)  # 37 columns: not a multiple of any block
    q = quantize(x, fmt, scaling=scaling)
    y = dequantize(q)
    assert y.shape == x.shape and torch.isfinite(y).all()
    if fmt not in ("fp32", "bf16"):
        assert rel(y, x) < 0.2
    sent = q.payload.numel() + q.scales.numel() * q.scales.element_size()
    sent += 0 if q.tensor_scale is None else 4 * q.tensor_scale.numel()
    assert wire_bytes(q) == sent == wire_bytes_for(q.spec, 15, 37)


def test_bits_per_element():
    assert FormatSpec("fp8_e4m3", "row").bits_per_element(1024, 8) == pytest.approx(8 + 32 / 1024)
    assert FormatSpec("mxfp8").bits_per_element(1024, 8) == pytest.approx(8.25)
    assert FormatSpec("nvfp4").bits_per_element(1024, 8) == pytest.approx(4.5 + 32 / 8192)
    assert FormatSpec("bf16").bits_per_element(1024) == 16


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
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, "fp8_e4m3")
    with pytest.raises(ValueError, match="unknown format"):
        quantize(torch.ones(4), "fp6")


@pytest.mark.parametrize("fmt,scaling", [("fp8_e4m3", "row"), ("mxfp8", "row"), ("nvfp4", "row"), ("fp8_e5m2", "tensor")])
def test_nonfinite_propagates_as_nan_never_finite(fmt, scaling):
    x = torch.randn(4, 64)
    x[1, 5] = math.inf
    y = dequantize(quantize(x, fmt, scaling=scaling, nonfinite="propagate"))
    assert torch.isnan(y[1, 5])
    if fmt in ("fp8_e4m3", "fp8_e5m2") and scaling == "row":
        assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2, 3]]).all()


def test_stochastic_rounding_is_seeded_and_unbiased():
    x = torch.full((64, 256), 1.0 + 1.0 / 32)  # between the E4M3 grid points 1.0 and 1.125
    x[0, 0] = 448.0  # per-tensor scale exactly 1
    a = dequantize(quantize(x, "fp8_e4m3", scaling="tensor", stochastic_rounding=True, seed=1))
    b = dequantize(quantize(x, "fp8_e4m3", scaling="tensor", stochastic_rounding=True, seed=1))
    c = dequantize(quantize(x, "fp8_e4m3", scaling="tensor", stochastic_rounding=True, seed=2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    nearest = dequantize(quantize(x, "fp8_e4m3", scaling="tensor"))
    assert abs(float(a.mean() - x.mean())) < 0.2 * abs(float(nearest.mean() - x.mean())) + 1e-4


def test_compiled_is_bit_identical_to_eager():
    x = torch.randn(32, 96, generator=torch.Generator().manual_seed(3))

    def round_trip(x: torch.Tensor, fmt: str):
        q = quantize(x, fmt, scaling="block", stochastic_rounding=True, seed=7, nonfinite="propagate")
        return q.payload, q.scales, dequantize(q)

    compiled = torch.compile(round_trip, fullgraph=True, dynamic=False)
    for fmt in ("fp8_e5m2", "nvfp4"):
        for a, b in zip(round_trip(x, fmt), compiled(x, fmt)):
            assert torch.equal(a, b), fmt
