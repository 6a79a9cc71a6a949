"""GIFT for FSDP2 (`fully_shard`): each FSDP module's reduce-scatter replaced by GIFT's.

FSDP2 runs its gradient reduce-scatter from `torch._dynamo.disable`d hooks, so no graph pass
ever sees it. It offers `FSDPModule.set_custom_reduce_scatter`: the custom comm receives the
flat reduce-scatter input of one FSDP module, in which FSDP2 packs all of that module's
gradients (`chunk_cat`). For `world` ranks::

    input.view(world, N)[r] = concat_i( rows [r*c_i, (r+1)*c_i) of grad_i, flattened )

with `c_i` rows of parameter `i` per rank (dim 0 padded to a multiple of `world`). That is
exactly a bucket: `GiftReduceScatter` cuts the buffer into one item per parameter (a managed
weight is `input.view(world, N)[:, off_i:off_i + c_i*cols_i]` reshaped to `[world*c_i, cols_i]`,
its full gradient) and runs `gift_compile.exchange.collectives.sync_buffer` on them: one all_to_all per
FSDP module, managed weights quantized with their transform/residual/seed, every other
parameter at full precision in the same collective. The graph path (a bucketed reduce-scatter
rewritten by the pass) runs the same functions on the same layout.

`install` also asks FSDP2 to reduce-scatter unused parameters (zeros,
`set_reduce_scatter_unused_params`), so every call holds every parameter that requires a
gradient and the layout always maps; a buffer that does not match raises.

A module sharded on a per-parameter mesh (torchtitan's MoE blocks under expert parallelism:
routed experts on the ``efsdp`` mesh, attention, router and shared experts on the ``fsdp``
mesh) has one parameter group per mesh. GIFT's state spans one process group (the one every
FSDP module reduce-scatters over, `shard_group`), so `install` puts `GiftReduceScatter` on that
group of such a module only (`fsdp_internals.set_group_reduce_scatter`) and leaves the others on
FSDP2's own reduce-scatter, at full precision. That is never silent: `outside_gift` lists them,
and under ``unrewritten="error"`` (the default) `install` raises naming their modules, under
``"warn"`` it logs one line per module. A group over one rank carries no gradient collective
(FSDP2 copies its gradient), so it is only logged, unless HSDP's replica hop
(`gift_compile.frameworks.hsdp`, ``install(..., replicas=N)``) has it all-reduced over the
replicas, also at full precision: refused or warned like the others.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from gift_compile.exchange.collectives import Segment, bucket_plan, bucket_wire_bytes, sync_buffer
from gift_compile.exchange.plan import BucketPlan, Collective
from gift_compile.frameworks.fsdp_internals import (
    DefaultReduceScatter, ReduceScatter, check_torch, custom_reduce_scatter, fsdp_modules, packed_params, same_group,
    set_group_reduce_scatter, shard_mesh_dims, shard_process_groups,
)
from gift_compile.config import GiftConfig, Unrewritten
from gift_compile.frameworks.adapter import attach, attached
from gift_compile.frameworks.parts import Parts, model_parts
from gift_compile.frameworks.routing import ManageMode, manage
from gift_compile.runtime.health import queue_backward_check
from gift_compile.runtime.state import GiftState
from gift_compile.runtime.telemetry import CommTimer

__all__ = ["FSDP2", "GiftReduceScatter", "OutsideGroup", "accounted_bytes", "discarded_gradients", "discarding",
           "FSDP2_SPLIT", "full_precision_params", "install", "outside_gift", "refuse_outside", "shard_group", "uninstall"]

logger = logging.getLogger(__name__)


# How many `discarded_gradients` contexts are open.
_discarding = 0


@contextlib.contextmanager
def discarded_gradients() -> Iterator[None]:
    """Reductions inside run FSDP2's default fp32 collectives and leave GIFT's state alone.

    For backward passes whose gradients the framework throws away: torch's pipeline stages
    infer shapes on their first step with a real backward on uninitialized inputs, whose
    reduce-scatter FSDP2 runs and whose gradients the stage then drops. Through GIFT's path that
    garbage would enter the error-feedback residuals, the byte counters and the health checks
    (a NaN there raises under ``nonfinite="error"``). Every rank of the group must be inside
    (they all run the same stage's inference), or the collectives would not match.
    """
    global _discarding
    _discarding += 1
    try:
        yield
    finally:
        _discarding -= 1


def discarding() -> bool:
    """Whether a `discarded_gradients` context is open."""
    return _discarding > 0


class GiftReduceScatter(ReduceScatter):
    """FSDP2 custom reduce-scatter of one FSDP module (see the module docstring)."""

    def __init__(self, module: FSDPModule, state: GiftState, timer: CommTimer, compiled: bool,
                 over: dist.ProcessGroup | None = None, replicas: int = 1) -> None:
        self.module = module
        self.over = over  # the process group of the module's parameter group this comm serves (None: its only one)
        self.state = state
        self.timer = timer
        self.compiled = compiled
        self.replicas = replicas  # replicas an HSDP hop all-reduces each reduced shard over (`install`)
        # (world, dtype, group name) of the last call: what `accounted_bytes` prices
        self.last_call: tuple[int, torch.dtype, str] | None = None

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _segments(self) -> list[Segment]:
        """Every parameter FSDP2 packs in this call (those requiring a gradient, in FSDP2's
        order) as a segment of its per-rank rows: managed weights with their layer's plan."""
        out = []
        for p in packed_params(self.module, self.over):
            layer = getattr(p.module, "_gift_layer", None) if p.param_name == "weight" else None
            if layer is not None and (not p.dim0 or p.cols != layer.shape[1]):
                layer = None
            out.append(Segment(p.fqn, p.rows, p.cols) if layer is None
                       else Segment(p.fqn, p.rows, p.cols, layer.plan, layer.tensors()))
        return out

    def plan(self, world: int, dtype: torch.dtype, group_name: str | None = None) -> BucketPlan:
        """The bucket this module's reduce-scatter runs: one item per parameter (managed
        weights quantized, the others at full precision), FSDP2's order."""
        return bucket_plan(self._segments(), dtype, world=world, group_name=group_name, average=False,
                           op=Collective.REDUCE_SCATTER)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        if op != dist.ReduceOp.SUM:
            raise ValueError(
                f"GIFT's FSDP2 reduce-scatter sums gradients; got {op}. install() forces SUM reductions "
                "(set_force_sum_reduction_for_comms: FSDP2 then divides before/after the comm); do not undo it."
            )
        if discarding():  # gradients the framework drops: no quantization, no state touched
            return DefaultReduceScatter()(output_tensor, input_tensor, group, op, async_op)
        world = group.size()
        segments = self._segments()
        chunk = sum(s.rows * s.cols for s in segments)
        if input_tensor.numel() != world * chunk:
            raise RuntimeError(
                f"GIFT FSDP2: the reduce-scatter buffer has {input_tensor.numel()} elements, the module's "
                f"parameters that require gradients make {world} x {chunk}; cannot map it to parameters"
            )
        config = self.state.config
        self.last_call = (world, input_tensor.dtype, group.group_name)
        sync_buffer(input_tensor, segments, self.state.shared, op=Collective.REDUCE_SCATTER, group=group, average=False,
                    out=output_tensor, plan_check=config.plan_check, compiled=self.compiled,
                    timing=self.timer.timing(input_tensor.device))
        queue_backward_check(self.state)
        return None


def shard_group(model: Parts, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The process group FSDP2 reduce-scatters over: the one every FSDP module of the whole
    model (all of its parts) has a parameter group on (a module with a per-parameter mesh has
    others besides, which GIFT leaves alone: `outside_gift`)."""
    check_torch()
    common: list[dist.ProcessGroup] | None = None
    for module in fsdp_modules(model):
        groups = shard_process_groups(module)
        common = groups if common is None else [g for g in common if any(same_group(g, h) for h in groups)]
    if not common or len(common) != 1:
        raise ValueError(f"gift_compile: FSDP2 model reduce-scatters over {len(common or [])} process groups common "
                         "to all of its FSDP modules; GIFT needs one")
    (pg,) = common
    if group is not None and group is not dist.group.WORLD and not same_group(group, pg):
        raise ValueError("gift_compile.apply: group= differs from the process group FSDP2 reduce-scatters over")
    return pg


class OutsideGroup(NamedTuple):
    """A parameter group of an FSDP module that reduce-scatters over another process group than
    GIFT's (a per-parameter mesh: torchtitan's routed experts under expert parallelism)."""

    modules: tuple[str, ...]  # the owning modules' names (from the root)
    kinds: tuple[str, ...]  # their classes
    params: tuple[tuple[str, tuple[int, ...]], ...]  # the parameters' names (from the root), unsharded shapes
    group: str  # the process group: its mesh dimensions' names (else the group's name)
    ranks: int  # its size (1: FSDP2 copies the gradient, no collective)
    replicas: int = 1  # replicas HSDP's replica hop then all-reduces the reduced shard over

    @property
    def crossing(self) -> bool:
        """Whether the group's gradients cross ranks (a reduce-scatter, or a replica all-reduce)."""
        return self.ranks > 1 or self.replicas > 1

    def route(self) -> str:
        """How the group's gradients travel, in words."""
        first = (f"reduce-scatters over mesh {self.group!r} ({self.ranks} ranks)" if self.ranks > 1
                 else f"is sharded over mesh {self.group!r} (one rank)")
        return first + (f" and all-reduces over {self.replicas} replicas" if self.replicas > 1 else "")


def outside_gift(model: Parts, pg: dist.ProcessGroup, replicas: int = 1) -> list[OutsideGroup]:
    """Every FSDP parameter group of `model` that does not reduce-scatter over ``pg`` (GIFT's
    group), so runs FSDP2's own reduce-scatter at full precision (then, with HSDP, an all-reduce
    over `replicas` replicas)."""
    names = {id(m): n for part in model_parts(model) for n, m in part.named_modules()}
    out = []
    for module in fsdp_modules(model):
        for other in shard_process_groups(module):
            if same_group(other, pg):
                continue
            params = packed_params(module, other)
            owners: dict[str, str] = {}
            fqns = []
            for p in params:
                owner = names.get(id(p.module), p.fqn.rpartition(".")[0])
                owners.setdefault(owner, type(p.module).__name__)
                fqns.append((f"{owner}.{p.param_name}" if owner else p.param_name, p.shape))
            mesh = "x".join(shard_mesh_dims(module, other)) or other.group_name
            out.append(OutsideGroup(tuple(owners), tuple(owners.values()), tuple(fqns), mesh, other.size(), replicas))
    return out


# Why FSDP2's per-parameter-mesh groups stay outside GIFT (`refuse_outside`'s default `split`).
FSDP2_SPLIT = ("FSDP2 shards them on another mesh than GIFT's group (per-parameter mesh: fully_shard's "
               "shard_placement_fn), so they reduce-scatter in a parameter group of their own, which GIFT leaves on "
               "FSDP2's own reduce-scatter (GIFT's statistics, transforms and selection span one group)")


def refuse_outside(groups: list[OutsideGroup], unrewritten: Unrewritten | str, *, split: str = FSDP2_SPLIT) -> None:
    """Raise (``unrewritten="error"``) naming the modules whose gradients `groups` carry at full
    precision past GIFT, or log one line per module (``"warn"``; a one-rank group without
    replicas, which sends nothing, is only logged). `split` says how the framework put them on
    another group than GIFT's (FSDP2's per-parameter mesh by default; SimpleFSDP passes its own,
    `gift_compile.frameworks.simple_fsdp`), so both frameworks refuse in one wording."""
    mode = Unrewritten.parse(unrewritten, "unrewritten")
    crossing = [g for g in groups if g.crossing]
    why = split
    if any(g.replicas > 1 for g in crossing):
        why += "; under HSDP their reduced shards are then all-reduced over the replicas at fp32, as native HSDP would"
    if any(len(shape) > 2 for g in crossing for _, shape in g.params):
        why += ("; and GIFT's matrices are 2-D linear weights with statistics of their inputs, while a grouped-GEMM "
                "expert weight is one 3-D tensor for a rank's experts, each fed only its routed tokens")
    if crossing and mode is Unrewritten.ERROR:
        names = "; ".join(f"{', '.join(f'{m} ({k})' for m, k in zip(g.modules, g.kinds))} over mesh {g.group!r} "
                          f"({'one rank' if g.ranks == 1 else f'{g.ranks} ranks'}"
                          f"{f', then {g.replicas} replicas' if g.replicas > 1 else ''})"
                          for g in crossing)
        raise ValueError(f"GIFT: the gradients of {names} would travel at full precision: {why}. Set "
                         "unrewritten='warn' (torchtitan: --gift.unrewritten warn) to run with them at full precision")
    for g in groups:
        for module, kind in zip(g.modules, g.kinds):
            if g.crossing:
                logger.warning("GIFT: %s (%s) %s at full precision, not managed: %s (unrewritten='warn')",
                               module, kind, g.route(), why)
            else:
                logger.info("GIFT: %s (%s) is sharded over mesh %r (one rank): its gradient crosses no rank, "
                            "nothing to compress", module, kind, g.group)


def install(model: Parts, state: GiftState, *, compiled: bool = True, replicas: int = 1) -> CommTimer:
    """Put every FSDP module of `model` (of all its parts, the pipeline stages a rank holds,
    which share `state` and one comm timer) on `GiftReduceScatter`; returns the comm timer.

    Forces FSDP2's SUM reduction (FSDP2 then applies its gradient divide factor itself) and
    the reduce-scatter of unused parameters, so every buffer maps onto the parameters. The
    timer is kept in the state's per-adapter slot (the FSDP2 adapter's telemetry reads it).
    A module with several parameter groups (a per-parameter mesh) gets GIFT's reduce-scatter on
    its group over `shard_group` only; the others are refused or logged by `refuse_outside`
    (``state.config.unrewritten``), and a managed weight in one of them always raises. With HSDP,
    `replicas` is the replica group's size (`gift_compile.frameworks.hsdp.install`, called next,
    checks it): every group's reduced shard then crosses the replicas too, which the refusal counts.
    """
    check_torch()
    pg = shard_group(model, None)
    outside = outside_gift(model, pg, replicas)
    managed_outside = [p.fqn for module in fsdp_modules(model) for other in shard_process_groups(module)
                       if not same_group(other, pg) for p in packed_params(module, other)
                       if p.param_name == "weight" and getattr(p.module, "_gift_layer", None) is not None]
    if managed_outside:
        raise ValueError(f"GIFT: managed weights {managed_outside} reduce-scatter over another process group than "
                         f"GIFT's ({pg.group_name!r}); exclude them (GiftConfig.exclude)")
    refuse_outside(outside, state.config.unrewritten)
    timer = CommTimer()
    for module in fsdp_modules(model):
        module.set_force_sum_reduction_for_comms(True)
        module.set_reduce_scatter_unused_params(True)
        several = len(shard_process_groups(module)) > 1
        set_group_reduce_scatter(module, pg, GiftReduceScatter(module, state, timer, compiled, pg if several else None,
                                                               replicas))
    attach(state, FSDP2.name, timer)
    return timer


def uninstall(model: Parts) -> None:
    """FSDP2's default reduce-scatter back on every FSDP module of `model` (on each parameter
    group GIFT's reduce-scatter runs on)."""
    for module in fsdp_modules(model):
        for pg in shard_process_groups(module):
            if isinstance(custom_reduce_scatter(module, pg if len(shard_process_groups(module)) > 1 else None),
                          GiftReduceScatter):
                set_group_reduce_scatter(module, pg, DefaultReduceScatter())


def full_precision_params(model: Parts) -> int | None:
    """How many parameters of `model` cross ranks outside GIFT (a reduce-scatter over more than
    one rank, or HSDP's replica all-reduce), in a parameter group whose module has another group
    on GIFT's reduce-scatter (`outside_gift`: torchtitan's routed experts under expert
    parallelism); None when GIFT is not installed."""
    comms = _gift_comms(model)
    if not comms:
        return None
    replicas = {id(c.module): c.replicas for c in comms if c.over is not None}
    return sum(len(packed_params(m, pg)) for m in fsdp_modules(model) if id(m) in replicas
               for pg in shard_process_groups(m) if (pg.size() > 1 or replicas[id(m)] > 1)
               and not isinstance(custom_reduce_scatter(m, pg), GiftReduceScatter))


def _gift_comms(model: Parts) -> list[GiftReduceScatter]:
    """The GIFT reduce-scatters installed on `model`'s parameter groups."""
    out = []
    for module in fsdp_modules(model):
        groups = shard_process_groups(module)
        for pg in groups:
            comm = custom_reduce_scatter(module, pg if len(groups) > 1 else None)
            if isinstance(comm, GiftReduceScatter):
                out.append(comm)
    return out


def accounted_bytes(model: Parts) -> int | None:
    """Shape-based bytes one rank hands to GIFT's reduce-scatters per synchronising backward
    (`bucket_wire_bytes` of each module's plan as last called, over all parts), to compare with the bytes the
    collectives counted; None before GIFT's reduce-scatter ran (or when it is not installed)."""
    comms = {id(c): c for c in _gift_comms(model) if c.last_call is not None}
    if not comms:
        return None
    return sum(bucket_wire_bytes(c.plan(*c.last_call)) for c in comms.values())


class _FSDP2Adapter:
    """`fully_shard` (FSDP2) models: GIFT's bucketed reduce-scatter as FSDP2's custom one."""

    name = "fsdp2"
    kind = "FSDP2 custom reduce-scatter"
    split_rows = True

    def detect(self, model: nn.Module) -> bool:
        return any(isinstance(m, FSDPModule) for m in model.modules())

    def install(self, model: nn.Module, config: GiftConfig, group: dist.ProcessGroup | None, *,
                fuse: bool) -> GiftState:
        """The state over the group FSDP2 reduce-scatters over (`shard_group`), statistics hooks
        on the managed linears, and `install`'s reduce-scatter on every FSDP module."""
        shards = shard_group(model, group)
        if shards.size() == 1:
            raise ValueError(
                "gift_compile.apply: the FSDP2 model reduce-scatters over a one-rank group; FSDP2 then copies each "
                "gradient without calling the custom reduce-scatter, so GIFT would quantize and send nothing (with "
                "replicas, install gift_compile.frameworks.fsdp2 and gift_compile.frameworks.hsdp: the replica hop "
                "then carries every gradient)")
        state = manage(model, config, shards, mode=ManageMode.STATS, split_rows=True)
        install(model, state, compiled=fuse)
        return state

    def no_sync(self, model: nn.Module, state: GiftState) -> AbstractContextManager[None]:
        """FSDP2's own switch (`set_requires_gradient_sync(False)`) on every FSDP module."""
        return _without_gradient_sync([m for m in model.modules() if isinstance(m, FSDPModule)])

    def remove(self, model: nn.Module, state: GiftState) -> None:
        uninstall(model)

    def telemetry(self, state: GiftState) -> dict[str, float]:
        """Seconds spent in GIFT's reduce-scatters since the last call (`comm_s`)."""
        return {"comm_s": attached(state, self.name).take()}


@contextlib.contextmanager
def _without_gradient_sync(modules: list[FSDPModule]) -> Iterator[None]:
    for m in modules:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in modules:
            m.set_requires_gradient_sync(True, recurse=False)


FSDP2 = _FSDP2Adapter()
