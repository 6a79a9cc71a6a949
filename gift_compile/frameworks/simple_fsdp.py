"""GIFT for SimpleFSDP-style models (torchtitan's graph_trainer): DTensor parameters whose
reduce-scatters are traced into the backward graph.

Such a framework launches its gradient collectives from the graph, where the FX pass
(`gift_compile.passes.gift_pass`) rewrites each (possibly bucketed) reduce-scatter that carries
a managed weight's gradient into GIFT's collective. So the adapter only manages the weights in
"tag" mode: each managed weight's gradient gets its `gift::mark`, which the pass reads.

Parameters SimpleFSDP wraps on another data-parallel mesh than GIFT's group (torchtitan's
graph_trainer under expert parallelism wraps the routed experts on the ``efsdp`` mesh, the rest
on ``fsdp``) reduce-scatter over that mesh's group (`outside_gift` finds them). They have no GIFT
layer (`gift_compile.frameworks.euclidean`), so `install` marks each one's gradient with a
Euclidean plan (`euclidean_plan`, the rule FSDP2's `EuclideanReduceScatter` sends them by) and
the tensors the pass needs (a seed offset, an empty probe, and as shared tensors the state's
seed and counters with the rank in that group): the pass then rewrites their reduce-scatters,
bucketed or not, into GIFT's collective over that group, which it reads from the traced
collective, as for any mark. Logged once per module. Under HSDP SimpleFSDP places them on the
``dp_replicate x efsdp`` mesh and all-reduces their gradients over dp_replicate before the efsdp
reduce-scatter; `gift_compile.frameworks.hsdp.install_graph` puts its replica hop on their marks
as on the managed linears' (`set_replica_hop`: the replica format, the hop's rank and counters),
so the pass runs GIFT's all-reduce of the reduced shard behind the reduce-scatter, or, where
efsdp has one rank and no reduce-scatter is traced, GIFT's all-reduce of the gradient as the
replica hop alone, no map either way. What the pass cannot carry is refused by name under
``unrewritten="error"`` (the default) or logged per module under ``"warn"`` (`refuse_outside`):
a shard on another dim than 0, or a placement that is neither a shard nor a replicated dim and
a shard.
Parameters that go unmarked (excluded, under `min_numel`, refused under "warn") are counted by
`full_precision_params` for telemetry.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from gift_compile.config import GiftConfig, Unrewritten
from gift_compile.exchange.collectives import ItemTensors, Shared
from gift_compile.exchange.mark import _GiftTag, pack_mark_tensors
from gift_compile.exchange.node_stage import residual_rows
from gift_compile.exchange.topology import node_layout
from gift_compile.exchange.plan import ItemPlan
from gift_compile.frameworks.adapter import attach, attached
from gift_compile.frameworks.euclidean import NO_MAP, describe, describe_items, euclidean_plan, gathered_shape
from gift_compile.frameworks.parts import Parts, model_parts
from gift_compile.frameworks.routing import ManageMode, manage
from gift_compile.frameworks.tensor_parallel import on_local_block
from gift_compile.runtime.state import GiftState

__all__ = ["SIMPLE_FSDP", "OutsideGroup", "OutsideMarks", "full_precision_params", "mark_outside", "outside_gift",
           "refuse_outside", "set_replica_hop"]

logger = logging.getLogger(__name__)


class OutsideGroup(NamedTuple):
    """Parameters of one module that SimpleFSDP reduces over another mesh than GIFT's group
    (torchtitan's routed experts under expert parallelism)."""

    modules: tuple[str, ...]  # the owning modules' names (from the root)
    kinds: tuple[str, ...]  # their classes
    params: tuple[tuple[str, tuple[int, ...]], ...]  # the parameters' names (from the root), unsharded shapes
    group: str  # the process group: its mesh dimensions' names (else its ranks)
    ranks: int  # its size (1: no collective)
    why: str = ""  # why the pass cannot carry their traced collectives; empty: `install` marks them
    # ranks along the mesh's replicated dim (HSDP's dp_replicate: SimpleFSDP all-reduces over them
    # before its reduce-scatter over the others, `ranks / replicas`); 1 without one
    replicas: int = 1


class _MarkedModule(NamedTuple):
    """A module `mark_outside` marked: what `set_replica_hop` repacks its marks from and logs."""

    group: OutsideGroup
    module: nn.Module
    named: list[tuple[str, ItemPlan | None]]  # its crossing parameters (by name in the module), their plans
    tensors: dict[str, tuple[ItemTensors, Shared]]  # the marked ones' item tensors and shard hop's `Shared`
    replica_group: dist.ProcessGroup | None  # the group SimpleFSDP all-reduces them over (HSDP), None without


class OutsideMarks(NamedTuple):
    """The adapter's slot: each crossing parameter's plan (None: unmarked, `full_precision_params`)
    and the modules whose parameters carry marks."""

    plans: dict[str, ItemPlan | None]
    modules: list[_MarkedModule]


def refuse_outside(groups: list[OutsideGroup], unrewritten: Unrewritten | str) -> None:
    """Raise (``unrewritten="error"``) naming the modules of `groups` whose gradients would
    cross ranks at full precision past GIFT (those with a `why`), with the reason, or log one
    line per such module (``"warn"``); a one-rank group, which sends nothing, is only logged."""
    mode = Unrewritten.parse(unrewritten, "unrewritten")
    crossing = [g for g in groups if g.ranks > 1 and g.why]
    if crossing and mode is Unrewritten.ERROR:
        names = "; ".join(f"{', '.join(f'{m} ({k})' for m, k in zip(g.modules, g.kinds))} over mesh {g.group!r} "
                          f"({g.ranks} ranks): {g.why}" for g in crossing)
        raise ValueError(f"GIFT: the gradients of {names}; they would travel at full precision. Set "
                         "unrewritten='warn' (torchtitan: --gift.unrewritten warn) to run with them at full precision, "
                         "or use the FSDP2 trainer, which sends them on GIFT's codec")
    for g in groups:
        for module, kind in zip(g.modules, g.kinds):
            if g.ranks == 1:
                logger.info("GIFT: %s (%s) is sharded over mesh %r (one rank): its gradient crosses no rank, "
                            "nothing to compress", module, kind, g.group)
            elif g.why:
                logger.warning("GIFT: %s (%s) reduces over mesh %r (%d ranks) at full precision, not carried: %s "
                               "(unrewritten='warn')", module, kind, g.group, g.ranks, g.why)


def _replicate_computation(module: nn.Module, name: str) -> Any:
    """The parametrization (torchtitan's ``ReplicateComputation``) the wrapper class's property
    for `name` calls: its ``device_mesh`` is the mesh SimpleFSDP all-gathers ``module.<name>``
    over and reduces its gradient over, its ``param_sharding`` how it shards it there. The
    parameter's own DTensor mesh cannot tell: it is that mesh concatenated with the EP/TP mesh
    the parameter had before. Raises when the property is not SimpleFSDP's."""
    prop = type(module).__dict__.get(name)
    cells = getattr(getattr(prop, "fget", None), "__closure__", None) or ()
    found = [c.cell_contents for c in cells
             if hasattr(c.cell_contents, "device_mesh") and hasattr(c.cell_contents, "param_sharding")]
    if len(found) != 1:
        raise RuntimeError(f"gift_compile: {type(module).__name__}.{name} is a DTensor parameter without SimpleFSDP's "
                           "parametrization (a property calling a ReplicateComputation), so the mesh its gradient is "
                           "reduced over is unknown: the simple_fsdp adapter takes models wrapped by torchtitan "
                           "graph_trainer's SimpleFSDP (data_parallel) only, and this one is not, or that wrapping "
                           "changed")
    return found[0]


def _why_not_carried(sharding: tuple[Any, ...]) -> str:
    """Why the pass cannot carry a parameter SimpleFSDP places as `sharding` on its mesh (empty:
    it can: a plain dim-0 shard, whose traced reduce-scatter takes the marked gradient as is,
    after, under HSDP, one replicated dim, whose traced all-reduce GIFT's replica hop replaces:
    `set_replica_hop`)."""
    *replicated, shard = sharding
    if not shard.is_shard() or len(replicated) > 1 or not all(p.is_replicate() for p in replicated):
        return (f"SimpleFSDP places them as {tuple(sharding)} on their mesh, not as a shard (FSDP) or one replicated "
                "dim and a shard (HSDP), the placements whose traced collectives the pass follows a mark through")
    if shard.dim != 0:
        return (f"SimpleFSDP shards them on dim {shard.dim} (more efsdp x ep ranks than experts), so their "
                "traced reduce-scatter takes a permuted copy of the gradient, which the pass does not follow a mark "
                "through")
    return ""


def outside_gift(model: Parts, group: dist.ProcessGroup) -> list[OutsideGroup]:
    """One entry per module whose SimpleFSDP-wrapped parameters reduce their gradients over
    another mesh than the model's data-parallel one: other ranks than `group` (GIFT's state
    group: the fsdp mesh's, or under HSDP the replicas x shards', compared as rank sets, since
    that group is not itself one of SimpleFSDP's mesh dimensions under HSDP), or a mesh of other
    dimensions than the one most parameters use (with TP the routed experts' efsdp group can
    hold the same ranks as the fsdp group, but is another collective), with why the pass
    cannot carry them where it cannot (`_why_not_carried`)."""
    from torch.distributed.tensor import DTensor

    gift_ranks = set(dist.get_process_group_ranks(group))
    found = []
    for part in model_parts(model):
        for owner, module in part.named_modules():
            params = [(n, p) for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)]
            found.append((owner, module, [(n, p, _replicate_computation(module, n)) for n, p in params]))
    sizes: Counter[tuple[str, ...] | None] = Counter()  # elements per mesh (by its dimensions' names)
    for _, _, params in found:
        for _, p, rc in params:
            sizes[rc.device_mesh.mesh_dim_names] += p.numel()
    dense = sizes.most_common(1)[0][0] if sizes else None
    out = []
    for owner, module, params in found:
        other = [(n, p, rc) for n, p, rc in params if set(rc.device_mesh.mesh.flatten().tolist()) != gift_ranks
                 or rc.device_mesh.mesh_dim_names != dense]
        if not other:
            continue
        rc = other[0][2]
        mesh = rc.device_mesh
        kind = next(c for c in type(module).__mro__ if not c.__name__.startswith("SimpleFSDP")).__name__
        replicas = math.prod(mesh.size(i) for i, p in enumerate(rc.param_sharding) if p.is_replicate())
        out.append(OutsideGroup((owner,), (kind,), tuple((f"{owner}.{n}", tuple(p.shape)) for n, p, _ in other),
                                "x".join(mesh.mesh_dim_names) if mesh.mesh_dim_names
                                else f"ranks {sorted(mesh.mesh.flatten().tolist())}", mesh.size(),
                                _why_not_carried(tuple(rc.param_sharding)), replicas))
    return out


