"""Blocking host collectives for refresh-time statistics (off the compiled hot path).

Refresh averages K-FAC factors (or reduces their sketches onto the layer's owner), gradient factors and selection measurements over the
data-parallel group and broadcasts the new transforms. These are ordinary blocking
``torch.distributed`` calls, in two levels over a group whose ranks span nodes (`set_levels`:
the bucket exchange's node layout), so a refresh crosses the network once per node rather than
once per rank, and counted where asked (`counting`: the refresh's own bytes, which
`comm_totals()` reports apart from the gradients'). One catch on gloo: its worker thread releases a finished
collective's tensors a moment *after* the caller's ``wait`` returns. When that release is
the tensor's last reference (a temporary), the worker must take the GIL to free the
Python object; if the interpreter is already shutting down (a refresh on the final step,
then exit) it cannot, and the process aborts with "terminate called without an active
exception". Every collective here therefore keeps its tensor referenced until a few later
collectives have run, so the worker's release is never the last one.

The same release can come from collectives this package does not own (the trainer's metric
reductions, FSDP2's, a process group that outlives ``destroy_process_group`` because a device
mesh or the trainer still references it; GIFT's own objects hold groups by name,
:class:`GroupByName`). A process whose distributed work is finished and
whose output is flushed therefore leaves through :func:`exit_without_finalization`, which
skips interpreter finalization and with it the race (seen in 2 of 4 four-rank HSDP runs
under CI load, and in the convergence workers).
"""

from __future__ import annotations

import logging
import os
import sys
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

__all__ = ["GroupByName", "Traffic", "all_gather_object_", "all_reduce_", "broadcast_", "counting",
           "exit_without_finalization", "group_rank", "process_group", "reduce_", "set_in_node", "set_levels",
           "world_size"]

# The most recent communicated tensors (see the module docstring). Bounded so at most a few
# refresh buffers outlive their use.
_RECENT: deque[torch.Tensor] = deque(maxlen=4)


def process_group(group: dist.ProcessGroup | str) -> dist.ProcessGroup:
    """`group`, or the process group registered under that name: traced collectives name their
    group (functional collectives take names), eager code holds the object, and plans carry the
    name; this is the one place that turns a name back into the group."""
    return dist.distributed_c10d._resolve_process_group(group) if isinstance(group, str) else group


class GroupByName:
    """A process-group attribute kept as the group's registered name, resolved on each read.

    A `ProcessGroup` object referenced from Python outlives `destroy_process_group`, and with
    it gloo's worker and transport threads: they keep running into interpreter finalization,
    where a worker that drops a collective's last tensor reference cannot take the GIL and the
    process aborts ("terminate called without an active exception") after the job has finished.
    GIFT's states live as long as the model, so they hold no group object:
    `destroy_process_group` then really ends the group's threads. Reading the attribute after
    the group was destroyed raises, naming the group (it is used only where the group must
    still exist). The name itself is the public attribute `<attribute>_name` (`group_name` for
    `group`): plans and traced code read that, without resolving the group.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.slot = f"{name}_name"

    def __get__(self, obj: object, owner: type | None = None) -> dist.ProcessGroup | None:
        if obj is None:
            return self  # type: ignore[return-value]  # the class attribute itself
        name = getattr(obj, self.slot)
        if name is None:
            return None
        try:
            return process_group(name)
        except RuntimeError as e:
            raise RuntimeError(f"GIFT: {type(obj).__name__}.{self.name}: process group {name!r} no longer exists "
                               "(destroy_process_group was called); GIFT cannot communicate over it") from e

    def __set__(self, obj: object, group: dist.ProcessGroup | str | None) -> None:
        setattr(obj, self.slot, group if group is None or isinstance(group, str) else group.group_name)


def world_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group``; 1 without a group or an initialised process group."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank within ``group`` (0 without communication)."""
    return dist.get_rank(group) if world_size(group) > 1 else 0


@dataclass
class Traffic:
    """Bytes this rank handed to send in the host collectives below while counted (`counting`):
    `wire` in all, `cross` of them to collectives between nodes (every byte of a group without
    two levels that may span nodes; none of a group `set_in_node` put inside one node; only the
    cross-node step of one with `set_levels`).
    A broadcast counts at the rank that sends, a reduction at every rank that contributes."""

    wire: int = 0
    cross: int = 0


# the `Traffic` records the collectives count into now (`counting`)
_COUNTING: list[Traffic] = []


@contextmanager
def counting(traffic: Traffic) -> Iterator[None]:
    """The host collectives inside add the bytes this rank hands them to `traffic` (the
    refresh's: `GiftState.refresh_traffic`, `comm_totals()["refresh_wire"]`)."""
    _COUNTING.append(traffic)
    try:
        yield
    finally:
        _COUNTING.remove(traffic)


def _count(t: torch.Tensor, cross: bool) -> None:
    n = t.numel() * t.element_size()
    for traffic in _COUNTING:
        traffic.wire += n
        traffic.cross += n if cross else 0


# group name -> (node group name, cross group name, ranks per node): the groups whose host
# collectives run in two levels (`set_levels`)
_LEVELS: dict[str, tuple[str, str, int]] = {}


