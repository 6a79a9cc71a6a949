"""Quantized collectives on real gloo groups: identical results, error levels, no code sums,
error feedback, compile parity."""

import pytest
import torch
import torch.distributed as dist

from gift_compile.config import GiftConfig
from gift_compile.exchange import collectives as C
from gift_compile.geometry import Transform
from multirank import run_ranks

FORMATS = ["fp8_e4m3", "fp8_e5m2", "mxfp8", "nvfp4", "int4", "mxint4", "int2", "ternary", "bf16"]
# Relative L2 error of an all-reduce of Gaussian data: two quantizations (reduce-scatter,
# then the re-encoded shard), so roughly sqrt(2) x the single round trip.
LIMITS = {"fp8_e4m3": 0.045, "fp8_e5m2": 0.085, "mxfp8": 0.05, "nvfp4": 0.17, "int4": 0.2, "mxint4": 0.27,
          "int2": 0.7, "ternary": 0.75, "bf16": 0.004}


def local_grad(rank: int) -> torch.Tensor:
    return torch.randn(16, 96, generator=torch.Generator().manual_seed(10 + rank)) * (1 + rank)


def _collectives_body(rank: int, world: int) -> dict:
    x = local_grad(rank)
    exact = x.clone()
    dist.all_reduce(exact)
    exact /= world
    out = {"exact": exact}
    t = Transform("hadamard", 96, seed=4)
    for fmt in FORMATS:
        cfg = GiftConfig(format=fmt)
        out[f"ar/{fmt}"] = C.all_reduce(x, dist.group.WORLD, cfg, t)
        out[f"rs/{fmt}"] = C.reduce_scatter(x, dist.group.WORLD, cfg)
    # 1-D and odd-row tensors go through the row-padding path
    out["ar/odd"] = C.all_reduce(x[:7], dist.group.WORLD, GiftConfig(format="fp8_e4m3"))
    out["exact_odd"] = exact[:7]
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_identical_on_every_rank_and_accurate(world):
    res = run_ranks(_collectives_body, world)
    exact = res[0]["exact"]
    for fmt in FORMATS:
        for r in range(1, world):
            assert torch.equal(res[r][f"ar/{fmt}"], res[0][f"ar/{fmt}"]), f"{fmt}: rank {r} decoded other bits"
        err = float((res[0][f"ar/{fmt}"] - exact).norm() / exact.norm())
        assert err < LIMITS[fmt], (fmt, err)
        assert err > LIMITS[fmt] / 20, f"{fmt}: error {err} too small: was anything quantized?"
        shards = torch.cat([res[r][f"rs/{fmt}"] for r in range(world)])
        assert shards.shape == exact.shape
        rs_err = float((shards - exact).norm() / exact.norm())
        assert LIMITS[fmt] / 40 < rs_err < LIMITS[fmt], (fmt, rs_err)
    odd = res[0]["ar/odd"]
    assert odd.shape == (7, 96) and float((odd - res[0]["exact_odd"]).norm() / res[0]["exact_odd"].norm()) < 0.045


def _traced_ops_body(rank: int, world: int) -> list[tuple[str, str]]:
    from torch.fx.experimental.proxy_tensor import make_fx

    from gift_compile.exchange.plan import BucketPlan, ItemPlan

    t = Transform("lowrank", 96, rank=8)
    managed = ItemPlan(name="w", rows=16, cols=96, format="fp8_e5m2", kind="lowrank", n_tensors=5)
    plan = BucketPlan((managed, ItemPlan.passthrough("b", 32, torch.float32)), world,
                      dist.group.WORLD.group_name, True, "all_reduce")

    def core(x, b, *ts):
        return C.bucket_core([x, b], [C.ItemTensors(ts), None], C.Shared(), plan)[0]

    gm = make_fx(core)(local_grad(rank), torch.ones(32), *t.tensors)
    return [(str(n.target).split(".")[1], str(n.args[0].meta["val"].dtype)) for n in gm.graph.nodes
            if n.op == "call_function" and "_c10d_functional" in str(n.target) and "wait" not in str(n.target)]


