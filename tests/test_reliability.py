"""Reliability round 2 on 2 gloo ranks: every gradient GIFT hands to a collective is guarded,
the plain path's full-precision sync pairs parameters by name whatever the backward order.

A learnable gain vector whose gradient turns NaN on rank 1 only, inside the backward (after
the forward, before any sync): every rank's backward raises when its collectives complete,
naming rank 1, before the optimizer touches the parameter. The checks run at the end of the
backward, so they hold alike when `apply` got `optimizer=` and when the loop drives GIFT with
`gift_compile.step(model)` (each case runs with both drivers).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import gift_compile
from gift_compile.config import GiftConfig
from multirank import run_ranks

FAST = 300  # seconds: a hang fails the test quickly
CFG = dict(format="fp8_e4m3", geometry="lowrank", min_numel=1024, rank=8, refresh_every=2, select="all", exclude=())


class _PoisonGrad(torch.autograd.Function):
    """Identity whose backward turns the gradient into NaN when `poison` (one rank's fault)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, poison: bool) -> torch.Tensor:
        ctx.poison = poison
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (g * float("nan") if ctx.poison else g), None


class GainNet(nn.Module):
    """Two managed linears, two same-shaped LayerNorms and a gain vector (all unmanaged).

    `swap` runs the two norms in the other order, so their gradients become ready in the
    other order in the backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(64, 128)
        self.norm_a = nn.LayerNorm(128)
        self.norm_b = nn.LayerNorm(128)
        self.gain = nn.Parameter(torch.ones(128))
        self.fc2 = nn.Linear(128, 64)
        with torch.no_grad():  # distinct norm parameters, so a mix-up shows
            self.norm_a.weight.uniform_(0.5, 1.5)
            self.norm_b.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor, poison: bool = False, swap: bool = False) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        first, second = (self.norm_b, self.norm_a) if swap else (self.norm_a, self.norm_b)
        h = second(first(h) * 1.5) * _PoisonGrad.apply(self.gain, poison)
        return self.fc2(h)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + rank))


def _drive(net: nn.Module, config: GiftConfig, driver: str) -> torch.optim.Optimizer:
    """`apply` with `optimizer=` ("optimizer") or without it ("step": the loop calls
    `gift_compile.step` after each optimizer step, see `_step`)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    gift_compile.apply(net, config, optimizer=opt if driver == "optimizer" else None, fuse=False)
    return opt


def _step(net: nn.Module, opt: torch.optim.Optimizer, driver: str, loss: torch.Tensor) -> str:
    """One training step; where it raised (`backward: ...` / `step: ...`) or "stepped"."""
    try:
        loss.backward()
    except (FloatingPointError, RuntimeError) as e:  # the health error, GiftReplicaError
        opt.zero_grad()
        return f"backward: {type(e).__name__}: {e}"
    try:
        opt.step()
        if driver == "step":
            gift_compile.step(net)
    except (FloatingPointError, RuntimeError) as e:
        return f"step: {type(e).__name__}: {e}"
    finally:
        opt.zero_grad()
    return "stepped"


def _nan_gain_body(rank: int, world: int, path: str, driver: str) -> dict:
    torch._inductor.config.fx_graph_cache = False
    model = GainNet()
    if path == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (model.fc1, model.fc2):
            fully_shard(layer)
        fully_shard(model)
    net = nn.parallel.DistributedDataParallel(model) if path == "ddp" else model
    opt = _drive(net, GiftConfig(**CFG), driver)
    fwd = torch.compile(net, fullgraph=True, dynamic=False) if path == "compiled" else net

    def gain() -> torch.Tensor:
        g = model.gain.detach()
        return g.full_tensor() if path == "fsdp2" else g.clone()

    out: dict = {}
    for step in range(2):
        before = gain()
        out[step] = _step(net, opt, driver, fwd(_batch(step, rank), poison=(rank == 1 and step == 1)).pow(2).mean())
        out[f"gain_unchanged_{step}"] = torch.equal(gain(), before)
    out["gain_finite"] = bool(torch.isfinite(gain()).all())
    out["quantized"] = gift_compile.state(net).comm_totals()["calls"] > 0
    return out


@pytest.mark.parametrize("driver", ["optimizer", "step"])
@pytest.mark.parametrize("path", ["eager", "compiled", "ddp", "fsdp2"])
def test_nan_in_an_unmanaged_gradient_on_one_rank_raises_on_every_rank(path, driver):
    results = run_ranks(_nan_gain_body, 2, path, driver, timeout=FAST)
    for r in results:
        assert r[0] == "stepped" and r["gain_unchanged_0"] is False and r["quantized"], r  # a healthy step
        # every rank's backward raises, naming rank 1, with or without the optimizer hook
        assert r[1].startswith("backward: FloatingPointError") and "NaN/Inf from rank(s) [1]" in r[1], r
        assert r["gain_unchanged_1"] and r["gain_finite"], r  # before the optimizer touched it


def _order_body(rank: int, world: int) -> dict:
    model, ref = GainNet(), GainNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    gift_compile.apply(model, GiftConfig(**CFG), optimizer=opt)
    st = gift_compile.state(model)
    swap = rank == 1  # rank 1's norm gradients become ready in the other order
    x = _batch(0, rank)
    model(x, swap=swap).pow(2).mean().backward()
    ref(x, swap=swap).pow(2).mean().backward()
    errs = {}
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        g = q.grad.clone()
        dist.all_reduce(g)
        errs[n] = float((p.grad - g / world).norm() / (g / world).norm())
    return {"errs": errs, "totals": st.comm_totals(), "managed": sorted(st.layers),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def test_plain_sync_pairs_parameters_by_name_in_one_launch():
    a, b = run_ranks(_order_body, 2, timeout=FAST)
    assert a["managed"] == ["fc1.weight", "fc2.weight"]
    for n, err in a["errs"].items():
        if n not in a["managed"]:
            assert err < 1e-6, (n, a["errs"])  # the readiness-order sync mixed norm_a and norm_b here
    for n in a["grads"]:
        assert torch.equal(a["grads"][n], b["grads"][n]), n
    # one launch for the 7 unmanaged parameters, one per managed weight
    assert a["totals"]["plain_calls"] == 1 and a["totals"]["calls"] == 2, a["totals"]


class DirectRead(nn.Module):
    """A block that reads a managed weight directly (`F.linear(h, self.fc2.weight, ...)`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        return nn.functional.linear(h, self.fc2.weight, self.fc2.bias)


def _direct_read_body(rank: int, world: int, exclude: tuple[str, ...], driver: str = "optimizer",
                      compiled: bool = False) -> dict:
    torch._inductor.config.fx_graph_cache = False
    model = DirectRead()
    opt = _drive(model, GiftConfig(**{**CFG, "exclude": exclude}), driver)
    fwd = torch.compile(model, fullgraph=True, dynamic=False) if compiled else model
    before = model.fc2.weight.detach().clone()
    outcome = _step(model, opt, driver, fwd(_batch(0, rank)).pow(2).mean())
    return {"outcome": outcome, "managed": sorted(gift_compile.state(model).layers),
            "unchanged": torch.equal(model.fc2.weight.detach(), before),
            "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("driver,compiled", [("optimizer", False), ("step", False), ("step", True)])
def test_managed_weight_read_directly_raises_on_every_rank_and_exclude_syncs_it(driver, compiled):
    for r in run_ranks(_direct_read_body, 2, (), driver, compiled, timeout=FAST):
        assert r["managed"] == ["fc1.weight", "fc2.weight"]
        assert r["outcome"].startswith("backward: GiftReplicaError") and "fc2.weight (rank(s) [1]" in r["outcome"], r
        assert "fc1.weight" not in r["outcome"] and r["unchanged"], r  # raised before the optimizer step
    if compiled:
        return
    a, b = run_ranks(_direct_read_body, 2, ("*fc2*",), driver, timeout=FAST)  # the documented opt-out
    assert a["managed"] == ["fc1.weight"] and a["outcome"] == b["outcome"] == "stepped"
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)  # fc2 synchronised at full precision: the replicas agree


def _plan_change_body(rank: int, world: int, case: str) -> list[str]:
    """Both ranks agree on the first call; the second call differs on one rank."""
    from gift_compile.exchange import collectives as C

    out = []
    for call in range(2):
        x = torch.randn(64, 96, generator=torch.Generator().manual_seed(rank))
        cfg = GiftConfig(format="fp8_e4m3")
        if call == 1 and rank == 0:
            if case == "rows":
                x = x[:48]  # different sizes: the all_to_all would hang
            else:
                cfg = GiftConfig(format="fp8_e5m2")  # same bytes on the wire: would decode garbage
        try:
            C.all_reduce(x, dist.group.WORLD, cfg)
            out.append("ok")
        except RuntimeError as e:
            out.append(str(e))
    return out


@pytest.mark.parametrize("case,difference", [("rows", "items[0].rows: 48 vs 64"),
                                             ("format", "items[0].format: 'fp8_e5m2' vs 'fp8_e4m3'")])
def test_a_plan_that_changes_after_the_first_call_raises_instead_of_hanging(case, difference):
    a, b = run_ranks(_plan_change_body, 2, case, timeout=120)
    assert a[0] == b[0] == "ok"
    assert "rank(s) [1] differ from rank 0" in a[1] and difference in a[1], a
    assert "rank(s) [0] differ from rank 1" in b[1], b


class TwinNet(nn.Module):
    """Two managed linears of the same shape; `swap` applies them in the other order, so their
    gradients reach the collectives in the other order."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc_a = nn.Linear(64, 64)
        self.fc_b = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, swap: bool = False) -> torch.Tensor:
        first, second = (self.fc_b, self.fc_a) if swap else (self.fc_a, self.fc_b)
        return second(torch.relu(first(x)))


def _swapped_layers_body(rank: int, world: int, compiled: bool) -> str:
    torch._inductor.config.fx_graph_cache = False
    model = TwinNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gift_compile.apply(model, GiftConfig(**CFG), optimizer=opt)
    fwd = torch.compile(model, fullgraph=True, dynamic=False) if compiled else model
    try:
        fwd(_batch(0, rank), swap=rank == 1).pow(2).mean().backward()
        opt.step()
        return "stepped"
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("compiled", [False, True])
def test_same_shaped_layers_in_another_order_on_one_rank_raise_on_every_rank(compiled):
    a, b = run_ranks(_swapped_layers_body, 2, compiled, timeout=FAST)
    if compiled:  # the header fingerprint branch: every rank raises at the optimizer step
        assert a.startswith("GiftHealthError") and "rank(s) [1] differ from rank 0" in a, a
        assert b.startswith("GiftHealthError") and "rank(s) [0] differ from rank 1" in b, b
    else:  # eager: the fingerprint exchange raises in the backward, before the data moves
        assert "rank(s) [1] differ from rank 0" in a and "items[0].name: 'fc_b.weight' vs 'fc_a.weight'" in a, a
        assert "rank(s) [0] differ from rank 1" in b, b


def _undriven_body(rank: int, world: int) -> dict[str, list[str]]:
    """`apply` without `optimizer=`: a loop that never calls `gift_compile.step` is warned once,
    after a refresh interval of optimizer steps; one that calls it is not, and neither are the
    several backward passes of one step (micro-batches, pipeline stages)."""
    import logging

    seen: dict[str, list[str]] = {}
    for driven in (False, True):
        records: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda rec: records.append(rec.getMessage())  # type: ignore[method-assign]
        logging.getLogger("gift_compile").addHandler(handler)
        model = DirectRead()
        opt = _drive(model, GiftConfig(**{**CFG, "refresh_every": 3}), "step")
        for step in range(8):
            for micro in range(4):  # four synchronising backward passes per step: no warning by themselves
                model(_batch(step, micro)).pow(2).mean().backward()  # the same batches on both ranks
            opt.step()
            opt.zero_grad()
            if driven:
                gift_compile.step(model)
        logging.getLogger("gift_compile").removeHandler(handler)
        seen["driven" if driven else "undriven"] = [m for m in records if "has not advanced" in m]
    return seen


def test_a_state_that_never_advances_is_warned_about_once():
    for r in run_ranks(_undriven_body, 2, timeout=FAST):
        assert len(r["undriven"]) == 1 and r["undriven"][0].startswith("GIFT: 4 optimizer steps"), r
        assert "gift_compile.step(model)" in r["undriven"][0] and r["driven"] == [], r
