"""`GiftState`: the layers of one `apply` (`gift_compile.runtime.layer`), the step driver and health.

Everything a compiled graph reads or writes (transform tensors, error-feedback residual, the
gradient probe, the stochastic-rounding seed, this process's rank, the byte/health counters)
is a tensor allocated once and updated in place, so graphs never recompile. `GiftState`
declares every field it has (`__slots__`: nothing can be added from outside); its refresh
engine (`gift_compile.runtime.refresh`), checkpointing (`gift_compile.runtime.checkpoint`) and telemetry
(`gift_compile.runtime.telemetry`) live in their own modules as mixins over these fields.

`GiftState.step()` is called once per optimizer step (an optimizer hook installed by
`gift_compile.apply(..., optimizer=...)`, `gift_compile.step(model)`, or a framework adapter),
never per backward pass, so refresh cadence and seeds count optimizer steps whatever the
gradient accumulation or the subset of layers that received gradients. It first checks the
health counters that every collective fills from the headers all ranks exchanged: a plan
mismatch or (under `nonfinite="error"`) a non-finite gradient on any rank raises on every
rank in the same step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from gift_compile.codec import Nonfinite
from gift_compile.codec import residual as residual_store
from gift_compile.config import GiftConfig, ReduceOp, SelectRule
from gift_compile.exchange.agreement import first_difference
from gift_compile.exchange.collectives import (C_MISMATCH, C_MISMATCH_RANKS, C_NONFINITE, C_NONFINITE_RANKS, N_COUNTERS,
                                               Shared, flagged_ranks)
from gift_compile.exchange.mark import SyncMode
from gift_compile.exchange.plan import BucketPlan, Collective, ItemPlan
from gift_compile.exchange.topology import FLAT, NodeLayout, node_layout
from gift_compile.geometry.maps import FactorSource, RowShard
from gift_compile.geometry.statistics import StatisticsSettings
from gift_compile.geometry.table import Geometry, geometry_class
from gift_compile.runtime.checkpoint import Checkpointing
from gift_compile.runtime.layer import LayerSpec, LayerState, OutsideResidual
from gift_compile.runtime.refresh import RefreshEngine, RefreshRecord, next_refresh
from gift_compile.runtime.selection import LayerMeasurement, decide
from gift_compile.runtime.telemetry import Telemetry, compression_of
from gift_compile.sync import GroupByName, Traffic, all_gather_object_, group_rank, set_in_node, set_levels, world_size


@dataclass
class BackwardWatch:
    """Bookkeeping of the checks that run when a backward's collectives have completed:
    whether they are queued for the running backward, what must run before them, how many
    optimizer steps ran since the state last advanced (`GiftState.step`), and whether the user
    was warned that it does not advance."""

    queued: bool = False
    # optimizer steps (seen as changed parameter versions between two backward passes) since
    # the state last advanced, and the versions at the last backward (None: not yet seen)
    since_step: int = 0
    versions: int | None = None
    warned: bool = False
    # collectives that run at the end of every synchronising backward that reached GIFT
    # (`gift_compile.frameworks.plain_sync`'s flush, registered once), run by the same callback
    # before the checks read the counters they fill
    flushes: list[Callable[[], None]] = field(default_factory=list)
    # the other parameters GIFT's own sync synchronises, `(name, parameter)`, whose gradients
    # the replica check compares as well (`gift_compile.frameworks.plain_sync` keeps the list)
    synced_params: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    # whether the end-of-backward check has read the counters since the last backward that
    # reached GIFT: the step then need not read them again (one host read per step)
    checked: bool = False


def layer_spec(config: GiftConfig, geometry: type[Geometry]) -> LayerSpec:
    """What the layers of a state under `config` are built from, their geometry's class
    `geometry` included: the one place that reads the config for them, so a layer, its map,
    statistics and plan get plain values (`LayerSpec`)."""
    statistics = StatisticsSettings(kind=config.statistics, rank=config.rank,
                                    sketch_cols=config.sketch_cols or 2 * config.rank, ema=config.ema,
                                    max_tokens=config.stats_tokens, seed=config.seed)
    # name, shape, kind and tensor count are each layer's (`LayerState`)
    plan = ItemPlan(name="", rows=0, cols=0, dtype="float32", managed=True, format=config.format,
                    scaling=config.scaling, block_size=config.block_size, error_feedback=config.error_feedback,
                    stochastic_rounding=config.stochastic_rounding, block_rotation=config.block_rotation,
                    unrewritten=config.unrewritten,
                    residual_format=config.residual_format,
                    second_hop_error_feedback=config.second_hop_error_feedback,
                    error_feedback_decay=config.error_feedback_decay, map_precision=config.map_precision,
                    ranks_per_node=config.ranks_per_node, intra_node_format=config.intra_node_format)
    return LayerSpec(geometry=geometry, rank=config.rank, seed=config.seed, statistics=statistics, plan=plan,
                     reselect=config.reselect_every > 0, layer_formats=config.layer_formats)


class GiftHealthError(RuntimeError):
    """Raised on every rank when the collectives' headers reported a plan mismatch."""


