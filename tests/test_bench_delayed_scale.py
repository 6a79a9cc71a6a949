"""`bench.fidelity.delayed_scale` on constructed tensors: its scales are the codec's when the maximum is
the current one, its saturation counter counts a delayed scale that is too small, and its
decision rule rejects what it should (the measured run itself is the bench's, minutes long)."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from bench.fidelity import delayed_scale as ds
from bench.lib.stats import paired
from gift_compile.codec import choose_scales, dequantize, quantize
from gift_compile.codec.formats import FORMAT_TABLE

SPECS = ds.two_level_specs()


def test_the_formats_are_every_one_with_a_tensor_scale() -> None:
    names = {s.name for s in SPECS}
    assert names == {n for n, f in FORMAT_TABLE.items() if f.has_tensor_scale}
    assert {"nvfp4", "int4", "int2"} <= names


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_the_current_maximum_gives_the_codecs_scales_and_error(spec) -> None:  # noqa: ANN001
    x = torch.randn(48, 96, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 1, 96)
    scales, gscale, saturated = ds.scales_with_max(x, spec, ds.current_max(x, spec))
    ref_scales, ref_gscale = choose_scales(x, spec)
    assert torch.equal(scales, ref_scales) and torch.equal(gscale, ref_gscale)
    assert not saturated.any()
    coded = ds.two_pass(x, spec)
    q = quantize(x, spec.name, scaling="row", block_size=spec.block_size)
    assert coded.error == pytest.approx(float((dequantize(q) - x).norm() / x.norm()), rel=1e-6)
    assert coded.saturated_blocks == coded.clipped_elements == 0
    assert coded.blocks == 48 * 96 // spec.block


@pytest.mark.parametrize("name", ["nvfp4", "int4"])
def test_a_too_small_delayed_scale_is_counted_as_saturation(name: str) -> None:
    """Four blocks of one row: three of magnitude 1, one of 64. A delayed maximum of 1 puts the
    tensor scale six binades too low: exactly the large block's code clips at 448 and all its
    elements are cut off; its error is far above two-pass's, which saturates nothing."""
    spec = next(s for s in SPECS if s.name == name)
    b = spec.block
    x = torch.ones(1, 4 * b)
    x[0, 3 * b:] = 64.0
    x[0, ::2] *= -1.0
    small = ds.code_with_max(x, spec, torch.ones(1))
    assert (small.blocks, small.saturated_blocks, small.clipped_elements) == (4, 1, b)
    exact = ds.two_pass(x, spec)
    assert exact.saturated_blocks == 0 and small.error > 10 * max(exact.error, 1e-3)
    # a larger delayed maximum (one binade of margin) saturates nothing and loses nothing here
    roomy = ds.code_with_max(x, spec, 2 * ds.current_max(x, spec))
    assert roomy.saturated_blocks == 0 and roomy.error == pytest.approx(exact.error, abs=1e-7)


def test_delayed_max_reads_the_right_history() -> None:
    hist = deque([torch.tensor([1.0]), torch.tensor([5.0]), torch.tensor([2.0])], maxlen=ds.HISTORY)
    assert float(ds.delayed_max(hist, 1, 1.0)) == 2.0
    assert float(ds.delayed_max(hist, ds.HISTORY, 1.0)) == 5.0
    assert float(ds.delayed_max(hist, ds.HISTORY, 2.0)) == 10.0


def test_the_corrected_interval_widens_with_the_family() -> None:
    values = [0.01, -0.002, 0.004, 0.0, 0.007, 0.003]
    mean, lo, hi = ds.corrected_ci(values, 1)
    p = paired(values)
    assert mean == pytest.approx(p.mean) and hi - mean == pytest.approx(p.ci95, rel=1e-9)
    _, lo36, hi36 = ds.corrected_ci(values, 36)
    assert lo36 < lo and hi36 > hi


def _tally(increase: float, saturated: int) -> ds.Tally:
    """A tally of 4 layers x 3 steps where every delayed arm has relative error `1 + increase`
    against two-pass's 1 and `saturated` blocks of 100 per layer-step saturate."""
    t = ds.Tally()
    ref = ds.Coded(1.0, 100, 0, 0, 1.0)
    for domain in ds.DOMAINS:
        for spec in SPECS:
            for layer in range(4):
                for step in range(3):
                    t.add((domain, spec.name, "two-pass"), f"l{layer}", step, ref, ref)
                    for arm in ds.DELAYED:
                        jitter = 1e-4 * (layer - 1.5)
                        coded = ds.Coded(1.0 + increase + jitter, 100, saturated, 3 * saturated, 0.5 if saturated else 2.0)
                        t.add((domain, spec.name, arm), f"l{layer}", step, coded, ref)
    return t


def test_the_decision_rule_accepts_and_rejects() -> None:
    free = ds.verdict(ds.summarize(_tally(0.0, 0)))
    assert free["free"] and free["free_arms"] == list(ds.DELAYED)
    costly = ds.verdict(ds.summarize(_tally(2 * ds.THRESHOLD, 0)))
    assert not costly["free"] and len(costly["arms"]["previous"]["failing"]) == 2 * len(SPECS)
    saturating = ds.summarize(_tally(0.0, 1))
    row = saturating["gift"]["nvfp4"]["previous"]
    assert (row["saturated_blocks"], row["blocks"], row["clipped_elements"]) == (12, 1200, 36)
    assert row["steps_with_saturation"] == 3 and row["scale_lower"] == 1.0
    assert not ds.verdict(saturating)["free"]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_the_saturation_count_is_every_block_past_e4m3s_maximum(spec) -> None:  # noqa: ANN001
    """A delayed maximum a third of the current one: the count equals the blocks whose unit,
    recomputed here in fp64, exceeds 448, including blocks just past it (448 to 896), and the
    clipped elements are those of these blocks beyond 448 x tensor scale x the top level."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(5)) * torch.logspace(-1, 1, 64).unsqueeze(1)
    gmax = ds.current_max(x, spec) / 3
    coded = ds.code_with_max(x, spec, gmax)
    _, gscale, _ = ds.scales_with_max(x, spec, gmax)
    unit = ds.block_statistic(x, spec).double() / (float(gscale) * spec.family.level)
    over = unit > 448.0
    assert bool(((unit > 448.0) & (unit <= 896.0)).any())
    assert coded.saturated_blocks == int(over.sum()) > 0
    bound = 448.0 * float(gscale) * ds.top_level(spec)
    past = x.abs().double().reshape(64, -1, spec.block) > bound
    assert coded.clipped_elements == int((past & over.unsqueeze(-1)).sum()) > 0


def test_an_arm_is_free_only_if_it_passes_in_every_window() -> None:
    free = ds.verdict(ds.summarize(_tally(0.0, 0)))
    costly = ds.verdict(ds.summarize(_tally(2 * ds.THRESHOLD, 0)))
    assert ds.free_arms([free, free]) == list(ds.DELAYED)
    assert ds.free_arms([free, costly]) == ds.free_arms([costly, free]) == []
