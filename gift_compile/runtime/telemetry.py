"""What a `GiftState` reports: bytes counted by the collectives, shape-based accounting, the
memory it keeps, and the per-layer selection summary; and `CommTimer`, the time a framework
hook spends in GIFT's collectives (a `GiftState` holds the FSDP2 hook's).

`GiftState` inherits `Telemetry`; the fields it reads are `GiftState`'s.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from gift_compile.exchange.collectives import (C_BASELINE, C_CALLS, C_CROSS_BASELINE, C_MISMATCH, C_NODE_WIRE, C_NONFINITE,
                                               C_PLAIN_CALLS, C_WIRE, bucket_wire_bytes)
from gift_compile.geometry.statistics import SketchStatistics

if TYPE_CHECKING:
    from gift_compile.runtime.layer import LayerState, OutsideResidual

__all__ = ["CommTimer", "Telemetry", "compression_of"]


def compression_of(totals: dict[str, int]) -> dict[str, float | None]:
    """`{"network": ..., "total": ...}` from `comm_totals()`-style byte counts (or their
    per-step differences).

    `network`, the headline ("x fewer bytes"): bytes an exchange at the gradients' dtype over
    the same node layout would have sent across nodes over the bytes GIFT sent across them
    (`cross_baseline / cross_wire`): what the network carries, the cost GIFT exists to cut.
    None when nothing crossed a node (a group inside one node has no network bytes; its
    figure is `total`). `total`: every byte, inside nodes and across them, against the
    replaced one-level collectives (`baseline / wire`); under two levels it also counts the
    node's fast full-precision reduce-scatter, so it can be below 1 while the network's is
    several times above. NaN before anything was handed over."""
    cross, wire = totals["cross_wire"], totals["wire"]
    return {"network": totals["cross_baseline"] / cross if cross else None,
            "total": totals["baseline"] / wire if wire else math.nan}


class CommTimer:
    """Time spent in GIFT's reduce-scatter hooks: CUDA events on the current stream (read at
    `take`, so the hot path never synchronizes), host wall time elsewhere."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._events: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def timing(self, device: torch.device) -> Iterator[None]:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - t0

    def take(self) -> float:
        """Seconds since the last `take`."""
        for start, end in self._events:
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1e3
        out, self.seconds, self._events = self.seconds, 0.0, []
        return out


class Telemetry:
    """Counters, accounting and summaries of a `GiftState` (a mixin: no fields of its own)."""

    __slots__ = ()
    layers: dict[str, LayerState]
    outside: dict[str, OutsideResidual]
    counters: torch.Tensor
    seed: torch.Tensor
    rank: torch.Tensor

    def comm_totals(self) -> dict[str, int]:
        """Cumulative counts since the state was created, as counted by the collectives when
        they handed bytes over: `wire` (every byte handed to GIFT's collectives, inside nodes
        and across them, the sync of a plain module's unmanaged parameters included),
        `baseline` (bytes the replaced one-level collectives would have been handed, at the
        gradients' dtype), `calls`, `nonfinite`, `mismatch`, and `plain_calls` (bucket
        collectives of a plain module's unmanaged parameters,
        `gift_compile.frameworks.plain_sync`; not in `calls`). Every gradient goes through
        these counters on plain modules, DDP and FSDP2; on a traced SimpleFSDP graph the
        reduce-scatters the pass left alone are its report's `untouched_bytes`, which
        torchtitan's telemetry adds to both.

        `wire` by where it goes: `cross_wire`, handed to collectives that cross nodes (the
        network: a two-level exchange's stage 2, a one-level group spanning nodes; 0 when the
        group sits inside one node), and `node_wire`, the rest (a two-level exchange's native
        reduce-scatter, header and result all_gathers, and every collective of a group inside
        one node). `cross_baseline`: what an exchange at the gradients' dtype over the same
        node layout would have handed across nodes (a two-level stage 2's node-reduced chunks,
        1/g of the gradient). `compression()` turns these into the two reported figures.

        The refresh's own traffic (statistics, selection measurements, map broadcasts; in two
        levels where the group spans nodes, `gift_compile.sync`) is apart from the gradients':
        `refresh_wire`, the bytes this rank handed to send in it, and `refresh_cross_wire`,
        those of them handed to collectives between nodes (by the same rule: all of them in a
        one-level group spanning nodes, none in a group inside one node)."""
        c = self.counters.tolist()
        return {"wire": c[C_WIRE], "baseline": c[C_BASELINE], "calls": c[C_CALLS], "nonfinite": c[C_NONFINITE],
                "mismatch": c[C_MISMATCH], "plain_calls": c[C_PLAIN_CALLS], "node_wire": c[C_NODE_WIRE],
                "cross_wire": c[C_WIRE] - c[C_NODE_WIRE], "cross_baseline": c[C_CROSS_BASELINE],
                "refresh_wire": self.refresh_traffic.wire, "refresh_cross_wire": self.refresh_traffic.cross}

    def compression(self) -> dict[str, float | None]:
        """The two compression figures of `comm_totals()` (`compression_of` says how)."""
        return compression_of(self.comm_totals())

    def accounted_bytes_per_step(self) -> int:
        """Shape-based accounting of the managed layers' bytes per step under this state's own
        one-layer collectives (what `comm_totals()["wire"]` should grow by per step when every
        managed layer is communicated once and nothing else is counted)."""
        return sum(bucket_wire_bytes(self.layer_plan(name)) for name in self.layers)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of every tensor this state keeps, by kind (transforms, statistics, residuals,
        the all-reduce's second-hop residuals, probes, pending accumulation buffers, other). Works on the meta device, which is how
        the benchmark sizes GIFT at models this machine cannot hold."""
        out = {"transforms": 0, "statistics": 0, "residuals": 0, "second_hop_residuals": 0, "probes": 0,
               "pending": 0, "other": 0}

        def add(kind: str, t: torch.Tensor | None) -> None:
            if t is not None:
                out[kind] += t.numel() * t.element_size()

        seen: set[int] = set()
        for layer in self.layers.values():
            out["transforms"] += layer.transform.memory_bytes()
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
            for t in layer.second_hop_residual or ():
                add("second_hop_residuals", t)
            add("probes", layer.probe)
            add("pending", layer.pending)
            add("other", layer.seed_offset)
        for outside in self.outside.values():
            for t in outside.buffers:
                add("residuals", t)
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