# (SimpleFSDP class, marked parameter names) -> its subclass that marks them (`_marked_class`)
_MARKED_CLASSES: dict[tuple[type, frozenset[str]], type] = {}


def _marked_property(cls: type, name: str) -> property:
    """`cls`'s property for parameter `name` (SimpleFSDP's all-gathering parametrization) with
    its result routed through `_GiftTag` on the block this rank computes with, so the gradient
    reaching SimpleFSDP's reduce-scatter carries the `gift::mark` the module keeps for `name`."""
    base = getattr(cls, name)

    def get(self: nn.Module) -> torch.Tensor:
        w = base.__get__(self, cls)
        if not (torch.is_grad_enabled() and w.requires_grad):
            return w
        plan, tensors = self._gift_marks[name]
        return on_local_block(w, lambda block: _GiftTag.apply(block, plan, *tensors))

    return property(get)


def _marked_class(cls: type, names: frozenset[str]) -> type:
    """Cached subclass of SimpleFSDP's wrapper class `cls` whose properties for `names` mark the
    gradients (`_marked_property`); `api.remove` restores `cls` (`_gift_base_class`)."""
    key = (cls, names)
    if key not in _MARKED_CLASSES:
        props: dict[str, Any] = {name: _marked_property(cls, name) for name in names}
        _MARKED_CLASSES[key] = type(f"Gift{cls.__name__}", (cls,), {**props, "_gift_base_class": cls})
    return _MARKED_CLASSES[key]


