"""What one `apply` did, said once: `ApplyReport` and `summarize`.

A GIFT that manages nothing, maps nothing or ignores a glob behaves exactly like plain low-bit
or fp32 communication: training runs, and nothing shows that the config did not do what its
author meant. So `apply` (and the torchtitan hook) build this report from the state it
installed and the model's linear weights, keep it on the state (`gift_compile.report(model)`)
and log it at WARNING on rank 0: the adapter, the format, the geometry and metric as "auto"
resolved them, the layers managed and selected, the linear weights without a layer, what
travels how (per class of gradient: format and bytes per step),
every glob (`select`, `exclude`, `layer_formats`) that matched no weight, and which exchange each
gradient path runs (one level, or two levels across nodes: on a cluster not every path does).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import math

import torch
import torch.distributed as dist

from gift_compile.config import GiftConfig, SelectRule, is_tiny
from gift_compile.exchange.accounting import bucket_wire_bytes
from gift_compile.exchange.plan import BucketPlan, ItemPlan
from gift_compile.runtime.refresh import next_refresh, refresh_words
from gift_compile.runtime.state import GiftState

__all__ = ["HEADER", "ApplyReport", "current", "log_report", "summarize", "traffic", "unmatched_globs"]

logger = logging.getLogger("gift_compile")


# The first line of the report as `log_report` prints it: the summary every successful `apply` logs at
# WARNING on rank 0 (so that the default log level shows it), which log readers tell from a warning of trouble.
HEADER = "GIFT applied ("


@dataclasses.dataclass(frozen=True)
class ApplyReport:
    """What `apply` installed on one rank's model (identical on every rank of the group)."""

    path: str
    """How the managed gradients travel (the adapter's `kind`)."""
    world: int
    format: str
    geometry: str
    """As resolved: never "auto"."""
    select: str
    select_metric: str
    managed: tuple[str, ...]
    selected: tuple[str, ...] | None
    """The layers taking the mapped path, or None while a measured selection is open (decided at
    the first refresh, `first_refresh`)."""
    first_refresh: int
    full_precision: tuple[str, ...]
    """Linear weights GIFT does not manage (excluded, under `min_numel`, rows that do not split)."""
    unmatched: tuple[str, ...]
    """`"<field>: <glob>"` for each glob that matched no weight."""
    exchanges: tuple[str, ...] = ()
    """One line per gradient path: which exchange it runs (one level, or two levels across
    nodes: `gift_compile.frameworks.exchanges`)."""
    step: int = 0
    """Optimizer steps taken when the report was made (0: at `apply`)."""
    last_refresh: str | None = None
    """What the last refresh left (`refresh.refresh_words`: layers mapped, the next refresh),
    None before the first."""
    next_refresh: int = 0
    """The optimizer step of the next refresh."""
    fused: bool = True
    """`apply(fuse=...)`: the framework hooks run GIFT's codec through compiled bodies."""
    compression: dict[str, float | None] | None = None
    """`GiftState.compression()` when the report was made (None until something was sent)."""
    traffic: tuple[str, ...] = ()
    """What travels how: one line per class of gradient (`traffic`): its count, format(s) and
    bytes per step on this rank."""

    def lines(self) -> list[str]:
        """The report as the log prints it."""
        out = [f"{HEADER}{self.path}, {self.world} ranks): format={self.format}, geometry={self.geometry}, "
               f"select={self.select}, select_metric={self.select_metric}",
               f"  managed ({len(self.managed)}): {_names(self.managed)}"]
        if not self.managed:
            out.append("  NOTHING IS MANAGED: every gradient travels at full precision (no eligible nn.Linear "
                       "weight: see min_numel and exclude)")
        if self.selected is None:
            out.append(f"  mapped: decided by the measured selection at the first refresh (optimizer step "
                       f"{self.first_refresh}; now after step {self.step}); until then every managed layer is "
                       "plain low-bit")
        else:
            out.append(f"  mapped ({len(self.selected)} of {len(self.managed)}): {_names(self.selected)}")
        if self.managed and self.step == 0:
            hooks = (f"with fuse=True the DDP/FSDP2 hooks compile GIFT's codec at the first step and its mapped path "
                     f"at the step after the first refresh (step {self.first_refresh}), logged when it starts; "
                     if self.fused else "")
            out.append(f"  one-time stalls (a minute or two each on a CPU): {hooks}a torch.compile'd model compiles "
                       "GIFT's pass with it")
        if self.last_refresh is not None:
            out.append(f"  last refresh: {self.last_refresh}")
        elif self.selected is not None and self.managed:
            out.append(f"  first refresh (maps built) at optimizer step {self.next_refresh}; now after step {self.step}")
        if self.full_precision:
            out.append(f"  linear weights without a layer ({len(self.full_precision)}): "
                       f"{_names(self.full_precision)}")
        out.extend(f"  {line}" for line in self.traffic)
        out.extend(f"  {entry} matched no weight" for entry in self.unmatched)
        out.extend(f"  exchange of the {line}" for line in self.exchanges)
        c = self.compression
        if c is not None:
            if c["network"] is None:
                out.append(f"  bytes so far: inside one node, nothing crossed a network; {c['total']:.2f}x fewer than "
                           "fp32 in total")
            else:
                out.append(f"  bytes so far: {c['network']:.2f}x fewer across nodes (the network) than an fp32 exchange "
                           f"over the same layout; in total, inside nodes and across, {c['total']:.2f}x fewer than fp32")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _names(names: tuple[str, ...], shown: int = 8) -> str:
    if not names:
        return "none"
    more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def unmatched_globs(config: GiftConfig, managed: list[str], linear_weights: list[str]) -> list[str]:
    """`"<field>: <glob>"` of each glob of `config` that matches none of the names it is meant
    for: `select` and `layer_formats` globs against the managed layers, `exclude` globs against
    every linear weight of the model (what they are matched against at `manage`; the default
    `exclude` globs are left out: they name what a model may have)."""
    out = []
    defaults = GiftConfig.__dataclass_fields__["exclude"].default
    if isinstance(config.select, tuple):
        out += [f"select: {g!r}" for g in config.select if not any(fnmatch.fnmatch(n, g) for n in managed)]
    out += [f"exclude: {g!r}" for g in config.exclude
            if g not in defaults and not any(fnmatch.fnmatch(n, g) for n in linear_weights)]
    for entry in config.layer_formats:
        glob = entry.partition("=")[0]
        if not any(fnmatch.fnmatch(n, glob) for n in managed):
            out.append(f"layer_formats: {entry!r}")
    return out


