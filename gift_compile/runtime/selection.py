"""Which managed layers take the transformed (GIFT) path, decided from measurements.

The gain of whitening depends on the layer and on the scaling granularity (on a small
Llama's real gradients, rank-32 whitening under E5M2 ranged from 0.89x to 1.93x the
Euclidean error per layer), so the default policy measures it: at a geometry refresh it
quantizes a sample of the layer's real, not yet quantized local gradient both ways (error in
plain L2, or with `select_metric="whitened"` in the layer's whitened geometry, the one a
preconditioned optimizer amplifies), and enables the transform only where the error drops
by at least `auto_min_gain` and the map's time stays below `auto_max_overhead` of the time the
layer costs the step without it (`overhead`). The decision is part of the compiled graph (`GiftState.set_selected`),
taken at the first refresh and again every `reselect_every` refreshes. Between decisions the
selected layers are still measured at every refresh, and one whose transformed path has become
worse than the Euclidean one (gain below 1, by the same metric) is deselected there
(`harmful`): statistics mature after the first decision, and a map that hurts must not be kept
until the next full decision (or forever, with `reselect_every=0`). Admission needs
`auto_min_gain`, removal a gain below 1: the gap keeps a layer near the boundary from flipping
at every refresh. The paper's offline rule (top-K by E5M2 saturation share) and explicit globs
are also available.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import torch

from gift_compile.codec import FormatSpec, as_rows, choose_scales, encode
from gift_compile.config import GiftConfig, SelectMetric, SelectRule
from gift_compile.exchange.collectives import ItemTensors, Shared, bucket_core
from gift_compile.exchange.plan import BucketPlan, Collective, ItemPlan
from gift_compile.geometry.table import IDENTITY_KIND, Geometry, map_class
from gift_compile.kernels.map_dispatch import MapPrecision

_E5M2_MAX_CODE = 0x7B  # 0 11110 11: 57344, the largest finite E5M2 magnitude


@dataclass
class LayerMeasurement:
    """Relative errors of one round trip on a gradient sample, Euclidean path vs transformed
    path, in the metric of `GiftConfig.select_metric`."""

    err_euclidean: float
    err_transformed: float
    overhead: float
    boundary_hits: float

    @property
    def gain(self) -> float:
        return self.err_euclidean / max(self.err_transformed, 1e-30)

    @property
    def finite(self) -> bool:
        """Whether both errors were measured (`measure` returns NaN for a zero or non-finite
        probe: a gradient that was never captured, is all zeros, or overflowed)."""
        return math.isfinite(self.err_euclidean) and math.isfinite(self.err_transformed)


def round_trip(g: torch.Tensor, spec: FormatSpec, kind: str, tensors: tuple[torch.Tensor, ...],
               block_rotation: bool = False, map_precision: str = MapPrecision.AUTO) -> torch.Tensor:
    """Transform, quantize, dequantize, inverse on one rank: the collective with no peers
    (with the block rotation where the config sends with it, and the map at the config's
    `map_precision`, so both paths are measured as they would be sent)."""
    rows, cols = g.shape
    item = ItemPlan(name="probe", rows=rows, cols=cols, format=spec.name, scaling=spec.scaling,
                    block_size=spec.block_size, kind=kind, n_tensors=len(tensors), block_rotation=block_rotation,
                    map_precision=map_precision)
    plan = BucketPlan((item,), 1, None, False, Collective.ALL_REDUCE)
    return bucket_core([g.float()], [ItemTensors(tuple(tensors))], Shared(), plan)[0][0]


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm().clamp(min=1e-30))


def boundary_hit_ratio(g: torch.Tensor) -> float:
    """Share of E5M2 per-tensor codes that land on the format maximum (the paper's statistic)."""
    spec = FormatSpec("fp8_e5m2", "tensor")
    scales, _ = choose_scales(g, spec)
    codes = encode(g, spec, scales) & 0x7F
    return float((codes == _E5M2_MAX_CODE).float().mean())


def transform_flops(kind: str, rows: int, d_in: int, rank: int) -> float:
    """FLOPs of forward plus inverse transform of a `[rows, d_in]` gradient (the map's own
    `transform_flops`)."""
    return map_class(kind).transform_flops(rows, d_in, rank)


def backward_flops(rows: int, d_in: int, tokens: float) -> float:
    """Weight- plus input-gradient matmuls of a linear layer: 2 * (2 * tokens * out * in)."""
    return 4.0 * max(tokens, 1.0) * rows * d_in


# The prices of the cost side, measured on an H200 (torch 2.11, Triton 3.6; the repository's
# bench/results/gpu/gpu_h200/, Llama-3-8B w1 and w2 gradients, 58.7M elements each, rank 32): the
# low-rank map's elementwise part (projections' epilogues, the residual and the copy) took
# 7.5-10.5 ps per element and its matmuls 5.8-5.9 ps; a bf16 weight-gradient matmul ran at
# 7.9e14 FLOP/s. Every process prices with them, a CPU one included, so a CPU run of the
# simulated cluster takes the decision the GPU run would.
MAP_ELEMENTWISE_SECONDS = 9.0e-12  # per gradient element, any map
MAP_MATMUL_SECONDS = 5.8e-12  # per gradient element, the rank-32 low-rank map's FLOPs
BACKWARD_FLOPS_PER_SECOND = 7.9e14
# the wire the user runs without GIFT, against which the map's time is judged: a bf16
# reduce-scatter summed in fp32 (the production bar)
BASELINE_WIRE_BYTES = 2.0
_PRICED_RANK = 32


def map_seconds(kind: str, rows: int, d_in: int, rank: int) -> float:
    """GPU time of a `kind` map's forward and inverse on a `[rows, d_in]` gradient: the measured
    elementwise price plus the measured rank-32 low-rank matmul price scaled by the map's FLOPs
    against that map's."""
    elements = float(rows * d_in)
    priced = transform_flops("lowrank", rows, d_in, _PRICED_RANK)
    return elements * (MAP_ELEMENTWISE_SECONDS + MAP_MATMUL_SECONDS * transform_flops(kind, rows, d_in, rank) / priced)


def step_seconds(rows: int, d_in: int, tokens: float, network_gbps: float) -> float:
    """GPU time a `[rows, d_in]` linear layer costs the step without GIFT's map: its backward
    matmuls at this rank's tokens plus its gradient's exchange at the baseline wire over a
    `network_gbps` link per GPU. The exchange is what GIFT exists to shrink, so a map is judged
    against the step it serves: at few tokens per rank the backward is small and the exchange
    is most of the layer's time, which a FLOPs-only ratio would miss (it switched the map off
    exactly where a run is most communication-bound)."""
    exchange = BASELINE_WIRE_BYTES * rows * d_in / (network_gbps * 1e9 / 8.0)
    return backward_flops(rows, d_in, tokens) / BACKWARD_FLOPS_PER_SECOND + exchange


def overhead(kind: str, shape: tuple[int, int], rank: int, tokens: float, network_gbps: float) -> float:
    """The map's time as a share of the layer's time in the step (`map_seconds` over
    `step_seconds`): the selection's cost side, compared with `auto_max_overhead`."""
    return map_seconds(kind, shape[0], shape[1], rank) / step_seconds(shape[0], shape[1], tokens, network_gbps)


def measure(
    sample: torch.Tensor, config: GiftConfig, kind: str, tensors: tuple[torch.Tensor, ...], shape: tuple[int, int],
    tokens: float, fqn: str
) -> LayerMeasurement:
    """Both paths' relative errors of the layer `fqn` at the format it is sent in
    (`config.format_for`), the map's share of the layer's step time (`overhead`) and the
    boundary-hit ratio."""
    spec = FormatSpec(config.format_for(fqn), config.scaling, config.block_size)
    g = as_rows(sample).float()
    if not bool(torch.isfinite(g).all()) or float(g.norm()) == 0.0:
        return LayerMeasurement(float("nan"), float("nan"), 0.0, 0.0)
    geometry = map_class(kind)
    rot = config.block_rotation
    euclidean = round_trip(g, spec, IDENTITY_KIND, (), rot)
    transformed = round_trip(g, spec, kind, tensors, rot, config.map_precision)  # the map as the layer sends it
    if config.select_metric is SelectMetric.WHITENED:  # both errors seen in the candidate's geometry
        g, euclidean, transformed = (geometry.apply_forward(t, tensors) for t in (g, euclidean, transformed))
    e_euc, e_t = relative_error(euclidean, g), relative_error(transformed, g)
    over = overhead(kind, shape, geometry.rank_of(tensors), tokens, config.auto_network_gbps)
    return LayerMeasurement(e_euc, e_t, over, boundary_hit_ratio(g))


def rests_on_gain(config: GiftConfig) -> bool:
    """Whether `config.select` decides by the measured gain (`"auto"`); the static rules and
    the boundary-hits rank do not read it."""
    return config.select is SelectRule.AUTO


def _require_finite(config: GiftConfig, measurements: dict[str, LayerMeasurement], caller: str) -> None:
    """Raise when the gain rule would read an unmeasured (NaN) gain: such a layer must be
    left out by the caller (the refresh defers it), never kept or dropped by a comparison."""
    bad = sorted(n for n, m in measurements.items() if not m.finite)
    if bad and rests_on_gain(config):
        raise ValueError(f"gift_compile.runtime.selection.{caller}: no finite measurement for {', '.join(bad)} "
                         "(zero or non-finite gradient probe); leave unmeasured layers out of the decision")


def decide(config: GiftConfig, geometry: type[Geometry], measurements: dict[str, LayerMeasurement],
           boundary_scores: dict[str, float]) -> set[str]:
    """The set of layer FQNs that take the transformed path under `config.select` and the
    layers' `geometry` (its class, as the `GiftState` holds it; the gain rule refuses
    unmeasured layers, see `_require_finite`)."""
    _require_finite(config, measurements, "decide")
    select = config.select
    names = list(measurements)
    if geometry.is_identity or select is SelectRule.NONE:
        return set()
    if select is SelectRule.ALL:
        return set(names)
    if isinstance(select, tuple):
        return {n for n in names if any(fnmatch.fnmatch(n, pat) for pat in select)}
    k = config.boundary_hits_k
    if k is not None:
        ranked = sorted(names, key=lambda n: boundary_scores.get(n, 0.0), reverse=True)
        return set(ranked[:k])
    chosen = set()
    for n, m in measurements.items():
        if m.gain >= config.auto_min_gain and m.overhead <= config.auto_max_overhead:
            chosen.add(n)
    return chosen


def harmful(config: GiftConfig, measurements: dict[str, LayerMeasurement], selected: set[str]) -> set[str]:
    """The `selected` layers whose measured transformed path is worse than the Euclidean one
    (gain below 1). Only the measured-gain rule (`select="auto"`) is revisited: static rules
    and the boundary-hits rank do not rest on the gain. Unmeasured layers are refused as in
    `decide`."""
    if not rests_on_gain(config):
        return set()
    _require_finite(config, measurements, "harmful")
    return {n for n, m in measurements.items() if n in selected and m.gain < 1.0}
