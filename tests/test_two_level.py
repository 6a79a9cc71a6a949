"""The two-level exchange (`gift_compile.exchange.node_stage`) on 8 gloo ranks, simulated as
2 nodes x 4 and 4 nodes x 2 (`GiftConfig.ranks_per_node`), in ONE spawn: the core (public
API and `sync_buffer`), DDP, FSDP2 and the graph pass, each checked against the one-level
exchange and the native collective.

Every check fails if the two levels collapsed into the one-level exchange: bytes handed inside
the node are non-zero and equal the accounting, the bytes across nodes are the one-level
exchange's / g, the codec's map and encode see 1/g of the elements, the rewritten graph holds
the node's reduce-scatter.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import gift_compile
from gift_compile.config import GiftConfig, GiftConfigError
from gift_compile.exchange.topology import TopologyError, node_of_ranks
from multirank import run_ranks
from mlp import EXACT_OUTSIDE, MLP
from test_pass import bucketed_step

WORLD = 8
LAYOUTS = (4, 2)  # ranks per node: 2 nodes x 4, 4 nodes x 2
NVFP4 = dict(format="nvfp4", block_size=16)


def _ints(rank: int, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Small integers: every summation order gives the same fp32 bits, so the two-level sums
    can be compared bit for bit with the native collective's."""
    return torch.randint(-64, 64, shape, generator=torch.Generator().manual_seed(1000 * seed + rank)).float()


class _Counting:
    """Counts the elements the codec's map (`apply_forward`) and encoder see, by wrapping the
    exchange's own references to them."""

    def __init__(self) -> None:
        from gift_compile.exchange import item_codec
        self.mod, self.mapped, self.encoded = item_codec, 0, 0
        self.saved = (item_codec.apply_forward, item_codec.choose_scales_and_encode)

    def __enter__(self) -> "_Counting":
        fwd, enc = self.saved

        def apply_forward(kind, g, *a, **k):
            self.mapped += g.numel()
            return fwd(kind, g, *a, **k)

        def encode(g, *a, **k):
            self.encoded += g.numel()
            return enc(g, *a, **k)

        self.mod.apply_forward, self.mod.choose_scales_and_encode = apply_forward, encode
        return self

    def __exit__(self, *exc) -> None:
        self.mod.apply_forward, self.mod.choose_scales_and_encode = self.saved


def _core(rank: int, world: int, g: int) -> dict:
    """The public API and `sync_buffer` on one layout: values, bytes per hop, codec work."""
    from gift_compile.exchange import collectives as C
    from gift_compile.exchange.plan import ItemPlan
    import os

    from gift_compile.exchange.topology import NodeLayout, node_layout

    # the launcher's node size: the flat arm (ranks_per_node=0) runs one level over the same
    # nodes, so its bytes are counted as crossing them
    os.environ["LOCAL_WORLD_SIZE"] = str(g)
    group = dist.group.WORLD
    out: dict = {}
    x = _ints(rank, (world * 4, 64))
    native = x.clone()
    dist.all_reduce(native)
    out["native"] = native
    for name, rpn in (("flat", 0), ("two", g)):
        fp32 = GiftConfig(format="fp32", ranks_per_node=rpn, reduce_op="sum")
        out[name, "rs32"] = C.reduce_scatter(x, group, fp32)
        out[name, "ar32"] = C.all_reduce(x[:13], group, fp32)  # 13 rows: padded to the world
        nv = GiftConfig(**NVFP4, ranks_per_node=rpn)
        out[name, "rsnv"] = C.reduce_scatter(x, group, nv)
        out[name, "arnv"] = C.all_reduce(x[:13], group, nv)
        # bytes per hop at the collectives, and the codec's work, on one bucket of two items
        for op, rows in (("reduce_scatter", world * 4), ("all_reduce", 13)):
            counters = torch.zeros(C.N_COUNTERS, dtype=torch.int64)
            item = ItemPlan(name="w", rows=rows, cols=64, **NVFP4)
            layout = node_layout(group, rpn)
            per = rows // world if op == "reduce_scatter" else rows
            segments = [C.Segment("w", per, 64, item, C.ItemTensors(())), C.Segment("b", 1, 8 if op == "all_reduce" else 1)]
            buf = torch.cat([_ints(rank, (rows * 64,), 1), _ints(rank, (8 if op == "all_reduce" else world,), 2)])
            plan = C.bucket_plan(segments, torch.float32, world=world, group_name=group.group_name, average=True,
                                 op=op, layout=layout)
            with _Counting() as count:
                C.sync_buffer(buf, segments, C.Shared(0, rank, counters), op=op, group=group, average=True,
                              ranks_per_node=rpn)
            out[name, op, "counted"] = (int(counters[C.C_NODE_WIRE]), int(counters[C.C_WIRE] - counters[C.C_NODE_WIRE]))
            out[name, op, "accounted"] = C.bucket_hop_bytes(plan)
            out[name, op, "work"] = (count.mapped, count.encoded)
            out[name, op, "two_level"] = plan.two_level
    out["flat_layout"] = node_layout(group, 0) == NodeLayout(1, world // g)  # one level, across world // g nodes
    # error feedback lives on stage 2's chunk: a full-size residual is refused, the chunk's kept
    ef = GiftConfig(**NVFP4, ranks_per_node=g)
    try:
        C.reduce_scatter(x, group, ef, residual=torch.zeros_like(x))
        out["full_residual"] = "accepted"
    except ValueError as e:
        out["full_residual"] = str(e)
    res = torch.zeros(world * 4 // g, 64)
    C.reduce_scatter(x, group, ef, residual=res)
    out["residual_nonzero"] = bool(res.abs().sum() > 0)
    # a NaN on the last rank, in rows another node's ranks own: every rank raises, naming it
    bad = x.clone()
    if rank == world - 1:
        bad[1, 3] = float("nan")
    try:
        C.reduce_scatter(bad, group, GiftConfig(**NVFP4, ranks_per_node=g))
        out["nan"] = "no error"
    except FloatingPointError as e:
        out["nan"] = str(e)
    counters = torch.zeros(C.N_COUNTERS, dtype=torch.int64)
    seg = [C.Segment("w", 4, 64, ItemPlan(name="w", rows=world * 4, cols=64, **NVFP4), C.ItemTensors(()))]
    C.sync_buffer(bad.reshape(-1), seg, C.Shared(0, rank, counters), op="reduce_scatter", group=group,
                  average=False, ranks_per_node=g)
    out["nan_mask"] = int(counters[C.C_NONFINITE_RANKS])
    return out


def _ddp(rank: int, world: int, g: int) -> dict:
    """DDP with GIFT's all-reduce in two levels, error feedback on, and a kill-and-resume of
    the GIFT state and the optimizer at step 2."""
    from gift_compile.exchange.collectives import bucket_hop_bytes, bucket_wire_bytes
    from gift_compile.exchange.plan import BucketPlan, ItemPlan
    from gift_compile.exchange.topology import FLAT, node_layout

    cfg = GiftConfig(**EXACT_OUTSIDE, **NVFP4, geometry="lowrank", rank=4, min_numel=1024, select="all", exclude=(),
                     refresh_every=1, error_feedback=True, ranks_per_node=g)

    def make():
        model = MLP(64)
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=100)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        gift_compile.apply(ddp, cfg, optimizer=opt, fuse=False)
        return model, ddp, opt

    def step(ddp, opt, i):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(10 * i + rank))
        ddp(x).pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in ddp.module.named_parameters()}
        opt.step()
        opt.zero_grad()
        return grads

    model, ddp, opt = make()
    st = gift_compile.state(ddp)
    first = step(ddp, opt, 0)
    totals = st.comm_totals()
    items = tuple(st.layers[n].plan if n in st.layers else ItemPlan.passthrough(n, p.numel(), p.dtype)
                  for n, p in reversed(list(model.named_parameters())))
    layout = node_layout(dist.group.WORLD, g)
    plan = BucketPlan(items, world, dist.group.WORLD.group_name, True, "all_reduce", layout)
    flat = BucketPlan(items, world, dist.group.WORLD.group_name, True, "all_reduce", FLAT)
    step(ddp, opt, 1)
    saved = {"gift": st.state_dict(), "model": {k: v.clone() for k, v in model.state_dict().items()},
             "opt": opt.state_dict()}
    resumed_from = {k: v.clone() for k, v in saved["gift"].items() if isinstance(v, torch.Tensor)}
    want = step(ddp, opt, 2)
    model2, ddp2, opt2 = make()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    gift_compile.state(ddp2).load_state_dict(saved["gift"])
    got = step(ddp2, opt2, 2)
    residual_shapes = {n: tuple(l.residual[0].shape) for n, l in st.layers.items()}
    return {"first": first, "totals": totals, "accounted": bucket_hop_bytes(plan), "flat": bucket_wire_bytes(flat),
            "resume_equal": all(torch.equal(got[n], want[n]) for n in want),
            "residual_shapes": residual_shapes, "has_residual": any(k.endswith("residual.0") for k in resumed_from)}


