"""`runtime.experts.ExpertLayers`: a grouped-GEMM module's local experts as GIFT layers of their
own state whose tensors are views of stacked ones, without ranks (the state's group is None)."""

from __future__ import annotations

import pytest
import torch

from gift_compile.config import GiftConfig
from gift_compile.exchange.plan import Collective
from gift_compile.geometry.maps import LowRank
from gift_compile.geometry.statistics import SketchStatistics
from gift_compile.runtime.experts import ExpertLayers
from gift_compile.runtime.state import GiftState

E, F, D = 4, 16, 48
SHAPES = {"w1_EFD": (E, F, D), "w3_EFD": (E, F, D), "w2_EDF": (E, D, F)}
INPUTS = {"w1_EFD": "x", "w3_EFD": "x", "w2_EDF": "h"}


def _config(**kw: object) -> GiftConfig:
    return GiftConfig(geometry="lowrank", format="fp8_e4m3", select="all", rank=4, sketch_cols=8, **kw)


def _params() -> dict[str, torch.nn.Parameter]:
    return {name: torch.nn.Parameter(torch.zeros(shape)) for name, shape in SHAPES.items()}


def _experts(config: GiftConfig, params: dict[str, torch.nn.Parameter] | None = None) -> ExpertLayers:
    state = GiftState(config, None, collective=Collective.REDUCE_SCATTER)
    return ExpertLayers(state, "layers.1.moe.experts", SHAPES, INPUTS, params or _params(), "cpu")


def _tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each expert's tokens from its own anisotropic distribution, sorted by expert (12, 0, 20, 8
    tokens: one expert gets none), two padding rows at the end."""
    gen = torch.Generator().manual_seed(seed)
    counts = [12, 0, 20, 8]
    xs = [torch.randn(n, D, generator=gen) * torch.logspace(0, 1.5, D)[torch.randperm(D, generator=gen)]
          for n in counts]
    x = torch.cat([*xs, torch.full((2, D), 1e30)])
    h = torch.cat([torch.randn(sum(counts), F, generator=gen) * torch.logspace(0, 1, F), torch.zeros(2, F)])
    return x, h, torch.tensor(counts).cumsum(0)


def test_each_expert_is_a_layer_named_by_its_local_index_whose_tensors_are_stacked_views() -> None:
    experts = _experts(_config())
    names = list(experts.state.layers)
    assert names[:E] == [f"layers.1.moe.experts.w1_EFD[{e}]" for e in range(E)] and len(names) == 3 * E
    w1 = experts.weights["w1_EFD"]
    for e, layer in enumerate(w1.layers):
        assert all(t.data_ptr() == s[e].data_ptr() for t, s in zip(layer.transform.tensors, w1.transform))
        assert layer.path_gate.data_ptr() == w1.gate[e].data_ptr() and layer.probe.data_ptr() == w1.probe[e].data_ptr()
    # w3 reads w1's input: its experts follow w1's statistics, one statistic per distinct input
    w3 = experts.weights["w3_EFD"]
    assert all(l.leader is w for l, w in zip(w3.layers, w1.layers)) and set(experts.stats) == {"x", "h"}
    plan = w1.plan
    assert plan.groups == E and plan.rows == E * F and plan.cols == D and plan.gated and plan.block_maps
    assert bool(w1.gate.all())  # select="all": every expert on its map
    item = w1.tensors(rank=1, world=2)
    assert item.shard_transform is not None and item.shard_transform[0].data_ptr() == w1.transform[0][2].data_ptr()


def test_a_refresh_builds_each_experts_map_from_its_own_tokens_into_the_stacked_tensors() -> None:
    experts = _experts(_config())
    x, h, offsets = _tokens()
    experts.observe("x", x, offsets)
    experts.observe("h", h, offsets)
    experts.state.refresh()
    for key, weight, rows, width in (("x", "w1_EFD", x, D), ("h", "w2_EDF", h, F)):
        stacked = experts.weights[weight].transform
        start = 0
        for e, end in enumerate(offsets.tolist()):
            ref = SketchStatistics(width, rank=4, sketch_cols=8, ema=experts.state.config.ema,
                                   max_tokens=experts.state.config.stats_tokens, seed=experts.state.config.seed)
            if end > start:
                ref.observe(rows[start:end])
            ref.consolidate(None)
            m = LowRank(width, 4)
            if end > start:
                m.refresh_from_stats(ref, experts.state.config.damping)
            for got, want in zip((t[e] for t in stacked), m.tensors):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # summation order differs
            start = end
    # w3 follows w1: the same maps
    assert all(torch.equal(a, b) for a, b in zip(experts.weights["w1_EFD"].transform,
                                                 experts.weights["w3_EFD"].transform))
    # the maps differ between experts (their tokens differ): not one map for all
    w1 = experts.weights["w1_EFD"].transform[1]
    assert not torch.equal(w1[0], w1[2])


def test_checkpoint_round_trip_writes_into_the_stacked_tensors() -> None:
    saved = _experts(_config(error_feedback=True))
    x, h, offsets = _tokens()
    saved.observe("x", x, offsets)
    saved.observe("h", h, offsets)
    saved.state.refresh()
    residual = saved.weights["w2_EDF"].residual
    assert residual is not None and residual[0].shape == (E * D, F)
    residual[0].copy_(torch.randn(E * D, F, generator=torch.Generator().manual_seed(3)))
    loaded = _experts(_config(error_feedback=True))
    loaded.state.load_state_dict(saved.state.state_dict())
    for name, weight in saved.weights.items():
        other = loaded.weights[name]
        assert all(torch.equal(a, b) for a, b in zip(weight.transform, other.transform)), name
        assert torch.equal(weight.gate, other.gate)
    assert torch.equal(loaded.weights["w2_EDF"].residual[0], residual[0])


def test_the_main_state_steps_refreshes_and_checkpoints_the_experts_state() -> None:
    """The experts' state is driven by the main one: each optimizer step advances it (its seed,
    its refresh at the same cadence) and the main state's checkpoint carries it."""
    def pair() -> tuple[GiftState, ExpertLayers]:
        main = GiftState(_config(refresh_every=2, refresh_warmup=0), None, collective=Collective.REDUCE_SCATTER)
        experts = _experts(_config(refresh_every=2, refresh_warmup=0))
        main.substates.append(experts.state)
        return main, experts

    main, experts = pair()
    x, h, offsets = _tokens()
    experts.observe("x", x, offsets)
    experts.observe("h", h, offsets)
    seed = int(experts.state.seed)
    main.step()
    assert experts.state.steps == 1 and int(experts.state.seed) == seed + 1 and not experts.state.history
    main.step()
    assert experts.state.steps == 2 and len(experts.state.history) == 1  # refreshed with the main state
    sd = main.state_dict()
    assert "sub0:layers.1.moe.experts.w1_EFD[0].transform.t1" in sd
    loaded, other = pair()
    loaded.load_state_dict(sd)
    assert other.state.steps == 2
    assert all(torch.equal(a, b) for a, b in zip(experts.weights["w1_EFD"].transform,
                                                 other.weights["w1_EFD"].transform))
    alone = GiftState(_config(refresh_every=2, refresh_warmup=0), None, collective=Collective.REDUCE_SCATTER)
    with pytest.raises(ValueError, match="further states"):
        alone.load_state_dict(sd)


