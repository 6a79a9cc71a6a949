"""Layer statistics: the sketch (`SketchStatistics`) against the exact factor it replaces."""

import math

import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from gift_compile.config import GiftConfig
from gift_compile.exchange.collectives import all_reduce
from gift_compile.geometry import Transform, lowrank_tensors
from gift_compile.geometry.statistics import KFACStatistics, SketchStatistics, sketch_matrix
from tests.multirank import run_ranks

D, R, SPIKES = 256, 16, 8


def spiked_factor(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`A = U diag(1e4 .. 1e2) U^T + diag(0.5 .. 1.5)` (fp64) and its spike basis `U`."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(D, SPIKES, generator=g, dtype=torch.float64))[0]
    a = (u * torch.logspace(4, 2, SPIKES, dtype=torch.float64)) @ u.t()
    return a + torch.diag(torch.rand(D, generator=g, dtype=torch.float64) + 0.5), u


def tokens_of(a: torch.Tensor) -> torch.Tensor:
    """`d` rows whose second moment `x^T x / d` is exactly `a` (`sqrt(d) a^{1/2}`)."""
    lam, v = torch.linalg.eigh(a)
    return ((v * lam.clamp(min=0).sqrt()) @ v.t() * math.sqrt(a.shape[0])).float()


def tokens(n: int, d: int = D, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * torch.logspace(0.5, -1, d) * scale


def whitened_error(g: torch.Tensor, e: torch.Tensor, a: torch.Tensor) -> float:
    """`||E A^{-1/2}|| / ||G A^{-1/2}||`: the error in the metric the optimizer sees."""
    lam, v = torch.linalg.eigh(a)
    w = v * lam.rsqrt()
    return float((e.double() @ w).norm() / (g.double() @ w).norm())


def test_sketch_whitening_reproduces_the_exact_lowrank_whitening():
    a, u = spiked_factor()
    stats = SketchStatistics(D, rank=R, ema=0.9, max_tokens=D)
    assert stats.cols == 2 * R
    stats.observe(tokens_of(a))
    assert stats.consolidate(None)
    exact, sketch = Transform("lowrank", D, rank=R), Transform("lowrank", D, rank=R)
    exact.refresh_from(a, 1e-3)
    sketch.refresh_from_stats(stats, 1e-3)
    # on the spike subspace (what the rank-r part must capture), T A T^T ~ I. A single-pass
    # sketch of 2r columns underestimates the weakest spike (1e2, against a diagonal tail of
    # trace ~256 that leaks into every column) by up to ~25%; the exact path is within 10%.
    for name, t, top in (("exact", exact, 1.1), ("sketch", sketch, 1.35)):
        tt = t.forward(torch.eye(D)).double()  # T^T
        metric = tt.t() @ a @ tt
        q = torch.linalg.qr(tt.t() @ u)[0]
        ev = torch.linalg.eigvalsh(q.t() @ metric @ q)
        assert 0.9 < float(ev[0]) and float(ev[-1]) < top, (name, ev)
        ev_all = torch.linalg.eigvalsh(metric)
        assert float(ev_all[-1] / ev_all[0]) < 10, name  # A's own condition number is ~2e4
    # the whitened error of an fp8 round trip matches the exact transform's, and beats Euclidean
    g = torch.randn(64, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grad = (g @ torch.linalg.cholesky(a).t()).float()  # rows with the inputs' geometry
    cfg = GiftConfig(format="fp8_e4m3", scaling="row", select="all")
    errs = {n: whitened_error(grad, all_reduce(grad, None, cfg, t) - grad, a)
            for n, t in (("exact", exact), ("sketch", sketch), ("euclid", Transform("identity", D)))}
    assert abs(errs["sketch"] / errs["exact"] - 1) < 0.05, errs
    assert errs["sketch"] < 0.5 * errs["euclid"], errs


def test_full_width_sketch_is_exact():
    """With as many columns as `d_in`, Nystrom is exact: the tensors equal those of the
    exact top eigenpairs (`eigh`) under the same residual and damping rule."""
    a = spiked_factor()[0][:96, :96]
    stats = SketchStatistics(96, sketch_cols=96, ema=0.5, max_tokens=96)
    stats.observe(tokens_of(a))
    stats.consolidate(None)
    lam, u = torch.linalg.eigh(a)
    exact = lowrank_tensors(torch.diagonal(a), u[:, -R:], lam[-R:], 1e-3)
    sketch = stats.whitening(R, 1e-3)
    for i in (0, 2, 3, 4):  # V is defined up to signs
        assert torch.allclose(sketch[i], exact[i], rtol=2e-3, atol=1e-6), i
    assert torch.allclose(sketch[1].abs(), exact[1].abs(), atol=2e-3)


def test_window_average_subsampling_and_ema():
    x1, x2 = tokens(512, seed=1), tokens(512, seed=2, scale=3.0)
    s = SketchStatistics(D, rank=R, ema=0.75, max_tokens=128, seed=3)
    omega = sketch_matrix(D, 2 * R, 3)
    assert torch.equal(s.omega, omega) and not torch.equal(omega, sketch_matrix(D, 2 * R, 4))
    assert torch.allclose(omega.t() @ omega, torch.eye(2 * R), atol=1e-5)
    s.observe(x1)
    assert float(s.count) == 128 and float(s.tokens) == 512  # strided: every 4th token
    s.consolidate(None)
    sub1 = x1[::4]
    y1, d1 = sub1.t() @ sub1 @ omega / 128, (sub1 * sub1).sum(0) / 128
    assert torch.allclose(s.y, y1, rtol=1e-4, atol=1e-5) and torch.allclose(s.diag, d1, rtol=1e-5)
    assert float(s.count) == 0 and float(s.y_acc.abs().sum()) == 0
    s.observe(x2[:256])
    s.observe(x2[256:])  # a window of two batches is averaged over its tokens
    s.consolidate(None)
    y2 = (x2[:256:2].t() @ x2[:256:2] + x2[256::2].t() @ x2[256::2]) @ omega / 256
    assert torch.allclose(s.y, 0.75 * y1 + 0.25 * y2, rtol=1e-4, atol=1e-4)
    s.consolidate(None)  # an empty window leaves the EMA alone
    assert torch.allclose(s.y, 0.75 * y1 + 0.25 * y2, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e30])
def test_non_finite_batch_is_dropped_and_counted(bad):
    s = SketchStatistics(D, rank=R, ema=0.5, max_tokens=64)
    s.observe(tokens(64, seed=1))
    s.consolidate(None)
    before = s.whitening(R, 1e-3)
    y = s.y.clone()
    x = tokens(64, seed=2)
    x[7, 3] = bad  # 1e30 is finite but its square overflows fp32
    s.observe(x)
    assert int(s.dropped) == 1 and float(s.count) == 0 and float(s.y_acc.abs().sum()) == 0
    x3 = tokens(64, seed=3)
    s.observe(x3)
    assert int(s.dropped) == 1 and float(s.count) == 64
    s.consolidate(None)  # the EMA holds the finite batches only
    assert torch.allclose(s.y, 0.5 * y + 0.5 * x3.t() @ x3 @ s.omega / 64, rtol=1e-4, atol=1e-4)
    after = s.whitening(R, 1e-3)
    assert all(bool(torch.isfinite(t).all()) for t in after)
    assert not torch.equal(after[0], before[0])  # the finite window did rebuild the map


def test_observe_compiles_fullgraph_without_recompiles():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    eager = SketchStatistics(D, rank=R, ema=0.5, max_tokens=96)
    comp = SketchStatistics(D, rank=R, ema=0.5, max_tokens=96)
    counter = CompileCounterWithBackend("inductor")

    def forward(stats: SketchStatistics, x: torch.Tensor) -> torch.Tensor:
        stats.observe(x)
        return x * 2

    compiled = torch.compile(forward, backend=counter, fullgraph=True, dynamic=False)
    batches = [tokens(384, seed=i).reshape(2, 192, D) for i in range(3)]
    batches[1][0, 4, 9] = float("nan")  # a sampled token (stride 4)
    torch._dynamo.config.error_on_recompile = True
    try:
        for x in batches:
            compiled(comp, x)
            forward(eager, x)
    finally:
        torch._dynamo.config.error_on_recompile = False
    assert counter.frame_count == 1
    assert int(comp.dropped) == int(eager.dropped) == 1
    assert float(comp.count) == float(eager.count) == 2 * 96 and float(comp.tokens) == 3 * 384
    assert torch.allclose(comp.y_acc, eager.y_acc, rtol=1e-4, atol=1e-3)
    assert torch.allclose(comp.diag_acc, eager.diag_acc, rtol=1e-5)


def _consolidate_body(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    x = tokens(256, seed=10 + rank, scale=1.0 + rank)
    s = SketchStatistics(D, rank=R, ema=0.5, max_tokens=128)
    s.observe(x)
    held = s.consolidate(group)
    out = {"held": held, "y": s.y.clone(), "diag": s.diag.clone(), "w": s.whitening(R, 1e-3)}
    s.observe(x)
    out["owner_held"] = s.consolidate(group, owner=1)
    out["owner_w"] = s.whitening(R, 1e-3) if out["owner_held"] else None
    if not out["owner_held"]:
        with pytest.raises(RuntimeError, match="holds no consolidated sketch"):
            s.whitening(R, 1e-3)
    with pytest.raises(ValueError, match="held by group rank 1"):
        s.consolidate(group)  # every rank refuses alike: no collective is left half-entered
    out["owner_held_again"] = s.consolidate(group, owner=1)
    return out


def test_consolidate_is_identical_across_ranks_and_reduces_to_the_owner():
    r0, r1 = run_ranks(_consolidate_body, 2)
    assert r0["held"] and r1["held"]
    assert torch.equal(r0["y"], r1["y"]) and torch.equal(r0["diag"], r1["diag"])
    assert all(torch.equal(a, b) for a, b in zip(r0["w"], r1["w"]))
    # the group average equals one process seeing both ranks' subsamples
    both = torch.cat([tokens(256, seed=10)[::2], tokens(256, seed=11, scale=2.0)[::2]])
    omega = sketch_matrix(D, 2 * R, 0)
    assert torch.allclose(r0["y"], both.t() @ both @ omega / 256, rtol=1e-4, atol=1e-4)
    # owner=1: only rank 1 folds; with the same window again, its EMA is unchanged in value
    assert r1["owner_held"] and not r0["owner_held"] and r0["owner_w"] is None
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(r1["owner_w"], r0["w"]))
    assert r1["owner_held_again"] and not r0["owner_held_again"]


def test_memory_is_linear_in_width_and_flops_match_the_counter():
    k = 2 * R
    for d in (1024, 2048):
        s = SketchStatistics(d, rank=R, ema=0.5, max_tokens=256)
        # Omega, window sketch, EMA sketch, two diagonals; the counters are a few scalars
        assert s.nbytes() == 4 * (3 * d * k + 2 * d) + 4 * 2 + 8 + 1 + 8
        dense = KFACStatistics(d, ema=0.5, max_tokens=256, device="meta")
        dense_bytes = sum(t.numel() * t.element_size() for t in dense.state_dict().values())
        assert s.nbytes() < dense_bytes / 20  # 3 d k fp32 against 2 d^2
    x = tokens(1000, d=2048)
    with FlopCounterMode(display=False) as fc:
        s.observe(x)
    m = 250  # stride 4
    assert fc.get_total_flops() == 4 * m * 2048 * k  # the two matmuls
    assert 0 < s.observe_flops(1000) - fc.get_total_flops() < 4 * m * 2048


def test_state_dict_round_trip_and_checks():
    s = SketchStatistics(D, rank=R, ema=0.5, max_tokens=64, seed=5)
    s.observe(tokens(64))
    s.consolidate(None)
    s.observe(tokens(64, seed=1))
    t = SketchStatistics(D, rank=R, ema=0.5, max_tokens=64, seed=5)
    t.load_state_dict(s.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(s.whitening(R, 1e-3), t.whitening(R, 1e-3)))
    assert torch.equal(s.y_acc, t.y_acc) and float(t.count) == 64
    with pytest.raises(ValueError, match=r"\[seed, d_in, cols\]"):
        SketchStatistics(D, rank=R, ema=0.5, max_tokens=64, seed=6).load_state_dict(s.state_dict())


def test_errors_are_named():
    s = SketchStatistics(D, rank=R, ema=0.5, max_tokens=64)
    with pytest.raises(RuntimeError, match="no consolidated sketch"):
        s.whitening(R, 1e-3)
    with pytest.raises(ValueError, match="input width"):
        s.observe(torch.zeros(4, D + 1))
    s.observe(tokens(64))
    s.consolidate(None)
    with pytest.raises(ValueError, match="rank must be"):
        s.whitening(2 * R + 1, 1e-3)
    with pytest.raises(ValueError, match="owner must be"):
        s.consolidate(None, owner=1)
    with pytest.raises(ValueError, match="ema"):
        SketchStatistics(D, ema=1.0, max_tokens=64)
    with pytest.raises(ValueError, match="dense transform needs the exact factor"):
        Transform("dense", D).refresh_from_stats(s, 1e-3)
    # the dense statistics still refresh either kind through the same entry point
    k = KFACStatistics(D, ema=0.5, max_tokens=64)
    k.observe(tokens(64))
    k.consolidate(None)
    via_stats, direct = Transform("lowrank", D, rank=R), Transform("lowrank", D, rank=R)
    via_stats.refresh_from_stats(k, 1e-3)
    direct.refresh_from(k.factor, 1e-3)
    assert all(torch.equal(a, b) for a, b in zip(via_stats.tensors, direct.tensors))


def test_layers_reading_the_same_input_share_one_statistic():
    """q/k/v-style layers (same input) are detected from bit-identical first windows and share
    one statistic: memory drops, their maps come from the same factor, the others stay apart."""
    from gift_compile.config import GiftConfig
    from gift_compile.runtime.state import GiftState

    st = GiftState(GiftConfig(geometry="lowrank", rank=4, refresh_every=1, select="all"), None)
    for name in ("q", "k", "v", "o"):
        st.add_layer(f"{name}.weight", (32, 256), "cpu")
    before = st.memory_bytes()["statistics"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=g) * torch.logspace(0, -2, 256)
    for name in ("q", "k", "v"):
        st.layers[f"{name}.weight"].stats.observe(x)
    st.layers["o.weight"].stats.observe(torch.randn(512, 256, generator=g))
    version = st.plan_version
    st.step()
    q, k, v, o = (st.layers[f"{n}.weight"] for n in "qkvo")
    assert k.leader is q and v.leader is q and o.leader is None and q.followers == [k, v]
    assert not k.collect_stats and q.collect_stats and o.collect_stats
    assert st.plan_version > version  # followers' forwards stop observing: a plan change
    assert st.memory_bytes()["statistics"] < 0.6 * before
    for a, b in zip(q.transform.tensors, k.transform.tensors):
        assert torch.equal(a, b)
    assert not torch.equal(q.transform.tensors[1], o.transform.tensors[1])
    # a checkpoint restores the sharing
    fresh = GiftState(GiftConfig(geometry="lowrank", rank=4, refresh_every=1, select="all"), None)
    for name in ("q", "k", "v", "o"):
        fresh.add_layer(f"{name}.weight", (32, 256), "cpu")
    fresh.load_state_dict(st.state_dict())
    assert fresh.layers["v.weight"].leader is fresh.layers["q.weight"]
