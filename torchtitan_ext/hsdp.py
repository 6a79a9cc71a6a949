"""HSDP (``--parallelism.data-parallel-replicate-degree > 1``) with GIFT on the stock FSDP2 trainer.

torchtitan's parallelize function shards each model on the 2-D ``["dp_replicate", "fsdp"]``
mesh when replication is on, and FSDP2 then runs the replica all-reduce itself, at full
precision, before any hook (see `gift_compile.frameworks.hsdp`). With ``gift.enable`` the job config wraps
``ModelSpec.parallelize_fn`` (`shard_only_parallelize`): the model's own parallelize function
runs unchanged but sees a ``ParallelDims`` view that reports replication off, so it shards on
the shard-only ``fsdp`` mesh. Everything else in torchtitan keeps the real ``ParallelDims``
(data loading per replica, the global token count of the loss, the loss mesh, checkpointing),
and the post-optimizer hook installs GIFT's replica hop over the ``dp_replicate`` group.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch.distributed as dist
from torchtitan.tools.logging import logger

from gift_compile.frameworks import hsdp as gift_hsdp

__all__ = ["ShardOnlyDims", "bind_shard_only_parallelize", "check_replicate_only", "describe_graph_hops", "describe_hops", "graph_accounted_bytes",
           "replica_group", "replica_metrics", "shard_only_parallelize"]


class ShardOnlyDims:
    """A read-only view of torchtitan's ``ParallelDims`` in which data-parallel replication is
    off: the model's parallelize function then shards on the shard-only mesh. Every other
    attribute is the real object's."""

    def __init__(self, dims: Any) -> None:
        object.__setattr__(self, "_dims", dims)

    @property
    def dp_replicate_enabled(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dims, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"ShardOnlyDims is a read-only view; cannot set {name}")


def shard_only_parallelize(model: Any, *, parallel_dims: Any, inner: Callable, section: Any, **kwargs: Any) -> Any:
    """``parallelize_fn`` that runs `inner` on the shard-only mesh when replication is on and
    ``section.enable`` (GIFT's replica hop then replaces FSDP2's; without GIFT the native HSDP
    mesh is kept, or nothing would all-reduce across replicas)."""
    if section.enable and parallel_dims.dp_replicate_enabled:
        logger.info(f"GIFT HSDP: fully_shard on the shard-only mesh (fsdp={parallel_dims.dp_shard * parallel_dims.cp}); GIFT "
                    f"all-reduces each reduced shard over the {parallel_dims.dp_replicate} replicas")
        parallel_dims = ShardOnlyDims(parallel_dims)
    return inner(model, parallel_dims=parallel_dims, **kwargs)


def bind_shard_only_parallelize(config: Any) -> None:
    """Wrap ``config.model_spec.parallelize_fn`` in `shard_only_parallelize` bound to
    ``config.gift`` (idempotent: rebinding keeps the model's own function and takes the final,
    CLI-parsed section, as `hooks.bind_gift_hook` does)."""
    current = config.model_spec.parallelize_fn
    if isinstance(current, functools.partial) and current.func is shard_only_parallelize:
        current = current.keywords["inner"]
    wrapped = functools.partial(shard_only_parallelize, inner=current, section=config.gift)
    config.model_spec = replace(config.model_spec, parallelize_fn=wrapped)


def check_replicate_only(config: Any) -> None:
    """graph_trainer with replication only (DDP: SimpleFSDP's ``replicate`` mode, one all-reduce
    per gradient, which the pass rewrites as GIFT's all-reduce with each layer's own plan): raise
    unless the one hop can run the configured formats (``replica_format`` would name a second hop
    that does not exist)."""
    if config.replica_hop_format != config.format:
        raise ValueError(
            f"gift.replica_format={config.replica_format!r}: with data_parallel_shard_degree x context_parallel_degree "
            f"= 1 graph_trainer only replicates (DDP), so each gradient crosses ranks once, in GIFT's all-reduce at "
            f"gift.format={config.format!r}; there is no replica hop of its own. Set gift.replica_format 'same'")
    logger.info("GIFT DDP (graph_trainer, replication only): each traced gradient all-reduce becomes GIFT's "
                f"all-reduce at {config.format}")


