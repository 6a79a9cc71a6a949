"""The eager paths keep the framework's overlap, on 2 gloo ranks: DDP's comm hook returns before
its exchange completes, so the backward of earlier layers runs while gradients travel; no GIFT
path reads the host inside the backward, and a step reads it at most once (the health check
when the backward ends); and a DDP step abandoned on a caught error leaves DDP's reducer able
to run the next one.

Each case runs a few steps of a small model with `fuse=False` (no compilation), well under a
minute.
"""

from __future__ import annotations

import functools
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import gift_compile
from gift_compile.config import GiftConfig
from multirank import run_ranks

FAST = 120  # seconds: a hang fails the test quickly
CFG = dict(format="fp8_e4m3", geometry="lowrank", min_numel=1024, rank=8, select="all", exclude=())


class _PoisonGrad(torch.autograd.Function):
    """Identity whose backward turns the gradient into NaN when `poison` (one rank's fault)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, poison: bool) -> torch.Tensor:  # noqa: ANN001
        ctx.poison = poison
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return (g * float("nan") if ctx.poison else g), None


class Tower(nn.Module):
    """Three linears; under `bucket_cap_mb=0.1` DDP's buckets (from the second step on) are one
    linear each, the last one's handed over while the earlier layers' backward is still to run."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 512)
        self.fc3 = nn.Linear(512, 1024)

    def forward(self, x: torch.Tensor, poison: bool = False) -> torch.Tensor:
        h = _PoisonGrad.apply(torch.relu(self.fc1(x)), poison)  # poison: NaN into fc1's gradient
        return self.fc3(torch.relu(self.fc2(h)))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + rank))


class _SlowCollectives:
    """`torch.ops._c10d_functional` with every all_to_all entered `delay` seconds late: one
    rank slowed down, so its peers' exchanges wait for it too."""

    def __init__(self, real: object, delay: float) -> None:
        self.real, self.delay = real, delay

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)

    def all_to_all_single(self, *args: object) -> torch.Tensor:
        time.sleep(self.delay)
        return self.real.all_to_all_single(*args)


DELAY = 1.0  # seconds each all_to_all of rank 1 starts late


def _overlap_body(rank: int, world: int) -> dict:
    from gift_compile.exchange import bucket as bucket_mod
    from gift_compile.frameworks import ddp as ddp_mod

    returned_done: list[bool] = []
    hook = ddp_mod._gift_hook

    @functools.wraps(hook)  # DDP reads the hook's signature: the original's
    def watched(hs: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = hook(hs, bucket)
        returned_done.append(fut.done())
        return fut

    ddp_mod._gift_hook = watched  # what `install` registers
    model = Tower()
    net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    gift_compile.apply(net, GiftConfig(**CFG, refresh_every=100, refresh_warmup=0), optimizer=opt, fuse=False)
    ddp_mod._gift_hook = hook
    out: dict = {}
    for step in range(3):  # steps 0-1 warm up (DDP rebuilds its buckets); step 2 has rank 1's exchanges slowed
        if step == 2 and rank == 1:
            bucket_mod._c10d = _SlowCollectives(bucket_mod._c10d, DELAY)
        returned_done.clear()
        x = _batch(step, rank).requires_grad_()
        stamps: dict[str, float] = {}
        x.register_hook(lambda g: stamps.setdefault("input_grad", time.perf_counter()) and None)
        loss = net(x).pow(2).mean()
        start = time.perf_counter()
        loss.backward()
        out[step] = {"input_grad": stamps["input_grad"] - start, "backward": time.perf_counter() - start,
                     "returned_done": list(returned_done)}
        opt.step()
        opt.zero_grad()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["calls"] = gift_compile.state(net).comm_totals()["calls"]
    return out


def test_ddp_hook_returns_before_its_exchange_completes_and_the_backward_goes_on():
    a, b = run_ranks(_overlap_body, 2, timeout=FAST)
    assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"])) and a["calls"] >= 7, (a, b)
    for r in (a, b):
        slow = r[2]
        assert len(slow["returned_done"]) == 3 and not any(slow["returned_done"]), r  # futures pending at return
        # the input's gradient (the backward's last compute) arrives long before the slowed
        # exchanges complete (every rank's wait for rank 1's)
        assert slow["input_grad"] < DELAY / 2, slow
    assert b[2]["backward"] >= 3 * DELAY, b[2]  # and the backward waits for them before it returns


# ---- host reads ---------------------------------------------------------------------------------
_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class _HostReads:
    """Counts calls that read a tensor's value on the host (and `.to("cpu")`), from any thread,
    split by whether they ran inside the end-of-backward health check (`end_of_backward`)."""

    def __init__(self) -> None:
        self.phase = ""
        self.calls: list[tuple[str, str, bool]] = []
        self._saved: dict[str, object] = {}

    def __enter__(self) -> "_HostReads":
        for name in (*_READS, "to"):
            real = getattr(torch.Tensor, name)
            self._saved[name] = real
            setattr(torch.Tensor, name, self._counting(name, real))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)

    def _counting(self, name: str, real: object):  # noqa: ANN202
        reads = self

        def counted(t: torch.Tensor, *args: object, **kwargs: object) -> object:
            to_host = name != "to" or any(str(a) == "cpu" for a in (*args, kwargs.get("device")))
            if reads.phase and to_host:
                frame, in_check = sys._getframe(1), False
                while frame is not None and not in_check:
                    in_check = frame.f_code.co_name == "end_of_backward"
                    frame = frame.f_back
                reads.calls.append((reads.phase, name, in_check))
            return real(t, *args, **kwargs)

        return counted


