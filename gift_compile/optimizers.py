"""What the optimizer steps: the inspections GIFT derives settings from.

`leaf_optimizers` finds the `torch.optim.Optimizer`s inside a container (the momentum geometry
reads their state); `select_metric_for` chooses `GiftConfig.select_metric` from whether the
optimizer preconditions whole matrices.
"""

from __future__ import annotations

import torch

__all__ = ["MATRIX_PRECONDITIONERS", "leaf_optimizers", "preconditions_matrices", "select_metric_for"]

# Optimizers that precondition each weight matrix as a whole (orthogonalize it or whiten it
# with curvature factors), recognised by a lower-case fragment of their class name or of a
# base class's name: Muon (torch.optim.Muon, torchtitan's DistMuon), Shampoo and
# DistributedShampoo, SOAP, K-FAC, PSGD Kron. Such an optimizer amplifies the gradient's weak
# directions, so the communication error that matters is the one seen in the layer's
# geometry (`select_metric="whitened"`); an elementwise optimizer (Adam, AdamW, SGD) sees the
# error in plain coordinates (`"euclidean"`).
MATRIX_PRECONDITIONERS = ("muon", "shampoo", "soap", "kfac", "kron")


def leaf_optimizers(optimizer: object) -> list[torch.optim.Optimizer]:
    """The `torch.optim.Optimizer`s inside `optimizer`: itself, the members of a container
    with an `optimizers` list (torchtitan's `OptimizersContainer`), or of a list/tuple."""
    if isinstance(optimizer, (list, tuple)):
        return [leaf for o in optimizer for leaf in leaf_optimizers(o)]
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, (list, tuple)):
        return leaf_optimizers(inner)
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    raise TypeError(f"GIFT: {type(optimizer).__name__} is not a torch.optim.Optimizer, a container of them "
                    "(an `optimizers` list) or a list of them")


def preconditions_matrices(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is a matrix preconditioner (`MATRIX_PRECONDITIONERS`)."""
    names = [c.__name__.lower() for c in type(optimizer).__mro__]
    return any(frag in name for name in names for frag in MATRIX_PRECONDITIONERS)


def select_metric_for(optimizer: object, weights: list[torch.Tensor]) -> str:
    """`GiftConfig.select_metric` for the optimizer(s) that step the managed `weights`.

    "whitened" when most of the managed elements (by count) are stepped by a matrix
    preconditioner, else "euclidean". The convergence study (bench/results/REPORT.md,
    section 5) is the evidence: under Muon the whitened round trip is what GIFT improves and
    what costs loss; under AdamW the plain error is. Weights that no optimizer steps are
    ignored; if none of them is stepped the choice is undefined and this raises.
    """
    leaves = leaf_optimizers(optimizer)
    owner: dict[int, torch.optim.Optimizer] = {}
    for opt in leaves:
        for group in opt.param_groups:
            for p in group["params"]:
                owner.setdefault(id(p), opt)
    stepped = [(w.numel(), owner[id(w)]) for w in weights if id(w) in owner]
    if not stepped:
        names = ", ".join(type(o).__name__ for o in leaves) or "none"
        raise ValueError(f"GIFT: cannot choose select_metric from the optimizer: none of the {len(weights)} managed "
                         f"weights is in its parameter groups ({names}); set select_metric explicitly")
    preconditioned = sum(n for n, opt in stepped if preconditions_matrices(opt))
    return "whitened" if 2 * preconditioned > sum(n for n, _ in stepped) else "euclidean"
