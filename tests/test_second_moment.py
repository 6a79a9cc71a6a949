"""geometry="second_moment": the column scaling from AdamW's second moment under `apply`, on a
plain module (GIFT's all-reduce) and on FSDP2 (each rank holds a row shard of the state)."""

from __future__ import annotations

import torch

import gift_compile
from gift_compile.config import GiftConfig
from mlp import MLP as _MLP
from multirank import run_ranks

# select="all": every managed layer takes the scaled path, so the test sees the map at work
CFG = dict(format="nvfp4", min_numel=1024, refresh_every=1, select="all", exclude=())
# input columns of very different sizes, so the second moment's columns differ
COLUMNS = torch.logspace(-1.5, 1.5, 64)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + rank)) * COLUMNS


def _expected_scales(v: torch.Tensor) -> torch.Tensor:
    """`s = (c / mean(c))^{-1/2}`, `c` the column sums of `exp_avg_sq` (all positive here)."""
    c = v.double().sum(0)
    return (c / c.mean()).rsqrt().float()


def _plain_body(rank: int, world: int, geometry: str) -> dict:
    model = _MLP(64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gift_compile.apply(model, GiftConfig(**CFG, geometry=geometry), optimizer=opt)
    st = gift_compile.state(model)
    grads = []
    for step in range(3):
        model(_batch(step, rank)).pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()  # the post-step hook refreshes: the map from this step's exp_avg_sq
        opt.zero_grad()
    out: dict = {"grads": grads, "maps": {}, "expected": {}}
    for name, layer in st.layers.items():
        out["maps"][name] = [t.clone() for t in layer.transform.tensors]
        if geometry == "second_moment":
            out["expected"][name] = _expected_scales(opt.state[st.modules[name].weight]["exp_avg_sq"])
    out["selected"] = sorted(n for n, l in st.layers.items() if l.selected)
    return out


def test_second_moment_under_apply_on_a_plain_module():
    sm = run_ranks(_plain_body, 2, "second_moment")
    eu = run_ranks(_plain_body, 2, "none")
    a, b = sm
    assert a["selected"] == ["fc1.weight", "fc2.weight"]
    for name in a["maps"]:
        # the map is the formula on this rank's optimizer state, and the same bits on both ranks
        assert torch.allclose(a["maps"][name][0], a["expected"][name], rtol=1e-5), name
        assert torch.equal(a["maps"][name][0], b["maps"][name][0]) and torch.equal(a["maps"][name][1], b["maps"][name][1])
        assert float(a["maps"][name][0].max() / a["maps"][name][0].min()) > 2.0, name  # not ~identity
    for step in range(3):
        for n in a["grads"][step]:
            assert torch.equal(a["grads"][step][n], b["grads"][step][n]), (step, n)  # replicas decode the same bits
    # identity until the first refresh: step 0's gradients are Euclidean's bits
    for n in a["grads"][0]:
        assert torch.equal(a["grads"][0][n], eu[0]["grads"][0][n]), n
    # after it, the managed gradients were quantized in the scaled coordinates: their error differs
    exact = _exact(2, eu, sm)
    for n in ("fc1.weight", "fc2.weight"):
        e_sm = float((a["grads"][1][n] - exact[n]).norm() / exact[n].norm())
        e_eu = float((eu[0]["grads"][1][n] - exact[n]).norm() / exact[n].norm())
        assert 0 < e_sm < 0.3 and 0 < e_eu < 0.3 and abs(e_sm - e_eu) > 1e-3 * e_eu, (n, e_sm, e_eu)


def _exact(world: int, eu: list[dict], sm: list[dict]) -> dict[str, torch.Tensor]:
    """Step 1's exact averaged gradient at the weights both arms hold after step 0 (their step 0
    gradients were identical, hence so are their weights): recomputed in fp32 from one replica."""
    model = _MLP(64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for n, p in model.named_parameters():
        p.grad = eu[0]["grads"][0][n].clone()
    opt.step()
    opt.zero_grad()
    for rank in range(world):
        model(_batch(1, rank)).pow(2).mean().backward()
    return {n: p.grad / world for n, p in model.named_parameters()}


def _fsdp2_body(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = _MLP(64)
    for layer in (model.fc1, model.fc2, model.out):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gift_compile.apply(model, GiftConfig(**CFG, geometry="second_moment"), optimizer=opt, fuse=False)
    for step in range(2):
        model(_batch(step, rank)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    st, out = gift_compile.state(model), {}
    for name, layer in st.layers.items():
        v = opt.state[st.modules[name].weight]["exp_avg_sq"]
        out[name] = ([t.clone() for t in layer.transform.tensors], _expected_scales(v.full_tensor()),
                     tuple(v.to_local().shape))
    return out


def test_second_moment_on_fsdp2_every_rank_builds_the_same_map_from_its_row_shard():
    a, b = run_ranks(_fsdp2_body, 2)
    assert sorted(a) == ["fc1.weight", "fc2.weight"]
    for name in a:
        (sa, ia), expected, shard = a[name]
        (sb, ib), _, _ = b[name]
        full_rows = {"fc1.weight": 128, "fc2.weight": 64}[name]
        assert shard[0] < full_rows  # the rank held only a row shard of exp_avg_sq
        assert torch.allclose(sa, expected, rtol=1e-5), name  # = the formula on the full state
        assert torch.equal(sa, sb) and torch.equal(ia, ib), name
        assert float(sa.max() / sa.min()) > 2.0, name


def test_second_moment_map_traces_fullgraph_and_a_refresh_does_not_recompile():
    from gift_compile.exchange.collectives import ItemTensors, Shared, bucket_core
    from gift_compile.geometry.table import SecondMoment
    from gift_compile.exchange.plan import BucketPlan, ItemPlan

    geo = SecondMoment(64)
    item = ItemPlan(name="w", rows=32, cols=64, format="nvfp4", kind=geo.kind, n_tensors=len(geo.tensors))
    plan = BucketPlan((item,), 1, None, False, "all_reduce")

    def core(g: torch.Tensor) -> torch.Tensor:
        return bucket_core([g], [ItemTensors(geo.tensors)], Shared(), plan)[0][0]

    compiled = torch.compile(core, fullgraph=True, dynamic=False)
    g = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)) * COLUMNS
    before = compiled(g)
    assert torch.equal(before, core(g))
    geo.refresh_from(COLUMNS.square(), 0.0)  # in place: same tensors, new values
    with torch.compiler.set_stance("fail_on_recompile"):
        after = compiled(g)
    assert torch.equal(after, core(g)) and not torch.equal(after, before)
