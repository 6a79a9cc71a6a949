"""The refresh engine: rebuilds the geometry from the statistics and decides the selection.

It runs eagerly, outside any compiled region, every `refresh_every` optimizer steps: it folds
the statistics into the geometry, rebuilds the maps (each on one owner rank, then broadcast,
so every rank holds bit-identical maps), measures every layer's errors on its probe, decides
the selection and re-expresses the error-feedback residuals in the new coordinates.
`GiftState` inherits it; the fields it reads are `GiftState`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gift_compile.codec import residual as residual_store
from gift_compile.config import GiftConfig
from gift_compile.geometry import apply_forward, apply_inverse
from gift_compile.geometry.maps import FactorSource, RowShard
from gift_compile.geometry.statistics import KFACStatistics, SketchStatistics
from gift_compile.runtime.selection import LayerMeasurement, decide, harmful, measure, rests_on_gain
from gift_compile.sync import all_gather_object_, all_reduce_, broadcast_, counting, group_rank

if TYPE_CHECKING:
    from gift_compile.runtime.layer import LayerState

__all__ = ["RefreshEngine", "RefreshRecord"]

logger = logging.getLogger("gift_compile")

RETRY_DAMPING = (1e-6, 1e-4, 1e-2)
"""Relative dampings (`GiftConfig.damping`'s unit) a refresh retries, in order, when a map
cannot be built at the configured one."""


@dataclass
class RefreshRecord:
    """Telemetry of one refresh: per-layer measurements and the resulting selection."""

    step: int
    layers: dict[str, dict[str, float | bool]] = field(default_factory=dict)
    seconds: float = 0.0  # wall time of the whole refresh on this rank (host-synchronous work)


def next_refresh(config: GiftConfig, step: int) -> int:
    """The optimizer step (1-based) of the first refresh after `step` steps."""
    return next(s for s in range(step + 1, step + 10 * config.refresh_every + 2) if config.refresh_due(s))


def refresh_words(config: GiftConfig, layers: dict[str, LayerState], step: int, shown: int = 8) -> str:
    """What a refresh at optimizer step `step` left, in the words of the rank-0 log line and of
    `gift_compile.report`: the layers mapped now (of those managed, the first `shown` named)
    and when the next refresh is."""
    mapped = [n for n, l in layers.items() if l.selected]
    names = ", ".join(mapped[:shown]) + (f", ... ({len(mapped) - shown} more)" if len(mapped) > shown else "")
    return (f"{len(mapped)} of {len(layers)} managed layers mapped{': ' + names if mapped and shown else ''}; "
            f"next refresh at optimizer step {next_refresh(config, step)}")


class RefreshEngine:
    """Refresh, selection and statistics sharing of a `GiftState` (a mixin: no fields of its own)."""

    __slots__ = ()
    config: GiftConfig
    group: dist.ProcessGroup | None
    layers: dict[str, LayerState]
    steps: int
    history: list[RefreshRecord]
    grad_source: FactorSource | None
    plan_version: int
    selection_changes: int
    counters: torch.Tensor
    _sharing_checked: bool


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
        identical on all ranks. The bytes its collectives are handed count into
        `refresh_traffic` (`comm_totals()["refresh_wire"]`)."""
        with counting(self.refresh_traffic):
            return self._refresh()

    def _refresh(self) -> RefreshRecord:
        cfg = self.config
        start = time.perf_counter()
        number = len(self.history) + 1  # this refresh's ordinal
        deciding = not self._static_selection() and (
            any(not l.decided for l in self.layers.values())
            or (cfg.reselect_every > 0 and number % cfg.reselect_every == 0))
        old = {n: (l.active_kind, tuple(t.clone() for t in l.active_tensors()))
               for n, l in self.layers.items() if l.residual_buffers()}
        if not self._sharing_checked:
            self._share_identical_statistics()
        owners, me = self.owners(), group_rank(self.group)
        needing = [n for n, l in self.layers.items() if self.needs_geometry(l, deciding)]
        failed: list[str] = []  # this rank's maps that could not be built (kept as they were)
        for name in needing:
            layer = self.layers[name]
            mine = owners[name] == me
            if layer.leader is not None:
                continue  # after its leader, below
            if isinstance(layer.stats, SketchStatistics):
                # reduced onto the owner only: it alone rebuilds the map
                if layer.stats.consolidate(self.group, owner=owners[name]) and mine:
                    failed += self._build_map(name, layer, lambda d, l=layer: l.transform.refresh_from_stats(l.stats, d))
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
                new = layer.transform.reduce_factor(local, self.group, sharded)
                if not bool(torch.isfinite(new).all()):
                    logger.warning("GIFT: non-finite gradient factor for %s dropped at step %d", name, self.steps)
                    continue
                layer.transform.fold_factor(layer.grad_factor, new, cfg.ema)
                factor = layer.grad_factor
            if mine:
                failed += self._build_map(name, layer, lambda d, l=layer, f=factor: l.transform.refresh_from(f, d))
        for name in needing:
            layer = self.layers[name]
            if layer.leader is not None and owners[name] == me:
                for dst, src in zip(layer.transform.tensors, layer.leader.transform.tensors):
                    dst.copy_(src)
        # every rank broadcasts the same list (owners send what they built, or kept)
        self._broadcast_transforms(owners, set(needing))
        self._raise_together(failed)
        record = self._select(deciding)
        for name, layer in self.layers.items():
            for bufs in layer.residual_buffers().values():  # maps act on columns: a row shard maps alike
                kind, tensors = old[name]
                fmt = self.config.residual_format
                back = apply_inverse(kind, residual_store.read(fmt, bufs, layer.shape[1]), tensors)
                residual_store.write(fmt, bufs, apply_forward(layer.active_kind, back, layer.active_tensors()))
        record.seconds = time.perf_counter() - start
        self.history.append(record)
        return record

    def _build_map(self, name: str, layer: LayerState, build: Callable[[float], None]) -> list[str]:
        """Build `layer`'s map with `build(damping)` at the configured damping, else at the
        larger relative dampings of `RETRY_DAMPING` (logged): a factor too ill-conditioned to
        decompose (`linalg.cholesky` not positive-definite), a map that comes out non-finite
        (a damping floor so small its inverse overflows), or one singular in fp32
        (`Geometry.fp32_problem`: it would turn the gradient into rounding noise, which the
        collectives would then report as the user's NaN/Inf), gets a usable map instead of failing
        on the one rank that owns it. Returns `[]`, or `[why]` when no damping gave one: the
        layer then keeps its previous map and `_raise_together` raises on every rank."""
        kept = tuple(t.clone() for t in layer.transform.tensors)
        problems: list[str] = []  # why each damping tried gave no usable map, in order
        tries = [self.config.damping, *(d for d in RETRY_DAMPING if d > self.config.damping)]
        for damping in tries:
            try:
                build(damping)
            except RuntimeError as e:  # torch.linalg.LinAlgError is one
                problems.append(str(e).splitlines()[0])
                continue
            if not all(bool(torch.isfinite(t).all()) for t in layer.transform.tensors):
                problems.append("the map came out non-finite")
                continue
            unusable = layer.transform.fp32_problem()
            if unusable is not None:
                problems.append(unusable)
                continue
            if problems:
                logger.warning("GIFT refresh at step %d: %s: no usable map at damping=%g (%s); built with "
                               "damping=%g", self.steps, name, self.config.damping, problems[0], damping)
            return []
        for dst, src in zip(layer.transform.tensors, kept):
            dst.copy_(src)
        return [f"{name}: {problems[-1]} (damping {self.config.damping:g} up to {tries[-1]:g})"]

    def _raise_together(self, failed: list[str]) -> None:
        """Raise the same error on every rank when any rank could not build a map it owns
        (one flag per rank all-reduced; the reasons gathered only then): the maps are built
        round-robin, so a rank that raised alone would leave the others waiting at their next
        collective until the process group's timeout. Every rank has broadcast its maps first
        (the failed ones unchanged), so the replicas still hold identical maps."""
        world = self.world()
        if world <= 1:
            if failed:
                raise RuntimeError(f"GIFT refresh at step {self.steps}: no map could be built for {'; '.join(failed)}")
            return
        flags = torch.zeros(world, dtype=torch.float64, device=self.counters.device)
        flags[group_rank(self.group)] = float(len(failed))
        if not all_reduce_(flags, self.group).any():
            return
        reasons = all_gather_object_(failed, self.group)
        listed = "; ".join(f"rank {r}: {why}" for r, whys in enumerate(reasons) for why in whys)
        raise RuntimeError(f"GIFT refresh at step {self.steps}: no map could be built for {listed}; raised on every "
                           f"rank, those layers keep their previous maps")

    def _select(self, deciding: bool) -> RefreshRecord:
        """Measure the layers with a geometry on their probes (averaged over ranks); when
        `deciding`, apply the measured selection rule, else deselect the selected layers the
        measurement says the transform now hurts (`selection.harmful`; the measurements are
        the all-reduced ones, so every rank takes the same decision: one plan change at most)."""
        cfg = self.config
        measured: dict[str, LayerMeasurement] = {}
        for name, layer in self.layers.items():
            if layer.transform.is_identity or not (layer.selected or not layer.decided or deciding):
                continue
            tokens = float(layer.stats.tokens) / max(self.steps, 1) if layer.stats is not None else 8192.0
            measured[name] = measure(layer.probe, cfg, layer.kind, layer.transform.tensors, layer.shape, tokens,
                                     name)
        # The overhead too: it divides by the tokens this rank's statistics saw, which differ
        # between ranks where each is routed its own tokens (a MoE's experts), and every rank
        # must take the same decision.
        stacked = torch.tensor(
            [[m.err_euclidean, m.err_transformed, m.boundary_hits, m.overhead] for m in measured.values()],
            dtype=torch.float64).reshape(-1, 4)
        if stacked.numel():
            all_reduce_(stacked, self.group).div_(self.world())
        for (name, m), row in zip(measured.items(), stacked.tolist()):
            m.err_euclidean, m.err_transformed, m.boundary_hits, m.overhead = row
            layer = self.layers[name]
            layer.measurement = m
            layer.boundary_score = m.boundary_hits if layer.boundary_score == 0 else 0.5 * (layer.boundary_score + m.boundary_hits)
        # The gain rule cannot judge a layer without a finite measurement (its probe was zero or
        # non-finite on some rank): it keeps its path, undecided ones stay undecided, and the
        # next refresh measures it again. The all-reduced rows make this the same on every rank.
        blind = sorted(n for n, m in measured.items() if not m.finite) if rests_on_gain(cfg) else []
        if blind:
            logger.warning("GIFT refresh at step %d: no finite error measurement for %s (zero or non-finite "
                           "gradient probe); kept on their current path, measured again at the next refresh",
                           self.steps, ", ".join(blind))
        judged = {n: m for n, m in measured.items() if n not in blind}
        if deciding:
            chosen = decide(cfg, self.geometry, judged, {n: l.boundary_score for n, l in self.layers.items()})
            for name, layer in self.layers.items():
                if name not in blind:
                    self.set_selected(layer, name in chosen, decided=True)
        else:
            hurt = harmful(cfg, judged, {n for n, l in self.layers.items() if l.selected})
            for name in sorted(hurt):
                logger.info("GIFT refresh at step %d: %s deselected, its transform now hurts (gain %.3f)",
                            self.steps, name, measured[name].gain)
                self.set_selected(self.layers[name], False, decided=True)
        record = RefreshRecord(self.steps)
        for name, m in measured.items():
            layer = self.layers[name]
            record.layers[name] = {
                "selected": layer.selected, "err_euclidean": m.err_euclidean, "err_transformed": m.err_transformed,
                "gain": m.gain, "overhead": m.overhead, "boundary_hits": m.boundary_hits,
            }
        if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
            logger.info("GIFT refresh at step %d: %s", self.steps, refresh_words(self.config, self.layers, self.steps))
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
        leader.sync_stats_gate()
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
        of its statistics switch changes the eager plan and the gates traced graphs read
        (`path_gate`, `stats_gate`), not what they carry: no retrace (`selection_changes`)."""
        group = [layer.leader or layer, *(layer.leader or layer).followers]
        before = [(l.selected, l.collect_stats) for l in group]
        layer.selected, layer.decided = selected, decided
        if [(l.selected, l.collect_stats) for l in group] != before:
            layer._replan()
            for member in group:  # a follower's path decides whether its leader feeds statistics
                member.sync_stats_gate()
            self.selection_changes += 1

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


def _same_window(a: KFACStatistics | SketchStatistics, b: KFACStatistics | SketchStatistics) -> bool:
    """Whether two statistics accumulated exactly the same window (non-empty)."""
    ta, tb = a.state_dict(), b.state_dict()
    keys = ("acc", "count") if isinstance(a, KFACStatistics) else ("y_acc", "diag_acc", "count")
    return bool(ta["count"] > 0) and all(torch.equal(ta[k], tb[k]) for k in keys)


def _local_grad(grad: torch.Tensor | RowShard) -> tuple[torch.Tensor, bool]:
    """The local tensor of a (possibly DTensor, dim-0 sharded, or `RowShard`) gradient-side
    tensor, and whether its rows lie on several ranks (the factor is then summed over them)."""
    if isinstance(grad, RowShard):
        return grad.local, True
    to_local = getattr(grad, "to_local", None)
    if to_local is not None:
        return to_local(), True
    return grad, False
