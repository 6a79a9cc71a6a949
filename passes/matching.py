"""Finding the gradient collectives the GIFT pass rewrites: match records, no mutation.

`find_gradient_collectives` returns one `BucketMatch` per functional `reduce_scatter_tensor` /
`all_reduce` (with its `wait_tensor`) that carries at least one marked gradient, either
directly (through views and casts) or as an entry of a bucket built by Inductor's
`bucketing::_pre_bucket_reduce_scatter`, and, for SimpleFSDP's HSDP, the replica all-reduce
each bucket entry went through first. `_why_not` says why a match cannot be rewritten. The
rewrite itself is `gift_compile.passes.gift_pass`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from gift_compile.config import ReduceOp
from gift_compile.exchange.mark import split_mark_tensors, unpack_item_tensors
from gift_compile.exchange.plan import Collective, ItemPlan, dtype_name
from gift_compile.passes.inductor_internals import pre_bucket_reduce_scatter_op
from gift_compile.sync import process_group

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten


_COLLECTIVES = {_c10d.all_reduce.default: Collective.ALL_REDUCE,
                _c10d.reduce_scatter_tensor.default: Collective.REDUCE_SCATTER}
# Ops a gradient may pass through between the mark and the collective without changing
# which element sits in which row.
_PASSTHROUGH = {
    _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.clone.default,
    _aten.alias.default, _aten._to_copy.default, _aten.contiguous.default,
    torch.ops.prims.convert_element_type.default,
}
_META_KEYS = ("autograd_backward", "stack_trace", "nn_module_stack", "seq_nr", "fwd_nn_module_stack", "custom")


class GiftRewriteError(RuntimeError):
    """A marked gradient whose collective the pass cannot rewrite (it would go at fp32)."""


@dataclass
class BucketMatch:
    """A gradient collective (+ wait) and the tensors it carries, some of them marked."""

    collective: fx.Node
    wait: fx.Node
    inputs: list[fx.Node]  # what the framework handed to the collective, per bucket entry
    marks: list[fx.Node | None]  # the mark each entry traces back to (None: unmanaged)
    pre_bucket: fx.Node | None
    op: Collective
    reduce_op: ReduceOp | None  # the graph's reduce op; None: neither a sum nor an average (not rewritten)
    group_size: int
    group_name: str
    # HSDP: the replica all-reduce (+ wait) each entry went through before the reduce-scatter
    # (`inputs` are then what entered those all-reduces), their group and op; empty otherwise.
    replica_reductions: list[tuple[fx.Node, fx.Node]] = field(default_factory=list)
    replica_group: str | None = None
    replica_op: ReduceOp | None = ReduceOp.SUM  # None: the replica all-reduces differ or do not sum
    mixed_replica: bool = False  # some entries went through a replica all-reduce, others not

    def plans(self) -> list[ItemPlan | None]:
        return [None if m is None else ItemPlan.from_str(m.args[2]) for m in self.marks]


def count_ops(graph: fx.Graph) -> dict[str, int]:
    """Counts of the call_function targets that matter here (collectives, marks, buckets, mm)."""
    c: Counter[str] = Counter()
    for n in graph.nodes:
        if n.op == "call_function":
            name = str(n.target)
            if ("_c10d_functional" in name or "gift." in name or "bucketing." in name
                    or name in ("aten.mm.default", "aten.copy_.default")):
                c[name] += 1
    return dict(c)


def untouched_gradient_bytes(graph: fx.Graph, groups: set[str]) -> int:
    """Bytes handed, per rank and per run of `graph`, to the reduce-scatters over the
    data-parallel `groups` that no GIFT rewrite replaced (gradients: the forward reduce-scatters
    of sequence parallelism run over the tensor-parallel group): SimpleFSDP's buckets without a
    managed weight (the embedding, the output head) that still travel at their own precision.
    Telemetry adds them to both sides of the compression, which then is the whole gradient's,
    as on the FSDP2 path (every bucket there is GIFT's). All-reduces are left out: an
    activation gradient's all-reduce (tensor parallelism over the same group) is not told apart
    from a gradient's here, so a replicate-only graph counts GIFT's all-reduces only."""
    total = 0
    for n in graph.nodes:
        if n.op != "call_function" or n.target is not _c10d.reduce_scatter_tensor.default:
            continue
        if str(n.kwargs.get("group_name", n.args[-1])) not in groups:
            continue
        val = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
        if isinstance(val, torch.Tensor):
            total += val.numel() * val.element_size()
    return total


def launches_by_group(graph: fx.Graph) -> dict[tuple[str, str], int]:
    """Collective launches (every `_c10d_functional` op but waits) per process group name (the
    last argument of every functional collective) and phase ("forward", or "backward" for nodes
    of a joint graph's backward): the collectives a rewrite must leave alone are told apart
    from the data-parallel ones it replaces by their group (tensor parallelism's activation
    all-reduces and all-gathers run over the TP group)."""
    c: Counter[tuple[str, str]] = Counter()
    for n in graph.nodes:
        if n.op != "call_function" or n.target is _c10d.wait_tensor.default:
            continue
        if "_c10d_functional" in str(n.target):
            phase = "backward" if n.meta.get("autograd_backward") else "forward"
            c[(str(n.kwargs.get("group_name", n.args[-1])), phase)] += 1
    return dict(c)


def _is_mark(n: Any) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is torch.ops.gift.mark.default


def _wait_of(n: fx.Node) -> fx.Node | None:
    users = list(n.users)
    if len(users) == 1 and users[0].target is _c10d.wait_tensor.default:
        return users[0]
    return None


def _trace_to_mark(n: Any) -> fx.Node | None:
    """The mark `n` is a view/cast of (through single-use links), or None."""
    while isinstance(n, fx.Node) and not _is_mark(n):
        if n.op != "call_function" or n.target not in _PASSTHROUGH or len(n.users) != 1:
            return None
        n = n.args[0]
    return n if _is_mark(n) else None


def _group_size(group_name: str) -> int:
    import torch.distributed as dist

    return dist.get_world_size(process_group(group_name))


def _replica_reduction(x: Any) -> tuple[fx.Node, fx.Node] | None:
    """`(all_reduce, wait)` when `x` is the waited result of an all_reduce used only here (how
    SimpleFSDP's HSDP hands a replica-reduced gradient to the shard reduce-scatter)."""
    if not (isinstance(x, fx.Node) and x.target is _c10d.wait_tensor.default and len(x.users) == 1):
        return None
    ar = x.args[0]
    if isinstance(ar, fx.Node) and ar.target is _c10d.all_reduce.default and len(ar.users) == 1:
        return ar, x
    return None


def _replica_reductions(inputs: list[Any]) -> list[tuple[fx.Node, fx.Node] | None]:
    """Per bucket entry, the replica all-reduce (HSDP) it went through, or None.

    The replica group is the group of the all-reduces that marked gradients went through; an
    entry all-reduced over another group is an input like any other (with tensor parallelism a
    norm weight's gradient is all-reduced over the TP group before the data-parallel
    reduce-scatter: that collective is TP's and stays as it is). Without a marked gradient
    behind an all-reduce there is no replica hop.
    """
    found = [_replica_reduction(x) for x in inputs]
    groups = {r[0].args[2] for r in found if r is not None and _trace_to_mark(r[0].args[0]) is not None}
    return [r if r is not None and r[0].args[2] in groups else None for r in found]


def _collective_inputs(n: fx.Node, pre_bucket: Any) -> tuple[fx.Node | None, fx.Node | None, list[Any]]:
    """`(wait, bucket, inputs)` of collective `n`: its wait, the `_pre_bucket_reduce_scatter` node
    feeding it (None when it sends one tensor) and the tensors it carries."""
    src = n.args[0]
    bucket = src if isinstance(src, fx.Node) and src.target is pre_bucket and len(src.users) == 1 else None
    return _wait_of(n), bucket, list(bucket.args[0]) if bucket is not None else [src]


def find_gradient_collectives(graph: fx.Graph) -> list[BucketMatch]:
    """Every all_reduce / reduce_scatter_tensor that carries at least one marked gradient; a
    reduce-scatter whose entries are replica all-reduces of marked gradients is one HSDP match
    (the all-reduces are part of it, not matches of their own)."""
    pre_bucket = pre_bucket_reduce_scatter_op()
    matches = []
    paired: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op != "call_function" or n.target is not _c10d.reduce_scatter_tensor.default:
            continue
        wait, bucket, inputs = _collective_inputs(n, pre_bucket)
        reductions = _replica_reductions(inputs)
        if not any(reductions):
            continue
        originals = [x if r is None else r[0].args[0] for x, r in zip(inputs, reductions)]
        marks = [_trace_to_mark(x) for x in originals]
        if wait is None or not any(marks):
            continue
        done = [r for r in reductions if r is not None]
        groups = {r[0].args[2] for r in done}
        ops = {r[0].args[1] for r in done}
        match = BucketMatch(n, wait, originals, marks, bucket, Collective.REDUCE_SCATTER, ReduceOp.lookup(n.args[1]),
                            n.args[2], n.args[3], done, groups.pop() if len(groups) == 1 else None,
                            ReduceOp.lookup(ops.pop()) if len(ops) == 1 else None,
                            mixed_replica=len(done) != len(inputs))
        paired.update(r[0] for r in done)
        matches.append(match)
    for n in graph.nodes:
        if n.op != "call_function" or n.target not in _COLLECTIVES or n in paired:
            continue
        if n.target is _c10d.reduce_scatter_tensor.default and any(m.collective is n for m in matches):
            continue
        wait, bucket, inputs = _collective_inputs(n, pre_bucket)
        marks = [_trace_to_mark(x) for x in inputs]
        if wait is None or not any(marks):
            continue
        op = _COLLECTIVES[n.target]
        if op is Collective.ALL_REDUCE:
            reduce_op, group_name = n.args[1], n.args[2]
            group_size = _group_size(group_name)
        else:
            reduce_op, group_size, group_name = n.args[1], n.args[2], n.args[3]
        matches.append(BucketMatch(n, wait, inputs, marks, bucket, op, ReduceOp.lookup(reduce_op), group_size,
                                   group_name))
    position = {n: i for i, n in enumerate(graph.nodes)}
    matches.sort(key=lambda m: position[m.collective])
    return matches


def _why_not_sole_replica_hop(match: BucketMatch, replica: list[str]) -> str | None:
    """Why an all-reduce of gradients whose plans have a replica hop (HSDP), feeding no shard
    reduce-scatter, cannot be that hop alone (`replica`: the marks' replica formats). It is
    when their shard group has one rank (torchtitan's routed experts on a one-rank efsdp under
    EP x HSDP): every mark has the hop at one format, and none has what a shard hop would
    serve, error feedback (its residual) or a gradient probe with rows (a layer's refresh
    measures it: a one-shard dense layer runs the layers' own plans, GIFT's DDP)."""
    if not all(replica) or len(set(replica)) != 1:
        return ("an all-reduce carrying gradients with and without a replica hop (HSDP), or at several replica "
                "formats; one replica hop runs one format")
    for m in match.marks:
        if m is None:
            continue
        plan = ItemPlan.from_str(m.args[2])
        probe = unpack_item_tensors(plan, split_mark_tensors(plan, list(m.args[1]))[0]).probe
        rows = probe.meta["val"].shape[0] if isinstance(probe, fx.Node) and "val" in probe.meta else None
        if plan.error_feedback or plan.second_hop_error_feedback or rows != 0:
            return (f"{plan.name}: its gradient's only collective is the replica all-reduce (HSDP, a one-rank shard "
                    "group), but its plan has a shard hop's error feedback or gradient probe (a managed layer's), "
                    "which that hop alone would leave unwritten")
    return None


def _why_not(match: BucketMatch) -> str | None:
    if match.reduce_op is None:
        return f"reduce op {match.collective.args[1]!r} is not a sum"
    replica = [ItemPlan.from_str(m.args[2]).replica_format for m in match.marks if m is not None]
    if match.replica_reductions:
        if match.mixed_replica:
            return "some entries of the bucket went through a replica all-reduce and others did not"
        if match.replica_group is None or match.replica_op is None:
            return "the entries' replica all-reduces differ in group or reduce op, or do not sum"
        if not all(replica):
            return ("the gradient crosses a replica all-reduce (HSDP) but its mark carries no replica hop "
                    "(gift_compile.frameworks.hsdp.install_graph was not called before tracing)")
    elif match.op is Collective.ALL_REDUCE and any(replica):
        why = _why_not_sole_replica_hop(match, replica)
        if why is not None:
            return why
    for x, m in zip(match.inputs, match.marks):
        val = x.meta.get("val")
        if val is None:
            return f"no shape metadata on {x.name}"
        try:
            dtype_name(val.dtype)
        except TypeError as e:
            return str(e)
        if m is None:
            if match.op is Collective.REDUCE_SCATTER and val.numel() % match.group_size:
                return f"{x.name} ({val.numel()} elements) does not split over {match.group_size} ranks"
            continue
        plan = ItemPlan.from_str(m.args[2])
        if val.numel() != plan.numel:
            return f"{plan.name}: gradient has {val.numel()} elements, the weight {plan.numel}"
        if match.op is Collective.REDUCE_SCATTER and plan.rows % match.group_size:
            return f"{plan.name}: {plan.rows} rows do not split evenly over {match.group_size} ranks"
    return None
