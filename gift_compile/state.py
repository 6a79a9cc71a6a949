"""Per-layer GIFT state and the refresh that keeps it current.

Everything a compiled graph reads (transform tensors, error-feedback residual, the gradient
probe, the stochastic-rounding seed) is a tensor allocated once and updated in place, so
graphs never recompile. The refresh itself runs eagerly, outside any compiled region, every
`refresh_every` steps: it folds the statistics into the geometry, rebuilds the transforms,
measures every layer's errors on its probe, decides the selection, re-expresses the
error-feedback residuals in the new coordinates, and finally broadcasts the transform
tensors from rank 0 so every rank holds bit-identical maps.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from gift_compile.collectives import wire_bytes_per_rank
from gift_compile.config import GiftConfig
from gift_compile.formats import FormatSpec
from gift_compile.geometry import KFACStatistics, Transform, apply_forward, apply_inverse, gradient_factor
from gift_compile.selection import LayerMeasurement, decide, measure
from gift_compile.sync import all_reduce_, broadcast_, group_rank, world_size

logger = logging.getLogger("gift_compile")

PROBE_ROWS = 128
_KIND = {"none": "identity", "hadamard": "hadamard", "dense": "dense", "lowrank": "lowrank", "gradient": "lowrank"}

# Layer ids are global so that a marker node in any traced graph names exactly one layer.
_LAYERS: "weakref.WeakValueDictionary[int, LayerState]" = weakref.WeakValueDictionary()
_next_id = [0]


def lookup_layer(layer_id: int) -> "LayerState":
    try:
        return _LAYERS[layer_id]
    except KeyError:
        raise KeyError(f"GIFT layer id {layer_id} is not registered (was gift_compile.remove called?)") from None


class LayerState:
    """What GIFT keeps for one managed weight `[out, in]`.

    `transform.tensors`, `residual`, `probe` and the owning state's `seed` enter traced
    graphs as inputs of the `gift::mark` op; `stats` is updated by the layer's forward.
    """

    def __init__(self, fqn: str, shape: tuple[int, int], config: GiftConfig, device: torch.device | str):
        self.fqn = fqn
        self.shape = (int(shape[0]), int(shape[1]))
        self.config = config
        out, d_in = self.shape
        self.transform = Transform(_KIND[config.geometry], d_in, config.rank, seed=config.seed + _next_id[0], device=device)
        self.stats = (
            KFACStatistics(d_in, ema=config.ema, max_tokens=config.stats_tokens, device=device)
            if config.geometry in ("dense", "lowrank")
            else None
        )
        self.grad_factor: torch.Tensor | None = (
            torch.zeros(d_in, d_in, device=device) if config.geometry == "gradient" else None
        )
        self.residual = torch.zeros(out, d_in, device=device) if config.error_feedback else None
        self.probe = torch.zeros(min(out, PROBE_ROWS), d_in, device=device)
        self.selected = False
        self.measurement: LayerMeasurement | None = None
        self.boundary_score = 0.0
        self.layer_id = _next_id[0]
        _next_id[0] += 1
        _LAYERS[self.layer_id] = self
        self.transform.set_identity()  # Euclidean until a refresh (or a static rule) selects it

    @property
    def kind(self) -> str:
        return self.transform.kind

    def graph_tensors(self, seed: torch.Tensor) -> list[torch.Tensor]:
        """Inputs of the marker op, in the order `passes` expects: transform, [residual], probe, seed."""
        extra = [self.residual] if self.residual is not None else []
        return [*self.transform.tensors, *extra, self.probe, seed]

    def state_dict(self) -> dict[str, torch.Tensor]:
        sd = {f"transform.{k}": v for k, v in self.transform.state_dict().items()}
        if self.stats is not None:
            sd.update({f"stats.{k}": v for k, v in self.stats.state_dict().items()})
        if self.grad_factor is not None:
            sd["grad_factor"] = self.grad_factor
        if self.residual is not None:
            sd["residual"] = self.residual
        sd["probe"] = self.probe
        sd["selected"] = torch.tensor(self.selected)
        sd["boundary_score"] = torch.tensor(self.boundary_score)
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.transform.load_state_dict({k[len("transform."):]: v for k, v in sd.items() if k.startswith("transform.")})
        if self.stats is not None:
            self.stats.load_state_dict({k[len("stats."):]: v for k, v in sd.items() if k.startswith("stats.")})
        for name in ("grad_factor", "residual", "probe"):
            t = getattr(self, name)
            if t is not None:
                t.copy_(sd[name])
        self.selected = bool(sd["selected"])
        self.boundary_score = float(sd["boundary_score"])


@dataclass
class RefreshRecord:
    """Telemetry of one refresh: per-layer measurements and the resulting selection."""

    step: int
    layers: dict[str, dict[str, float | bool]] = field(default_factory=dict)
    seconds: float = 0.0  # wall time of the whole refresh on this rank (host-synchronous work)


class GiftState:
    """All layers managed by one `apply`, plus the step counter that drives refreshes.

    Implements `state_dict`/`load_state_dict` (torch.distributed.checkpoint's Stateful).
    Replicated across ranks: `seed`, `steps`, transforms, the K-FAC factor (EMA), the
    gradient-side factor, selection and boundary scores. Per rank: the K-FAC accumulator of
    the current window, the error-feedback residuals and the gradient probes, so a
    checkpoint keeps one copy per rank.
    """

    def __init__(self, config: GiftConfig, group: dist.ProcessGroup | None, collective: str = "all_reduce"):
        self.config = config
        self.group = group
        self.collective = collective
        self.layers: dict[str, LayerState] = {}
        self.seed = torch.full((), config.seed, dtype=torch.int64)
        self.steps = 0
        self.history: list[RefreshRecord] = []
        self.grad_source: Callable[[str], torch.Tensor | None] | None = None

    def add_layer(self, fqn: str, shape: tuple[int, int], device: torch.device | str) -> LayerState:
        """Register a managed weight; a fixed rotation chosen by a static rule starts active."""
        if not self.layers and self.seed.device != torch.device(device):
            self.seed = self.seed.to(device)  # graphs read it where the weights live
        layer = LayerState(fqn, shape, self.config, device)
        self.layers[fqn] = layer
        if not layer.transform.adaptive and layer.kind != "identity":
            static = decide(self.config, {fqn: LayerMeasurement(1.0, 1.0, 0.0, 0.0)}, {})
            if fqn in static and self.config.select != "auto":
                self.set_selected(layer, True)
        return layer

    def world(self) -> int:
        return world_size(self.group)

    # ---- step driver -------------------------------------------------------------------
    def step(self) -> None:
        """Call once per optimizer step, after backward (apply() wires this up)."""
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
        return {name: i % world for i, name in enumerate(self.layers)}

    @torch.no_grad()
    def refresh(self) -> RefreshRecord:
        """Rebuild every layer's geometry and selection; identical on all ranks.

        Every rank averages the statistics (collectives), each layer's owner rebuilds its
        transform, and the owners broadcast them.
        """
        cfg = self.config
        start = time.perf_counter()
        old = {n: tuple(t.clone() for t in l.transform.tensors) for n, l in self.layers.items() if l.residual is not None}
        owners, me = self.owners(), group_rank(self.group)
        for name, layer in self.layers.items():
            if not layer.transform.adaptive:
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
                f = layer.grad_factor
                f.copy_(new) if float(f.abs().sum()) == 0.0 else f.mul_(cfg.ema).add_(new, alpha=1 - cfg.ema)
                factor = f
            if not bool(torch.isfinite(factor).all()):
                logger.warning("GIFT: non-finite statistics for %s; keeping its previous transform", name)
                continue
            if owners[name] == me:
                layer.transform.refresh_from(factor, cfg.damping)
        self._broadcast_transforms(owners)
        record = self._select()
        for name, layer in self.layers.items():
            if layer.residual is not None:
                prev = old[name]
                back = apply_inverse(layer.kind, layer.residual, prev)
                layer.residual.copy_(apply_forward(layer.kind, back, layer.transform.tensors))
        record.seconds = time.perf_counter() - start
        self.history.append(record)
        return record

    def _select(self) -> RefreshRecord:
        """Measure each layer on its probe (averaged over ranks) and apply the selection."""
        cfg = self.config
        names = list(self.layers)
        measured: dict[str, LayerMeasurement] = {}
        for name in names:
            layer = self.layers[name]
            tokens = float(layer.stats.tokens) / max(self.steps, 1) if layer.stats is not None else 8192.0
            layer.transform.activate()
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
        chosen = decide(cfg, measured, {n: l.boundary_score for n, l in self.layers.items()})
        record = RefreshRecord(self.steps)
        for name, layer in self.layers.items():
            self.set_selected(layer, name in chosen)
            m = layer.measurement
            record.layers[name] = {
                "selected": layer.selected, "err_euclidean": m.err_euclidean, "err_transformed": m.err_transformed,
                "gain": m.gain, "overhead": m.overhead, "boundary_hits": m.boundary_hits,
            }
        logger.info(
            "GIFT refresh at step %d: %d/%d layers on the transformed path", self.steps, len(chosen), len(self.layers)
        )
        return record

    def set_selected(self, layer: LayerState, selected: bool) -> None:
        """Switch a layer's path by data (the graph stays the same)."""
        layer.selected = selected
        if selected:
            layer.transform.activate()
        else:
            layer.transform.set_identity()

    def _broadcast_transforms(self, owners: dict[str, int]) -> None:
        """Every layer's transform tensors from its owner, one packed broadcast per owner."""
        if self.world() <= 1:
            return
        for src in range(self.world()):
            flat = [t for name, layer in self.layers.items() if owners[name] == src for t in layer.transform.tensors]
            if not flat:
                continue
            buf = broadcast_(torch.cat([t.reshape(-1) for t in flat]), self.group, src)
            offset = 0
            for t in flat:
                t.copy_(buf[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    # ---- telemetry ---------------------------------------------------------------------
    def wire_bytes_per_step(self) -> dict[str, int]:
        """Bytes this rank hands to gradient collectives per step for the managed weights,
        in the configured format and at fp32/bf16 for comparison."""
        world = max(self.world(), 1)
        spec = FormatSpec(self.config.format, self.config.scaling, self.config.block_size)
        total = {"gift": 0, "fp32": 0, "bf16": 0}
        for layer in self.layers.values():
            total["gift"] += wire_bytes_per_rank(self.collective, layer.shape, spec, world)
            total["fp32"] += wire_bytes_per_rank(self.collective, layer.shape, FormatSpec("fp32"), world)
            total["bf16"] += wire_bytes_per_rank(self.collective, layer.shape, FormatSpec("bf16"), world)
        return total

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
    def state_dict(self) -> dict[str, torch.Tensor]:
        sd: dict[str, torch.Tensor] = {"seed": self.seed, "steps": torch.tensor(self.steps)}
        for name, layer in self.layers.items():
            sd.update({f"{name}.{k}": v for k, v in layer.state_dict().items()})
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.seed.copy_(sd["seed"])
        self.steps = int(sd["steps"])
        for name, layer in self.layers.items():
            prefix = f"{name}."
            layer.load_state_dict({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)})


def _local_grad(grad: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The local tensor of a (possibly DTensor, dim-0 sharded) gradient."""
    to_local = getattr(grad, "to_local", None)
    if to_local is not None:
        return to_local(), True
    return grad, False
