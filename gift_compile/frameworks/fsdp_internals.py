"""The FSDP2 internals GIFT reads, in one place, behind a torch version check.

FSDP2 has public switches for everything GIFT sets (`FSDPModule.set_custom_reduce_scatter`,
`set_force_sum_reduction_for_comms`, `set_reduce_scatter_unused_params`,
`set_requires_gradient_sync`), but not for what GIFT must read to map the reduce-scatter
buffer onto parameters: each FSDP module's parameter group, its parameters' padded shard
sizes, placements and owning modules, and the process group it reduce-scatters over; nor for
the `ReduceScatter` interface a custom comm implements.

A module sharded with a per-parameter mesh (``fully_shard(..., shard_placement_fn=...)``
returning a `ShardPlacementResult`: torchtitan's MoE blocks under expert parallelism, routed
experts on the ``efsdp`` mesh, the rest on the ``fsdp`` mesh) has one parameter group per mesh,
and FSDP2's public setters refuse custom comms for it ("not supported with multiple param
groups"; `set_all_reduce_hook` likewise). Every reader here therefore takes ``over``: the process
group whose parameter group is meant (None: the module's only one), and the three ``set_group_*``
functions put a comm, an all-reduce hook or a gradient divide factor on exactly that group: the
writes GIFT makes past the public API, each the assignment its public setter makes for every
group. Those are private and may change
between releases, so they are read only here, and only on a torch GIFT was tested with
(`TESTED_TORCH`); another version raises naming it before anything is installed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from gift_compile.frameworks.parts import Parts, model_parts
from gift_compile.torch_release import require_tested_torch

__all__ = ["DefaultReduceScatter", "PackedParam", "ReduceScatter", "TESTED_TORCH", "all_reduce_hook", "check_torch",
           "custom_reduce_scatter", "fsdp_modules", "gradient_divide_factor", "is_native_hsdp", "packed_params",
           "param_group_id", "same_group", "set_group_all_reduce_hook", "set_group_divide_factor",
           "set_group_reduce_scatter", "shard_mesh_dims", "shard_process_group", "shard_process_groups", "sharded_params"]

# (major, minor) releases whose FSDP2 internals match what this module reads.
TESTED_TORCH = ((2, 13), (2, 14))


def check_torch(version: str = torch.__version__) -> None:
    """Raise unless `version` is a torch release this module was tested with."""
    require_tested_torch(TESTED_TORCH, "GIFT's FSDP2 hook reads FSDP2 internals",
                         "Use a tested torch, or the graph path / DDP", version)


class PackedParam(NamedTuple):
    """One parameter FSDP2 packs into a module's reduce-scatter buffer."""

    fqn: str
    module: nn.Module  # the module owning the parameter
    param_name: str  # its name on that module
    dim0: bool  # sharded along dim 0 (the only placement GIFT's row blocks map onto)
    local: tuple[int, ...]  # this rank's padded shard's shape

    @property
    def rows(self) -> int:
        """Rows of this rank's padded shard."""
        return self.local[0]

    @property
    def cols(self) -> int:
        """Elements per row."""
        return math.prod(self.local[1:])


