"""Where the bench's files are: the repository root and the results folder.

Results are grouped the way the bench is: `bench/results/<room>/` holds what the experiments of
room `bench.<room>` write (`bench.run`'s REPORT.md, results.json and figures sit at the top).
Every module that reads or writes a results file starts from `RESULTS` here, so moving a room's
folder is one edit."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
