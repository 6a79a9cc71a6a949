"""The checks every multi-rank torchtitan test makes of a run against GIFT off (test-only helpers,
imported from tests/ like ``conftest``).

A GIFT run and a GIFT-off run with the same seed, init and data must log every step; their first
losses must be equal (the forward is the same: only the gradient path differs), a later one must
differ (the gradient path did quantize: a no-op feature would reproduce GIFT off exactly) and
every one must stay within the tolerance the test allows.
"""

from __future__ import annotations

from gift_compile.torchtitan_ext.runs import RunResult

__all__ = ["assert_tracks_gift_off", "logged_steps"]


def logged_steps(run: RunResult, steps: int) -> list[dict]:
    """The records of `run` that carry a loss, checked to be steps 1..`steps` in order."""
    records = [r for r in run.records if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    return records


def assert_tracks_gift_off(gift: RunResult, off: RunResult, tolerance: float) -> None:
    """`gift`'s losses start equal to `off`'s, differ later, and stay within `tolerance` of them."""
    g, o = gift.losses(), off.losses()
    assert g[1] == o[1]  # same init, data and forward: only the gradient path differs
    assert any(g[s] != o[s] for s in g if s > 1)  # and that path did quantize
    for step in g:
        assert abs(g[step] - o[step]) < tolerance, (step, g, o)
