"""GIFT for `DistributedDataParallel`: a comm hook that runs GIFT's all-reduce on each bucket.

DDP hands a comm hook one `GradBucket` at a time: a flat buffer holding the gradients of
several parameters in order (the accumulated `.grad`s; under `model.no_sync()` DDP calls no
hook and the next synchronising backward sends the accumulated gradients). The hook builds
one bucket plan, managed weights quantized with their layer's transform/residual/seed and
every other parameter by the rule for gradients outside the layers (`frameworks.euclidean`:
in plain coordinates at `unmapped_format`, tiny ones at `tiny_format`), runs `gift_compile.exchange.collectives.sync_buffer` (one
all_to_all plus one all_gather per DDP bucket, the same core as the FSDP2 hook and the FX
pass), and writes the results back into the buffer. The returned future is complete: the
collective has run (DDP overlaps buckets with the rest of the backward either way).
"""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations at runtime.

import logging
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
import torch.nn as nn

from gift_compile.config import GiftConfig, ReduceOp
from gift_compile.exchange.collectives import Segment, group_info, sync_buffer
from gift_compile.exchange.plan import Collective
from gift_compile.exchange.topology import node_layout
from gift_compile.frameworks.adapter import attach
from gift_compile.frameworks.euclidean import outside_item
from gift_compile.frameworks.routing import ManageMode, manage, unmanage
from gift_compile.runtime.health import queue_backward_check
from gift_compile.runtime.state import GiftState
from gift_compile.sync import GroupByName

logger = logging.getLogger("gift_compile")

__all__ = ["DDP", "install"]


class _HookState:
    """What the comm hook needs: the GIFT state, parameter names and layers, the group."""

    # held by name, so a destroyed group's threads end with it (`gift_compile.sync.GroupByName`)
    group = GroupByName()

    def __init__(self, state: GiftState, model: nn.Module, group: dist.ProcessGroup, fuse: bool) -> None:
        self.state = state
        self.group = group
        self.fuse = fuse
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.layers = {id(m._parameters["weight"]): m._gift_layer for m in state.modules.values()}
        # every other parameter's item (`euclidean.outside_item`), built once: plan and tensors
        world = dist.get_world_size(group)
        layout = node_layout(group, state.config.ranks_per_node, state.config.intra_node_format)
        self.outside = {id(p): outside_item(state, n, tuple(p.shape), world, p.device,
                                            collective=Collective.ALL_REDUCE, layout=layout)
                        for n, p in model.named_parameters() if id(p) not in self.layers and p.requires_grad}


def _gift_hook(hs: "_HookState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    _, world, _ = group_info(hs.group)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    if not hs.state.active:  # gift_compile.remove was called: DDP's default behaviour
        dist.all_reduce(buf.div_(world), group=hs.group)
        fut.set_result(buf)
        return fut
    segments = []
    for p in bucket.parameters():
        layer = hs.layers.get(id(p))
        if layer is None:
            plan, tensors = hs.outside.get(id(p), (None, None))
            segments.append(Segment(hs.names.get(id(p), "param"), 1, p.numel()) if plan is None
                            else Segment(plan.name, plan.rows, plan.cols, plan, tensors))
        else:
            segments.append(Segment(layer.fqn, *layer.shape, layer.plan, layer.tensors()))
    config = hs.state.config
    sync_buffer(buf, segments, hs.state.shared, op=Collective.ALL_REDUCE, group=hs.group,
                average=config.reduce_op is ReduceOp.AVG, out=buf, plan_check=config.plan_check, compiled=hs.fuse,
                ranks_per_node=config.ranks_per_node, intra_node_format=config.intra_node_format)
    queue_backward_check(hs.state)
    fut.set_result(buf)
    return fut


def install(model: nn.parallel.DistributedDataParallel, config: GiftConfig, group: dist.ProcessGroup | None, *,
            fuse: bool = True) -> GiftState:
    """Manage the wrapped module's linear weights (statistics hooks) and register the hook."""
    pg = model.process_group if group is None or group is dist.group.WORLD else group
    if pg is not model.process_group and dist.get_world_size(pg) != dist.get_world_size(model.process_group):
        raise ValueError("gift_compile.apply: group= differs from the DistributedDataParallel process group")
    if dist.get_world_size(model.process_group) == 1:  # as the plain adapter: nothing to compress
        logger.warning("gift_compile.apply: DistributedDataParallel on a one-rank group, no gradient communication "
                       "to compress; nothing managed")
        state = GiftState(config, None)
        model._gift_state = state
        attach(state, DDP.name, None)
        return state
    state = manage(model.module, config, model.process_group, mode=ManageMode.STATS, collective=Collective.ALL_REDUCE)
    hook = _HookState(state, model.module, model.process_group, fuse)
    if getattr(model, "_gift_comm_hook", None) is not None:
        # applied before and removed: DDP takes one comm hook per model and none back, so
        # GIFT's own hook (running DDP's plain all-reduce since) is pointed at the new state
        model._gift_comm_hook.__dict__.update(hook.__dict__)
    else:
        try:
            model.register_comm_hook(hook, _gift_hook)
        except RuntimeError as e:
            unmanage(model.module, state)  # all or nothing
            raise RuntimeError(f"gift_compile.apply: DistributedDataParallel refused GIFT's comm hook ({e}); GIFT "
                               "needs the model's one comm hook: apply GIFT instead of registering another") from e
        model._gift_comm_hook = hook
    model._gift_state = state
    attach(state, DDP.name, None)
    return state


class _DDPAdapter:
    """`DistributedDataParallel` models: GIFT's all-reduce as DDP's comm hook."""

    name = "ddp"
    kind = "DDP comm hook"
    split_rows = False

    def detect(self, model: nn.Module) -> bool:
        return isinstance(model, nn.parallel.DistributedDataParallel)

    def install(self, model: nn.Module, config: GiftConfig, group: dist.ProcessGroup | None, *,
                fuse: bool) -> GiftState:
        return install(model, config, group, fuse=fuse)

    def no_sync(self, model: nn.Module, state: GiftState) -> AbstractContextManager[None]:
        """DDP's own `no_sync` (it calls no comm hook inside; the next backward sends the sum)."""
        return model.no_sync()

    def remove(self, model: nn.Module, state: GiftState) -> None:
        """A comm hook cannot be unregistered: the hook sees the state inactive and runs DDP's
        plain fp32 all-reduce from now on (logged); a later `apply` points it at its new state."""
        logger.warning("gift_compile.remove: DDP keeps its comm hook; it now runs DDP's plain fp32 all-reduce")

    def telemetry(self, state: GiftState) -> dict[str, float]:
        """Nothing beyond the state's counters: the hook's collectives count into them."""
        return {}


DDP = _DDPAdapter()