def set_levels(group: dist.ProcessGroup | str, node_group: str, cross_group: str, ranks_per_node: int) -> None:
    """Run the host collectives over `group` in two levels from now on: its ranks sit
    `ranks_per_node` to a node, consecutive in group order, `node_group` this rank's node's
    ranks and `cross_group` the ranks of its local index on every node (in node order): the
    layout `gift_compile.exchange.topology.node_layout` made for the bucket exchange, whose
    owner (`GiftState`) registers it. Each collective then crosses the network once per
    node instead of once per rank: a reduction reduces inside the node first, then across
    nodes between the ranks of one local index, then (an all-reduce) broadcasts inside the node."""
    name = process_group(group).group_name
    _IN_NODE.discard(name)
    _LEVELS[name] = (node_group, cross_group, int(ranks_per_node))


# names of the one-level groups whose ranks all sit on one node (`set_in_node`)
_IN_NODE: set[str] = set()


def set_in_node(group: dist.ProcessGroup | str, inside: bool) -> None:
    """Run the host collectives over `group` in one level from now on, counted as inside one
    node (`inside`: none of their bytes in `Traffic.cross`) or as crossing nodes: the one-level
    layout `gift_compile.exchange.topology.node_layout` made (`NodeLayout.spans_nodes`), which
    its owner (`GiftState`) registers, so the refresh's bytes are told apart by the same rule
    as the gradients' (`comm_totals()`)."""
    name = process_group(group).group_name
    _LEVELS.pop(name, None)
    if inside:
        _IN_NODE.add(name)
    else:
        _IN_NODE.discard(name)


def _crosses(group: dist.ProcessGroup | None) -> bool:
    """Whether a one-level host collective over `group` may cross nodes (not `set_in_node`)."""
    return (group if group is not None else dist.group.WORLD).group_name not in _IN_NODE


def _levels(group: dist.ProcessGroup) -> tuple[dist.ProcessGroup, dist.ProcessGroup, int] | None:
    entry = _LEVELS.get(group.group_name)
    if entry is None:
        return None
    node, cross, g = entry
    return process_group(node), process_group(cross), g


def all_reduce_(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``t`` over ``group`` in place (no-op on one rank); returns ``t``. In two levels where
    the group has them (`set_levels`): reduce to the node's first rank, all-reduce between the
    nodes' first ranks, broadcast inside the node (the same sum on every rank)."""
    if world_size(group) > 1:
        _RECENT.append(t)
        levels = _levels(group)
        if levels is None:
            dist.all_reduce(t, group=group)
            _count(t, cross=_crosses(group))
            return t
        node, cross, _ = levels
        leader = dist.get_global_rank(node, 0)
        dist.reduce(t, dst=leader, group=node)
        _count(t, cross=False)
        if dist.get_rank(node) == 0:
            dist.all_reduce(t, group=cross)
            _count(t, cross=True)
        dist.broadcast(t, src=leader, group=node)
        if dist.get_rank(node) == 0:
            _count(t, cross=False)
    return t


def reduce_(t: torch.Tensor, group: dist.ProcessGroup | None, dst: int = 0) -> torch.Tensor:
    """Sum ``t`` over ``group`` into group rank ``dst``'s copy, in place (no-op on one rank).

    Only ``dst`` may read the result: backends use the other ranks' ``t`` as scratch, so it
    is unspecified there. Cheaper than ``all_reduce_`` when one rank alone consumes the sum
    (the owner that rebuilds a layer's transform). In two levels where the group has them:
    inside each node onto the rank of ``dst``'s local index, then across nodes onto ``dst``.
    Returns ``t``.
    """
    if world_size(group) > 1:
        _RECENT.append(t)
        levels = _levels(group)
        if levels is None:
            dist.reduce(t, dst=dist.get_global_rank(group, dst), group=group)
            _count(t, cross=_crosses(group))
            return t
        node, cross, g = levels
        dst_node, dst_local = divmod(dst, g)
        dist.reduce(t, dst=dist.get_global_rank(node, dst_local), group=node)
        _count(t, cross=False)
        if dist.get_rank(node) == dst_local:
            dist.reduce(t, dst=dist.get_global_rank(cross, dst_node), group=cross)
            _count(t, cross=True)
    return t


def broadcast_(t: torch.Tensor, group: dist.ProcessGroup | None, src: int = 0) -> torch.Tensor:
    """Overwrite ``t`` with group rank ``src``'s copy, in place (no-op on one rank); returns
    ``t``. In two levels where the group has them: across nodes between the ranks of ``src``'s
    local index, then inside each node from that rank."""
    if world_size(group) > 1:
        _RECENT.append(t)
        levels = _levels(group)
        if levels is None:
            dist.broadcast(t, src=dist.get_global_rank(group, src), group=group)
            if dist.get_rank(group) == src:
                _count(t, cross=_crosses(group))
            return t
        node, cross, g = levels
        src_node, src_local = divmod(src, g)
        if dist.get_rank(node) == src_local:
            dist.broadcast(t, src=dist.get_global_rank(cross, src_node), group=cross)
            if dist.get_rank(group) == src:
                _count(t, cross=True)
            _count(t, cross=False)  # what it sends on inside its node
        dist.broadcast(t, src=dist.get_global_rank(node, src_local), group=node)
    return t


def all_gather_object_(obj: object, group: dist.ProcessGroup | None) -> list[object]:
    """Every rank's ``obj`` (picklable), in group rank order; ``[obj]`` on one rank."""
    if world_size(group) <= 1:
        return [obj]
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def exit_without_finalization(code: int = 0) -> NoReturn:
    """Flush logs and standard streams, then end the process with ``code`` at once.

    For the end of a distributed program whose process group is destroyed and whose results
    are written (see the module docstring): gloo's worker threads may still release a
    collective's last tensor reference, which aborts a process that is finalizing the
    interpreter. Only a success path calls this; errors propagate as usual.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
