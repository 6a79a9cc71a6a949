"""Convergence: where low-bit gradient communication costs loss, and how much GIFT gives back.

2-rank gloo data-parallel pretraining of the bench's small Llama, per optimizer (Muon on the
hidden matrices with AdamW on embeddings, norms and head — the paper's setting — or AdamW
alone) and per arm:

- `fp32`: a plain fp32 all-reduce of every gradient, the reference;
- `euclid-<fmt>[-ef]` / `gift-<fmt>[-ef]`: `gift_compile.apply(model, GiftConfig(...),
  optimizer=...)`, the product path. Managed linear weights take the quantized all-reduce in
  plain coordinates (`geometry="none"`) or GIFT's (`geometry="lowrank"`, every managed layer
  whitened); `-ef` adds error feedback (Euclidean + EF is the ablation the paper lacks).
  Everything else is all-reduced in fp32.

Every arm of a (seed, optimizer) starts from the same initialisation and sees the same data in
the same order, so the per-seed difference to `fp32` isolates the communication. The summary
gives, per arm, the mean paired difference of the final held-out bits/byte with a t-based 95%
CI and the minimum detectable effect (`bench.lib.stats`); per bit width and EF setting, the gap
Euclidean leaves and the share of it GIFT closes. Runs write one JSON line each as they finish
(`jsonl` next to the results), so a long profile can be inspected, or rendered, while it runs.

This module runs the study (training, the two gradient paths, the workers); the arms and run
keys are `bench.convergence.arms`, the statistics over finished runs `bench.convergence.summary`,
and the pages render them (`bench.pages.report`, `bench.pages.readme`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
import statistics
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import gift_compile
from bench.convergence.arms import (PATHS, RunKey, arm_config, check_settings, emulated_precision, rescaled,
                                    resolve_arm_auto, run_key, settings_key)
from bench.convergence.summary import summarise
from bench.fidelity.round_trip import two_sided_round_trip
from bench.fidelity.map_emulation import MANTISSA_BITS, tensor_core_map
from bench.lib.reference import make_optimizers, train_step
from bench.lib.settings import ConvergenceSettings
from bench.lib.tiny_llama import TinyLlama
from gift_compile.api import eligible_linears
from gift_compile.config import GiftConfig
from gift_compile.exchange.collectives import all_reduce
from gift_compile.geometry import Transform, gradient_factor
from gift_compile.geometry.table import geometry_class
from gift_compile.passes import last_reports, reports_seen
from gift_compile.runtime.state import GiftState
from gift_compile.sync import all_reduce_, exit_without_finalization
from gift_compile.torchtitan_ext.cpu import corpus, language_modeling

Log = Callable[[str], None]

class TwoSided:
    """The `-two` arms: an experiment that asks whether whitening BOTH sides of the gradient
    closes the loss gap a one-sided map leaves. Not a `GiftConfig` geometry: a row-mixing map
    cannot be inverted on a reduce-scatter's row shard (FSDP), so the product cannot run it.

    Every `refresh_every` optimizer steps each managed weight gets the dense whitening of its
    momentum's input-side factor M^T M / out (R) and output-side factor M M^T / in (L)
    (`fidelity_sweep`'s `mom2-dense-d1e-2`); the gradient travels as L^-1 G R^-T through the
    product's Euclidean codec (`gift_compile.exchange.collectives.all_reduce`, the same bits on every
    rank) and is mapped back. Identity until the first refresh, like GIFT's maps.
    """

    def __init__(self, model: nn.Module, config: GiftConfig, optimizer: torch.optim.Optimizer, world: int):
        self.config, self.optimizer, self.world = config, optimizer, world
        linears = eligible_linears(model, world, min_numel=config.min_numel, excluded=config.is_excluded,
                                   split_rows=False)
        self.weights = {name: m.weight for name, m in linears}
        self.maps = {name: (Transform("dense", w.shape[0]), Transform("dense", w.shape[1]))
                     for name, w in self.weights.items()}
        self.rest = [p for p in model.parameters() if all(p is not w for w in self.weights.values())]
        self.steps = 0

    def sync(self) -> None:
        """All-reduce: managed weights through the two-sided codec, the rest in fp32."""
        for name, w in self.weights.items():
            left, right = self.maps[name]
            w.grad.copy_(two_sided_round_trip(w.grad, left, right, lambda x: all_reduce(x, dist.group.WORLD, self.config)))
        _allreduce_fp32(self.rest, self.world)

    def step(self) -> None:
        """After the optimizer step: rebuild both maps from the momentum every refresh."""
        self.steps += 1
        if self.steps % self.config.refresh_every:
            return
        for name, w in self.weights.items():
            m = self.optimizer.state[w]["momentum_buffer"]
            left, right = self.maps[name]
            left.refresh_from(gradient_factor(m.t()), self.config.damping)
            right.refresh_from(gradient_factor(m), self.config.damping)


def _allreduce_fp32(params: list[torch.Tensor], world: int) -> None:
    """Mean of the gradients of `params` over the ranks, in fp32, as one flat all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce_(flat, dist.group.WORLD)  # keeps `flat` referenced past gloo's release (gift_compile.sync)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


