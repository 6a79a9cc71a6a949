"""Fault injection on 2 gloo ranks: every fault ends in a clear error on every rank, a correct
result, or a logged, documented conversion — never silence, never a hang.

Each multi-rank case runs with a short timeout, so a hang fails fast instead of waiting for the
process group's default timeout. The single-process cases cover checkpoints and bad arguments.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import gift_compile
from gift_compile.config import GiftConfig
from gift_compile.exchange import collectives as C
from gift_compile.geometry import Transform
from gift_compile.runtime.state import GiftState
from multirank import run_ranks
from mlp import MLP as _MLP

FAST = 120  # seconds: a hang fails the test quickly


def MLP() -> nn.Module:
    return _MLP(64, classes=None)


def _nan_training_body(rank: int, world: int, compiled: bool) -> list[str]:
    """A NaN gradient on rank 1 at step 1: every rank's backward raises when its collectives
    complete, the loop skips the step, and training continues in lockstep."""
    torch._inductor.config.fx_graph_cache = False
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gift_compile.apply(model, GiftConfig(format="fp8_e4m3", geometry="lowrank", min_numel=1024, refresh_every=2, select="all", rank=8),
                       optimizer=opt)
    fwd = torch.compile(model, fullgraph=True, dynamic=False) if compiled else model
    outcome = []
    for step in range(4):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(10 * step + rank))
        if rank == 1 and step == 1:
            x[3, 7] = float("inf")
        try:
            fwd(x).pow(2).mean().backward()
            opt.step()
            outcome.append("stepped")
        except FloatingPointError as e:
            outcome.append("raised: " + str(e).split(";")[0])
        opt.zero_grad()
    outcome.append(f"steps={gift_compile.state(model).steps}")
    outcome.append(str([float(p.sum()) for p in model.parameters()]))
    return outcome


@pytest.mark.parametrize("compiled", [False, True])
def test_nonfinite_gradient_on_one_rank_fails_every_rank_in_the_same_step(compiled):
    a, b = run_ranks(_nan_training_body, 2, compiled, timeout=FAST * 3)
    assert a == b, (a, b)  # same outcome on both ranks, same parameters afterwards
    assert a[0] == "stepped" and a[1].startswith("raised") and a[2] == a[3] == "stepped", a
    assert a[4] == "steps=3"  # the skipped step did not advance GIFT's state


def _cols_mismatch_body(rank: int, world: int) -> str:
    x = torch.randn(16, 96 if rank == 0 else 64)
    try:
        C.all_reduce(x, dist.group.WORLD, GiftConfig())
        return "no error"
    except RuntimeError as e:
        return str(e)


def test_mismatched_columns_raise_on_every_rank_instead_of_aborting():
    for msg in run_ranks(_cols_mismatch_body, 2, timeout=FAST):
        assert "disagree on a collective's plan" in msg and "[16, 96]" in msg and "[16, 64]" in msg, msg


def _setup_mismatch_body(rank: int, world: int) -> str:
    model = MLP()
    try:
        gift_compile.apply(model, GiftConfig(min_numel=1024, rank=8 if rank == 0 else 16))
        return "no error"
    except ValueError as e:
        return str(e)


def test_ranks_with_different_gift_setups_refuse_to_start():
    for msg in run_ranks(_setup_mismatch_body, 2, timeout=FAST):
        assert "different GIFT plan" in msg and "config.rank: 8 vs 16" in msg.replace("16 vs 8", "8 vs 16"), msg


def _state(**overrides: object) -> GiftState:
    st = GiftState(GiftConfig(**{"geometry": "lowrank", "rank": 4, "refresh_every": 1, "select": "all", **overrides}), None)
    st.add_layer("a.weight", (32, 48), "cpu")
    st.add_layer("b.weight", (16, 48), "cpu")
    g = torch.Generator().manual_seed(0)
    for layer in st.layers.values():
        layer.stats.observe(torch.randn(256, 48, generator=g) * torch.logspace(0, -2, 48))
    st.step()  # one refresh: non-trivial transforms
    return st


def test_checkpoint_round_trip_is_exact():
    saved = _state(error_feedback=True).state_dict()
    fresh = _state(error_feedback=True)
    fresh.load_state_dict(saved)
    again = fresh.state_dict()
    for k, v in saved.items():
        assert (v == again[k]) if isinstance(v, str) else torch.equal(v, again[k]), k


@pytest.mark.parametrize("change,message", [
    ({"rank": 8}, "layer a.weight: rank 4 != expected 8"),
    ({"geometry": "dense"}, "layer a.weight: kind lowrank != expected dense"),
])
def test_checkpoint_with_another_geometry_is_refused(change, message):
    saved = _state().state_dict()
    with pytest.raises(ValueError, match=message):
        _state(**change).load_state_dict(saved)


def test_checkpoint_faults_name_layer_and_key():
    good = _state().state_dict()
    target = _state()
    before = {k: v.clone() for k, v in target.state_dict().items() if isinstance(v, torch.Tensor)}
    bad = dict(good)
    bad["a.weight.transform.t1"] = bad["a.weight.transform.t1"].clone().fill_(float("nan"))
    with pytest.raises(ValueError, match=r"layer a.weight: key 'transform.t1' holds NaN/Inf"):
        target.load_state_dict(bad)
    bad = {k: v for k, v in good.items() if not k.startswith("b.weight.transform")}
    with pytest.raises(ValueError, match=r"layer b.weight: key 'transform.t0' is missing"):
        target.load_state_dict(bad)
    only_a = GiftState(GiftConfig(geometry="lowrank", rank=4, refresh_every=1, select="all"), None)
    only_a.add_layer("a.weight", (32, 48), "cpu")
    with pytest.raises(ValueError, match=r"layers differ: missing \['b.weight'\]"):
        target.load_state_dict(only_a.state_dict())
    bad = dict(good, **{"zz.extra": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"unexpected keys \['zz.extra'\]"):
        target.load_state_dict(bad)
    bad = dict(good)
    bad["b.weight.probe"] = torch.zeros(3, 48)
    with pytest.raises(ValueError, match=r"layer b.weight: key 'probe' has shape \(3, 48\)"):
        target.load_state_dict(bad)
    after = target.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items()), "a refused load modified the state"
    with pytest.raises(ValueError, match="error_feedback is off now"):
        _state().load_state_dict(_state(error_feedback=True).state_dict())


def test_checkpoint_conversions_are_logged(caplog):
    caplog.set_level(logging.WARNING, logger="gift_compile")
    exact = _state(error_feedback=True)
    layer = exact.layers["a.weight"]
    value = torch.randn(32, 48, generator=torch.Generator().manual_seed(1)) * 1e-3
    layer.residual[0].copy_(value)
    target = _state(error_feedback=True, residual_format="fp8_e4m3", format="nvfp4")
    target.load_state_dict(exact.state_dict())
    from gift_compile.codec import residual as R

    back = R.read("fp8_e4m3", target.layers["a.weight"].residual, 48)
    assert 0 < float((back - value).norm() / value.norm()) < 0.04  # re-stored in 8 bits
    text = caplog.text
    assert "re-stored from fp32 to fp8_e4m3" in text and "config changed" in text and "nvfp4" in text


@pytest.mark.parametrize("call", [
    lambda: Transform("spline", 16),
    lambda: C.reduce_scatter(torch.ones(3, 8), None, GiftConfig(), Transform("lowrank", 16)),
    lambda: C.all_reduce(torch.ones(()), None, GiftConfig()),
    lambda: C.all_reduce(torch.ones(4, 8, dtype=torch.int64), None, GiftConfig()),
    lambda: C.all_reduce(torch.ones(4, 8), None, GiftConfig(), residual=torch.zeros(4, 9)),
    lambda: GiftState(GiftConfig(geometry="lowrank"), None).add_layer("w", (0, 16), "meta"),
])
def test_bad_arguments_are_one_clear_error(call):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert len(str(info.value)) > 20 and "Traceback" not in str(info.value)


def _other_ranks_checkpoint_body(rank: int, world: int) -> dict:
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    gift_compile.apply(net, GiftConfig(format="int2", error_feedback=True, geometry="lowrank", rank=4, select="all",
                                       refresh_every=2, min_numel=1024), optimizer=opt, fuse=False)
    for step in range(3):
        torch.manual_seed(10 * step + rank)
        net(torch.randn(16, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    st = gift_compile.state(net)
    mine = st.state_dict()
    rank0s = [mine]
    dist.broadcast_object_list(rank0s, src=0)  # rank 0's file, on every rank
    out = {"has_residuals": any(k.endswith("residual.0") and bool(v.any()) for k, v in mine.items()
                                if isinstance(v, torch.Tensor))}
    for what, sd in (("rank0", rank0s[0]), ("own", mine)):
        try:
            st.load_state_dict(sd)
            out[what] = "loaded"
        except ValueError as e:
            out[what] = str(e)
    return out


def test_another_ranks_checkpoint_is_refused():
    """Issue 49 case 4: before, rank 0's GIFT checkpoint (int2 + error feedback) loaded silently
    on rank 1, whose next synchronised gradient carried rank 0's residuals."""
    r0, r1 = run_ranks(_other_ranks_checkpoint_body, 2, timeout=FAST)
    assert r0["has_residuals"] and r0["rank0"] == "loaded" and r0["own"] == "loaded", r0
    assert "saved by rank 0 of 2 and this is rank 1 of 2" in r1["rank0"] and r1["own"] == "loaded", r1
