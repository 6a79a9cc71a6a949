"""Soak run: a long GIFT training loop on 2 gloo ranks, watched for slow leaks and drift.

A small MLP with LayerNorms (two managed linears, every other parameter through the plain
path's fp32 bucket), compiled once (`fullgraph=True, dynamic=False`), trained with GIFT FP8 +
error feedback, geometry refreshed every `--refresh-every` steps and a DCP checkpoint (model,
optimizer, per-rank GIFT state) written every `--ckpt-every` steps. Every `--sample-every`
steps each rank records its resident memory (VmRSS), the graphs Dynamo compiled so far and
the byte counters. The report (rank 0, JSON) states:

- resident memory after warm-up and at the end, and the least-squares slope over the samples
  after warm-up (MiB per 1,000 steps);
- graphs compiled after warm-up (must be 0: state lives in tensors updated in place);
- whether every step added exactly the accounted bytes (managed all-reduces by their plans,
  the plain bucket by its plan) and one plain-sync launch, and no health flags.

    nice -n 19 python -m bench.cluster.soak --steps 1000 --out bench/results/cluster/soak.json

Not part of the test suite (minutes of CPU); `tests/test_bench_smoke.py` runs a few steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn as nn

import gift_compile
from gift_compile.sync import exit_without_finalization


class SoakNet(nn.Module):
    """Two managed linears, LayerNorms and biases (unmanaged): both sync paths run."""

    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(width, 2 * width)
        self.norm1 = nn.LayerNorm(2 * width)
        self.out = nn.Linear(2 * width, width)
        self.norm2 = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(self.out(torch.relu(self.norm1(self.inp(x)))))


def rss_mib() -> float:
    """This process's resident memory (VmRSS), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def _plain_bytes(model: nn.Module, managed: set[int], world: int) -> int:
    """Bytes of the plain path's one fp32 all-reduce per backward (gradients, an arrival flag
    per parameter, a non-finite and a layout-changed flag per rank)."""
    others = [p for p in model.parameters() if id(p) not in managed]
    return 4 * (sum(p.numel() for p in others) + len(others) + 2 * world)


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, ckpt_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    torch._inductor.config.fx_graph_cache = False
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        model = SoakNet(args.width)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        cfg = gift_compile.GiftConfig(format="fp8_e4m3", geometry="lowrank", min_numel=1024, rank=8, select="all",
                                      exclude=(), error_feedback=True, refresh_every=args.refresh_every)
        gift_compile.apply(model, cfg, optimizer=opt)
        st = gift_compile.state(model)
        fwd = torch.compile(model, fullgraph=True, dynamic=False)
        managed = {id(m._parameters["weight"]) for m in st.modules.values()}
        per_step = st.accounted_bytes_per_step() + _plain_bytes(model, managed, world)
        gen = torch.Generator().manual_seed(1000 + rank)
        target = torch.randn(args.width, args.width, generator=torch.Generator().manual_seed(7)) / args.width ** 0.5
        samples: list[dict[str, float]] = []
        bad_steps: list[int] = []
        warm = None
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            before = st.comm_totals()
            x = torch.randn(args.batch, args.width, generator=gen)
            loss = (fwd(x) - x @ target).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            after = st.comm_totals()
            if (after["wire"] - before["wire"] != per_step or after["plain_calls"] - before["plain_calls"] != 1
                    or after["nonfinite"] or after["mismatch"]):
                bad_steps.append(step)
            if step % args.ckpt_every == 0:
                dcp.save({"model": model.state_dict(), "optim": opt.state_dict(),
                          f"gift.rank{rank}": st.state_dict()}, checkpoint_id=os.path.join(ckpt_dir, "last"))
            if step == args.warmup:
                warm = {"step": step, "rss_mib": rss_mib(), "graphs": compiled_graphs()}
            if step % args.sample_every == 0:
                samples.append({"step": step, "t_s": round(time.perf_counter() - start, 1), "rss_mib": round(rss_mib(), 2),
                                "graphs": compiled_graphs(), "loss": round(float(loss), 5), "wire": after["wire"]})
                if rank == 0:  # progress, readable while the run goes on
                    with open(out + ".progress", "a") as f:
                        f.write(json.dumps(samples[-1]) + "\n")
        wall = time.perf_counter() - start
        after_warm = [s for s in samples if s["step"] > args.warmup]
        report = {
            "rank": rank, "steps": args.steps, "wall_s": round(wall, 1), "warmup_steps": args.warmup,
            "refreshes": len(st.history), "checkpoints": args.steps // args.ckpt_every,
            "rss_mib_after_warmup": round(warm["rss_mib"], 2), "rss_mib_end": round(rss_mib(), 2),
            "rss_slope_mib_per_1000_steps": round(1000 * _slope([s["step"] for s in after_warm],
                                                                [s["rss_mib"] for s in after_warm]), 3),
            "graphs_after_warmup": warm["graphs"], "graphs_end": compiled_graphs(),
            "recompiles_after_warmup": compiled_graphs() - warm["graphs"],
            "accounted_bytes_per_step": per_step, "steps_off_the_accounting": bad_steps[:20],
            "n_steps_off_the_accounting": len(bad_steps), "totals": st.comm_totals(),
            "samples": samples,
        }
        reports: list[object] = [None] * world
        dist.all_gather_object(reports, report)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"command": args.command, "ranks": reports}, f, indent=1)
    finally:
        dist.destroy_process_group()
    exit_without_finalization(0)  # results are written: leave before finalization (gift_compile.sync)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=100, help="steps before the memory/recompile baseline")
    p.add_argument("--refresh-every", type=int, default=50)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--sample-every", type=int, default=25)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--out", default="bench/results/cluster/soak.json")
    a = p.parse_args(argv)
    if not 0 < a.warmup < a.steps:
        p.error("--warmup must be between 0 and --steps")
    a.command = "python -m bench.cluster.soak " + " ".join(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "store"), a, tmp, a.out), nprocs=2, join=True)
    with open(a.out) as f:
        result = json.load(f)
    for r in result["ranks"]:
        print(f"rank {r['rank']}: {r['steps']} steps in {r['wall_s']} s, {r['refreshes']} refreshes, "
              f"{r['checkpoints']} checkpoints; RSS {r['rss_mib_after_warmup']} -> {r['rss_mib_end']} MiB "
              f"(slope {r['rss_slope_mib_per_1000_steps']} MiB/1000 steps); recompiles after warm-up "
              f"{r['recompiles_after_warmup']}; steps off the byte accounting {r['n_steps_off_the_accounting']}")
    return result


if __name__ == "__main__":
    main()
