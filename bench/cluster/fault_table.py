"""Fault table: where each injected fault is caught, per data-parallel path and step driver.

Two faults on 2 gloo ranks, each on every path `gift_compile.apply` serves, with the two ways a
training loop can drive GIFT (`apply(..., optimizer=opt)`, or `apply` without it and
`gift_compile.step(model)` after each optimizer step):

- `nan-unmanaged`: the gradient of a gain vector (an unmanaged parameter) turns NaN on rank 1
  in the second step's backward;
- `direct-read`: a managed weight read directly (`F.linear(h, fc2.weight)`): its gradient
  reaches `.grad` without GIFT's sync, so the replicas differ (GIFT's own sync only: DDP and
  FSDP2 synchronise every `.grad` themselves).

Each cell says where the fault surfaced on every rank (`backward`, `step`, or `silent`: no
error and the fault reached the parameters) and whether the replicas' parameters agree after
the loop. Only the public API is used, so the same file measures any checkout:

    python -m bench.cluster.fault_table --out bench/results/cluster/fault_table.json

(the "before" column of the README was this file run with an older checkout first on
`PYTHONPATH`). Not part of the test suite; `tests/test_reliability.py` asserts the cases.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from bench.lib.provenance import commit
import gift_compile
from gift_compile.config import GiftConfig

PATHS = ("eager", "compiled", "ddp", "fsdp2")
DRIVERS = ("optimizer", "step")
CFG = dict(format="fp8_e4m3", geometry="lowrank", min_numel=1024, rank=8, refresh_every=2, select="all", exclude=())


class _Poison(torch.autograd.Function):
    """Identity whose backward turns the gradient into NaN when `poison` (one rank's fault)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, poison: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.poison = poison
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return (g * float("nan") if ctx.poison else g), None


class Net(nn.Module):
    """Two managed linears and an unmanaged gain; `direct` reads fc2's weight directly."""

    def __init__(self, direct: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(64, 128), nn.Linear(128, 64)
        self.gain = nn.Parameter(torch.ones(128))
        self.direct = direct

    def forward(self, x: torch.Tensor, poison: bool = False) -> torch.Tensor:
        h = torch.relu(self.fc1(x)) * _Poison.apply(self.gain, poison)
        return nn.functional.linear(h, self.fc2.weight, self.fc2.bias) if self.direct else self.fc2(h)


def _case(rank: int, fault: str, path: str, driver: str) -> dict[str, object]:
    torch._inductor.config.fx_graph_cache = False
    model = Net(direct=fault == "direct-read")
    if path == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (model.fc1, model.fc2):
            fully_shard(layer)
        fully_shard(model)
    net = nn.parallel.DistributedDataParallel(model) if path == "ddp" else model
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    gift_compile.apply(net, GiftConfig(**CFG), optimizer=opt if driver == "optimizer" else None, fuse=False)
    fwd = torch.compile(net, fullgraph=True, dynamic=False) if path == "compiled" else net
    where = "silent"
    for step in range(2):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = fwd(x, poison=fault == "nan-unmanaged" and rank == 1 and step == 1).pow(2).mean()
        try:
            loss.backward()
        except (FloatingPointError, RuntimeError) as e:
            where = f"backward ({type(e).__name__})"
            opt.zero_grad()
            continue
        try:
            opt.step()
            if driver == "step":
                gift_compile.step(net)
        except (FloatingPointError, RuntimeError) as e:
            where = f"step ({type(e).__name__})"
        opt.zero_grad()
    params = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    flat = torch.cat([p.reshape(-1) for p in params])
    both = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(both, flat)
    return {"where": where, "replicas_agree": bool(torch.equal(both[0], both[1])),
            "finite": bool(torch.isfinite(flat).all())}


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    rows = []
    for fault in ("nan-unmanaged", "direct-read"):
        for path in PATHS if fault == "nan-unmanaged" else ("eager", "compiled"):
            for driver in DRIVERS:
                rows.append({"fault": fault, "path": path, "driver": driver, **_case(rank, fault, path, driver)})
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "commit": commit(), "torch": torch.__version__}, indent=1))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.cluster.fault_table", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), str(a.out)), nprocs=2, join=True)
    for r in json.loads(a.out.read_text())["rows"]:
        print(f"{r['fault']:14s} {r['path']:9s} {r['driver']:9s} {r['where']:28s} replicas agree: {r['replicas_agree']}"
              f", finite: {r['finite']}")


if __name__ == "__main__":
    sys.exit(main())