def test_second_moment_builds_each_experts_scales_from_its_own_rows_of_adamws_state() -> None:
    """Under AdamW's default geometry (`second_moment`) each expert's column scales come from its
    own block of the 3-D weight's `exp_avg_sq` (`GiftState.blocks`), read through the optimizer
    `attach_optimizer` binds; not one scale vector for all experts, not the identity."""
    params = _params()
    gen = torch.Generator().manual_seed(5)
    opt = torch.optim.AdamW(params.values(), lr=1e-3)
    for p in params.values():  # each expert's gradient columns on their own scale
        p.grad = torch.randn(p.shape, generator=gen) * torch.rand(p.shape[0], 1, p.shape[2], generator=gen) * 10
    opt.step()
    experts = _experts(GiftConfig(geometry="second_moment", format="fp8_e4m3", select="all"), params)
    state = experts.state
    with pytest.raises(RuntimeError, match=r"w1_EFD\[0\] has no second moment"):
        state.factor_source(None)("layers.1.moe.experts.w1_EFD[0]")
    state.grad_source = state.factor_source(opt)
    state.refresh()
    for name, weight in experts.weights.items():
        v = opt.state[params[name]]["exp_avg_sq"]
        for e, layer in enumerate(weight.layers):
            c = v[e].double().sum(0)
            want = (c / c.mean()).rsqrt().float()
            torch.testing.assert_close(weight.transform[0][e], want, rtol=1e-5, atol=0)
            assert layer.transform.tensors[0].data_ptr() == weight.transform[0][e].data_ptr()
        assert not torch.allclose(weight.transform[0][0], weight.transform[0][1])


def _select_on_rank(rank: int, world: int) -> dict[str, bool]:
    """One refresh of the experts' state over 2 gloo ranks, each rank routed its own number of
    tokens (rank 0 16384 per expert, rank 1 one): the layers each rank selects. The measured
    transformed error is halved (a gain of 2 for every expert) and the exchange is priced as free
    (`auto_network_gbps` 1e6), so that what decides is the map's time against the expert's
    backward, which each rank computes from its tokens (rank 0 alone would select every expert)."""
    import dataclasses

    import torch.distributed as dist

    from gift_compile.runtime import refresh

    measure = refresh.measure
    refresh.measure = lambda *a, **k: dataclasses.replace(m := measure(*a, **k), err_transformed=m.err_euclidean / 2)
    config = GiftConfig(geometry="lowrank", format="nvfp4", select="auto", rank=4, sketch_cols=8,
                        auto_network_gbps=1e6)
    state = GiftState(config, dist.group.WORLD, collective=Collective.REDUCE_SCATTER)
    experts = ExpertLayers(state, "layers.1.moe.experts", SHAPES, INPUTS, _params(), "cpu")
    gen = torch.Generator().manual_seed(11)  # the same probes on both ranks
    tokens = 16384 if rank == 0 else 1
    counts = torch.full((E,), tokens)
    experts.observe("x", torch.randn(E * tokens, D), counts.cumsum(0))
    experts.observe("h", torch.randn(E * tokens, F), counts.cumsum(0))
    for weight in experts.weights.values():
        weight.probe.copy_(torch.randn(weight.probe.shape, generator=gen))
    state.refresh()
    return {name: layer.selected for name, layer in state.layers.items()}


def test_ranks_routed_different_token_counts_take_the_same_selection() -> None:
    """A MoE routes each rank its own tokens, so the map's share of an expert's
    backward (the selection's overhead, per token) differs between ranks; the selection must
    still be one decision for the group, or the ranks' plans (and their collectives) diverge."""
    from multirank import run_ranks

    first, second = run_ranks(_select_on_rank, 2)
    assert first == second
    # rank 0's own overhead (0.12) is under the limit, the group's mean (rank 1's one token
    # dominates) is over it
    assert not any(first.values())
