"""The codec prices the step model reads off the H200 measurement (`bench.step_model.pricing`): the
prices reproduce the measured bodies, a body that was not measured is named, and the committed
H200 run still renders as a GPU.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.step_model import pricing as gpu_pricing
from bench.step_model.pricing import Body, CodecPricer, load_bodies


@pytest.fixture(scope="module")
def bodies() -> list[Body]:
    return load_bodies()


def test_every_path_and_shape_of_the_h200_run_is_committed(bodies: list[Body]) -> None:
    assert {(b.path, b.rows, b.cols) for b in bodies} == {
        (p, r, c) for p in gpu_pricing.PATHS.values() for r, c in ((1280, 3456), (3456, 1280), (4096, 14336), (14336, 4096))}


def test_the_price_at_a_measured_shape_is_the_measured_body_time(bodies: list[Body]) -> None:
    pricer = CodecPricer(bodies)
    for b in bodies:
        p = pricer.price(b.path, b.rows, b.cols)
        assert p.device_us == pytest.approx(b.device_us, rel=1e-9), b
        assert p.basis.startswith("measured")
        if b.elements < 10_000_000:  # 600M: launch-bound, the wall time is the host's
            assert b.wall_us > 1.2 * b.device_us
            assert p.wall_us == pytest.approx(b.wall_us, rel=1e-9)
        else:  # 8B: the GPU is the bottleneck, the wall time is the kernels' plus small gaps
            assert p.wall_us == pytest.approx(b.wall_us, rel=0.05)


def test_other_shapes_lie_on_the_line_through_the_measured_sizes(bodies: list[Body]) -> None:
    pricer = CodecPricer(bodies)
    small, large = pricer.price("gift-fp8", 1280, 3456), pricer.price("gift-fp8", 4096, 14336)
    mid = pricer.price("gift-fp8", 4096, 4096)  # Llama-3-8B wq: between the two, w2-like
    n0, n1, n = 1280 * 3456, 4096 * 14336, 4096 * 4096
    assert mid.device_us == pytest.approx(small.device_us + (large.device_us - small.device_us) * (n - n0) / (n1 - n0))
    assert mid.basis.startswith("interpolated") and small.device_us < mid.device_us < large.device_us
    kv = pricer.price("gift-fp8", 1024, 4096)  # just below the smallest measured size
    assert kv.basis.startswith("extrapolated") and 0 < kv.device_us < small.device_us
    assert kv.wall_us == small.wall_us  # the host floor does not shrink with the shape


def test_a_body_that_was_not_measured_raises_naming_it(bodies: list[Body]) -> None:
    pricer = CodecPricer(bodies)
    with pytest.raises(KeyError, match="'gift-int4'.*w2-like"):
        pricer.price("gift-int4", 4096, 14336)
    one_size = CodecPricer([b for b in bodies if not (b.path == "euclid-nvfp4" and b.rows == 14336)])
    with pytest.raises(KeyError, match="'euclid-nvfp4' at w1-like"):
        one_size.price("euclid-nvfp4", 14336, 4096)
    one_size.price("euclid-nvfp4", 4096, 14336)  # the other orientation is still priced


def test_the_committed_h200_run_renders_as_gpu_md() -> None:
    """The run's own render crashed (`NameError: copy_bw`); today's renders it, `impl` absent."""
    from bench.gpu.report import render
    md = render(json.loads(gpu_pricing.CODEC_FILE.read_text()))
    assert "## Codec kernels" in md and "8B w2 (fc2)" in md and "NVIDIA H200" in md
    assert md == (Path(gpu_pricing.GPU_DIR) / "GPU.md").read_text()
