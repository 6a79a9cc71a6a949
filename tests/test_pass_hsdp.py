"""The GIFT pass on an HSDP backward graph, 4 gloo ranks (2 replicas x 2 shards), no trainer.

The graph is built by hand in the shape SimpleFSDP traces for hybrid sharding (torchtitan's
graph_trainer): per gradient an all_reduce of the full gradient over the replica group, then the
block's bucketed reduce-scatter of those results over the shard group. The pass must swap the
pair: GIFT's reduce-scatter of the local gradients over the shard group at `format`, then GIFT's
all-reduce of the reduced shard over the replica group at `replica_format`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from multirank import run_ranks

# (format, replica_format): both exact, each hop alone quantized, both quantized
CASES = [("fp32", "fp32"), ("fp8_e4m3", "fp32"), ("fp32", "int4"), ("fp8_e4m3", "nvfp4")]


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from gift_compile.frameworks import hsdp
    from gift_compile.api import manage
    from gift_compile.exchange.collectives import C_BASELINE, C_CALLS, C_WIRE
    from gift_compile.config import GiftConfig
    from gift_compile.passes import GiftRewriteError, count_ops, rewrite_gradient_collectives

    from torch.fx.experimental.proxy_tensor import make_fx
    import torch._inductor.fx_passes.bucketing  # noqa: F401

    c10d = torch.ops._c10d_functional
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replica, shard = mesh.get_group("replicate"), mesh.get_group("shard")
    gen = torch.Generator().manual_seed(100 + rank)
    g, norm = torch.randn(128, 64, generator=gen), torch.randn(128, generator=gen)
    # the exact result: this shard's rows of the sum over all 4 ranks, in the bucket's layout
    full = torch.cat([g.reshape(2, -1), norm.reshape(2, -1)], dim=1)
    dist.all_reduce(full)
    exact = full[dist.get_rank(shard)]

    def build(config: GiftConfig, with_hop: bool, tp_norm: bool = False) -> tuple:
        model = nn.Sequential(nn.Linear(64, 128))
        state = manage(model, config, dist.group.WORLD, mode="tag", split_rows=True)
        if with_hop:
            hsdp.install_graph(state, replica)
        layer = next(iter(state.layers.values()))
        tensors = layer.mark_tensors(state.shared)

        def backward(g: torch.Tensor, norm: torch.Tensor, *st: torch.Tensor) -> torch.Tensor:
            marked = torch.ops.gift.mark(g, list(st), layer.plan_str)
            a = c10d.wait_tensor(c10d.all_reduce(marked, "sum", replica.group_name))
            if tp_norm:  # HSDP x TP: the norm's TP all-reduce first (the shard group stands in for TP's)
                norm = c10d.wait_tensor(c10d.all_reduce(norm, "sum", shard.group_name))
            b = c10d.wait_tensor(c10d.all_reduce(norm, "sum", replica.group_name))
            flat = torch.ops.bucketing._pre_bucket_reduce_scatter([a, b], 2)
            return c10d.wait_tensor(c10d.reduce_scatter_tensor(flat, "sum", 2, shard.group_name)) * 1.0

        gm = make_fx(backward, tracing_mode="fake")(g, norm, *tensors)
        return state, tensors, gm

    out: dict = {"cases": []}
    for fmt, replica_fmt in CASES:
        config = GiftConfig(format=fmt, replica_format=replica_fmt, geometry="hadamard", select="all",
                            min_numel=1024, exclude=(), reduce_op="sum")
        state, tensors, gm = build(config, with_hop=True)
        before = count_ops(gm.graph)
        report = rewrite_gradient_collectives(gm)
        hop = hsdp.replica_hop(state)
        shard_before, replica_before = state.counters.clone(), hop.counters.clone()
        got = gm(g, norm, *tensors)
        shard_delta = (state.counters - shard_before).tolist()
        replica_delta = (hop.counters - replica_before).tolist()
        state.check_health()  # no plan mismatch, no non-finite flag on either hop
        out["cases"].append({
            "formats": (fmt, replica_fmt), "before": before, "after": report.ops_after,
            "fallbacks": report.fallbacks, "layers": report.layers, "hops": report.replica_hops,
            "err": float((got - exact).norm() / exact.norm()), "got": got,
            "counted": (shard_delta[C_WIRE], replica_delta[C_WIRE]),
            "accounted": (report.wire_bytes, report.replica_wire_bytes),
            "baseline": (shard_delta[C_BASELINE], replica_delta[C_BASELINE]),
            "accounted_baseline": (report.baseline_bytes, report.replica_baseline_bytes),
            "calls": (shard_delta[C_CALLS], replica_delta[C_CALLS]),
        })
    # HSDP x TP on graph_trainer: a norm gradient crosses TP's all-reduce, then the replica one;
    # the pass takes the marked gradients' group as the replica hop and leaves TP's all-reduce
    config = GiftConfig(format="fp32", replica_format="fp32", geometry="hadamard", select="all", min_numel=1024,
                        exclude=(), reduce_op="sum")
    state, tensors, gm = build(config, with_hop=True, tp_norm=True)
    before = count_ops(gm.graph)
    report = rewrite_gradient_collectives(gm)
    tp_summed = norm.clone()
    dist.all_reduce(tp_summed, group=shard)
    full = torch.cat([g.reshape(2, -1), tp_summed.reshape(2, -1)], dim=1)
    dist.all_reduce(full)
    want = full[dist.get_rank(shard)]
    got = gm(g, norm, *tensors)
    out["tp_norm"] = {"before": before, "after": report.ops_after, "fallbacks": report.fallbacks,
                      "hops": report.replica_hops, "err": float((got - want).norm() / want.norm())}
    # a mark without the replica hop crossing a replica all-reduce is refused, not quantized at the wrong hop
    _, _, gm = build(GiftConfig(format="fp8_e4m3", geometry="lowrank", select="all", min_numel=1024, exclude=()),
                     with_hop=False)
    try:
        rewrite_gradient_collectives(gm)
        out["refused"] = None
    except GiftRewriteError as e:
        out["refused"] = str(e)
    out["sole"] = _sole_replica_hop(replica)
    out["ranks"] = (dist.get_rank(replica), dist.get_rank(shard))
    return out


def _sole_replica_hop(replica: dist.ProcessGroup) -> dict:
    """A gradient whose only collective is the replica all-reduce (a one-rank shard group:
    torchtitan's routed experts on a one-rank efsdp under EP x HSDP), marked as
    `simple_fsdp.mark_outside` and `set_replica_hop` mark it (a Euclidean plan with the hop's
    format, an empty probe, the hop's `Shared`), at fp32 and nvfp4; and a managed layer's mark
    (its probe has rows) in the same place, which the pass must refuse."""
    import dataclasses

    from torch.fx.experimental.proxy_tensor import make_fx

    from gift_compile.api import manage
    from gift_compile.config import GiftConfig
    from gift_compile.exchange.collectives import C_CALLS, C_WIRE, ItemTensors, Shared
    from gift_compile.exchange.mark import pack_mark_tensors
    from gift_compile.frameworks import hsdp
    from gift_compile.frameworks.euclidean import euclidean_plan
    from gift_compile.passes import GiftRewriteError, rewrite_gradient_collectives

    c10d = torch.ops._c10d_functional
    g = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(7 + dist.get_rank()))
    exact = g.clone()
    dist.all_reduce(exact, group=replica)

    def traced(plan_str: str, tensors: list[torch.Tensor]) -> torch.fx.GraphModule:
        def backward(g: torch.Tensor, *st: torch.Tensor) -> torch.Tensor:
            marked = torch.ops.gift.mark(g, list(st), plan_str)
            return c10d.wait_tensor(c10d.all_reduce(marked, "sum", replica.group_name)) * 1.0
        return make_fx(backward, tracing_mode="fake")(g, *tensors)

    out: dict = {}
    for fmt in ("fp32", "nvfp4"):
        config = GiftConfig(format=fmt, geometry="hadamard", select="all", min_numel=1024, exclude=(),
                            unmapped_format="int4")  # the shard hop (one rank) has a plan; the replica hop is `fmt`
        state = manage(nn.Sequential(nn.Linear(64, 128)), config, dist.group.WORLD, mode="tag", split_rows=True)
        hop = hsdp.install_graph(state, replica)
        plan = dataclasses.replace(euclidean_plan(state, "experts.w1", g.shape, 1), replica_format=fmt)
        item = ItemTensors((), probe=torch.zeros(0, 64), seed_offset=torch.tensor(plan.seed_offset))
        tensors = pack_mark_tensors(plan, item, state.shared, Shared(state.seed, hop.rank, hop.counters))
        gm = traced(plan.to_str(), tensors)
        report = rewrite_gradient_collectives(gm)
        shard_before, hop_before = state.counters.clone(), hop.counters.clone()
        got = gm(g, *tensors)
        hop_delta = (hop.counters - hop_before).tolist()
        out[fmt] = {"err": float((got - exact).norm() / exact.norm()), "after": report.ops_after,
                    "fallbacks": report.fallbacks, "hops": (report.replica_hops, report.sole_replica_hops),
                    "accounted": (report.wire_bytes, report.replica_wire_bytes, report.replica_baseline_bytes),
                    "counted": (hop_delta[C_WIRE], hop_delta[C_CALLS]),
                    "shard_counted": bool((state.counters != shard_before).any())}
        layer = next(iter(state.layers.values()))  # a layer's mark: its probe has rows
        gm = traced(layer.plan_str, layer.mark_tensors(state.shared))
        try:
            rewrite_gradient_collectives(gm)
            out[fmt]["layer_refused"] = None
        except GiftRewriteError as e:
            out[fmt]["layer_refused"] = str(e)
    out["baseline"] = g.numel() * 4
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_worker, 4)


def test_pass_swaps_the_replica_all_reduce_behind_the_shard_reduce_scatter(ranks: list[dict]) -> None:
    for case in ranks[0]["cases"]:
        before, after = case["before"], case["after"]
        assert before["_c10d_functional.all_reduce.default"] == 2
        assert before["_c10d_functional.reduce_scatter_tensor.default"] == 1
        # both hops are GIFT's: no native all-reduce or reduce-scatter is left; the shard hop is
        # one all_to_all, the replica hop one all_to_all + one all_gather
        assert "_c10d_functional.all_reduce.default" not in after, after
        assert "_c10d_functional.reduce_scatter_tensor.default" not in after, after
        assert after["_c10d_functional.all_to_all_single.default"] == 2, after
        assert after["_c10d_functional.all_gather_into_tensor.default"] == 1, after
        assert "gift.mark.default" not in after
        assert case["fallbacks"] == [] and case["layers"] == ["0.weight"] and case["hops"] == 1


def test_each_hop_at_its_own_format(ranks: list[dict]) -> None:
    errs = {c["formats"]: c["err"] for c in ranks[0]["cases"]}
    assert errs[("fp32", "fp32")] < 1e-6  # the swap is exact up to fp32 summation order
    assert 1e-3 < errs[("fp8_e4m3", "fp32")] < 0.08, errs  # fp8 on the shard hop alone
    assert 0.02 < errs[("fp32", "int4")] < 0.3, errs  # int4 on the replica hop alone
    assert errs[("fp8_e4m3", "nvfp4")] > errs[("fp8_e4m3", "fp32")], errs
    assert errs[("fp8_e4m3", "nvfp4")] < 0.3, errs


def test_bytes_per_hop_counted_equal_accounted(ranks: list[dict]) -> None:
    for rank in ranks:
        for case in rank["cases"]:
            assert case["counted"] == case["accounted"], case["formats"]
            assert case["baseline"] == case["accounted_baseline"], case["formats"]
            assert case["calls"] == (1, 1)
    quantized = {c["formats"]: c for c in ranks[0]["cases"]}[("fp8_e4m3", "nvfp4")]
    exact = {c["formats"]: c for c in ranks[0]["cases"]}[("fp32", "fp32")]
    assert quantized["counted"][0] < exact["counted"][0] and quantized["counted"][1] < exact["counted"][1]


def test_replicas_decode_identical_bits(ranks: list[dict]) -> None:
    by_shard: dict[int, list[dict]] = {}
    for rank in ranks:
        by_shard.setdefault(rank["ranks"][1], []).append(rank)
    assert sorted(len(v) for v in by_shard.values()) == [2, 2]
    for pair in by_shard.values():
        for a, b in zip(pair[0]["cases"], pair[1]["cases"]):
            assert torch.equal(a["got"], b["got"]), a["formats"]


def test_mark_without_replica_hop_is_refused(ranks: list[dict]) -> None:
    assert ranks[0]["refused"] is not None and "carries no replica hop" in ranks[0]["refused"]


def test_tp_all_reduce_of_a_norm_gradient_before_the_replica_one_stays(ranks: list[dict]) -> None:
    """HSDP x TP: SimpleFSDP all-reduces a norm weight's gradient over TP, then over the replicas,
    before the bucket's reduce-scatter. Only the replica all-reduces move behind GIFT's shard hop;
    TP's stays where it was, and at fp32 the result is the exact sum."""
    for rank in ranks:
        case = rank["tp_norm"]
        assert case["before"]["_c10d_functional.all_reduce.default"] == 3
        assert case["after"]["_c10d_functional.all_reduce.default"] == 1, case["after"]  # TP's
        assert "_c10d_functional.reduce_scatter_tensor.default" not in case["after"]
        assert case["fallbacks"] == [] and case["hops"] == 1
        assert case["err"] < 1e-6, case["err"]


def test_replica_all_reduce_alone_is_the_replica_hop_for_a_mark_without_a_layer(ranks: list[dict]) -> None:
    """A gradient whose shard group has one rank (SimpleFSDP traces its replica all-reduce and no
    reduce-scatter: the routed experts under EP x HSDP on a one-rank efsdp), marked with no map
    and the replica hop: the pass makes that all-reduce GIFT's at the plan's replica format, on
    the hop's counters (counted == accounted, nothing on the shard hop's); a managed layer's mark
    there (its probe, which only a shard hop writes) is refused by name."""
    for rank in ranks:
        sole = rank["sole"]
        for fmt in ("fp32", "nvfp4"):
            case = sole[fmt]
            assert case["fallbacks"] == [] and case["hops"] == (1, 1), case
            assert "_c10d_functional.all_reduce.default" not in case["after"], case["after"]
            assert "gift.mark.default" not in case["after"]
            wire, replica_wire, replica_baseline = case["accounted"]
            assert wire == 0 and replica_baseline == sole["baseline"]
            assert case["counted"] == (replica_wire, 1) and not case["shard_counted"], case
            assert "experts.w1" not in (case["layer_refused"] or ""), case["layer_refused"]
            assert "0.weight" in case["layer_refused"] and "probe" in case["layer_refused"], case["layer_refused"]
        assert sole["fp32"]["err"] < 1e-6
        assert 0.02 < sole["nvfp4"]["err"] < 0.3, sole["nvfp4"]["err"]
        assert sole["nvfp4"]["accounted"][1] < 0.2 * sole["fp32"]["accounted"][1]
