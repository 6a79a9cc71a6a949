"""apply/remove semantics, selection policies and eager data-parallel training."""

import pytest
import torch
import torch.nn as nn

import gift_compile
from gift_compile.config import GiftConfig
from gift_compile.geometry.table import geometry_class
from gift_compile.runtime.selection import LayerMeasurement, decide
from gift_compile.runtime.state import GiftState
from multirank import run_ranks
from mlp import MLP as _MLP


def MLP() -> nn.Module:
    return _MLP(96)


def _apply_remove_body(rank: int, world: int) -> dict:
    from torch._inductor import config as inductor_config

    def user_pass(graph):
        return None

    inductor_config.post_grad_custom_post_pass = user_pass
    m = MLP()
    keys = list(m.state_dict())
    cfg = GiftConfig(min_numel=1024)
    gift_compile.apply(m, cfg)
    res = {"managed": sorted(gift_compile.state(m).layers), "same_keys": list(m.state_dict()) == keys}
    res["idempotent"] = gift_compile.apply(m, cfg) is m and len(gift_compile.state(m).layers) == 2
    try:
        gift_compile.apply(m, GiftConfig(format="nvfp4", min_numel=1024))
        res["reapply_error"] = None
    except ValueError as e:
        res["reapply_error"] = str(e)
    passes = inductor_config.post_grad_custom_post_pass
    res["user_pass_kept"] = isinstance(passes, list) and passes[0] is user_pass and len(passes) == 2
    gift_compile.remove(m)
    res["removed"] = type(m.fc1) is nn.Linear and not hasattr(m, "_gift_state")
    res["pass_after_remove"] = inductor_config.post_grad_custom_post_pass is user_pass
    return res


def test_apply_is_idempotent_and_remove_undoes_it():
    res = run_ranks(_apply_remove_body, 2)[0]
    assert res["managed"] == ["fc1.weight", "fc2.weight"]  # out.weight: 384 < min_numel
    assert res["same_keys"] and res["idempotent"] and res["removed"]
    assert "different config" in res["reapply_error"]
    assert res["user_pass_kept"] and res["pass_after_remove"]


