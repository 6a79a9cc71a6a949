"""Per-layer GIFT state, the step driver and the refresh that keeps the geometry current.

Everything a compiled graph reads or writes (transform tensors, error-feedback residual, the
gradient probe, the stochastic-rounding seed, this process's rank, the byte/health counters)
is a tensor allocated once and updated in place, so graphs never recompile. The refresh runs
eagerly, outside any compiled region, every `refresh_every` optimizer steps: it folds the
statistics into the geometry, rebuilds the transforms (each on one owner rank, then
broadcast, so every rank holds bit-identical maps), measures every layer's errors on its
probe, decides the selection and re-expresses the error-feedback residuals in the new
coordinates.

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
import logging
import math
import time
import zlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.distributed as dist

from gift_compile import residual as residual_store
from gift_compile.collectives import (
    C_BASELINE, C_CALLS, C_MISMATCH, C_MISMATCH_RANKS, C_NONFINITE, C_NONFINITE_RANKS, C_PLAIN_CALLS, C_WIRE,
    N_COUNTERS, ItemTensors, Shared, bucket_wire_bytes, flagged_ranks,
)
from gift_compile.config import GiftConfig
from gift_compile.geometry import Transform, apply_forward, apply_inverse, gradient_factor
from gift_compile.statistics import KFACStatistics, SketchStatistics
from gift_compile.plan import TRANSFORM_KIND, BucketPlan, ItemPlan
from gift_compile.selection import LayerMeasurement, decide, measure
from gift_compile.sync import all_gather_object_, all_reduce_, broadcast_, group_rank, world_size

logger = logging.getLogger("gift_compile")

PROBE_ROWS = 128
STATE_VERSION = 2


class LayerState:
    """What GIFT keeps for one managed weight `[out, in]`.

    `plan` is the static description the `gift::mark` op carries into graphs; the transform
    tensors, `residual` and `probe` are the layer's runtime tensors; `stats` is fed by the
    layer's forward pre-hook.
    """

    def __init__(self, fqn: str, shape: tuple[int, int], config: GiftConfig, device: torch.device | str):
        self.fqn = fqn
        self.shape = (int(shape[0]), int(shape[1]))
        self.config = config
        out, d_in = self.shape
        kind = TRANSFORM_KIND[config.geometry]
        stable = zlib.crc32(fqn.encode()) & 0x7FFFFFFF
        self.transform = Transform(kind, d_in, config.rank, seed=config.seed + stable, device=device)
        self.stats = _make_statistics(config, d_in, device)
        # Statistics shared with other layers that read the same input (q/k/v, gate/up):
        # a follower reads its leader's statistics and feeds none itself.
        self.leader: LayerState | None = None
        self.followers: list[LayerState] = []
        self.grad_factor: torch.Tensor | None = (
            torch.zeros(d_in, d_in, device=device) if config.geometry in ("gradient", "momentum") else None
        )
        self.residual = (residual_store.allocate(config.residual_format, out, d_in, device)
                         if config.error_feedback else None)
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
        self.transform.activate()  # a fixed rotation is always on; adaptive maps start as the identity
        self._replan()

    @property
    def kind(self) -> str:
        """The transform kind GIFT builds for this layer (used when it is selected)."""
        return self.transform.kind

    @property
    def active_kind(self) -> str:
        """The kind the collectives run now: the layer's, or "identity" when not selected."""
        return self.transform.kind if self.selected else "identity"

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

    def active_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.transform.tensors if self.selected else ()

    def tensors(self) -> ItemTensors:
        """Runtime tensors for `gift_compile.collectives`."""
        return ItemTensors(self.active_tensors(), self.residual, self.probe, self.seed_offset)

    def mark_tensors(self, shared: Shared) -> list[torch.Tensor]:
        """Inputs of the `gift::mark` op, in the order `unpack_mark_tensors` reads them."""
        extra = list(self.residual) if self.residual is not None else []
        return [*self.active_tensors(), *extra, self.probe, self.seed_offset, shared.seed, shared.rank, shared.counters]

    def state_dict(self) -> dict[str, torch.Tensor]:
        sd = {f"transform.{k}": v for k, v in self.transform.state_dict().items()}
        if self.stats is not None:
            sd.update({f"stats.{k}": v for k, v in self.stats.state_dict().items()})
        if self.grad_factor is not None:
            sd["grad_factor"] = self.grad_factor
        if self.residual is not None:
            sd.update({f"residual.{i}": t for i, t in enumerate(self.residual)})
        sd["probe"] = self.probe
        sd["selected"] = torch.tensor(self.selected)
        sd["decided"] = torch.tensor(self.decided)
        sd["boundary_score"] = torch.tensor(self.boundary_score)
        return sd


