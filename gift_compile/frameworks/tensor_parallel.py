"""Managed weights under tensor parallelism: the matrix one data-parallel rank holds.

With tensor parallelism (TP) next to data parallelism, a linear weight is a DTensor on a mesh
whose dimensions are either data-parallel (FSDP's shard dimension, HSDP's replicate dimension)
or model-parallel (TP). A TP rank computes with its own block of the weight: colwise TP keeps
output rows ``[out/tp, in]`` and sees the whole input, rowwise TP keeps input columns
``[out, in/tp]`` and sees only its slice of the input features. Gradients are summed over the
data-parallel group alone, on that TP-local block; the TP ranks never sum weight gradients with
each other. So for GIFT each TP rank's block is its own matrix: its shape (`local_matrix_shape`)
sizes the layer's map and plan, its inputs (`local_input`, the TP rank's part of a DTensor
activation) feed the statistics, and statistics, transforms and plans are agreed over the
data-parallel group only. The input-side K-FAC map of a rowwise weight is then block-diagonal
across the TP ranks (each rank whitens its own input slice); a colwise weight's TP ranks each
build the map of the same full input from the same tokens.

A mesh dimension is data-parallel when its process group's ranks all belong to GIFT's state
group (the group gradients are reduced over); every other dimension shards the matrix GIFT
sees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["describe_blocks", "local_input", "local_matrix_shape", "on_local_block"]


def _is_dtensor(x: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def local_matrix_shape(weight: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The shape of `weight` as one rank of the data-parallel `group` computes with it: the
    global shape for a plain tensor (or without a group: every mesh dimension is then taken as
    data-parallel); for a DTensor, the global shape sharded along every mesh dimension outside
    `group` (TP), in this rank's coordinate.

    Raises for a placement GIFT cannot map to a block of whole rows or columns on such a
    dimension (a strided or partial one).
    """
    if not _is_dtensor(weight) or group is None:
        return tuple(int(s) for s in weight.shape)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    dp_ranks = set(dist.get_process_group_ranks(group))
    mesh = weight.device_mesh
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    shape = [int(s) for s in weight.shape]
    for dim, placement in enumerate(weight.placements):
        if set(dist.get_process_group_ranks(mesh.get_group(dim))) <= dp_ranks:
            continue  # a data-parallel dimension: gradients are reduced over it
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, _StridedShard) or not isinstance(placement, Shard):
            raise ValueError(f"GIFT: a managed weight is placed {placement!r} on mesh dimension {names[dim]!r}, "
                             "outside the data-parallel group; GIFT maps only plain Shard or Replicate "
                             "placements of model-parallel dimensions onto a TP rank's block")
        size, parts, coord = shape[placement.dim], mesh.size(dim), mesh.get_local_rank(dim)
        chunk = -(-size // parts)  # torch.chunk's split, as DTensor's Shard uses it
        shape[placement.dim] = max(0, min(chunk, size - coord * chunk))
    return tuple(shape)


def local_input(x: torch.Tensor) -> torch.Tensor:
    """The part of a layer input this rank computes with: a DTensor activation's local tensor
    (a colwise layer's replicated input is whole, a rowwise layer's input holds this TP rank's
    slice of the features), a plain tensor itself. A pending (Partial) sum is refused: its local
    tensor is not an input any rank computes with."""
    if not _is_dtensor(x):
        return x
    if any(p.is_partial() for p in x.placements):
        raise ValueError(f"GIFT: a managed layer's input is a DTensor with placements {tuple(x.placements)}; "
                         "a Partial (unreduced) activation is not the input the layer's statistics need")
    return x.to_local()


def describe_blocks(state: Any) -> str:
    """One log line: each managed weight's global shape and the block GIFT manages on this
    rank (its plan's shape), and the data-parallel group its statistics are reduced over."""
    blocks = []
    for name, layer in state.layers.items():
        full = tuple(int(s) for s in state.modules[name]._parameters["weight"].shape)
        blocks.append(f"{name} {list(full)} -> {list(layer.shape)}")
    world = dist.get_world_size(state.group) if state.group is not None else 1
    return (f"GIFT TP: {len(blocks)} managed weights are this TP rank's blocks, each its own GIFT matrix with "
            f"statistics reduced over the {world}-rank data-parallel group: {', '.join(blocks)}")


def on_local_block(weight: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`fn` applied to the block of `weight` this rank computes with, the result wrapped back
    with `weight`'s placements: a SimpleFSDP weight under TP is a DTensor on the TP mesh in the
    forward, so the `gift::mark` of its gradient must see the TP-local block (the tensor the
    framework's data-parallel reduce-scatter carries), never a DTensor. Both wrappers are
    differentiable, so the gradient reaches `fn` as the local block's gradient."""
    if not _is_dtensor(weight):
        return fn(weight)
    from torch.distributed.tensor import DTensor

    local = fn(weight.to_local())
    return DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False,
                              shape=weight.shape, stride=weight.stride())