def _host_reads_body(rank: int, world: int, path: str) -> dict:
    model = Tower()
    if path == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (model.fc1, model.fc2, model.fc3):
            fully_shard(layer)
        fully_shard(model)
        net: nn.Module = model
    else:
        net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    gift_compile.apply(net, GiftConfig(**CFG, refresh_every=100, refresh_warmup=0), optimizer=opt, fuse=False)
    counts = []
    with _HostReads() as reads:
        for step in range(3):  # counted from the second step (the first sets things up)
            loss = net(_batch(step, rank)).pow(2).mean()
            reads.phase = "backward" if step else ""
            loss.backward()
            reads.phase = "step" if step else ""
            opt.step()
            reads.phase = ""
            opt.zero_grad()
            if step:
                counts.append(list(reads.calls))
                reads.calls.clear()
    return {"counts": counts, "calls": gift_compile.state(net).comm_totals()["calls"]}


def _check_reads(results: list[dict]) -> None:
    for r in results:
        assert r["calls"] >= 4, r  # GIFT's exchanges ran
        for calls in r["counts"]:
            during = [c for c in calls if c[0] == "backward" and not c[2]]
            assert not during, calls  # nothing read while the backward's layers and exchanges run
            assert len(calls) <= 1, calls  # one read per step: the end-of-backward health check


def test_ddp_step_reads_the_host_once_and_never_inside_the_backward():
    _check_reads(run_ranks(_host_reads_body, 2, "ddp", timeout=FAST))


def test_fsdp2_step_reads_the_host_once_and_never_inside_the_backward():
    _check_reads(run_ranks(_host_reads_body, 2, "fsdp2", timeout=FAST))


# ---- a DDP step abandoned on a caught error (issue 56, class 4) -----------------------------------
def _recover_body(rank: int, world: int, find_unused: bool) -> dict:
    model = Tower()
    net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1, find_unused_parameters=find_unused)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    gift_compile.apply(net, GiftConfig(**CFG, refresh_every=2), optimizer=opt, fuse=False)
    outcome = []
    for step in range(4):
        try:
            net(_batch(step, rank), poison=rank == 1 and step == 1).pow(2).mean().backward()
            opt.step()
            outcome.append("stepped")
        except FloatingPointError as e:  # recover as the message advises: skip the step
            outcome.append("raised: " + str(e).split(";")[0])
        except RuntimeError as e:
            outcome.append("broken: " + str(e).splitlines()[0])
        opt.zero_grad()
    return {"outcome": outcome, "params": [p.detach().clone() for p in model.parameters()],
            "steps": gift_compile.state(net).steps}


def test_ddp_trains_on_after_a_caught_nonfinite_error():
    for find_unused in (False, True):
        a, b = run_ranks(_recover_body, 2, find_unused, timeout=FAST)
        for r in (a, b):
            o = r["outcome"]
            assert o[0] == "stepped" and o[1].startswith("raised") and "rank(s) [1]" in o[1], o
            assert o[2:] == ["stepped", "stepped"], o  # the reducer ran the next steps
            assert r["steps"] == 3, r
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))  # replicas in step
