"""Graph-level tests of the GIFT pass on 2 gloo ranks: what the rewrite does to the backward
graph, what Inductor makes of it, and that compiled training is the eager algorithm."""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import gift_compile
from multirank import run_ranks
from mlp import EXACT_OUTSIDE

_c10d = torch.ops._c10d_functional


class _TensorParallelCopy(torch.autograd.Function):
    """Megatron-style f-op: identity forward, all-reduce of the activation gradient backward —
    an unrelated collective in the same backward graph as the managed gradients, which the
    pass must leave alone."""

    @staticmethod
    def forward(ctx, x, group_name):
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _c10d.wait_tensor(_c10d.all_reduce(g, "sum", ctx.group_name)) / 2, None


class Net(nn.Module):
    def __init__(self, group_name: str):
        super().__init__()
        self.group_name = group_name
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64, bias=False)
        self.head = nn.Linear(64, 8)  # 520 elements: below min_numel, stays on the plain path

    def forward(self, x):
        # relu, not gelu: Inductor's fused GELU differs from ATen's in the last ulp, which
        # would make compiled and eager gradients differ before GIFT ever touches them
        h = torch.relu(self.up(x))
        h = self.down(_TensorParallelCopy.apply(h, self.group_name))
        return self.head(h)


# the parameters outside the layers go raw (`EXACT_OUTSIDE`): the tests read them as exact
CFG = dict(format="fp8_e4m3", geometry="lowrank", rank=8, refresh_every=3, min_numel=1024, exclude=(), **EXACT_OUTSIDE)


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 + 10 * step + rank)
    return torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)


def _make(select: str = "all", **overrides):
    torch.manual_seed(0)
    net = Net(dist.group.WORLD.group_name)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    gift_compile.apply(net, gift_compile.GiftConfig(select=select, **{**CFG, **overrides}), optimizer=opt)
    return net, opt


def _step(model, net, opt, step, rank):
    x, y = _batch(step, rank)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    opt.step()
    opt.zero_grad()
    return float(loss), grads


def _pass_body(rank: int, world: int) -> dict:
    from torch._inductor.utils import run_and_get_code

    from gift_compile.passes import last_reports

    # the pass must really run here: no graph served from the on-disk caches
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    eager_net, eager_opt = _make()
    net, opt = _make()
    compiled = torch.compile(net, fullgraph=True, dynamic=False)
    out = {"diff": [], "params": None}
    (_, grads), codes = run_and_get_code(_step, compiled, net, opt, 0, rank)
    _, eager_grads = _step(eager_net, eager_net, eager_opt, 0, rank)
    out["code"] = codes
    out["reports"] = [(r.ops_before, r.ops_after, [(x.layers, x.op, x.wire_bytes, x.baseline_bytes) for x in r.rewritten])
                      for r in last_reports()]
    torch.manual_seed(0)
    exact_net = Net(dist.group.WORLD.group_name)
    x, y = _batch(0, rank)
    ((exact_net(x) - y) ** 2).mean().backward()
    out["quant_err"] = {}
    for n, p in exact_net.named_parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
        out["quant_err"][n] = float((grads[n] - p.grad).norm() / p.grad.norm())
    torch._dynamo.config.error_on_recompile = True
    try:
        for step in range(1, 7):  # crosses refreshes at steps 3 and 6
            _, grads_c = _step(compiled, net, opt, step, rank)
            _, grads_e = _step(eager_net, eager_net, eager_opt, step, rank)
            out["diff"].append(max(float((grads_c[n] - grads_e[n]).norm() / grads_e[n].norm()) for n in grads_e))
    finally:
        torch._dynamo.config.error_on_recompile = False
    out["params"] = [p.detach().clone() for p in net.parameters()]
    out["eager_params"] = [p.detach().clone() for p in eager_net.parameters()]
    st = gift_compile.state(net)
    out["selected"] = {n: l.selected for n, l in st.layers.items()}
    out["refreshes"] = len(st.history)
    out["grads0"] = grads
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_pass_body, 2)