def mark_outside(model: Parts, state: GiftState, groups: list[OutsideGroup]) -> OutsideMarks:
    """Mark the gradients of the parameters of `groups` the pass can carry over their own group
    (no `why`, more than one rank) with their Euclidean plans (`euclidean_plan`, over the
    gradient SimpleFSDP reduce-scatters over the mesh's shard dim: this rank's shard gathered
    over that dim's ranks) and their tensors: a seed offset, an empty probe (no layer measures
    them), the state's seed and counters and this rank's rank in the shard dim's group
    (stochastic rounding is seeded per group, the bytes count with the rest), and under
    `error_feedback` a residual of the whole local gradient for the reduce-scatter, kept and
    checkpointed by the state (`GiftState.add_outside_residual`; none where the shard dim has
    one rank: the replica hop alone keeps no residual). Logs one line per module; under HSDP
    (a replicated dim) `set_replica_hop` logs it, with the replica hop it adds. Returns each
    crossing parameter's plan, None for those that stay unmarked (`full_precision_params`), and
    the marked modules."""
    modules = {owner: m for part in model_parts(model) for owner, m in part.named_modules()}
    device = state.counters.device
    shared: dict[str, Shared] = {}  # per mesh
    out = OutsideMarks({}, [])
    for g in groups:
        if g.ranks == 1:
            continue
        owner, kind = g.modules[0], g.kinds[0]
        module = modules[owner]
        tensors: dict[str, tuple[ItemTensors, Shared]] = {}
        named: list[tuple[str, ItemPlan | None]] = []
        for fqn, _ in g.params:
            name = fqn[len(owner) + 1:] if owner else fqn
            mesh = _replicate_computation(module, name).device_mesh
            shards = mesh.size(mesh.ndim - 1)  # the shard dim is the last (`_why_not_carried`)
            local = tuple(module._parameters[name].to_local().shape)
            # error feedback on their reduce-scatter (a one-rank shard dim has none: the replica hop
            # alone carries no residual, as a layer's would belong to the shard hop)
            plan = None if g.why else euclidean_plan(state, fqn, gathered_shape(local, shards), shards,
                                                     error_feedback=shards > 1)
            out.plans[fqn] = plan
            named.append((name, plan))
            if plan is None:
                continue
            if g.group not in shared:
                rank = torch.full((), dist.get_rank(mesh.get_group(mesh.ndim - 1)), dtype=torch.int64, device=device)
                shared[g.group] = Shared(state.seed, rank, state.counters)
            # the rows stage 2 of a two-level exchange rounds, where the shard dim spans nodes
            rows = residual_rows(plan.rows, shards, node_layout(mesh.get_group(mesh.ndim - 1), plan.ranks_per_node))
            residual = state.add_outside_residual(fqn, (rows, plan.cols), device) if plan.error_feedback else None
            item = ItemTensors((), residual, probe=torch.zeros(0, plan.cols, device=device),
                               seed_offset=torch.tensor(plan.seed_offset, dtype=torch.int64, device=device))
            tensors[name] = item, shared[g.group]
        if g.why:
            continue
        verb = "reduce-scatters" if g.replicas == 1 else "reduces"
        if not tensors:  # GIFT sends none of them: their traced collectives stay as they are
            logger.info("GIFT: %s (%s) %s over mesh %r (%d ranks) unmarked, at full precision in its traced "
                        "collective (excluded, under min_numel, or rows not splitting over the ranks): %s",
                        owner, kind, verb, g.group, g.ranks, ", ".join(name for name, _ in named))
            continue
        replica_group = mesh.get_group(0) if g.replicas > 1 else None
        marked = _MarkedModule(g, module, named, tensors, replica_group)
        module._gift_marks = {}
        _pack_marks(marked, None)
        module.__class__ = _marked_class(type(module), frozenset(tensors))
        out.modules.append(marked)
        if replica_group is None:
            logger.log(_log_level(state), describe(owner, kind, g.group, g.ranks,
                                                   describe_items(named, state.config.error_feedback)))
    return out


