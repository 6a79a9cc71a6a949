"""The `gift::mark` op and the autograd functions that put it on a managed weight's gradient.

A managed linear's forward routes its weight through `_GiftTag` (a framework collective
follows: the FX pass rewrites it) or `_GiftSync` (GIFT synchronises the gradient itself). In a
traced backward both emit `gift::mark(grad, [state tensors], plan)`: the gradient, the layer's
runtime tensors (in the order `MarkLayout` defines: `pack_mark_tensors` writes them,
`unpack_mark_tensors` reads them back) and its static `ItemPlan` as text. The
FX pass (`gift_compile.passes`) imports this module alone to find the op; nothing here depends
on `GiftState`.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake

from gift_compile.codec import residual as residual_store
from gift_compile.codec.layout import Choice
from gift_compile.config import PlanCheck, ReduceOp, Unrewritten
from gift_compile.exchange import collectives
from gift_compile.exchange.collectives import ItemTensors, Shared
from gift_compile.exchange.plan import Collective, ItemPlan

__all__ = ["MarkLayout", "SyncMode", "mark", "pack_mark_tensors", "split_mark_tensors",
           "tracing", "unpack_item_tensors", "unpack_mark_tensors", "unpack_replica_shared"]

logger = logging.getLogger("gift_compile")
_c10d = torch.ops._c10d_functional
_warned_unrewritten: set[str] = set()


class SyncMode(Choice):
    """How a managed weight's backward behaves under GIFT's own sync (`_GiftSync`): a forward
    argument, so a change is a dynamo guard (at most three graph variants, never a recompile
    from step to step). `GiftState.sync_mode` holds `SYNC` or `ACCUMULATE` (inside
    `gift_compile.no_sync`), each `LayerState.mode` one of the three."""

    SYNC = "sync"
    ACCUMULATE = "accumulate"
    SYNC_PENDING = "sync_pending"  # the next backward sends gradient + pending once


@torch.library.custom_op("gift::mark", mutates_args=())
def mark(grad: torch.Tensor, state: list[torch.Tensor], plan: str) -> torch.Tensor:
    """Identity on a managed weight's gradient that carries its static plan and state tensors.

    The FX pass consumes it; executing it means no pass rewrote the graph (a backend without
    Inductor's post-grad hooks, or an eager SimpleFSDP model), so the gradient would travel at
    full precision. That raises unless the layer's config says `unrewritten="warn"`.
    """
    item = ItemPlan.from_str(plan)
    message = (f"GIFT: the gradient of {item.name} reached gift::mark without the GIFT pass rewriting its "
               "collective (compiled without Inductor's post-grad passes, or run eagerly on a framework whose "
               "collective GIFT only rewrites in graphs); it would travel at full precision")
    if item.unrewritten is Unrewritten.ERROR:
        raise RuntimeError(message + ". Set GiftConfig(unrewritten='warn') to allow that.")
    if item.name not in _warned_unrewritten:
        _warned_unrewritten.add(item.name)
        logger.warning("%s (unrewritten='warn')", message)
    return grad.clone()


@mark.register_fake
def _mark_fake(grad: torch.Tensor, state: list[torch.Tensor], plan: str) -> torch.Tensor:
    return torch.empty_like(grad)


def tracing(t: torch.Tensor) -> bool:
    """Whether `t` flows through a tracer (dynamo, or the fake tensors of AOT tracing) rather
    than eager kernels: graphs get the rewrite-ready mark, eager code runs the exchange."""
    return torch.compiler.is_compiling() or is_fake(t)


class _GiftTag(torch.autograd.Function):
    """Identity whose backward marks the gradient for a framework-owned collective."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, plan: str, *state: torch.Tensor) -> torch.Tensor:
        # State tensors are ctx attributes, not saved tensors: other layers' backward passes
        # update the shared counters in place before this one runs, which autograd's version
        # check on saved tensors would reject.
        ctx.plan, ctx.state = plan, state
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        state = list(ctx.state)
        return (torch.ops.gift.mark(grad, state, ctx.plan), None, *[None] * len(state))


class _GiftSync(torch.autograd.Function):
    """Identity whose backward synchronises the gradient over the data-parallel group.

    `mode` SYNC communicates this backward's gradient; ACCUMULATE adds it to `pending` and
    returns no gradient (gradient accumulation without communication); SYNC_PENDING
    communicates gradient + `pending` and clears it, so an accumulated step is sent once.
    `op` (`GiftConfig.reduce_op`) averages or sums over the group.
    """

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, plan: str, group_name: str, op: ReduceOp, mode: SyncMode,
                pending: torch.Tensor | None, *state: torch.Tensor) -> torch.Tensor:
        ctx.plan, ctx.group_name, ctx.op, ctx.mode = plan, group_name, op, mode
        ctx.pending, ctx.state = pending, state  # attributes, not saved tensors: see _GiftTag
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved, pending = list(ctx.state), ctx.pending
        nones = [None] * (5 + len(saved))
        if ctx.mode is SyncMode.ACCUMULATE:
            pending.add_(grad)
            return (None, *nones)
        if ctx.mode is SyncMode.SYNC_PENDING:
            grad = grad + pending
            pending.zero_()
        if tracing(grad):
            marked = torch.ops.gift.mark(grad, saved, ctx.plan)
            return (_c10d.wait_tensor(_c10d.all_reduce(marked, ctx.op.value, ctx.group_name)), *nones)
        item = ItemPlan.from_str(ctx.plan)
        tensors, shared = unpack_mark_tensors(item, saved)
        segment = collectives.Segment(item.name, item.rows, item.cols, item, tensors)
        outs = collectives.sync_buffer(grad.reshape(-1), [segment], shared, op=Collective.ALL_REDUCE,
                                       group=ctx.group_name, average=ctx.op is ReduceOp.AVG, plan_check=PlanCheck.FIRST,
                                       ranks_per_node=item.ranks_per_node,
                                       intra_node_format=item.intra_node_format)
        return (outs[0].to(grad.dtype).reshape(grad.shape), *nones)