def _fsdp2(rank: int, world: int, g: int) -> dict:
    """FSDP2's custom reduce-scatter in two levels: the shards FSDP2 expects, bytes per hop."""
    from torch.distributed.fsdp import fully_shard

    from gift_compile.exchange.collectives import bucket_hop_bytes

    model, ref = MLP(64), MLP(64)
    for layer in (model.fc1, model.fc2, model.out):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    gift_compile.apply(model, GiftConfig(**EXACT_OUTSIDE, format="fp32", min_numel=1024, exclude=(), ranks_per_node=g, select="none"),
                       optimizer=opt, fuse=False)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    exact = {}
    for n, p in ref.named_parameters():
        dist.all_reduce(p.grad)
        exact[n] = p.grad / world
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    st = gift_compile.state(model)
    accounted = [0, 0]
    for module in (model.fc1, model.fc2, model.out):
        comm = module._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm
        node, cross = bucket_hop_bytes(comm.plan(world, torch.float32, dist.group.WORLD.group_name))
        accounted[0] += node
        accounted[1] += cross
    errs = {n: float((grads[n] - exact[n]).abs().max()) for n in exact}
    return {"errs": errs, "totals": st.comm_totals(), "accounted": tuple(accounted)}


def _graph(rank: int, world: int, g: int, node_format: str = "native") -> dict:
    """The graph pass on a bucketed reduce-scatter (graph_trainer / torch.compile's shape):
    rewritten into the node's reduce-scatter + GIFT's all_to_all across nodes, equal to the
    eager two-level bucket bit for bit (`node_format`: `GiftConfig.intra_node_format`, carried
    by the marks' plans into the rewrite)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import torch._inductor.fx_passes.bucketing  # noqa: F401  (registers the bucketing ops)
    from gift_compile.exchange import collectives as C
    from gift_compile.exchange.plan import BucketPlan, ItemPlan
    from gift_compile.exchange.topology import node_layout
    from gift_compile.passes import count_ops, rewrite_gradient_collectives
    from gift_compile.runtime.state import GiftState

    st = GiftState(GiftConfig(**NVFP4, geometry="lowrank", rank=4, select="all", refresh_every=1, ranks_per_node=g,
                              intra_node_format=node_format), dist.group.WORLD, collective="reduce_scatter")
    a, b = st.add_layer("a.weight", (16, 48), "cpu"), st.add_layer("b.weight", (32, 32), "cpu")
    gen = torch.Generator().manual_seed(0)
    for layer in (a, b):
        layer.stats.observe(torch.randn(256, layer.shape[1], generator=gen) * torch.logspace(0, -2, layer.shape[1]))
    st.refresh()
    group = dist.group.WORLD.group_name
    ta, tb = a.mark_tensors(st.shared), b.mark_tensors(st.shared)

    step = bucketed_step(a, b, ta, tb, world, group)

    gen = torch.Generator().manual_seed(10 + rank)
    xs = [torch.randn(16, 48, generator=gen), torch.randn(32, 32, generator=gen), torch.randn(16, generator=gen)]
    gm = make_fx(step, tracing_mode="fake")(*xs, *ta, *tb)
    report = rewrite_gradient_collectives(gm)
    after = count_ops(gm.graph)
    before_wire = int(st.counters[C.C_NODE_WIRE])
    got = [t.clone() for t in gm(*xs, *ta, *tb)]
    node_wire = int(st.counters[C.C_NODE_WIRE]) - before_wire
    items = (a.plan, b.plan, ItemPlan.passthrough("norm", 16, torch.float32))
    plan = BucketPlan(items, world, group, False, "reduce_scatter", node_layout(group, g, node_format))
    want, _ = C.run_bucket(xs, [a.tensors(), b.tensors(), None], st.shared, plan)
    one_level, _ = C.run_bucket(xs, [a.tensors(), b.tensors(), None], st.shared, BucketPlan(items, world, group, False,
                                                                                           "reduce_scatter"))
    exact = [x.clone() for x in xs]
    for e in exact:
        dist.all_reduce(e)
    return {"after": after, "layers": report.layers, "got": got, "want": want, "exact": exact, "flat": one_level,
            "node_wire": node_wire, "accounted": C.bucket_hop_bytes(plan)}


def _body(rank: int, world: int) -> dict:
    torch._inductor.config.fx_graph_cache = False
    return {g: {"core": _core(rank, world, g), "ddp": _ddp(rank, world, g), "fsdp2": _fsdp2(rank, world, g),
                "graph": _graph(rank, world, g)} for g in LAYOUTS}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_body, WORLD, timeout=900)


def _rs_shard(full: torch.Tensor, rank: int) -> torch.Tensor:
    return full.reshape(WORLD, -1, *full.shape[1:])[rank]


@pytest.mark.parametrize("g", LAYOUTS)
def test_fp32_two_level_equals_native_collective_bit_for_bit(ranks, g):
    for rank, r in enumerate(ranks):
        c = r[g]["core"]
        assert torch.equal(c["two", "rs32"], _rs_shard(c["native"], rank))
        assert torch.equal(c["two", "ar32"], c["native"][:13])
        assert torch.equal(c["flat", "rs32"], c["two", "rs32"])
        assert c["flat_layout"] and c["two", "reduce_scatter", "two_level"]  # the layout really had two levels


@pytest.mark.parametrize("g", LAYOUTS)
def test_nvfp4_two_level_within_format_error_and_replicas_identical(ranks, g):
    for rank, r in enumerate(ranks):
        c = r[g]["core"]
        want = _rs_shard(c["native"], rank) / WORLD
        for key, ref in (("rsnv", want), ("arnv", c["native"][:13] / WORLD)):
            err = float((c["two", key] - ref).norm() / ref.norm())
            flat_err = float((c["flat", key] - ref).norm() / ref.norm())
            assert 0 < err < 0.2 and err < 2 * flat_err + 0.02, (key, err, flat_err)
            # rounded once, on the node's sum, not on each rank's gradient: other bits than one level's
            assert not torch.equal(c["two", key], c["flat", key]), key
        assert torch.equal(c["two", "arnv"], ranks[0][g]["core"]["two", "arnv"])  # every replica, same bits


@pytest.mark.parametrize("g", LAYOUTS)
def test_bytes_per_hop_counted_equal_accounting_and_cross_node_is_flat_over_g(ranks, g):
    for r in ranks:
        c = r[g]["core"]
        for op in ("reduce_scatter", "all_reduce"):
            assert c["two", op, "two_level"] and not c["flat", op, "two_level"]
            assert c["two", op, "counted"] == c["two", op, "accounted"], op
            assert c["flat", op, "counted"] == c["flat", op, "accounted"], op
            node, cross = c["two", op, "counted"]
            assert node > 0 and c["flat", op, "counted"][0] == 0
        # a reduce-scatter's all_to_all: exactly 1/g of the one-level bytes, headers included
        assert c["two", "reduce_scatter", "counted"][1] * g == c["flat", "reduce_scatter", "counted"][1]
        # an all-reduce's: its all_to_all shrinks by g; each rank still hands one shard to the all_gather
        flat_ar, two_ar = c["flat", "all_reduce", "counted"][1], c["two", "all_reduce", "counted"][1]
        assert two_ar < flat_ar / g * 1.6 and two_ar * g > flat_ar, (two_ar, flat_ar)


@pytest.mark.parametrize("g", LAYOUTS)
def test_map_and_encode_run_on_one_gth_of_the_elements(ranks, g):
    for r in ranks:
        c = r[g]["core"]
        flat_map, flat_enc = c["flat", "reduce_scatter", "work"]
        two_map, two_enc = c["two", "reduce_scatter", "work"]
        assert flat_map > 0 and two_map * g == flat_map and two_enc * g == flat_enc


@pytest.mark.parametrize("g", LAYOUTS)
def test_error_feedback_lives_on_the_chunk_and_nan_raises_on_every_rank(ranks, g):
    for r in ranks:
        c = r[g]["core"]
        assert "node chunk" in c["full_residual"], c["full_residual"]
        assert c["residual_nonzero"]
        assert f"rank(s) [{WORLD - 1}]" in c["nan"], c["nan"]
        assert c["nan_mask"] == 1 << (WORLD - 1)


@pytest.mark.parametrize("g", LAYOUTS)
def test_ddp_two_level_replicas_identical_bytes_accounted_resume_exact(ranks, g):
    for r in ranks:
        d = r[g]["ddp"]
        for n, grad in d["first"].items():
            assert torch.equal(grad, ranks[0][g]["ddp"]["first"][n]), n
        assert (d["totals"]["node_wire"], d["totals"]["cross_wire"]) == d["accounted"]
        assert d["totals"]["cross_wire"] * g < d["flat"] * 1.6
        assert d["resume_equal"] and d["has_residual"]
        assert d["residual_shapes"]["fc1.weight"] == (128 // g, 64)  # the chunk's rows, not the gradient's


@pytest.mark.parametrize("g", LAYOUTS)
def test_fsdp2_two_level_shards_and_bytes(ranks, g):
    for r in ranks:
        f = r[g]["fsdp2"]
        assert max(f["errs"].values()) < 1e-5, f["errs"]
        assert (f["totals"]["node_wire"], f["totals"]["cross_wire"]) == f["accounted"]
        assert f["accounted"][0] > 0


@pytest.mark.parametrize("g", LAYOUTS)
def test_graph_pass_rewrites_into_two_levels(ranks, g):
    for rank, r in enumerate(ranks):
        q = r[g]["graph"]
        assert q["layers"] == ["a.weight", "b.weight"]
        assert q["after"].get("_c10d_functional.reduce_scatter_tensor.default") == 1  # the node's stage 1
        assert q["after"].get("_c10d_functional.all_to_all_single.default") == 1  # across nodes
        for got, want in zip(q["got"], q["want"]):
            assert torch.equal(got.reshape(-1), want.reshape(-1))
        for got, flat, exact in zip(q["got"], q["flat"], q["exact"]):
            shard = _rs_shard(exact, rank).reshape(-1)
            err = float((got.reshape(-1) - shard).norm() / shard.norm())
            flat_err = float((flat.reshape(-1) - shard).norm() / shard.norm())
            assert err < 2 * flat_err + 0.05 and err < 0.4, (err, flat_err)  # NVFP4's error, as one level's
        assert q["node_wire"] == q["accounted"][0]


def test_layout_rules():
    assert node_of_ranks([0, 1, 2, 3, 4, 5, 6, 7], 4) == (4, 2)
    assert node_of_ranks([0, 2, 4, 6], 4) == (2, 2)  # a mesh dim: two of the group's ranks per node
    assert node_of_ranks([0, 1, 2, 3], 8) == (4, 1)  # one node: one level
    with pytest.raises(TopologyError, match="unevenly"):
        node_of_ranks([0, 1, 2, 4], 2)
    with pytest.raises(TopologyError, match="not consecutive"):
        node_of_ranks([0, 2, 1, 3], 2)
    with pytest.raises(GiftConfigError, match="ranks_per_node"):
        GiftConfig(ranks_per_node=-1)


def _compiled(rank: int, world: int) -> dict:
    """The eager hooks' compiled bodies (`sync_buffer(compiled=True)`, what `fuse=True` runs)
    in two levels: the same bits and counters as the op-by-op core."""
    from gift_compile.exchange import collectives as C
    from gift_compile.exchange.plan import ItemPlan

    out = {}
    for op, rows in (("reduce_scatter", world * 4), ("all_reduce", 13)):
        item = ItemPlan(name="w", rows=rows, cols=64, format="fp8_e4m3")
        per = rows // world if op == "reduce_scatter" else rows
        segments = [C.Segment("w", per, 64, item, C.ItemTensors(())), C.Segment("b", 1, 8 if op == "all_reduce" else 1)]
        buf = torch.randn(rows * 64 + (8 if op == "all_reduce" else world), generator=torch.Generator().manual_seed(rank))
        runs = []
        for compiled in (False, True):
            counters = torch.zeros(C.N_COUNTERS, dtype=torch.int64)
            outs = C.sync_buffer(buf.clone(), segments, C.Shared(0, rank, counters), op=op, group=dist.group.WORLD,
                                 average=True, ranks_per_node=2, compiled=compiled)
            runs.append((outs, counters))
        (eager, c_eager), (comp, c_comp) = runs
        out[op] = {"equal": all(torch.equal(a, b) for a, b in zip(eager, comp)), "counters": (c_eager, c_comp)}
    return out


def test_compiled_bodies_equal_eager_in_two_levels():
    """4 ranks as 2 nodes x 2 (each rank compiles its bodies: the slow part)."""
    for r in run_ranks(_compiled, 4, timeout=900):
        for op, v in r.items():
            c_eager, c_comp = v["counters"]
            assert v["equal"] and torch.equal(c_eager, c_comp), op
            assert int(c_comp[8]) > 0  # C_NODE_WIRE: the two levels ran


def _core_four(rank: int, world: int) -> dict:
    return _core(rank, world, 2)


def test_core_on_four_ranks_as_two_nodes_of_two():
    """The fast tier's two-level check (`make test`; the 8-rank file above is `make test-full`'s):
    the eager core on 2 nodes x 2, no compile. fp32 is the native collective bit for bit, the
    cross-node bytes are the one-level exchange's / 2 and equal the accounting, the codec maps and
    encodes half the elements, error feedback lives on the chunk and a NaN on rank 3 raises on
    every rank. A collapse to the one-level exchange fails every line."""
    ranks = run_ranks(_core_four, 4, timeout=300)
    for rank, c in enumerate(ranks):
        assert torch.equal(c["two", "rs32"], c["native"].reshape(4, -1, 64)[rank])
        assert torch.equal(c["two", "ar32"], c["native"][:13])
        for op in ("reduce_scatter", "all_reduce"):
            assert c["two", op, "two_level"] and not c["flat", op, "two_level"]
            assert c["two", op, "counted"] == c["two", op, "accounted"] and c["two", op, "counted"][0] > 0, op
        assert c["two", "reduce_scatter", "counted"][1] * 2 == c["flat", "reduce_scatter", "counted"][1]
        (flat_map, flat_enc), (two_map, two_enc) = (c[k, "reduce_scatter", "work"] for k in ("flat", "two"))
        assert flat_map > 0 and two_map * 2 == flat_map and two_enc * 2 == flat_enc
        assert not torch.equal(c["two", "rsnv"], c["flat", "rsnv"])  # rounded once, on the node's sum
        assert torch.equal(c["two", "arnv"], ranks[0]["two", "arnv"])
        assert "node chunk" in c["full_residual"] and c["residual_nonzero"]
        assert "rank(s) [3]" in c["nan"] and c["nan_mask"] == 1 << 3, c["nan"]


def _node_format(rank: int, world: int) -> dict:
    """`intra_node_format` on 2 nodes x 2: the public API and `sync_buffer` at native and bf16
    inside the node (bytes per hop counted and accounted, values), and the graph pass's
    rewrite at bf16."""
    from gift_compile.exchange import collectives as C
    from gift_compile.exchange.plan import ItemPlan
    from gift_compile.exchange.topology import node_layout

    group = dist.group.WORLD
    x = torch.randn(world * 4, 64, generator=torch.Generator().manual_seed(rank))  # not exact in bf16
    exact = x.clone()
    dist.all_reduce(exact)
    magnitude = x.abs()
    dist.all_reduce(magnitude)
    out: dict = {"exact": exact, "magnitude": magnitude}
    for fmt in ("native", "bf16"):
        for wire in ("fp32", "nvfp4"):
            cfg = GiftConfig(**(NVFP4 if wire == "nvfp4" else {"format": "fp32"}), ranks_per_node=2,
                             intra_node_format=fmt, reduce_op="sum")
            out[fmt, wire, "rs"] = C.reduce_scatter(x, group, cfg)
            out[fmt, wire, "ar"] = C.all_reduce(x[:13], group, cfg)
        for op, rows in (("reduce_scatter", world * 4), ("all_reduce", 13)):
            counters = torch.zeros(C.N_COUNTERS, dtype=torch.int64)
            item = ItemPlan(name="w", rows=rows, cols=64, **NVFP4)
            per = rows // world if op == "reduce_scatter" else rows
            segments = [C.Segment("w", per, 64, item, C.ItemTensors(())), C.Segment("b", 1, 8 if op == "all_reduce" else 1)]
            buf = torch.randn(rows * 64 + (8 if op == "all_reduce" else world), generator=torch.Generator().manual_seed(rank))
            plan = C.bucket_plan(segments, torch.float32, world=world, group_name=group.group_name, average=True,
                                 op=op, layout=node_layout(group, 2, fmt))
            C.sync_buffer(buf, segments, C.Shared(0, rank, counters), op=op, group=group, average=True,
                          ranks_per_node=2, intra_node_format=fmt)
            out[fmt, op, "counted"] = (int(counters[C.C_NODE_WIRE]), int(counters[C.C_WIRE] - counters[C.C_NODE_WIRE]))
            out[fmt, op, "accounted"] = C.bucket_hop_bytes(plan)
            out[fmt, op, "describe"] = plan.describe()
            out[fmt, op, "fingerprint"] = plan.fingerprint()
    out["graph"] = _graph(rank, world, 2, "bf16")
    out["ddp"], out["fsdp2"] = _frameworks_bf16(rank, world)
    return out


def _frameworks_bf16(rank: int, world: int) -> tuple[dict, dict]:
    """DDP's comm hook and FSDP2's reduce-scatter with bf16 inside the node (2 nodes x 2): DDP's
    gradients on every rank and its bytes per hop against the accounting; FSDP2's fp32 GIFT
    shards against the exact mean."""
    from torch.distributed.fsdp import fully_shard

    from gift_compile.exchange.collectives import bucket_hop_bytes
    from gift_compile.exchange.plan import BucketPlan, ItemPlan
    from gift_compile.exchange.topology import node_layout

    cfg = dict(ranks_per_node=2, intra_node_format="bf16", min_numel=1024, exclude=())
    model = MLP(64)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=100)
    gift_compile.apply(ddp, GiftConfig(**EXACT_OUTSIDE, **NVFP4, geometry="none", **cfg), fuse=False)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))
    ddp(x).pow(2).mean().backward()
    st = gift_compile.state(ddp)
    items = tuple(st.layers[n].plan if n in st.layers else ItemPlan.passthrough(n, p.numel(), p.dtype)
                  for n, p in reversed(list(model.named_parameters())))
    plan = BucketPlan(items, world, dist.group.WORLD.group_name, True, "all_reduce",
                      node_layout(dist.group.WORLD, 2, "bf16"))
    totals = st.comm_totals()
    ddp_out = {"grads": {n: p.grad.clone() for n, p in model.named_parameters()},
               "counted": (totals["node_wire"], totals["cross_wire"]), "accounted": bucket_hop_bytes(plan)}
    model, ref = MLP(64), MLP(64)
    for layer in (model.fc1, model.fc2, model.out):
        fully_shard(layer)
    fully_shard(model)
    gift_compile.apply(model, GiftConfig(**EXACT_OUTSIDE, format="fp32", select="none", **cfg), fuse=False)
    model(x).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    errs = {}
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    for n, p in ref.named_parameters():
        mean = p.grad.clone()
        dist.all_reduce(mean)
        mean /= world
        errs[n] = float((got[n] - mean).norm() / mean.norm())
    return ddp_out, {"errs": errs, "node_wire": gift_compile.state(model).comm_totals()["node_wire"]}


def test_bf16_inside_the_node_halves_its_bytes_within_bf16_error():
    """`GiftConfig.intra_node_format="bf16"` on 4 ranks as 2 nodes x 2 (the fast tier): the
    bytes handed inside the node (stage 1's reduce-scatter of an fp32 bucket, and an
    all-reduce's stage-3 all_gather) halve, counted at the collectives and equal to the
    accounting; the bytes across nodes do not change; fp32 GIFT differs from the native node
    stage (bf16 really travelled) by no more than bf16's rounding of the node's sum, NVFP4
    stays within its error, replicas of an all-reduce stay bit-identical, the plan says so
    (description, fingerprint), and the graph pass's rewrite, DDP's comm hook (bytes counted =
    accounted, replicas identical) and FSDP2's reduce-scatter (fp32 GIFT within bf16's rounding
    of the exact mean) run it at bf16 too."""
    from gift_compile.exchange.accounting import HEADER_BYTES

    ranks = run_ranks(_node_format, 4, timeout=300)
    for rank, c in enumerate(ranks):
        for op in ("reduce_scatter", "all_reduce"):
            (node16, cross16), (node32, cross32) = c["bf16", op, "counted"], c["native", op, "counted"]
            assert c["bf16", op, "counted"] == c["bf16", op, "accounted"], op
            assert c["native", op, "counted"] == c["native", op, "accounted"], op
            assert (node32 - HEADER_BYTES) == 2 * (node16 - HEADER_BYTES) and cross16 == cross32, (op, node16, node32)
            assert "bf16 inside the node" in c["bf16", op, "describe"], c["bf16", op, "describe"]
            assert c["bf16", op, "fingerprint"] != c["native", op, "fingerprint"]
        shard, size = c["exact"].reshape(4, -1, 64)[rank], c["magnitude"].reshape(4, -1, 64)[rank]
        for key, ref, mag in (("rs", shard, size), ("ar", c["exact"][:13], c["magnitude"][:13])):
            native, bf16 = c["native", "fp32", key], c["bf16", "fp32", key]
            assert not torch.equal(native, bf16), key  # bf16 really travelled
            assert float((native - ref).abs().max()) < 1e-5, key
            # each rank's gradient and the node's sum rounded to bf16 (2^-9 each), an all-reduce's
            # result once more: |err| <= 2^-7 * sum over ranks of |x|
            assert bool(((bf16 - ref).abs() <= mag * 2 ** -7).all()), key
            for fmt in ("native", "bf16"):
                err = float((c[fmt, "nvfp4", key] - ref).norm() / ref.norm())
                assert 0 < err < 0.2, (fmt, key, err)
            assert torch.equal(c["bf16", "nvfp4", "ar"], ranks[0]["bf16", "nvfp4", "ar"])  # replicas identical
        d = c["ddp"]
        assert d["counted"] == d["accounted"], (d["counted"], d["accounted"])
        assert all(torch.equal(g, ranks[0]["ddp"]["grads"][n]) for n, g in d["grads"].items())  # replicas identical
        f = c["fsdp2"]
        assert f["node_wire"] > 0 and 0 < max(f["errs"].values()) < 2 ** -7, f["errs"]  # fp32 GIFT: bf16's rounding only
        q = c["graph"]
        assert q["after"].get("_c10d_functional.reduce_scatter_tensor.default") == 1
        assert all(torch.equal(a.reshape(-1), b.reshape(-1)) for a, b in zip(q["got"], q["want"]))
        assert q["node_wire"] == q["accounted"][0]


def _experts(rank: int, world: int) -> dict:
    """Grouped experts on a group of 2 nodes x 2: mapped ones refused when their layers are
    built, map-free ones built."""
    from gift_compile.exchange.plan import Collective
    from gift_compile.runtime.experts import ExpertLayers
    from gift_compile.runtime.state import GiftState

    shapes = {"w1_EFD": (4, 16, 48), "w2_EDF": (4, 48, 16)}
    inputs = {"w1_EFD": "x", "w2_EDF": "h"}
    out = {}
    for geometry in ("lowrank", "none"):
        state = GiftState(GiftConfig(geometry=geometry, format="fp8_e4m3", select="all", rank=4, ranks_per_node=2),
                          dist.group.WORLD, collective=Collective.REDUCE_SCATTER)
        params = {n: nn.Parameter(torch.zeros(s)) for n, s in shapes.items()}
        try:
            experts = ExpertLayers(state, "layers.1.moe.experts", shapes, inputs, params, "cpu")
            out[geometry] = experts.weights["w1_EFD"].plan.groups
        except TopologyError as e:
            out[geometry] = str(e)
    return out


def test_mapped_grouped_experts_are_refused_under_two_levels_when_built():
    """Whitened (mapped) grouped experts on a group spanning nodes raise when `apply` builds
    their layers, naming the layout and the ways out, instead of failing in the first backward
    or falling back to one level; map-free grouped experts run in two levels (4 ranks as
    2 nodes x 2)."""
    for r in run_ranks(_experts, 4, timeout=300):
        assert "2 nodes x 2 ranks" in r["lowrank"] and "layers.1.moe.experts" in r["lowrank"], r["lowrank"]
        assert "ranks_per_node=0" in r["lowrank"] and "'lowrank'" in r["lowrank"]
        assert r["none"] == 4


def _reports(rank: int, world: int) -> dict:
    """The apply report's exchange lines on 4 ranks as 2 nodes x 2: a plain module (two levels
    at bf16 inside the node, and switched off), DDP, and an FSDP2 + HSDP replica hop on a 2 x 2
    mesh (the shard group inside a node, the replica group one rank per node)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gift_compile.api import manage
    from gift_compile.frameworks import fsdp2, hsdp
    from gift_compile.frameworks.exchanges import describe_exchanges

    out = {}
    for name, kw in (("plain", dict(ranks_per_node=2, intra_node_format="bf16")), ("off", dict(ranks_per_node=0))):
        model = MLP(64)
        gift_compile.apply(model, GiftConfig(**EXACT_OUTSIDE, format="fp8_e4m3", min_numel=1024, **kw), fuse=False)
        out[name] = gift_compile.report(model).exchanges
        out[name, "lines"] = gift_compile.report(model).lines()
    ddp = nn.parallel.DistributedDataParallel(MLP(64))
    gift_compile.apply(ddp, GiftConfig(**EXACT_OUTSIDE, format="fp8_e4m3", min_numel=1024, ranks_per_node=2), fuse=False)
    out["ddp"] = gift_compile.report(ddp).exchanges
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = MLP(64)
    for layer in (model.fc1, model.fc2, model.out):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = manage(model, GiftConfig(**EXACT_OUTSIDE, format="fp8_e4m3", geometry="lowrank", min_numel=1024, exclude=(), reduce_op="sum",
                                     ranks_per_node=2), mesh.get_group("shard"), mode="stats", split_rows=True)
    fsdp2.install(model, state, compiled=False)
    hsdp.install(model, state, mesh.get_group("replicate"), compiled=False)
    out["hsdp"] = describe_exchanges(state)
    return out