def test_no_collective_ever_sums_low_bit_codes():
    # one bucket (a managed weight + a full-precision tensor) is one all_to_all of bytes and,
    # for an all-reduce, one all_gather of bytes: no reduction collective at all
    ops = run_ranks(_traced_ops_body, 2)[0]
    assert sorted(ops) == [("all_gather_into_tensor", "torch.uint8"), ("all_to_all_single", "torch.uint8")], ops


def _error_feedback_body(rank: int, world: int, steps: int) -> tuple[float, float]:
    cfg = GiftConfig(format="nvfp4")
    x = local_grad(rank)
    exact = x.clone()
    dist.all_reduce(exact)
    exact /= world
    residual = torch.zeros_like(x)
    errs = []
    for use_ef in (False, True):
        acc = torch.zeros_like(x)
        for _ in range(steps):
            acc += C.all_reduce(x, dist.group.WORLD, cfg, residual=residual if use_ef else None)
        errs.append(float((acc / steps - exact).norm() / exact.norm()))
    return tuple(errs)


def test_error_feedback_shrinks_the_mean_error():
    no_ef, ef = run_ranks(_error_feedback_body, 2, 40)[0]
    # Without feedback the same bias repeats every step; with it the time-average converges
    # (the second, all-gather stage is not compensated here, which bounds the gain; see
    # tests/test_second_hop_ef.py for second_hop_error_feedback).
    assert ef < 0.6 * no_ef, (no_ef, ef)


def _compiled_body(rank: int, world: int) -> tuple[torch.Tensor, ...]:
    from gift_compile.exchange.plan import BucketPlan, ItemPlan

    cfg = GiftConfig(format="fp8_e4m3", stochastic_rounding=True, error_feedback=True)
    t = Transform("lowrank", 96, rank=8)
    a = torch.randn(256, 96, generator=torch.Generator().manual_seed(0))
    t.refresh_from(a.t() @ a, 1e-3)
    res_e, res_c, res_k = torch.zeros(16, 96), torch.zeros(16, 96), torch.zeros(16, 96)
    seed = torch.tensor(3)
    x = local_grad(rank)
    eager = C.all_reduce(x, dist.group.WORLD, cfg, t, res_e, seed=seed)
    # what eager callers (FSDP2's and DDP's hooks) use: the library compiles its core
    core = C.all_reduce(x, dist.group.WORLD, cfg, t, res_k, seed=seed, compiled=True)
    # user code compiling the functional core itself, fullgraph, with the rank as data
    item = ItemPlan(name="x", rows=16, cols=96, format="fp8_e4m3", kind="lowrank", n_tensors=5, error_feedback=True,
                    stochastic_rounding=True)
    plan = BucketPlan((item,), world, dist.group.WORLD.group_name, True, "all_reduce")

    def f(x, residual, seed, rank_t):
        return C.bucket_core([x], [C.ItemTensors(t.tensors, (residual,))], C.Shared(seed, rank_t), plan)[0][0]

    compiled = torch.compile(f, fullgraph=True, dynamic=False)(x, res_c, seed, torch.tensor(rank))
    return eager, compiled, res_e, res_c, core, res_k


def test_compiled_collective_matches_eager_bitwise():
    for eager, compiled, res_e, res_c, core, res_k in run_ranks(_compiled_body, 2):
        assert torch.equal(eager, compiled) and torch.equal(eager, core)
        assert torch.equal(res_e, res_c) and torch.equal(res_e, res_k) and float(res_e.abs().sum()) > 0