@dataclass
class Faults:
    """What the health counters reported on this rank's state and no check has raised yet: how
    many collectives saw a plan mismatch or (under `nonfinite="error"`) a non-finite gradient,
    and the state's group ranks flagged in them (`RANK_BITS` stands for "that rank or a higher
    one"). Kept while a health group defers the raise to the optimizer step
    (`gift_compile.runtime.health.check_health_group`)."""

    mismatch: int = 0
    nonfinite: int = 0
    mismatch_ranks: set[int] = field(default_factory=set)
    nonfinite_ranks: set[int] = field(default_factory=set)

    def add(self, other: "Faults") -> None:
        self.mismatch += other.mismatch
        self.nonfinite += other.nonfinite
        self.mismatch_ranks |= other.mismatch_ranks
        self.nonfinite_ranks |= other.nonfinite_ranks


class GiftState(RefreshEngine, Checkpointing, Telemetry):
    """All layers managed by one `apply` (or one framework adapter), plus the step driver.

    Implements `state_dict`/`load_state_dict` (torch.distributed.checkpoint's Stateful);
    loading validates layer names, shapes, geometry, rank, error feedback and finiteness.
    Replicated across ranks: `seed`, `steps`, transforms, the K-FAC factor (EMA), the
    gradient-side factor, selection and boundary scores. Per rank: the K-FAC accumulator of
    the current window, the error-feedback residuals, the gradient probes and the counters.
    """

    __slots__ = ("config", "group_name", "collective", "layers", "seed", "rank", "counters", "steps", "history",
                 "grad_source", "_health_seen", "modules", "handles", "active", "sync_mode", "dirty_params",
                 "plan_version", "selection_changes", "_sharing_checked", "adapters", "hop_counters", "backward_watch",
                 "geometry", "layer_spec", "health_group_name", "pending_faults", "outside", "substates", "blocks",
                 "stepped_by_optimizer", "driver", "report", "layout", "outside_items", "refresh_traffic",
                 "_progress_last", "_exchange")

    # held by name, so a destroyed group's threads end with it (`gift_compile.sync.GroupByName`)
    group = GroupByName()
    health_group = GroupByName()

    def __init__(self, config: GiftConfig, group: dist.ProcessGroup | None,
                 collective: Collective | str = Collective.ALL_REDUCE):
        if config.second_hop_error_feedback and Collective.parse(collective) is not Collective.ALL_REDUCE:
            raise ValueError(f"GIFT: second_hop_error_feedback=True needs GIFT's all-reduce; this state runs a "
                             f"{collective}, which has no second hop (only error_feedback applies)")
        self.config = config
        # The geometry's class, looked up once from `config.geometry`: layers, refresh,
        # selection and the framework hooks use this object, never the name.
        self.geometry = geometry_class(config.geometry)
        self.layer_spec = layer_spec(config, self.geometry)  # what `add_layer` builds each layer from
        self.group = group
        self.collective = collective
        self.layers: dict[str, LayerState] = {}
        self.seed = torch.full((), config.seed, dtype=torch.int64)
        self.rank = torch.full((), group_rank(group), dtype=torch.int64)
        # where the group's ranks sit (`exchange.topology`): a group spanning nodes runs every
        # collective in two levels, and the layers' residuals are sized to its node chunks
        self.layout = (node_layout(group, config.ranks_per_node, config.intra_node_format) if world_size(group) > 1
                       else FLAT)
        if self.layout.two_level:  # the refresh's host collectives cross the network once per node too
            set_levels(group, self.layout.node_group, self.layout.cross_group, self.layout.ranks_per_node)
        elif world_size(group) > 1:  # one level: the refresh crosses the network where the group spans nodes
            set_in_node(group, not self.layout.spans_nodes)
        # (ranks, node layout) of the collective the layers' gradients cross, where an adapter put
        # it on another group than the state's (`exchange_over`); None: the state's group
        self._exchange: tuple[int, NodeLayout] | None = None
        self.counters = torch.zeros(N_COUNTERS, dtype=torch.int64)
        self.steps = 0
        self.history: list[RefreshRecord] = []
        self.grad_source: FactorSource | None = None
        self._health_seen = [0] * N_COUNTERS
        # Set by `gift_compile.api.manage` and friends.
        self.modules: dict[str, torch.nn.Module] = {}
        self.handles: list[Any] = []
        self.active = True
        # GIFT's own sync: `SyncMode.SYNC` or `ACCUMULATE` (inside `gift_compile.no_sync`), and the
        # unmanaged parameters whose `.grad` holds unsynchronised local contributions.
        self.sync_mode = SyncMode.SYNC
        self.dirty_params: set[int] = set()
        # What `apply` installed (`gift_compile.runtime.report.ApplyReport`), set once it has.
        self.report: Any = None
        # every parameter outside the layers that a hook sends in its buckets, by FQN: its item
        # (None: raw) and the gradient's shape as the collective reduces it
        # (`gift_compile.frameworks.euclidean.outside_item`), for the apply report's classes
        self.outside_items: dict[str, tuple[ItemPlan | None, tuple[int, ...]]] = {}
        # bytes this rank handed to the refresh's collectives (statistics, selection, map
        # broadcast), all and across nodes (`gift_compile.sync.Traffic`)
        self.refresh_traffic = Traffic()
        # Bumped whenever what traced graphs carry changes (which layers feed their own
        # statistics, at the first refresh): graphs with the old structure must be retraced
        # (dynamo does it through its guards; the torchtitan graph_trainer hook by dropping its
        # traced step). A selection change is data in graphs (`LayerState.path_gate`), counted
        # in `selection_changes` instead.
        self.plan_version = 0
        self.selection_changes = 0
        self._sharing_checked = False  # identical statistics are detected at the first refresh
        # The framework adapters installed on this state, by name, each with what it keeps
        # (FSDP2's comm timer, HSDP's replica hop; None for nothing): one generic slot, so no
        # field here belongs to one framework (`gift_compile.frameworks.adapter.attach`).
        self.adapters: dict[str, Any] = {}
        # The counters of further hops an adapter runs over other groups (HSDP's replica hop
        # counts its bytes and health flags there): the health check reads them with `counters`.
        self.hop_counters: list[torch.Tensor] = []
        # The end-of-backward checks (`gift_compile.runtime.health.queue_backward_check`).
        self.backward_watch = BackwardWatch()
        # A group wider than `group` whose ranks must all raise a fault any of them saw (the job's
        # world under pipeline or tensor parallelism, where other ranks run other GIFT states):
        # set by `gift_compile.api.attach_optimizer`, it defers the raise from each check to the
        # optimizer step, where every rank takes part (`gift_compile.runtime.health.check_health_group`).
        self.health_group = None
        self.pending_faults = Faults()
        # Error-feedback residuals of gradients sent outside the layers (`add_outside_residual`).
        self.outside: dict[str, OutsideResidual] = {}
        # States over other groups this one drives: stepped, refreshed and checkpointed with it
        # (the routed experts' layers over their own data-parallel group, `runtime.experts`).
        self.substates: list[GiftState] = []
        # The layers that are one block of a stacked weight (a routed expert of a grouped-GEMM
        # weight `[E, out, in]`): the parameter, the block's index in it and the number of blocks
        # (`runtime.experts`).
        self.blocks: dict[str, tuple[torch.nn.Parameter, int, int]] = {}
        # Whether an optimizer's step hook advances the state (`gift_compile.api.attach_optimizer`):
        # `gift_compile.step` then refuses to advance it a second time per step.
        self.stepped_by_optimizer = False
        # `comm_totals()` at the last progress line (`GiftConfig.progress_every`)
        self._progress_last: dict[str, int] | None = None
        # The optimizer(s) driving it, weakly, and their hooks' handles (`api.attach_optimizer`):
        # `apply` with another optimizer swaps them (`api.reattach_optimizer`).
        self.driver: tuple[tuple[Any, ...], list[Any]] | None = None

    @property
    def shared(self) -> Shared:
        return Shared(self.seed, self.rank, self.counters)

    def _health_counts(self) -> list[int]:
        """The counters of every hop, summed (each hop's collectives write its health flags
        into its own counters); the rank masks are OR-ed across hops and cleared. All of them
        come to the host in one read (`tolist` of the stacked counters): the one host read of a
        step (`runtime.health`)."""
        masks = slice(C_NONFINITE_RANKS, C_MISMATCH_RANKS + 1)  # bit masks: OR-ed, not summed
        hops = [self.counters, *self.hop_counters]
        device = self.counters.device
        rows = torch.stack([h.detach() if h.device == device else h.detach().to(device) for h in hops]).tolist()
        for hop in hops:
            hop[masks].zero_()  # rank masks: read once, then cleared
        now = [sum(col) for col in zip(*rows)]
        for i in range(masks.start, masks.stop):
            now[i] = 0
            for row in rows:
                now[i] |= row[i]
        return now

    def add_layer(self, fqn: str, shape: tuple[int, int], device: torch.device | str, *,
                  world: int | None = None) -> LayerState:
        """Register a managed weight; a fixed rotation chosen by a static rule starts active.

        `world` sizes the second-hop residual (this rank's shard of the all-reduce); it
        defaults to the state's group and may differ only for a state without a group (the
        memory benchmark sizes a `world`-rank state on the meta device)."""
        if world is None:
            world = self.world()
        elif self.group is not None and world != self.world():
            raise ValueError(f"GiftState.add_layer: {fqn}: world={world} but the state's group has {self.world()} ranks")
        if fqn in self.layers:
            raise ValueError(f"GiftState.add_layer: {fqn} is already managed")
        if len(shape) != 2 or not all(isinstance(d, int) and d > 0 for d in shape):
            raise ValueError(f"GiftState.add_layer: {fqn}: shape must be two positive ints [out, in], got {shape}")
        if not self.layers and self.seed.device != torch.device(device):
            # graphs read these where the weights live
            self.seed, self.rank, self.counters = (t.to(device) for t in (self.seed, self.rank, self.counters))
        layer = LayerState(fqn, shape, self.layer_spec, device, world, self.layout)
        if self._exchange is not None:  # its gradient crosses an adapter's group (`exchange_over`)
            layer.size_residual(*self._exchange)
        self.layers[fqn] = layer
        if self._static_selection():  # decided before any graph exists: not a plan change
            chosen = fqn in decide(self.config, self.geometry, {fqn: LayerMeasurement(1.0, 1.0, 0.0, 0.0)}, {})
            layer.selected, layer.decided = chosen and not layer.transform.is_identity, True
            layer._replan()
        return layer

    @property
    def exchange(self) -> tuple[int, NodeLayout]:
        """`(ranks, node layout)` of the collective the layers' gradients cross, which their
        first-hop residuals are sized for: the state's group, or the group an adapter exchanges
        them over (`exchange_over`)."""
        return self._exchange if self._exchange is not None else (self.world(), self.layout)

    def exchange_over(self, group: dist.ProcessGroup) -> None:
        """The layers' gradients cross `group`, not the state's group: HSDP's shard hop, whose
        state spans shards x replicas (statistics, maps and selection must agree on every
        replica) while the reduce-scatter that carries the error feedback runs over the shard
        group. That group's own node layout (`exchange.topology.node_layout`, from its ranks'
        nodes: a group inside one node or with one rank per node is one level) decides the rows
        its items send, so the first-hop residuals are re-sized for it (zero). A two-level
        state's layout would give a node chunk's rows that the one-level hop does not send (a
        one-rank shard group is one level too: HSDP's replica hop, one level, then carries the
        whole gradient and its residual). Called
        by every rank of `group` (the layout is agreed over it) before any gradient crossed it:
        raises once the state has stepped or a residual outside the layers was sized already."""
        world = group.size()
        exchange = world, node_layout(group, self.config.ranks_per_node, self.config.intra_node_format)
        if exchange == self.exchange:
            return
        if self.steps or self.outside:
            raise RuntimeError(
                f"GIFT: GiftState.exchange_over({group.group_name!r}) after the state has stepped ({self.steps} steps) "
                f"or sized residuals outside its layers ({sorted(self.outside)[:3]}): those residuals hold the rows "
                "of the state's own layout; install the adapter before the first step")
        self._exchange = exchange
        for layer in self.layers.values():
            layer.size_residual(*exchange)

    def add_outside_residual(self, fqn: str, shape: tuple[int, int],
                             device: torch.device | str) -> tuple[torch.Tensor, ...]:
        """Zero error-feedback buffers, in the config's residual format, for parameter `fqn`, a
        gradient an adapter sends on GIFT's codec outside the layers (`frameworks.euclidean`),
        `shape` its whole local gradient as the item views it (under a two-level exchange the
        node chunk's rows, `exchange.node_stage.residual_rows`); kept here so that checkpoints
        carry it (the layers' residuals' rules: `gift_compile.runtime.checkpoint`)."""
        if fqn in self.outside or fqn in self.layers:
            raise ValueError(f"GiftState.add_outside_residual: {fqn} already has a residual")
        rows, cols = shape
        buffers = residual_store.allocate(self.config.residual_format, rows, cols, device)
        self.outside[fqn] = OutsideResidual((int(rows), int(cols)), buffers)
        return buffers

    def _static_selection(self) -> bool:
        """Whether the selection rule needs no measurement (all, none, globs, no geometry)."""
        cfg = self.config
        return self.geometry.is_identity or cfg.select in (SelectRule.ALL, SelectRule.NONE) or isinstance(cfg.select, tuple)

    def world(self) -> int:
        return world_size(self.group)

    def weight(self, name: str) -> torch.Tensor:
        """The managed weight parameter `name` (what the optimizer steps and `.grad` lands on;
        for a block of a stacked weight, the whole stacked parameter)."""
        if name in self.blocks:
            return self.blocks[name][0]
        return self.modules[name]._parameters["weight"]

    def factor_source(self, optimizer: Any | None) -> FactorSource:
        """Where a refresh reads each layer's gradient-side tensor (`Geometry.factor_source`
        over `optimizer`'s state or the weights' `.grad`), a block's rows cut out of its stacked
        weight's tensor (`block_rows`)."""
        source = self.geometry.factor_source(self.weight, optimizer, lambda: self.steps)

        def rows(name: str) -> torch.Tensor | RowShard | None:
            full = source(name)
            if full is None or name not in self.blocks:
                return full
            _, block, count = self.blocks[name]
            return block_rows(name, full, block, count, self.group)

        return rows

    def layer_plan(self, fqn: str) -> BucketPlan:
        """The one-layer collective this state's own sync runs for `fqn` (for accounting)."""
        group_name = self.group_name if self.world() > 1 else None
        return BucketPlan((self.layers[fqn].plan,), self.world(), group_name, self.config.reduce_op is ReduceOp.AVG,
                          self.collective, self.layout)

    # ---- gradient accumulation (GIFT's own sync) -----------------------------------------
    def enter_accumulate(self) -> None:
        """`no_sync` entered: managed weights accumulate into their pending buffers."""
        self.sync_mode = SyncMode.ACCUMULATE
        for layer in self.layers.values():
            if layer.pending is None:
                layer.pending = torch.zeros(layer.shape, device=layer.probe.device)
            layer.mode = SyncMode.ACCUMULATE

    def exit_accumulate(self) -> None:
        """`no_sync` left: the next backward sends gradient + pending once."""
        self.sync_mode = SyncMode.SYNC
        for layer in self.layers.values():
            layer.mode = SyncMode.SYNC_PENDING

    def check_pending(self) -> None:
        """Refuse an optimizer step that would drop gradients accumulated under `no_sync`
        (inside it, or after it without a synchronising backward)."""
        waiting = [n for n, l in self.layers.items() if l.mode is SyncMode.ACCUMULATE
                   or (l.mode is SyncMode.SYNC_PENDING and bool(l.pending.any()))]
        if waiting or self.dirty_params:
            raise RuntimeError(
                f"GIFT: gradients accumulated under gift_compile.no_sync were never synchronised "
                f"({len(waiting)} managed weights, {len(self.dirty_params)} other parameters); run the last "
                "micro-batch's backward outside no_sync before the optimizer step"
            )

    # ---- agreement ---------------------------------------------------------------------
    def describe(self) -> str:
        """Everything ranks must agree on: config and every layer's plan, in order."""
        return json.dumps({"config": self.config.to_dict(), "layers": [l.plan.to_str() for l in self.layers.values()]},
                          sort_keys=True)

    def check_agreement(self) -> None:
        """Raise on every rank, naming the first difference, unless all ranks manage the same
        layers with the same config (checked once, when the model is set up)."""
        if self.world() <= 1:
            return
        mine = self.describe()
        everyone = all_gather_object_(mine, self.group)
        for r, other in enumerate(everyone):
            if other != mine:
                a, b = json.loads(mine), json.loads(other)
                diff = first_difference(a, b)
                raise ValueError(f"GIFT: rank {r} set up a different GIFT plan than rank {group_rank(self.group)}: {diff}")

    # ---- step driver -------------------------------------------------------------------
    def check_health(self) -> None:
        """Raise on every rank if the collectives since the last check saw a plan mismatch or
        (under `nonfinite="error"`) a non-finite gradient on any rank.

        Every rank decoded the same headers, so every rank raises in the same step; the
        counters are consumed first, so a caller that catches the error, drops the step's
        gradients and goes on is not raised at again. With a `health_group` the faults are
        kept in `pending_faults` instead: ranks outside the state's group saw nothing, and
        raising here would leave them waiting for this rank's next pipeline send.
        """
        faults = self._new_faults()
        if self.health_group is not None:
            self.pending_faults.add(faults)
            return
        if faults.mismatch:
            raise GiftHealthError(
                f"GIFT: {faults.mismatch} collective(s) since the last step ran with a plan that differs "
                f"between ranks: rank(s) {sorted(faults.mismatch_ranks)} differ from rank {group_rank(self.group)} "
                "(different format, shapes, layers or layer order); the gradients of this step are garbage"
            )
        if faults.nonfinite:
            raise FloatingPointError(
                f"GIFT: {faults.nonfinite} gradient collective(s) in this step carried NaN/Inf from rank(s) "
                f"{sorted(faults.nonfinite_ranks)}; raised on every rank (nonfinite='error'). Skip the step (zero the "
                "gradients) or set nonfinite='propagate'."
            )

    def _new_faults(self) -> Faults:
        """The faults the counters recorded since the last call (consumed: read once); a
        non-finite gradient counts only under `nonfinite="error"`."""
        now = self._health_counts()
        nonfinite_ranks, mismatch_ranks = flagged_ranks(now[C_NONFINITE_RANKS]), flagged_ranks(now[C_MISMATCH_RANKS])
        now[C_NONFINITE_RANKS] = now[C_MISMATCH_RANKS] = 0
        new = [a - b for a, b in zip(now, self._health_seen)]
        self._health_seen = now
        nonfinite = new[C_NONFINITE] if self.config.nonfinite is Nonfinite.ERROR else 0
        return Faults(new[C_MISMATCH], nonfinite, set(mismatch_ranks) if new[C_MISMATCH] else set(),
                      set(nonfinite_ranks) if nonfinite else set())

    def step(self) -> None:
        """Once per optimizer step, after it: seed, and the refresh when `config.refresh_due`
        (the warm-up steps, then every `refresh_every` steps).

        The health counters are checked again here for collectives that ran outside a checked
        backward (a traced whole step); the backward's own checks have consumed the rest, and
        where the last backward's check ran since its collectives this reads nothing (one host
        read per step). A refresh is where plans change: the ranks compare them again after it
        (`check_agreement`), so the hooks need no per-bucket plan check."""
        if not self.backward_watch.checked:
            self.check_health()
        self.backward_watch.checked = False
        self.backward_watch.since_step, self.backward_watch.versions = 0, None
        for layer in self.layers.values():
            if layer.mode is SyncMode.SYNC_PENDING:
                layer.mode = SyncMode.SYNC
        self.steps += 1
        self.seed.add_(1)
        if self.config.refresh_due(self.steps):
            self.refresh()
            self.check_agreement()
        for sub in self.substates:
            sub.step()
        self._progress()

    def _progress(self) -> None:
        """Every `config.progress_every` optimizer steps, one line on the job's rank 0 (stdout,
        so that a script shows it without logging set up): the step, the bytes per step since the
        last line, the compression (`compression_of`: the network's, or on one node the total)
        and the layers mapped. Only the state `apply` reported on prints (not its substates)."""
        every = self.config.progress_every
        if not every or self.steps % every or self.report is None:
            return
        totals = self.comm_totals()
        last, self._progress_last = self._progress_last or dict.fromkeys(totals, 0), totals
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        delta = {k: totals[k] - last[k] for k in totals}
        c = compression_of(delta)
        if c["network"] is not None:
            ratio = f"{c['network']:.2f}x fewer bytes across nodes than fp32 ({c['total']:.2f}x in total)"
        else:
            ratio = f"{c['total']:.2f}x fewer bytes than fp32 (one node)"
        mapped = sum(layer.selected for layer in self.layers.values())
        decided = all(layer.decided for layer in self.layers.values())
        print(f"GIFT step {self.steps}: {delta['wire'] / every / 1e6:.3f} MB/step sent, {ratio}; "
              + (f"{mapped} of {len(self.layers)} layers mapped" if decided
                 else f"mapping decided at step {next_refresh(self.config, self.steps)}"), flush=True)


