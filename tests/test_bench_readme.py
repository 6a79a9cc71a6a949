"""README's measured-number blocks are generated from the committed results (`bench.readme`)."""

from __future__ import annotations

import json

import pytest

from bench import readme


def test_committed_readme_blocks_match_the_committed_results() -> None:
    assert readme.main(["--check"]) == 0, "README blocks differ from bench/results/results.json: run python -m bench.readme"


def test_a_hand_edited_number_is_caught_and_regenerated(tmp_path) -> None:
    results = json.loads(readme.RESULTS.read_text())
    text = readme.README.read_text()
    block = readme.step_model(results)
    assert block in text
    number = f"{100 * results['step_model']['scenarios']['calibrated']['arms']['gift-fp8 (13 fc2)']['vs_fp32']:+.1f}%"
    edited = text.replace(block, block.replace(number, "-9.1%" if number != "-9.1%" else "-9.2%"))
    path = tmp_path / "README.md"
    path.write_text(edited)
    assert readme.main(["--readme", str(path), "--check"]) == 1
    assert readme.main(["--readme", str(path)]) == 0
    assert path.read_text() == text


def test_missing_block_markers_raise() -> None:
    with pytest.raises(ValueError, match=f"bench:{next(iter(readme.BLOCKS))}"):
        readme.render("no markers here", json.loads(readme.RESULTS.read_text()))


def test_the_targets_block_judges_only_the_default_arm_and_never_at_one_seed() -> None:
    """`closing` reads the per-optimizer default's gap (the GIFT arm without codec modifiers that
    resolved the default geometry), says "met" only where the data say so, and makes no call at
    n=1: each clause would pass as a no-op only if the verdicts were typed in."""
    def gap(share: float, gift_resolved: bool, n: int = 5, euclid_resolved: bool = True) -> dict:
        def p(resolved: bool) -> dict:
            return {"mean": 0.001, "ci95": 0.0005, "n": n, "resolved": resolved}
        return {"format": "nvfp4", "share_closed": share, "share_closed_ci95": [share - 0.1, share + 0.1],
                "gift_minus_fp32": p(gift_resolved), "euclid_minus_fp32": p(euclid_resolved),
                "gift_minus_euclid": {"mean": -0.0005, "ci95": 0.0002, "n": n, "resolved": True}}

    def study(gaps: dict, geometry: dict) -> dict:
        return {"optimizers": {"muon": {"gaps": gaps, "arms": {f"gift-{k}": {"geometry": geometry[k]} for k in gaps}}}}

    cv = {"default_geometry": {"muon": "lowrank"}, "runs": [], "paths": {
        # the -ef arm closes more, but it is not the default: the verdict reads nvfp4's 45%
        "reduce-scatter": study({"nvfp4-ef": gap(0.9, True), "nvfp4": gap(0.45, True)},
                                {"nvfp4-ef": "lowrank", "nvfp4": "lowrank"}),
        "all-reduce": study({"nvfp4": gap(0.85, True)}, {"nvfp4": "lowrank"}),
        "reduce-scatter, 4 ranks": study({"nvfp4": gap(float("nan"), False, n=1)}, {"nvfp4": "lowrank"}),
        "reduce-scatter, 480 steps": study({"nvfp4": gap(0.1, False)}, {"nvfp4": "none"}),
        # GIFT within fp32's CI, but so is Euclidean: the design resolves nothing, so no verdict
        "reduce-scatter, 8 ranks": study({"nvfp4": gap(float("nan"), False, euclid_resolved=False)},
                                         {"nvfp4": "lowrank"}),
    }}
    lines = readme.closing({"convergence": cv, "sweeps": []}).splitlines()
    by = {line.split(" (default")[0].strip(): line for line in lines[1:]}
    assert "45% closed" in by["reduce-scatter, muon"] and by["reduce-scatter, muon"].endswith("not met.")
    assert by["all-reduce, muon"].endswith("**met**.")
    assert "no test yet" in by["reduce-scatter, 4 ranks, muon"] and "met" not in by["reduce-scatter, 4 ranks, muon"]
    assert "reduce-scatter, 480 steps, muon" not in by  # its arm did not resolve the default geometry
    assert "no verdict" in by["reduce-scatter, 8 ranks, muon"] and "met" not in by["reduce-scatter, 8 ranks, muon"]
    assert "GIFT resolved better than Euclidean" in by["reduce-scatter, 8 ranks, muon"]