def test_bad_inputs_are_clear_errors():
    x = torch.randn(4, 8)
    x[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN/Inf"):
        C.all_reduce(x, None, GiftConfig())
    nan_rows = C.all_reduce(x, None, GiftConfig(nonfinite="propagate"))
    assert torch.isnan(nan_rows[0]).all() and torch.isfinite(nan_rows[1:]).all()
    for bad in (torch.ones(()), torch.ones(0, 8)):
        with pytest.raises(ValueError, match="x must have"):
            C.all_reduce(bad, None, GiftConfig())
    with pytest.raises(TypeError, match="dtype"):
        C.all_reduce(torch.ones(4, 8, dtype=torch.float64), None, GiftConfig())
    with pytest.raises(ValueError, match="d_in"):
        C.all_reduce(torch.ones(4, 8), None, GiftConfig(), Transform("lowrank", 16))


def test_wire_bytes_accounting():
    from gift_compile.codec import FormatSpec

    # fp8 row scaling, 2 ranks, all-reduce of [64, 256]: the all_to_all carries a 16-byte
    # header per rank + codes + row scales, then the re-encoded half shard (codes + row scales)
    spec = FormatSpec("fp8_e4m3", "row")
    assert C.wire_bytes_per_rank("all_reduce", (64, 256), spec, 2) == (2 * 16 + 64 * 256 + 64 * 4) + (32 * 256 + 32 * 4)
    assert C.wire_bytes_per_rank("reduce_scatter", (64, 256), FormatSpec("fp32"), 2) == 64 * 256 * 4


def _bucket_body(rank: int, world: int) -> dict:
    """One bucket of two managed weights (different transforms) and one fp32 tensor, against
    the same tensors sent one by one; bytes counted at run time vs the accounting."""
    from gift_compile.exchange.plan import BucketPlan, ItemPlan

    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(16, 96, generator=g), torch.randn(8, 64, generator=g), torch.randn(40, generator=g)]
    t = Transform("lowrank", 96, rank=8)
    a = torch.randn(256, 96, generator=torch.Generator().manual_seed(5))
    t.refresh_from(a.t() @ a, 1e-3)
    items = (ItemPlan(name="a", rows=16, cols=96, format="fp8_e4m3", kind="lowrank", n_tensors=5),
             ItemPlan(name="b", rows=8, cols=64, format="nvfp4"),
             ItemPlan.passthrough("c", 40, torch.float32))
    counters = torch.zeros(C.N_COUNTERS, dtype=torch.int64)
    shared = C.Shared(0, rank, counters)
    plan = BucketPlan(items, world, dist.group.WORLD.group_name, True, "reduce_scatter")
    outs, headers = C.run_bucket(xs, [C.ItemTensors(t.tensors), C.ItemTensors(()), None], shared, plan)
    single = [C.reduce_scatter(xs[0], dist.group.WORLD, GiftConfig(format="fp8_e4m3"), t),
              C.reduce_scatter(xs[1], dist.group.WORLD, GiftConfig(format="nvfp4"))]
    exact = [x.clone() for x in xs]
    for e in exact:
        dist.all_reduce(e)
        e /= world
    return {"outs": outs, "single": single, "exact": exact, "counters": counters, "accounted": C.bucket_wire_bytes(plan),
            "headers": headers}


def test_bucket_equals_items_sent_alone_and_counts_its_bytes():
    world = 2
    res = run_ranks(_bucket_body, world)
    for rank, r in enumerate(res):
        assert torch.equal(r["outs"][0], r["single"][0]) and torch.equal(r["outs"][1], r["single"][1])
        rows = slice(rank * 8, (rank + 1) * 8)
        err = float((r["outs"][0] - r["exact"][0][rows]).norm() / r["exact"][0][rows].norm())
        assert 0.005 < err < 0.05, err  # quantized: neither exact nor garbage
        assert torch.allclose(r["outs"][2], r["exact"][2].reshape(world, -1)[rank], atol=1e-6)  # fp32 item
        c = r["counters"]
        assert int(c[C.C_WIRE]) == r["accounted"] and int(c[C.C_CALLS]) == 1
        assert int(c[C.C_BASELINE]) == 4 * (16 * 96 + 8 * 64 + 40)
        assert int(c[C.C_NONFINITE]) == 0 and int(c[C.C_MISMATCH]) == 0