def test_rewrite_op_counts(ranks):
    reports = [r for r in ranks[0]["reports"] if r[2]]
    assert len(reports) == 1, "exactly one backward graph holds the managed collectives"
    before, after, rewritten = reports[0]
    assert sorted(name for layers, *_ in rewritten for name in layers) == ["down.weight", "up.weight"]
    assert before["gift.mark.default"] == 2 and "gift.mark.default" not in after
    # before: 2 gradient all-reduces + the tensor-parallel all-reduce of an activation gradient
    assert before["_c10d_functional.all_reduce.default"] == 3
    # after: per managed layer one all_to_all (codes + scales + header) and one all_gather
    # (the re-encoded shard); the tensor-parallel all-reduce is the only all_reduce left
    assert after["_c10d_functional.all_reduce.default"] == 1
    assert after["_c10d_functional.all_to_all_single.default"] == 2
    assert after["_c10d_functional.all_gather_into_tensor.default"] == 2
    for _, _, wire, fp32 in rewritten:
        assert wire < fp32 / 2.5  # fp8 codes + row scales + headers vs fp32


def test_unmanaged_collective_in_a_rewritten_graph_is_untouched(ranks):
    # the TP all-reduce sits in the backward graph the pass rewrote; it must still reduce the
    # activation gradient (a sum over ranks of fp32), which the exact reference checks below
    code = _backward_code(ranks[0]["code"])
    assert code.count("torch.ops._c10d_functional.all_reduce_.default(") == 1
    fwd = [r for r in ranks[0]["reports"] if not r[2]]
    assert fwd and all(r[0] == r[1] for r in fwd), "graphs without managed gradients must not change"
    # up.bias's gradient flows through the TP all-reduce: exact (up to fp32 rounding)
    assert ranks[0]["quant_err"]["up.bias"] < 1e-5


def _backward_code(codes: list[str]) -> str:
    (bwd,) = [c for c in codes if "all_to_all_single" in c]
    return bwd


def test_inductor_fuses_transform_and_quantize(ranks):
    code = _backward_code(ranks[0]["code"])
    kernels = dict(re.findall(r"(cpp_fused_\w+) = async_compile\.cpp_pybinding\((\[[^\]]*\])", code))
    # encode: reads fp32 (the gradient after the diagonal scaling and the rank-r correction,
    # i.e. the transform's elementwise tail), reduces the row amax and stores the codes
    # (uint8, bitcast from E4M3 in the kernel) and the scales, in ONE kernel per layer
    encode = [k for k, sig in kernels.items()
              if "'uint8_t*'" in sig and "const uint8_t*" not in sig and "amax" in k and "sum" not in k]
    # decode of every sender + fp32 sum + re-encode of the shard, in ONE kernel per layer
    decode_sum = [k for k, sig in kernels.items() if "const uint8_t*" in sig and "'uint8_t*'" in sig
                  and "sum" in k and "amax" in k]
    assert len(encode) == 2 and len(decode_sum) == 2, sorted(kernels.items())
    for k in encode:
        assert "add" in k and "clamp" in k, k
    for k in decode_sum:
        assert "sum" in k and "amax" in k, k
    # the whole backward, both managed layers included, stays a few small kernels per layer
    assert len(kernels) <= 30, sorted(kernels)
    call = code[code.index("def call"):]
    for k in encode:  # each encode kernel runs before an all_to_all that follows it
        pos = call.index(k + "(")
        assert call.index("all_to_all_single.default", pos) > pos


def test_compiled_matches_eager_algorithm(ranks):
    for r in ranks:
        assert max(r["diff"]) < 1e-6, r["diff"]
        for a, b in zip(r["params"], r["eager_params"]):
            assert float((a - b).norm() / b.norm()) < 1e-6


