"""GIFT telemetry in torchtitan's metrics logger, plus a JSON-lines record of every step.

torchtitan's ``MetricsProcessor.log`` prints one console line per logged step and forwards a
metrics dict to TensorBoard / W&B. :class:`GiftMetricsProcessor` adds GIFT's counters to that
dict, prints a second console line with them, and appends every logged step and validation to
``<dump_folder>/<jsonl_file>`` on rank 0 (with pipeline parallelism: on the rank that sees the
loss, plus one ``<stem>.pp<k>.jsonl`` per pipeline rank, whose GIFT state manages that stage's
layers), so scripts and tests read losses and telemetry without scraping logs. It finds the
GIFT state on the model parts (the trainer hands the processor its ``model_parts``), so no
trainer subclass is involved.

Every byte figure is the difference of the state's counters between two logged steps, i.e.
what GIFT's collectives handed over at run time (codes, scales, headers and the unmanaged
parameters that share their buckets), next to what the replaced collectives would have been
handed (``baseline``); ``gift/accounted_bytes_per_backward`` is the shape-based
accounting of the same reduce-scatters (FSDP2: each module's plan as last called; graph_trainer:
the GIFT pass's report of the step it rewrote), which the counted figure must equal. Collectives GIFT does not touch (buckets without a managed weight) are
not counted in those two; ``gift/untouched_bytes_per_step`` is what they handed over (graph_trainer's
buckets without a managed weight: embedding, head; 0 on FSDP2, whose every parameter group is
GIFT's). The two compression figures are `GiftState.compression()`'s on both trainers
(`whole_gradient`): ``gift/network_compression``, the headline, is the bytes an fp32 exchange
over the same node layout would have sent across nodes over the bytes sent across them (absent
when the group sits inside one node: nothing crosses the network), and
``gift/total_compression`` the whole gradient's: fp32 bytes of every gradient collective of the
step over every byte they handed over, inside nodes and across them. Under HSDP those figures are the shard hop's (the reduce-scatter), and the
``gift/replica_*`` keys (:func:`.hsdp.replica_metrics`) are the replica hop's. With expert
parallelism the routed experts' reduce-scatters over their efsdp mesh go on GIFT's codec with
no map, inside those figures (FSDP2: `gift_compile.frameworks.fsdp2.EuclideanReduceScatter`;
graph_trainer: marked by `gift_compile.frameworks.simple_fsdp.mark_outside`, rewritten by the
pass); on the FSDP2 trainer ``gift/experts_err_euclidean_mean`` is their round-trip error at their
format at every logged step (the rows each rank last sent; per parameter as
``gift/err_euclidean/<fqn>``); on graph_trainer ``gift/full_precision_params`` counts those that
stay unmarked (excluded, or refused under ``--gift.unrewritten warn``), in traced reduce-scatters
outside every figure above.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torchtitan.components.metrics import MetricsProcessor, _get_metrics_rank
from torchtitan.tools.logging import logger

from gift_compile.exchange import compiled_bodies
from gift_compile.frameworks import fsdp2, simple_fsdp, table
from gift_compile.runtime.state import GiftState

from .hsdp import replica_metrics

__all__ = ["GiftMetricsProcessor", "gift_metrics", "read_jsonl"]


def gift_metrics(state: GiftState, last: dict[str, Any]) -> dict[str, float]:
    """GIFT's metrics since the snapshot `last` (updated in place: counters, step, refreshes)."""
    totals = state.comm_totals()
    steps = max(state.steps - last.get("steps", 0), 1)
    prev = last.get("totals", {k: 0 for k in totals})
    delta = {k: totals[k] - prev[k] for k in totals}
    out: dict[str, float] = {
        "gift/managed_layers": float(len(state.layers)),
        "gift/selected_layers": float(sum(layer.selected for layer in state.layers.values())),
        "gift/wire_bytes_per_step": delta["wire"] / steps,
        # by where the bytes go: collectives inside a node (a two-level exchange's node stage, or
        # every collective of a group inside one node) and collectives across nodes (the network)
        "gift/node_wire_bytes_per_step": delta["node_wire"] / steps,
        "gift/cross_wire_bytes_per_step": delta["cross_wire"] / steps,
        "gift/baseline_bytes_per_step": delta["baseline"] / steps,
        "gift/cross_baseline_bytes_per_step": delta["cross_baseline"] / steps,
        # the refresh's own traffic (statistics, selection, map broadcasts), apart from the
        # gradients': all of it, and its part between nodes (two levels where the group spans them)
        "gift/refresh_wire_bytes_per_step": delta["refresh_wire"] / steps,
        "gift/refresh_cross_wire_bytes_per_step": delta["refresh_cross_wire"] / steps,
        "gift/collectives_per_step": delta["calls"] / steps,
        "gift/plan_version": float(state.plan_version),
        "gift/selection_changes": float(state.selection_changes),
    }
    # the hooks' codec compilations in this process (one body per item plan and stage: bounded
    # by the model's distinct layer shapes, not its depth or selection history)
    bodies = compiled_bodies.stats()
    out.update({"gift/codec_bodies": float(bodies["bodies"]), "gift/codec_compilations": float(bodies["graphs"]),
                "gift/codec_recompiles": float(bodies["recompiles"]), "gift/codec_bodies_evicted": float(bodies["evicted"])})
    for adapter in table.installed(state):  # what each framework adapter measured itself (FSDP2: comm_s)
        out.update({f"gift/{key}_per_step": value / steps for key, value in adapter.telemetry(state).items()})
    last.update(totals=totals, steps=state.steps)
    if len(state.history) > last.get("refreshes", 0):
        last["refreshes"] = len(state.history)
        record = state.history[-1]
        out["gift/refresh_step"] = float(record.step)
        out["gift/refresh_s"] = record.seconds
        rows = list(record.layers.values())
        # a layer whose probe was zero or non-finite has NaN errors (the refresh warned and kept
        # its path): the means are over the measured layers, and the unmeasured ones are counted
        measured = [r for r in rows if math.isfinite(float(r["err_euclidean"]))
                    and math.isfinite(float(r["err_transformed"]))]
        if rows:
            out["gift/unmeasured_layers"] = float(len(rows) - len(measured))
        if measured:
            out["gift/err_euclidean_mean"] = sum(float(r["err_euclidean"]) for r in measured) / len(measured)
            out["gift/err_transformed_mean"] = sum(float(r["err_transformed"]) for r in measured) / len(measured)
        for fqn, row in record.layers.items():
            out[f"gift/err_euclidean/{fqn}"] = float(row["err_euclidean"])
            out[f"gift/err_transformed/{fqn}"] = float(row["err_transformed"])
            out[f"gift/selected/{fqn}"] = float(row["selected"])
    out.update(_experts_metrics(state, last))
    return out