def test_the_apply_report_names_each_paths_exchange():
    """`gift_compile.report(model).exchanges` says, per gradient path, whether it runs in two
    levels and why not: a plain module's managed weights in two levels (bf16 inside the node)
    and its unmanaged parameters' native fp32 all-reduce in one; `ranks_per_node=0`; DDP's
    buckets; HSDP's shard hop inside one node and its replica hop, one rank per node."""
    r = run_ranks(_reports, 4, timeout=300)[0]
    managed, unmanaged = r["plain"]
    assert managed.startswith("managed weights: two levels, 2 nodes x 2 ranks (inside the node at bf16"), managed
    # a plain module's unmanaged parameters go on GIFT's exchange, in the same two levels
    assert unmanaged.startswith("unmanaged parameters: one bucket per backward at unmapped_format / tiny_format, "
                                "two levels, 2 nodes x 2 ranks (inside the node at bf16"), unmanaged
    assert any(line.startswith("  exchange of the managed weights: two levels") for line in r["plain", "lines"])
    assert r["off"][0] == "managed weights: one level over 4 ranks (ranks_per_node=0)", r["off"]
    assert r["ddp"] == ("managed weights and the parameters in their buckets: two levels, 2 nodes x 2 ranks (inside "
                        "the node at native, then GIFT's codec on the 1/2 chunk across nodes)",), r["ddp"]
    shard, replica = r["hsdp"]
    assert shard.endswith("one level over 2 ranks (all on one node at ranks_per_node=2)"), shard
    assert replica == ("HSDP replica hop at fp8_e4m3: GIFT's all-reduce, one level over 2 ranks (one rank per node: "
                       "nothing to split)"), replica