def test_quantization_really_happened(ranks):
    err = ranks[0]["quant_err"]
    for name in ("up.weight", "down.weight"):  # fp8 e4m3, two stages: ~3.7%
        assert 0.02 < err[name] < 0.06, err
    for name in ("up.bias", "head.weight", "head.bias"):  # plain fp32 path
        assert err[name] < 1e-5, err


def test_ranks_end_identical_and_refresh_ran(ranks):
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
    assert ranks[0]["refreshes"] == 2
    assert all(ranks[0]["selected"].values())


def _nvfp4_body(rank: int, world: int) -> list[float]:
    """NVFP4 through the pass: E2M1 nibble packing, E4M3 block scales and the tensor scale
    all trace into the rewritten graph, and compiled steps equal eager ones."""
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    eager_net, eager_opt = _make(format="nvfp4")
    net, opt = _make(format="nvfp4")
    compiled = torch.compile(net, fullgraph=True, dynamic=False)
    diffs = []
    for step in range(4):  # crosses the refresh at step 3
        _, grads_c = _step(compiled, net, opt, step, rank)
        _, grads_e = _step(eager_net, eager_net, eager_opt, step, rank)
        diffs.append(max(float((grads_c[n] - grads_e[n]).norm() / grads_e[n].norm()) for n in grads_e))
    return diffs


def test_nvfp4_compiled_matches_eager():
    for diffs in run_ranks(_nvfp4_body, 2):
        assert max(diffs) < 1e-6, diffs


