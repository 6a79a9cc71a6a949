"""Where a group's ranks sit: the node layout a two-level exchange runs on.

A GIFT collective over ranks on several nodes runs in two levels (`gift_compile.exchange.bucket`):
the `g` ranks of a node reduce-scatter the bucket natively over their fast links, then GIFT's
codec runs on that 1/g chunk and crosses the network only between the ranks of the same local
index. This module answers, once per group, whether that applies and over which subgroups:

- the ranks agree on the layout before it is used: the first call for a group gathers, over
  that group, every rank's `GiftConfig.ranks_per_node`, the launcher's `LOCAL_WORLD_SIZE` and
  node rank (torchrun's `GROUP_RANK`), and each rank resolves the layout from that one table,
  so every rank reaches the same layout or raises the same `TopologyError` before any subgroup
  exists (ranks that read the layout each from its own settings could build different
  subgroups and wait in them until the backend's timeout);
- the node of a rank is its launcher node rank where every rank reports one and the setting is
  None (so nodes of unequal size are seen as such), else `rank // ranks_per_node` (torchrun
  numbers a node's ranks consecutively); `ranks_per_node` is `GiftConfig.ranks_per_node`, or
  the launcher's `LOCAL_WORLD_SIZE` when that is None, or one node when neither is set; ranks
  that resolve different sizes raise, and a setting that differs from `LOCAL_WORLD_SIZE` is
  followed with a warning on every rank;
- a group whose ranks all sit on one node, or one to a node, runs the one-level exchange
  (`FLAT`), bit for bit today's; so does `ranks_per_node=0`;
- otherwise every node must hold the same number of the group's ranks, consecutive in group
  order (the layouts a device mesh gives); any other layout raises, naming the nodes, since a
  silent one-level fallback would put g times the bytes on the network.

The node and cross-node subgroups are made once per (group, setting) with
`dist.new_group(..., use_local_synchronization=True)`: only their members meet, every rank
makes its node's group and then its cross group in that order. They are cached (`_LAYOUTS`)
under the live group: an entry remembers its group by a weak reference, so a group destroyed
and re-created under the same name (`destroy_process_group` then `init_process_group` reuse
the names) is agreed on afresh, and entries of destroyed groups are dropped. Traced code reads
only the subgroups' names.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from gift_compile.config import INTRA_NODE_FORMATS, NATIVE_NODE_FORMAT
from gift_compile.sync import process_group

__all__ = ["FLAT", "MAX_RANKS_PER_NODE", "NodeLayout", "TopologyError", "agree_layout", "describe_layout",
           "node_layout", "node_of_ranks", "resolved_ranks_per_node"]

logger = logging.getLogger("gift_compile")

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

# (group name, setting, this rank's launcher variables) -> (the group, weakly, its layout)
_LAYOUTS: dict[tuple[str, int | None, str, str], tuple[weakref.ref, NodeLayout]] = {}
# what the launcher tells a rank about its node (torchrun sets all three)
_LAUNCHER_VARS = ("LOCAL_WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK")


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
    return _count_nodes(ranks, [r // ranks_per_node for r in ranks], f"ranks_per_node={ranks_per_node}")


def _count_nodes(ranks: list[int], nodes: list[int], source: str) -> tuple[int, int]:
    """`(g, nodes)` of a group whose global ranks `ranks` (group order) sit on the nodes
    `nodes` (one id per rank, read from `source`, named in the error): each node's ranks must be
    consecutive in group order and every node must hold the same number of them."""
    order: list[int] = []
    for node in nodes:
        if not order or order[-1] != node:
            if node in order:
                raise TopologyError(
                    f"GIFT: the group's ranks {ranks} are not consecutive per node (nodes {nodes} from "
                    f"{source}); a two-level exchange needs each node's ranks together in "
                    "group order (set GiftConfig.ranks_per_node=0 for the one-level exchange)")
            order.append(node)
    counts = {n: nodes.count(n) for n in order}
    if len(set(counts.values())) != 1:
        raise TopologyError(
            f"GIFT: the group's ranks {ranks} sit unevenly on nodes ({counts} ranks per node from "
            f"{source}); a two-level exchange needs the same number on every node "
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
    """`node_layout` at the native node format: agreed (`agree_layout`) and its subgroups
    made once per live (group, setting)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return FLAT
    pg = process_group(group)
    if pg.size() <= 1:
        return FLAT
    launcher = tuple(os.environ.get(v, "") for v in _LAUNCHER_VARS)
    key = (pg.group_name, ranks_per_node, *launcher[:2])
    cached = _LAYOUTS.get(key)
    if cached is not None and cached[0]() is pg:
        return cached[1]
    _drop_destroyed()
    ranks = dist.get_process_group_ranks(pg)
    me = dist.get_rank(pg)
    reports: list[tuple | None] = [None] * len(ranks)
    # the one collective over the parent group, before any subgroup: every rank then resolves
    # the same table, so all reach the same layout or raise the same error
    dist.all_gather_object(reports, (ranks_per_node, *launcher), group=pg)
    g, nodes = agree_layout(ranks, [r for r in reports if r is not None])
    if g == 1 or nodes == 1:
        layout = FLAT if nodes == 1 else NodeLayout(1, nodes)
    else:
        node, local = divmod(me, g)
        node_pg = dist.new_group(ranks[node * g:(node + 1) * g], use_local_synchronization=True)
        cross_pg = dist.new_group(ranks[local::g], use_local_synchronization=True)
        layout = NodeLayout(g, nodes, node_pg.group_name, cross_pg.group_name)
    _LAYOUTS[key] = weakref.ref(pg), layout
    return layout