class MarkLayout(NamedTuple):
    """How many of a mark's tensors each part holds, in order: the item's own (transform,
    residual buffers, second-hop residual buffers, probe, seed offset), the state's shared
    ones (seed, rank, counters), then with a replica hop (`plan.replica_format`) that hop's
    rank and counters. The one definition of the order: `pack_mark_tensors` writes it and
    every reader (`unpack_*`, `split_mark_tensors`, the FX pass) goes through this."""

    own: int
    shared: int
    replica: int

    @classmethod
    def of(cls, plan: ItemPlan) -> "MarkLayout":
        k = residual_store.buffer_count(plan.residual_format)
        own = plan.n_tensors + k * (int(plan.error_feedback) + int(plan.second_hop_error_feedback)) + 2
        return cls(own, 3, 2 if plan.replica_format else 0)


def pack_mark_tensors(plan: ItemPlan, item: ItemTensors, shared: Shared, replica: Shared | None) -> list[torch.Tensor]:
    """The `gift::mark` op's tensors for `plan` (order: `MarkLayout`); `replica` is the replica
    hop's `Shared` (its rank and counters travel), required exactly when the plan has one.
    Runs in traced forwards, so it only lists (the readers check the count against the plan)."""
    if bool(plan.replica_format) != (replica is not None):
        raise RuntimeError(f"GIFT: {plan.name}: the plan {'has' if plan.replica_format else 'has no'} replica hop "
                           f"but replica tensors were {'not ' if replica is None else ''}given")
    out = [*item.transform, *(item.residual if plan.error_feedback else ()),
           *(item.second_hop_residual if plan.second_hop_error_feedback else ()), item.probe, item.seed_offset,
           shared.seed, shared.rank, shared.counters]
    if replica is not None:
        out += [replica.rank, replica.counters]
    return out


def split_mark_tensors(plan: ItemPlan, tensors: list[Any]) -> tuple[list[Any], list[Any], list[Any]]:
    """A mark's tensors (or FX nodes) as (the item's own, the shared seed/rank/counters, the
    replica hop's rank/counters: empty without one)."""
    own, shared, replica = MarkLayout.of(plan)
    if len(tensors) != own + shared + replica:
        raise ValueError(f"GIFT: the mark of {plan.name} carries {len(tensors)} tensors; its plan lays out "
                         f"{own} + {shared} + {replica}")
    return list(tensors[:own]), list(tensors[own:own + shared]), list(tensors[own + shared:])


def unpack_item_tensors(plan: ItemPlan, own: list[Any]) -> ItemTensors:
    """The item's own part of a mark's tensors (`split_mark_tensors`) as `ItemTensors`."""
    n = plan.n_tensors
    k = residual_store.buffer_count(plan.residual_format)
    transform = tuple(own[:n])
    residual = tuple(own[n:n + k]) if plan.error_feedback else None
    n += k if plan.error_feedback else 0
    second = tuple(own[n:n + k]) if plan.second_hop_error_feedback else None
    n += k if plan.second_hop_error_feedback else 0
    probe, seed_offset = own[n:n + 2]
    return ItemTensors(transform, residual, probe, seed_offset, second)


def unpack_mark_tensors(plan: ItemPlan, tensors: list[Any]) -> tuple[ItemTensors, Shared]:
    """Inverse of `pack_mark_tensors` without the replica hop (tensors and FX nodes alike)."""
    own, shared, _ = split_mark_tensors(plan, tensors)
    return unpack_item_tensors(plan, own), Shared(*shared)


def unpack_replica_shared(plan: ItemPlan, tensors: list[Any]) -> Shared:
    """The replica hop's `Shared` (the step's seed, this rank's rank in the replica group, the
    hop's own counters) from a mark's tensors; only for a plan with a `replica_format`."""
    if not plan.replica_format:
        raise ValueError(f"GIFT: the mark of {plan.name} carries no replica hop (its plan has no replica_format)")
    _, (seed, _, _), (rank, counters) = split_mark_tensors(plan, tensors)
    return Shared(seed, rank, counters)