def bucketed_step(a, b, ta: list, tb: list, world: int, group: str):
    """What Inductor's bucketing leaves of two marked layers' and a norm's reduce-scatters: one
    `_pre_bucket_reduce_scatter` -> reduce_scatter_tensor -> wait -> split, over the two layers'
    mark tensors `ta`, `tb` (traced with `make_fx`; tests/test_two_level.py traces it too)."""

    def step(ga, gb, norm, *state):
        sa, sb = list(state[:len(ta)]), list(state[len(ta):])
        ma = torch.ops.gift.mark(ga, sa, a.plan_str)
        mb = torch.ops.gift.mark(gb, sb, b.plan_str)
        flat = torch.ops.bucketing._pre_bucket_reduce_scatter([ma, mb, norm], world)
        out = torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.reduce_scatter_tensor(flat, "sum", world, group))
        return out.split([ga.numel() // world, gb.numel() // world, norm.numel() // world])

    return step


def _bucket_graph_body(rank: int, world: int) -> dict:
    """A bucketed reduce-scatter as Inductor's bucketing pass (torchtitan's default GPU pass
    list) emits it — `_pre_bucket_reduce_scatter([marked, marked, plain])` -> one
    reduce_scatter_tensor -> wait -> split — rewritten into ONE GIFT all_to_all, and its
    result equal to the eager bucket core on the same inputs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import torch._inductor.fx_passes.bucketing  # noqa: F401  (registers the bucketing ops)
    from gift_compile.exchange import collectives as C
    from gift_compile.passes import count_ops, rewrite_gradient_collectives
    from gift_compile.exchange.plan import BucketPlan, ItemPlan
    from gift_compile.runtime.state import GiftState

    st = GiftState(gift_compile.GiftConfig(format="fp8_e4m3", geometry="lowrank", rank=4, select="all", refresh_every=1),
                   dist.group.WORLD, collective="reduce_scatter")
    a, b = st.add_layer("a.weight", (8, 48), "cpu"), st.add_layer("b.weight", (16, 32), "cpu")
    gen = torch.Generator().manual_seed(0)
    for layer in (a, b):
        layer.stats.observe(torch.randn(256, layer.shape[1], generator=gen) * torch.logspace(0, -2, layer.shape[1]))
    st.refresh()  # real transforms on both ranks
    group = dist.group.WORLD.group_name
    ta, tb = a.mark_tensors(st.shared), b.mark_tensors(st.shared)

    step = bucketed_step(a, b, ta, tb, world, group)

    g = torch.Generator().manual_seed(10 + rank)
    xs = [torch.randn(8, 48, generator=g), torch.randn(16, 32, generator=g), torch.randn(6, generator=g)]
    gm = make_fx(step, tracing_mode="fake")(*xs, *ta, *tb)
    before = count_ops(gm.graph)
    report = rewrite_gradient_collectives(gm)
    after = count_ops(gm.graph)
    got = [t.clone() for t in gm(*xs, *ta, *tb)]
    items = (a.plan, b.plan, ItemPlan.passthrough("norm", 6, torch.float32))
    plan = BucketPlan(items, world, group, False, "reduce_scatter")
    want, _ = C.run_bucket(xs, [a.tensors(), b.tensors(), None], st.shared, plan)
    exact = [x.clone() for x in xs]
    for e in exact:
        dist.all_reduce(e)
    return {"before": before, "after": after, "layers": report.layers, "got": got, "want": want, "exact": exact,
            "rank": rank}


def test_bucketed_reduce_scatter_becomes_one_gift_all_to_all():
    for r in run_ranks(_bucket_graph_body, 2):
        assert r["before"]["_c10d_functional.reduce_scatter_tensor.default"] == 1
        assert r["before"]["bucketing._pre_bucket_reduce_scatter.default"] == 1
        assert r["after"] == {"_c10d_functional.all_to_all_single.default": 1,
                              "_c10d_functional.wait_tensor.default": 1, **{k: v for k, v in r["after"].items()
                                                                          if k.startswith("aten.")}}, r["after"]
        assert r["layers"] == ["a.weight", "b.weight"]
        rank = r["rank"]
        for got, want, exact, rows in zip(r["got"], r["want"], r["exact"], (4, 8, None)):
            assert torch.equal(got.reshape(want.shape), want)  # the graph computes the eager core's bits
            ref = exact.reshape(2, -1)[rank] if rows is None else exact[rank * rows:(rank + 1) * rows].reshape(-1)
            err = float((got.reshape(-1) - ref.reshape(-1)).norm() / ref.norm())
            assert (err < 1e-6) if rows is None else (0.003 < err < 0.1), err  # norm exact, weights quantized


def _untouched_body(rank: int, world: int) -> dict:
    """A marked reduce-scatter next to an unmarked one (an embedding's gradient, no managed
    weight): the pass rewrites the first and reports the second's bytes as untouched."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from gift_compile.passes import rewrite_gradient_collectives
    from gift_compile.runtime.state import GiftState

    st = GiftState(gift_compile.GiftConfig(format="nvfp4", geometry="none", select="all"), dist.group.WORLD,
                   collective="reduce_scatter")
    a = st.add_layer("a.weight", (16, 64), "cpu")
    ta, group = a.mark_tensors(st.shared), dist.group.WORLD.group_name

    def step(ga, gembed, *state):
        rs = torch.ops._c10d_functional.reduce_scatter_tensor
        out_a = torch.ops._c10d_functional.wait_tensor(rs(torch.ops.gift.mark(ga, list(state), a.plan_str),
                                                          "sum", world, group))
        return out_a, torch.ops._c10d_functional.wait_tensor(rs(gembed, "sum", world, group))

    gm = make_fx(step, tracing_mode="fake")(torch.randn(16, 64), torch.randn(10, 8), *ta)
    report = rewrite_gradient_collectives(gm)
    return {"layers": report.layers, "untouched": report.untouched_bytes, "wire": report.wire_bytes,
            "baseline": report.baseline_bytes}


def test_the_pass_reports_the_bytes_of_the_gradient_collectives_it_left_alone():
    """graph_trainer's compression used to leave out the buckets without a managed weight
    (embedding, head); the pass now reports their bytes, which telemetry adds to both sides."""
    for r in run_ranks(_untouched_body, 2):
        assert r["layers"] == ["a.weight"] and r["baseline"] == 16 * 64 * 4 > 4 * r["wire"], r
        assert r["untouched"] == 10 * 8 * 4, r  # the fp32 embedding gradient each rank hands over