def _resume(rank: int, world: int) -> dict:
    """A state's checkpoint on 2 nodes x 2 loaded under other node layouts, with and without
    error-feedback residuals."""
    from gift_compile.runtime.state import GiftState

    def state(rpn: int, error_feedback: bool) -> GiftState:
        st = GiftState(GiftConfig(format="fp8_e4m3", geometry="lowrank", rank=4, ranks_per_node=rpn,
                                  error_feedback=error_feedback), dist.group.WORLD, collective="reduce_scatter")
        st.add_layer("a.weight", (16, 48), "cpu")
        return st

    out = {}
    for ef in (True, False):
        saved = state(2, ef).state_dict()
        out[ef, "meta"] = saved["meta"]
        for rpn in (2, 0, 4):
            try:
                state(rpn, ef).load_state_dict(saved)
                out[ef, rpn] = "loaded"
            except ValueError as e:
                out[ef, rpn] = str(e)
    return out


def test_checkpoints_record_the_node_layout_and_refuse_its_residuals_elsewhere():
    """A GIFT state's checkpoint records its node layout; resumed under another layout it is
    refused by name when it holds first-hop error-feedback residuals (the node chunk's rows of
    the old layout) and loads when it holds none (nothing else depends on the layout). 4 ranks:
    saved as 2 nodes x 2, loaded as 2 x 2, one level (ranks_per_node=0) and one node (4)."""
    import json

    for r in run_ranks(_resume, 4, timeout=300):
        assert json.loads(r[True, "meta"])["node_layout"] == {"ranks_per_node": 2, "nodes": 2}
        assert r[True, 2] == "loaded" and r[False, 2] == "loaded"
        for rpn in (0, 4):
            msg = r[True, rpn]
            assert "saved on two levels, 2 nodes x 2 ranks" in msg and "the one-level exchange" in msg, msg
            assert "a.weight" in msg and "ranks_per_node=2" in msg, msg
            assert r[False, rpn] == "loaded", r[False, rpn]


