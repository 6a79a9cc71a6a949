"""bench.cluster.exit_stress counts what the jobs' exits were: an abort is counted, a clean exit is not.

The abort is stood in for by an "interpreter" that prints gloo's message and raises SIGABRT, so
the counting is checked without waiting on a race; one real 2-rank job checks the clean path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.cluster import exit_stress


def test_an_abort_is_counted_with_its_message_and_a_clean_job_is_not(tmp_path: Path) -> None:
    aborting = tmp_path / "aborting-python"
    aborting.write_text("#!/bin/sh\necho 'terminate called without an active exception' >&2\nkill -ABRT $$\n")
    aborting.chmod(0o755)
    out = tmp_path / "exit.json"
    exit_stress.main(["--runs", "2", "--variants", "plain-holder", "--python", str(aborting), "--label", "abort",
                      "--out", str(out)])
    exit_stress.main(["--runs", "1", "--variants", "no-holder", "--python", sys.executable, "--label", "real",
                      "--out", str(out)])
    rows = {r["label"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["abort"] == {"variant": "plain-holder", "label": "abort", "jobs": 2, "failed_jobs": 2,
                             "abort_message": 2, "exit_codes": [-6]}
    assert rows["real"] == {"variant": "no-holder", "label": "real", "jobs": 1, "failed_jobs": 0,
                            "abort_message": 0, "exit_codes": [0]}
