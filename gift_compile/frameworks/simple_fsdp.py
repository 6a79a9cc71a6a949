"""GIFT for SimpleFSDP-style models (torchtitan's graph_trainer): DTensor parameters whose
reduce-scatters are traced into the backward graph.

Such a framework launches its gradient collectives from the graph, where the FX pass
(`gift_compile.passes.gift_pass`) rewrites each (possibly bucketed) reduce-scatter that carries
a managed weight's gradient into GIFT's collective. So the adapter only manages the weights in
"tag" mode: each managed weight's gradient gets its `gift::mark`, which the pass reads.

Parameters SimpleFSDP wraps on another data-parallel mesh than GIFT's group (torchtitan's
graph_trainer under expert parallelism wraps the routed experts on the ``efsdp`` mesh, the rest
on ``fsdp``) reduce-scatter over that mesh's group, a collective that carries no mark, so the pass
leaves it as traced: at full precision. That is never silent: `outside_gift` lists them and
`install` refuses them by name under ``unrewritten="error"`` (the default) or logs one line per
module under ``"warn"`` (`refuse_outside`); `full_precision_params` counts them for telemetry.
(FSDP2's custom reduce-scatter, which receives every parameter group's buffer, sends such
groups on GIFT's codec instead: `gift_compile.frameworks.fsdp2.EuclideanReduceScatter`.)
"""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import AbstractContextManager
from typing import NamedTuple

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from gift_compile.config import GiftConfig, Unrewritten
from gift_compile.frameworks.adapter import attach, attached
from gift_compile.frameworks.parts import Parts, model_parts
from gift_compile.frameworks.routing import ManageMode, manage
from gift_compile.runtime.state import GiftState

__all__ = ["SIMPLE_FSDP", "SIMPLE_FSDP_SPLIT", "OutsideGroup", "full_precision_params", "outside_gift", "refuse_outside"]

logger = logging.getLogger(__name__)

# Why SimpleFSDP's parameters on another mesh stay outside GIFT (`refuse_outside`).
SIMPLE_FSDP_SPLIT = ("SimpleFSDP wraps them on another data-parallel mesh than GIFT's group (graph_trainer's "
                     "apply_simple_fsdp: the routed experts on the efsdp mesh), so their traced reduce-scatters run "
                     "over that mesh's group and carry no GIFT mark, and the GIFT pass leaves them as traced (GIFT's "
                     "statistics, transforms and selection span one group)")


class OutsideGroup(NamedTuple):
    """Parameters of one module that SimpleFSDP reduce-scatters over another mesh than GIFT's
    group (torchtitan's routed experts under expert parallelism), in traced collectives the GIFT
    pass leaves alone."""

    modules: tuple[str, ...]  # the owning modules' names (from the root)
    kinds: tuple[str, ...]  # their classes
    params: tuple[tuple[str, tuple[int, ...]], ...]  # the parameters' names (from the root), unsharded shapes
    group: str  # the process group: its mesh dimensions' names (else its ranks)
    ranks: int  # its size (1: no collective)


def refuse_outside(groups: list[OutsideGroup], unrewritten: Unrewritten | str) -> None:
    """Raise (``unrewritten="error"``) naming the modules whose gradients `groups` carry at full
    precision past GIFT, or log one line per module (``"warn"``; a one-rank group, which sends
    nothing, is only logged)."""
    mode = Unrewritten.parse(unrewritten, "unrewritten")
    crossing = [g for g in groups if g.ranks > 1]
    why = SIMPLE_FSDP_SPLIT
    if any(len(shape) > 2 for g in crossing for _, shape in g.params):
        why += ("; and GIFT's matrices are 2-D linear weights with statistics of their inputs, while a grouped-GEMM "
                "expert weight is one 3-D tensor for a rank's experts, each fed only its routed tokens")
    if crossing and mode is Unrewritten.ERROR:
        names = "; ".join(f"{', '.join(f'{m} ({k})' for m, k in zip(g.modules, g.kinds))} over mesh {g.group!r} "
                          f"({g.ranks} ranks)" for g in crossing)
        raise ValueError(f"GIFT: the gradients of {names} would travel at full precision: {why}. Set "
                         "unrewritten='warn' (torchtitan: --gift.unrewritten warn) to run with them at full precision, "
                         "or use the FSDP2 trainer, which sends them on GIFT's codec")
    for g in groups:
        for module, kind in zip(g.modules, g.kinds):
            if g.ranks > 1:
                logger.warning("GIFT: %s (%s) reduce-scatters over mesh %r (%d ranks) at full precision, not managed: "
                               "%s (unrewritten='warn')", module, kind, g.group, g.ranks, why)
            else:
                logger.info("GIFT: %s (%s) is sharded over mesh %r (one rank): its gradient crosses no rank, "
                            "nothing to compress", module, kind, g.group)