def test_the_committed_hop_byte_table_is_what_its_measurement_renders():
    """bench/results/cluster/hop_bytes.md is `bench.cluster.hop_bytes.table` of the committed hop_bytes.json
    (regenerated, never typed); in it, on 8 ranks as 2 nodes x 4 and 4 nodes x 2, every eager
    row's counted bytes per hop equal the accounting, two levels cut a reduce-scatter's bytes
    across nodes to exactly 1/g of flat's while bf16 inside the node halves the bytes inside it;
    and each torchtitan launch that ran logged node + cross = accounted at every step, its
    two-level runs at 1/g of the flat run's cross-node bytes."""
    import json

    from bench.cluster import hop_bytes

    d = json.loads(hop_bytes.OUT.read_text())
    assert hop_bytes.TABLE.read_text() == hop_bytes.table(d)
    assert set(d["eager"]["layouts"]) == set(hop_bytes.LAYOUTS)
    for name, layout in d["eager"]["layouts"].items():
        g = layout["ranks_per_node"]
        assert g == hop_bytes.LAYOUTS[name] and list(layout["arms"]) == list(hop_bytes.ARMS)
        for arm, rows in layout["arms"].items():
            for path, r in rows.items():
                assert [r["node"], r["cross"]] == r["accounted"], (name, arm, path)
        flat, two, bf16 = (layout["arms"][a] for a in hop_bytes.ARMS)
        for path in ("one bucket, reduce_scatter (sync_buffer)", "FSDP2"):
            assert two[path]["cross"] * g == flat[path]["cross"] and bf16[path]["cross"] == two[path]["cross"], path
            assert flat[path]["node"] == 0 and two[path]["node"] > 0, path
        one = "one bucket, reduce_scatter (sync_buffer)"
        assert (two[one]["node"] - 16) == 2 * (bf16[one]["node"] - 16)  # less the 16-byte header all_gather
    runs = d["torchtitan"]["runs"]
    assert runs, "no torchtitan launch recorded"
    flat_cross = {r["trainer"]: r["steps"][-1]["cross"] for r in runs if r["arm"] == "flat" and r["steps"]}
    for r in runs:
        assert r["returncode"] == 0 and len(r["steps"]) == d["torchtitan"]["steps"], (r["command"], r.get("error"))
        assert r["command"].startswith("python -m torch.distributed.run") and "--nproc-per-node=8" in r["command"]
        assert f"--gift.ranks-per-node={r['ranks_per_node']}" in r["command"]
        for s in r["steps"]:
            assert s["node"] + s["cross"] == s["wire"] == s["accounted"], (r["trainer"], r["layout"], s)
        g = r["ranks_per_node"]
        if g and r["trainer"] in flat_cross:
            assert r["steps"][-1]["node"] > 0
            assert abs(r["steps"][-1]["cross"] * g / flat_cross[r["trainer"]] - 1) < 0.01, (r["trainer"], g)
    native = {(r["trainer"], r["layout"]): r["steps"][-1] for r in runs if r["arm"] == "two levels"}
    for r in runs:  # bf16 inside the node: about half the node's bytes, the same across nodes
        if r["arm"] == "two levels, bf16 in node" and (r["trainer"], r["layout"]) in native:
            two, last = native[r["trainer"], r["layout"]], r["steps"][-1]
            assert last["cross"] == two["cross"] and abs(2 * last["node"] / two["node"] - 1) < 0.01, r["command"]


