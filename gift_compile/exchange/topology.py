"""Where a group's ranks sit: the node layout a two-level exchange runs on.

A GIFT collective over ranks on several nodes runs in two levels (`gift_compile.exchange.bucket`):
the `g` ranks of a node reduce-scatter the bucket natively over their fast links, then GIFT's
codec runs on that 1/g chunk and crosses the network only between the ranks of the same local
index. This module answers, once per group, whether that applies and over which subgroups:

- the node of a global rank is `rank // ranks_per_node` (torchrun numbers a node's ranks
  consecutively); `ranks_per_node` is `GiftConfig.ranks_per_node`, or the launcher's
  `LOCAL_WORLD_SIZE` when that is None, or one node when neither is set;
- a group whose ranks all sit on one node, or one to a node, runs the one-level exchange
  (`FLAT`), bit for bit today's; so does `ranks_per_node=0`;
- otherwise every node must hold the same number of the group's ranks, consecutive in group
  order (the layouts a device mesh gives); any other layout raises, naming the nodes, since a
  silent one-level fallback would put g times the bytes on the network.

The node and cross-node subgroups are made once per (group, setting) with
`dist.new_group(..., use_local_synchronization=True)`: only their members meet, every rank
makes its node's group and then its cross group in that order, so the calls pair up on every
rank without a collective over the whole job. They are cached for the process's life
(`_LAYOUTS`, bounded by the groups a job uses), and traced code reads only their names.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.distributed as dist

from gift_compile.config import INTRA_NODE_FORMATS, NATIVE_NODE_FORMAT
from gift_compile.sync import process_group

__all__ = ["FLAT", "MAX_RANKS_PER_NODE", "NodeLayout", "TopologyError", "describe_layout", "node_layout",
           "node_of_ranks", "resolved_ranks_per_node"]

# A stage-2 header carries a node's flags as bit masks of its local ranks in one int64 (two
# masks of 31 bits: non-finite, plan mismatch), which bounds the ranks of one node in a group.
MAX_RANKS_PER_NODE = 31


class TopologyError(ValueError):
    """A group's ranks sit on nodes in a layout the two-level exchange cannot run on."""


