"""The maps built from the optimizer's own state: `Momentum` (the low-rank map of the momentum
`M^T M`, what Muon orthogonalizes) and `SecondMoment` (one scale per input column from Adam's
`exp_avg_sq`, the coordinates AdamW's update sees). Each reads its tensor through
`_optimizer_state_source`, which raises naming the layer when the optimizer keeps none, over
the optimizers `leaf_optimizers` finds inside a container.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from gift_compile.geometry.maps import EXACT, FactorSource, Geometry, Gradient, Statistics
from gift_compile.sync import all_reduce_

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["Momentum", "SecondMoment", "leaf_optimizers"]


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


def _optimizer_state_source(geometry: str, keys: tuple[str, ...], what: str, weights: Callable[[str], torch.Tensor],
                            optimizer: Any | None, steps: Callable[[], int], advice: str) -> FactorSource:
    """A factor source reading, for each managed weight, the first of `keys` in the optimizer
    state (identical on every rank because the replicas are; under FSDP2 the rank's shard).
    Raises naming the layer when no optimizer is attached or it keeps none of `keys` for the
    layer: a silent skip would leave the layer Euclidean while the config says otherwise."""
    if optimizer is None:
        def missing(name: str) -> torch.Tensor:
            raise RuntimeError(f"GIFT: geometry={geometry!r} but no optimizer is attached, so layer {name} has no "
                               f"{what} to build its map from; pass optimizer= to gift_compile.apply or call "
                               "attach_optimizer")
        return missing
    leaves = leaf_optimizers(optimizer)

    def source(name: str) -> torch.Tensor:
        weight = weights(name)
        for opt in leaves:
            st = opt.state.get(weight, {})
            for key in keys:
                if key in st:
                    return st[key]
        kinds = ", ".join(type(o).__name__ for o in leaves)
        raise RuntimeError(f"GIFT: geometry={geometry!r} but the optimizer ({kinds}) keeps no {what} "
                           f"({' or '.join(keys)}) for layer {name} at step {steps()}; {advice}")

    return source


class _OptimizerStateFactor:
    """Mixin of the maps whose factor is a tensor the optimizer keeps: it is read through
    `_optimizer_state_source` (first of `STATE_KEYS`) and, being an average over steps already,
    replaces the kept factor at each refresh instead of entering an EMA."""

    name: ClassVar[str]
    needs_optimizer: ClassVar[bool] = True
    STATE_KEYS: ClassVar[tuple[str, ...]]
    STATE_WHAT: ClassVar[str]  # what the error message calls the tensor
    STATE_ADVICE: ClassVar[str]  # what to do when the optimizer keeps none

    @staticmethod
    @torch.no_grad()
    def fold_factor(kept: torch.Tensor, new: torch.Tensor, ema: float) -> None:
        kept.copy_(new)

    @classmethod
    def factor_source(cls, weights: Callable[[str], torch.Tensor], optimizer: Any | None,
                      steps: Callable[[], int]) -> FactorSource:
        """Each managed weight's `STATE_KEYS` tensor in the optimizer state."""
        return _optimizer_state_source(cls.name, cls.STATE_KEYS, cls.STATE_WHAT, weights, optimizer, steps,
                                       cls.STATE_ADVICE)


class Momentum(_OptimizerStateFactor, Gradient):
    """Rank-r whitening of the factor of each weight's momentum in the optimizer state (torch
    Muon / SGD `momentum_buffer`, Adam / AdamW `exp_avg`); the momentum is already an average
    over steps, so each refresh replaces the factor."""

    name = "momentum"
    # optimizer state keys holding a momentum (torch Muon / SGD, then Adam / AdamW)
    STATE_KEYS = MOMENTUM_KEYS = ("momentum_buffer", "exp_avg")
    STATE_WHAT = "momentum"
    STATE_ADVICE = "use geometry='lowrank' or 'gradient', or an optimizer with momentum"


class SecondMoment(_OptimizerStateFactor, Geometry):
    """One scale per input column from Adam's second moment: `X = G diag(s)` is quantized,
    `G' = Q(X) diag(1/s)`, with `c_j = sum_i exp_avg_sq[i, j]` and `s_j = (c_j / mean(c))^{-1/2}`.

    Why: AdamW steps by `m / sqrt(v)`, so an error in a column whose `v` is small is amplified
    in the update; scaling columns by `v^{-1/2}` before quantizing spends the quantizer's
    relative precision where the update sees it (the fidelity sweep, metric `adamw`: gain
    1.15-1.19x over Euclidean at NVFP4 and int2, where K-FAC whitening hurts, 0.84-0.87x). Only
    columns: a per-row factor is absorbed by the formats' row/block scales. Under FSDP2 each rank
    sums the columns of its row shard and one all-reduce of `d_in` numbers gives every rank the
    full `c`; the owner then builds `s` and broadcasts it, so the map is bit-identical. `c` is
    clamped at its smallest positive entry (a column Adam has never seen move gets the largest
    scale, not an infinite one); the map is the identity until the first refresh.
    """

    name, kind, is_identity, adaptive = "second_moment", "diagonal", False, True
    uses_gradient_factor, optimizer_coordinates = True, True
    STATE_KEYS = SECOND_MOMENT_KEYS = ("exp_avg_sq",)  # torch Adam / AdamW
    STATE_WHAT = "second moment"
    STATE_ADVICE = "use it with torch.optim.Adam / AdamW, or another geometry"

    def _allocate(self, seed: int, f32: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        return (torch.ones(self.d_in, **f32), torch.ones(self.d_in, **f32))

    @staticmethod
    def apply_forward(g: torch.Tensor, tensors: tuple[torch.Tensor, ...], precision: str = EXACT) -> torch.Tensor:
        return g * tensors[0]

    @staticmethod
    def apply_inverse(gt: torch.Tensor, tensors: tuple[torch.Tensor, ...], precision: str = EXACT) -> torch.Tensor:
        return gt * tensors[1]

    @staticmethod
    def gated(tensors: tuple[torch.Tensor, ...], on: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.where(on, t, 1.0) for t in tensors)

    @torch.no_grad()
    def set_identity(self) -> None:
        for t in self.tensors:
            t.fill_(1.0)

    @classmethod
    def allocate_factor(cls, d_in: int, device: torch.device | str) -> torch.Tensor | None:
        """The column sums `c` of the second moment (`d_in` numbers)."""
        return torch.zeros(d_in, device=device)

    @staticmethod
    @torch.no_grad()
    def reduce_factor(local: torch.Tensor, group: dist.ProcessGroup | None, sharded: bool) -> torch.Tensor:
        """`c_j = sum_i v[i, j]` over the rank's rows, summed over `group` when the rows are
        sharded (FSDP2): one all-reduce of `d_in` numbers."""
        c = local.detach().reshape(-1, local.shape[-1]).double().sum(dim=0)
        if sharded:
            all_reduce_(c, group)
        return c.float()

    @torch.no_grad()
    def refresh_from(self, a: torch.Tensor, damping: float) -> None:
        """`s = (c / mean(c))^{-1/2}` from the column sums `a` (`damping` is unused: the clamp
        at the smallest positive entry bounds the scales). All-zero `c` keeps the identity."""
        c = a.double()
        positive = c[c > 0]
        if positive.numel() == 0:
            self.set_identity()
            return
        c = c.clamp(min=float(positive.min()))
        s = (c / c.mean()).rsqrt()
        self.tensors[0].copy_(s)
        self.tensors[1].copy_(1.0 / s)

    @classmethod
    def transform_flops(cls, rows: int, d_in: int, rank: int) -> float:
        return 2.0 * rows * d_in

    @classmethod
    def refresh_flops(cls, rows: int, d_in: int, rank: int, stats: Statistics | None) -> float:
        """Column sums of `exp_avg_sq` and one scale per column."""
        return float(rows * d_in + 3 * d_in)