def _traced(rank: int, world: int) -> dict:
    """`bucket_core` of a two-level plan with bf16 inside the node under
    `torch.compile(fullgraph=True)`: the frames compiled over three calls with new data and
    seeds, and the results against the eager core."""
    from torch._dynamo.testing import CompileCounter

    from gift_compile.exchange import collectives as C
    from gift_compile.exchange.plan import BucketPlan, ItemPlan
    from gift_compile.exchange.topology import node_layout

    group = dist.group.WORLD.group_name
    items = (ItemPlan(name="w", rows=32, cols=64, format="fp8_e4m3"), ItemPlan.passthrough("b", 8, torch.float32))
    out = {}
    for op in ("reduce_scatter", "all_reduce"):
        plan = BucketPlan(items, world, group, True, op, node_layout(group, 2, "bf16"))
        counter = CompileCounter()
        counters = torch.zeros(C.N_COUNTERS, dtype=torch.int64)

        def core(xs: list[torch.Tensor], seed: torch.Tensor) -> list[torch.Tensor]:
            return C.bucket_core(xs, [C.ItemTensors(()), None], C.Shared(seed, torch.tensor(rank), counters), plan)[0]

        compiled = torch.compile(core, fullgraph=True, backend=counter)
        equal = True
        for step in range(3):
            gen = torch.Generator().manual_seed(100 * step + rank)
            xs = [torch.randn(32, 64, generator=gen), torch.randn(8, generator=gen)]
            got = compiled(xs, torch.tensor(step))
            want = core(xs, torch.tensor(step))
            equal = equal and all(torch.equal(a, b) for a, b in zip(got, want))
        out[op] = {"frames": counter.frame_count, "equal": equal, "node_wire": int(counters[C.C_NODE_WIRE])}
    return out