def _eager_training_body(rank: int, world: int, fmt: str) -> tuple[list[torch.Tensor], list[dict]]:
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    gift_compile.apply(m, GiftConfig(format=fmt, geometry="lowrank", min_numel=1024, refresh_every=4, error_feedback=True,
                                     rank=8, select="all"),
                       optimizer=opt)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 96, generator=g) @ torch.diag(torch.logspace(0, -2, 96))
    y = torch.randn(64, 4, generator=g)
    for _ in range(8):
        ((m(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    st = gift_compile.state(m)
    transforms = {n: [t.clone() for t in layer.transform.tensors] for n, layer in st.layers.items()}
    return [p.detach().clone() for p in m.parameters()], [r.layers for r in st.history], transforms, st.owners()


def test_eager_training_identical_ranks_and_refresh_records():
    (p0, hist0, tr0, own0), (p1, hist1, tr1, own1) = run_ranks(_eager_training_body, 2, "fp8_e5m2")
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    # the refresh is sharded (each rank rebuilds its own layers) and the broadcast makes
    # every transform bit-identical
    assert own0 == own1 and set(own0.values()) == {0, 1}
    for name in tr0:
        assert all(torch.equal(a, b) for a, b in zip(tr0[name], tr1[name])), name
        assert not torch.equal(tr0[name][0], torch.ones_like(tr0[name][0])), "transform was rebuilt"
    assert len(hist0) == 2 and hist0 == hist1  # selection decided identically on both ranks
    for rec in hist0[-1].values():
        assert 0 < rec["err_euclidean"] < 0.1 and 0 < rec["err_transformed"] < 0.2


def test_selection_policies():
    ms = {
        "a.w2.weight": LayerMeasurement(0.05, 0.02, 0.01, 0.001),
        "b.w2.weight": LayerMeasurement(0.05, 0.049, 0.01, 0.03),  # gain 1.02 < 1.05
        "c.w1.weight": LayerMeasurement(0.05, 0.02, 0.5, 0.02),  # too expensive
    }
    hits = {n: m.boundary_hits for n, m in ms.items()}

    def decide_for(config: GiftConfig) -> set[str]:
        return decide(config, geometry_class(config.geometry), ms, hits)

    assert decide_for(GiftConfig(geometry="lowrank")) == {"a.w2.weight"}
    assert decide_for(GiftConfig(geometry="lowrank", select="all")) == set(ms)
    assert decide_for(GiftConfig(geometry="lowrank", select="none")) == set()
    assert decide_for(GiftConfig(geometry="lowrank", select=("*.w2.*",))) == {"a.w2.weight", "b.w2.weight"}
    assert decide_for(GiftConfig(geometry="lowrank", select="boundary_hits:2")) == {"b.w2.weight", "c.w1.weight"}
    assert decide_for(GiftConfig(geometry="none", select="all")) == set()


def _auto_record(metric: str) -> dict:
    # strongly anisotropic input geometry; fp8 per-row errors are ~uniform per element, so
    # plain L2 does not improve, while the error seen in the whitened geometry does
    cfg = GiftConfig(format="fp8_e4m3", scaling="row", geometry="lowrank", rank=16, refresh_every=1,
                     select_metric=metric)
    st = GiftState(cfg, None)
    layer = st.add_layer("w", (128, 96), "cpu")
    g = torch.Generator().manual_seed(0)
    q = torch.linalg.qr(torch.randn(96, 96, generator=g))[0]
    x = (torch.randn(4096, 96, generator=g) * torch.logspace(0, -3, 96)) @ q.t()
    layer.stats.observe(x)
    delta = torch.randn(4096, 128, generator=g)
    layer.probe.copy_((delta.t() @ x)[:128])
    st.step()
    return st.history[-1].layers["w"]


def test_auto_selection_follows_the_measurement():
    whitened = _auto_record("whitened")
    assert whitened["gain"] > 2 and whitened["selected"], whitened
    euclidean = _auto_record("euclidean")
    assert euclidean["gain"] < 1.05 and not euclidean["selected"], euclidean


def _gradient_geometry_body(rank: int, world: int) -> list[bool]:
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    gift_compile.apply(m, GiftConfig(geometry="gradient", min_numel=1024, refresh_every=2, select="all", rank=8),
                       optimizer=opt)
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    st = gift_compile.state(m)
    return [bool(layer.transform.tensors[1].abs().sum() > 0) for layer in st.layers.values()]


def test_gradient_side_geometry_refreshes_from_the_reduced_gradient():
    assert all(run_ranks(_gradient_geometry_body, 2)[0])


def _momentum_geometry_body(rank: int, world: int) -> dict:
    """geometry="momentum" builds each map from the optimizer's momentum buffer (not from the
    step's gradient), needs the optimizer, and names the layer when there is no momentum."""
    from gift_compile.geometry import Transform, gradient_factor

    cfg = GiftConfig(geometry="momentum", min_numel=1024, refresh_every=2, select="all", rank=8)
    out: dict = {}
    try:
        gift_compile.apply(MLP(), cfg)
    except ValueError as e:
        out["no_optimizer"] = str(e)
    for momentum in (0.9, 0.0):
        m = MLP()
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=momentum)
        gift_compile.apply(m, cfg, optimizer=opt)
        st = gift_compile.state(m)
        try:
            for step in range(2):
                x = torch.randn(64, 96, generator=torch.Generator().manual_seed(10 * step + rank))
                m(x).pow(2).mean().backward()
                opt.step()
                if step == 0:
                    opt.zero_grad()
        except RuntimeError as e:
            out["no_momentum"] = str(e)
            continue
        for name, layer in st.layers.items():
            w = st.modules[name].weight
            ref_m = Transform("lowrank", w.shape[1], 8)
            ref_m.refresh_from(gradient_factor(opt.state[w]["momentum_buffer"]), cfg.damping)
            ref_g = Transform("lowrank", w.shape[1], 8)
            ref_g.refresh_from(gradient_factor(w.grad), cfg.damping)  # the reduced gradient of the step
            out[name] = [max(float((a - b).abs().max()) / float(b.abs().max()) for a, b in zip(layer.transform.tensors, ref.tensors))
                         for ref in (ref_m, ref_g)]
    return out


def test_momentum_geometry_builds_the_map_from_the_optimizer_momentum():
    out = run_ranks(_momentum_geometry_body, 2)[0]
    assert "pass optimizer=" in out["no_optimizer"]
    assert "keeps no momentum" in out["no_momentum"] and "fc1.weight" in out["no_momentum"]
    for name in ("fc1.weight", "fc2.weight"):
        from_momentum, from_gradient = out[name]
        assert from_momentum < 1e-4 and from_gradient > 1e-2, (name, out[name])


def _deselected_body(rank: int, world: int) -> dict:
    """select="auto" decides at the first refresh; a deselected layer then runs the Euclidean
    codec eagerly (its plan's map is the identity), and in the compiled model its map gated off
    by data (the same graph as a selected layer's: no recompilation, issue 31), and feeds no
    statistics (a tensor gate in the compiled forward); a layer selected by a static rule keeps
    its transform."""
    from gift_compile.passes import last_reports, reports_seen

    torch._inductor.config.fx_graph_cache = False
    out = {}
    for select in ("all", "auto"):
        m = MLP()
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        # auto_min_gain far above any measured gain: the measured rule deselects every layer
        gift_compile.apply(m, GiftConfig(geometry="lowrank", min_numel=1024, refresh_every=2, rank=8, select=select,
                                         auto_min_gain=1e9), optimizer=opt)
        st = gift_compile.state(m)
        fwd = torch.compile(m, fullgraph=True, dynamic=False)
        n0 = reports_seen()
        tokens = []
        for step in range(4):
            x = torch.randn(32, 96, generator=torch.Generator().manual_seed(10 * step + rank))
            fwd(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            tokens.append(float(st.layers["fc1.weight"].stats.tokens))
        backward = [r for r in last_reports(since=n0) if r.rewritten]
        out[select] = {"mm": [r.ops_after.get("aten.mm.default", 0) for r in backward], "tokens": tokens,
                       "kinds": sorted({l.plan.kind for l in st.layers.values()}), "version": st.plan_version,
                       "changes": st.selection_changes, "selected": sum(l.selected for l in st.layers.values()),
                       "traced": sorted({l.traced_plan.kind for l in st.layers.values()})}
    return out


def test_deselected_layers_run_the_euclidean_codec_and_collect_nothing():
    res = run_ranks(_deselected_body, 2)[0]
    static, auto = res["all"], res["auto"]
    assert static["kinds"] == ["lowrank"] and len(static["mm"]) == 1 and static["version"] == 0
    # auto: every layer deselected (eager plan: the identity codec); the compiled graph carries
    # the gated map and the statistics switch off by a tensor gate (issue 31: Python flags were
    # guards), so the decision does not recompile: one backward graph for all steps
    assert auto["kinds"] == ["identity"] and auto["selected"] == 0 and auto["changes"] > 0
    assert auto["traced"] == ["lowrank"] and auto["version"] == 0
    # the gated map's matmuls stay in the graph: the same graph as the static arm's, which dynamo
    # reuses for this second model (same class and plans: no new compilation, no new report)
    assert auto["mm"] in ([], static["mm"])
    assert auto["tokens"][1] > auto["tokens"][0] and auto["tokens"][3] == auto["tokens"][1]  # stats stop
    assert static["tokens"][3] > static["tokens"][1]  # a selected layer keeps its statistics


def test_reapply_with_another_config_names_the_differing_field():
    """A second `apply` with another config says which field differs (and both values), not
    just "different config": the user then knows what to make equal or to remove."""
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    gift_compile.apply(m, GiftConfig(min_numel=16))
    with pytest.raises(ValueError, match=r"different config \(format: 'fp8_e4m3' vs 'nvfp4'"):
        gift_compile.apply(m, GiftConfig(format="nvfp4", min_numel=16))
    gift_compile.remove(m)


def test_fp64_parameters_are_refused_at_apply_naming_the_parameter():
    """fp64 gradients cannot travel in a GIFT bucket; `apply` says so, naming the parameter,
    instead of the first backward failing inside a hook."""
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    m[1].double()
    with pytest.raises(TypeError, match=r"parameter 1\.weight is torch\.float64"):
        gift_compile.apply(m, GiftConfig(min_numel=16))
    assert not hasattr(m, "_gift_state")


def _optimizer_list_body(rank: int, world: int) -> dict:
    """`optimizer=[muon, adamw]` (Muon for the matrices, AdamW for the rest) and the reverse
    ownership: one step driver, "auto" following the optimizer that owns the managed weights,
    the second moment read from the list's AdamW."""
    out: dict = {}
    for owner in ("muon", "adamw"):
        m = MLP()
        matrices = [p for p in m.parameters() if p.dim() == 2]
        rest = [p for p in m.parameters() if p.dim() != 2]
        if owner == "muon":
            opts = [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)]
        else:
            opts = [torch.optim.AdamW(matrices, lr=1e-3), torch.optim.SGD(rest, lr=0.01)]
        gift_compile.apply(m, GiftConfig(format="nvfp4", min_numel=1024, refresh_every=2, refresh_warmup=0,
                                         select="all", rank=8), optimizer=opts)
        st = gift_compile.state(m)
        for step in range(4):
            x = torch.randn(64, 96, generator=torch.Generator().manual_seed(10 * step + rank))
            m(x).pow(2).mean().backward()
            for opt in reversed(opts) if step % 2 else opts:  # either order within a step
                opt.step()
                opt.zero_grad()
        out[owner] = {"geometry": st.config.geometry, "metric": str(st.config.select_metric), "steps": st.steps,
                      "refreshes": [r.step for r in st.history],
                      "mapped": {n: float((layer.transform.tensors[0] - 1).abs().max()) if owner == "adamw" else
                                 float(layer.transform.tensors[0].abs().sum()) for n, layer in st.layers.items()}}
        m(torch.randn(64, 96)).pow(2).mean().backward()
        opts[0].step()
        try:
            opts[0].step()
        except RuntimeError as e:
            out[owner]["twice"] = str(e)
    try:
        gift_compile.apply(MLP(), GiftConfig(), optimizer=[torch.optim.SGD(MLP().parameters(), lr=0.1), "adamw"])
    except TypeError as e:
        out["not_an_optimizer"] = str(e)
    return out


def test_optimizer_list_is_one_step_driver_and_the_map_follows_the_owner():
    a, b = run_ranks(_optimizer_list_body, 2)
    muon, adamw = a["muon"], a["adamw"]
    assert (muon["geometry"], muon["metric"]) == ("lowrank", "whitened"), muon
    assert (adamw["geometry"], adamw["metric"]) == ("second_moment", "whitened"), adamw
    for got in (muon, adamw):
        assert got["steps"] == 4 and got["refreshes"] == [2, 4], got  # once per training step, not per optimizer
        assert set(got["mapped"]) == {"fc1.weight", "fc2.weight"} and min(got["mapped"].values()) > 1e-3, got
        assert "stepped again before" in got["twice"] and "optimizer 1 of the list" in got["twice"], got["twice"]
    assert "1: str" in a["not_an_optimizer"], a["not_an_optimizer"]
    assert a["muon"]["mapped"] == b["muon"]["mapped"] and a["adamw"]["mapped"] == b["adamw"]["mapped"]


class _Headed(nn.Module):
    """`body` then a classifier named `head` (large enough to be managed if not excluded)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = _MLP(96, classes=None)
        self.head = nn.Linear(96, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _report_body(rank: int, world: int) -> dict:
    """The apply report and its log, for a model with a head named `head`, a glob that matches
    nothing, and a model without linears."""
    import logging

    seen: list[tuple[int, str]] = []
    handler = logging.Handler()
    handler.emit = lambda r: seen.append((r.levelno, r.getMessage()))  # type: ignore[method-assign]
    logging.getLogger("gift_compile").addHandler(handler)
    out = {}
    m = _Headed()
    gift_compile.apply(m, GiftConfig(format="nvfp4", geometry="lowrank", min_numel=1024,
                                     select=("body.fc1.*", "blocks.*.attn.*")), optimizer=torch.optim.SGD(m.parameters()))
    out["glob"] = gift_compile.report(m)
    m = _Headed()
    gift_compile.apply(m, GiftConfig(min_numel=1024, exclude=("*fc2*", "*typo*")), optimizer=torch.optim.AdamW(m.parameters()))
    out["auto"] = gift_compile.report(m)
    m = nn.Sequential(nn.Conv1d(4, 4, 3))
    gift_compile.apply(m, GiftConfig(), optimizer=torch.optim.SGD(m.parameters()))
    out["none"] = gift_compile.report(m)
    out["warnings"] = [msg for level, msg in seen if level >= logging.WARNING and msg.startswith("GIFT applied")]
    return out


def test_apply_report_is_logged_on_rank_0_and_names_what_did_nothing():
    a, b = run_ranks(_report_body, 2)
    glob = a["glob"]
    assert glob.managed == ("body.fc1.weight", "body.fc2.weight") and glob.geometry == "lowrank"
    assert glob.full_precision == ("head.weight",)  # the default exclude catches a head named `head`
    assert glob.selected == ("body.fc1.weight",)
    assert glob.unmatched == ("select: 'blocks.*.attn.*'",), glob.unmatched
    auto = a["auto"]
    assert (auto.geometry, auto.select_metric) == ("second_moment", "whitened"), auto  # resolved, never "auto"
    assert auto.selected is None and auto.first_refresh == 10
    assert auto.managed == ("body.fc1.weight", "head.weight") and auto.unmatched == ("exclude: '*typo*'",), auto
    assert a["none"].managed == () and "NOTHING IS MANAGED" in str(a["none"])
    assert len(a["warnings"]) == 3 and b["warnings"] == [], (a["warnings"], b["warnings"])  # rank 0 only
    assert "select: 'blocks.*.attn.*' matched no weight" in a["warnings"][0]
    assert "mapped (1 of 2): body.fc1.weight" in a["warnings"][0]
    assert glob == b["glob"] and auto == b["auto"]