def block_rows(name: str, full: torch.Tensor, block: int, count: int,
               group: dist.ProcessGroup | None) -> torch.Tensor | RowShard:
    """Block `block` of `count` (dim 0) of a stacked weight's gradient-side tensor `full`: the
    block itself when `full` is a plain tensor of the rank's `count` blocks, else this rank's
    rows of it (`RowShard`: all of the block on the rank whose dim-0 chunk holds it, none
    elsewhere) when `full` is a DTensor whose local chunk is `count / world` blocks (FSDP2's
    even dim-0 shard of the rank's experts over their data-parallel `group`). Raises naming the
    layer for any other layout: a guessed row range would build a map from another expert's rows."""
    to_local = getattr(full, "to_local", None)
    if to_local is None:
        if full.shape[0] != count:
            raise ValueError(f"GIFT: {name}: its stacked weight's tensor {tuple(full.shape)} does not hold the "
                             f"{count} blocks its layers were built for")
        return full[block]
    local = to_local()
    world = world_size(group)
    if local.shape[0] * world != count:
        raise ValueError(f"GIFT: {name}: the rank's chunk {tuple(local.shape)} of its stacked weight's tensor is not "
                         f"an even share of its {count} blocks over the {world} ranks of its group, so the rows of "
                         f"block {block} cannot be found")
    start = group_rank(group) * local.shape[0]
    if start <= block < start + local.shape[0]:
        return RowShard(local[block - start])
    return RowShard(local.new_zeros((0, local.shape[-1])))

