"""Error feedback on the all-reduce's two hops, measured on real gradients.

GIFT's all-reduce quantizes twice: each rank's contribution (independent errors that average
down over ranks), then each reduced shard before the all-gather (one error that every rank
applies). This experiment runs the real collective (`gift_compile.exchange.collectives.all_reduce`) on
2 gloo ranks, each rank holding one half-batch gradient of the bench's reference model
(`LayerSample.halves`), cycling through the held-out batches for `--steps` steps, and reports
the time-averaged error `||sum_t (out_t - exact_t)|| / ||sum_t exact_t||` per layer (mean over
the managed layers): the bias error feedback exists to remove. Arms: no error feedback,
first-hop EF, both hops, both hops with a leaky residual (beta = 0.9); geometries: Euclidean
(no map) and GIFT's low-rank K-FAC map built from the first batch's previous-batch factor.

    python -m bench.fidelity.second_hop --out bench/results/fidelity/second_hop.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.lib import reference
from bench.fidelity.round_trip import build_transform
from bench.lib.settings import profile
from gift_compile.config import GiftConfig
from gift_compile.exchange import collectives as C
from gift_compile.sync import exit_without_finalization
from gift_compile.torchtitan_ext.cpu import corpus
from bench.lib.paths import RESULTS

# arm -> (error_feedback, second_hop_error_feedback, error_feedback_decay)
ARMS: dict[str, tuple[bool, bool, float]] = {
    "none": (False, False, 1.0),
    "first-hop EF": (True, False, 1.0),
    "both hops EF": (True, True, 1.0),
    "both hops EF, beta 0.9": (True, True, 0.9),
}
GEOMETRIES = ("euclidean", "gift")


def _worker(rank: int, world: int, store: str, data_path: str, formats: list[str], steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        data = torch.load(data_path, weights_only=False)
        results: dict[str, dict[str, dict[str, float]]] = {}
        for fmt in formats:
            for side in GEOMETRIES:
                for arm, (ef1, ef2, beta) in ARMS.items():
                    cfg = GiftConfig(format=fmt, geometry="lowrank", error_feedback=ef1, second_hop_error_feedback=ef2,
                                     error_feedback_decay=beta)
                    errs = {}
                    for name, layer in data["layers"].items():
                        halves = layer["halves"]  # [batches, 2, out, in]
                        t = layer["transform"] if side == "gift" else None
                        out_rows, d_in = halves.shape[2], halves.shape[3]
                        first = torch.zeros(out_rows, d_in) if ef1 else None
                        second = torch.zeros(-(-out_rows // world), d_in) if ef2 else None
                        acc, exact = torch.zeros(out_rows, d_in), torch.zeros(out_rows, d_in)
                        for step in range(steps):
                            pair = halves[step % halves.shape[0]]
                            acc += C.all_reduce(pair[rank], dist.group.WORLD, cfg, t, first, second_hop_residual=second)
                            exact += pair.mean(0)
                        errs[name] = float((acc - exact).norm() / exact.norm())
                    results.setdefault(fmt, {}).setdefault(side, {})[arm] = sum(errs.values()) / len(errs)
                    if rank == 0:
                        print(f"  {fmt} {side:9s} {arm:24s} {results[fmt][side][arm]:.4f}", flush=True)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
    exit_without_finalization(0)  # results are written: leave before finalization (gift_compile.sync)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="nvfp4,int2")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batches", type=int, default=4, help="held-out batches cycled through (>= 2)")
    p.add_argument("--profile", choices=("smoke", "quick"), default="quick")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=RESULTS / "fidelity" / "second_hop.json")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    base = profile(a.profile)
    fs = dataclasses.replace(base.fidelity, heldout_batches=a.batches, multirank_batches=0, keep_halves=True)
    paths = corpus.prepare()
    model, record = reference.reference_model(base.reference, paths, print, a.cache_dir)
    samples = reference.collect_samples(model, fs, paths, print)
    layers: dict[str, dict] = {}
    for s in samples:
        entry = layers.setdefault(s.name, {"halves": [], "transform": None})
        entry["halves"].append(s.halves)
        if entry["transform"] is None:  # built once from the first batch's previous-batch factor, then kept
            entry["transform"] = build_transform("lowrank", 32, "kfac", s, fs.damping)
    for entry in layers.values():
        entry["halves"] = torch.stack(entry["halves"])
    formats = [f for f in a.formats.split(",") if f]
    with tempfile.TemporaryDirectory() as tmp:
        data_path, out_path = os.path.join(tmp, "data.pt"), os.path.join(tmp, "out.json")
        torch.save({"layers": layers}, data_path)
        mp.spawn(_worker, args=(2, os.path.join(tmp, "store"), data_path, formats, a.steps, out_path), nprocs=2, join=True)
        errors = json.loads(Path(out_path).read_text())
    result = {
        "command": "python -m bench.fidelity.second_hop " + " ".join(argv if argv is not None else sys.argv[1:]),
        "reference": {"optimizer": base.reference.optimizer, "val_bpb": record["val_bpb"]},
        "world": 2, "steps": a.steps, "batches": a.batches, "layers": len(layers),
        "metric": "time-averaged relative error of the all-reduced gradient, mean over managed layers",
        "arms": {k: dict(zip(("error_feedback", "second_hop_error_feedback", "error_feedback_decay"), v))
                 for k, v in ARMS.items()},
        "errors": errors, "seconds": time.perf_counter() - start,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