def test_two_level_bucket_at_bf16_traces_fullgraph_once():
    """The two-level bucket with bf16 inside the node traces under `torch.compile(fullgraph=True)`
    into one frame that three calls with new data and seeds reuse (no recompile), with the eager
    core's results (4 ranks as 2 nodes x 2; Dynamo only, no Inductor)."""
    for r in run_ranks(_traced, 4, timeout=600):
        for op, v in r.items():
            assert v["frames"] == 1 and v["equal"] and v["node_wire"] > 0, (op, v)


def _refresh_levels(rank: int, world: int, g: int, local_world: str) -> dict:
    """A lowrank refresh (statistics reduced onto owners, maps broadcast) over 4 ranks as 2 nodes
    x 2 (`g=2`) or flat (`g=0`) under the launcher's `LOCAL_WORLD_SIZE=local_world` ("" unset),
    counted; and the host collectives' results in two levels."""
    import os

    from gift_compile import sync

    if local_world:
        os.environ["LOCAL_WORLD_SIZE"] = local_world
    else:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    model = MLP(64)
    gift_compile.apply(model, GiftConfig(**EXACT_OUTSIDE, format="fp8_e4m3", geometry="lowrank", rank=4, min_numel=1024,
                                         select="all", exclude=(), ranks_per_node=g), fuse=False)
    st = gift_compile.state(model)
    model(torch.randn(32, 64, generator=torch.Generator().manual_seed(rank))).pow(2).mean().backward()
    st.refresh()
    out = {"totals": st.comm_totals(), "maps": [t.clone() for layer in st.layers.values() for t in layer.tensors()[0]]}
    t, b, r = torch.full((100,), float(rank + 1)), torch.full((10,), float(rank)), torch.full((10,), float(rank + 1))
    sync.all_reduce_(t, dist.group.WORLD)
    sync.broadcast_(b, dist.group.WORLD, src=3)
    sync.reduce_(r, dist.group.WORLD, dst=2)
    out.update(all_reduce=t, broadcast=b, reduce=r if rank == 2 else None)
    return out