def _fail_together_body(rank: int, world: int) -> list[str]:
    """Rank 1 has a NaN: both ranks raise in the same call, and the group stays in step."""
    outcome = []
    for step in range(3):
        x = local_grad(rank)
        if rank == 1 and step == 1:
            x[3, 5] = float("nan")
        try:
            y = C.all_reduce(x, dist.group.WORLD, GiftConfig(format="fp8_e4m3"))
            outcome.append(f"ok {float(y.sum()):.4f}")
        except FloatingPointError as e:
            outcome.append("raised: " + str(e).split(";")[0])
    return outcome


def test_nonfinite_on_one_rank_raises_on_every_rank_and_the_group_stays_in_step():
    a, b = run_ranks(_fail_together_body, 2, timeout=120)
    assert a[1] == b[1] and a[1].startswith("raised") and "rank(s) [1]" in a[1], (a, b)
    assert a[0] == b[0] and a[2] == b[2] and a[2].startswith("ok"), (a, b)  # same results after the error


def _mismatch_body(rank: int, world: int, case: str) -> str:
    x = local_grad(rank)
    cfg = GiftConfig(format="fp8_e4m3")
    if case == "format" and rank == 1:
        cfg = GiftConfig(format="fp8_e5m2")  # same bytes on the wire: would decode garbage
    if case == "rows" and rank == 1:
        x = x[:8]  # different sizes: the all_to_all would hang
    try:
        C.reduce_scatter(x, dist.group.WORLD, cfg)
        return "no error"
    except RuntimeError as e:
        return str(e)


@pytest.mark.parametrize("case", ["format", "rows"])
def test_mismatched_plans_raise_on_every_rank_naming_both(case):
    msgs = run_ranks(_mismatch_body, 2, case, timeout=120)
    for m in msgs:
        assert "disagree on a collective's plan" in m, msgs
        assert ("fp8_e5m2" in m and "fp8_e4m3" in m) if case == "format" else ("[8, 96]" in m and "[16, 96]" in m), m


def _ef_storage_body(rank: int, world: int, steps: int) -> dict[str, float]:
    """Time-averaged all-reduce error with error feedback, residual stored in various formats."""
    from gift_compile.codec import residual as R
    from gift_compile.exchange.plan import BucketPlan, ItemPlan

    x = local_grad(rank)
    exact = x.clone()
    dist.all_reduce(exact)
    exact /= world
    out = {}
    for res_fmt in ("none", "fp32", "bf16", "fp8_e4m3", "int4"):
        item = ItemPlan(name="x", rows=16, cols=96, format="nvfp4", error_feedback=res_fmt != "none",
                        residual_format="fp32" if res_fmt == "none" else res_fmt)
        plan = BucketPlan((item,), world, dist.group.WORLD.group_name, True, "all_reduce")
        bufs = R.allocate(item.residual_format, 16, 96, "cpu") if res_fmt != "none" else None
        acc = torch.zeros_like(x)
        for _ in range(steps):
            acc += C.run_bucket([x], [C.ItemTensors((), bufs)], C.Shared(), plan)[0][0]
        out[res_fmt] = float((acc / steps - exact).norm() / exact.norm())
    return out


def test_error_feedback_residual_in_eight_bits_keeps_most_of_the_gain():
    errs = run_ranks(_ef_storage_body, 2, 40)[0]
    assert errs["fp32"] < 0.6 * errs["none"], errs
    assert errs["bf16"] < 1.1 * errs["fp32"], errs
    # an 8-bit residual (a quarter of the memory) keeps most of error feedback's gain
    assert errs["fp8_e4m3"] < 0.6 * errs["none"] and errs["fp8_e4m3"] < 1.5 * errs["fp32"], errs
    assert errs["int4"] < errs["none"], errs
