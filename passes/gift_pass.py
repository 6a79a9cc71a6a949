"""Rewrite gradient collectives of GIFT-managed weights into GIFT's bucketed collective.

A pure function of the graph: every managed weight's gradient carries a `gift::mark` node whose
arguments are its state tensors and its static plan (`gift_compile.exchange.plan.ItemPlan`, as text), so
nothing outside the graph is consulted.

`find_gradient_collectives` (`gift_compile.passes.matching`) returns one `BucketMatch` per
functional `reduce_scatter_tensor` / `all_reduce` (with its `wait_tensor`) that carries at
least one marked gradient, either directly (through views and casts) or as an entry of a bucket
built by Inductor's `bucketing::_pre_bucket_reduce_scatter` (torchtitan's graph_trainer buckets
each transformer block's reduce-scatters into one). Every other collective (tensor/sequence
parallel, forward all-gathers, buckets of unmanaged parameters) is left alone.

`rewrite_bucket` replaces a match by `gift_compile.exchange.collectives`: the encode side and the
all_to_all (`launch`) where the framework launched its collective, the decode side
(`finish`, and for an all-reduce the all_gather stage) where it waited, so whatever overlap a
scheduler arranged is kept and the collective count does not grow for reduce-scatters. Entries
of a bucket without a mark travel at full precision inside the same all_to_all. Each new node
gets the replaced collective's metadata (`autograd_backward`, module FQN, stack trace, ...).

HSDP (hybrid sharding: replicas x shards). SimpleFSDP traces, per gradient, an unbucketed
`all_reduce` of the FULL gradient over the replica group and then feeds its result to the
block's bucketed reduce-scatter over the shard group. The pass swaps the pair (a sum is linear:
exact in fp32): each bucket entry's replica all-reduce is dropped, the reduce-scatter over the
shard group runs first on the local gradients (GIFT at the item's `format`), and GIFT's
all-reduce of the reduced shard over the replica group follows it (at the plan's
`replica_format`, no error feedback: the residual belongs to the shard hop), one bucket per
reduce-scatter bucket. A managed weight's shard is whole rows, so its input-side transform
applies unchanged. The replica hop counts its bytes in its own counters, which the marks carry
(`gift_compile.exchange.mark.unpack_replica_shared`), and `RewriteRecord` accounts them separately.
Where a marked gradient's shard group has one rank (torchtitan's routed experts on a one-rank
efsdp mesh under EP x HSDP) SimpleFSDP traces no reduce-scatter: its replica all-reduce is the
gradient's only collective, and the pass makes it the replica hop alone, GIFT's all-reduce at
the plan's `replica_format` on the hop's rank and counters (`replica_only` records).

GIFT's own sync (a plain module's managed layers, `ItemPlan.own_sync`): no framework decides
which of these collectives a graph runs, so a rank that ran other managed layers in a step
has a graph with other buckets. Before the group's first such bucket the pass puts one
`gift::agree_plans` (`gift_compile.exchange.agreement`), filled in with the fingerprint and
description of all of the graph's buckets on the group once they are rewritten: every rank
raises there, before any exchange, when the ranks' graphs differ (`_agree_first`).

A marked gradient that cannot be rewritten raises (or, where its plan says
`unrewritten="warn"`, is logged and sent at full precision): never a silent fp32 fallback.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from gift_compile.config import ReduceOp, Unrewritten
from gift_compile.exchange.agreement import graph_plans
from gift_compile.exchange.collectives import (
    ItemTensors, Shared, bucket_core, bucket_wire_bytes, finish, gather_finish, gather_launch, launch,
)
from gift_compile.exchange.mark import split_mark_tensors, unpack_item_tensors, unpack_replica_shared
from gift_compile.exchange.plan import BucketPlan, Collective, ItemPlan, replica_hop_plan
from gift_compile.exchange.topology import FLAT, NodeLayout, node_layout

logger = logging.getLogger("gift_compile")

_c10d = torch.ops._c10d_functional
from gift_compile.passes.inductor_internals import splice
from gift_compile.passes.matching import (
    _META_KEYS, BucketMatch, GiftRewriteError, _group_size, _is_mark, _why_not, count_ops, find_gradient_collectives,
    launches_by_group, untouched_gradient_bytes,
)

@dataclass
class RewriteRecord:
    """One rewritten collective: its items and the bytes per call (shape-based accounting;
    the runtime counters count what is really handed over)."""

    op: str
    group: str  # the process group (name) of the collective it replaced, which GIFT's runs over
    layers: list[str]
    passthrough: int
    wire_bytes: int
    baseline_bytes: int
    # HSDP: the replica hop's all-reduce of the reduced shard (0 without one); its baseline is
    # an fp32 all-reduce of that shard (SimpleFSDP's own order all-reduced the full gradient,
    # shards x more)
    replica_wire_bytes: int = 0
    replica_baseline_bytes: int = 0
    # the replica hop alone (its gradients' shard group has one rank): this record's bytes are
    # all the replica hop's, whose baseline is then the fp32 all-reduce it replaced
    replica_only: bool = False
    # the bucket's plan (its exchange's, the replica hop's when `replica_only`): a graph of
    # GIFT's own sync agrees on these across ranks before its first exchange (`_agree_first`)
    plan: BucketPlan | None = field(default=None, repr=False, compare=False)


@dataclass
class RewriteReport:
    """What one run of the pass did to one graph."""

    rewritten: list[RewriteRecord] = field(default_factory=list)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    ops_before: dict[str, int] = field(default_factory=dict)
    ops_after: dict[str, int] = field(default_factory=dict)
    # collective launches per (process group name, "forward" / "backward"), before and after
    groups_before: dict[tuple[str, str], int] = field(default_factory=dict)
    groups_after: dict[tuple[str, str], int] = field(default_factory=dict)
    # per run of the graph: bytes of the data-parallel gradient collectives left as they were
    # (`matching.untouched_gradient_bytes`), the rest of the whole gradient's bytes
    untouched_bytes: int = 0

    @property
    def layers(self) -> list[str]:
        return [name for r in self.rewritten for name in r.layers]

    @property
    def wire_bytes(self) -> int:
        return sum(r.wire_bytes for r in self.rewritten)

    @property
    def baseline_bytes(self) -> int:
        return sum(r.baseline_bytes for r in self.rewritten)

    def rewritten_over(self, group_name: str) -> tuple[int, int]:
        """(collectives, managed weights) the pass rewrote over `group_name` (under expert
        parallelism the routed experts' efsdp reduce-scatters, told apart from the dense ones)."""
        records = [r for r in self.rewritten if r.group == group_name]
        return len(records), sum(len(r.layers) for r in records)

    @property
    def replica_hops(self) -> int:
        """Replica all-reduces GIFT put into the graph (HSDP; one per rewritten bucket, after
        its reduce-scatter, or alone: `sole_replica_hops`)."""
        return sum(r.replica_wire_bytes > 0 for r in self.rewritten)

    @property
    def sole_replica_hops(self) -> int:
        """Of `replica_hops`, those that are their gradients' only collective (`replica_only`)."""
        return sum(r.replica_only for r in self.rewritten)

    @property
    def replica_wire_bytes(self) -> int:
        return sum(r.replica_wire_bytes for r in self.rewritten)

    @property
    def replica_baseline_bytes(self) -> int:
        return sum(r.replica_baseline_bytes for r in self.rewritten)

    def group_launches(self, group_name: str) -> dict[str, tuple[int, int]]:
        """Launches over `group_name` per phase, (before, after) the rewrite: for a group the
        pass must leave alone (tensor parallelism's) the two are equal."""
        return {phase: (self.groups_before.get((group_name, phase), 0), self.groups_after.get((group_name, phase), 0))
                for phase in ("forward", "backward")}

    def launches(self, ops: dict[str, int]) -> int:
        """Collective launches in a graph's op counts (every `_c10d_functional` op but waits)."""
        return sum(n for k, n in ops.items() if "_c10d_functional" in k and "wait_tensor" not in k)


def rewrite_bucket(graph: fx.Graph, match: BucketMatch) -> RewriteRecord:
    """Replace one matched collective (+ its wait, and its bucket op) by GIFT's collective."""
    items: list[ItemPlan] = []
    layouts: list[tuple[int, int]] = []  # (first index of the item's state in `state_nodes`, count)
    state_nodes: list[fx.Node] = []
    shared_nodes: list[fx.Node] | None = None
    for x, m in zip(match.inputs, match.marks):
        val = x.meta["val"]
        if m is None:
            items.append(ItemPlan.passthrough(x.name, val.numel(), val.dtype))
            layouts.append((0, 0))
            continue
        plan = ItemPlan.from_str(m.args[2]).with_dtype(val.dtype)
        items.append(plan)
        # the replica hop's rank and counters are read by `_splice_replica_hop`
        own, shared, _ = split_mark_tensors(plan, list(m.args[1]))
        layouts.append((len(state_nodes), len(own)))
        state_nodes.extend(own)
        if shared_nodes is None:
            shared_nodes = shared  # seed, rank, counters: one set per GiftState
    assert shared_nodes is not None
    average = match.reduce_op is ReduceOp.AVG
    sole = _sole_replica_hop(match)
    if sole is None:
        plan = BucketPlan(tuple(items), match.group_size, match.group_name, average, match.op, _layout(match, items))
    else:  # HSDP's replica hop alone: at its format, on its rank and counters (see the module docstring)
        plan = replica_hop_plan(items, sole, match.group_size, match.group_name, average)
        first = next(m for m in match.marks if m is not None)
        shared_nodes = list(unpack_replica_shared(ItemPlan.from_str(first.args[2]), list(first.args[1])))
    n_x = len(match.inputs)
    out_val = match.wait.meta["val"]

    def unpack(args: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], list[ItemTensors | None], Shared]:
        xs, rest = list(args[:n_x]), args[n_x:]
        state, shared = rest[:len(state_nodes)], Shared(*rest[len(state_nodes):])
        per_item: list[ItemTensors | None] = []
        for item, sent, (start, count) in zip(items, plan.items, layouts):
            if not sent.managed:  # raw: unmarked, or the replica hop's lossless format
                per_item.append(None)
                continue
            it = unpack_item_tensors(item, list(state[start:start + count]))
            # the replica hop alone: the item's map and seed, no residual, no probe
            per_item.append(it if sole is None else ItemTensors(it.transform, None, None, it.seed_offset))
        return xs, per_item, shared

    def launch_fn(*args: torch.Tensor) -> torch.Tensor:
        xs, per_item, shared = unpack(args)
        return launch(xs, per_item, shared, plan)

    def finish_fn(recv: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        _, per_item, shared = unpack((*[None] * n_x, *args))
        if match.op is Collective.REDUCE_SCATTER:
            outs = finish(recv, per_item, shared, plan)
            flat = torch.cat([o.reshape(-1) for o in outs])
            return flat.to(out_val.dtype).reshape(out_val.shape)
        shards = finish(recv, per_item, shared, plan, transformed=True)
        gathered = _c10d.wait_tensor(gather_launch(shards, per_item, shared, plan))
        (full,) = gather_finish(gathered, per_item, plan, shared=shared)
        return full.to(out_val.dtype).reshape(out_val.shape)

    meta = {k: match.collective.meta[k] for k in _META_KEYS if k in match.collective.meta}
    for ar, ar_wait in match.replica_reductions:  # HSDP: the shard hop goes first (see the module docstring)
        ar_wait.replace_all_uses_with(ar.args[0])
        graph.erase_node(ar_wait)
        graph.erase_node(ar)
    launched = splice(graph, launch_fn, [*match.inputs, *state_nodes, *shared_nodes], match.collective, meta)
    with graph.inserting_before(match.wait):
        recv = graph.call_function(_c10d.wait_tensor.default, (launched,))
        recv.meta.update(copy.deepcopy(meta))
        recv.meta["val"] = launched.meta["val"]
    result = splice(graph, finish_fn, [recv, *state_nodes, *shared_nodes], match.wait, meta)
    replica_plan = None
    if match.replica_reductions:
        replica_plan = _replica_plan(match, items)
        result = _splice_replica_hop(graph, match, replica_plan, items, layouts, result, state_nodes, meta)
    match.wait.replace_all_uses_with(result)
    graph.erase_node(match.wait)
    graph.erase_node(match.collective)
    if match.pre_bucket is not None and not match.pre_bucket.users:
        graph.erase_node(match.pre_bucket)
    baseline = sum(x.meta["val"].numel() * x.meta["val"].element_size() for x in match.inputs)
    layers = [i.name for i in items if i.managed]
    if sole is not None:  # the replica hop's bytes, counted in its counters
        return RewriteRecord(match.op, match.group_name, layers, sum(not i.managed for i in items), 0, 0,
                             bucket_wire_bytes(plan), baseline, replica_only=True, plan=plan)
    record = RewriteRecord(match.op, match.group_name, layers, sum(not i.managed for i in items),
                           bucket_wire_bytes(plan), baseline, plan=plan)
    if replica_plan is not None:
        record.replica_wire_bytes = bucket_wire_bytes(replica_plan)
        record.replica_baseline_bytes = baseline // match.group_size
    return record


def _agree_first(graph: fx.Graph, match: BucketMatch,
                 agreements: dict[str, tuple[fx.Node, list[BucketPlan]]]) -> list[BucketPlan] | None:
    """For a bucket of GIFT's own sync (`ItemPlan.own_sync`): the list its plan joins, of the
    graph's agreement over the bucket's group (`agreement.agree_plans`), which is put before
    the group's first such bucket when this is it (its fingerprint and description are filled
    in once every bucket is rewritten). None for a framework's bucket: the framework decides
    its graph's collectives, GIFT only re-encodes them, and a host read there would stall a
    GPU backward that GIFT's own path already reads the host in.

    The agreement precedes the exchanges in the graph's order and by its declared mutation of
    the counters, which every launch updates after it; Inductor's default scheduling keeps
    each collective after it (the tests' compiled graphs raise before any exchange). A
    scheduler that hoists collectives (Inductor's `reorder_for_compute_comm_overlap`) could
    move one above it, since a launch's send buffer does not read the counters: not covered."""
    plans = [p for p in match.plans() if p is not None]
    if not any(p.own_sync for p in plans):
        return None
    if match.group_name not in agreements:
        first = next(m for m in match.marks if m is not None)
        _, (_, _, counters), _ = split_mark_tensors(plans[0], list(first.args[1]))
        with graph.inserting_before(match.collective):
            node = graph.call_function(torch.ops.gift.agree_plans.default, (counters, match.group_name, 0, ""))
        node.meta.update({k: match.collective.meta[k] for k in _META_KEYS if k in match.collective.meta})
        agreements[match.group_name] = (node, [])
    return agreements[match.group_name][1]


def _layout(match: BucketMatch, items: list[ItemPlan]) -> NodeLayout:
    """The node layout of the bucket's group under its managed items' `ranks_per_node` and
    `intra_node_format` (the config's, carried by each mark), as the eager hooks resolve it
    (`topology.node_layout`): two levels where the group spans nodes. Its subgroups are made
    here, at the rewrite, which every rank of the group runs at the same point of its
    compilation."""
    settings = {(item.ranks_per_node, item.intra_node_format) for item in items if item.managed}
    if len(settings) != 1:
        raise GiftRewriteError(f"GIFT pass: the managed gradients of one bucket carry (ranks_per_node, "
                               f"intra_node_format) {sorted(settings, key=str)}; one bucket runs on one node layout")
    per_node, node_format = settings.pop()
    return node_layout(match.group_name, per_node, node_format) if match.group_size > 1 else FLAT


def _sole_replica_hop(match: BucketMatch) -> str | None:
    """The replica format when `match` is HSDP's replica hop alone (an all-reduce of gradients
    whose plans have a replica hop, feeding no shard reduce-scatter: their shard group has one
    rank), else None; `_why_not` has checked that every marked gradient's plan agrees."""
    if match.op is not Collective.ALL_REDUCE:
        return None
    return next((p.replica_format for p in match.plans() if p is not None and p.replica_format), None)


def _replica_plan(match: BucketMatch, items: list[ItemPlan]) -> BucketPlan:
    """The replica hop's bucket (`replica_hop_plan`) over each entry's row shard, what the
    shard hop left on this rank, at the managed items' `replica_format`."""
    shard = match.group_size
    formats = {item.replica_format for item in items if item.managed}
    if len(formats) != 1:
        raise GiftRewriteError(f"GIFT pass: the managed gradients of one bucket carry replica formats {sorted(formats)}; "
                               "one replica hop runs one format")
    shards = [dataclasses.replace(item, rows=item.rows // shard) if item.managed
              else ItemPlan.passthrough(item.name, item.numel // shard, item.torch_dtype) for item in items]
    return replica_hop_plan(shards, formats.pop(), _group_size(match.replica_group), match.replica_group,
                            match.replica_op is ReduceOp.AVG)


def _splice_replica_hop(graph: fx.Graph, match: BucketMatch, plan: BucketPlan, items: list[ItemPlan],
                        layouts: list[tuple[int, int]], shard: fx.Node, state_nodes: list[fx.Node],
                        meta: dict[str, Any]) -> fx.Node:
    """GIFT's all-reduce of the flat reduced shard `shard` over the replica group, spliced where
    the shard hop's result is (before the replaced wait): returns the node of the result, in
    `shard`'s shape. Transforms and seed offsets are the items' own; no residual, no probe."""
    first = next(m for m in match.marks if m is not None)
    replica_nodes = list(unpack_replica_shared(ItemPlan.from_str(first.args[2]), list(first.args[1])))
    out_val = shard.meta["val"]
    sizes = [i.numel for i in plan.items]

    def hop_fn(flat: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        state, shared = args[:len(state_nodes)], Shared(*args[len(state_nodes):])
        xs: list[torch.Tensor] = []
        per_item: list[ItemTensors | None] = []
        offset = 0
        for item, hop_item, (start, count), n in zip(items, plan.items, layouts, sizes):
            piece = flat.reshape(-1)[offset:offset + n]
            offset += n
            if not item.managed:
                xs.append(piece)
                per_item.append(None)
                continue
            it = unpack_item_tensors(item, list(state[start:start + count]))
            xs.append(piece.reshape(hop_item.rows, hop_item.cols) if hop_item.managed else piece)
            per_item.append(ItemTensors(it.transform, None, None, it.seed_offset) if hop_item.managed else None)
        outs, _ = bucket_core(xs, per_item, shared, plan)
        return torch.cat([o.reshape(-1) for o in outs]).to(out_val.dtype).reshape(out_val.shape)

    return splice(graph, hop_fn, [shard, *state_nodes, *replica_nodes], match.wait, meta)


def _fallback(report: RewriteReport, plans: list[ItemPlan], reason: str) -> None:
    """A marked gradient that stays at full precision: raise, or log where its plan allows."""
    for plan in plans:
        report.fallbacks.append((plan.name, reason))
    strict = [p.name for p in plans if p.unrewritten is Unrewritten.ERROR]
    if strict:
        raise GiftRewriteError(
            f"GIFT pass cannot rewrite the gradient collective of {strict}: {reason}. It would travel at full "
            "precision; set GiftConfig(unrewritten='warn') to allow that."
        )
    for plan in plans:
        logger.warning("GIFT: %s stays at full precision: %s", plan.name, reason)


def _drop_marks(graph: fx.Graph, report: RewriteReport) -> None:
    """Marks become identities once their collective is rewritten; a mark whose gradient
    reached no recognised collective is a fallback."""
    orphans = []
    for n in list(graph.nodes):
        if _is_mark(n):
            if n.meta.get("gift_rewritten") is not True and n.users:
                orphans.append(ItemPlan.from_str(n.args[2]))
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
    if orphans:
        _fallback(report, orphans, "its gradient does not reach a recognised gradient collective")


# The most recent reports (tests and telemetry), bounded: a long job compiles many graphs.
MAX_REPORTS = 256
_REPORTS: deque[RewriteReport] = deque(maxlen=MAX_REPORTS)
_reports_seen = 0


def reports_seen() -> int:
    """How many graphs the pass has seen in this process (a mark for `last_reports(since=)`)."""
    return _reports_seen


def last_reports(since: int | None = None) -> list[RewriteReport]:
    """The reports kept (the last `MAX_REPORTS`), or those of the graphs seen after the
    `since`-th (`reports_seen()` taken earlier; raises if some of those were already dropped)."""
    if since is None:
        return list(_REPORTS)
    lost = _reports_seen - len(_REPORTS)
    if since < lost:
        raise RuntimeError(f"GIFT pass: reports {since}..{lost - 1} were dropped (only the last {MAX_REPORTS} "
                           "are kept); take reports_seen() closer to the compiles you inspect")
    return list(_REPORTS)[since - lost:]


def rewrite_gradient_collectives(gm: fx.GraphModule | fx.Graph) -> RewriteReport:
    """Entry point: rewrite every managed gradient collective of a graph, in place."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    global _reports_seen
    report = RewriteReport(ops_before=count_ops(graph), groups_before=launches_by_group(graph))
    _REPORTS.append(report)
    _reports_seen += 1
    if not any(_is_mark(n) for n in graph.nodes):
        report.ops_after, report.groups_after = report.ops_before, report.groups_before
        return report
    agreements: dict[str, tuple[fx.Node, list[BucketPlan]]] = {}
    for match in find_gradient_collectives(graph):
        reason = _why_not(match)
        if reason is not None:
            _fallback(report, [p for p in match.plans() if p is not None], reason)
            continue
        agreement = _agree_first(graph, match, agreements)
        record = rewrite_bucket(graph, match)
        report.rewritten.append(record)
        if agreement is not None:
            assert record.plan is not None
            agreement.append(record.plan)
        for m in match.marks:
            if m is not None:
                m.meta["gift_rewritten"] = True
    for node, plans in agreements.values():  # the plans are known once every bucket is rewritten
        node.args = (node.args[0], node.args[1], *graph_plans(plans))
    _drop_marks(graph, report)
    graph.eliminate_dead_code()
    graph.lint()
    if isinstance(gm, fx.GraphModule):
        gm.recompile()
    report.ops_after, report.groups_after = count_ops(graph), launches_by_group(graph)
    report.untouched_bytes = untouched_gradient_bytes(graph, {r.group for r in report.rewritten})
    logger.info(
        "GIFT pass: rewrote %d gradient collectives (%d managed weights; collective launches %d -> %d; "
        "%d -> %d bytes per call)", len(report.rewritten), len(report.layers), report.launches(report.ops_before),
        report.launches(report.ops_after), report.baseline_bytes, report.wire_bytes,
    )
    return report
