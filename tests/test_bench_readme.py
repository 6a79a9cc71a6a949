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
    with pytest.raises(ValueError, match="bench:step_model"):
        readme.render("no markers here", json.loads(readme.RESULTS.read_text()))