class NodeLayout(NamedTuple):
    """A group's two levels: `ranks_per_node` (g) of its ranks on each of `nodes` nodes, the
    name of this rank's node group (its g ranks, in group order) and of its cross group (the
    `nodes` ranks with its local index, in node order). `ranks_per_node == 1`: one level.
    `node_format` (`GiftConfig.intra_node_format`) is the precision of the collectives inside
    the node; a one-level layout has none, so it is always native there. A one-level layout's
    `nodes` is the number of nodes its group spans (1: all inside one node, or no node layout
    known), which decides whether its bytes are counted as crossing nodes (`spans_nodes`)."""

    ranks_per_node: int = 1
    nodes: int = 1
    node_group: str | None = None
    cross_group: str | None = None
    node_format: str = NATIVE_NODE_FORMAT

    @property
    def two_level(self) -> bool:
        return self.ranks_per_node > 1

    @property
    def spans_nodes(self) -> bool:
        """Whether the group's collectives cross nodes (the network): a two-level layout's
        stage 2, or a one-level group with ranks on several nodes."""
        return self.nodes > 1

    def node_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a tensor of `dtype` travels at inside the node: its own, or bf16."""
        return dtype if self.node_format == NATIVE_NODE_FORMAT else torch.bfloat16

    def with_node_format(self, node_format: str) -> NodeLayout:
        """This layout with the node's collectives at `node_format`; a one-level layout stays
        itself (it runs no collective inside a node). Raises ValueError for an unknown name."""
        if node_format not in INTRA_NODE_FORMATS:
            raise ValueError(f"GIFT: intra_node_format={node_format!r}; allowed: {', '.join(INTRA_NODE_FORMATS)}")
        return self._replace(node_format=node_format) if self.two_level else self


FLAT = NodeLayout()  # the one-level exchange

_LAYOUTS: dict[tuple[str, int], NodeLayout] = {}


def resolved_ranks_per_node(setting: int | None) -> int:
    """`GiftConfig.ranks_per_node` resolved: the setting, or `LOCAL_WORLD_SIZE`, or 0 (one node)."""
    if setting is not None:
        return int(setting)
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not env:
        return 0
    try:
        value = int(env)
    except ValueError:
        raise TopologyError(f"GIFT: LOCAL_WORLD_SIZE={env!r} is not an integer; set GiftConfig.ranks_per_node") from None
    if value < 1:
        raise TopologyError(f"GIFT: LOCAL_WORLD_SIZE={value} must be positive; set GiftConfig.ranks_per_node")
    return value


def node_of_ranks(ranks: list[int], ranks_per_node: int) -> tuple[int, int]:
    """`(g, nodes)` of a group whose global ranks are `ranks` (group order) on nodes of
    `ranks_per_node` global ranks; `(1, len(ranks))` or `(len(ranks), 1)` mean one level.
    Raises `TopologyError` for a layout with uneven or interleaved nodes."""
    nodes = [r // ranks_per_node for r in ranks]
    order: list[int] = []
    for node in nodes:
        if not order or order[-1] != node:
            if node in order:
                raise TopologyError(
                    f"GIFT: the group's ranks {ranks} are not consecutive per node (nodes {nodes} at "
                    f"ranks_per_node={ranks_per_node}); a two-level exchange needs each node's ranks together in "
                    "group order (set GiftConfig.ranks_per_node=0 for the one-level exchange)")
            order.append(node)
    counts = {n: nodes.count(n) for n in order}
    if len(set(counts.values())) != 1:
        raise TopologyError(
            f"GIFT: the group's ranks {ranks} sit unevenly on nodes ({counts} ranks per node at "
            f"ranks_per_node={ranks_per_node}); a two-level exchange needs the same number on every node "
            "(set GiftConfig.ranks_per_node=0 for the one-level exchange)")
    return len(ranks) // len(order), len(order)


def node_layout(group: dist.ProcessGroup | str | None, ranks_per_node: int | None,
                intra_node_format: str = NATIVE_NODE_FORMAT) -> NodeLayout:
    """The layout GIFT's collectives over `group` run on under `GiftConfig.ranks_per_node`
    and `GiftConfig.intra_node_format` (see the module docstring); makes and caches the
    subgroups on the first call for a group, so every rank of `group` must call it at the
    same point (an eager collective's setup, a state's construction, a graph's rewrite: all
    collective already)."""
    return _node_groups(group, ranks_per_node).with_node_format(intra_node_format)


def _node_groups(group: dist.ProcessGroup | str | None, ranks_per_node: int | None) -> NodeLayout:
    """`node_layout` at the native node format: the subgroups, made once per (group, setting)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return FLAT
    per_node = resolved_ranks_per_node(ranks_per_node)
    if per_node == 0:
        return _spanned(group)
    pg = process_group(group)
    key = (pg.group_name, per_node)
    layout = _LAYOUTS.get(key)
    if layout is not None:
        return layout
    ranks = dist.get_process_group_ranks(pg)
    g, nodes = node_of_ranks(ranks, per_node)
    if g == 1 or nodes == 1:
        layout = FLAT if nodes == 1 else NodeLayout(1, nodes)
    else:
        if g > MAX_RANKS_PER_NODE:
            raise TopologyError(f"GIFT: {g} ranks of the group on one node; the two-level exchange carries at most "
                                f"{MAX_RANKS_PER_NODE} (set GiftConfig.ranks_per_node=0 for the one-level exchange)")
        me = dist.get_rank(pg)
        node, local = divmod(me, g)
        node_pg = dist.new_group(ranks[node * g:(node + 1) * g], use_local_synchronization=True)
        cross_pg = dist.new_group(ranks[local::g], use_local_synchronization=True)
        layout = NodeLayout(g, nodes, node_pg.group_name, cross_pg.group_name)
    _LAYOUTS[key] = layout
    return layout


def _spanned(group: dist.ProcessGroup | str) -> NodeLayout:
    """The one-level layout of a group whose two levels are off (`ranks_per_node=0`, or no node
    layout): over the nodes the launcher's `LOCAL_WORLD_SIZE` puts its ranks on, so that its
    bytes are counted as crossing nodes where they do; without it, one node."""
    per_node = resolved_ranks_per_node(None)
    if per_node == 0:
        return FLAT
    pg = process_group(group)
    key = (pg.group_name, -per_node)  # cached apart from the two-level layouts (keyed by a positive g)
    layout = _LAYOUTS.get(key)
    if layout is None:
        nodes = len({r // per_node for r in dist.get_process_group_ranks(pg)})
        layout = _LAYOUTS[key] = FLAT if nodes == 1 else NodeLayout(1, nodes)
    return layout


def describe_layout(layout: NodeLayout, world: int, ranks_per_node: int | None,
                    ranks: list[int] | None = None) -> str:
    """How a collective over a group of `world` ranks on `layout` runs, in words, and why a
    one-level one is (`gift_compile.report`): `ranks_per_node` is the setting it was resolved
    from; `ranks`, the group's global ranks, tells a group inside one node or one to a node
    from one that has no node layout at all."""
    if layout.two_level:
        return (f"two levels, {layout.nodes} nodes x {layout.ranks_per_node} ranks (inside the node at "
                f"{layout.node_format}, then GIFT's codec on the 1/{layout.ranks_per_node} chunk across nodes)")
    if world <= 1:
        return "no collective (one rank)"
    per_node = resolved_ranks_per_node(ranks_per_node)
    if per_node == 0:
        why = ("ranks_per_node=0" if ranks_per_node == 0
               else "no node layout (ranks_per_node and LOCAL_WORLD_SIZE unset)")
    elif ranks is not None and node_of_ranks(ranks, per_node)[0] == 1:
        why = f"one rank per node at ranks_per_node={per_node}"
    else:
        why = f"all on one node at ranks_per_node={per_node}"
    return f"one level over {world} ranks ({why})"