def _pack_marks(marked: _MarkedModule, replica: Shared | None) -> None:
    """(Re)set the marks `marked.module` routes its parameters' gradients through: each plan and
    its tensors, with the replica hop's `replica` (its plans then have a `replica_format`)."""
    for name, plan in marked.named:
        if plan is not None:
            item, shared = marked.tensors[name]
            marked.module._gift_marks[name] = plan.to_str(), pack_mark_tensors(plan, item, shared, replica)


def _log_level(state: GiftState) -> int:
    """A warning where the state's geometry has a map the parameters outside GIFT go without."""
    return logging.INFO if state.geometry.is_identity else logging.WARNING


def set_replica_hop(state: GiftState, fmt: str, replica: Shared, group: dist.ProcessGroup) -> None:
    """Put HSDP's replica hop into the marks `mark_outside` put on parameters SimpleFSDP also
    replicates, as `LayerState.set_replica_hop` does for the managed linears': each plan gets
    ``replica_format = fmt`` and each mark the hop's `Shared` `replica` (its rank and its
    counters, so the hop's bytes count with the dense layers' replica hop's). The pass then
    replaces SimpleFSDP's replica all-reduce of such a gradient by GIFT's all-reduce of the
    reduced shard after the reduce-scatter, or, where the mesh's shard dim has one rank (no
    reduce-scatter: torchtitan's efsdp under EP x HSDP), by GIFT's all-reduce of the gradient
    alone. Call before the step is traced. Logs one line per module. Raises where such a
    module's replica group holds other ranks than `group` (the hop's), whose rank it carries."""
    if SIMPLE_FSDP.name not in state.adapters:
        return
    outside: OutsideMarks = attached(state, SIMPLE_FSDP.name)
    ranks = dist.get_process_group_ranks(group)
    for i, marked in enumerate(outside.modules):
        g = marked.group
        if marked.replica_group is None:
            continue
        if dist.get_process_group_ranks(marked.replica_group) != ranks:
            raise ValueError(f"GIFT: {g.modules[0]} ({g.kinds[0]}) is all-reduced over ranks "
                             f"{dist.get_process_group_ranks(marked.replica_group)}, the replica hop runs over {ranks}")
        named = [(name, None if plan is None else dataclasses.replace(plan, replica_format=fmt))
                 for name, plan in marked.named]
        marked = outside.modules[i] = marked._replace(named=named)
        _pack_marks(marked, replica)
        owner = g.modules[0]
        outside.plans.update({f"{owner}.{name}" if owner else name: plan for name, plan in named})
        logger.log(_log_level(state), _describe_replicated(marked, state.config.error_feedback, fmt))


