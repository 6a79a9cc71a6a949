"""Optimizer-aware choices of the selection metric and of the geometry
(`gift_compile.geometry.optimizers.select_metric_for` / `geometry_for`), resolved from the
optimizers by `gift_compile.api.resolve_auto` for `apply` and for torchtitan alike (whose former
spelling ``auto_by_optimizer`` is an alias of ``auto``); a measured selection revisited at every
refresh."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gift_compile.config import GiftConfigError
from gift_compile.geometry.optimizer_maps import leaf_optimizers
from gift_compile.geometry.optimizers import preconditions_matrices, select_metric_for
from conftest import require
from mlp import MLP as _MLP


class _Net(nn.Module):
    """Two hidden matrices (`layers.*`), an embedding-like table and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(64, 32)
        self.layers = nn.ModuleList([nn.Linear(32, 128, bias=False), nn.Linear(128, 32, bias=False)])
        self.norm = nn.LayerNorm(32)


def _hidden(net: _Net) -> list[torch.Tensor]:
    return [layer.weight for layer in net.layers]


def _muon_adamw(net: _Net) -> list[torch.optim.Optimizer]:
    hidden = _hidden(net)
    rest = [p for p in net.parameters() if all(p is not h for h in hidden)]
    return [torch.optim.Muon(hidden, lr=1e-3), torch.optim.AdamW(rest, lr=1e-3)]


