"""The FSDP2 internals GIFT reads, in one place, behind a torch version check.

FSDP2 has public switches for everything GIFT sets (`FSDPModule.set_custom_reduce_scatter`,
`set_force_sum_reduction_for_comms`, `set_reduce_scatter_unused_params`,
`set_requires_gradient_sync`), but not for what GIFT must read to map the reduce-scatter
buffer onto parameters: each FSDP module's parameter group, its parameters' padded shard
sizes, placements and owning modules, and the process group it reduce-scatters over; nor for
the `ReduceScatter` interface a custom comm implements. Those are private and may change
between releases, so they are read only here, and only on a torch GIFT was tested with
(`TESTED_TORCH`); another version raises naming it before anything is installed.
"""

from __future__ import annotations

import math
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
           "param_group_id", "shard_process_group"]

# (major, minor) releases whose FSDP2 internals match what this module reads.
TESTED_TORCH = ((2, 13), (2, 14))


def check_torch(version: str = torch.__version__) -> None:
    """Raise unless `version` is a torch release this module was tested with."""
    require_tested_torch(TESTED_TORCH, "GIFT's FSDP2 hook reads FSDP2 internals",
                         "Use a tested torch, or the graph path / DDP", version)


class PackedParam(NamedTuple):
    """One parameter FSDP2 packs into a module's reduce-scatter buffer."""

    fqn: str
    rows: int  # rows of this rank's padded shard
    cols: int  # elements per row
    module: nn.Module  # the module owning the parameter
    param_name: str  # its name on that module
    dim0: bool  # sharded along dim 0 (the only placement GIFT's row blocks map onto)


def _param_group(module: FSDPModule) -> Any | None:
    return module._get_fsdp_state()._fsdp_param_group


def fsdp_modules(model: Parts) -> list[FSDPModule]:
    """The FSDP modules of `model` (of each of its parts: the pipeline stages a rank holds)
    that own parameters (have a parameter group)."""
    return [m for part in model_parts(model) for m in part.modules()
            if isinstance(m, FSDPModule) and _param_group(m) is not None]


def packed_params(module: FSDPModule) -> list[PackedParam]:
    """The parameters FSDP2 packs in `module`'s reduce-scatter (those requiring a gradient,
    in FSDP2's order)."""
    out = []
    for fsdp_param in _param_group(module).fsdp_params:
        if not fsdp_param.sharded_param.requires_grad:
            continue
        size = fsdp_param.padded_sharded_param_size
        info = fsdp_param._module_info
        out.append(PackedParam(fsdp_param._param_fqn or info.param_name, int(size[0]), int(math.prod(size[1:])),
                               info.module, info.param_name, fsdp_param.fsdp_placement.dim == 0))
    return out


def shard_process_group(module: FSDPModule) -> dist.ProcessGroup:
    """The process group `module` reduce-scatters its gradients over."""
    return _param_group(module).mesh_info.shard_process_group


def param_group_id(module: FSDPModule) -> int:
    """Identity of `module`'s parameter group (modules sharded together share one)."""
    return id(_param_group(module))


def is_native_hsdp(module: FSDPModule) -> bool:
    """Whether `module` is sharded on a 2-D (replicate x shard) mesh, whose replica all-reduce
    FSDP2 runs itself before any all-reduce hook."""
    return bool(_param_group(module)._is_hsdp)


def custom_reduce_scatter(module: FSDPModule) -> Any:
    """The reduce-scatter comm `module` currently runs (set by `set_custom_reduce_scatter`)."""
    return _param_group(module)._reduce_scatter_comm


def all_reduce_hook(module: FSDPModule) -> Any | None:
    """The hook `set_all_reduce_hook` put on `module`'s parameter group, if any."""
    return _param_group(module)._all_reduce_hook


def gradient_divide_factor(module: FSDPModule) -> float | None:
    """The explicit gradient divide factor of `module` (None: FSDP2's default mean)."""
    return _param_group(module).gradient_divide_factor
