"""GIFT for FSDP2 (`fully_shard`): each FSDP module's reduce-scatter replaced by GIFT's.

FSDP2 runs its gradient reduce-scatter from `torch._dynamo.disable`d hooks, so no graph pass
ever sees it. It offers `FSDPModule.set_custom_reduce_scatter`: the custom comm receives the
flat reduce-scatter input of one FSDP module, in which FSDP2 packs all of that module's
gradients (`chunk_cat`). For `world` ranks::

    input.view(world, N)[r] = concat_i( rows [r*c_i, (r+1)*c_i) of grad_i, flattened )

with `c_i` rows of parameter `i` per rank (dim 0 padded to a multiple of `world`). That is
exactly a bucket: `GiftReduceScatter` cuts the buffer into one item per parameter (a managed
weight is `input.view(world, N)[:, off_i:off_i + c_i*cols_i]` reshaped to `[world*c_i, cols_i]`,
its full gradient) and runs `gift_compile.exchange.collectives.sync_buffer` on them: one all_to_all per
FSDP module, managed weights quantized with their transform/residual/seed, every other
parameter at full precision in the same collective. The graph path (a bucketed reduce-scatter
rewritten by the pass) runs the same functions on the same layout.

`install` also asks FSDP2 to reduce-scatter unused parameters (zeros,
`set_reduce_scatter_unused_params`), so every call holds every parameter that requires a
gradient and the layout always maps; a buffer that does not match raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from gift_compile.exchange.collectives import Segment, bucket_plan, bucket_wire_bytes, sync_buffer
from gift_compile.exchange.plan import BucketPlan, Collective
from gift_compile.frameworks.fsdp_internals import (
    DefaultReduceScatter, ReduceScatter, check_torch, custom_reduce_scatter, fsdp_modules, packed_params,
    shard_process_group,
)
from gift_compile.config import GiftConfig
from gift_compile.frameworks.adapter import attach, attached
from gift_compile.frameworks.parts import Parts
from gift_compile.frameworks.routing import ManageMode, manage
from gift_compile.runtime.health import queue_backward_check
from gift_compile.runtime.state import GiftState
from gift_compile.runtime.telemetry import CommTimer

__all__ = ["FSDP2", "GiftReduceScatter", "accounted_bytes", "discarded_gradients", "discarding", "install",
           "shard_group", "uninstall"]


# How many `discarded_gradients` contexts are open.
_discarding = 0


@contextlib.contextmanager
def discarded_gradients() -> Iterator[None]:
    """Reductions inside run FSDP2's default fp32 collectives and leave GIFT's state alone.

    For backward passes whose gradients the framework throws away: torch's pipeline stages
    infer shapes on their first step with a real backward on uninitialized inputs, whose
    reduce-scatter FSDP2 runs and whose gradients the stage then drops. Through GIFT's path that
    garbage would enter the error-feedback residuals, the byte counters and the health checks
    (a NaN there raises under ``nonfinite="error"``). Every rank of the group must be inside
    (they all run the same stage's inference), or the collectives would not match.
    """
    global _discarding
    _discarding += 1
    try:
        yield
    finally:
        _discarding -= 1


def discarding() -> bool:
    """Whether a `discarded_gradients` context is open."""
    return _discarding > 0


class GiftReduceScatter(ReduceScatter):
    """FSDP2 custom reduce-scatter of one FSDP module (see the module docstring)."""

    def __init__(self, module: FSDPModule, state: GiftState, timer: CommTimer, compiled: bool) -> None:
        self.module = module
        self.state = state
        self.timer = timer
        self.compiled = compiled
        # (world, dtype, group name) of the last call: what `accounted_bytes` prices
        self.last_call: tuple[int, torch.dtype, str] | None = None

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _segments(self) -> list[Segment]:
        """Every parameter FSDP2 packs in this call (those requiring a gradient, in FSDP2's
        order) as a segment of its per-rank rows: managed weights with their layer's plan."""
        out = []
        for p in packed_params(self.module):
            layer = getattr(p.module, "_gift_layer", None) if p.param_name == "weight" else None
            if layer is not None and (not p.dim0 or p.cols != layer.shape[1]):
                layer = None
            out.append(Segment(p.fqn, p.rows, p.cols) if layer is None
                       else Segment(p.fqn, p.rows, p.cols, layer.plan, layer.tensors()))
        return out

    def plan(self, world: int, dtype: torch.dtype, group_name: str | None = None) -> BucketPlan:
        """The bucket this module's reduce-scatter runs: one item per parameter (managed
        weights quantized, the others at full precision), FSDP2's order."""
        return bucket_plan(self._segments(), dtype, world=world, group_name=group_name, average=False,
                           op=Collective.REDUCE_SCATTER)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        if op != dist.ReduceOp.SUM:
            raise ValueError(
                f"GIFT's FSDP2 reduce-scatter sums gradients; got {op}. install() forces SUM reductions "
                "(set_force_sum_reduction_for_comms: FSDP2 then divides before/after the comm); do not undo it."
            )
        if discarding():  # gradients the framework drops: no quantization, no state touched
            return DefaultReduceScatter()(output_tensor, input_tensor, group, op, async_op)
        world = group.size()
        segments = self._segments()
        chunk = sum(s.rows * s.cols for s in segments)
        if input_tensor.numel() != world * chunk:
            raise RuntimeError(
                f"GIFT FSDP2: the reduce-scatter buffer has {input_tensor.numel()} elements, the module's "
                f"parameters that require gradients make {world} x {chunk}; cannot map it to parameters"
            )
        config = self.state.config
        self.last_call = (world, input_tensor.dtype, group.group_name)
        sync_buffer(input_tensor, segments, self.state.shared, op=Collective.REDUCE_SCATTER, group=group, average=False,
                    out=output_tensor, plan_check=config.plan_check, compiled=self.compiled,
                    timing=self.timer.timing(input_tensor.device))
        queue_backward_check(self.state)
        return None


def shard_group(model: Parts, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The process group FSDP2 reduce-scatters over (must be one for the whole model, all of
    its parts)."""
    check_torch()
    groups = {shard_process_group(m) for m in fsdp_modules(model)}
    if len(groups) != 1:
        raise ValueError(f"gift_compile: FSDP2 model reduce-scatters over {len(groups)} process groups; GIFT needs one")
    (pg,) = groups
    if group is not None and group is not dist.group.WORLD and group is not pg:
        raise ValueError("gift_compile.apply: group= differs from the process group FSDP2 reduce-scatters over")
    return pg


def install(model: Parts, state: GiftState, *, compiled: bool = True) -> CommTimer:
    """Put every FSDP module of `model` (of all its parts, the pipeline stages a rank holds,
    which share `state` and one comm timer) on `GiftReduceScatter`; returns the comm timer.

    Forces FSDP2's SUM reduction (FSDP2 then applies its gradient divide factor itself) and
    the reduce-scatter of unused parameters, so every buffer maps onto the parameters. The
    timer is kept in the state's per-adapter slot (the FSDP2 adapter's telemetry reads it).
    """
    check_torch()
    timer = CommTimer()
    for module in fsdp_modules(model):
        module.set_force_sum_reduction_for_comms(True)
        module.set_reduce_scatter_unused_params(True)
        module.set_custom_reduce_scatter(GiftReduceScatter(module, state, timer, compiled))
    attach(state, FSDP2.name, timer)
    return timer


def uninstall(model: Parts) -> None:
    """FSDP2's default reduce-scatter back on every FSDP module of `model`."""
    for module in fsdp_modules(model):
        module.set_custom_reduce_scatter(DefaultReduceScatter())


def accounted_bytes(model: Parts) -> int | None:
    """Shape-based bytes one rank hands to GIFT's reduce-scatters per synchronising backward
    (`bucket_wire_bytes` of each module's plan as last called, over all parts), to compare with the bytes the
    collectives counted; None before GIFT's reduce-scatter ran (or when it is not installed)."""
    comms = {id(c): c for c in (custom_reduce_scatter(m) for m in fsdp_modules(model))
             if isinstance(c, GiftReduceScatter) and c.last_call is not None}
    if not comms:
        return None
    return sum(bucket_wire_bytes(c.plan(*c.last_call)) for c in comms.values())


class _FSDP2Adapter:
    """`fully_shard` (FSDP2) models: GIFT's bucketed reduce-scatter as FSDP2's custom one."""

    name = "fsdp2"
    kind = "FSDP2 custom reduce-scatter"
    split_rows = True

    def detect(self, model: nn.Module) -> bool:
        return any(isinstance(m, FSDPModule) for m in model.modules())

    def install(self, model: nn.Module, config: GiftConfig, group: dist.ProcessGroup | None, *,
                fuse: bool) -> GiftState:
        """The state over the group FSDP2 reduce-scatters over (`shard_group`), statistics hooks
        on the managed linears, and `install`'s reduce-scatter on every FSDP module."""
        shards = shard_group(model, group)
        if shards.size() == 1:
            raise ValueError(
                "gift_compile.apply: the FSDP2 model reduce-scatters over a one-rank group; FSDP2 then copies each "
                "gradient without calling the custom reduce-scatter, so GIFT would quantize and send nothing (with "
                "replicas, install gift_compile.frameworks.fsdp2 and gift_compile.frameworks.hsdp: the replica hop "
                "then carries every gradient)")
        state = manage(model, config, shards, mode=ManageMode.STATS, split_rows=True)
        install(model, state, compiled=fuse)
        return state

    def no_sync(self, model: nn.Module, state: GiftState) -> AbstractContextManager[None]:
        """FSDP2's own switch (`set_requires_gradient_sync(False)`) on every FSDP module."""
        return _without_gradient_sync([m for m in model.modules() if isinstance(m, FSDPModule)])

    def remove(self, model: nn.Module, state: GiftState) -> None:
        uninstall(model)

    def telemetry(self, state: GiftState) -> dict[str, float]:
        """Seconds spent in GIFT's reduce-scatters since the last call (`comm_s`)."""
        return {"comm_s": attached(state, self.name).take()}


@contextlib.contextmanager
def _without_gradient_sync(modules: list[FSDPModule]) -> Iterator[None]:
    for m in modules:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in modules:
            m.set_requires_gradient_sync(True, recurse=False)


FSDP2 = _FSDP2Adapter()
