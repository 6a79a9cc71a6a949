"""How the bench writes numbers, in one place for every page it generates (REPORT.md by
`bench.pages.report`, the README and docs blocks by `bench.pages.readme` and `bench.pages.blocks`): a paired
difference with its 95% CI, the share of a gap closed with its Fieller CI, signed
percentages, markdown tables. The statistics themselves are `bench.lib.stats`; a page that wrote a
CI its own way would disagree with the others on the same result.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

__all__ = ["paired_ci", "share_closed", "signed_pct", "table", "value"]


def value(v: Any, digits: int = 4) -> str:
    """A table cell: ints with thousands separators, floats with `digits` decimals (scientific
    below 1e-3 or from 1e5 on), NaN as `n/a`, anything else as `str`."""
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.{digits - 1}e}"
        return f"{v:.{digits}f}"
    return str(v)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 4) -> str:
    """A GitHub-flavoured markdown table; floats with `digits` decimals."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(value(v, digits) for v in row) + " |")
    return "\n".join(lines)


def paired_ci(p: dict, digits: int = 4, *, mark_resolved: bool = False) -> str:
    """`mean ± 95% CI half-width (n)` of a paired difference (`bench.lib.stats.Paired.as_dict`);
    with `mark_resolved`, ` *` marks a difference whose CI excludes zero."""
    if p["n"] < 2:
        return f"{p['mean']:+.{digits}f} (n=1)"
    mark = " *" if mark_resolved and p["resolved"] else ""
    return f"{p['mean']:+.{digits}f} ± {p['ci95']:.{digits}f}{mark} (n={p['n']})"


def share_closed(g: dict, *, unresolved: str, closed: str = "", ci_label: str = "") -> str:
    """`NN%<closed> (<ci_label>lo% to hi%)`: the share of a gap closed (`share_closed`) with
    its Fieller 95% CI (`share_closed_ci95`; "CI unbounded" without bounds), or `unresolved`
    where no gap was resolved to take a share of (NaN)."""
    share = g.get("share_closed", math.nan)
    if share != share:
        return unresolved
    ci = g.get("share_closed_ci95")
    bounds = "CI unbounded" if ci is None else f"{ci_label}{100 * ci[0]:.0f}% to {100 * ci[1]:.0f}%"
    return f"{100 * share:.0f}%{closed} ({bounds})"


def signed_pct(x: float) -> str:
    """A fraction as a signed percentage with one decimal (`+12.3%`)."""
    return f"{100 * x:+.1f}%"
