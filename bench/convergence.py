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
CI and the minimum detectable effect (`bench.stats`); per bit width and EF setting, the gap
Euclidean leaves and the share of it GIFT closes. Runs write one JSON line each as they finish
(`jsonl` next to the results), so a long profile can be inspected, or rendered, while it runs.
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
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import gift_compile
from bench.fidelity import two_sided_round_trip
from bench.reference import make_optimizers, train_step
from bench.settings import ConvergenceSettings
from bench.stats import holm, paired, ratio_ci
from bench.tiny_llama import TinyLlama
from gift_compile.exchange.collectives import all_reduce
from gift_compile.api import eligible_linears, managed_weights, resolve_auto
from gift_compile.config import GiftConfig
from gift_compile.codec import FormatSpec
from gift_compile.geometry.table import geometry_class
from gift_compile.sync import exit_without_finalization
from gift_compile.geometry import Transform, gradient_factor
from gift_compile.passes import last_reports, reports_seen
from gift_compile.runtime.state import GiftState
from gift_compile.sync import all_reduce_
from gift_compile.torchtitan_ext import corpus

Log = Callable[[str], None]

# short format name -> GiftConfig keyword arguments (and the order of the bit-width axis)
FORMATS: dict[str, dict[str, object]] = {
    "fp8": {"format": "fp8_e4m3", "scaling": "row"},
    "int6": {"format": "int6", "block_size": 32},
    "nvfp4": {"format": "nvfp4"},
    "int4": {"format": "int4", "block_size": 32},
    "int3": {"format": "int3", "block_size": 32},
    "int2": {"format": "int2", "block_size": 32},
    "ternary": {"format": "ternary", "block_size": 32},
}


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GiftConfig)}

# arm suffixes beyond `-ef` (the tuning runs): what each changes in the GIFT config
MODIFIERS: dict[str, dict[str, object]] = {
    "sr": {"stochastic_rounding": True},
    "dense": {"geometry": "dense"},
    "exact": {"statistics": "dense"},
    "r64": {"rank": 64},
    "rf5": {"refresh_every": 5},
    "grad": {"geometry": "gradient"},
    # the low-rank map built from the optimizer's momentum (what Muon orthogonalizes)
    "mom": {"geometry": "momentum"},
    # damping 1e-2 instead of 1e-3 (the fidelity sweep's best momentum candidate, `mom-r32-d1e-2`)
    "d2": {"damping": 1e-2},
    # the product's measured selection (`select="auto"`, default metric) instead of every layer whitened
    "auto": {"select": "auto"},
    # input columns scaled by AdamW's second moment (`geometry="second_moment"`, the sweep's vcol-p1)
    "vsq": {"geometry": "second_moment"},
    # the geometry the product picks for the optimizer (`geometry="auto"`: `geometry_for`)
    "geo": {"geometry": "auto"},
    # EXPERIMENT, not in the product: two-sided dense whitening from the momentum (`TwoSided`)
    "two": {"geometry": "none", "damping": 1e-2},
    # owner-side error feedback on the all-reduce's second hop (all-reduce path only); with
    # `-ef` both hops are compensated
    "ef2": {"second_hop_error_feedback": True},
    # a leaky residual, beta 0.9, on whichever hops have error feedback
    "b9": {"error_feedback_decay": 0.9},
    # what a user gets from `GiftConfig(format=..., geometry="auto")` with `optimizer=`: the
    # product's defaults for selection (measured, metric chosen from the optimizer), refresh
    # cadence and rank, instead of the study's every-layer, refresh-20 arms
    "dflt": {"geometry": "auto", **{f: _DEFAULTS[f] for f in ("select", "select_metric", "refresh_every",
                                                              "refresh_warmup", "rank")}},
    # the selection metric before it was chosen from the optimizer (plain L2 for every optimizer)
    "euc": {"select_metric": "euclidean"},
    # no refresh warm-up: refreshes only at multiples of refresh_every (the schedule before the
    # warm-up existed; every study arm without `-dflt` runs so, to keep its meaning)
    "nowarm": {"refresh_warmup": 0},
}


# the modifiers that change only GIFT's map (the rest, `sr`, `ef2`, `b9`, change the codec both
# geometries share): a GIFT arm with them is compared with the Euclidean arm without them
MAP_MODIFIERS = frozenset({"dense", "exact", "r64", "rf5", "grad", "mom", "d2", "auto", "vsq", "geo", "two", "dflt",
                           "euc", "nowarm"})
