"""One rank of the emulated cluster (`bench.cluster.emulated`): every arm of one framework path,
trained side by side from the same initialisation on the same data, timed step by step.

`bench.cluster.emulated` starts one `torchrun --nnodes N --nproc-per-node g --node-rank K` per
network namespace; this module is what each rank runs. `LOCAL_WORLD_SIZE` is then the node's
real rank count, so GIFT's two-level exchange finds the nodes by itself (the `-flat` arms switch
it off with `ranks_per_node=0`). Per arm it builds the model (the same seed), wraps it on the path
(DDP, FSDP2, or HSDP: shard inside the node, replicate across), installs the arm's communication
(a native precision, torch's PowerSGD hook, or `gift_compile.apply` with the arm's config), trains
`warmup + steps` steps of the bench's Muon + AdamW recipe (`bench.lib.reference.train_step`) and
records: every step's wall time on every rank, the global-batch loss curve, the bytes the kernel
counted on the node's link (`/proc/net/dev` of the namespace, read by each node's local rank 0
between barriers around the timed steps) and GIFT's own counters of the bytes handed to its
collectives. Rank 0 appends one JSON line per arm to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import _muon

import gift_compile
from bench.lib.reference import Fp32Muon, _newton_schulz_fp32, make_optimizers, train_step
from bench.lib.tiny_llama import TinyLlama, TinyLlamaConfig
from gift_compile import recipes
from gift_compile.config import GiftConfig
from gift_compile.sync import exit_without_finalization
from gift_compile.torchtitan_ext.cpu import corpus, language_modeling

# The cluster's model: an LLM-shaped member of the bench's Llama family (the corpus tokenizer's
# 4096-token vocabulary), deep and narrow so that the embedding and the head are under 15% of the
# parameters, as in Llama-3-8B (`embedding_share` computes the exact share).
MODEL = TinyLlamaConfig(dim=96, n_layers=42, n_heads=4, vocab_size=corpus.VOCAB_SIZE, multiple_of=32,
                        max_seq_len=64)
# Sequences per rank per step (`--batch`): 16 x 64 = 1024 tokens, nearer an LLM's per-GPU batch
# (thousands of tokens) than a toy's. The compute per step grows with it and the gradient's bytes
# and GIFT's codec do not, so the ratio of the two, not the model alone, sets where a step stands.
LOCAL_BATCH = 16
SEQ_LEN = 64
LR, MUON_LR = 3e-3, 2e-2
RECIPE_FOR_EUCLID = "muon-int2-leaky-ef"  # the frontier's fewest bits: the Euclidean arm runs its format and EF


@dataclass(frozen=True)
class Arm:
    """One arm: its name, the paths it runs on, and its communication (`comm`: "native" with a
    gradient dtype, "powersgd" with a rank, or "gift" with a `GiftConfig`'s fields)."""

    name: str
    comm: str
    paths: tuple[str, ...]
    reduce_dtype: str = "fp32"
    rank: int = 0
    fields: tuple[tuple[str, Any], ...] = ()
    bf16_params: bool = False


PATHS = ("ddp", "fsdp2", "hsdp")
_SHARDED = ("fsdp2", "hsdp")


def _arms() -> dict[str, Arm]:
    out: dict[str, Arm] = {}
    out["fp32"] = Arm("fp32", "native", PATHS)
    out["bf16"] = Arm("bf16", "native", PATHS, reduce_dtype="bf16")
    for r in (2, 4, 8):
        out[f"powersgd-{r}"] = Arm(f"powersgd-{r}", "powersgd", ("ddp",), rank=r)
    euclid = {**recipes.recipe_fields(RECIPE_FOR_EUCLID), "geometry": "none"}
    out["euclid-int2"] = Arm("euclid-int2", "gift", PATHS, fields=tuple(euclid.items()))
    out["euclid-int2-flat"] = Arm("euclid-int2-flat", "gift", ("ddp", "fsdp2"),
                                  fields=tuple({**euclid, "ranks_per_node": 0}.items()))
    # the same codes without the block rotation: with euclid-int2 and the recipe, the unshaped
    # overhead splits into the codec's, the rotation's and the map's with its statistics
    out["euclid-int2-norot"] = Arm("euclid-int2-norot", "gift", PATHS,
                                   fields=tuple({**euclid, "block_rotation": False}.items()))
    for name in ("muon-nvfp4", "muon-int2-leaky-ef"):
        fields = recipes.recipe_fields(name)
        out[name] = Arm(name, "gift", PATHS, fields=tuple(fields.items()))
        out[f"{name}-flat"] = Arm(f"{name}-flat", "gift", ("ddp", "fsdp2"),
                                  fields=tuple({**fields, "ranks_per_node": 0}.items()))
    # HSDP with the shard hop left to FSDP2 (`GiftConfig.shard_hop="native"`): the codes made once,
    # on the replica hop that crosses nodes, from each rank's reduced rows
    for base in ("euclid-int2", "muon-int2-leaky-ef"):
        fields = {**dict(out[base].fields), "shard_hop": "native"}
        out[f"{base}-nativehop"] = Arm(f"{base}-nativehop", "gift", ("hsdp",), fields=tuple(fields.items()))
    # FSDP2 / HSDP with the parameters all-gathered (and computed) at bf16
    for base in ("fp32", "bf16", "muon-int2-leaky-ef"):
        a = out[base]
        out[f"{base}-bf16p"] = Arm(f"{base}-bf16p", a.comm, _SHARDED, a.reduce_dtype, a.rank, a.fields, True)
    return out


ARMS: dict[str, Arm] = _arms()
"""Every arm by name (`bench.cluster.emulated --arms` selects from these)."""


def embedding_share(config: TinyLlamaConfig = MODEL) -> tuple[int, float]:
    """The model's parameter count and the share of it in the embedding and the output head."""
    model = TinyLlama(config, seed=0)
    total = sum(p.numel() for p in model.parameters())
    return total, (model.tok_embeddings.weight.numel() + model.output.weight.numel()) / total


def link_bytes(iface: str) -> tuple[int, int]:
    """(rx, tx) bytes the kernel counted on `iface` in this process's network namespace."""
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    raise RuntimeError(f"emulated cluster: no interface {iface!r} in this namespace's /proc/net/dev")


def _dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def bf16_hook(_: None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's bf16 gradient compression on any backend: the steps of torch's
    `default_hooks.bf16_compress_hook` (the bucket divided by the world, cast to bf16, all-reduced,
    cast back into the bucket), which refuses every backend but NCCL and XCCL."""
    buffer = bucket.buffer()
    compressed = buffer.div(dist.get_world_size()).to(torch.bfloat16)
    fut = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(f.value()[0])
        return buffer
    return fut.then(decompress)


# DDP checks a hook's annotations as objects; this module's are strings (`from __future__ import annotations`)
bf16_hook.__annotations__.update(bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]})


def _gathered_newton_schulz(update: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                            eps: float) -> torch.Tensor:
    """Muon's orthogonalization of a sharded matrix: all-gathered once (fp32), orthogonalized whole
    on every rank, and this rank's shard kept (no scatter: every rank holds the same result)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(update, DTensor):
        return _newton_schulz_fp32(update, ns_coefficients, ns_steps, eps)
    whole = _newton_schulz_fp32(update.full_tensor(), ns_coefficients, ns_steps, eps)
    return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)


class GatheredMuon(Fp32Muon):
    """The bench's Muon on FSDP2's sharded matrices, as distributed Muon implementations run it:
    each matrix's update is all-gathered, orthogonalized whole, and the shard kept. Through
    DTensor's own operators the iteration would redistribute at every product of every step
    (a minute per step here); the momentum and the update stay elementwise on the shard."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        original = _muon._zeropower_via_newtonschulz
        _muon._zeropower_via_newtonschulz = _gathered_newton_schulz
        try:
            return torch.optim.Muon.step(self, closure)
        finally:
            _muon._zeropower_via_newtonschulz = original


def _optimizers(model: nn.Module, sharded: bool) -> tuple[list[torch.optim.Optimizer], list[float]]:
    """The bench's Muon + AdamW (`bench.lib.reference.make_optimizers`) over `model`'s parameters;
    on a sharded model its Muon is `GatheredMuon` with the same parameters and settings."""
    optimizers, peaks = make_optimizers(model, "muon", LR, MUON_LR)
    if sharded:
        muon = optimizers[0]
        optimizers[0] = GatheredMuon(muon.param_groups[0]["params"], **muon.defaults)
    return optimizers, peaks


def _shard(model: TinyLlama, mesh: Any, arm: Arm) -> None:
    """`fully_shard` per transformer block and at the root on `mesh` (1-D: FSDP2, 2-D: native HSDP)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if arm.bf16_params else None,
                                  reduce_dtype=_dtype(arm.reduce_dtype) if arm.comm == "native" else None)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def build(arm: Arm, path: str, model: TinyLlama, warmup: int, fuse: bool = True
          ) -> tuple[nn.Module, list[torch.optim.Optimizer], list[float], Callable[[], dict[str, int]] | None]:
    """`model` wrapped on `path` with `arm`'s communication: the module to run forward on, the
    Muon + AdamW optimizers over the wrapped parameters (FSDP2 replaces them by sharded ones, so
    they are made after the wrap; torch's Muon orthogonalizes a sharded matrix through DTensor,
    which gathers it), their peak learning rates, and a reader of GIFT's cumulative byte counters
    (None for a native or PowerSGD arm). PowerSGD compresses from step `warmup` on (torch's
    `start_powerSGD_iter`, at least 2), with error feedback and warm start. `fuse`: GIFT's codec
    through torch.compile (`gift_compile.apply(fuse=True)`, compiled in the warm-up steps), else eager."""
    world = dist.get_world_size()
    g = int(os.environ["LOCAL_WORLD_SIZE"])
    config = GiftConfig(**dict(arm.fields)) if arm.comm == "gift" else None
    if path == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        optimizers, peaks = _optimizers(model, sharded=False)
        if arm.comm == "native" and arm.reduce_dtype == "bf16":
            ddp.register_comm_hook(None, bf16_hook)
        elif arm.comm == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=arm.rank,
                                       start_powerSGD_iter=max(2, warmup), use_error_feedback=True,
                                       warm_start=True, random_seed=0)
            ddp.register_comm_hook(state, psgd.powerSGD_hook)
        elif config is not None:
            gift_compile.apply(ddp, config, optimizer=optimizers, fuse=fuse)
            return ddp, optimizers, peaks, gift_compile.state(ddp).comm_totals
        return ddp, optimizers, peaks, None
    from torch.distributed.device_mesh import init_device_mesh

    if path == "fsdp2":
        _shard(model, init_device_mesh("cpu", (world,)), arm)
        optimizers, peaks = _optimizers(model, sharded=True)
        if config is not None:
            gift_compile.apply(model, config, optimizer=optimizers, fuse=fuse)
            return model, optimizers, peaks, gift_compile.state(model).comm_totals
        return model, optimizers, peaks, None
    if path != "hsdp":
        raise ValueError(f"emulated cluster: unknown path {path!r}; allowed: {', '.join(PATHS)}")
    mesh = init_device_mesh("cpu", (world // g, g), mesh_dim_names=("replicate", "shard"))
    if config is None:  # native HSDP: FSDP2's own replica all-reduce
        _shard(model, mesh, arm)
        optimizers, peaks = _optimizers(model, sharded=True)
        return model, optimizers, peaks, None
    from gift_compile.api import attach_optimizer, managed_weights, resolve_auto
    from gift_compile.frameworks import fsdp2, hsdp
    from gift_compile.frameworks.routing import manage

    _shard(model, mesh["shard"], arm)  # shard-only mesh: GIFT's replica hop replaces FSDP2's all-reduce
    optimizers, peaks = _optimizers(model, sharded=True)
    config = resolve_auto(config, optimizers, managed_weights(model, config, dist.group.WORLD, split_rows=True))
    state = manage(model, config, dist.group.WORLD, mode="stats", split_rows=True)
    fsdp2.install(model, state, compiled=fuse)
    hsdp.install(model, state, mesh.get_group("replicate"), compiled=fuse)
    attach_optimizer(state, optimizers)

    def totals() -> dict[str, int]:
        hops = hsdp.hop_totals(state)
        refresh = {k: v for k, v in state.comm_totals().items() if k.startswith("refresh_")}
        # the shard hop stays inside a node, the replica hop crosses nodes; the refresh's own keys
        return {"wire": sum(h["wire"] for h in hops.values()), "baseline": sum(h["baseline"] for h in hops.values()),
                "node_wire": hops["shard"]["wire"], "cross_wire": hops.get("replica", {"wire": 0})["wire"], **refresh}
    return model, optimizers, peaks, totals


def run_arm(arm: Arm, path: str, steps: int, warmup: int, iface: str, seed: int,
            tokens: torch.Tensor, fuse: bool = True, batch: int = LOCAL_BATCH) -> dict[str, Any]:
    """Train `arm` on `path` for `warmup + steps` steps; the record of one arm (rank 0's is complete)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_RANK"])
    model = TinyLlama(MODEL, seed=seed)
    forward, optimizers, peaks, gift_totals = build(arm, path, model, warmup, fuse)
    params = list(model.parameters())
    total = warmup + steps
    data = language_modeling.batches(tokens, batch * world, SEQ_LEN, seed=seed, rank=rank, world_size=world,
                                     steps=total)
    times: list[float] = []
    losses: list[float] = []
    link0 = gift0 = None
    for step, (x, y) in enumerate(data):
        if step == warmup:
            dist.barrier()
            link0 = link_bytes(iface) if local == 0 else None
            gift0 = gift_totals() if gift_totals else None
        start = time.perf_counter()
        value = train_step(forward, params, optimizers, peaks, step, total, warmup, x, y)
        times.append(time.perf_counter() - start)
        losses.append(float(value))
    dist.barrier()
    link1 = link_bytes(iface) if local == 0 else None
    gift1 = gift_totals() if gift_totals else None
    mine = {"times": times, "losses": losses,
            "link": None if link0 is None else {"rx": link1[0] - link0[0], "tx": link1[1] - link0[1]}}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    g = int(os.environ["LOCAL_WORLD_SIZE"])
    record: dict[str, Any] = {
        "arm": arm.name, "path": path, "steps": steps, "warmup": warmup,
        # a step lasts until its slowest rank is done: the per-step maximum over ranks
        "step_times": [max(r["times"][i] for r in every) for i in range(total)],
        "losses": [statistics.fmean(r["losses"][i] for r in every) for i in range(total)],  # global batch
        "link_bytes": [every[n * g]["link"] for n in range(world // g)],  # per node, over the timed steps
    }
    if gift0 is not None:
        record["gift_bytes"] = {k: gift1[k] - gift0[k] for k in gift1 if k in gift0}
    return record


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.cluster.emulated_worker", description=__doc__.splitlines()[0])
    p.add_argument("--path", choices=PATHS, required=True)
    p.add_argument("--arms", required=True, help="comma-separated names of `ARMS`")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--iface", required=True, help="the node's link, whose kernel counters are read")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=LOCAL_BATCH, help="sequences per rank per step")
    p.add_argument("--out", required=True, help="JSON lines, one per arm (rank 0 appends)")
    p.add_argument("--eager", dest="fuse", action="store_false",
                   help="GIFT's codec eager (apply's fuse=False; default: fused, as apply gives it)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    tokens = corpus.token_stream("train", corpus.prepare())
    try:
        for name in a.arms.split(","):
            record = run_arm(ARMS[name], a.path, a.steps, a.warmup, a.iface, a.seed, tokens, a.fuse, a.batch)
            if dist.get_rank() == 0:
                with open(a.out, "a") as f:
                    f.write(json.dumps(record) + "\n")
                print(f"[{a.path} {name}] median step {statistics.median(record['step_times'][a.warmup:]):.3f} s, "
                      f"loss {record['losses'][-1]:.3f}", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_without_finalization(0)  # every record is written (gift_compile.sync: gloo's exit abort)


if __name__ == "__main__":
    main()
