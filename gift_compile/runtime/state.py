"""Per-layer GIFT state, and `GiftState`: the layers of one `apply`, the step driver and health.

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
import zlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from gift_compile.codec import residual as residual_store
from gift_compile.runtime.checkpoint import Checkpointing
from gift_compile.exchange.collectives import (C_MISMATCH, C_MISMATCH_RANKS, C_NONFINITE, C_NONFINITE_RANKS, N_COUNTERS,
                                      ItemTensors, Shared, flagged_ranks)
from gift_compile.config import GiftConfig
from gift_compile.geometry.table import IDENTITY_KIND, geometry_class
from gift_compile.exchange.plan import BucketPlan, ItemPlan
from gift_compile.runtime.refresh import RefreshEngine, RefreshRecord
from gift_compile.runtime.selection import LayerMeasurement, decide
from gift_compile.sync import all_gather_object_, group_rank, world_size
from gift_compile.runtime.telemetry import Telemetry

if TYPE_CHECKING:
    from gift_compile.frameworks.fsdp2 import CommTimer


PROBE_ROWS = 128


class LayerState:
    """What GIFT keeps for one managed weight `[out, in]`.

    `plan` is the static description the `gift::mark` op carries into graphs; the transform
    tensors, `residual`, `second_hop_residual` and `probe` are the layer's runtime tensors;
    `stats` is fed by the layer's forward pre-hook. `world` sizes the second-hop residual:
    this rank's shard of the all-reduce, `ceil(out / world)` rows.
    """

    def __init__(self, fqn: str, shape: tuple[int, int], config: GiftConfig, device: torch.device | str,
                 world: int = 1):
        self.fqn = fqn
        self.shape = (int(shape[0]), int(shape[1]))
        self.config = config
        out, d_in = self.shape
        geometry = geometry_class(config.geometry)
        stable = zlib.crc32(fqn.encode()) & 0x7FFFFFFF
        self.transform = geometry(d_in, config.rank, seed=config.seed + stable, device=device)
        self.stats = geometry.make_statistics(config, d_in, device)
        # Statistics shared with other layers that read the same input (q/k/v, gate/up):
        # a follower reads its leader's statistics and feeds none itself.
        self.leader: LayerState | None = None
        self.followers: list[LayerState] = []
        self.grad_factor: torch.Tensor | None = geometry.allocate_factor(d_in, device)
        self.residual = (residual_store.allocate(config.residual_format, out, d_in, device)
                         if config.error_feedback else None)
        self.second_hop_residual = (residual_store.allocate(config.residual_format, -(-out // world), d_in, device)
                                    if config.second_hop_error_feedback else None)
        self.probe = torch.zeros(min(out, PROBE_ROWS), d_in, device=device)
        self._full_plan = ItemPlan.managed_layer(fqn, self.shape, config, len(self.transform.tensors))
        self.seed_offset = torch.tensor(self._full_plan.seed_offset, dtype=torch.int64, device=device)
        # GIFT's own sync: "sync", "accumulate" (inside `gift_compile.no_sync`) or
        # "sync_pending" (the next backward sends gradient + `pending`, allocated on first use).
        self.mode = "sync"
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
        return self.stats is not None and (self.selected or not self.decided or self.config.reselect_every > 0)

    @property
    def collect_stats(self) -> bool:
        """Whether this layer's forward feeds statistics: it or a follower needs them, and it
        is not itself a follower."""
        return self.leader is None and (self.needs_stats or any(f.needs_stats for f in self.followers))

    def _replan(self) -> None:
        """The static plan of the active path (graphs carry it; a change is a recompile)."""
        n = len(self.transform.tensors) if self.selected else 0
        self.plan = replace(self._full_plan, kind=self.active_kind, n_tensors=n)
        self.plan_str = self.plan.to_str()  # precomputed: the forward passes it to traced code
        self.sync_stats_gate()

    def sync_stats_gate(self) -> None:
        """Set `stats_gate` to `collect_stats` (in place; called whenever that can change)."""
        self.stats_gate.fill_(self.collect_stats)

    def active_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.transform.tensors if self.selected else ()

    def tensors(self) -> ItemTensors:
        """Runtime tensors for `gift_compile.exchange.collectives`."""
        return ItemTensors(self.active_tensors(), self.residual, self.probe, self.seed_offset,
                           self.second_hop_residual)

    def residual_buffers(self) -> dict[str, tuple[torch.Tensor, ...]]:
        """The error-feedback residuals this layer keeps, by state-dict prefix (first hop:
        `residual`, the all-reduce's second hop: `second_hop_residual`)."""
        return {k: v for k, v in (("residual", self.residual), ("second_hop_residual", self.second_hop_residual))
                if v is not None}

    def mark_tensors(self, shared: Shared, replica: Shared | None = None) -> list[torch.Tensor]:
        """Inputs of the `gift::mark` op, in the order `unpack_mark_tensors` reads them; with a
        graph replica hop (`plan.replica_format`) also its rank and counters (`replica`)."""
        extra = [t for bufs in self.residual_buffers().values() for t in bufs]
        out = [*self.active_tensors(), *extra, self.probe, self.seed_offset, shared.seed, shared.rank, shared.counters]
        if self.plan.replica_format:
            if replica is None:
                raise RuntimeError(f"GIFT: {self.fqn} has a replica hop in its plan but no replica tensors were given")
            out += [replica.rank, replica.counters]
        return out

    def set_replica_format(self, fmt: str) -> None:
        """Put HSDP's replica hop into the plan the mark carries (before any graph is traced)."""
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
    # collectives that run at the end of the backward themselves (`gift_compile.frameworks.plain_sync`'s
    # flush), run by the same callback before the checks read the counters they fill
    flushes: list[Callable[[], None]] = field(default_factory=list)


class GiftHealthError(RuntimeError):
    """Raised on every rank when the collectives' headers reported a plan mismatch."""


class GiftState(RefreshEngine, Checkpointing, Telemetry):
    """All layers managed by one `apply` (or one framework adapter), plus the step driver.

    Implements `state_dict`/`load_state_dict` (torch.distributed.checkpoint's Stateful);
    loading validates layer names, shapes, geometry, rank, error feedback and finiteness.
    Replicated across ranks: `seed`, `steps`, transforms, the K-FAC factor (EMA), the
    gradient-side factor, selection and boundary scores. Per rank: the K-FAC accumulator of
    the current window, the error-feedback residuals, the gradient probes and the counters.
    """

    __slots__ = ("config", "group", "collective", "layers", "seed", "rank", "counters", "steps", "history",
                 "grad_source", "_health_seen", "modules", "handles", "active", "sync_mode", "dirty_params",
                 "plan_version", "_sharing_checked", "comm_timer", "retraces", "replica_hop", "backward_watch")

    def __init__(self, config: GiftConfig, group: dist.ProcessGroup | None, collective: str = "all_reduce"):
        if config.second_hop_error_feedback and collective != "all_reduce":
            raise ValueError(f"GIFT: second_hop_error_feedback=True needs GIFT's all-reduce; this state runs a "
                             f"{collective}, which has no second hop (only error_feedback applies)")
        self.config = config
        self.group = group
        self.collective = collective
        self.layers: dict[str, LayerState] = {}
        self.seed = torch.full((), config.seed, dtype=torch.int64)
        self.rank = torch.full((), group_rank(group), dtype=torch.int64)
        self.counters = torch.zeros(N_COUNTERS, dtype=torch.int64)
        self.steps = 0
        self.history: list[RefreshRecord] = []
        self.grad_source: Callable[[str], torch.Tensor | None] | None = None
        self._health_seen = torch.zeros(N_COUNTERS, dtype=torch.int64)
        # Set by `gift_compile.api.manage` and friends.
        self.modules: dict[str, torch.nn.Module] = {}
        self.handles: list[Any] = []
        self.active = True
        # GIFT's own sync: "sync" or "accumulate" (inside `gift_compile.no_sync`), and the
        # unmanaged parameters whose `.grad` holds unsynchronised local contributions.
        self.sync_mode = "sync"
        self.dirty_params: set[int] = set()
        # Bumped whenever a layer's plan or statistics switch changes: compiled graphs that
        # carry the old plan must be retraced (dynamo does it through its guards; the
        # torchtitan graph_trainer hook does it by dropping its traced step).
        self.plan_version = 0
        self._sharing_checked = False  # identical statistics are detected at the first refresh
        # Telemetry filled by adapters: the FSDP2 hook's comm timer, and how often a framework
        # dropped its traced step for a plan change (torchtitan's graph_trainer hook).
        self.comm_timer: CommTimer | None = None
        self.retraces = 0
        # HSDP's replica hop (`gift_compile.frameworks.hsdp.ReplicaHop`: group, counters, error probe), set
        # by `gift_compile.frameworks.hsdp.install`; None without a replica hop.
        self.replica_hop: Any = None
        # The end-of-backward checks (`gift_compile.runtime.health.queue_backward_check`).
        self.backward_watch = BackwardWatch()

    @property
    def shared(self) -> Shared:
        return Shared(self.seed, self.rank, self.counters)

    @property
    def replica_shared(self) -> Shared | None:
        """The replica hop's `Shared` (seed, rank in the replica group, its own counters), or None."""
        hop = self.replica_hop
        return None if hop is None else Shared(self.seed, hop.rank, hop.counters)

    def _health_counts(self) -> torch.Tensor:
        """The counters of every hop, summed (each hop's collectives write its health flags
        into its own counters); the rank masks are OR-ed across hops and cleared."""
        now = self.counters.detach().to("cpu", copy=True)
        self.counters[C_NONFINITE_RANKS:C_MISMATCH_RANKS + 1].zero_()  # rank masks: read once, then cleared
        if self.replica_hop is not None:
            hop = self.replica_hop.counters
            other = hop.detach().to("cpu", copy=True)
            hop[C_NONFINITE_RANKS:C_MISMATCH_RANKS + 1].zero_()
            masks = now[C_NONFINITE_RANKS:C_MISMATCH_RANKS + 1] | other[C_NONFINITE_RANKS:C_MISMATCH_RANKS + 1]
            now += other
            now[C_NONFINITE_RANKS:C_MISMATCH_RANKS + 1] = masks  # bit masks are OR-ed, not summed
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
        layer = LayerState(fqn, shape, self.config, device, world)
        self.layers[fqn] = layer
        if self._static_selection():  # decided before any graph exists: not a plan change
            chosen = fqn in decide(self.config, {fqn: LayerMeasurement(1.0, 1.0, 0.0, 0.0)}, {})
            layer.selected, layer.decided = chosen and not layer.transform.is_identity, True
            layer._replan()
        return layer

    def _static_selection(self) -> bool:
        """Whether the selection rule needs no measurement (all, none, globs, no geometry)."""
        cfg = self.config
        return geometry_class(cfg.geometry).is_identity or cfg.select in ("all", "none") or isinstance(cfg.select, tuple)

    def world(self) -> int:
        return world_size(self.group)

    def weight(self, name: str) -> torch.Tensor:
        """The managed weight parameter `name` (what the optimizer steps and `.grad` lands on)."""
        return self.modules[name]._parameters["weight"]

    def layer_plan(self, fqn: str) -> BucketPlan:
        """The one-layer collective this state's own sync runs for `fqn` (for accounting)."""
        group_name = self.group.group_name if self.world() > 1 else None
        return BucketPlan((self.layers[fqn].plan,), self.world(), group_name, self.config.reduce_op == "avg",
                          self.collective)

    # ---- gradient accumulation (GIFT's own sync) -----------------------------------------
    def enter_accumulate(self) -> None:
        """`no_sync` entered: managed weights accumulate into their pending buffers."""
        self.sync_mode = "accumulate"
        for layer in self.layers.values():
            if layer.pending is None:
                layer.pending = torch.zeros(layer.shape, device=layer.probe.device)
            layer.mode = "accumulate"

    def exit_accumulate(self) -> None:
        """`no_sync` left: the next backward sends gradient + pending once."""
        self.sync_mode = "sync"
        for layer in self.layers.values():
            layer.mode = "sync_pending"

    def check_pending(self) -> None:
        """Refuse an optimizer step that would drop gradients accumulated under `no_sync`
        (inside it, or after it without a synchronising backward)."""
        waiting = [n for n, l in self.layers.items() if l.mode == "accumulate"
                   or (l.mode == "sync_pending" and bool(l.pending.any()))]
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
                diff = _first_difference(a, b)
                raise ValueError(f"GIFT: rank {r} set up a different GIFT plan than rank {group_rank(self.group)}: {diff}")

    # ---- step driver -------------------------------------------------------------------
    def check_health(self) -> None:
        """Raise on every rank if the collectives since the last check saw a plan mismatch or
        (under `nonfinite="error"`) a non-finite gradient on any rank.

        Every rank decoded the same headers, so every rank raises in the same step; the
        counters are consumed first, so a caller that catches the error, drops the step's
        gradients and goes on is not raised at again.
        """
        now = self._health_counts()
        masks = C_NONFINITE_RANKS, C_MISMATCH_RANKS  # OR-ed rank masks: read, then cleared
        nonfinite_ranks, mismatch_ranks = flagged_ranks(int(now[masks[0]])), flagged_ranks(int(now[masks[1]]))
        now[masks[0]:masks[1] + 1] = 0
        new = now - self._health_seen
        self._health_seen = now
        if int(new[C_MISMATCH]):
            raise GiftHealthError(
                f"GIFT: {int(new[C_MISMATCH])} collective(s) since the last step ran with a plan that differs "
                f"between ranks: rank(s) {mismatch_ranks} differ from rank {group_rank(self.group)} (different "
                "format, shapes, layers or layer order); the gradients of this step are garbage"
            )
        if int(new[C_NONFINITE]) and self.config.nonfinite == "error":
            raise FloatingPointError(
                f"GIFT: {int(new[C_NONFINITE])} gradient collective(s) in this step carried NaN/Inf from rank(s) "
                f"{nonfinite_ranks}; raised on every rank (nonfinite='error'). Skip the step (zero the gradients) or "
                "set nonfinite='propagate'."
            )

    def step(self) -> None:
        """Once per optimizer step, after it: seed, and the refresh when `config.refresh_due`
        (the warm-up steps, then every `refresh_every` steps).

        The health counters are checked again here for collectives that ran outside a checked
        backward (a traced whole step); the backward's own checks have consumed the rest."""
        self.check_health()
        self.backward_watch.since_step, self.backward_watch.versions = 0, None
        for layer in self.layers.values():
            if layer.mode == "sync_pending":
                layer.mode = "sync"
        self.steps += 1
        self.seed.add_(1)
        if self.config.refresh_due(self.steps):
            self.refresh()

def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else k)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return f"{path}: {a!r} vs {b!r}"


