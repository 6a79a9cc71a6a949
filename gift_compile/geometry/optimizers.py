"""What the optimizer steps: the inspections GIFT derives settings from.

`select_metric_for` chooses `GiftConfig.select_metric` from whether the
optimizer preconditions whole matrices, `geometry_for` chooses `GiftConfig.geometry` from the
same inspection plus whether the optimizer keeps Adam's second moment. Above the geometry table
(it asks the table whether a geometry works in the optimizer's coordinates); the optimizer
maps below the table find the optimizers themselves (`leaf_optimizers`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gift_compile.config import SelectMetric
from gift_compile.geometry.optimizer_maps import leaf_optimizers
from gift_compile.geometry.table import geometry_class

__all__ = ["MATRIX_PRECONDITIONERS", "SECOND_MOMENT_OPTIMIZERS", "geometry_for", "optimizer_family",
           "preconditions_matrices", "select_metric_for"]

# Optimizers that precondition each weight matrix as a whole (orthogonalize it or whiten it
# with curvature factors), recognised by a lower-case fragment of their class name or of a
# base class's name: Muon (torch.optim.Muon, torchtitan's DistMuon), Shampoo and
# DistributedShampoo, SOAP, K-FAC, PSGD Kron. Such an optimizer amplifies the gradient's weak
# directions, so the communication error that matters is the one seen in the layer's
# geometry (`select_metric="whitened"`); an elementwise optimizer (Adam, AdamW, SGD) sees the
# error in plain coordinates (`"euclidean"`).
MATRIX_PRECONDITIONERS = ("muon", "shampoo", "soap", "kfac", "kron")


# Elementwise optimizers that keep Adam's second moment `exp_avg_sq` per weight (the state the
# `second_moment` geometry reads). Adamax keeps an infinity norm instead and is not listed.
SECOND_MOMENT_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam,
)


def preconditions_matrices(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is a matrix preconditioner (`MATRIX_PRECONDITIONERS`)."""
    names = [c.__name__.lower() for c in type(optimizer).__mro__]
    return any(frag in name for name in names for frag in MATRIX_PRECONDITIONERS)


def _stepped(optimizer: object, weights: list[torch.Tensor], what: str) -> list[tuple[int, torch.optim.Optimizer]]:
    """`(numel, optimizer that steps it)` of each of `weights` some optimizer in `optimizer`
    steps; raises when none is stepped (then no choice is defined)."""
    leaves = leaf_optimizers(optimizer)
    owner: dict[int, torch.optim.Optimizer] = {}
    for opt in leaves:
        for group in opt.param_groups:
            for p in group["params"]:
                owner.setdefault(id(p), opt)
    stepped = [(w.numel(), owner[id(w)]) for w in weights if id(w) in owner]
    if not stepped:
        names = ", ".join(type(o).__name__ for o in leaves) or "none"
        raise ValueError(f"GIFT: cannot choose {what} from the optimizer: none of the {len(weights)} managed "
                         f"weights is in its parameter groups ({names}); set {what} explicitly")
    return stepped


def _mostly(stepped: list[tuple[int, torch.optim.Optimizer]], test: Callable[[torch.optim.Optimizer], bool]) -> bool:
    """Whether optimizers passing `test` step more than half of the managed elements."""
    return 2 * sum(n for n, opt in stepped if test(opt)) > sum(n for n, _ in stepped)


def select_metric_for(optimizer: object, weights: list[torch.Tensor], geometry: str | None = None) -> SelectMetric:
    """`GiftConfig.select_metric` for the optimizer(s) that step the managed `weights`.

    "whitened" when most of the managed elements (by count) are stepped by a matrix
    preconditioner, else "euclidean". The convergence study (bench/results/REPORT.md,
    section 5) is the evidence: under Muon the whitened round trip is what GIFT improves and
    what costs loss; under AdamW the plain error is. One exception: a `geometry` whose map is
    the optimizer's own preconditioning (`second_moment` under Adam/AdamW, `optimizer_coordinates`)
    is judged in its coordinates ("whitened"), where the error is the error of the update itself
    (the bench's AdamW sweep measured it so); in plain L2 the same map measures 0.96x at NVFP4
    and would be refused. Weights that no optimizer steps are ignored; if none of them is
    stepped the choice is undefined and this raises.
    """
    stepped = _stepped(optimizer, weights, "select_metric")
    if _mostly(stepped, preconditions_matrices):
        return SelectMetric.WHITENED
    if geometry is not None and geometry_class(geometry).optimizer_coordinates and _mostly(stepped, _second_moment):
        return SelectMetric.WHITENED
    return SelectMetric.EUCLIDEAN


def _second_moment(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt` keeps Adam's second moment (`SECOND_MOMENT_OPTIMIZERS`)."""
    return isinstance(opt, SECOND_MOMENT_OPTIMIZERS)


def optimizer_family(optimizer: object, weights: list[torch.Tensor]) -> str:
    """The family of the optimizer(s) stepping most managed elements, as the recipes name them:
    "muon" (a matrix preconditioner), "adamw" (a second moment), else the class names."""
    stepped = _stepped(optimizer, weights, "the optimizer family")
    if _mostly(stepped, preconditions_matrices):
        return "muon"
    if _mostly(stepped, _second_moment):
        return "adamw"
    return "/".join(sorted({type(o).__name__ for _, o in stepped}))


def geometry_for(optimizer: object, weights: list[torch.Tensor]) -> str:
    """`GiftConfig.geometry` for the optimizer(s) that step the managed `weights`.

    Most managed elements (by count) stepped by a matrix preconditioner (Muon, Shampoo, ...):
    "lowrank", the K-FAC map (the convergence study: under Muon it closes about half of
    Euclidean low-bit's gap at NVFP4 on both paths, the most of any runnable map trained).
    Else, most stepped by an optimizer with a second moment (Adam, AdamW):
    "second_moment" (the bench's AdamW-update sweep: K-FAC whitening raises the error of
    AdamW's next update, 0.84-0.87x Euclidean's gain, the second-moment column scaling lowers
    it, 1.15-1.19x at NVFP4 and int2). Anything else (SGD, ...) has no evidence either way:
    "none", the Euclidean codec. Raises when none of `weights` is stepped.
    """
    stepped = _stepped(optimizer, weights, "geometry")
    if _mostly(stepped, preconditions_matrices):
        return "lowrank"
    if _mostly(stepped, _second_moment):
        return "second_moment"
    return "none"
