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
parameter in the same collective by the rule for gradients outside the layers
(`frameworks.euclidean`: plain coordinates at `unmapped_format`, tiny ones at `tiny_format`). The graph path (a bucketed reduce-scatter
rewritten by the pass) runs the same functions on the same layout.

`install` also asks FSDP2 to reduce-scatter unused parameters (zeros,
`set_reduce_scatter_unused_params`), so every call holds every parameter that requires a
gradient and the layout always maps; a buffer that does not match raises.

A module sharded on a per-parameter mesh (torchtitan's MoE blocks under expert parallelism:
routed experts on the ``efsdp`` mesh, attention, router and shared experts on the ``fsdp``
mesh) has one parameter group per mesh (`fsdp_internals.set_group_reduce_scatter` sets a comm
on one of them). GIFT's state spans one process group (the one every FSDP module
reduce-scatters over, `shard_group`): that group of such a module gets `GiftReduceScatter`, the
others `EuclideanReduceScatter`, GIFT's codec over their own group (the grouped expert weights
as stacks of matrices, each rank receiving its own experts' rows): with no map, or, under a
geometry with input statistics or a fixed map, each expert through its own map as a layer of the
experts' own state (`_whitened_experts`, `gift_compile.runtime.experts`). `install` logs one line
per such module saying what goes how; no gradient crosses ranks at full precision unless the
config opts out (`unmapped_format` / `tiny_format` "fp32").