class _Container:
    """Like torchtitan's OptimizersContainer: the real optimizers in an `optimizers` list."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers


def test_muon_on_the_managed_weights_means_whitened_adamw_means_euclidean() -> None:
    net = _Net()
    opts = _muon_adamw(net)
    assert select_metric_for(opts, _hidden(net)) == "whitened"
    assert select_metric_for(_Container(opts), _hidden(net)) == "whitened"
    # the AdamW half of the same pair steps only the embedding and the norm
    assert select_metric_for(opts, [net.tok_embeddings.weight]) == "euclidean"
    assert select_metric_for(torch.optim.AdamW(net.parameters()), _hidden(net)) == "euclidean"
    assert select_metric_for(torch.optim.SGD(net.parameters()), _hidden(net)) == "euclidean"
    # the second-moment map is judged in its own coordinates (AdamW's update's), other maps are not
    adamw = torch.optim.AdamW(net.parameters())
    assert select_metric_for(adamw, _hidden(net), "second_moment") == "whitened"
    assert select_metric_for(adamw, _hidden(net), "lowrank") == "euclidean"
    assert select_metric_for(torch.optim.SGD(net.parameters()), _hidden(net), "second_moment") == "euclidean"


def test_majority_of_managed_elements_decides_and_subclasses_are_recognised() -> None:
    net = _Net()
    big, small = net.layers[0].weight, net.layers[1].weight  # same numel: 4096 each
    wide = nn.Linear(32, 512, bias=False).weight  # 16384 elements
    dist_muon = type("DistMuon", (torch.optim.SGD,), {})  # torchtitan's name, another base
    shampoo_like = type("MyPreconditioner", (type("DistributedShampoo", (torch.optim.SGD,), {}),), {})
    assert preconditions_matrices(dist_muon([big], lr=0.1))
    assert preconditions_matrices(shampoo_like([big], lr=0.1))  # through the base class name
    assert not preconditions_matrices(torch.optim.Adam([big]))
    mixed = [dist_muon([big, small], lr=0.1), torch.optim.AdamW([wide])]
    assert select_metric_for(mixed, [big, small, wide]) == "euclidean"  # 8192 vs 16384 elements
    assert select_metric_for(mixed, [big, small]) == "whitened"
    assert len(leaf_optimizers(_Container([mixed[0], _Container([mixed[1]])]))) == 2


def test_unstepped_weights_and_non_optimizers_are_errors() -> None:
    net = _Net()
    opts = _muon_adamw(net)
    stranger = nn.Linear(4, 4).weight
    with pytest.raises(ValueError, match="none of the 1 managed weights is in its parameter groups"):
        select_metric_for(opts, [stranger])
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        select_metric_for(object(), _hidden(net))


def test_torchtitan_section_resolves_auto_by_optimizer() -> None:
    """``auto`` is the section's spelling, as the core's; ``auto_by_optimizer`` (existing TOMLs)
    is stored as ``auto``, and the config the section makes carries it to the resolution."""
    require("torchtitan", "torchtitan extra not installed")
    from gift_compile.torchtitan_ext.section import AUTO_ALIAS, GiftSection

    assert (GiftSection().geometry, GiftSection().select_metric) == ("auto", "auto")  # as GiftConfig()
    alias = GiftSection(geometry=AUTO_ALIAS, select_metric=AUTO_ALIAS)
    assert (alias.geometry, alias.select_metric) == ("auto", "auto")
    config = alias.to_gift_config()
    assert (config.geometry, config.select_metric) == ("auto", "auto")  # left for resolve_auto
    explicit = GiftSection(geometry="momentum", select_metric="euclidean").to_gift_config()
    assert (explicit.geometry, explicit.select_metric) == ("momentum", "euclidean")
    with pytest.raises(GiftConfigError, match="allowed: euclidean, whitened, auto, auto_by_optimizer"):
        GiftSection(select_metric="plain")


def test_geometry_for_follows_the_optimizer() -> None:
    from gift_compile.geometry.optimizers import geometry_for

    net = _Net()
    assert geometry_for(_muon_adamw(net), _hidden(net)) == "lowrank"
    assert geometry_for(_Container([torch.optim.AdamW(net.parameters())]), _hidden(net)) == "second_moment"
    assert geometry_for(torch.optim.Adam(net.parameters()), _hidden(net)) == "second_moment"
    assert geometry_for(torch.optim.SGD(net.parameters(), lr=0.1), _hidden(net)) == "none"
    # Adamax keeps no exp_avg_sq: not a second-moment optimizer
    assert geometry_for(torch.optim.Adamax(net.parameters()), _hidden(net)) == "none"
    big, small = _hidden(net)
    wide = nn.Linear(32, 512, bias=False).weight
    mixed = [torch.optim.Muon([big, small], lr=1e-3), torch.optim.AdamW([wide])]
    assert geometry_for(mixed, [big, small, wide]) == "second_moment"  # 8192 vs 16384 elements
    with pytest.raises(ValueError, match="cannot choose geometry"):
        geometry_for(mixed, [nn.Linear(4, 4).weight])


def test_apply_resolves_geometry_auto_from_the_optimizer_and_falls_back_logged_without_one(caplog) -> None:
    import gift_compile
    from gift_compile.api import manage
    from gift_compile.config import GiftConfig

    cfg = GiftConfig(geometry="auto", min_numel=1024)
    m = _MLP()
    with caplog.at_level("WARNING", logger="gift_compile"):
        gift_compile.apply(m, cfg)
    assert gift_compile.state(m).config.geometry == "lowrank"
    assert "geometry='auto' without optimizer=: using K-FAC's 'lowrank' map" in caplog.text
    with pytest.raises(ValueError, match="geometry='auto' is resolved from the optimizer before managing"):
        manage(_MLP(), cfg, None, mode="sync")
    for make, expected in ((lambda ps: torch.optim.AdamW(ps), "second_moment"),
                           (lambda ps: torch.optim.Muon([p for p in ps if p.dim() == 2], lr=1e-3), "lowrank"),
                           (lambda ps: torch.optim.SGD(ps, lr=0.1), "none")):
        m = _MLP()
        with caplog.at_level("INFO", logger="gift_compile"):
            gift_compile.apply(m, cfg, optimizer=make(list(m.parameters())))
        assert gift_compile.state(m).config.geometry == expected
        # the selection judges each layer where the update sees the error: the second-moment map
        # in AdamW's coordinates, Muon's layers in their whitened geometry; SGD in plain L2
        metric = "euclidean" if expected == "none" else "whitened"
        assert gift_compile.state(m).config.select_metric == metric
        assert f"geometry='auto' -> {expected!r}, select_metric='auto' -> {metric!r}" in caplog.text
        gift_compile.remove(m)


def test_torchtitan_section_resolves_geometry_auto_by_optimizer(caplog) -> None:
    """The torchtitan hook's config (`hooks.gift_config`) resolves ``auto`` exactly as
    `gift_compile.apply` does, for each optimizer and for either spelling, and logs the same line."""
    require("torchtitan", "torchtitan extra not installed")
    import gift_compile
    from gift_compile.config import GiftConfig
    from gift_compile.torchtitan_ext.hooks import gift_config
    from gift_compile.torchtitan_ext.section import AUTO_ALIAS, GiftSection

    makers = {"lowrank": lambda ps: [torch.optim.Muon([p for p in ps if p.dim() == 2], lr=1e-3)],
              "second_moment": lambda ps: [torch.optim.AdamW(ps)],
              "none": lambda ps: [torch.optim.SGD(ps, lr=0.1)]}
    for expected, make in makers.items():
        for spelling in ("auto", AUTO_ALIAS):
            net = _MLP()
            opts = make(list(net.parameters()))
            with caplog.at_level("INFO", logger="gift_compile"):
                caplog.clear()
                got = gift_config(GiftSection(min_numel=1024, geometry=spelling, select_metric=spelling),
                                  _Container(opts), net, None)
            assert got.geometry == expected
            assert f"geometry='auto' -> {expected!r}" in caplog.text
            twin = _MLP()
            gift_compile.apply(twin, GiftConfig(min_numel=1024, reduce_op="sum"),
                               optimizer=make(list(twin.parameters()))[0])
            applied = gift_compile.state(twin).config
            assert (got.geometry, got.select_metric) == (applied.geometry, applied.select_metric)
            gift_compile.remove(twin)
    with pytest.raises(GiftConfigError, match="second_moment, auto, auto_by_optimizer"):
        GiftSection(geometry="spherical")


def _revisit_state(select: str) -> tuple:
    """A one-process GiftState with two second-moment layers whose probes have input columns of
    very different sizes, and a settable second-moment source per layer."""
    from gift_compile.config import GiftConfig
    from gift_compile.runtime.state import GiftState

    st = GiftState(GiftConfig(geometry="second_moment", format="int2", select=select, refresh_every=1), None)
    columns = torch.logspace(-3, 0, 64)
    source: dict[str, torch.Tensor] = {}
    for i, name in enumerate(("a.weight", "b.weight")):
        layer = st.add_layer(name, (32, 64), "cpu")
        layer.probe.copy_(torch.randn(32, 64, generator=torch.Generator().manual_seed(i)) * columns)
        source[name] = columns.square().expand(32, 64).clone()  # matches the probe: the scaling helps
    st.grad_source = source.__getitem__
    return st, source, columns


def test_a_selected_layer_whose_transform_turns_harmful_is_deselected_at_the_next_refresh(caplog) -> None:
    st, source, columns = _revisit_state("auto")
    first = st.refresh()
    assert all(first.layers[n]["selected"] and first.layers[n]["gain"] > 1.05 for n in source), first.layers
    version = st.selection_changes
    # the second moment turns against the gradient's columns: the scaling now amplifies the spread
    source["b.weight"] = columns.flip(0).square().expand(32, 64).clone()
    with caplog.at_level("INFO", logger="gift_compile"):
        second = st.refresh()
    assert second.layers["b.weight"]["gain"] < 1.0 and not second.layers["b.weight"]["selected"]
    assert not st.layers["b.weight"].selected and st.layers["a.weight"].selected
    assert second.layers["a.weight"]["gain"] > 1.05
    assert st.selection_changes > version and "b.weight deselected, its transform now hurts" in caplog.text
    # nothing changes at a refresh where no selected layer is hurt: no further selection change
    version = st.selection_changes
    st.refresh()
    assert st.selection_changes == version and st.layers["a.weight"].selected


def test_static_selections_are_not_revisited() -> None:
    st, source, columns = _revisit_state("all")
    st.refresh()
    source["b.weight"] = columns.flip(0).square().expand(32, 64).clone()
    record = st.refresh()
    assert record.layers["b.weight"]["gain"] < 1.0 and st.layers["b.weight"].selected


def test_an_unmeasured_layer_is_neither_kept_nor_dropped_by_a_nan_gain(caplog) -> None:
    """A zero probe (a gradient never captured, as on HSDP's one-rank shard hop before its fix)
    or a non-finite one measures NaN: the gain rule must not decide on it. The layer keeps its
    path with a warning naming it and is decided once a refresh measures it."""
    from gift_compile.config import GiftConfig
    from gift_compile.geometry.table import LowRank
    from gift_compile.runtime.selection import LayerMeasurement, decide, harmful

    st, source, columns = _revisit_state("auto")
    saved = st.layers["b.weight"].probe.clone()
    st.layers["b.weight"].probe.zero_()
    with caplog.at_level("WARNING", logger="gift_compile"):
        first = st.refresh()
    assert "no finite error measurement for b.weight" in caplog.text
    assert first.layers["a.weight"]["selected"] and st.layers["a.weight"].decided
    b = st.layers["b.weight"]
    assert not b.decided and not b.selected and first.layers["b.weight"]["gain"] != first.layers["b.weight"]["gain"]
    b.probe.copy_(saved)
    st.refresh()  # still undecided: this refresh decides it
    assert b.decided and b.selected
    # between decisions: a selected layer whose probe turned non-finite is not deselected
    caplog.clear()
    st.layers["a.weight"].probe.fill_(float("nan"))
    with caplog.at_level("WARNING", logger="gift_compile"):
        st.refresh()
    assert st.layers["a.weight"].selected and "no finite error measurement for a.weight" in caplog.text
    # the rules themselves refuse a NaN gain instead of reading it as a drop or a keep
    nan = {"x": LayerMeasurement(float("nan"), float("nan"), 0.0, 0.0)}
    with pytest.raises(ValueError, match="no finite measurement for x"):
        decide(GiftConfig(geometry="lowrank", select="auto"), LowRank, nan, {})
    with pytest.raises(ValueError, match="no finite measurement for x"):
        harmful(GiftConfig(geometry="lowrank", select="auto"), nan, {"x"})
    # a static rule does not read the gain
    assert decide(GiftConfig(geometry="lowrank", select="all"), LowRank, nan, {}) == {"x"}


def test_the_default_geometry_and_metric_follow_the_optimizer_and_explicit_ones_are_kept(caplog) -> None:
    """`GiftConfig()`'s geometry and select_metric ("auto") follow the optimizer: under Muon the
    K-FAC map, layers judged in their whitened geometry (plain L2 drops most of Muon's layers,
    and with them GIFT's gain); under AdamW the second-moment map, judged in AdamW's update
    coordinates; without `optimizer=` K-FAC's map and plain L2, both logged; explicit choices stay."""
    import gift_compile
    from gift_compile.config import GiftConfig

    def muon(ps):
        return torch.optim.Muon([p for p in ps if p.dim() == 2], lr=1e-3)

    def adamw(ps):
        return torch.optim.AdamW(ps)

    cases = ((muon, {}, "lowrank", "whitened"), (adamw, {}, "second_moment", "whitened"),
             (None, {}, "lowrank", "euclidean"), (muon, {"select_metric": "euclidean"}, "lowrank", "euclidean"),
             (adamw, {"geometry": "lowrank"}, "lowrank", "euclidean"))
    for make, extra, geometry, metric in cases:
        m = _MLP()
        cfg = GiftConfig(min_numel=1024, **extra)
        assert cfg.geometry == extra.get("geometry", "auto") and cfg.select == "auto"
        caplog.clear()
        with caplog.at_level("INFO", logger="gift_compile"):
            gift_compile.apply(m, cfg, optimizer=None if make is None else make(list(m.parameters())))
        resolved = gift_compile.state(m).config
        assert (resolved.geometry, resolved.select_metric) == (geometry, metric), (extra, geometry, metric)
        if make is None:
            assert "select_metric='auto' without optimizer=" in caplog.text
            assert "geometry='auto' without optimizer=: using K-FAC's 'lowrank' map" in caplog.text
        gift_compile.remove(m)


def test_the_cost_side_prices_the_map_against_the_layers_step_time() -> None:
    """The map's time over the layer's time in the step without it (backward at this rank's
    tokens plus a bf16 exchange at the configured network), priced as on an H200: at 256 tokens
    per rank a rank-32 map is a quarter of a 512x512 layer's backward FLOPs, which a FLOPs-only
    cap rejected, but a small share of its step over a 100 Gb/s link; over 400 Gb/s InfiniBand
    the exchange is cheap and the map is rejected again until the rank sees more tokens."""
    from gift_compile.runtime import selection

    shape, rank = (512, 512), 32
    flops_share = selection.transform_flops("lowrank", *shape, rank) / selection.backward_flops(*shape, 256)
    assert flops_share > 0.25  # what the former rule compared with the cap
    elements = 512 * 512
    want_map = elements * (selection.MAP_ELEMENTWISE_SECONDS + selection.MAP_MATMUL_SECONDS)
    want_step = 4 * 256 * elements / selection.BACKWARD_FLOPS_PER_SECOND + 2 * elements / (100e9 / 8)
    assert selection.overhead("lowrank", shape, rank, 256, 100.0) == pytest.approx(want_map / want_step, rel=1e-12)
    cap = 0.25
    assert selection.overhead("lowrank", shape, rank, 256, 100.0) < cap
    assert selection.overhead("lowrank", shape, rank, 256, 400.0) > cap
    assert selection.overhead("lowrank", shape, rank, 8192, 400.0) < cap
    # more tokens or a slower link: a smaller share; a smaller rank: a cheaper map
    assert selection.overhead("lowrank", shape, rank, 512, 100.0) < selection.overhead("lowrank", shape, rank, 256, 100.0)
    assert selection.overhead("lowrank", shape, rank, 256, 25.0) < selection.overhead("lowrank", shape, rank, 256, 100.0)
    assert selection.overhead("lowrank", shape, 8, 256, 400.0) < selection.overhead("lowrank", shape, rank, 256, 400.0)


def test_the_configured_network_reaches_the_refreshs_decision() -> None:
    """`auto_network_gbps` is what a refresh prices with: the same layers, probes and gains are
    selected over a slow link and rejected when the link is priced as free (the map then
    competes with the backward alone, at the 8192 tokens a layer without statistics assumes)."""
    from gift_compile.config import GiftConfig
    from gift_compile.runtime.state import GiftState

    decided = {}
    for gbps in (12.5, 1e9):
        st = GiftState(GiftConfig(geometry="second_moment", format="int2", select="auto", refresh_every=1,
                                  auto_network_gbps=gbps, auto_max_overhead=0.02), None)
        columns = torch.logspace(-3, 0, 64)
        for i, name in enumerate(("a.weight", "b.weight")):
            layer = st.add_layer(name, (32, 64), "cpu")
            layer.probe.copy_(torch.randn(32, 64, generator=torch.Generator().manual_seed(i)) * columns)
        st.grad_source = lambda name: columns.square().expand(32, 64).clone()
        record = st.refresh()
        assert all(record.layers[n]["gain"] > 1.05 for n in ("a.weight", "b.weight")), record.layers
        decided[gbps] = {n: (record.layers[n]["selected"], record.layers[n]["overhead"]) for n in ("a.weight", "b.weight")}
    assert all(sel and over < 0.02 for sel, over in decided[12.5].values()), decided
    assert all(not sel and over > 0.02 for sel, over in decided[1e9].values()), decided
