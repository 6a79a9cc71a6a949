"""`LayerState`: what GIFT keeps for one managed weight, built from its state's `LayerSpec`.

Its own module, below `GiftState`'s (`gift_compile.runtime.state`), because the refresh engine,
checkpointing and telemetry that `GiftState` inherits read layers too: importing the layer from
here keeps every one of them below `state` (no import cycle, TYPE_CHECKING included).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import torch

from gift_compile.codec import residual as residual_store
from gift_compile.config import layer_format
from gift_compile.exchange.collectives import ItemTensors, Shared
from gift_compile.exchange.mark import SyncMode, pack_mark_tensors
from gift_compile.exchange.node_stage import residual_rows
from gift_compile.exchange.plan import ItemPlan
from gift_compile.exchange.topology import FLAT, NodeLayout
from gift_compile.geometry.statistics import StatisticsSettings
from gift_compile.geometry.table import IDENTITY_KIND, Geometry
from gift_compile.runtime.selection import LayerMeasurement

__all__ = ["PROBE_ROWS", "LayerSpec", "LayerState", "OutsideResidual"]

PROBE_ROWS = 128


@dataclass(frozen=True)
class LayerSpec:
    """What every layer of one `GiftState` is built from, resolved once from the state's
    `GiftConfig` (`gift_compile.runtime.state.layer_spec`): the layers, their maps, statistics
    and plans read these values, never the config, so the config is read in one place.

    `plan` is every layer's plan but for what is the layer's own (its name, shape, map kind
    and tensor count, filled in by `LayerState`); its error-feedback flags and residual format
    say which residuals a layer keeps. `reselect` keeps the statistics of a decided layer
    running (`GiftConfig.reselect_every` > 0)."""

    geometry: type[Geometry]
    rank: int
    seed: int
    statistics: StatisticsSettings
    plan: ItemPlan
    reselect: bool
    # `GiftConfig.layer_formats`: a layer whose FQN an entry matches is planned at that format
    layer_formats: tuple[str, ...] = ()


@dataclass(frozen=True)
class OutsideResidual:
    """The error-feedback residual of a gradient GIFT sends with no map outside its layers
    (`gift_compile.frameworks.euclidean`: torchtitan's routed experts), `shape` `[rows, cols]`
    (the item's whole local gradient), stored as `buffers` in the state's residual format.
    The state keeps it (`GiftState.add_outside_residual`) so that it is checkpointed, validated
    and sized with the layers' residuals."""

    shape: tuple[int, int]
    buffers: tuple[torch.Tensor, ...]


class LayerState:
    """What GIFT keeps for one managed weight `[out, in]`.

    `plan` is the static description the `gift::mark` op carries into graphs; the transform
    tensors, `residual`, `second_hop_residual` and `probe` are the layer's runtime tensors;
    `stats` is fed by the layer's forward pre-hook. `world` sizes the second-hop residual:
    this rank's shard of the all-reduce, `ceil(out / world)` rows; the group's node `layout`
    the first-hop residual: the whole gradient's rows, or under a two-level exchange its
    node chunk's (`exchange.node_stage.residual_rows`), where stage 2 rounds.
    """

    def __init__(self, fqn: str, shape: tuple[int, int], spec: LayerSpec, device: torch.device | str,
                 world: int = 1, layout: NodeLayout = FLAT):
        self.fqn = fqn
        self.shape = (int(shape[0]), int(shape[1]))
        self.reselect = spec.reselect
        out, d_in = self.shape
        stable = zlib.crc32(fqn.encode()) & 0x7FFFFFFF
        geometry = spec.geometry
        self.transform = geometry(d_in, spec.rank, seed=spec.seed + stable, device=device)
        self.stats = geometry.make_statistics(spec.statistics, d_in, device)
        # Statistics shared with other layers that read the same input (q/k/v, gate/up):
        # a follower reads its leader's statistics and feeds none itself.
        self.leader: LayerState | None = None
        self.followers: list[LayerState] = []
        self.grad_factor: torch.Tensor | None = geometry.allocate_factor(d_in, device)
        plan = spec.plan
        self.probe = torch.zeros(min(out, PROBE_ROWS), d_in, device=device)
        self._full_plan = replace(plan, name=fqn, rows=out, cols=d_in, kind=geometry.kind,
                                  n_tensors=len(self.transform.tensors),
                                  format=layer_format(spec.layer_formats, fqn, plan.format))
        self.second_hop_residual = self._zero_rows(-(-out // world), plan.second_hop_error_feedback)
        self.seed_offset = torch.tensor(self._full_plan.seed_offset, dtype=torch.int64, device=device)
        self.residual: tuple[torch.Tensor, ...] | None = None
        self.size_residual(world, layout)
        # GIFT's own sync (`SyncMode`); `pending` is allocated when `gift_compile.no_sync` is first entered.
        self.mode = SyncMode.SYNC
        self.pending: torch.Tensor | None = None
        # Selection is structure: a layer takes the transformed path (`selected`) or runs the
        # Euclidean codec with no transform at all; `decided` ends the statistics of a
        # deselected layer (see GiftConfig.reselect_every).
        self.selected = False
        self.decided = False
        self.measurement: LayerMeasurement | None = None
        self.boundary_score = 0.0
        # `collect_stats` as a tensor (bool, 0-d), what a traced forward's statistics hook
        # reads (`routing.observe_inputs`): a Python flag there is a guard, one compilation
        # per pattern of selected layers, per block of a per-block compiled model.
        self.stats_gate = torch.zeros((), dtype=torch.bool, device=device)
        # `selected` as a tensor (bool, 0-d), what traced graphs read: they carry `traced_plan`,
        # the layer's map gated by it, so a selection change is data, not a recompile.
        self.path_gate = torch.zeros((), dtype=torch.bool, device=device)
        # HSDP's replica hop in a traced graph (`set_replica_hop`): its tensors ride on the mark
        self.replica: Shared | None = None
        self.transform.activate()  # a fixed rotation is always on; adaptive maps start as the identity
        self._replan()

    @property
    def kind(self) -> str:
        """The transform kind GIFT builds for this layer (used when it is selected)."""
        return self.transform.kind

    @property
    def active_kind(self) -> str:
        """The kind the collectives run now: the layer's, or the identity when not selected."""
        return self.transform.kind if self.selected else IDENTITY_KIND

    @property
    def needs_stats(self) -> bool:
        """Whether this layer's geometry must stay current: selected, or selection still open."""
        return self.stats is not None and (self.selected or not self.decided or self.reselect)

    @property
    def collect_stats(self) -> bool:
        """Whether this layer's forward feeds statistics: it or a follower needs them, and it
        is not itself a follower."""
        return self.leader is None and (self.needs_stats or any(f.needs_stats for f in self.followers))

    def size_residual(self, world: int, layout: NodeLayout) -> None:
        """Allocate the first-hop residual, zero, for an exchange over `world` ranks on `layout`
        (`exchange.node_stage.residual_rows`), where the plan has error feedback. Besides the
        constructor, `GiftState.exchange_over` calls it when an adapter's collective runs over
        another group than the state's (HSDP's shard group), whose own layout decides the rows
        its items send."""
        self.residual = self._zero_rows(residual_rows(self.shape[0], world, layout), self._full_plan.error_feedback)

    def carry_row_shard(self, rows: int, world: int) -> None:
        """Size the residuals (zero) and the gradient probe for an all-reduce over `world` ranks
        that carries `rows` of the layer's rows, this rank's row shard: HSDP under
        `shard_hop="native"`, whose replica hop all-reduces each rank's reduced shard with the
        layer's plan and is the only one that rounds. The map acts on columns, so it is the
        layer's own, unchanged; the probe keeps the shard's first rows (each rank its own: the refresh all-reduces the
        measurements, so every rank decides alike). Called before the first step."""
        plan = self._full_plan
        self.residual = self._zero_rows(rows, plan.error_feedback)
        self.second_hop_residual = self._zero_rows(-(-rows // world), plan.second_hop_error_feedback)
        self.probe = torch.zeros(min(rows, PROBE_ROWS), self.shape[1], device=self.probe.device)

    def _zero_rows(self, rows: int, kept: bool) -> tuple[torch.Tensor, ...] | None:
        """A zero residual of `rows` of the layer's rows in its residual format, where `kept`
        (the plan keeps that residual), else None."""
        return (residual_store.allocate(self._full_plan.residual_format, rows, self.shape[1], self.probe.device)
                if kept else None)

    def _replan(self) -> None:
        """The plans of the active path: `plan` (the eager codec's: the identity when not
        selected, so a deselected layer costs no map) and `traced_plan`, which graphs carry
        (selection independent: the map gated by `path_gate`; one graph for every selection),
        as text, and as GIFT's own sync marks it in graphs (`traced_sync_plan_str`)."""
        n = len(self.transform.tensors) if self.selected else 0
        self.plan = replace(self._full_plan, kind=self.active_kind, n_tensors=n)
        self.plan_str = self.plan.to_str()
        if self.transform.is_identity:
            self.traced_plan = self.plan
        else:
            self.traced_plan = replace(self._full_plan, n_tensors=len(self.transform.tensors) + 1, gated=True)
        self.traced_plan_str = self.traced_plan.to_str()  # precomputed: the forward passes it to traced code
        # what a traced backward of GIFT's own sync (`_GiftSync`) marks: the FX pass then makes
        # the ranks agree on the graph's plans before its first exchange
        self.traced_sync_plan_str = replace(self.traced_plan, own_sync=True).to_str()
        self.path_gate.fill_(self.selected)
        self.sync_stats_gate()

    def sync_stats_gate(self) -> None:
        """Set `stats_gate` to `collect_stats` (in place; called whenever that can change)."""
        self.stats_gate.fill_(self.collect_stats)

    def active_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.transform.tensors if self.selected else ()

    def tensors(self, transform: tuple[torch.Tensor, ...] | None = None) -> ItemTensors:
        """Runtime tensors for `gift_compile.exchange.collectives`, with the active path's map
        tensors unless `transform` is given (a traced mark's gated map: then `selected` is not
        read, which in a trace would be a guard)."""
        return ItemTensors(self.active_tensors() if transform is None else transform, self.residual, self.probe,
                           self.seed_offset, self.second_hop_residual)

    def residual_buffers(self) -> dict[str, tuple[torch.Tensor, ...]]:
        """The error-feedback residuals this layer keeps, by state-dict prefix (first hop:
        `residual`, the all-reduce's second hop: `second_hop_residual`)."""
        return {k: v for k, v in (("residual", self.residual), ("second_hop_residual", self.second_hop_residual))
                if v is not None}

    def mark_tensors(self, shared: Shared, *, traced: bool = False) -> list[torch.Tensor]:
        """Inputs of the `gift::mark` op (`gift_compile.exchange.mark.pack_mark_tensors`: the
        one definition of their order), for `plan` (eager) or, `traced`, for `traced_plan` (the
        whole map and `path_gate`), with the graph replica hop's when the plan has one."""
        if traced and self.traced_plan.gated:
            item = self.tensors((*self.transform.tensors, self.path_gate))
            return pack_mark_tensors(self.traced_plan, item, shared, self.replica)
        return pack_mark_tensors(self.plan, self.tensors(), shared, self.replica)

    def set_replica_hop(self, fmt: str, replica: Shared) -> None:
        """Put HSDP's replica hop into the plan the mark carries, at `fmt`, with the hop's
        `Shared` (seed, rank in the replica group, its counters), before any graph is traced."""
        self.replica = replica
        self._full_plan = replace(self._full_plan, replica_format=fmt)
        self._replan()

    def state_dict(self) -> dict[str, torch.Tensor]:
        sd = {f"transform.{k}": v for k, v in self.transform.state_dict().items()}
        if self.stats is not None:
            sd.update({f"stats.{k}": v for k, v in self.stats.state_dict().items()})
        if self.grad_factor is not None:
            sd["grad_factor"] = self.grad_factor
        for prefix, bufs in self.residual_buffers().items():
            sd.update({f"{prefix}.{i}": t for i, t in enumerate(bufs)})
        sd["probe"] = self.probe
        sd["selected"] = torch.tensor(self.selected)
        sd["decided"] = torch.tensor(self.decided)
        sd["boundary_score"] = torch.tensor(self.boundary_score)
        return sd