def _make_statistics(config: GiftConfig, d_in: int, device: torch.device | str) -> KFACStatistics | SketchStatistics | None:
    """The K-FAC statistics object of a layer: a sketch for low-rank maps (unless configured
    dense, or the layer is too narrow for the sketch to be smaller), the exact factor for the
    dense map, none for fixed maps and the gradient-side geometry."""
    if config.geometry not in ("dense", "lowrank"):
        return None
    cols = config.sketch_cols or 2 * config.rank
    if config.geometry == "lowrank" and config.statistics == "sketch" and 2 * d_in > 3 * cols:
        return SketchStatistics(d_in, rank=config.rank, sketch_cols=cols, ema=config.ema,
                                max_tokens=config.stats_tokens, seed=config.seed, device=device)
    return KFACStatistics(d_in, ema=config.ema, max_tokens=config.stats_tokens, device=device)


def unpack_mark_tensors(plan: ItemPlan, tensors: list[Any]) -> tuple[ItemTensors, Shared]:
    """Inverse of `LayerState.mark_tensors` (works on tensors and on FX nodes alike)."""
    n = plan.n_tensors
    transform = tuple(tensors[:n])
    residual = tuple(tensors[n:n + residual_store.buffer_count(plan.residual_format)]) if plan.error_feedback else None
    probe, seed_offset, seed, rank, counters = tensors[-5:]
    return ItemTensors(transform, residual, probe, seed_offset), Shared(seed, rank, counters)


@dataclass
class RefreshRecord:
    """Telemetry of one refresh: per-layer measurements and the resulting selection."""

    step: int
    layers: dict[str, dict[str, float | bool]] = field(default_factory=dict)
    seconds: float = 0.0  # wall time of the whole refresh on this rank (host-synchronous work)


class GiftHealthError(RuntimeError):
    """Raised on every rank when the collectives' headers reported a plan mismatch."""