assert MAP_MODIFIERS <= MODIFIERS.keys()


def parse_arm(arm: str) -> tuple[str, str | None, bool]:
    """`(side, format short name, error feedback)` of an arm name (`fp32`: no format); the
    side is `euclid`, `gift` or `fp32`, the arm's coordinates (not a geometry name).

    Names are `fp32` or `(euclid|gift)-<format>[-ef][-<modifier>...]`, modifiers from
    `MODIFIERS` (stochastic rounding, dense whitening, exact statistics, rank 64, refresh
    every 5 steps, gradient-side geometry, momentum-side geometry, damping 1e-2, measured
    selection, the two-sided experiment, AdamW's second-moment column scaling, the geometry
    chosen from the optimizer, second-hop error feedback, a decaying residual, the product's
    defaults, the plain-L2 selection metric, no refresh warm-up).
    """
    if arm == "fp32":
        return "fp32", None, False
    parts = arm.split("-")
    if (len(parts) < 2 or parts[0] not in ("euclid", "gift") or parts[1] not in FORMATS
            or any(p not in MODIFIERS and p != "ef" for p in parts[2:])):
        raise ValueError(f"unknown convergence arm {arm!r}: expected fp32 or (euclid|gift)-<format>[-ef][-mod...], "
                         f"format one of {sorted(FORMATS)}, modifiers {sorted(MODIFIERS)}")
    return parts[0], parts[1], "ef" in parts[2:]


def arm_config(arm: str, s: ConvergenceSettings, seed: int) -> GiftConfig | None:
    side, fmt, ef = parse_arm(arm)
    if fmt is None:
        return None
    gift = {"geometry": "lowrank", "select": "all", "rank": s.rank} if side == "gift" else {"geometry": "none"}
    extra = {"refresh_every": s.refresh_every, "refresh_warmup": 0}  # the study's fixed cadence
    for mod in arm.split("-")[2:]:
        extra.update(MODIFIERS.get(mod, {}))
    return GiftConfig(**{**FORMATS[fmt], **gift, "error_feedback": ef, "seed": seed, **extra})


def bits_per_element(fmt: str, cols: int = 512) -> float:
    """Exact wire bits per managed element of a format (payload + scales) at width `cols`."""
    kw = FORMATS[fmt]
    return FormatSpec(str(kw["format"]), str(kw.get("scaling", "row")), int(kw.get("block_size", 32))).bits_per_element(cols, 64)


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
        self.weights = {name: m.weight for name, m in eligible_linears(model, config, world, split_rows=False)}
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


def _resolve_auto(config: GiftConfig | None, model: nn.Module, optimizers: list[torch.optim.Optimizer], *,
                  split_rows: bool) -> GiftConfig | None:
    """The arm's `geometry="auto"` / `select_metric="auto"` chosen as `apply` chooses them
    (`gift_compile.api.resolve_auto`) from the optimizers that step the plain model's managed
    weights: here rather than in `apply`, because on the reduce-scatter path GIFT is applied to
    the twin, whose parameters no optimizer steps."""
    if config is None:
        return None
    return resolve_auto(config, optimizers, managed_weights(model, config, dist.group.WORLD, split_rows=split_rows))