def _data_parallel_mesh(module: nn.Module, name: str) -> DeviceMesh:
    """The mesh SimpleFSDP all-gathers ``module.<name>`` over and reduce-scatters its gradient
    over: the ``device_mesh`` of the parametrization (torchtitan's ``ReplicateComputation``)
    that the wrapper class's property for `name` calls. The parameter's own DTensor mesh cannot
    tell: it is that mesh concatenated with the EP/TP mesh the parameter had before. Raises when
    the property is not SimpleFSDP's."""
    prop = type(module).__dict__.get(name)
    cells = getattr(getattr(prop, "fget", None), "__closure__", None) or ()
    found = [c.cell_contents for c in cells
             if hasattr(c.cell_contents, "device_mesh") and hasattr(c.cell_contents, "param_sharding")]
    if len(found) != 1:
        raise RuntimeError(f"gift_compile: {type(module).__name__}.{name} is a DTensor parameter without SimpleFSDP's "
                           "parametrization (a property calling a ReplicateComputation), so the mesh its gradient is "
                           "reduced over is unknown: the simple_fsdp adapter takes models wrapped by torchtitan "
                           "graph_trainer's SimpleFSDP (data_parallel) only, and this one is not, or that wrapping changed")
    return found[0].device_mesh


def outside_gift(model: Parts, group: dist.ProcessGroup) -> list[OutsideGroup]:
    """One entry per module whose SimpleFSDP-wrapped parameters reduce their gradients over
    another mesh than the model's data-parallel one: other ranks than `group` (GIFT's state
    group: the fsdp mesh's, or under HSDP the replicas x shards', compared as rank sets, since
    that group is not itself one of SimpleFSDP's mesh dimensions under HSDP), or a mesh of other
    dimensions than the one most parameters use (with TP the routed experts' efsdp group can
    hold the same ranks as the fsdp group, but is another collective the pass never sees a mark
    in). Their traced collectives carry no mark (the module docstring)."""
    from torch.distributed.tensor import DTensor

    gift_ranks = set(dist.get_process_group_ranks(group))
    found = []
    for part in model_parts(model):
        for owner, module in part.named_modules():
            params = [(n, p) for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)]
            found.append((owner, module, [(n, p, _data_parallel_mesh(module, n)) for n, p in params]))
    sizes: Counter[tuple[str, ...] | None] = Counter()  # elements per mesh (by its dimensions' names)
    for _, _, params in found:
        for _, p, m in params:
            sizes[m.mesh_dim_names] += p.numel()
    dense = sizes.most_common(1)[0][0] if sizes else None
    out = []
    for owner, module, params in found:
        other = [(n, p, m) for n, p, m in params
                 if set(m.mesh.flatten().tolist()) != gift_ranks or m.mesh_dim_names != dense]
        if not other:
            continue
        mesh = other[0][2]
        kind = next(c for c in type(module).__mro__ if not c.__name__.startswith("SimpleFSDP")).__name__
        out.append(OutsideGroup((owner,), (kind,), tuple((f"{owner}.{n}", tuple(p.shape)) for n, p, _ in other),
                                "x".join(mesh.mesh_dim_names) if mesh.mesh_dim_names
                                else f"ranks {sorted(mesh.mesh.flatten().tolist())}", mesh.size()))
    return out


def full_precision_params(state: GiftState) -> int | None:
    """How many parameters reduce-scatter over more than one rank outside GIFT (`outside_gift`,
    as `install` found them: the routed experts under expert parallelism); None when the
    SimpleFSDP adapter is not installed on `state`."""
    if SIMPLE_FSDP.name not in state.adapters:
        return None
    return sum(len(g.params) for g in attached(state, SIMPLE_FSDP.name) if g.ranks > 1)


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
        holds (torchtitan hands its model parts). Parameters reduce-scattered over another
        group than `group` (`outside_gift`) are refused or logged first, per
        ``config.unrewritten``; a managed weight among them always raises. The adapter's slot
        keeps them (`full_precision_params`)."""
        outside = outside_gift(model, group if group is not None else dist.group.WORLD)
        refuse_outside(outside, config.unrewritten)
        state = manage(model, config, group, mode=ManageMode.TAG, split_rows=True)
        managed_outside = [fqn for g in outside for fqn, _ in g.params if fqn in state.layers]
        if managed_outside:
            raise ValueError(f"GIFT: managed weights {managed_outside} reduce-scatter over another process group than "
                             "GIFT's; exclude them (GiftConfig.exclude)")
        attach(state, self.name, outside)
        return state

    def no_sync(self, model: nn.Module, state: GiftState) -> AbstractContextManager[None]:
        """Refused: the reduce-scatters are part of the traced backward and run in every one."""
        raise ValueError("gift_compile.no_sync: a SimpleFSDP model's reduce-scatters are traced into its backward "
                         "and run in every backward; GIFT cannot defer them. Accumulate the framework's way "
                         "(torchtitan: --training.global-batch-size over several local batches)")

    def remove(self, model: nn.Module, state: GiftState) -> None:
        """Nothing of the framework's to restore: without the marks (the managed classes are
        restored by `api.remove`) the pass leaves the framework's collectives alone."""

    def telemetry(self, state: GiftState) -> dict[str, float]:
        """Nothing beyond the state's counters: the rewritten collectives count into them (the
        parameters outside GIFT are a count, not a per-step figure: `full_precision_params`)."""
        return {}


SIMPLE_FSDP = _SimpleFSDPAdapter()
