"""The transform API by map kind: `Transform(kind, d_in, rank)`, `apply_forward(kind, ...)`,
`apply_inverse(kind, ...)`, and the whitening math (`gradient_factor`, `dense_whitening`, ...).

A thin facade over the geometry table (`gift_compile.geometry.table`): a kind ("identity",
"hadamard", "dense", "lowrank") names the map a plan carries; `map_class(kind)` is the class
whose code runs. Benchmarks and user code that pick a map by kind use these names; GIFT's own
layers build their geometry from `GiftConfig.geometry` through `geometry_class`.

The package is the geometry layer (docs/architecture.md): the maps (`maps`, `optimizer_maps`),
their statistics and whitening math (`statistics`, `whitening`), the table (`table`) and the
optimizer inspections behind `"auto"` (`optimizers`); it imports only the codec, the kernels
(the low-rank map's tensor-core matmuls, `kernels.map_dispatch`), the config and `sync`.
"""

from __future__ import annotations

import torch

from gift_compile.geometry.table import KINDS, Geometry, map_class
from gift_compile.kernels.map_dispatch import MapPrecision
from gift_compile.geometry.whitening import (
    dense_whitening, diag_floor, gradient_factor, lowrank_refresh_flops, lowrank_tensors, lowrank_whitening,
    top_eigenpairs,
)

__all__ = ["KINDS", "Transform", "apply_forward", "apply_inverse", "dense_whitening", "diag_floor", "gated_tensors",
           "gradient_factor", "lowrank_refresh_flops", "lowrank_tensors", "lowrank_whitening", "top_eigenpairs"]


def Transform(kind: str, d_in: int, rank: int = 32, *, seed: int = 0,  # noqa: N802 (kept for its callers)
              device: torch.device | str = "cpu") -> Geometry:
    """A map of kind `kind` on `d_in` input columns (its geometry class's instance): `.forward`,
    `.inverse`, `.refresh_from`, `.refresh_from_stats`, `.tensors` (refreshed in place)."""
    return map_class(kind)(d_in, rank, seed=seed, device=device)


def apply_forward(kind: str, g: torch.Tensor, tensors: tuple[torch.Tensor, ...],
                  precision: str = MapPrecision.EXACT) -> torch.Tensor:
    """`G T^T` for a gradient `g` of shape `[..., d_in]` (fp32), map `kind`, its matmuls at
    `precision` (`GiftConfig.map_precision`; the exchange passes its plan's)."""
    return map_class(kind).apply_forward(g, tensors, precision)


def apply_inverse(kind: str, gt: torch.Tensor, tensors: tuple[torch.Tensor, ...],
                  precision: str = MapPrecision.EXACT) -> torch.Tensor:
    """`G~ T^{-T}`: exact inverse of `apply_forward` (up to fp32 rounding, and the operand
    rounding of `precision`)."""
    return map_class(kind).apply_inverse(gt, tensors, precision)


def gated_tensors(kind: str, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The tensors map `kind` runs with, from a gated plan's (`ItemPlan.gated`): the layer's
    map tensors followed by its 0-d bool path gate; the map's own where the gate is on, the
    identity's values where it is off (`Geometry.gated`)."""
    return map_class(kind).gated(tuple(tensors[:-1]), tensors[-1])