@pytest.mark.parametrize("g, local_world", [(2, ""), (0, "2"), (0, "")])
def test_the_refresh_runs_in_two_levels_and_is_counted_apart(g: int, local_world: str) -> None:
    runs = run_ranks(_refresh_levels, 4, g, local_world)
    for r in runs:
        assert torch.equal(r["all_reduce"], torch.full((100,), 10.0)) and torch.equal(r["broadcast"], torch.full((10,), 3.0))
        assert all(torch.equal(a, b) for a, b in zip(r["maps"], runs[0]["maps"]))  # one map on every rank
    assert torch.equal(runs[2]["reduce"], torch.full((10,), 10.0))
    wire = sum(r["totals"]["refresh_wire"] for r in runs)
    cross = sum(r["totals"]["refresh_cross_wire"] for r in runs)
    assert wire > 0, runs[0]["totals"]
    if g == 0 and local_world:  # one level over 2 nodes (the launcher's): every byte crosses them
        assert cross == wire
    elif g == 0:  # one level, no node layout known: one node, nothing crosses a network (as the gradients')
        assert cross == 0 and all(r["totals"]["cross_wire"] == 0 for r in runs), runs[0]["totals"]
    else:  # the statistics and maps cross between nodes once per node (the ranks of one local index)
        assert 0 < cross < wire / 2, (cross, wire)
    # the gradients' bytes are apart
    assert all(r["totals"]["wire"] > 0 for r in runs)