# the last few tensors handed to a gloo collective here: gloo's worker thread drops its reference a
# moment after `wait` returns, and if that is the last one while the process exits, the process
# aborts ("terminate called without an active exception"; `gift_compile.sync` explains)
_KEEP: deque[torch.Tensor] = deque(maxlen=4)


def _replicas_identical(model: nn.Module) -> bool:
    """True when every rank holds bit-identical parameters (max and min of a checksum agree)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    check = torch.stack([flat.sum(), (flat * torch.arange(flat.numel(), dtype=torch.float64)).sum()])
    both = torch.cat([check, -check])
    _KEEP.append(both)  # gloo's worker releases it after wait returns: never the last reference (gift_compile.sync)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return bool((both[:2] == -both[2:]).all())


class ShardedTwin:
    """The reduce-scatter path: the model's FSDP2 twin (`fully_shard` per transformer block and
    at the root, 1-D mesh over the world) runs forward and backward, so its gradients are
    reduce-scattered by FSDP2 (by `gift_compile.frameworks.fsdp2.GiftReduceScatter` once `apply` runs on
    the twin: ONE quantization per gradient, no re-encoded second hop).

    The optimizer keeps stepping the plain model: after the backward each reduced shard is
    all-gathered exactly (fp32, `DTensor.full_tensor`) into the plain model's `.grad`, the same
    clipping and optimizer step run as on the all-reduce path, and the new parameters are
    copied back into the twin's shards. For AdamW (elementwise) this is the update FSDP2's
    sharded optimizer computes; for Muon it is what a distributed Muon does (orthogonalize the
    gathered matrix), and it keeps the optimizer code, `Fp32Muon` included, identical on both
    paths, so the paired difference between paths is the gradient communication alone.
    """

    def __init__(self, model: nn.Module, rank: int, world: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.model, self.rank, self.world = model, rank, world
        self.module = copy.deepcopy(model)
        mesh = init_device_mesh("cpu", (world,))
        for block in self.module.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.module, mesh=mesh)
        self.pairs = [(p, dict(self.module.named_parameters())[n]) for n, p in model.named_parameters()]

    def read_optimizer_state(self, state: GiftState, optimizer: torch.optim.Optimizer) -> None:
        """Point a geometry built from the optimizer's state (`second_moment`) at the plain
        model's state: the optimizer steps the plain model, so the twin's parameters have none.
        Every rank holds that state whole and identical, so each layer's factor is the exact
        full one (not a row shard's), and the owner's broadcast keeps the maps bit-identical."""
        cls = geometry_class(state.config.geometry)
        if cls.needs_optimizer:
            plain = dict(self.model.named_parameters())
            state.grad_source = cls.factor_source(plain.__getitem__, optimizer, lambda: state.steps)

    def gather_grads(self) -> None:
        """Every rank's plain model gets the full reduced gradient (an exact fp32 all-gather)."""
        for plain, shard in self.pairs:
            plain.grad = shard.grad.full_tensor()
            shard.grad = None

    @torch.no_grad()
    def push_params(self) -> None:
        """Copy the plain model's parameters into this rank's shards (FSDP2 splits dim 0 like
        `torch.chunk`)."""
        for plain, shard in self.pairs:
            local = shard.to_local()
            piece = plain.detach().chunk(self.world, dim=0)[self.rank]
            if piece.shape != local.shape:
                raise RuntimeError(f"reduce-scatter path: shard of shape {tuple(local.shape)} does not match "
                                   f"torch.chunk's {tuple(piece.shape)}; cannot copy the update back")
            local.copy_(piece)


def _train(opt_name: str, arm: str, seed: int, s: ConvergenceSettings, paths: corpus.CorpusPaths,
           rank: int, world: int) -> dict[str, object]:
    """One run of `arm`; an arm with `-tf32` / `-bf16` runs inside the tensor-core map
    emulation (`bench.fidelity.map_emulation`) and records how many maps ran emulated, raising if none
    did (the arm would have been the exact map under another name)."""
    precision = emulated_precision(arm)
    if precision is None:
        return _train_run(opt_name, arm, seed, s, paths, rank, world)
    with tensor_core_map(precision) as emulation:
        result = _train_run(opt_name, arm, seed, s, paths, rank, world)
    if not emulation.calls:
        raise RuntimeError(f"arm {arm!r}: no low-rank map ran through the {precision} emulation (no layer whitened "
                           "by a low-rank map?)")
    result["map_emulation"] = {"precision": precision, "mantissa_bits": MANTISSA_BITS[precision],
                               "calls": emulation.calls}
    return result


def _train_run(opt_name: str, arm: str, seed: int, s: ConvergenceSettings, paths: corpus.CorpusPaths,
               rank: int, world: int) -> dict[str, object]:
    model = TinyLlama(s.model, seed=seed)
    config = arm_config(arm, s, seed)
    optimizers, peaks = make_optimizers(model, opt_name, s.lr, s.muon_lr)
    reports_before = reports_seen()
    two_sided = TwoSided(model, config, optimizers[0], world) if "two" in arm.split("-")[2:] else None
    sharded = ShardedTwin(model, rank, world) if s.path == "reduce-scatter" else None
    gift_model = sharded.module if sharded is not None else model
    config = resolve_arm_auto(config, model, optimizers, split_rows=sharded is not None)
    if config is not None and two_sided is None:  # the first optimizer drives GIFT's state (health check, refresh)
        # fuse=False: the FSDP2 hook's codec runs eagerly, as the eager all-reduce path's does (no per-run compile)
        gift_compile.apply(gift_model, config, group=dist.group.WORLD, optimizer=optimizers[0], fuse=False)
        if sharded is not None:
            sharded.read_optimizer_state(gift_compile.state(gift_model), optimizers[0])
    forward = sharded.module if sharded is not None else (torch.compile(model) if s.compile else model)
    tokens = corpus.token_stream("train", paths)
    losses: list[float] = []
    evals: list[tuple[int, float]] = []
    start = time.perf_counter()
    data = language_modeling.batches(tokens, s.local_batch * world, s.seq_len, seed=seed, rank=rank, world_size=world,
                          steps=s.steps)
    params = list(model.parameters())
    sync: Callable[[], None] | None = None  # None: GIFT's backward hooks all-reduce the gradients
    if sharded is not None:
        sync = sharded.gather_grads
    elif two_sided is not None:
        sync = two_sided.sync
    elif config is None:
        sync = functools.partial(_allreduce_fp32, params, world)
    for step, (x, y) in enumerate(data):
        value = train_step(forward, params, optimizers, peaks, step, s.steps, s.warmup, x, y, sync)
        if sharded is not None:
            sharded.push_params()
        if two_sided is not None:
            two_sided.step()
        losses.append(float(value))
        if (step + 1) % s.eval_every == 0 or step + 1 == s.steps:
            if rank == 0:
                evals.append((step + 1, language_modeling.bits_per_byte(model, "val", paths, seq_len=s.seq_len,
                                                             max_tokens=s.eval_tokens)))
            dist.barrier()
    result: dict[str, object] = {
        "optimizer": opt_name, "arm": arm, "seed": seed, "path": s.path, "world": world, "steps": s.steps,
        "losses": losses, "evals": evals,
        "optimizer_classes": [type(o).__name__ for o in optimizers],
        "seconds": time.perf_counter() - start, "replicas_identical": _replicas_identical(model),
    }
    if config is not None and two_sided is None:
        state = gift_compile.state(gift_model)
        totals = state.comm_totals()
        result["wire_bytes_per_step"] = totals["wire"] / s.steps
        result["baseline_bytes_per_step"] = totals["baseline"] / s.steps
        result["managed_layers"] = len(state.layers)
        # the frontier's x axis: bits per managed element from the collectives' own byte counts
        result["managed_elements"] = sum(math.prod(layer.shape) for layer in state.layers.values())
        result["selected_layers"] = sum(layer.selected for layer in state.layers.values())
        result["geometry"] = state.config.geometry  # as resolved (`-geo`: chosen from the optimizer)
        result["select_metric"] = state.config.select_metric
        if s.compile:  # what the FX pass did to this arm's graphs
            reports = last_reports(since=reports_before)
            result["pass_rewritten"] = sum(len(r.layers) for r in reports)
            result["pass_fallbacks"] = sum(len(r.fallbacks) for r in reports)
        gift_compile.remove(gift_model)
    return result


def _worker(rank: int, world: int, store_path: str, s: ConvergenceSettings, paths: corpus.CorpusPaths,
            jsonl: str, log_every_run: bool, done: frozenset[RunKey] = frozenset()) -> None:
    """One rank: every (seed, optimizer, arm) not in `done` (`run_key`s), seeds outermost so
    every arm reaches n seeds before any reaches n + 1; rank 0 appends each run to `jsonl`."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        for seed in s.seeds:
            for opt_name, arms in s.arms:
                for arm in arms:
                    if settings_key(s, opt_name, seed, arm) in done:
                        continue
                    res = _train(opt_name, arm, seed, s, paths, rank, world)
                    curves = [None] * world
                    dist.all_gather_object(curves, res["losses"])
                    if rank == 0:
                        res["losses"] = [statistics.fmean(v) for v in zip(*curves)]  # global-batch loss
                        with open(jsonl, "a") as f:
                            f.write(json.dumps(res) + "\n")
                        if log_every_run:
                            print(f"    [{opt_name} seed {seed} {arm}] held-out bits/byte {res['evals'][-1][1]:.4f} "
                                  f"({res['seconds']:.0f} s)", flush=True)
    finally:
        dist.destroy_process_group()
    # Every run is written: leave before interpreter finalization (`gift_compile.sync`).
    exit_without_finalization(0)


def run(s: ConvergenceSettings, paths: corpus.CorpusPaths, log: Log, jsonl: Path | None = None) -> dict[str, object]:
    """Train every (seed, optimizer, arm) on `s.world` gloo ranks and summarise (see module doc).

    `jsonl` (default: a temporary file) receives one line per finished run.
    """
    check_settings(s)
    n_runs = len(s.seeds) * sum(len(a) for _, a in s.arms)
    log(f"  {len(s.seeds)} seed(s) x {n_runs // len(s.seeds)} (optimizer, arm) runs x {s.steps} steps on {s.world} "
        f"gloo ranks ({s.local_batch}x{s.seq_len} tokens per rank per step, {'compiled' if s.compile else 'eager'})")
    with tempfile.TemporaryDirectory() as tmp:
        path = str(jsonl) if jsonl is not None else os.path.join(tmp, "runs.jsonl")
        if jsonl is not None and os.path.exists(path):
            os.remove(path)
        mp.spawn(_worker, args=(s.world, os.path.join(tmp, "store"), s, paths, path, n_runs > 8),
                 nprocs=s.world, join=True)
        with open(path) as f:
            runs = [json.loads(line) for line in f if line.strip()]
    return summarise(runs, s)


def main(argv: list[str] | None = None) -> None:
    """Stream study runs into a JSONL file, resuming: runs already in the file are skipped, so
    a background study can be stopped and restarted. Summarise with
    `python -m bench.run --only convergence --merge --convergence-runs <file> ...`."""
    import argparse

    from bench.lib.settings import profile

    p = argparse.ArgumentParser(prog="python -m bench.convergence.runner", description=main.__doc__.splitlines()[0])
    p.add_argument("--profile", choices=("smoke", "quick", "full"), default="full")
    p.add_argument("--path", choices=PATHS, required=True)
    p.add_argument("--seeds", required=True, help="comma-separated seeds, outermost loop")
    p.add_argument("--arms", required=True, help="'muon=fp32,euclid-int2;adamw=fp32,gift-int2' (in run order)")
    p.add_argument("--jsonl", type=Path, required=True, help="appended to; runs already in it are skipped")
    p.add_argument("--world", type=int, default=None,
                   help="ranks (default: the profile's); the global batch stays the profile's, so every rank count "
                        "trains on the same data per step")
    p.add_argument("--steps", type=int, default=None,
                   help="steps (default: the profile's); warmup and evaluation interval scale with them")
    args = p.parse_args(argv)
    arms = tuple((opt, tuple(a.split(","))) for opt, a in (part.split("=") for part in args.arms.split(";")))
    s = dataclasses.replace(profile(args.profile).convergence, path=args.path, arms=arms,
                            seeds=tuple(int(x) for x in args.seeds.split(",")))
    s = rescaled(s, world=args.world or s.world, steps=args.steps or s.steps)
    check_settings(s)
    done = frozenset(run_key(json.loads(line)) for line in args.jsonl.read_text().splitlines() if line.strip()) \
        if args.jsonl.exists() else frozenset()
    paths = corpus.prepare()
    todo = len(s.seeds) * sum(len(a) for _, a in s.arms) - sum(
        settings_key(s, o, seed, a) in done for seed in s.seeds for o, arms_ in s.arms for a in arms_)
    print(f"{todo} runs to do on the {s.path} path, {s.world} ranks, {s.steps} steps ({len(done)} already in "
          f"{args.jsonl})", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(s.world, os.path.join(tmp, "store"), s, paths, str(args.jsonl), True, done),
                 nprocs=s.world, join=True)


if __name__ == "__main__":
    main()