def _describe_replicated(marked: _MarkedModule, error_feedback: bool, fmt: str) -> str:
    """The log line of a module whose gradients cross HSDP's shard and replica hops (`set_replica_hop`)."""
    g = marked.group
    owner, kind, shards = g.modules[0], g.kinds[0], g.ranks // g.replicas
    if shards == 1:
        return (f"GIFT: {owner} ({kind}) is sharded over mesh {g.group!r} with one rank along its shard dim (no "
                f"reduce-scatter): GIFT's replica hop all-reduces its gradient over the {g.replicas} replicas on "
                f"GIFT's codec with no map ({NO_MAP}): {describe_items(marked.named, error_feedback, fmt)}")
    return (f"GIFT: {owner} ({kind}) reduce-scatters over the {shards} shards of mesh {g.group!r}, then GIFT's replica "
            f"hop all-reduces the reduced shard over its {g.replicas} replicas, on GIFT's codec with no map "
            f"({NO_MAP}): {describe_items(marked.named, error_feedback)}; the replica hop at {fmt}")


def full_precision_params(state: GiftState) -> int | None:
    """How many parameters reduce over more than one rank outside GIFT's group without a mark
    (excluded, under `min_numel`, or refused under ``unrewritten="warn"``: `mark_outside`), so
    travel at full precision; None when the SimpleFSDP adapter is not installed on `state`."""
    if SIMPLE_FSDP.name not in state.adapters:
        return None
    return sum(plan is None for plan in attached(state, SIMPLE_FSDP.name).plans.values())


