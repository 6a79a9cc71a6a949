"""Where a bench's results came from: the commit of the checkout that ran them.

One function for every results file that records its commit (`bench.cluster.layouts`, `bench.cluster.fault_table`,
`bench.fidelity.delayed_scale`), so they all name a checkout the same way.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["commit"]


def commit() -> str:
    """The short hash of the checkout this bench (and the `gift_compile` beside it) runs from."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent).stdout.strip()
