"""What GIFT's cross-rank plan checks cost, measured on 2 gloo ranks.

Two mechanisms keep ranks from running mismatched collectives (which would hang on different
sizes or decode garbage on equal sizes):

- the in-band header: every bucket's all_to_all carries, to every rank, 16 bytes with the
  plan's fingerprint and a non-finite flag, which every receiver compares (always on, also in
  compiled graphs);
- the host check (`check_plan_agreement`): an `all_gather_object` of the plan's description
  before the data moves, on the first call of each plan in eager paths (FSDP2/DDP hooks, the
  public API), or on every call with `GiftConfig(plan_check="always")`.

    python -m bench.plan_check [--rows 1280 --cols 3456 --repeats 20]

prints the header's share of the bucket's bytes, the time of one bucket collective with and
without the per-call host check (median over repeats, interleaved), and the host check alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gift_compile import collectives as C
from gift_compile.plan import BucketPlan, ItemPlan


def _worker(rank: int, world: int, store: str, rows: int, cols: int, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        g = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rank))
        item = ItemPlan(name="w", rows=rows, cols=cols, format="fp8_e4m3", scaling="row", block_size=32,
                        kind="identity", n_tensors=0)
        plan = BucketPlan((item,), world, dist.group.WORLD.group_name, True, "reduce_scatter")
        state = [C.ItemTensors(())]
        C.check_plan_agreement(plan, dist.group.WORLD)  # first call: the host check every eager path pays once
        times: dict[str, list[float]] = {"bucket": [], "bucket + host check": [], "host check alone": []}
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            C.run_bucket([g], state, C.Shared(), plan)
            t1 = time.perf_counter()
            C.check_plan_agreement(plan, dist.group.WORLD, always=True)
            C.run_bucket([g], state, C.Shared(), plan)
            t2 = time.perf_counter()
            C.check_plan_agreement(plan, dist.group.WORLD, always=True)
            t3 = time.perf_counter()
            times["bucket"].append(t1 - t0)
            times["bucket + host check"].append(t2 - t1)
            times["host check alone"].append(t3 - t2)
        if rank == 0:
            wire = C.bucket_wire_bytes(plan)
            lines = [f"bucket: [{rows}, {cols}] fp8_e4m3/row reduce-scatter over {world} gloo ranks, "
                     f"{repeats} repeats (median)",
                     f"  bytes handed to the all_to_all: {wire}, of which headers {world * C.HEADER_BYTES} "
                     f"({100 * world * C.HEADER_BYTES / wire:.4f}%)"]
            lines += [f"  {k}: {statistics.median(v) * 1e3:.3f} ms" for k, v in times.items()]
            with open(out, "w") as f:
                f.write("\n".join(lines) + "\n")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1280)
    p.add_argument("--cols", type=int, default=3456)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.txt")
        mp.spawn(_worker, args=(2, os.path.join(tmp, "store"), a.rows, a.cols, a.repeats, out), nprocs=2, join=True)
        sys.stdout.write(open(out).read())


if __name__ == "__main__":
    main()
