"""Convergence: 2-rank gloo data-parallel pretraining with each gradient format.

Every arm of one seed starts from the same initialisation and sees the same data in the same
order (`gift_compile.torchtitan_ext.corpus.batches` slices one global batch per step across the ranks), so
the only difference between arms is how gradients are communicated:

- `fp32`: a plain fp32 all-reduce of every gradient (what DDP does), the reference;
- `euclid-*` / `gift-*`: `gift_compile.apply(model, GiftConfig(...), group=WORLD)`, the product
  API. Managed linear weights take the quantized all-reduce, Euclidean (`geometry="none"`) or
  GIFT (`geometry="lowrank"`, rank 32, `select="all"` so every managed layer is whitened once
  its K-FAC statistics exist); everything else is all-reduced in fp32 by the hooks `apply`
  installs. The model runs eagerly by default (the backward calls the same collective the
  compiled graph would; `torch.compile` of 2 ranks x 5 arms costs minutes of compile time on
  2 cores); `ConvergenceSettings.compile` compiles it instead.

DESIGN.md section 5 measured that at this scale the format's effect is far below run-to-run
noise, so the report gives several seeds, mean and spread, and paired (same-seed) differences.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import gift_compile
from bench.reference import lr_at
from bench.settings import ConvergenceSettings
from gift_compile.torchtitan_ext import corpus
from gift_compile.config import GiftConfig
from gift_compile.passes import last_reports
from bench.tiny_llama import TinyLlama, loss

Log = Callable[[str], None]

# arm -> GiftConfig keyword arguments (None: plain fp32 all-reduce). The FP8 arms use the
# paper's setting (E5M2, one scale per tensor).
ARMS: dict[str, dict[str, object] | None] = {
    "fp32": None,
    "euclid-fp8": {"format": "fp8_e5m2", "scaling": "tensor", "geometry": "none"},
    "gift-fp8": {"format": "fp8_e5m2", "scaling": "tensor", "geometry": "lowrank", "select": "all"},
    "euclid-nvfp4": {"format": "nvfp4", "geometry": "none"},
    "gift-nvfp4": {"format": "nvfp4", "geometry": "lowrank", "select": "all"},
}


def arm_config(arm: str, s: ConvergenceSettings, seed: int) -> GiftConfig | None:
    kwargs = ARMS[arm]
    if kwargs is None:
        return None
    return GiftConfig(**kwargs, rank=32, refresh_every=s.refresh_every, seed=seed)


def _allreduce_fp32(model: nn.Module, world: int) -> None:
    """Mean of every gradient over the ranks, in fp32, as one flat all-reduce."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _replicas_identical(model: nn.Module) -> bool:
    """True when every rank holds bit-identical parameters (max and min of a checksum agree)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    check = torch.stack([flat.sum(), (flat * torch.arange(flat.numel(), dtype=torch.float64)).sum()])
    both = torch.cat([check, -check])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return bool((both[:2] == -both[2:]).all())


def _train_arm(arm: str, seed: int, s: ConvergenceSettings, paths: corpus.CorpusPaths,
               rank: int, world: int) -> dict[str, object]:
    model = TinyLlama(s.model, seed=seed)
    config = arm_config(arm, s, seed)
    reports_before = len(last_reports())
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if config is not None:
        gift_compile.apply(model, config, group=dist.group.WORLD, optimizer=opt)
    forward = torch.compile(model) if s.compile else model
    tokens = corpus.token_stream("train", paths)
    losses: list[float] = []
    evals: list[tuple[int, float]] = []
    start = time.perf_counter()
    data = corpus.batches(tokens, s.local_batch * world, s.seq_len, seed=seed, rank=rank, world_size=world,
                          steps=s.steps)
    for step, (x, y) in enumerate(data):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s.steps, s.lr, s.warmup)
        value = loss(forward(x), y)
        opt.zero_grad(set_to_none=True)
        value.backward()
        if config is None:
            _allreduce_fp32(model, world)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(value.detach()))
        if (step + 1) % s.eval_every == 0 or step + 1 == s.steps:
            if rank == 0:
                bpb = corpus.bits_per_byte(model, "val", paths, seq_len=s.seq_len, max_tokens=s.eval_tokens)
                evals.append((step + 1, bpb))
                print(f"    [seed {seed} {arm}] step {step + 1}/{s.steps} loss {losses[-1]:.3f} "
                      f"held-out bits/byte {bpb:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
            dist.barrier()
    result: dict[str, object] = {
        "arm": arm, "seed": seed, "losses": losses, "evals": evals,
        "seconds": time.perf_counter() - start, "replicas_identical": _replicas_identical(model),
    }
    if config is not None:
        state = gift_compile.state(model)
        totals = state.comm_totals()
        result["wire_bytes_per_step"] = {"gift": totals["wire"] / s.steps, "fp32": totals["baseline"] / s.steps}
        result["managed_layers"] = len(state.layers)
        result["selected_layers"] = sum(layer.selected for layer in state.layers.values())
        if s.compile:  # what the FX pass did to this arm's graphs
            reports = last_reports()[reports_before:]
            result["pass_rewritten"] = sum(len(r.layers) for r in reports)
            result["pass_fallbacks"] = sum(len(r.fallbacks) for r in reports)
        gift_compile.remove(model)
    return result


def _worker(rank: int, world: int, store_path: str, s: ConvergenceSettings, paths: corpus.CorpusPaths,
            out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        results = [_train_arm(arm, seed, s, paths, rank, world) for seed in s.seeds for arm in s.arms]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _summary(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def run(s: ConvergenceSettings, paths: corpus.CorpusPaths, log: Log) -> dict[str, object]:
    """Train every (seed, arm) on `s.world` gloo ranks; curves, final metrics, paired diffs."""
    log(f"  {len(s.seeds)} seed(s) x {len(s.arms)} arms x {s.steps} steps on {s.world} gloo ranks "
        f"({s.local_batch}x{s.seq_len} tokens per rank per step, {'compiled' if s.compile else 'eager'})")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(s.world, os.path.join(tmp, "store"), s, paths, tmp), nprocs=s.world, join=True)
        per_rank = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(s.world)]
    runs = []
    for i, first in enumerate(per_rank[0]):
        curves = [r[i]["losses"] for r in per_rank]
        rec = dict(first)
        rec["losses"] = [statistics.fmean(v) for v in zip(*curves)]  # global-batch loss
        tail = rec["losses"][-max(1, s.steps // 10):]
        rec["final_train_loss"] = statistics.fmean(tail)
        rec["final_bpb"] = first["evals"][-1][1]
        runs.append(rec)
    by = {(r["seed"], r["arm"]): r for r in runs}
    arms = {}
    for arm in s.arms:
        bpb = [by[(seed, arm)]["final_bpb"] for seed in s.seeds]
        train = [by[(seed, arm)]["final_train_loss"] for seed in s.seeds]
        diff = [by[(seed, arm)]["final_bpb"] - by[(seed, "fp32")]["final_bpb"] for seed in s.seeds]
        rel = [d / by[(seed, "fp32")]["final_bpb"] for d, seed in zip(diff, s.seeds)]
        arms[arm] = {"final_bpb": _summary(bpb), "final_train_loss": _summary(train),
                     "paired_diff_bpb": _summary(diff), "paired_rel_diff_bpb": _summary(rel),
                     "seconds": statistics.fmean(by[(seed, arm)]["seconds"] for seed in s.seeds)}
    # Paired GIFT-vs-Euclidean differences at the same format.
    gift_vs_euclid = {}
    for fmt in ("fp8", "nvfp4"):
        if f"gift-{fmt}" in s.arms and f"euclid-{fmt}" in s.arms:
            d = [by[(seed, f"gift-{fmt}")]["final_bpb"] - by[(seed, f"euclid-{fmt}")]["final_bpb"] for seed in s.seeds]
            gift_vs_euclid[fmt] = _summary(d)
    return {
        "mode": "compiled" if s.compile else "eager",
        "world": s.world, "steps": s.steps, "tokens_per_step": s.world * s.local_batch * s.seq_len,
        "seeds": list(s.seeds), "arms": list(s.arms),
        "arm_configs": {a: ARMS[a] for a in s.arms},
        "runs": runs, "summary": arms, "gift_minus_euclid_bpb": gift_vs_euclid,
        "all_replicas_identical": all(r["replicas_identical"] for r in runs),
        "noise_floor_bpb": _seed_spread(by, s),
    }


def _seed_spread(by: dict[tuple[int, str], dict[str, object]], s: ConvergenceSettings) -> float:
    """Std over seeds of the fp32 arm's final bits/byte: the run-to-run noise to compare against."""
    if len(s.seeds) < 2 or "fp32" not in s.arms:
        return math.nan
    return statistics.stdev(by[(seed, "fp32")]["final_bpb"] for seed in s.seeds)
