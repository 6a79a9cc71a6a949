"""The checks every multi-rank torchtitan test makes of a run against GIFT off (test-only helpers,
imported from tests/ like ``conftest``).

A GIFT run and a GIFT-off run with the same seed, init and data must log every step; their first
losses must be equal (the forward is the same: only the gradient path differs), a later one must
differ (the gradient path did quantize: a no-op feature would reproduce GIFT off exactly) and
every one must stay within the tolerance the test allows.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gift_compile.torchtitan_ext.cpu.kill_resume import checkpoint_tensors
from gift_compile.torchtitan_ext.cpu.runs import RunResult

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


def assert_expert_residuals_checkpointed(run: RunResult, experts: list[str], step: int, *, ranks: int = 4,
                                         shape: tuple[int, int] = (128, 64), local_experts: int = 0) -> None:
    """Under error feedback each rank keeps, per grouped expert weight, what its last encode left
    out of its local gradient (`shape`: the item), and the GIFT state the run checkpointed at
    `step` carries it: non-zero (it was written: the experts were quantized with it), finite, and
    each rank's own; and no expert module's log line says it goes without error feedback. With
    `local_experts` the experts are layers of the experts' own state (whitened): the residual is
    their layers' rows (``sub0:<module>.<weight>[<e>].residual.0``), else the state's residual of
    a gradient sent outside the layers (``outside:<module>.<weight>.0``)."""
    assert not [line for line in run.output.splitlines()
                if "(GroupedExperts)" in line and "without error feedback" in line]
    folder = Path(run.command[run.command.index("--dump-folder") + 1]) / "checkpoint" / f"step-{step}"
    flat = checkpoint_tensors(folder)
    for expert in experts:
        for w in ("w1_EFD", "w2_EDF", "w3_EFD"):
            seen = []
            for rank in range(ranks):
                keys = ([f"gift.rank{rank}.sub0:{expert}.{w}[{e}].residual.0" for e in range(local_experts)]
                        if local_experts else [f"gift.rank{rank}.outside:{expert}.{w}.0"])
                assert all(k in flat for k in keys), (keys, sorted(k for k in flat if "residual" in k)[:8])
                residual = torch.cat([flat[k] for k in keys])
                key = keys[0]
                assert tuple(residual.shape) == shape and residual.dtype == torch.float32, key
                assert bool(torch.isfinite(residual).all()) and float(residual.norm()) > 0, key
                seen.append(residual)
            assert all(not torch.equal(a, b) for i, a in enumerate(seen) for b in seen[i + 1:]), (expert, w)