class _SimpleFSDPAdapter:
    """Models whose parameters are DTensors with a traced reduce-scatter (see the module docstring)."""

    name = "simple_fsdp"
    kind = "rewrite of the traced reduce-scatters"
    split_rows = True

    def detect(self, model: nn.Module) -> bool:
        from torch.distributed.tensor import DTensor

        return any(isinstance(p, DTensor) for p in model.parameters())

    def install(self, model: Parts, config: GiftConfig, group: dist.ProcessGroup | None, *,
                fuse: bool) -> GiftState:
        """Manage the linears in "tag" mode (the marks the pass rewrites); `fuse` concerns eager
        collectives, and these run in the compiled graph. `model` may be the parts one rank
        holds (torchtitan hands its model parts). Parameters reduced over another group than
        `group` (`outside_gift`) that the pass cannot carry are refused or logged first, per
        ``config.unrewritten``; a managed weight among them always raises; the others are
        marked (`mark_outside`). The adapter's slot keeps their plans (`full_precision_params`)."""
        outside = outside_gift(model, group if group is not None else dist.group.WORLD)
        refuse_outside(outside, config.unrewritten)
        state = manage(model, config, group, mode=ManageMode.TAG, split_rows=True)
        managed_outside = [fqn for g in outside for fqn, _ in g.params if fqn in state.layers]
        if managed_outside:
            raise ValueError(f"GIFT: managed weights {managed_outside} reduce-scatter over another process group than "
                             "GIFT's; exclude them (GiftConfig.exclude)")
        attach(state, self.name, mark_outside(model, state, outside))
        return state

    def no_sync(self, model: nn.Module, state: GiftState) -> AbstractContextManager[None]:
        """Refused: the reduce-scatters are part of the traced backward and run in every one."""
        raise ValueError("gift_compile.no_sync: a SimpleFSDP model's reduce-scatters are traced into its backward "
                         "and run in every backward; GIFT cannot defer them. Accumulate the framework's way "
                         "(torchtitan: --training.global-batch-size over several local batches)")

    def remove(self, model: nn.Module, state: GiftState) -> None:
        """Nothing of the framework's to restore: without the marks (the managed and marked
        classes are restored by `api.remove`; the marks' tensors go here) the pass leaves the
        framework's collectives alone."""
        for module in model.modules():
            module.__dict__.pop("_gift_marks", None)

    def telemetry(self, state: GiftState) -> dict[str, float]:
        """Nothing beyond the state's counters: the rewritten collectives count into them (the
        parameters outside GIFT are a count, not a per-step figure: `full_precision_params`)."""
        return {}


SIMPLE_FSDP = _SimpleFSDPAdapter()
