"""The step model priced from the H200 measurement (`bench.step_model.pricing`, `bench.step_model.gpu`):
the prices reproduce the measured bodies, a body that was not measured is named, the committed
result is what its generator gives, and the committed H200 run still renders as a GPU.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.step_model import pricing as gpu_pricing, gpu as gpu_step_model
from bench.step_model.pricing import Body, CodecPricer, GemmPricer, load_bodies, load_gemms


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


def test_gemms_are_measured_or_at_the_nearest_measured_rate() -> None:
    gemms = load_gemms()
    pricer = GemmPricer(gemms)
    w2 = next(g for g in gemms if (g.rows, g.cols) == (4096, 14336))
    p = pricer.price(4096, 14336, 8192)
    assert (p.fwd_us, p.dw_us, p.dx_us) == (w2.dx_us, w2.dw_us, w2.dx_us)
    assert pricer.price(4096, 14336, 16384).total_us == pytest.approx(2 * p.total_us)
    q = pricer.price(4096, 4096, 8192)  # nearest by element count: 8B w2 (58.7 M) over 600M (4.4 M)
    assert q.basis.endswith("[4096, 14336]") and q.total_us == pytest.approx(p.total_us * 4096 / 14336)
    with pytest.raises(ValueError):
        GemmPricer([])


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads(gpu_step_model.OUT.read_text())


def test_the_committed_result_is_what_its_generator_gives(committed: dict) -> None:
    fresh = json.loads(json.dumps(gpu_step_model.run(), sort_keys=True))
    assert fresh == committed, "bench/results/step_model/gpu_step_model.json is stale: run python -m bench.step_model.gpu"


def test_shares_and_goal_exposures_are_computed_from_the_costs(committed: dict) -> None:
    goal = committed["goal"]
    for fmt, v in committed["formats"].items():
        assert v["total"]["managed_layers"] == 224  # every layer of Llama-3-8B: 32 x (q, k, v, o, w1, w2, w3)
        assert sum(r["count"] for r in v["rows"]) == 224
        for r in [*v["rows"], v["total"]]:
            s, sv = r["step_us"], r["saves_us"]
            assert sv["euclid"] == pytest.approx(s["fp32"] - s["euclid"])
            assert r["share"] == pytest.approx(sv["gift"] / sv["euclid"])
        for r in v["rows"]:  # at the goal's exposure GIFT saves exactly `goal` of Euclidean's saving
            f = r["exposed_share_for_goal"]
            d = {a: r["comm_us"]["fp32"] - r["comm_us"][a] for a in ("euclid", "gift")}
            k = {"euclid": r["codec_us"]["euclid"], "gift": r["codec_us"]["gift"] + r["stats_us"] + r["refresh_us"]}
            assert f * d["gift"] - k["gift"] == pytest.approx(goal * (f * d["euclid"] - k["euclid"]))
            assert r["codec_us"]["gift"] > r["codec_us"]["euclid"] > 0


def test_the_block_names_its_command_and_the_whole_step_share(committed: dict) -> None:
    text = gpu_step_model.block()
    assert "`python -m bench.step_model.gpu`" in text and "**Assumed**" in text and "**Calibrated**" in text
    for v in committed["formats"].values():
        assert f"**{v['total']['share']:.3f}**" in text


def test_the_committed_h200_run_renders_as_gpu_md() -> None:
    """The run's own render crashed (`NameError: copy_bw`); today's renders it, `impl` absent."""
    from bench.gpu.report import render
    md = render(json.loads(gpu_pricing.CODEC_FILE.read_text()))
    assert "## Codec kernels" in md and "8B w2 (fc2)" in md and "NVIDIA H200" in md
    assert md == (Path(gpu_pricing.GPU_DIR) / "GPU.md").read_text()