def current(report: ApplyReport, state: GiftState) -> ApplyReport:
    """`report` (what `apply` installed) brought up to `state` now: the layers mapped, the
    last refresh's outcome and the next refresh's step (`gift_compile.report`)."""
    decided = all(layer.decided for layer in state.layers.values())
    selected = tuple(n for n, layer in state.layers.items() if layer.selected) if decided else None
    sent = state.compression()
    last = (f"optimizer step {state.history[-1].step}: "
            f"{refresh_words(state.config, state.layers, state.history[-1].step, shown=0)}") if state.history else None
    return dataclasses.replace(report, selected=selected, step=state.steps, last_refresh=last,
                               next_refresh=next_refresh(state.config, state.steps),
                               compression=None if math.isnan(sent["total"]) else sent,
                               traffic=tuple(traffic(state)))


def _item_bytes(plan: ItemPlan, state: GiftState) -> int:
    """Bytes one rank hands to the state's collective for `plan` once (the bucket's header left out)."""
    world, op = state.world(), state.collective
    if world <= 1:
        return 0
    twice = (plan, dataclasses.replace(plan, name=f"{plan.name} (again)"))  # the marginal item: no header
    return (bucket_wire_bytes(BucketPlan(twice, world, None, False, op, state.layout))
            - bucket_wire_bytes(BucketPlan(twice[:1], world, None, False, op, state.layout)))


def traffic(state: GiftState) -> list[str]:
    """What travels how, per class of gradient: GIFT's mapped layers, its layers and the
    parameters outside them in plain low-bit coordinates, the embedding and head (those
    `exclude` matches), tiny tensors (`GiftConfig.tiny_format`) and what goes raw at full
    precision (the opt-outs). Each with its count, format(s) and bytes one rank hands to the
    collectives per step (`_item_bytes`, the accounting of the bucket exchange: codes, scales,
    padding; an fp32 gradient assumed for raw items). The outside parameters are those a hook
    sends in its buckets (`GiftState.outside_items`); a path whose framework sends them itself
    (a traced SimpleFSDP graph) has none, and says so by their absence."""
    config = state.config
    classes: dict[str, list[tuple[str, int]]] = {}  # label -> [(format, bytes)]

    def add(label: str, fmt: str, nbytes: int) -> None:
        classes.setdefault(label, []).append((fmt, nbytes))

    for name, layer in state.layers.items():
        plan = state.layer_plan(name).items[0]
        label = ("GIFT's layers, map decided at the first refresh" if not layer.decided
                 else "mapped layers" if layer.selected and not state.geometry.is_identity
                 else "GIFT's layers in plain coordinates")
        add(label, plan.format, _item_bytes(plan, state))
    for name, (plan, shape) in state.outside_items.items():
        if plan is None:
            add("full precision (opt-out)", "fp32",
                _item_bytes(ItemPlan.passthrough(name, math.prod(shape), torch.float32), state))
        elif is_tiny(shape, config.min_numel):
            add("tiny tensors (norms, biases)", plan.format, _item_bytes(plan, state))
        elif plan.cols == 1 and shape[-1] != 1:  # `euclidean_plan`'s logged fallback
            add("at tiny_format (codes would not pay, or rows do not split)", plan.format, _item_bytes(plan, state))
        elif config.is_excluded(name):
            add("embedding/head (exclude)", plan.format, _item_bytes(plan, state))
        else:
            add("other parameters in plain coordinates", plan.format, _item_bytes(plan, state))
    return [f"{label} ({len(rows)}): {'/'.join(sorted({f for f, _ in rows}))}, {sum(b for _, b in rows):,} bytes "
            "per step" for label, rows in classes.items()]


def summarize(state: GiftState, path: str, linear_weights: list[str], exchanges: tuple[str, ...] = ()) -> ApplyReport:
    """The report of `state`, which manages some of `linear_weights` (every `nn.Linear` weight
    FQN of the model, as `manage` names them) and sends them as `path` says, over the
    `exchanges` its paths run (`gift_compile.frameworks.exchanges.describe_exchanges`)."""
    config = state.config
    managed = tuple(state.layers)
    decided = all(layer.decided for layer in state.layers.values())
    selected = tuple(n for n, layer in state.layers.items() if layer.selected) if decided else None
    first = next_refresh(config, 0)
    select = config.select if isinstance(config.select, (SelectRule, str)) else ",".join(config.select)
    return ApplyReport(
        path=path, world=state.world(), format=config.format, geometry=config.geometry, select=str(select),
        select_metric=str(config.select_metric), managed=managed, selected=selected, first_refresh=first,
        full_precision=tuple(n for n in linear_weights if n not in state.layers),
        unmatched=tuple(unmatched_globs(config, list(managed), linear_weights)), exchanges=exchanges,
        step=state.steps, next_refresh=first, traffic=tuple(traffic(state)))


def log_report(report: ApplyReport) -> None:
    """The report at WARNING on the job's rank 0 (every rank holds the same one)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning("%s", report)
