"""Follow the config from `gift_compile.apply` through the package (issue 25's measure of how
scattered the design is): on rank 0 of a 2-rank gloo job applying GIFT to two linears, record the
file of every gift_compile frame that holds a `GiftConfig` (an argument or a local; the config's
own methods in config.py excluded) from apply's entry to its return, and print the files visited,
the stops (runs of consecutive frames in one file) and the returns to a file left earlier.

    python -m bench.cluster.config_walk
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

def worker(rank: int, world: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import gift_compile
    from gift_compile import GiftConfig
    root = os.path.dirname(gift_compile.__file__)
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    opt = torch.optim.AdamW(m.parameters())
    seq = []
    def prof(frame, event: str, arg: object) -> None:
        if event != "call":
            return
        f = frame.f_code.co_filename
        if not f.startswith(root) or f.endswith(os.sep + "config.py"):  # the config's own methods do not count
            return
        if any(isinstance(v, GiftConfig) for v in frame.f_locals.values()):
            seq.append(os.path.relpath(f, root))
    cfg = GiftConfig(format="nvfp4", geometry="lowrank", min_numel=16)
    sys.setprofile(prof)
    gift_compile.apply(m, cfg, optimizer=opt)
    sys.setprofile(None)
    if rank == 0:
        stops = [f for i, f in enumerate(seq) if i == 0 or seq[i - 1] != f]
        returns = sum(1 for i, f in enumerate(stops) if f in stops[:max(0, i - 1)])
        print(f"files {len(set(stops))}, stops {len(stops)}, returns to a file left earlier {returns}")
        print(" -> ".join(stops))
    dist.destroy_process_group()

def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(2, os.path.join(d, "store")), nprocs=2, join=True)


if __name__ == "__main__":
    main()
