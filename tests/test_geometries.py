"""The geometry table: every geometry is one class, found by name through one table."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from gift_compile.config import GEOMETRIES as CONFIG_GEOMETRIES
from gift_compile.config import GiftConfig
from gift_compile.geometry.statistics import KFACStatistics, SketchStatistics
from gift_compile.geometry.table import GEOMETRIES, KINDS, Geometry, Momentum, SecondMoment, geometry_class, map_class
from gift_compile.runtime.state import layer_spec

ROOT = Path(__file__).resolve().parent.parent
NAMES = set(GEOMETRIES) | set(KINDS)


def _spd(d: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * d, d, generator=gen) * torch.logspace(0, 2, d)
    return x.t() @ x / x.shape[0]


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_each_geometry_round_trips_and_is_not_the_identity_unless_named_so(name):
    cls = geometry_class(name)
    assert cls.name == name and map_class(cls.kind).kind == cls.kind
    geo = cls(64, 8, seed=3)
    geo.activate()
    factor = _spd(64)
    kept = cls.allocate_factor(64, "cpu")
    if kept is not None and kept.dim() == 1:  # a per-column factor (the second moment's column sums)
        factor = torch.diagonal(factor).contiguous()
    geo.refresh_from(factor, 1e-3)
    g = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    fwd = geo.forward(g)
    assert torch.allclose(geo.inverse(fwd), g, rtol=1e-4, atol=1e-4)
    assert cls.is_identity == torch.equal(fwd, g)
    geo.set_identity()
    assert torch.equal(geo.forward(g), g) and torch.equal(geo.inverse(g), g)
    assert geo.adaptive == cls.adaptive and (cls.transform_flops(16, 64, geo.rank) > 0) != cls.is_identity
    sd = {k: v.clone() for k, v in geo.state_dict().items()}
    other = cls(64, 8, seed=3)
    other.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(other.tensors, geo.tensors))


def test_config_names_are_the_table_and_unknown_names_raise():
    assert CONFIG_GEOMETRIES == tuple(GEOMETRIES)
    with pytest.raises(ValueError, match="unknown geometry 'spherical'"):
        geometry_class("spherical")
    with pytest.raises(ValueError, match="unknown transform kind 'spherical'"):
        map_class("spherical")


def test_statistics_source_is_the_classes_own():
    settings = layer_spec(GiftConfig(rank=8), geometry_class("none")).statistics
    kinds = {name: type(geometry_class(name).make_statistics(settings, 256, "cpu")).__name__ for name in GEOMETRIES}
    assert kinds == {"none": "NoneType", "hadamard": "NoneType", "dense": "KFACStatistics",
                     "lowrank": "SketchStatistics", "gradient": "NoneType", "momentum": "NoneType",
                     "second_moment": "NoneType"}
    dense = layer_spec(GiftConfig(rank=8, statistics="dense"), geometry_class("lowrank")).statistics
    assert isinstance(geometry_class("lowrank").make_statistics(dense, 256, "cpu"), KFACStatistics)
    assert [n for n in GEOMETRIES if geometry_class(n).allocate_factor(4, "cpu") is not None] == ["gradient", "momentum",
                                                                                                  "second_moment"]
    with pytest.raises(ValueError, match="exact factor"):
        geometry_class("dense")(16).refresh_from_stats(SketchStatistics(16, rank=2, sketch_cols=4, ema=0.9,
                                                                         max_tokens=8), 1e-3)


def test_momentum_reads_the_optimizer_state_and_names_the_layer_without_one():
    w = torch.nn.Parameter(torch.randn(4, 8))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    w.grad = torch.ones_like(w)
    opt.step()
    source = Momentum.factor_source(lambda name: w, opt, lambda: 1)
    assert source("fc.weight") is opt.state[w]["momentum_buffer"]
    with pytest.raises(RuntimeError, match="no optimizer is attached, so layer fc.weight"):
        Momentum.factor_source(lambda name: w, None, lambda: 1)("fc.weight")
    bare = torch.optim.SGD([w], lr=0.1)
    with pytest.raises(RuntimeError, match="keeps no momentum .* for layer fc.weight at step 7"):
        Momentum.factor_source(lambda name: w, bare, lambda: 7)("fc.weight")
    assert Geometry.factor_source(lambda name: w, opt, lambda: 1)("fc.weight") is w.grad


def _adamw_after_steps(shape: tuple[int, int] = (6, 16), steps: int = 3) -> tuple[torch.nn.Parameter, torch.optim.AdamW]:
    """A weight and an AdamW that stepped it on gradients whose columns differ in size."""
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(*shape, generator=gen))
    opt = torch.optim.AdamW([w], lr=1e-3)
    col = torch.logspace(-2, 1, shape[1])
    for _ in range(steps):
        w.grad = torch.randn(*shape, generator=gen) * col
        opt.step()
    return w, opt


def test_second_moment_map_from_a_real_adamw_equals_the_formula():
    w, opt = _adamw_after_steps()
    v = opt.state[w]["exp_avg_sq"]
    source = SecondMoment.factor_source(lambda name: w, opt, lambda: 3)
    assert source("fc.weight") is v
    c = SecondMoment.reduce_factor(source("fc.weight"), None, False)
    geo = SecondMoment(16)
    geo.refresh_from(c, 1e-3)
    csum = v.double().sum(0)
    expected = (csum / csum.mean()).rsqrt()
    assert torch.allclose(geo.tensors[0].double(), expected, rtol=1e-6)
    assert torch.allclose(geo.tensors[1].double(), 1 / expected, rtol=1e-6)
    g = torch.randn(6, 16)
    assert torch.allclose(geo.forward(g), g * expected.float(), rtol=1e-6)
    # the scales are not all 1: columns with larger second moment are scaled down
    assert float(geo.tensors[0][0]) > 10 * float(geo.tensors[0][-1])


def test_second_moment_clamps_at_the_smallest_positive_column_and_stays_identity_without_one():
    geo = SecondMoment(4)
    geo.refresh_from(torch.tensor([0.0, 1.0, 4.0, 0.0]), 0.0)
    c = torch.tensor([1.0, 1.0, 4.0, 1.0], dtype=torch.float64)
    assert torch.allclose(geo.tensors[0].double(), (c / c.mean()).rsqrt())
    geo.refresh_from(torch.zeros(4), 0.0)
    assert all(torch.equal(t, torch.ones(4)) for t in geo.tensors)


def test_second_moment_raises_without_an_optimizer_or_without_exp_avg_sq():
    w, _ = _adamw_after_steps()
    with pytest.raises(RuntimeError, match="geometry='second_moment' but no optimizer is attached, so layer fc.weight"):
        SecondMoment.factor_source(lambda name: w, None, lambda: 1)("fc.weight")
    sgd = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    sgd.step()
    with pytest.raises(RuntimeError, match="keeps no second moment .exp_avg_sq. for layer fc.weight at step 5"):
        SecondMoment.factor_source(lambda name: w, sgd, lambda: 5)("fc.weight")
    from gift_compile import apply

    with pytest.raises(ValueError, match="geometry='second_moment' builds each layer's map from the optimizer"):
        apply(torch.nn.Linear(4, 4), GiftConfig(geometry="second_moment"))


def _names_in(node: ast.AST) -> set[str]:
    """The strings a compared side *is* (a literal, or a tuple/list/set of literals); keys
    inside it (`x["kind"]`, `.get("geometry")`) are not compared values, so they do not count."""
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {n.value for n in elts if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _is_geometry_value(node: ast.AST) -> bool:
    """`kind`, `geometry`, `x.kind`, `x.geometry`, `x["kind"]`: a value holding a geometry or
    map name (the bench reads them from result rows as dict entries)."""
    return (isinstance(node, ast.Name) and node.id in ("kind", "geometry")
            or isinstance(node, ast.Attribute) and node.attr in ("kind", "geometry")
            or isinstance(node, ast.Subscript) and _names_in(node.slice) & {"kind", "geometry"} != set())


# Names that are also values of other options ("none": select; "dense": statistics) count only
# when compared with a geometry value; the others count wherever they are compared.
_SHARED_NAMES = {"none", "dense"}


def _name_comparisons(source: str) -> list[int]:
    """Lines comparing a geometry or map name: `x == "lowrank"`, `kind in ("dense", ...)`,
    `config.geometry != "none"`, and any comparison of a `.kind` / `.geometry` value with a
    string."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        literals = set().union(*(_names_in(s) for s in sides))
        about_geometry = any(_is_geometry_value(s) for s in sides)
        if literals & (NAMES - _SHARED_NAMES) or about_geometry and literals:
            hits.append(node.lineno)
    return hits