def _train(opt_name: str, arm: str, seed: int, s: ConvergenceSettings, paths: corpus.CorpusPaths,
           rank: int, world: int) -> dict[str, object]:
    model = TinyLlama(s.model, seed=seed)
    config = arm_config(arm, s, seed)
    optimizers, peaks = make_optimizers(model, opt_name, s.lr, s.muon_lr)
    reports_before = reports_seen()
    two_sided = TwoSided(model, config, optimizers[0], world) if "two" in arm.split("-")[2:] else None
    sharded = ShardedTwin(model, rank, world) if s.path == "reduce-scatter" else None
    gift_model = sharded.module if sharded is not None else model
    config = _resolve_auto(config, model, optimizers, split_rows=sharded is not None)
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
    data = corpus.batches(tokens, s.local_batch * world, s.seq_len, seed=seed, rank=rank, world_size=world,
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
                evals.append((step + 1, corpus.bits_per_byte(model, "val", paths, seq_len=s.seq_len,
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


PATHS = ("all-reduce", "reduce-scatter")


RunKey = tuple[str, int, int, str, int, str]


def run_key(record: dict) -> RunKey:
    """`(path, world, steps, optimizer, seed, arm)` of a run record. Records written before a
    field existed: the path is all-reduce, the world 2 ranks (every earlier run), the steps the
    length of the loss curve."""
    return (record.get("path", "all-reduce"), record.get("world", 2), record.get("steps", len(record["losses"])),
            record["optimizer"], record["seed"], record["arm"])


def settings_key(s: ConvergenceSettings, opt: str, seed: int, arm: str) -> RunKey:
    """The `run_key` the run of `(opt, seed, arm)` under settings `s` will have."""
    return s.path, s.world, s.steps, opt, seed, arm


def study(record: dict, s: ConvergenceSettings) -> str:
    """The study a run belongs to: its path, qualified by the ranks and steps where they differ
    from the settings' (the 4-rank subset, the longer confirmation), so runs of different
    designs are never paired with each other."""
    path, world, steps = run_key(record)[:3]
    return path + (f", {world} ranks" if world != s.world else "") + (f", {steps} steps" if steps != s.steps else "")


def rescaled(s: ConvergenceSettings, *, world: int, steps: int) -> ConvergenceSettings:
    """`s` on `world` ranks for `steps` steps, the same experiment otherwise: the global batch
    is kept (each rank takes its share of the same sequences, `corpus.batches`), warmup and
    the evaluation interval keep their share of the run. Raises where the batch cannot split."""
    global_batch = s.local_batch * s.world
    if world < 1 or global_batch % world:
        raise ValueError(f"cannot split the global batch of {global_batch} sequences over {world} ranks")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return dataclasses.replace(s, world=world, local_batch=global_batch // world, steps=steps,
                               warmup=max(1, round(s.warmup * steps / s.steps)),
                               eval_every=max(1, round(s.eval_every * steps / s.steps)))


def check_settings(s: ConvergenceSettings) -> None:
    """Raise, naming the problem, for settings a run could not honour (before any run starts)."""
    if s.path not in PATHS:
        raise ValueError(f"unknown convergence path {s.path!r}; allowed: {', '.join(PATHS)}")
    for _, arms in s.arms:
        for arm in arms:
            parse_arm(arm)
            mods = arm.split("-")[2:]
            if s.path == "reduce-scatter" and ("two" in mods or "mom" in mods):
                raise ValueError(f"arm {arm!r} cannot run on the reduce-scatter path: the optimizer steps the plain "
                                 "model (`ShardedTwin`), so a map built from the optimizer's momentum or the two-sided "
                                 "experiment has no state on the FSDP2 twin")
            if s.path == "reduce-scatter" and "ef2" in mods:
                raise ValueError(f"arm {arm!r} cannot run on the reduce-scatter path: a reduce-scatter has no second "
                                 "hop for second-hop error feedback to correct")
            arm_config(arm, s, 0)  # invalid combinations (a decay without any error feedback) fail here
    if s.path == "reduce-scatter" and s.compile:
        raise ValueError("the reduce-scatter path runs eager (FSDP2's reduce-scatter runs from eager hooks)")


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


def summarise(runs: list[dict], s: ConvergenceSettings) -> dict[str, object]:
    """Per study (`all-reduce` / `reduce-scatter`, or one of them at other ranks or steps:
    `study`), per optimizer: per-arm paired statistics and per-(bit width, EF) gaps from
    finished runs. `paths` is keyed by study (each entry names its collective path); `world`
    and `steps` are the settings' own.

    Every run is either summarised or listed under `excluded` with the reason. Arms come from
    `s.arms` (in that order) plus any other arm found in the runs (at whatever n it has), so a
    run outside the profile's arm list is shown rather than silently dropped. `optimizers` is
    the all-reduce path's summary (the study's first path) or, without all-reduce runs, the
    only path's.
    """
    used: dict[tuple[str, str, int, str], dict] = {}
    excluded: list[dict[str, object]] = []

    def key_of(r: dict) -> tuple[str, str, int, str]:
        return study(r, s), r["optimizer"], r["seed"], r["arm"]

    keys = {key_of(r) for r in runs}
    for r in runs:
        r.setdefault("path", "all-reduce")  # records written before the path existed
        tail = r["losses"][-max(1, len(r["losses"]) // 10):]
        r["final_train_loss"] = statistics.fmean(tail)
        r["final_bpb"] = r["evals"][-1][1]
        if "geometry" not in r and r["arm"] != "fp32":  # recorded before the field: the arm's configured map
            r["geometry"] = arm_config(r["arm"], s, r["seed"]).geometry
        key = key_of(r)
        if key in used:
            excluded.append({"key": list(key), "reason": "duplicate of an earlier run with the same study, optimizer, "
                                                          "seed and arm (the first is used)"})
        elif (key[0], key[1], key[2], "fp32") not in keys:
            excluded.append({"key": list(key), "reason": "no fp32 run of the same seed, optimizer and study to pair with"})
        else:
            used[key] = r
    arm_order = {opt: list(arms) for opt, arms in s.arms}
    for _, opt, _, arm in used:
        arm_order.setdefault(opt, ["fp32"])
        if arm not in arm_order[opt]:
            arm_order[opt].append(arm)
    paths = {}
    found = {k[0] for k in used}
    for label in [*(p for p in PATHS if p in found), *sorted(found - set(PATHS))]:
        mine = {k: r for k, r in used.items() if k[0] == label}
        paths[label] = {"path": next(iter(mine.values()))["path"], "seeds": sorted({k[2] for k in mine}),
                        "runs": len(mine), "optimizers": _per_optimizer(mine, arm_order)}
    primary = "all-reduce" if "all-reduce" in paths else next(iter(paths), None)
    between: dict[str, dict[str, dict]] = {}  # reduce-scatter minus all-reduce, same seed (same init and data)
    for (path, opt, seed, arm), r in used.items():
        other = used.get(("all-reduce", opt, seed, arm))
        if path == "reduce-scatter" and other is not None:
            between.setdefault(opt, {}).setdefault(arm, []).append(r["final_bpb"] - other["final_bpb"])
    return {
        "mode": "compiled" if s.compile else "eager", "world": s.world, "steps": s.steps,
        "tokens_per_step": s.world * s.local_batch * s.seq_len, "seeds": sorted({k[2] for k in used}),
        "arms": arm_order, "runs": runs, "excluded": excluded, "paths": paths, "primary_path": primary,
        "optimizers": paths[primary]["optimizers"] if primary else {},
        "rs_minus_ar": {opt: {arm: paired(d).as_dict() for arm, d in arms.items()} for opt, arms in between.items()},
        "optimizer_classes": _optimizer_classes(runs, list(arm_order), s),
        "default_geometry": {opt: default_geometry(opt, s) for opt in arm_order},
        "gift_config": {"rank": s.rank, "refresh_every": s.refresh_every, "select": "all", "geometry": "lowrank"},
        "all_replicas_identical": all(r["replicas_identical"] for r in runs),
    }


def default_geometry(opt: str, s: ConvergenceSettings) -> str:
    """The geometry the product picks for optimizer `opt` (`geometry="auto"`), resolved as a
    `-geo` run resolves it: the GIFT arm that records this geometry and no codec modifier is the
    product's per-optimizer default in the study."""
    model = TinyLlama(s.model, seed=0)
    optimizers, _ = make_optimizers(model, opt, s.lr, s.muon_lr)
    config = _resolve_auto(arm_config("gift-nvfp4-geo", s, 0), model, optimizers, split_rows=False)
    assert config is not None
    return config.geometry


def _optimizer_classes(runs: list[dict], opts: list[str], s: ConvergenceSettings) -> dict[str, dict[str, object]]:
    """The optimizer classes each optimizer name ran as: recorded per run, or (runs recorded
    before the field existed, all on CPU) what `make_optimizers` builds for a CPU model."""
    out = {}
    for opt in opts:
        recorded = {tuple(r["optimizer_classes"]) for r in runs if r["optimizer"] == opt and "optimizer_classes" in r}
        if recorded:
            out[opt] = {"classes": sorted({c for t in recorded for c in t}), "source": "recorded in the runs"}
        else:
            built, _ = make_optimizers(TinyLlama(s.model, seed=0), opt, s.lr, s.muon_lr)
            out[opt] = {"classes": [type(o).__name__ for o in built],
                        "source": "not recorded; what make_optimizers builds on CPU, where every run of this study ran"}
    return out


def _per_optimizer(by: dict[tuple[str, str, int, str], dict], arm_order: dict[str, list[str]]) -> dict[str, dict]:
    """Per optimizer: paired statistics per arm, the gaps, the verdict (runs of one path)."""
    seeds = sorted({k[2] for k in by})
    path = next(iter(by))[0]
    per_opt: dict[str, dict[str, object]] = {}
    for opt_name, arms in arm_order.items():
        summary, gaps = {}, {}

        def bpb(seed: int, arm: str) -> float:
            return by[(path, opt_name, seed, arm)]["final_bpb"]

        def have(seed: int, arm: str) -> bool:
            return (path, opt_name, seed, arm) in by

        for arm in arms:
            done = [seed for seed in seeds if have(seed, arm) and have(seed, "fp32")]
            if not done:
                continue
            diff = [bpb(seed, arm) - bpb(seed, "fp32") for seed in done]
            _, fmt, _ = parse_arm(arm)
            summary[arm] = {
                "bits": 32.0 if fmt is None else bits_per_element(fmt),
                "final_bpb": statistics.fmean(bpb(seed, arm) for seed in done), "n": len(done), "seeds": done,
                "paired_diff_bpb": paired(diff).as_dict(),
                "seconds": statistics.fmean(by[(path, opt_name, seed, arm)]["seconds"] for seed in done),
                # the geometry the runs resolved (`-geo`: chosen from the optimizer); None for fp32
                "geometry": by[(path, opt_name, done[0], arm)].get("geometry"),
                # the selection metric the runs resolved and the layers their selection kept at the
                # end (mean over seeds); absent for runs recorded before the fields existed
                **_selection(by[(path, opt_name, seed, arm)] for seed in done),
            }
        for arm in arms:
            side, fmt, ef = parse_arm(arm)
            twin = "-".join(["euclid", *arm.split("-")[1:]]) if side == "gift" else ""
            if twin not in summary:  # GIFT-only modifiers (dense, rank, ...): the twin keeps only the codec's
                twin = "-".join(["euclid", *(p for p in arm.split("-")[1:] if p not in MAP_MODIFIERS)])
            if side != "gift" or twin not in summary or arm not in summary:
                continue
            done = [seed for seed in seeds if have(seed, arm) and have(seed, twin)]
            g_minus_e = [bpb(seed, arm) - bpb(seed, twin) for seed in done]
            gap_e, gap_g = summary[twin]["paired_diff_bpb"]["mean"], summary[arm]["paired_diff_bpb"]["mean"]
            with_ref = [seed for seed in done if have(seed, "fp32")]
            closed = ratio_ci([bpb(seed, twin) - bpb(seed, arm) for seed in with_ref],
                              [bpb(seed, twin) - bpb(seed, "fp32") for seed in with_ref])
            gaps[arm.removeprefix("gift-")] = {
                "format": fmt, "error_feedback": ef, "bits": summary[arm]["bits"],
                "euclid_minus_fp32": summary[twin]["paired_diff_bpb"], "gift_minus_fp32": summary[arm]["paired_diff_bpb"],
                "gift_minus_euclid": paired(g_minus_e).as_dict(),
                # a share of a gap only where that gap is resolved (its CI excludes zero): at n=1 or an
                # unresolved Euclidean cost the ratio is noise over noise
                "share_closed": 1.0 - gap_g / gap_e if gap_e > 0 and summary[twin]["paired_diff_bpb"]["resolved"]
                else float("nan"),
                # Fieller 95% CI of (Euclidean - GIFT) / (Euclidean - fp32); None: unbounded
                "share_closed_ci95": None if closed is None else list(closed),
            }
        if summary:
            per_opt[opt_name] = {"arms": summary, "gaps": gaps, "verdict": _verdict(summary, gaps),
                                 "defaults": _defaults_vs_study(summary, bpb, have, seeds)}
    return per_opt


def _defaults_vs_study(summary: dict, bpb: Callable[[int, str], float], have: Callable[[int, str], bool],
                       seeds: list[int]) -> dict[str, dict[str, object]]:
    """Per `-dflt` arm (the product's defaults): its paired difference in held-out bits/byte to
    the study's arm of the same map on every layer (`gift-<fmt>[-ef]`, or `-geo` where the
    default resolved the optimizer's geometry) and, where run, to the same default judged by
    the plain-L2 metric (`-euc`). The comparisons of one optimizer and study form one family:
    `holm_rejects` is Holm's 5% family-wise decision on each paired t test's p-value."""
    rows: dict[str, dict[str, object]] = {}
    for arm, v in summary.items():
        parts = arm.split("-")
        if parts[0] != "gift" or "dflt" not in parts or "euc" in parts:
            continue
        base = [p for p in parts if p not in ("dflt", "nowarm")]  # the study's arms have no warm-up
        study = next((a for a in ("-".join(base), "-".join([*base, "geo"]))
                      if a in summary and summary[a].get("geometry") == v.get("geometry")), None)
        plain = next((a for a in summary if set(a.split("-")) == {*parts, "euc"}), None)  # any modifier order
        for other, label in ((study, "study"), (plain, "plain_metric")):
            if other is None or other not in summary:
                continue
            done = [seed for seed in seeds if have(seed, arm) and have(seed, other)]
            rows.setdefault(arm, {})[label] = {"arm": other, **paired([bpb(x, arm) - bpb(x, other) for x in done]).as_dict()}
    tests = [(arm, label) for arm, cmp in rows.items() for label in cmp if cmp[label]["n"] > 1]
    for (arm, label), rejects in zip(tests, holm([rows[arm][label]["p"] for arm, label in tests])):
        rows[arm][label]["holm_rejects"] = rejects
    return rows


def _selection(records: Iterable[dict]) -> dict[str, object]:
    """`select_metric`, mean `selected_layers` and `managed_layers` of an arm's runs, where recorded."""
    rs = [r for r in records if "selected_layers" in r]
    if not rs:
        return {}
    return {"select_metric": rs[0].get("select_metric"), "managed_layers": rs[0]["managed_layers"],
            "selected_layers": statistics.fmean(r["selected_layers"] for r in rs)}


def _verdict(summary: dict, gaps: dict) -> dict[str, object]:
    """Per EF setting, the widest bit width at which Euclidean costs loss, GIFT's share of that
    gap (with its Fieller CI); and the arms that are resolved positive controls.

    "Costs loss" is a claim picked from a family (every study bit width of that EF setting),
    so it is made only where Holm's procedure over the family's paired t tests (Euclidean minus
    fp32) rejects at 5% family-wise; `family` lists the tests and their decisions. The no-EF
    answer sits at the top level (`first_costly`, `bits`, `share_closed`, ...), the
    error-feedback answer under `with_ef` in the same shape."""

    def first(ef: bool) -> dict[str, object]:
        keys = [k for k, g in gaps.items() if g["error_feedback"] == ef and _plain(k)
                and g["euclid_minus_fp32"]["n"] >= 2]  # a single seed is no test: outside the family
        pvalues = [gaps[k]["euclid_minus_fp32"]["p"] for k in keys]
        rejected = holm(pvalues)
        family = [{"key": k, "bits": gaps[k]["bits"], "p": p, "holm_rejected": rej,
                   "mean": gaps[k]["euclid_minus_fp32"]["mean"]} for k, p, rej in zip(keys, pvalues, rejected)]
        costly = [(f["bits"], f["key"]) for f in family if f["holm_rejected"] and f["mean"] > 0]
        if not costly:
            return {"first_costly": None, "family": family}
        bits, key = max(costly)
        return {"first_costly": key, "bits": bits, "share_closed": gaps[key]["share_closed"], "family": family,
                "share_closed_ci95": gaps[key]["share_closed_ci95"], "gift_minus_euclid": gaps[key]["gift_minus_euclid"]}

    controls = [a for a, v in summary.items() if v["paired_diff_bpb"]["resolved"] and v["paired_diff_bpb"]["mean"] > 0]
    return {**first(False), "with_ef": first(True), "positive_controls": controls}


def _plain(gap_key: str) -> bool:
    """Whether a gap key (`<format>[-ef]`) is a study arm rather than a tuning variant."""
    return all(p == "ef" for p in gap_key.split("-")[1:])


def main(argv: list[str] | None = None) -> None:
    """Stream study runs into a JSONL file, resuming: runs already in the file are skipped, so
    a background study can be stopped and restarted. Summarise with
    `python -m bench.run --only convergence --merge --convergence-runs <file> ...`."""
    import argparse

    from bench.settings import profile

    p = argparse.ArgumentParser(prog="python -m bench.convergence", description=main.__doc__.splitlines()[0])
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