class GiftState:
    """All layers managed by one `apply` (or one framework adapter), plus the step driver.

    Implements `state_dict`/`load_state_dict` (torch.distributed.checkpoint's Stateful);
    loading validates layer names, shapes, geometry, rank, error feedback and finiteness.
    Replicated across ranks: `seed`, `steps`, transforms, the K-FAC factor (EMA), the
    gradient-side factor, selection and boundary scores. Per rank: the K-FAC accumulator of
    the current window, the error-feedback residuals, the gradient probes and the counters.
    """

    def __init__(self, config: GiftConfig, group: dist.ProcessGroup | None, collective: str = "all_reduce"):
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

    @property
    def shared(self) -> Shared:
        return Shared(self.seed, self.rank, self.counters)

    def add_layer(self, fqn: str, shape: tuple[int, int], device: torch.device | str) -> LayerState:
        """Register a managed weight; a fixed rotation chosen by a static rule starts active."""
        if fqn in self.layers:
            raise ValueError(f"GiftState.add_layer: {fqn} is already managed")
        if len(shape) != 2 or not all(isinstance(d, int) and d > 0 for d in shape):
            raise ValueError(f"GiftState.add_layer: {fqn}: shape must be two positive ints [out, in], got {shape}")
        if not self.layers and self.seed.device != torch.device(device):
            # graphs read these where the weights live
            self.seed, self.rank, self.counters = (t.to(device) for t in (self.seed, self.rank, self.counters))
        layer = LayerState(fqn, shape, self.config, device)
        self.layers[fqn] = layer
        if self._static_selection():  # decided before any graph exists: not a plan change
            chosen = fqn in decide(self.config, {fqn: LayerMeasurement(1.0, 1.0, 0.0, 0.0)}, {})
            layer.selected, layer.decided = chosen and layer.kind != "identity", True
            layer._replan()
        return layer

    def _static_selection(self) -> bool:
        """Whether the selection rule needs no measurement (all, none, globs, no geometry)."""
        cfg = self.config
        return cfg.geometry == "none" or cfg.select in ("all", "none") or isinstance(cfg.select, tuple)

    def world(self) -> int:
        return world_size(self.group)

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
        now = self.counters.detach().to("cpu", copy=True)
        masks = C_NONFINITE_RANKS, C_MISMATCH_RANKS  # OR-ed rank masks: read, then cleared
        self.counters[masks[0]:masks[1] + 1].zero_()
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
        """Once per optimizer step, after it: health check, seed, and the refresh every
        `refresh_every` steps."""
        self.check_health()
        for layer in self.layers.values():
            if layer.mode == "sync_pending":
                layer.mode = "sync"
        self.steps += 1
        self.seed.add_(1)
        if self.steps % self.config.refresh_every == 0:
            self.refresh()

    def owners(self) -> dict[str, int]:
        """Group rank that rebuilds each layer's transform at a refresh (round robin).

        The eigendecompositions are the expensive part of a refresh; sharding them over the
        data-parallel ranks divides that cost by the world size, and the owner's broadcast
        is what makes every rank's transform bit-identical.
        """
        world = self.world()
        owner = {name: i % world for i, name in enumerate(self.layers)}
        for name, layer in self.layers.items():
            if layer.leader is not None:
                owner[name] = owner[layer.leader.fqn]  # built from the leader's statistics
        return owner

    def needs_geometry(self, layer: LayerState, deciding: bool = False) -> bool:
        """Whether a refresh rebuilds `layer`'s map: adaptive, and selected or still undecided
        (or this refresh decides the selection). The step model prices refreshes by it."""
        return layer.transform.adaptive and (layer.selected or not layer.decided or deciding)

    @torch.no_grad()
    def refresh(self) -> RefreshRecord:
        """Rebuild the geometry of the layers that use (or may use) it, then the selection;
        identical on all ranks."""
        cfg = self.config
        start = time.perf_counter()
        number = len(self.history) + 1  # this refresh's ordinal
        deciding = not self._static_selection() and (
            any(not l.decided for l in self.layers.values())
            or (cfg.reselect_every > 0 and number % cfg.reselect_every == 0))
        old = {n: (l.active_kind, tuple(t.clone() for t in l.active_tensors()))
               for n, l in self.layers.items() if l.residual is not None}
        if not self._sharing_checked:
            self._share_identical_statistics()
        owners, me = self.owners(), group_rank(self.group)
        needing = [n for n, l in self.layers.items() if self.needs_geometry(l, deciding)]
        for name in needing:
            layer = self.layers[name]
            mine = owners[name] == me
            if layer.leader is not None:
                continue  # after its leader, below
            if isinstance(layer.stats, SketchStatistics):
                # reduced onto the owner only: it alone rebuilds the map
                if layer.stats.consolidate(self.group, owner=owners[name]) and mine:
                    layer.transform.refresh_from_stats(layer.stats, cfg.damping)
                continue
            if layer.stats is not None:
                factor = layer.stats.consolidate(self.group)
                if not bool(layer.stats.initialized):
                    continue
            else:
                grad = self.grad_source(name) if self.grad_source is not None else None
                if grad is None:
                    continue
                local, sharded = _local_grad(grad)
                new = gradient_factor(local, self.group, sharded=sharded)
                if not bool(torch.isfinite(new).all()):
                    logger.warning("GIFT: non-finite gradient factor for %s dropped at step %d", name, self.steps)
                    continue
                f = layer.grad_factor
                if cfg.geometry == "momentum" or float(f.abs().sum()) == 0.0:
                    f.copy_(new)  # the momentum is already an average over steps
                else:
                    f.mul_(cfg.ema).add_(new, alpha=1 - cfg.ema)
                factor = f
            if mine:
                layer.transform.refresh_from(factor, cfg.damping)
        for name in needing:
            layer = self.layers[name]
            if layer.leader is not None and owners[name] == me:
                for dst, src in zip(layer.transform.tensors, layer.leader.transform.tensors):
                    dst.copy_(src)
        # every rank broadcasts the same list (owners send what they built, or kept)
        self._broadcast_transforms(owners, set(needing))
        record = self._select(deciding)
        for name, layer in self.layers.items():
            if layer.residual is not None:
                kind, tensors = old[name]
                fmt = self.config.residual_format
                back = apply_inverse(kind, residual_store.read(fmt, layer.residual, layer.shape[1]), tensors)
                residual_store.write(fmt, layer.residual, apply_forward(layer.active_kind, back, layer.active_tensors()))
        record.seconds = time.perf_counter() - start
        self.history.append(record)
        return record

    def _select(self, deciding: bool) -> RefreshRecord:
        """Measure the layers with a geometry on their probes (averaged over ranks); when
        `deciding`, apply the measured selection rule."""
        cfg = self.config
        measured: dict[str, LayerMeasurement] = {}
        for name, layer in self.layers.items():
            if layer.kind == "identity" or not (layer.selected or not layer.decided or deciding):
                continue
            tokens = float(layer.stats.tokens) / max(self.steps, 1) if layer.stats is not None else 8192.0
            measured[name] = measure(layer.probe, cfg, layer.kind, layer.transform.tensors, layer.shape, tokens)
        stacked = torch.tensor(
            [[m.err_euclidean, m.err_transformed, m.boundary_hits] for m in measured.values()], dtype=torch.float64
        ).reshape(-1, 3)
        if stacked.numel():
            all_reduce_(stacked, self.group).div_(self.world())
        for (name, m), row in zip(measured.items(), stacked.tolist()):
            m.err_euclidean, m.err_transformed, m.boundary_hits = row
            layer = self.layers[name]
            layer.measurement = m
            layer.boundary_score = m.boundary_hits if layer.boundary_score == 0 else 0.5 * (layer.boundary_score + m.boundary_hits)
        if deciding:
            chosen = decide(cfg, measured, {n: l.boundary_score for n, l in self.layers.items()})
            for name, layer in self.layers.items():
                self.set_selected(layer, name in chosen, decided=True)
        record = RefreshRecord(self.steps)
        for name, m in measured.items():
            layer = self.layers[name]
            record.layers[name] = {
                "selected": layer.selected, "err_euclidean": m.err_euclidean, "err_transformed": m.err_transformed,
                "gain": m.gain, "overhead": m.overhead, "boundary_hits": m.boundary_hits,
            }
        logger.info("GIFT refresh at step %d: %d/%d layers on the transformed path", self.steps,
                    sum(l.selected for l in self.layers.values()), len(self.layers))
        return record

    def share_statistics(self, names: list[str]) -> None:
        """Let the layers `names` (which read the same input) use the statistics of the first:
        one statistic per distinct input. The others stop feeding statistics (a plan change:
        compiled forwards drop their hooks' work after one recompilation)."""
        leader = self.layers[names[0]]
        for name in names[1:]:
            layer = self.layers[name]
            if layer.stats is None or type(layer.stats) is not type(leader.stats) or layer.shape[1] != leader.shape[1]:
                raise ValueError(f"GiftState.share_statistics: {name} cannot share {names[0]}'s statistics")
            layer.leader, layer.stats = leader, leader.stats
            leader.followers.append(layer)
            layer._replan()
        self.plan_version += 1

    @torch.no_grad()
    def _share_identical_statistics(self) -> None:
        """At the first refresh: layers whose first window of statistics is bit-identical saw
        the same inputs (q/k/v, gate/up projections); all ranks must agree before they share."""
        self._sharing_checked = True
        groups: dict[tuple[type, int], list[LayerState]] = {}
        for layer in self.layers.values():
            if layer.stats is not None and layer.leader is None and not layer.followers:
                groups.setdefault((type(layer.stats), layer.shape[1]), []).append(layer)
        candidates = []
        for members in groups.values():
            for i, a in enumerate(members):
                for b in members[i + 1:]:
                    candidates.append((a, b, _same_window(a.stats, b.stats)))
        if not candidates:
            return
        flags = torch.tensor([float(same) for _, _, same in candidates], dtype=torch.float64)
        all_reduce_(flags, self.group)
        classes: dict[str, list[str]] = {}
        leader_of: dict[str, str] = {}
        for (a, b, _), flag in zip(candidates, flags.tolist()):
            if flag == self.world() and b.fqn not in leader_of:
                head = leader_of.get(a.fqn, a.fqn)
                leader_of[b.fqn] = head
                classes.setdefault(head, [head]).append(b.fqn)
        for names in classes.values():
            self.share_statistics(names)
            logger.info("GIFT: %s read the same input; they share one statistic", ", ".join(names))

    def set_selected(self, layer: LayerState, selected: bool, *, decided: bool = True) -> None:
        """Put a layer on the transformed (`selected`) or Euclidean path. A change of path or
        of its statistics switch changes the plan graphs carry (`plan_version`)."""
        group = [layer.leader or layer, *(layer.leader or layer).followers]
        before = [(l.selected, l.collect_stats) for l in group]
        layer.selected, layer.decided = selected, decided
        if [(l.selected, l.collect_stats) for l in group] != before:
            layer._replan()
            self.plan_version += 1

    def _broadcast_transforms(self, owners: dict[str, int], names: set[str]) -> None:
        """The rebuilt layers' transform tensors from their owners, one packed broadcast per owner."""
        if self.world() <= 1:
            return
        for src in range(self.world()):
            flat = [t for name, layer in self.layers.items() if name in names and owners[name] == src
                    for t in layer.transform.tensors]
            if not flat:
                continue
            buf = broadcast_(torch.cat([t.reshape(-1) for t in flat]), self.group, src)
            offset = 0
            for t in flat:
                t.copy_(buf[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    # ---- telemetry ---------------------------------------------------------------------
    def comm_totals(self) -> dict[str, int]:
        """Cumulative counts since the state was created, as counted by the collectives when
        they handed bytes over: `wire` (bytes handed to GIFT's collectives, and to the
        full-precision sync of unmanaged parameters where GIFT does that sync), `baseline`
        (bytes the replaced collectives would have been handed), `calls`, `nonfinite`,
        `mismatch`, and `plain_calls` (bucket collectives of the full-precision sync of unmanaged
        parameters, `gift_compile.plain_sync`; not in `calls`)."""
        c = self.counters.tolist()
        return {"wire": c[C_WIRE], "baseline": c[C_BASELINE], "calls": c[C_CALLS], "nonfinite": c[C_NONFINITE],
                "mismatch": c[C_MISMATCH], "plain_calls": c[C_PLAIN_CALLS]}

    def accounted_bytes_per_step(self) -> int:
        """Shape-based accounting of the managed layers' bytes per step under this state's own
        one-layer collectives (what `comm_totals()["wire"]` should grow by per step when every
        managed layer is communicated once and nothing else is counted)."""
        return sum(bucket_wire_bytes(self.layer_plan(name)) for name in self.layers)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of every tensor this state keeps, by kind (transforms, statistics, residuals,
        probes, pending accumulation buffers, other). Works on the meta device, which is how
        the benchmark sizes GIFT at models this machine cannot hold."""
        out = {"transforms": 0, "statistics": 0, "residuals": 0, "probes": 0, "pending": 0, "other": 0}

        def add(kind: str, t: torch.Tensor | None) -> None:
            if t is not None:
                out[kind] += t.numel() * t.element_size()

        seen: set[int] = set()
        for layer in self.layers.values():
            for t in layer.transform.tensors:
                add("transforms", t)
            if layer.stats is not None and id(layer.stats) not in seen:
                seen.add(id(layer.stats))
                stats_tensors = dict(layer.stats.state_dict())
                if isinstance(layer.stats, SketchStatistics):
                    stats_tensors["omega"] = layer.stats.omega
                for t in stats_tensors.values():
                    add("statistics", t)
            add("statistics", layer.grad_factor)
            for t in layer.residual or ():
                add("residuals", t)
            add("probes", layer.probe)
            add("pending", layer.pending)
            add("other", layer.seed_offset)
        for t in (self.seed, self.rank, self.counters):
            add("other", t)
        return out

    def summary(self) -> list[dict[str, object]]:
        """One row per layer: selection and the errors measured at the last refresh."""
        rows = []
        for name, layer in self.layers.items():
            m = layer.measurement
            rows.append({
                "layer": name, "shape": layer.shape, "selected": layer.selected,
                "err_euclidean": m.err_euclidean if m else math.nan,
                "err_transformed": m.err_transformed if m else math.nan,
            })
        return rows

    # ---- checkpointing -----------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "sharing_checked": self._sharing_checked,
            "shared": {l.fqn: [f.fqn for f in l.followers] for l in self.layers.values() if l.followers},
            "layers": {n: {"shape": list(l.shape), "kind": l.kind, "rank": l.transform.rank,
                           "error_feedback": l.residual is not None,
                           "residual_format": self.config.residual_format if l.residual is not None else None}
                       for n, l in self.layers.items()},
        }

    def state_dict(self) -> dict[str, Any]:
        """A snapshot (detached copies): loaders such as DCP write into the tensors they are
        given before `load_state_dict` validates them, which must not touch the live state."""
        sd: dict[str, Any] = {"meta": json.dumps(self._meta(), sort_keys=True), "seed": self.seed.detach().clone(),
                              "steps": torch.tensor(self.steps)}
        for name, layer in self.layers.items():
            sd.update({f"{name}.{k}": v.detach().clone() for k, v in layer.state_dict().items()})
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load a checkpoint after validating it against this state; raises ValueError naming
        the layer and key that do not fit, before anything is modified.

        Accepted with a logged conversion: a different wire format, refresh cadence, EMA,
        damping or selection rule (the saved geometry stays valid), and turning error feedback
        on (residuals start at zero). Refused: other layers, shapes, geometry kind or rank,
        turning error feedback off with saved residuals, and non-finite tensors.
        """
        if "meta" not in sd:
            raise ValueError("GIFT checkpoint has no 'meta' entry: it was not written by this version of GiftState")
        meta = json.loads(sd["meta"]) if isinstance(sd["meta"], str) else sd["meta"]
        mine = self._meta()
        if meta.get("version") != STATE_VERSION:
            raise ValueError(f"GIFT checkpoint version {meta.get('version')} != {STATE_VERSION}")
        saved_layers, my_layers = meta["layers"], mine["layers"]
        missing, extra = sorted(set(my_layers) - set(saved_layers)), sorted(set(saved_layers) - set(my_layers))
        if missing or extra:
            raise ValueError(f"GIFT checkpoint layers differ: missing {missing}, unexpected {extra}")
        converted = []
        for name, want in my_layers.items():
            got = saved_layers[name]
            for key in ("shape", "kind", "rank"):
                if got[key] != want[key]:
                    raise ValueError(f"GIFT checkpoint: layer {name}: {key} {got[key]} != expected {want[key]}")
            if got["error_feedback"] and not want["error_feedback"]:
                raise ValueError(f"GIFT checkpoint: layer {name} has an error-feedback residual but error_feedback "
                                 "is off now; its accumulated error would be lost")
            if want["error_feedback"] and not got["error_feedback"]:
                converted.append(f"{name}: residual starts at zero (error feedback newly on)")
        recoded: dict[str, torch.Tensor] = {}  # residuals saved in another format, as fp32
        for name, layer in self.layers.items():
            got, want = saved_layers[name], my_layers[name]
            if got["error_feedback"] and want["error_feedback"] and got["residual_format"] != want["residual_format"]:
                n = residual_store.buffer_count(got["residual_format"])
                bufs = tuple(torch.as_tensor(sd.get(f"{name}.residual.{i}", torch.empty(0))) for i in range(n))
                try:
                    value = residual_store.read(got["residual_format"], bufs, layer.shape[1])
                except (RuntimeError, ValueError) as e:
                    raise ValueError(f"GIFT checkpoint: layer {name}: unreadable {got['residual_format']} residual: {e}")
                recoded[name] = value
                converted.append(f"{name}: residual re-stored from {got['residual_format']} to {want['residual_format']}")
        plan: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, layer in self.layers.items():
            for key, dst in layer.state_dict().items():
                full = f"{name}.{key}"
                if key.startswith("residual.") and (name in recoded or not saved_layers[name]["error_feedback"]):
                    continue
                if full not in sd:
                    raise ValueError(f"GIFT checkpoint: layer {name}: key {key!r} is missing")
                src = torch.as_tensor(sd[full])
                if src.shape != dst.shape:
                    raise ValueError(f"GIFT checkpoint: layer {name}: key {key!r} has shape {tuple(src.shape)}, "
                                     f"expected {tuple(dst.shape)}")
                if src.is_floating_point() and not bool(torch.isfinite(src).all()):
                    raise ValueError(f"GIFT checkpoint: layer {name}: key {key!r} holds NaN/Inf values")
                if key not in ("selected", "decided", "boundary_score"):
                    plan.append((dst, src))
        unknown = sorted(k for k in sd if k not in ("meta", "seed", "steps")
                         and not any(k.startswith(f"{n}.") for n in self.layers))
        if unknown:
            raise ValueError(f"GIFT checkpoint has unexpected keys {unknown[:5]}")
        for dst, src in plan:
            dst.copy_(src)
        for name, value in recoded.items():
            residual_store.write(self.config.residual_format, self.layers[name].residual, value)
        for leader, followers in meta.get("shared", {}).items():
            if not self.layers[leader].followers:
                self.share_statistics([leader, *followers])
        self._sharing_checked = bool(meta.get("sharing_checked", False))
        for name, layer in self.layers.items():
            self.set_selected(layer, bool(sd[f"{name}.selected"]), decided=bool(sd[f"{name}.decided"]))
            layer.boundary_score = float(sd[f"{name}.boundary_score"])
        self.seed.copy_(torch.as_tensor(sd["seed"]))
        self.steps = int(sd["steps"])
        changed = {k: (meta["config"].get(k), v) for k, v in mine["config"].items() if meta["config"].get(k) != v}
        if changed:
            converted.append(f"config changed since the checkpoint: {changed}")
        for line in converted:
            logger.warning("GIFT checkpoint loaded with a conversion: %s", line)


def _same_window(a: KFACStatistics | SketchStatistics, b: KFACStatistics | SketchStatistics) -> bool:
    """Whether two statistics accumulated exactly the same window (non-empty)."""
    ta, tb = a.state_dict(), b.state_dict()
    keys = ("acc", "count") if isinstance(a, KFACStatistics) else ("y_acc", "diag_acc", "count")
    return bool(ta["count"] > 0) and all(torch.equal(ta[k], tb[k]) for k in keys)


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


def _local_grad(grad: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The local tensor of a (possibly DTensor, dim-0 sharded) gradient."""
    to_local = getattr(grad, "to_local", None)
    if to_local is not None:
        return to_local(), True
    return grad, False
