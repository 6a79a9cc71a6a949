"""Which exchange each of a state's gradient paths runs, in words, for `gift_compile.report`.

A job spanning nodes runs GIFT's collectives in two levels where their group spans nodes
(`gift_compile.exchange.topology`), but not every path does, so the apply report names each:

- the managed weights' collectives (and, under DDP, FSDP2 and SimpleFSDP, the unmanaged
  parameters that share their buckets) over the state's group;
- a plain module's unmanaged parameters (`plain_sync`): one bucket per backward on GIFT's
  exchange (`unmapped_format` / `tiny_format`, its per-rank flags as exact fp32 sums), on the
  same node layout as the managed weights;
- the routed experts' layers over their own data-parallel group (`runtime.experts`);
- HSDP's replica hop (`hsdp`): GIFT's all-reduce over the replica group, always one level.
  In the layouts it is for (a shard group per node) the replica group has one rank per node,
  so there is nothing to split; a replica group with several ranks on a node is named as
  such, since its exchange then crosses the network g times over.
"""

from __future__ import annotations

import torch.distributed as dist

from gift_compile.exchange.topology import TopologyError, describe_layout, node_of_ranks, resolved_ranks_per_node
from gift_compile.frameworks.hsdp import replica_hop
from gift_compile.frameworks.plain_sync import PLAIN
from gift_compile.runtime.state import GiftState

__all__ = ["describe_exchanges"]


def _ranks(group: dist.ProcessGroup | None) -> list[int] | None:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_process_group_ranks(group)


def describe_exchanges(state: GiftState) -> tuple[str, ...]:
    """One line per gradient path of `state` (module docstring): what it sends and how."""
    config = state.config
    plain = PLAIN.name in state.adapters
    managed = "managed weights" if plain else "managed weights and the parameters in their buckets"
    out = [f"{managed}: {describe_layout(state.layout, state.world(), config.ranks_per_node, _ranks(state.group))}"]
    if plain and state.world() > 1:
        out.append("unmanaged parameters: one bucket per backward at unmapped_format / tiny_format, "
                   f"{describe_layout(state.layout, state.world(), config.ranks_per_node, _ranks(state.group))}")
    for sub in state.substates:
        line = describe_layout(sub.layout, sub.world(), config.ranks_per_node, _ranks(sub.group))
        out.append(f"routed experts ({len(sub.layers)} layers, their data-parallel group): {line}")
    hop = replica_hop(state)
    if hop is not None:
        text = f"HSDP replica hop at {config.replica_hop_format}: GIFT's all-reduce, one level over {hop.world} ranks"
        ranks, per_node = _ranks(hop.group), resolved_ranks_per_node(config.ranks_per_node)
        if ranks is not None and per_node:
            try:
                g, nodes = node_of_ranks(ranks, per_node)
            except TopologyError:  # a layout no two-level exchange could run on either
                g, nodes = 0, 0
                text += f" (its ranks {ranks} sit unevenly on nodes of {per_node})"
            if g == 1:
                text += " (one rank per node: nothing to split)"
            elif nodes > 1:
                text += (f", although they sit {g} to a node on {nodes} nodes: the replica hop does not run in two "
                         "levels (shard over whole nodes to give it one rank per node)")
        out.append(text)
    return tuple(out)