Why one module: the adapter, its two custom reduce-scatters (GIFT's, and the Euclidean one for
gradients outside GIFT's group) and install / uninstall all rest on FSDP2's packing rule above and
on the same internals fence; split, each part would restate that rule.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from gift_compile.exchange.collectives import (
    C_CALLS, ItemTensors, Segment, Shared, bucket_plan, bucket_wire_bytes, count_raw, per_call_check, sync_buffer,
)
from gift_compile.exchange.node_stage import residual_rows
from gift_compile.exchange.plan import BucketPlan, Collective, ItemPlan
from gift_compile.exchange.topology import FLAT, node_layout
from gift_compile.frameworks.fsdp_internals import (
    DefaultReduceScatter, PackedParam, ReduceScatter, check_torch, custom_reduce_scatter, fsdp_modules, packed_params, same_group,
    set_group_reduce_scatter, shard_mesh_dims, shard_process_groups, sharded_params,
)
from gift_compile.config import NATIVE_NODE_FORMAT, GiftConfig
from gift_compile.frameworks.adapter import attach, attached
from gift_compile.frameworks.euclidean import describe, describe_items, euclidean_plan, gathered_shape, outside_item
from gift_compile.frameworks.grouped_experts import INPUTS, expert_layers, is_grouped_experts
from gift_compile.frameworks.parts import Parts, model_parts
from gift_compile.frameworks.routing import ManageMode, manage
from gift_compile.geometry.table import IDENTITY_KIND
from gift_compile.runtime.health import queue_backward_check
from gift_compile.runtime.experts import ExpertLayers, GroupedWeight
from gift_compile.runtime.layer import PROBE_ROWS, LayerState
from gift_compile.runtime.selection import relative_error, round_trip
from gift_compile.runtime.state import GiftState
from gift_compile.runtime.telemetry import CommTimer
from gift_compile.sync import GroupByName

__all__ = ["FSDP2", "EuclideanReduceScatter", "GiftReduceScatter", "accounted_bytes", "discarded_gradients",
           "discarding", "euclidean_errors", "install", "shard_group", "uninstall"]

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


def _layer_of(p: PackedParam) -> LayerState | None:
    """The GIFT layer whose rows packed parameter `p` is: a managed weight sharded on dim 0 with
    its layer's columns (else it goes as an item outside the layers)."""
    layer = getattr(p.module, "_gift_layer", None) if p.param_name == "weight" else None
    return layer if layer is not None and p.dim0 and p.cols == layer.shape[1] else None


class GiftReduceScatter(ReduceScatter):
    """FSDP2 custom reduce-scatter of one FSDP module (see the module docstring)."""

    # held by name, so a destroyed group's threads end with it (`gift_compile.sync.GroupByName`)
    over = GroupByName()

    def __init__(self, module: FSDPModule, state: GiftState, timer: CommTimer, compiled: bool,
                 over: dist.ProcessGroup | None = None, names: dict[int, str] | None = None) -> None:
        self.module = module
        self.over = over  # the process group of the module's parameter group this comm serves (None: its only one)
        self.state = state
        self.timer = timer
        self.compiled = compiled
        # (world, dtype, group name) of the last call: what `accounted_bytes` prices
        self.last_call: tuple[int, torch.dtype, str] | None = None
        # the items of the parameters outside the layers (`euclidean.outside_item`), by (owner
        # module, name): the buffer's layout, `[world * rows, cols]` of each rank's padded
        # shard, is what the reduce-scatter reduces, so uneven dim-0 shards split whole
        self._outside: dict[tuple[int, str], tuple[ItemPlan | None, ItemTensors | None]] = {}
        # the ranks and node layout of the collective the layers' gradients cross (HSDP: the
        # shard group's, `GiftState.exchange_over`), which the outside items are sized for too
        self._world, layout = state.exchange
        # HSDP with `shard_hop="native"`: this reduce-scatter runs FSDP2's own at the gradient's
        # dtype, and the replica hop all-reduces each rank's reduced row shard with the items'
        # plans (`gift_compile.frameworks.hsdp`), so the outside items are planned for that
        self.native = state.config.shard_hop == NATIVE_NODE_FORMAT
        self._per_rank = 1 if self.native else self._world  # an outside plan's rows per rank's rows
        if names is not None:  # (`EuclideanReduceScatter` plans its own)
            world = self._world
            for p in packed_params(module, over):
                if _layer_of(p) is not None:
                    continue
                owner = names.get(id(p.module), "")
                fqn = f"{owner}.{p.param_name}" if owner else p.param_name
                self._outside[id(p.module), p.param_name] = (
                    outside_item(state, fqn, (p.rows, *p.local[1:]), world, state.counters.device,
                                 collective=Collective.ALL_REDUCE, layout=FLAT) if self.native else
                    outside_item(state, fqn, (world * p.rows, *p.local[1:]), world, state.counters.device,
                                 collective=Collective.REDUCE_SCATTER, layout=layout))

    # whether its managed items are the state's layers (selection, maps, the layers' residuals)
    has_layers = True

    @property
    def shared(self) -> Shared:
        """Seed, rank and counters of this comm's collectives: the state's."""
        return self.state.shared

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _segments(self) -> list[Segment]:
        """Every parameter FSDP2 packs in this call (those requiring a gradient, in FSDP2's
        order) as a segment of its per-rank rows: managed weights with their layer's plan."""
        out = []
        for p in packed_params(self.module, self.over):
            layer = _layer_of(p)
            if layer is not None:
                out.append(Segment(p.fqn, p.rows, p.cols, layer.plan, layer.tensors()))
                continue
            plan, tensors = self._outside.get((id(p.module), p.param_name), (None, None))
            out.append(Segment(p.fqn, p.rows, p.cols) if plan is None
                       else Segment(plan.name, plan.rows // self._per_rank, plan.cols, plan, tensors))
        return out

    def layer_rows(self) -> list[tuple[LayerState, int]]:
        """Each managed weight's layer with the rows of it a rank's shard holds (FSDP2's dim-0
        shard, padded): what HSDP's replica hop carries under `shard_hop="native"`."""
        return [(layer, p.rows) for p in packed_params(self.module, self.over) if (layer := _layer_of(p)) is not None]

    def raw_bytes(self, world: int, dtype: torch.dtype) -> int:
        """Bytes one call hands to the native reduce-scatter (`native`): every rank's rows of
        every parameter at the gradient's dtype."""
        return world * sum(s.rows * s.cols for s in self._segments()) * dtype.itemsize

    def _native(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                op: Any, async_op: bool) -> dist.Work | None:
        """FSDP2's own reduce-scatter (`shard_hop="native"`), its bytes counted as handed over:
        raw, so the wire and the baseline are the buffer's, inside the node where the shard
        group is (`C_NODE_WIRE`). Refused without HSDP's replica hop, which alone would code
        the layers: plain FSDP2 would then send everything raw while GIFT reported it managed."""
        if "hsdp" not in self.state.adapters:  # `gift_compile.frameworks.hsdp.NAME` (a module above this one)
            raise RuntimeError("GIFT FSDP2: shard_hop='native' leaves the reduce-scatter to FSDP2 at full precision "
                               "and codes the layers on HSDP's replica hop, but no replica hop is installed "
                               "(gift_compile.frameworks.hsdp.install); use shard_hop='gift' for FSDP2 alone")
        wire = input_tensor.numel() * input_tensor.element_size()
        count_raw(self.state.counters, self.state.exchange[1], wire, wire)
        self.state.counters[C_CALLS] += 1
        return DefaultReduceScatter()(output_tensor, input_tensor, group, op, async_op)

    def plan(self, world: int, dtype: torch.dtype, group_name: str | None = None) -> BucketPlan:
        """The bucket this module's reduce-scatter runs: one item per parameter (managed
        weights quantized, the others at full precision), FSDP2's order, on the group's node
        layout (two levels where it spans nodes)."""
        config = self.state.config
        layout = node_layout(group_name, config.ranks_per_node, config.intra_node_format) if group_name else FLAT
        return bucket_plan(self._segments(), dtype, world=world, group_name=group_name, average=False,
                           op=Collective.REDUCE_SCATTER, layout=layout)

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
        if self.native:
            work = self._native(output_tensor, input_tensor, group, op, async_op)
            queue_backward_check(self.state)
            return work
        sync_buffer(input_tensor, segments, self.shared, op=Collective.REDUCE_SCATTER, group=group, average=False,
                    out=output_tensor, plan_check=per_call_check(config), compiled=self.compiled,
                    timing=self.timer.timing(input_tensor.device), ranks_per_node=config.ranks_per_node,
                    intra_node_format=config.intra_node_format)
        queue_backward_check(self.state)
        return None


def shard_group(model: Parts, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The process group FSDP2 reduce-scatters over: the one every FSDP module of the whole
    model (all of its parts) has a parameter group on (a module with a per-parameter mesh has
    others besides, which `install` puts on `EuclideanReduceScatter`)."""
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


class EuclideanReduceScatter(GiftReduceScatter):
    """GIFT's reduce-scatter of a parameter group FSDP2 shards on another mesh than GIFT's
    group (a per-parameter mesh: torchtitan's routed experts on ``efsdp`` under expert
    parallelism), with GIFT's codec and no map.

    GIFT's layers (statistics, transforms, selection) belong to the state's group, and a
    grouped-GEMM expert weight `[E, out, in]` is one tensor for a rank's
    experts, each fed only its routed tokens: no linear layer's statistics describe it. Its
    gradient is still a stack of `[out, in]` matrices, and FSDP2's dim-0 shard gives each rank
    whole experts, so it goes as one Euclidean item `[E * out, in]` (`euclidean.euclidean_plan`): each
    rank receives the summed rows of its own experts, every row with its own scales, at the
    state's format (or its `layer_formats` entry). Parameters it cannot carry that way (not
    sharded on dim 0, fewer than two dims, under `min_numel`, excluded) go raw in the same
    collective, as a dense group's norms do. The bytes go to the state's counters, so the
    telemetry, accounting and health checks see them with the rest; the rank that seeds
    stochastic rounding is this group's. Under `error_feedback` each quantized item keeps its
    residual (`keep_error_feedback`), which the state checkpoints.
    """

    def __init__(self, module: FSDPModule, state: GiftState, timer: CommTimer, compiled: bool,
                 over: dist.ProcessGroup, names: dict[int, str],
                 experts: dict[int, ExpertLayers] | None = None) -> None:
        super().__init__(module, state, timer, compiled, over)
        # grouped weights whose experts are GIFT layers (`runtime.experts`): sent as grouped items
        self._whitened: dict[tuple[int, str], GroupedWeight] = {
            (module_id, name): weight for module_id, layers in (experts or {}).items()
            for name, weight in layers.weights.items()}
        self.rank = torch.full((), dist.get_rank(over), dtype=torch.int64, device=state.counters.device)
        # FSDP2 names its parameters only once it has run, so each is named from its owner's FQN in
        # the model (`names`: id(module) -> FQN) and keyed by (owner, name) here
        self._owners: dict[int, tuple[str, str]] = {}
        self._plans: dict[tuple[int, str], tuple[str, ItemPlan | None]] = {}
        # what each plan is made from: the parameter's FQN and the gradient the collective reduces
        self._shapes: dict[tuple[int, str], tuple[str, tuple[int, ...]]] = {}
        for p in packed_params(module, over):
            owner = names.get(id(p.module), "")
            self._owners[id(p.module)] = (owner, type(p.module).__name__)
            fqn = f"{owner}.{p.param_name}" if owner else p.param_name
            # FSDP2 hands over the whole gradient; a shard on another dim has no rows to split (raw)
            shape = gathered_shape(p.local, over.size()) if p.dim0 else ()
            self._shapes[id(p.module), p.param_name] = fqn, shape
            key = id(p.module), p.param_name
            self._plans[key] = fqn, (self._whitened[key].plan if key in self._whitened
                                     else euclidean_plan(state, fqn, shape, over.size()))
        device = state.counters.device
        self._seeds = {key: torch.tensor(plan.seed_offset, dtype=torch.int64, device=device)
                       for key, (_, plan) in self._plans.items() if plan is not None and key not in self._whitened}
        # each item's first gradient rows as last sent (the codec copies them), for `errors`
        self._probes = {key: torch.zeros(min(plan.rows, PROBE_ROWS), plan.cols, device=device)
                        for key, (_, plan) in self._plans.items() if plan is not None and key not in self._whitened}
        self._residuals: dict[tuple[int, str], tuple[torch.Tensor, ...]] = {}
        if over.size() > 1:  # a one-rank group sends nothing, unless HSDP's replica hop carries it
            self.keep_error_feedback()

    has_layers = False

    def keep_error_feedback(self) -> None:
        """Give every quantized item error feedback where the config asks for it: its plan with
        the state's error feedback and a residual of its whole local gradient, kept by the state
        (`GiftState.add_outside_residual`, so checkpoints carry it). Called for a group whose
        items cross ranks: its own reduce-scatter, or (one rank) HSDP's replica hop as the only
        hop (`gift_compile.frameworks.hsdp.install`)."""
        if self._residuals:
            return
        for key, (fqn, shape) in self._shapes.items():
            if key in self._whitened:  # the experts' layers keep theirs (`ExpertLayers`)
                continue
            plan = euclidean_plan(self.state, fqn, shape, self.over.size(), error_feedback=True)
            if plan is not None and plan.error_feedback:
                self._plans[key] = fqn, plan
                # the rows stage 2 of a two-level exchange rounds, where the group spans nodes
                layout = node_layout(self.over, self.state.config.ranks_per_node)
                rows = residual_rows(plan.rows, self.over.size(), layout)
                self._residuals[key] = self.state.add_outside_residual(fqn, (rows, plan.cols),
                                                                       self.state.counters.device)

    @property
    def shared(self) -> Shared:
        return Shared(self.state.seed, self.rank, self.state.counters)

    def _segments(self) -> list[Segment]:
        out = []
        for p in packed_params(self.module, self.over):
            key = id(p.module), p.param_name
            fqn, plan = self._plans[key]
            if plan is None:
                out.append(Segment(fqn, p.rows, p.cols))
                continue
            world = self.over.size()
            tensors = (self._whitened[key].tensors(dist.get_rank(self.over), world) if key in self._whitened
                       else ItemTensors((), self._residuals.get(key), self._probes[key], self._seeds[key]))
            out.append(Segment(fqn, plan.rows // world, plan.cols, plan, tensors))
        return out

    def errors(self) -> dict[str, float]:
        """Relative round-trip error, at its format, of each quantized parameter's rows as this
        rank last sent them (its local gradient's first rows: the first local expert's): the
        experts' counterpart of a layer's Euclidean error at a refresh. NaN before anything was
        sent (a one-rank group without HSDP sends nothing) or for a non-finite gradient."""
        out = {}
        for key, (fqn, plan) in self._plans.items():
            if plan is None or key in self._whitened:  # the experts' layers are measured at refreshes
                continue
            g = self._probes[key]
            finite = bool(torch.isfinite(g).all()) and float(g.norm()) > 0.0
            out[fqn] = (relative_error(round_trip(g, plan.spec, IDENTITY_KIND, (), plan.block_rotation), g)
                        if finite else math.nan)
        return out

    def describe(self) -> list[str]:
        """One line per module owning parameters of the group: its mesh, which parameters go
        quantized (and how), which raw."""
        mesh = "x".join(shard_mesh_dims(self.module, self.over)) or self.over_name
        lines = []
        for module_id, (owner, kind) in self._owners.items():
            whitened = [(name, w) for (m, name), w in self._whitened.items() if m == module_id]
            if whitened:
                how = ", ".join(f"{name} as [{w.plan.rows}, {w.plan.cols}] at {w.plan.format}, {len(w.layers)} experts "
                                f"each with its own {w.plan.kind} map" for name, w in whitened)
                lines.append(f"GIFT: {owner} ({kind}) reduce-scatters over mesh {mesh!r} ({self.over.size()} ranks) "
                             f"on GIFT's codec, each local expert a GIFT layer of the experts' own state: {how}")
                continue
            plans = [(name, plan) for (m, name), (_, plan) in self._plans.items() if m == module_id]
            # one rank: no reduce-scatter, only HSDP's replica hop, at its own format and with the
            # config's error feedback (`keep_error_feedback` when that hop is installed)
            several = self.over.size() > 1
            how = describe_items(plans, several and self.state.config.error_feedback,
                                 None if several else self.state.config.replica_hop_format)
            if not several:
                lines.append(f"GIFT: {owner} ({kind}) is sharded over mesh {mesh!r} (one rank): its gradient crosses "
                             f"no rank in a reduce-scatter (under HSDP GIFT's replica hop sends it with no map: {how})")
            else:
                why = ("the geometry has no map" if self.state.geometry.is_identity else
                       "its weights are not GIFT layers: excluded, or see the warning naming it")
                lines.append(describe(owner, kind, mesh, self.over.size(), how, why))
        return lines


def install(model: Parts, state: GiftState, *, compiled: bool = True) -> CommTimer:
    """Put every FSDP parameter group of `model` (of all its parts, the pipeline stages a rank
    holds, which share `state` and one comm timer) on GIFT's reduce-scatter; returns the timer.

    Forces FSDP2's SUM reduction (FSDP2 then applies its gradient divide factor itself) and
    the reduce-scatter of unused parameters, so every buffer maps onto the parameters. The
    timer is kept in the state's per-adapter slot (the FSDP2 adapter's telemetry reads it).
    The groups over `shard_group` get `GiftReduceScatter`; a group over another mesh (a
    per-parameter mesh: torchtitan's routed experts on ``efsdp``) gets `EuclideanReduceScatter`,
    logged once per module (a warning where the state's geometry has a map those parameters go
    without), and a managed linear weight in such a group raises, as does one that lies in no FSDP
    module (`_refuse_weights_outside_fsdp`). A group over one rank carries no gradient collective
    (FSDP2 copies its gradient; under HSDP the replica hop then carries it).
    """
    check_torch()
    pg = shard_group(model, None)
    _refuse_weights_outside_fsdp(model)
    managed_outside = [p.fqn for module in fsdp_modules(model) for other in shard_process_groups(module)
                       if not same_group(other, pg) for p in packed_params(module, other)
                       if p.param_name == "weight" and getattr(p.module, "_gift_layer", None) is not None]
    if managed_outside:
        raise ValueError(f"GIFT: managed weights {managed_outside} reduce-scatter over another process group than "
                         f"GIFT's ({pg.group_name!r}); exclude them (GiftConfig.exclude)")
    # HSDP: the state spans shards x replicas, the reduce-scatter only the shard group, which
    # may be one level where the state's group is two (its residuals then have other rows)
    state.exchange_over(pg)
    names = {id(m): n for part in model_parts(model) for n, m in part.named_modules()}
    timer = CommTimer()
    experts_states: dict[str, GiftState] = {}  # the experts' own state per group (`_whitened_experts`)
    for module in fsdp_modules(model):
        module.set_force_sum_reduction_for_comms(True)
        module.set_reduce_scatter_unused_params(True)
        groups = shard_process_groups(module)
        for group in groups:
            if same_group(group, pg):
                set_group_reduce_scatter(module, pg, GiftReduceScatter(module, state, timer, compiled,
                                                                       pg if len(groups) > 1 else None, names))
                continue
            experts = _whitened_experts(state, module, group, names, experts_states)
            comm = EuclideanReduceScatter(module, state, timer, compiled, group, names, experts)
            set_group_reduce_scatter(module, group, comm)
            level = logging.INFO if state.geometry.is_identity or group.size() == 1 or experts else logging.WARNING
            for line in comm.describe():
                logger.log(level, line)
    for sub in experts_states.values():
        sub.check_agreement()
    attach(state, FSDP2.name, timer)
    return timer


def _refuse_weights_outside_fsdp(model: Parts) -> None:
    """Raise naming every managed weight that lies in no FSDP module, and warn naming the other
    trainable parameters there.

    `fully_shard` on some submodules only leaves the parameters of the rest as plain tensors:
    FSDP2 runs no collective for their gradients, and GIFT's only hook on this path is FSDP2's
    reduce-scatter, so each rank would keep its own gradient while the report, the traffic
    lines and `comm_totals` counted such a weight as managed and compressed. A managed weight
    is GIFT's claim, so it is refused; another parameter there is FSDP2's own behaviour (a user
    may sync it by hand, as `fully_shard(ignored_params=...)` intends), so it is only named.
    Every rank holds the same module structure, so every rank raises the same error."""
    sharded = sharded_params(model)
    managed, others = [], []
    for part in model_parts(model):
        for fqn, module in part.named_modules():
            for pname, p in module._parameters.items():
                if p is None or not p.requires_grad or (id(module), pname) in sharded:
                    continue
                name = f"{fqn}.{pname}" if fqn else pname
                is_layer = pname == "weight" and getattr(module, "_gift_layer", None) is not None
                (managed if is_layer else others).append(name)
    if managed:
        raise ValueError(
            f"gift_compile: managed weight(s) {', '.join(managed)} lie in no FSDP module: fully_shard was applied to "
            "submodules that do not contain them, so FSDP2 runs no collective for their gradients and GIFT (which "
            "hooks FSDP2's reduce-scatter) would not either: every rank would keep its own gradient. Apply fully_shard "
            "to the modules holding them too (fully_shard(model) on the root, after the submodules, covers every "
            "parameter left over) before gift_compile.apply")
    if others:
        logger.warning("GIFT: %d trainable parameter(s) lie in no FSDP module, so neither FSDP2 nor GIFT reduces "
                       "their gradients (each rank keeps its own unless you sync them): %s; fully_shard(model) on the "
                       "root covers them", len(others), ", ".join(others))


def _whitened_experts(state: GiftState, module: FSDPModule, group: dist.ProcessGroup, names: dict[int, str],
                      states: dict[str, GiftState]) -> dict[int, ExpertLayers]:
    """The grouped-GEMM experts modules of `module`'s parameter group over `group` whose local
    experts become GIFT layers (`grouped_experts.expert_layers`) of the experts' own state over
    `group` (one per group, in `states`, driven by `state`: `GiftState.substates`), by module id.
    None where the geometry has no map or the group has one rank (no reduce-scatter); a module
    whose grouped weights are excluded (`GiftConfig.exclude`) goes as Euclidean items, and one
    whose grouped weights are sharded on another dim or whose experts do not split whole over the
    group's ranks too, with a warning naming it and why.
    A geometry whose factor is gradient-side (`second_moment`, the AdamW default; `momentum`,
    `gradient`) reads each expert's rows of the 3-D weight's optimizer state or gradient
    (`GiftState.blocks`)."""
    if state.geometry.is_identity or group.size() == 1:
        return {}
    owners: dict[int, tuple[nn.Module, dict[str, tuple[int, int, int]]]] = {}
    other_dim: set[int] = set()  # modules with a grouped weight FSDP2 shards on another dim than 0
    for p in packed_params(module, group):
        if is_grouped_experts(p.module) and p.param_name in INPUTS:
            owner = names.get(id(p.module), "")
            entry = owners.setdefault(id(p.module), (p.module, {}))
            if not p.dim0:
                other_dim.add(id(p.module))
            elif not state.config.is_excluded(f"{owner}.{p.param_name}" if owner else p.param_name):
                entry[1][p.param_name] = gathered_shape(p.local, group.size())  # type: ignore[assignment]
    out = {}
    for module_id, (experts_module, shapes) in owners.items():
        owner = names.get(module_id, "")
        if module_id in other_dim:
            why = ("FSDP2 shards its grouped weights on another dim than 0 (torchtitan does so with more efsdp x ep "
                   "ranks than experts), so no rank holds whole experts; they go raw")
        elif not shapes:  # every grouped weight excluded: the Euclidean items say so
            continue
        else:
            experts = next(iter(shapes.values()))[0]
            why = (f"only {len(shapes)} of its 3 grouped weights are not excluded" if len(shapes) != len(INPUTS) else
                   f"its {experts} local experts do not split whole over {group.size()} ranks"
                   if experts % group.size() else "")
        if why:
            logger.warning("GIFT: %s (%s): its experts are not whitened, %s", owner, type(experts_module).__name__, why)
            continue
        if group.group_name not in states:
            sub = GiftState(state.config, group, collective=Collective.REDUCE_SCATTER)
            sub.grad_source = sub.factor_source(None)  # the optimizer's state once `attach_optimizer` runs
            states[group.group_name] = sub
            state.substates.append(sub)
        out[module_id] = expert_layers(states[group.group_name], owner, experts_module, shapes,
                                       state.counters.device)
    return out


def uninstall(model: Parts) -> None:
    """FSDP2's default reduce-scatter back on every FSDP module of `model` (on each parameter
    group GIFT's reduce-scatter runs on)."""
    for module in fsdp_modules(model):
        for pg in shard_process_groups(module):
            if isinstance(custom_reduce_scatter(module, pg if len(shard_process_groups(module)) > 1 else None),
                          GiftReduceScatter):
                set_group_reduce_scatter(module, pg, DefaultReduceScatter())


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


def euclidean_errors(model: Parts) -> dict[str, float]:
    """`EuclideanReduceScatter.errors` of every such comm on `model` (the routed experts' under
    expert parallelism), by parameter FQN; empty without one."""
    return {fqn: err for comm in _gift_comms(model) if isinstance(comm, EuclideanReduceScatter)
            for fqn, err in comm.errors().items()}


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