def _drop_destroyed() -> None:
    """Forget the layouts of groups that no longer exist (destroyed, or collected): their
    subgroups are gone with them, and a new group may reuse the name."""
    live = dist.distributed_c10d._world.pg_map
    for key in [k for k, (ref, _) in _LAYOUTS.items() if ref() is None or ref() not in live]:
        del _LAYOUTS[key]


def _launcher_span(ranks: list[int], reports: list[tuple]) -> tuple[int, int]:
    """`(1, nodes)` of a one-level group (`ranks_per_node=0`) over the nodes the launcher puts its
    ranks on (its `GROUP_RANK`s, else `LOCAL_WORLD_SIZE` consecutive ranks to a node), so that
    its bytes are counted as crossing nodes where they do; `(len(ranks), 1)` where they all sit
    on one node or the launcher says nothing usable (the same on every rank: the same reports)."""
    node_ids = [r[2] for r in reports]
    lws = [r[1] for r in reports]
    if all(node_ids):
        nodes = len(set(node_ids))
    elif all(v.isdigit() and int(v) > 0 for v in lws):
        nodes = len({rank // int(v) for rank, v in zip(ranks, lws)})
    else:
        nodes = 1
    return (1, nodes) if nodes > 1 else (len(ranks), 1)


def agree_layout(ranks: list[int], reports: list[tuple]) -> tuple[int, int]:
    """`(g, nodes)` of a group of global `ranks` (group order), from every rank's report
    `(GiftConfig.ranks_per_node, LOCAL_WORLD_SIZE, GROUP_RANK, LOCAL_RANK)` (the launcher's
    variables as strings, "" when unset); `g == 1` or `nodes == 1` is one level. Every rank
    calls it on the same reports, so it returns the same layout on every rank or raises the
    same `TopologyError` on every rank, naming what each rank reported and the way out; a
    setting that the launcher contradicts is logged as a warning on every rank."""
    settings = [r[0] for r in reports]
    lws = [r[1] for r in reports]

    def table(values: list, name: str) -> str:
        return ", ".join(f"rank {rank}: {name}={v!r}" for rank, v in zip(ranks, values))

    if len(set(settings)) > 1:
        raise TopologyError(
            f"GIFT: the ranks disagree on GiftConfig.ranks_per_node ({table(settings, 'ranks_per_node')}); every rank "
            "must pass the same setting (or leave it None to read the launcher's LOCAL_WORLD_SIZE); raised on every "
            "rank before any node group was made")
    setting = settings[0]
    for rank, value in zip(ranks, lws):
        if value and not (value.isdigit() and int(value) > 0) and setting is None:
            raise TopologyError(f"GIFT: rank {rank} has LOCAL_WORLD_SIZE={value!r}, not a positive integer; set "
                                "GiftConfig.ranks_per_node (0 for the one-level exchange)")
    if setting is not None:
        if setting < 0:
            raise TopologyError(f"GIFT: ranks_per_node={setting} must be >= 0 (0: the one-level exchange)")
        contradicted = sorted({v for v in lws if v and v != str(setting)})
        if setting and contradicted:
            logger.warning(
                "GIFT: ranks_per_node=%d (GiftConfig) differs from the launcher's LOCAL_WORLD_SIZE=%s: GIFT follows "
                "the setting and puts every %d consecutive ranks on one node. If the launcher is right, a node group "
                "of the setting %s; leave ranks_per_node=None to follow the launcher (0: one level)",
                setting, "/".join(contradicted), setting,
                "spans several machines and runs its full-precision stage over the network"
                if any(int(v) < setting for v in contradicted if v.isdigit())
                else "splits a machine, so GIFT's codec runs between ranks that share one")
        if setting == 0:
            return _launcher_span(ranks, reports)
        g, nodes = node_of_ranks(ranks, setting)
    elif not any(lws):  # no node layout known: one node
        return len(ranks), 1
    elif all(r[2] for r in reports):  # the launcher says which node each rank is on: believe it
        node_ids = [int(r[2]) if r[2].isdigit() else r[2] for r in reports]
        g, nodes = _count_nodes(ranks, node_ids, f"the launcher's GROUP_RANK, with {table(lws, 'LOCAL_WORLD_SIZE')}")
    elif len(set(lws)) > 1:
        raise TopologyError(
            f"GIFT: the ranks report different node sizes ({table(lws, 'LOCAL_WORLD_SIZE')}) and no node rank "
            "(GROUP_RANK); a two-level exchange needs the same number of ranks on every node. Launch the same "
            "number of processes per node, or set GiftConfig.ranks_per_node=0 for the one-level exchange")
    else:
        g, nodes = node_of_ranks(ranks, int(lws[0]))
    if g > MAX_RANKS_PER_NODE and nodes > 1:
        raise TopologyError(f"GIFT: {g} ranks of the group on one node; the two-level exchange carries at most "
                            f"{MAX_RANKS_PER_NODE} (set GiftConfig.ranks_per_node=0 for the one-level exchange)")
    return g, nodes


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
