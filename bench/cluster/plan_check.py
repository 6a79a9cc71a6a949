"""What GIFT's cross-rank checks cost, measured on 2 gloo ranks.

Mechanisms that keep ranks from running mismatched collectives (which would hang on different
sizes or decode garbage on equal sizes) or from stepping on bad gradients:

- the in-band header: every bucket's all_to_all carries, to every rank, 16 bytes with the
  plan's fingerprint (item names and order included) and a non-finite flag over every item,
  managed or passed through, which every receiver compares (always on, also in compiled graphs);
- the eager host check (`check_plan_agreement`): a fixed-size table of every rank's
  fingerprint on every eager call (FSDP2/DDP hooks, GIFT's eager per-layer sync, the public
  API), plus an `all_gather_object` of the plan's description on a plan's first call or a
  mismatch (every call with `GiftConfig(plan_check="always")`);
- the non-finite flag of a passthrough item (an `isfinite` reduction over its bytes);
- the replica check before each optimizer step of GIFT's own sync (`gift_compile.runtime.health`):
  a checksum of each managed gradient's bits and one small all-reduce.

    python -m bench.cluster.plan_check [--rows 1280 --cols 3456 --repeats 20]

prints the header's share of the bucket's bytes and the median time (over repeats,
interleaved) of one bucket collective and of each check, on a gradient of the same size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gift_compile.exchange import collectives as C
from gift_compile.exchange.plan import BucketPlan, ItemPlan
from gift_compile.runtime.health import grad_checksum
from gift_compile.sync import all_reduce_, exit_without_finalization


def _worker(rank: int, world: int, store: str, rows: int, cols: int, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        g = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rank))
        item = ItemPlan(name="w", rows=rows, cols=cols, format="fp8_e4m3", scaling="row", block_size=32,
                        kind="identity", n_tensors=0)
        plan = BucketPlan((item,), world, dist.group.WORLD.group_name, True, "reduce_scatter")
        state = [C.ItemTensors(())]
        C.check_plan_agreement(plan, dist.group.WORLD)  # first call: the description exchange, once per plan
        checks: dict[str, Callable[[], object]] = {
            "bucket collective": lambda: C.run_bucket([g], state, C.Shared(), plan),
            "fingerprint table (plan_check='first', every eager call)": lambda: C.check_plan_agreement(
                plan, dist.group.WORLD),
            "fingerprint table + descriptions (plan_check='always')": lambda: C.check_plan_agreement(
                plan, dist.group.WORLD, always=True),
            "non-finite flag of a passthrough item of this size": lambda: bool(torch.isfinite(g).all()),
            "replica checksum of a gradient of this size + all-reduce": lambda: all_reduce_(
                grad_checksum(g, torch.device("cpu")).reshape(1, 2).repeat(world, 1), dist.group.WORLD).tolist(),
        }
        times: dict[str, list[float]] = {k: [] for k in checks}
        for _ in range(repeats):
            for name, fn in checks.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        if rank == 0:
            wire = C.bucket_wire_bytes(plan)
            lines = [f"bucket: [{rows}, {cols}] fp8_e4m3/row reduce-scatter over {world} gloo ranks, "
                     f"{repeats} repeats (median)",
                     f"  bytes handed to the all_to_all: {wire}, of which headers {world * C.HEADER_BYTES} "
                     f"({100 * world * C.HEADER_BYTES / wire:.4f}%)"]
            bucket = statistics.median(times["bucket collective"])
            lines += [f"  {k}: {statistics.median(v) * 1e3:.3f} ms ({100 * statistics.median(v) / bucket:.1f}% of the "
                      "bucket)" for k, v in times.items()]
            lines.append(f"  load average during the run: {os.getloadavg()[0]:.1f} (2 cores)")
            with open(out, "w") as f:
                f.write("\n".join(lines) + "\n")
    finally:
        dist.destroy_process_group()
    exit_without_finalization(0)  # results are written: leave before finalization (gift_compile.sync)


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