def _param_groups(module: FSDPModule) -> list[Any]:
    """`module`'s parameter groups (one per mesh; torch >= 2.13 keeps them in a list)."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    if not isinstance(groups, list):
        raise RuntimeError(f"gift_compile: FSDP2's _fsdp_param_groups is a {type(groups).__name__}, not the list "
                           f"torch {TESTED_TORCH} keep; GIFT's FSDP2 hook does not know this torch")
    return groups


def same_group(a: dist.ProcessGroup, b: dist.ProcessGroup) -> bool:
    """Whether two process group handles are the same group (DeviceMesh may hand out
    distinct handles of one group)."""
    return a is b or a.group_name == b.group_name


def _param_group(module: FSDPModule, over: dist.ProcessGroup | None = None) -> Any:
    """`module`'s parameter group: its only one (``over`` None), or the one reduce-scattering
    over ``over`` (a module with a per-parameter mesh has several)."""
    groups = _param_groups(module)
    if over is None:
        if len(groups) != 1:
            raise ValueError(f"gift_compile: FSDP module {type(module).__name__} has {len(groups)} parameter groups; "
                             "name the process group of the one meant")
        return groups[0]
    found = [g for g in groups if same_group(g.mesh_info.shard_process_group, over)]
    if len(found) != 1:
        raise ValueError(f"gift_compile: FSDP module {type(module).__name__} has {len(found)} parameter groups "
                         f"reduce-scattering over process group {over.group_name!r} (of {len(groups)}); expected one")
    return found[0]


def fsdp_modules(model: Parts) -> list[FSDPModule]:
    """The FSDP modules of `model` (of each of its parts: the pipeline stages a rank holds)
    that own parameters (have at least one parameter group)."""
    return [m for part in model_parts(model) for m in part.modules()
            if isinstance(m, FSDPModule) and _param_groups(m)]


def shard_process_groups(module: FSDPModule) -> list[dist.ProcessGroup]:
    """The process group each parameter group of `module` reduce-scatters over (one entry per
    group, FSDP2's order; several with a per-parameter mesh)."""
    return [g.mesh_info.shard_process_group for g in _param_groups(module)]


def shard_mesh_dims(module: FSDPModule, over: dist.ProcessGroup | None = None) -> tuple[str, ...]:
    """The names of the mesh dimensions `module`'s parameter group over ``over`` (None: its only
    one) is sharded on (empty when the mesh has no names)."""
    return tuple(_param_group(module, over).mesh_info.mesh.mesh_dim_names or ())


def _set_on_group(module: FSDPModule, over: dist.ProcessGroup, slot: str, value: Any,
                  public: Callable[[Any], None]) -> None:
    """Write `value` into the ``slot`` of `module`'s parameter group over ``over`` only: the
    assignment FSDP2's public setter (`public`) makes for every group, which it refuses for a
    module with several (one value would serve two meshes). A module with one group goes
    through the public setter."""
    if len(_param_groups(module)) == 1:
        if not same_group(shard_process_group(module), over):
            raise ValueError(f"gift_compile: FSDP module {type(module).__name__} reduce-scatters over "
                             f"{shard_process_group(module).group_name!r}, not {over.group_name!r}")
        public(value)
        return
    group = _param_group(module, over)
    if not hasattr(group, slot):
        raise RuntimeError(f"gift_compile: FSDP2's parameter group has no {slot} (the slot {public.__name__} writes "
                           f"in torch {TESTED_TORCH}); GIFT's FSDP2 hooks do not know this torch")
    setattr(group, slot, value)


def set_group_reduce_scatter(module: FSDPModule, over: dist.ProcessGroup, comm: ReduceScatter) -> None:
    """Put `comm` on the parameter group of `module` that reduce-scatters over ``over``, and only
    on it (the module's other groups keep theirs; `FSDPModule.set_custom_reduce_scatter` refuses
    a module with several groups)."""
    _set_on_group(module, over, "_reduce_scatter_comm", comm, module.set_custom_reduce_scatter)


def packed_params(module: FSDPModule, over: dist.ProcessGroup | None = None) -> list[PackedParam]:
    """The parameters FSDP2 packs in the reduce-scatter of `module`'s parameter group over
    ``over`` (None: its only one): those requiring a gradient, in FSDP2's order."""
    out = []
    for fsdp_param in _param_group(module, over).fsdp_params:
        if not fsdp_param.sharded_param.requires_grad:
            continue
        size = fsdp_param.padded_sharded_param_size
        info = fsdp_param._module_info
        out.append(PackedParam(fsdp_param._param_fqn or info.param_name, info.module, info.param_name,
                               fsdp_param.fsdp_placement.dim == 0, tuple(int(d) for d in size)))
    return out


def sharded_params(model: Parts) -> set[tuple[int, str]]:
    """`(id(owning module), name)` of every parameter some FSDP module of `model` (of each of
    its parts) shards, in any of its parameter groups, requiring a gradient or not, under each
    module it is registered on (a tied parameter's every registration): a parameter not in this
    set lies in no FSDP module, so FSDP2 runs no collective for its gradient."""
    out = set()
    for module in fsdp_modules(model):
        for group in _param_groups(module):
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                out.add((id(info.module), info.param_name))
                out.update((id(m), n) for m, n in zip(info.shared_modules, info.shared_param_names))
    return out


def shard_process_group(module: FSDPModule) -> dist.ProcessGroup:
    """The process group `module` reduce-scatters its gradients over."""
    return _param_group(module).mesh_info.shard_process_group


def param_group_id(module: FSDPModule, over: dist.ProcessGroup | None = None) -> int:
    """Identity of `module`'s parameter group over ``over`` (modules sharded together share one)."""
    return id(_param_group(module, over))


def is_native_hsdp(module: FSDPModule, over: dist.ProcessGroup | None = None) -> bool:
    """Whether `module`'s parameter group over ``over`` is sharded on a 2-D (replicate x shard)
    mesh, whose replica all-reduce FSDP2 runs itself before any all-reduce hook."""
    return bool(_param_group(module, over)._is_hsdp)


def custom_reduce_scatter(module: FSDPModule, over: dist.ProcessGroup | None = None) -> Any:
    """The reduce-scatter comm `module`'s parameter group over ``over`` (None: its only one)
    currently runs (set by `set_custom_reduce_scatter` / `set_group_reduce_scatter`)."""
    return _param_group(module, over)._reduce_scatter_comm


def all_reduce_hook(module: FSDPModule, over: dist.ProcessGroup | None = None) -> Any | None:
    """The hook `set_all_reduce_hook` / `set_group_all_reduce_hook` put on `module`'s parameter
    group over ``over``, if any."""
    return _param_group(module, over)._all_reduce_hook


def set_group_all_reduce_hook(module: FSDPModule, over: dist.ProcessGroup, hook: Any) -> None:
    """Put the all-reduce `hook` on the parameter group of `module` that reduce-scatters over
    ``over``, and only on it (`FSDPModule.set_all_reduce_hook` refuses a module with several
    groups). FSDP2 calls the hook of each group with that group's reduced shard."""
    _set_on_group(module, over, "_all_reduce_hook", hook, module.set_all_reduce_hook)


def gradient_divide_factor(module: FSDPModule, over: dist.ProcessGroup | None = None) -> float | None:
    """The explicit gradient divide factor of `module`'s parameter group over ``over`` (None:
    FSDP2's default mean)."""
    return _param_group(module, over).gradient_divide_factor


def set_group_divide_factor(module: FSDPModule, over: dist.ProcessGroup, factor: float) -> None:
    """Set the gradient divide factor of `module`'s parameter group over ``over`` only
    (`FSDPModule.set_gradient_divide_factor` sets one factor on every group, while groups on
    meshes of different sizes need different ones)."""
    _param_group(module, over if len(_param_groups(module)) > 1 else None).gradient_divide_factor = factor
