"""Geometries: the coordinates in which a layer's gradient is quantized, one class each.

A map acts on the *input* dimension (the last dim of a `[out, in]` weight gradient), row by
row, so it commutes with FSDP's dim-0 sharding and with the sum over ranks:
`sum_r G_r T^T = (sum_r G_r) T^T` when every rank holds the same `T`.

Each geometry is a class that owns everything about it: its tensors (allocated once at their
final shapes and refreshed in place, so a compiled graph never recompiles), the traced
forward/inverse (`apply_forward` / `apply_inverse`, static methods of `(g, tensors)` that the
collectives, the FX pass and the benchmarks call), where its statistics come from (K-FAC input
hooks, the reduced gradient, the optimizer's momentum), its refresh, its FLOP and memory cost
and its state-dict entries. `GEOMETRIES` maps `GiftConfig.geometry` to the class; it is the only
place that knows geometry names. A plan carries the map's `kind` (several geometries share one
map: "gradient" and "momentum" build a low-rank map from another factor) as data, and the core
finds the code through `map_class(kind)`.

Maps:
- identity (`none`): `G~ = G`.
- hadamard: random signs then an orthonormal block Walsh-Hadamard butterfly; a 0-d `gate`
  tensor switches it off by data.
- dense: `T = L^{-1}` with `A + delta I = L L^T` (Cholesky), applied as two `d_in x d_in` matmuls.
- lowrank: `A ~= D^{1/2} (I + V S^2 V^T) D^{1/2}` (top-r eigenpairs plus the damped diagonal of
  the residual), `T = M D^{-1/2}`, `M = I + V((I+S^2)^{-1/2} - I)V^T`, applied in
  O(d_in * r) per row; `M^{-1} = I + V((I+S^2)^{1/2} - I)V^T`.
- diagonal (`second_moment`): `T = diag(s)`, one scale per input column, applied in
  O(d_in) per row; `s_j = (c_j / mean(c))^{-1/2}` with `c_j` the column sum of Adam's
  `exp_avg_sq`.
"""

from __future__ import annotations

from gift_compile.config import AUTO_GEOMETRY
from gift_compile.config import GEOMETRIES as CONFIG_NAMES
from gift_compile.geometry.maps import Dense, FactorSource, Geometry, Gradient, Hadamard, LowRank, Statistics
from gift_compile.geometry.optimizer_maps import Momentum, SecondMoment

__all__ = ["GEOMETRIES", "IDENTITY_KIND", "KINDS", "Dense", "FactorSource", "Geometry", "Gradient", "Hadamard",
           "LowRank", "Momentum", "SecondMoment", "Statistics", "geometry_class", "map_class"]

# The one table: GiftConfig.geometry -> class. Everything else asks it.
GEOMETRIES: dict[str, type[Geometry]] = {
    cls.name: cls for cls in (Geometry, Hadamard, Dense, LowRank, Gradient, Momentum, SecondMoment)
}
# `GiftConfig` validates names from below this layer, against its own list: the two must agree.
if tuple(GEOMETRIES) != CONFIG_NAMES:
    raise ImportError(f"gift_compile.config.GEOMETRIES {CONFIG_NAMES} != the geometry table's {tuple(GEOMETRIES)}")
# The map each plan kind runs (geometries sharing a map share its code: the first one listed).
_MAPS: dict[str, type[Geometry]] = {}
for _cls in GEOMETRIES.values():
    _MAPS.setdefault(_cls.kind, _cls)
IDENTITY_KIND = Geometry.kind
KINDS = tuple(_MAPS)


def geometry_class(name: str) -> type[Geometry]:
    """The class of `GiftConfig.geometry` `name` (raises naming the choices)."""
    try:
        return GEOMETRIES[name]
    except KeyError:
        if name == AUTO_GEOMETRY:  # GiftConfig's default: a choice `apply` makes, not a map
            raise ValueError("geometry 'auto' is chosen from the optimizer by gift_compile.apply(..., optimizer=) "
                             "(gift_compile.api.resolve_auto); name a geometry to build GIFT's state without it") \
                from None
        raise ValueError(f"unknown geometry {name!r}; allowed: {', '.join(GEOMETRIES)}") from None


def map_class(kind: str) -> type[Geometry]:
    """The class whose map a plan's `kind` names (raises naming the kinds)."""
    try:
        return _MAPS[kind]
    except KeyError:
        raise ValueError(f"unknown transform kind {kind!r}; allowed: {', '.join(KINDS)}") from None
