"""Which managed layers take the transformed (GIFT) path, decided from measurements.

The gain of whitening depends on the layer and on the scaling granularity (on a small
Llama's real gradients, rank-32 whitening under E5M2 ranged from 0.89x to 1.93x the
Euclidean error per layer), so the default policy measures it: at a geometry refresh it
quantizes a sample of the layer's real, not yet quantized local gradient both ways (error in
plain L2, or with `select_metric="whitened"` in the layer's whitened geometry, the one a
preconditioned optimizer amplifies), and enables the transform only where the error drops
by at least `auto_min_gain` and the transform's FLOPs stay below `auto_max_overhead` of the
layer's backward FLOPs. The decision is part of the compiled graph (`GiftState.set_selected`),
taken at the first refresh and again every `reselect_every` refreshes. The paper's offline rule (top-K by E5M2 saturation share) and explicit
globs are also available.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch

from gift_compile.config import GiftConfig
from gift_compile.collectives import ItemTensors, Shared, bucket_core
from gift_compile.plan import BucketPlan, ItemPlan
from gift_compile.formats import FormatSpec, as_rows, choose_scales, encode
from gift_compile.geometry import apply_forward

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


def round_trip(g: torch.Tensor, spec: FormatSpec, kind: str, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Transform, quantize, dequantize, inverse on one rank: the collective with no peers."""
    rows, cols = g.shape
    item = ItemPlan("probe", rows, cols, "float32", True, spec.name, spec.scaling, spec.block_size, kind, len(tensors))
    plan = BucketPlan((item,), 1, None, False, "all_reduce")
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
    """FLOPs of forward plus inverse transform of a `[rows, d_in]` gradient."""
    if kind == "lowrank":
        return 2 * (4.0 * rows * d_in * rank + 2.0 * rows * d_in)
    if kind == "dense":
        return 2 * 2.0 * rows * d_in * d_in
    if kind == "hadamard":
        block = d_in & -d_in
        return 2 * rows * d_in * max(1, block.bit_length() - 1)
    return 0.0


def backward_flops(rows: int, d_in: int, tokens: float) -> float:
    """Weight- plus input-gradient matmuls of a linear layer: 2 * (2 * tokens * out * in)."""
    return 4.0 * max(tokens, 1.0) * rows * d_in


def measure(
    sample: torch.Tensor, config: GiftConfig, kind: str, tensors: tuple[torch.Tensor, ...], shape: tuple[int, int], tokens: float
) -> LayerMeasurement:
    spec = FormatSpec(config.format, config.scaling, config.block_size)
    g = as_rows(sample).float()
    if not bool(torch.isfinite(g).all()) or float(g.norm()) == 0.0:
        return LayerMeasurement(float("nan"), float("nan"), 0.0, 0.0)
    euclidean, transformed = round_trip(g, spec, "identity", ()), round_trip(g, spec, kind, tensors)
    if config.select_metric == "whitened":  # both errors seen in the candidate's geometry
        g, euclidean, transformed = (apply_forward(kind, t, tensors) for t in (g, euclidean, transformed))
    e_euc, e_t = relative_error(euclidean, g), relative_error(transformed, g)
    over = transform_flops(kind, shape[0], shape[1], tensors[1].shape[1] if kind == "lowrank" else 0) / backward_flops(
        shape[0], shape[1], tokens
    )
    return LayerMeasurement(e_euc, e_t, over, boundary_hit_ratio(g))


def decide(config: GiftConfig, measurements: dict[str, LayerMeasurement], boundary_scores: dict[str, float]) -> set[str]:
    """The set of layer FQNs that take the transformed path under `config.select`."""
    select = config.select
    names = list(measurements)
    if config.geometry == "none" or select == "none":
        return set()
    if select == "all":
        return set(names)
    if isinstance(select, tuple):
        return {n for n in names if any(fnmatch.fnmatch(n, pat) for pat in select)}
    k = config.boundary_hits_k
    if k is not None:
        ranked = sorted(names, key=lambda n: boundary_scores.get(n, 0.0), reverse=True)
        return set(ranked[:k])
    chosen = set()
    for n, m in measurements.items():
        if m.gain == m.gain and m.gain >= config.auto_min_gain and m.overhead <= config.auto_max_overhead:
            chosen.add(n)
    return chosen


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