def _experts_metrics(state: GiftState, last: dict[str, Any]) -> dict[str, float]:
    """The routed experts' layers (the states the main one drives, `GiftState.substates`): how
    many there are and are on their maps, and at each of their refreshes the mean errors measured
    on their probes on either path."""
    subs = state.substates
    if not subs:
        return {}
    out = {"gift/experts_layers": float(sum(len(s.layers) for s in subs)),
           "gift/experts_selected_layers": float(sum(l.selected for s in subs for l in s.layers.values()))}
    refreshes = sum(len(s.history) for s in subs)
    if refreshes > last.get("experts_refreshes", 0):
        last["experts_refreshes"] = refreshes
        rows = [r for s in subs if s.history for r in s.history[-1].layers.values()
                if math.isfinite(float(r["err_euclidean"])) and math.isfinite(float(r["err_transformed"]))]
        if rows:
            out["gift/experts_err_euclidean_mean"] = sum(float(r["err_euclidean"]) for r in rows) / len(rows)
            out["gift/experts_err_transformed_mean"] = sum(float(r["err_transformed"]) for r in rows) / len(rows)
    return out


class GiftMetricsProcessor(MetricsProcessor):
    """``MetricsProcessor`` that also logs GIFT's counters and writes a JSONL record."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        jsonl_file: str = "gift_metrics.jsonl"
        """File under dump_folder for one JSON record per logged step (rank 0); "" disables."""

    def __init__(self, config: Config, *, dump_folder: str = "./outputs", **kwargs: Any) -> None:
        super().__init__(config, dump_folder=dump_folder, **kwargs)
        self._gift_last: dict[str, Any] = {}
        self._jsonl_paths = _jsonl_paths(config.jsonl_file, dump_folder, kwargs.get("parallel_dims"),
                                         kwargs.get("pp_schedule", "1F1B"))
        for path in self._jsonl_paths:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

    def _gift_state(self) -> GiftState | None:
        parts = getattr(self, "model_parts", None) or []
        return next((m._gift_state for m in parts if getattr(m, "_gift_state", None) is not None), None)

    def _write(self, record: dict[str, Any]) -> None:
        for path in self._jsonl_paths:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"time": time.time(), **record}) + "\n")

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        extra = dict(extra_metrics or {})
        state = self._gift_state()
        steps = max(state.steps - self._gift_last.get("steps", 0), 1) if state is not None else 1
        gift = gift_metrics(state, self._gift_last) if state is not None else {}
        if state is not None:  # HSDP: the replica hop's own figures (the ones above are the shard hop's)
            gift.update(replica_metrics(state, self.model_parts, self._gift_last, steps, self.config.log_freq))
            accounted = fsdp2.accounted_bytes(self.model_parts)
            if accounted is None:  # graph_trainer: the pass's accounting of the step it rewrote
                accounted = _graph_accounted_bytes()
            if accounted is not None:  # what the wire counter should grow by per backward
                gift["gift/accounted_bytes_per_backward"] = float(accounted)
            gift.update(whole_gradient(gift, _graph_untouched_bytes(), state.layout.spans_nodes))
            # expert parallelism on the FSDP2 trainer: the routed experts' round-trip error at their format
            experts = {k: v for k, v in fsdp2.euclidean_errors(self.model_parts).items() if math.isfinite(v)}
            if experts:
                gift["gift/experts_err_euclidean_mean"] = sum(experts.values()) / len(experts)
                gift.update({f"gift/err_euclidean/{fqn}": err for fqn, err in experts.items()})
            # expert parallelism on graph_trainer: routed experts left unmarked (excluded, or refused
            # under "warn") reduce-scatter outside GIFT, in traced collectives over the efsdp mesh
            outside = simple_fsdp.full_precision_params(state)
            if outside:
                gift["gift/full_precision_params"] = float(outside)
        extra.update(gift)
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)
        # Per-layer entries (gift/<metric>/<layer>) go to the loggers and the JSONL only.
        summary = {k.removeprefix("gift/"): v for k, v in gift.items() if k.count("/") == 1}
        if summary:
            logger.info("gift step %d: %s", step, "  ".join(f"{k}={_fmt(v)}" for k, v in summary.items()))
        self._write({"step": step, "loss": global_avg_loss, "max_loss": global_max_loss, "grad_norm": grad_norm, **extra})

    def log_validation(self, loss: float, step: int, extra_metrics: dict[str, Any] | None = None) -> None:
        super().log_validation(loss, step, extra_metrics=extra_metrics)
        self._write({"step": step, "validation_loss": loss, **(extra_metrics or {})})


def whole_gradient(gift: dict[str, float], untouched: tuple[int, int] | None,
                   spans_nodes: bool = False) -> dict[str, float]:
    """The two compression figures, one definition on both trainers (`GiftState.compression()`'s):
    ``gift/total_compression``, the whole gradient's bytes in fp32 over the bytes every gradient
    collective of the step handed over, GIFT's and those left as they were, inside nodes and
    across them; and, where bytes crossed nodes, ``gift/network_compression``, the headline:
    what an fp32 exchange over the same node layout would have sent across nodes over what was
    sent across them. FSDP2 puts every parameter group on GIFT's reduce-scatter (nothing is
    left); graph_trainer leaves the buckets without a managed weight (embedding, head) as traced,
    so `untouched` = (their bytes per run of the step's graph, GIFT collectives per run), and the
    runs per step are GIFT's collectives per step over the latter; they run in one level over
    the group, so they cross nodes at full size where the group spans nodes (`spans_nodes`).
    Also ``gift/untouched_bytes_per_step``: what those collectives handed over."""
    per_step = 0.0
    if untouched is not None and untouched[1]:
        per_step = untouched[0] * gift["gift/collectives_per_step"] / untouched[1]
    wire = gift["gift/wire_bytes_per_step"] + per_step
    out = {"gift/untouched_bytes_per_step": per_step,
           "gift/total_compression": (gift["gift/baseline_bytes_per_step"] + per_step) / wire if wire else float("nan")}
    crossing = per_step if spans_nodes else 0.0
    cross = gift.get("gift/cross_wire_bytes_per_step", 0.0) + crossing
    if cross:
        out["gift/network_compression"] = (gift.get("gift/cross_baseline_bytes_per_step", 0.0) + crossing) / cross
    return out


def _graph_untouched_bytes() -> tuple[int, int] | None:
    """graph_trainer: (bytes of the data-parallel gradient collectives the GIFT pass left as
    they were, GIFT collectives) per run of the last graph it rewrote; None without one."""
    from gift_compile.passes import last_reports

    report = next((r for r in reversed(last_reports()) if r.rewritten), None)
    return None if report is None else (report.untouched_bytes, len(report.rewritten))


def _graph_accounted_bytes() -> int | None:
    """graph_trainer: the (shard hop's) shape-based bytes per backward of the last graph the
    GIFT pass rewrote (the traced training step); None when no graph was rewritten."""
    from gift_compile.passes import last_reports

    report = next((r for r in reversed(last_reports()) if r.rewritten), None)
    return None if report is None else report.wire_bytes


def _jsonl_paths(name: str, dump_folder: str, parallel_dims: Any, pp_schedule: str) -> list[str]:
    """Where this rank writes its records: ``<dump_folder>/<name>`` on the rank that sees the
    loss (rank 0, or under pipeline parallelism torchtitan's metrics rank, the last stage's
    first rank), and under pipeline parallelism also ``<stem>.pp<k>.jsonl`` on the first rank
    of each pipeline rank k's data-parallel group: each stage's GIFT state manages its own
    layers, and only the last stage's loss is real (the others log torchtitan's -2)."""
    if not name:
        return []
    if not dist.is_initialized():
        return [os.path.join(dump_folder, name)]
    rank = dist.get_rank()
    if parallel_dims is None or not parallel_dims.pp_enabled:
        return [os.path.join(dump_folder, name)] if rank == 0 else []
    paths = [os.path.join(dump_folder, name)] if rank == _get_metrics_rank(parallel_dims=parallel_dims,
                                                                          pp_schedule=pp_schedule) else []
    per_stage = parallel_dims.world_size // parallel_dims.pp  # pp is torchtitan's outermost mesh dimension
    if rank % per_stage == 0:
        stem, ext = os.path.splitext(name)
        paths.append(os.path.join(dump_folder, f"{stem}.pp{rank // per_stage}{ext}"))
    return paths


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Records of a ``gift_metrics.jsonl`` file, in file order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