def test_no_geometry_name_comparisons_outside_the_table():
    found = {}
    for folder in ("gift_compile", "passes", "torchtitan_ext", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "gift_compile" / "geometry" / "table.py":
                continue
            lines = _name_comparisons(path.read_text())
            if lines:
                found[str(path.relative_to(ROOT))] = lines
    assert not found, f"geometry names compared outside gift_compile/geometry/table.py: {found}"


def test_the_name_checker_finds_comparisons():
    src = ('if cfg.geometry == "momentum": pass\nif kind in ("dense", "lowrank"): pass\nif select == "none": pass\n'
           'if layer.kind != "identity": pass\nif statistics == "dense": pass\nif stat_kind == "amax": pass\n'
           'if x == "hadamard": pass\nif row["kind"] == "dense": pass\nif "identity" in pair: pass\n'
           'if name.split(".")[-2] == layer: pass\nif o.get("geometry") == geometry: pass\n')
    assert _name_comparisons(src) == [1, 2, 4, 7, 8, 9]


def test_refresh_cost_is_the_geometrys_own():
    """Cost models read a refresh's FLOPs off the geometry class with the layer's statistics:
    fixed maps rebuild nothing, the low-rank map from a sketch costs its Nystrom step (far less
    than subspace iteration on a dense factor at LLM widths), a gradient-side map also forms
    its factor, the column scales are linear in the weight."""
    from gift_compile.geometry.whitening import lowrank_refresh_flops

    rows, d_in, rank = 3456, 1280, 32
    settings = layer_spec(GiftConfig(geometry="lowrank", rank=rank), geometry_class("lowrank")).statistics
    sketch = geometry_class("lowrank").make_statistics(settings, d_in, "meta")
    assert isinstance(sketch, SketchStatistics)
    flops = {name: cls.refresh_flops(rows, d_in, rank, sketch if name == "lowrank" else None)
             for name, cls in GEOMETRIES.items()}
    assert flops["none"] == flops["hadamard"] == 0.0
    assert flops["lowrank"] == sketch.whitening_flops(rank) < lowrank_refresh_flops(d_in, rank) / 10
    assert GEOMETRIES["lowrank"].refresh_flops(rows, d_in, rank, None) == lowrank_refresh_flops(d_in, rank)
    assert flops["gradient"] == flops["momentum"] == 2.0 * rows * d_in ** 2 + lowrank_refresh_flops(d_in, rank)
    assert flops["dense"] == pytest.approx(2 / 3 * d_in ** 3)
    assert 0 < flops["second_moment"] < 2 * rows * d_in
