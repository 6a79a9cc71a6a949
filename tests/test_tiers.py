"""The split of the suite into `make test` and `make test-full` stays deliberate (tests/tiers.py).

A new test file in neither tier, a tier entry that names no test (renamed or removed), or a row of
the feature table whose tests `make test` would not run fails here. The tiers are read from what
pytest itself collects and deselects, so a broken marker hook fails too.
"""

from __future__ import annotations

import subprocess
import sys
from functools import cache
from pathlib import Path

from conftest import in_full_tier
from tiers import FAST_FILES, FEATURES, FULL_FILES, FULL_TESTS

TESTS = Path(__file__).resolve().parent


# Collects the suite in a child interpreter and prints each node id with whether it carries the `full`
# marker: the marker `make test` deselects with `-m "not full"`.
_COLLECT = """
import sys, pytest
class Report:
    def pytest_collection_finish(self, session):
        for item in session.items:
            print("ITEM", int(item.get_closest_marker("full") is not None), item.nodeid)
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"], plugins=[Report()]))
"""


@cache
def _collected() -> dict[str, bool]:
    """Every node id pytest collects from tests/, and whether it is in the full tier only."""
    out = subprocess.run([sys.executable, "-c", _COLLECT], cwd=TESTS.parent, capture_output=True, text=True,
                         timeout=600)
    ids = {line.split(" ", 2)[2]: line.split(" ", 2)[1] == "1" for line in out.stdout.splitlines()
           if line.startswith("ITEM ")}
    assert out.returncode == 0 and ids, out.stdout[-2000:] + out.stderr[-2000:]
    return ids


def _fast() -> tuple[str, ...]:
    return tuple(i for i, full in _collected().items() if not full)


def _matches(entry: str, ids: tuple[str, ...]) -> list[str]:
    """The node ids an entry of tests/tiers.py names: itself, or its parametrizations."""
    return [i for i in ids if i.removeprefix("tests/") == entry or i.removeprefix("tests/").startswith(entry + "[")]


def test_every_test_file_is_in_exactly_one_tier() -> None:
    files = {p.name for p in TESTS.glob("test_*.py")}
    assert not FAST_FILES & set(FULL_FILES), FAST_FILES & set(FULL_FILES)
    assert files - FAST_FILES - set(FULL_FILES) == set(), "add these files to tests/tiers.py"
    assert FAST_FILES | set(FULL_FILES) <= files, (FAST_FILES | set(FULL_FILES)) - files


def test_every_full_test_entry_names_tests_of_a_fast_file() -> None:
    everything = tuple(_collected())
    for entry in FULL_TESTS:
        assert entry.split("::")[0] in FAST_FILES, entry
        assert _matches(entry, everything), f"tests/tiers.py FULL_TESTS names no test: {entry}"


def test_the_marker_follows_the_tier_list() -> None:
    """`make test` deselects what carries `full`: exactly what tests/tiers.py puts in the full tier."""
    collected = _collected()
    assert {i for i, full in collected.items() if full} == {i for i in collected if in_full_tier(i)}
    assert 0 < sum(collected.values()) < len(collected)


def test_every_feature_row_has_a_fast_test() -> None:
    fast = _fast()
    missing = {row: entry for row, entries in FEATURES.items() for entry in entries if not _matches(entry, fast)}
    assert not missing, f"feature rows whose test `make test` does not run: {missing}"
    assert all(FEATURES.values())