def replica_group(parallel_dims: Any) -> dist.ProcessGroup | None:
    """The replica group of HSDP, or None without replication."""
    return parallel_dims.get_mesh("dp_replicate").get_group() if parallel_dims.dp_replicate > 1 else None


def replica_metrics(state: Any, model: Any, last: dict[str, Any], steps: int, log_freq: int) -> dict[str, float]:
    """Per-hop telemetry of HSDP since the snapshot `last` (updated in place): the replica hop's
    bytes handed over (counted at run time) and their fp32 baseline, its calls, its time, its
    error probed against an fp32 all-reduce (on every `log_freq`-th step), and both hops'
    shape-based bytes per backward for comparison. Empty without a replica hop."""
    hop = gift_hsdp.replica_hop(state)
    if hop is None:
        return {}
    hop.measure_every = log_freq
    totals = gift_hsdp.hop_totals(state)["replica"]
    prev = last.get("replica", {k: 0 for k in totals})
    delta = {k: totals[k] - prev[k] for k in totals}
    last["replica"] = totals
    out = {
        "gift/replica_wire_bytes_per_step": delta["wire"] / steps,
        "gift/replica_baseline_bytes_per_step": delta["baseline"] / steps,
        "gift/replica_compression": delta["baseline"] / delta["wire"] if delta["wire"] else float("nan"),
        "gift/replica_collectives_per_step": delta["calls"] / steps,
        "gift/replica_comm_s_per_step": hop.timer.take() / steps,
    }
    accounted = graph_accounted_bytes() if not gift_hsdp._hooks(model) else gift_hsdp.accounted_bytes(model)
    out["gift/shard_accounted_bytes_per_backward"] = float(accounted["shard"])
    out["gift/replica_accounted_bytes_per_backward"] = float(accounted["replica"])
    err = hop.take_error()
    if err is not None:
        out["gift/replica_err"] = err
    return out


def graph_accounted_bytes() -> dict[str, int]:
    """graph_trainer: each hop's shape-based bytes per backward, from the GIFT pass's report of
    the last graph it rewrote (the traced training step)."""
    from gift_compile.passes import last_reports

    report = next((r for r in reversed(last_reports()) if r.rewritten), None)
    if report is None:
        raise RuntimeError("GIFT HSDP: no graph was rewritten yet (no accounting to report)")
    return {"shard": report.wire_bytes, "replica": report.replica_wire_bytes}


def describe_hops(model: Any, state: Any, shard_world: int) -> str:
    """One log line: each hop's group size and format, and how many FSDP parameter groups
    (one bucket per hop each) carry how many managed weights."""
    hop = gift_hsdp.replica_hop(state)
    groups = len(gift_hsdp._hooks(model))
    config = state.config
    if shard_world == 1:
        return (f"GIFT HSDP with one shard: {groups} FSDP parameter groups, {len(state.layers)} managed weights; no "
                f"shard hop (FSDP2 copies), the replica hop (all-reduce of each full gradient over {hop.world} "
                f"replicas) is the only collective, at {config.format} with the layers' error feedback and probes; "
                f"the other parameters travel unquantized inside the same buckets")
    return (f"GIFT HSDP: {groups} FSDP parameter groups, {len(state.layers)} managed weights; shard hop "
            f"(reduce-scatter over {shard_world} ranks) at {config.format}, replica hop (all-reduce of each "
            f"reduced shard over {hop.world} replicas) at {config.replica_hop_format}; the other parameters "
            f"travel unquantized inside the same buckets")


def describe_graph_hops(state: Any, shard_world: int) -> str:
    """graph_trainer's one-line HSDP summary (the rewrite log then shows each hop's bytes)."""
    config = state.config
    return (f"GIFT HSDP (graph_trainer): {len(state.layers)} managed weights; shard hop (each bucketed "
            f"reduce-scatter over {shard_world} ranks) at {config.format}, then replica hop (all-reduce of the "
            f"reduced shard over {gift_hsdp.replica_hop(state).world} replicas) at {config.replica_hop_format}; the pass "
            f"runs SimpleFSDP's replica all-reduce after the reduce-scatter instead of before it")
