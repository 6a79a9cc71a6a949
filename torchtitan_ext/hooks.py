"""Set GIFT up inside torchtitan through its own hooks (no trainer subclass).

torchtitan calls ``ModelSpec.post_optimizer_build_fn(optimizers, model_parts, parallel_dims)``
once the model is parallelized, materialized on its device and its optimizers exist: the right
moment to manage the linear weights (`gift_compile.api.manage`, the function behind
`gift_compile.apply`), install the FSDP2 reduce-scatter or the graph tags, and drive the GIFT
state from the optimizer container's step hooks. The hook is bound to the final, CLI-parsed
``[gift]`` section by the job configs in :mod:`.job_config`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torchtitan.tools.logging import logger

from gift_compile.api import attach_optimizer, manage, managed_weights, resolve_auto
from gift_compile.config import GiftConfig
from gift_compile.frameworks import fsdp2
from gift_compile.frameworks import hsdp as gift_hsdp
from gift_compile.frameworks.exchanges import describe_exchanges
from gift_compile.frameworks.parts import Parts
from gift_compile.frameworks.routing import ManageMode, linear_weight_names
from gift_compile.frameworks.simple_fsdp import SIMPLE_FSDP
from gift_compile.frameworks.tensor_parallel import describe_blocks
from gift_compile.runtime.report import log_report, summarize

from . import hsdp, pipeline_parallel, platform_hooks
from .section import GiftSection

__all__ = ["REFUSAL", "bind_gift_hook", "data_parallel_group", "gift_config", "gift_post_optimizer_build"]


# How every refusal of a layout starts (tests look for it in a run's log to show there was none)
REFUSAL = "gift.enable does not run on this layout"

# Why each layout is refused (docs/torchtitan/layouts_combined.md, "Limits").
_UNSUPPORTED_WHY = {
    "pipeline on graph_trainer": "graph_trainer runs the registered pass pipeline (where the gift pass is) "
              "only on its whole-step trace, which it makes only without pipeline parallelism; with it, "
              "its GraphPP schedule runs stage-local graphs (FSDP's reduce-scatters split into a reduce-grad "
              "graph) built with graph_trainer's default compile-time passes, so GIFT's marks would be inert and "
              "every gradient would travel at fp32; use the FSDP2 trainer (GIFT per stage)",
    "expert with context": "GIFT with expert parallelism has been built and run with FSDP, HSDP, FSDP x TP "
              "(both trainers) and PP x FSDP (FSDP2 trainer); with CP the layout has not been run with GIFT because "
              "torchtitan 0.3.0 does not run it on this repo's MoE model without GIFT either (both trainers stop "
              "with 'aten.add.Tensor got mixed torch.Tensor and DTensor')",
}


def data_parallel_group(parallel_dims: Any, trainer: str = "graph") -> dist.ProcessGroup:
    """The data-parallel group GIFT's state spans (statistics, transforms, selection): the FSDP
    group, or with HSDP (both trainers) shards x replicas. With tensor parallelism (FSDP x TP and
    HSDP x TP on both trainers, PP x TP x FSDP on the FSDP2 trainer) it is still that group,
    never the TP ranks: each TP rank's weight block is its own GIFT matrix
    (`gift_compile.frameworks.tensor_parallel`), and under HSDP the replica hop all-reduces the
    reduced shard of that block over the replicas holding the same TP coordinate (torchtitan's
    ``dp_replicate`` group; 8-rank runs in `bench.cluster.layouts`). With context parallelism
    torchtitan's FSDP group is dp_shard x cp, the ranks FSDP2 or SimpleFSDP reduce-scatter over
    (GIFT's shard hop): the K-FAC statistics, sums over tokens, then add each CP rank's slice of
    every sequence to the others', so every CP rank builds the same transforms. That holds with
    TP (per TP block; both trainers) and PP (per stage; FSDP2 trainer), and CP alone
    (dp_shard 1) is a 2-rank FSDP group. With HSDP x CP (both trainers) the state group is
    dp_replicate x dp_shard x cp, torchtitan's ``loss`` mesh (its ``batch`` mesh, which GIFT's
    HSDP uses without CP, leaves the CP ranks out); the shard hop runs over fsdp, the replica hop
    over dp_replicate. With expert parallelism (FSDP2 trainer: FSDP, HSDP, FSDP x TP, PP x FSDP)
    it is the group it would be without EP: EP borrows its ranks from dp_shard x tp, the dense
    parameters (every block's attention, router and shared experts, the dense blocks, embeddings
    and head) reduce-scatter over the fsdp mesh, and only the routed experts over the smaller
    efsdp mesh, whose reduce-scatter GIFT sends on its codec with no map (logged per module,
    `gift_compile.frameworks.fsdp2.EuclideanReduceScatter`), as it does their replica all-reduce
    over dp_replicate under HSDP. On graph_trainer with expert parallelism
    (FSDP, HSDP, FSDP x TP) it is the group it would be without EP as well: SimpleFSDP wraps the
    routed experts on the efsdp mesh, whose gradients GIFT marks with no map
    (`gift_compile.frameworks.simple_fsdp.mark_outside`), so the pass rewrites their traced
    reduce-scatters over that group; under HSDP (dp_replicate x efsdp) the replica all-reduce
    traced for them is not carried, so they are refused by name or logged per module
    (`simple_fsdp.refuse_outside`). The EP all-to-alls are not GIFT's. Other layouts are refused
    by name."""
    others = {
        "pipeline on graph_trainer": parallel_dims.pp if trainer != "fsdp2" else 1,
        "expert with context": parallel_dims.ep if parallel_dims.cp > 1 else 1,
    }
    unsupported = [name for name, degree in others.items() if degree > 1]
    if unsupported:
        why = "; ".join(f"{name}: {_UNSUPPORTED_WHY[name]}" for name in unsupported)
        raise ValueError(f"{REFUSAL}; {', '.join(unsupported)} parallelism is on ({why})")
    if trainer == "fsdp2" and parallel_dims.dp_shard * parallel_dims.cp * parallel_dims.dp_replicate <= 1:
        # one data-parallel rank (per pipeline stage): no gradient crosses ranks, nothing to compress
        if parallel_dims.pp > 1:
            raise ValueError(
                f"gift.enable with pipeline parallelism (degree {parallel_dims.pp}) needs data parallelism: GIFT "
                "compresses each stage's data-parallel gradient reduce-scatter, not the activations stages send each "
                "other, and with data_parallel_shard_degree x context_parallel_degree x data_parallel_replicate_degree = 1 "
                "no gradient crosses ranks; set one of them > 1 or turn gift.enable off")
        raise ValueError(
            "gift.enable on the FSDP2 trainer needs more than one data-parallel rank: FSDP2 copies a one-rank "
            "shard's gradient instead of calling the reduce-scatter GIFT replaces, and without replicas no gradient "
            "crosses ranks, so nothing would be quantized or sent (and every refresh would measure never-written "
            "gradient probes); run on more ranks or turn gift.enable off")
    if parallel_dims.dp_replicate > 1:
        # replicas x shards; with CP the shards are fsdp = dp_shard x cp, and torchtitan's mesh of all
        # three is its loss mesh (its batch mesh, dp_replicate x dp_shard, leaves the CP ranks out)
        return parallel_dims.get_mesh("loss" if parallel_dims.cp > 1 else "batch").get_group()
    return parallel_dims.get_mesh("fsdp").get_group()


def gift_post_optimizer_build(optimizers: Any, model_parts: list[nn.Module], parallel_dims: Any, *,
                              section: GiftSection, trainer: str, inner: Callable | None) -> None:
    """``post_optimizer_build_fn``: GIFT for the stock trainer ("fsdp2") or graph_trainer ("graph").

    FSDP2: statistics hooks plus `gift_compile.frameworks.fsdp2`'s bucketed reduce-scatter on every FSDP
    module, and with HSDP `gift_compile.frameworks.hsdp`'s replica all-reduce hook. graph_trainer: the
    `gift::mark` tags whose reduce-scatters (bucketed or not) the ``gift`` pass pipeline
    rewrites, with HSDP carrying the replica hop (`gift_compile.frameworks.hsdp.install_graph`) the pass
    puts after each rewritten reduce-scatter, and with replication only (DDP) the traced
    all-reduces the pass rewrites at each layer's own plan. Both: `attach_optimizer` on torchtitan's optimizer
    container (health check before its step, `GiftState.step()` after). With pipeline
    parallelism (FSDP2 only) one state spans every model part (stage) of the rank, over its
    data-parallel group (`.pipeline_parallel`). When that group is smaller than the job (pipeline
    or tensor parallelism) the job's world is the state's health group: a fault any stage or
    block saw raises on every rank at the optimizer step (`gift_compile.api.attach_optimizer`).
    """
    if inner is not None:
        inner(optimizers, model_parts, parallel_dims)
    if trainer == "fsdp2":
        for model in model_parts:
            platform_hooks.after_fsdp2(model)
    if not section.enable:
        return
    model = model_parts  # pipeline parallelism: the rank's stages, one state over them (.pipeline_parallel)
    group = data_parallel_group(parallel_dims, trainer)
    if parallel_dims.pp > 1:
        pipeline_parallel.guard_shape_inference()
    world = dist.get_world_size(group)
    config = gift_config(section, optimizers, model, group)
    if trainer == "fsdp2":
        if parallel_dims.ep > 1:
            # the group the dense parameter groups reduce-scatter over must be the fsdp mesh's
            # (raises otherwise); the routed experts' efsdp groups go on GIFT's codec with no map
            fsdp2.shard_group(model, parallel_dims.get_mesh("fsdp").get_group())
        state = manage(model, config, group, mode=ManageMode.STATS, split_rows=True)
        fsdp2.install(model, state, compiled=section.fuse)
        replicas = hsdp.replica_group(parallel_dims)
        if replicas is not None:
            gift_hsdp.install(model, state, replicas, compiled=section.fuse)
            logger.info(hsdp.describe_hops(model, state, parallel_dims.dp_shard * parallel_dims.cp))
    else:
        replicas = hsdp.replica_group(parallel_dims)
        # SimpleFSDP shards over fsdp = dp_shard x cp; over one rank it only replicates (DDP): each
        # gradient's one all-reduce is then GIFT's all-reduce at `format`, the layers' own plans
        if replicas is not None and parallel_dims.dp_shard * parallel_dims.cp == 1:
            hsdp.check_replicate_only(config)
            replicas = None
        state = SIMPLE_FSDP.install(model, config, group, fuse=section.fuse)
        if replicas is not None:  # the marks carry the replica hop, which the pass puts after the shard hop
            gift_hsdp.install_graph(state, replicas)
            gift_hsdp.check_replicas_identical(model, replicas)
            logger.info(hsdp.describe_graph_hops(state, parallel_dims.dp_shard * parallel_dims.cp))
    if parallel_dims.tp > 1:
        logger.info(describe_blocks(state))
    # Pipeline stages and tensor-parallel blocks run other GIFT states on other ranks, which never
    # see this state's faults: the optimizer step raises a fault on every rank of the job.
    health = dist.group.WORLD if world < dist.get_world_size() else None
    attach_optimizer(state, optimizers, health_group=health)
    stage = pipeline_parallel.stage_of(parallel_dims)
    where = ("" if stage is None else
             f" on pipeline rank {stage} ({len(model_parts)} model parts, data-parallel group of {world})")
    logger.info(f"GIFT: {len(state.layers)} weights managed{where} ({', '.join(state.layers) or 'none'})")
    kind = fsdp2.FSDP2.kind if trainer == "fsdp2" else SIMPLE_FSDP.kind
    state.report = summarize(state, kind, linear_weight_names(model), describe_exchanges(state))
    log_report(state.report)


def gift_config(section: GiftSection, optimizers: Any, model: Parts, group: dist.ProcessGroup | None) -> GiftConfig:
    """The section's `GiftConfig` with ``auto`` (geometry, select_metric) resolved by the
    function `gift_compile.apply` resolves it with (`gift_compile.api.resolve_auto`), from the
    optimizers that step the weights GIFT will manage on `group` (every layout here is a
    reduce-scatter: rows split over the group; `group` also sizes a tensor-parallel block)."""
    config = section.to_gift_config()
    return resolve_auto(config, optimizers, managed_weights(model, config, group, split_rows=True))


def bind_gift_hook(config: Any, trainer: str) -> None:
    """Point ``config.model_spec.post_optimizer_build_fn`` at `gift_post_optimizer_build` bound
    to ``config.gift`` (idempotent: rebinding keeps the model's own hook as ``inner``)."""
    from dataclasses import replace

    current = config.model_spec.post_optimizer_build_fn
    if isinstance(current, functools.partial) and current.func is gift_post_optimizer_build:
        current = current.keywords["inner"]
    hook = functools.partial(gift_post_optimizer_build, section=config.gift, trainer=trainer, inner=current)
    config.model_spec = replace(config.model_spec, post_optimizer_build_fn=hook)
