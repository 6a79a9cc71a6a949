"""GIFT for `DistributedDataParallel`: a comm hook that runs GIFT's all-reduce on each bucket.

DDP hands a comm hook one `GradBucket` at a time: a flat buffer holding the gradients of
several parameters in order (the accumulated `.grad`s; under `model.no_sync()` DDP calls no
hook and the next synchronising backward sends the accumulated gradients). The hook builds
one bucket's segments, managed weights quantized with their layer's transform/residual/seed and
every other parameter by the rule for gradients outside the layers (`frameworks.euclidean`:
in plain coordinates at `unmapped_format`, tiny ones at `tiny_format`), and hands `gift_compile.exchange.collectives.sync_buffer`
(one all_to_all plus one all_gather per DDP bucket, the same core as the FSDP2 hook and the FX
pass) to the model's exchange lane (`_Lane`). It returns at once a future that completes when
that bucket's exchange has written its results into the buffer: the backward of the earlier
layers runs while the gradients travel, as with DDP's own all-reduce.

Why a lane (one worker thread and a process group of its own) rather than chained work
callbacks: a bucket is several collectives in sequence (the all_to_all, the all_gather, two
levels add the node's), and collectives pair across ranks by the order in which each rank
issues them on a group. Callbacks run when each rank's data arrives, so one rank could issue
bucket 1's all_gather before bucket 2's all_to_all and its peer after; and DDP issues its own
collectives on its group from the autograd thread (the unused-parameter map under
`find_unused_parameters`). One worker runs the buckets in the order DDP hands them over (the
same on every rank) on a group nothing else uses, so every rank issues the same sequence.

Health: the exchange reads nothing on the host (no per-bucket plan check: the ranks agreed on
every layer's plan at `apply` and agree again after each refresh, `GiftState.check_agreement`;
each collective's header still carries the plan's fingerprint and the non-finite flags into
the state's counters). The counters are read once per step, when the backward ends, after
DDP's reducer has waited for every bucket and finalised the step (`queue_backward_check`
with `after_framework`): an error raised there leaves the reducer consistent, so a caller
that catches it, zeroes the gradients and goes on trains on.
"""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations at runtime.

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
import torch.nn as nn

from gift_compile.config import GiftConfig, ReduceOp
from gift_compile.exchange.collectives import Segment, group_info, per_call_check, sync_buffer
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


class _Lane:
    """One worker thread that runs a model's bucket exchanges in the order they are handed
    over, each answered by a `torch.futures.Future` (see the module docstring for why one).

    On CUDA the exchange runs on a stream of its own that first waits for what the submitting
    stream had queued (the bucket's gradients), and the future is device-aware: whoever waits
    on it (DDP's reducer) waits for the exchange's kernels on its own stream, not on the host."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gift-ddp-lane")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def submit(self, work: Callable[[], torch.Tensor]) -> tuple[torch.futures.Future[torch.Tensor], object]:
        """Run `work` after every earlier submission; `(its future, the pool's handle)`.
        An exception in `work` is set on the future, so the waiter (every rank's DDP) raises it."""
        if self._stream is None:
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            ready = None
        else:
            fut = torch.futures.Future(devices=[self.device])
            ready = torch.cuda.current_stream(self.device).record_event()

        def run() -> None:
            try:
                if self._stream is None:
                    fut.set_result(work())
                    return
                with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                    self._stream.wait_event(ready)
                    fut.set_result(work())  # records the stream's progress for the waiters
            except BaseException as e:  # the waiter raises it
                fut.set_exception(e)

        return fut, self._pool.submit(run)


class _HookState:
    """What the comm hook needs: the GIFT state, parameter names and layers, DDP's group and
    the exchange lane with its own group (same ranks)."""

    # held by name, so a destroyed group's threads end with it (`gift_compile.sync.GroupByName`)
    group = GroupByName()
    lane_group = GroupByName()

    def __init__(self, state: GiftState, model: nn.Module, group: dist.ProcessGroup, lane_group: dist.ProcessGroup,
                 fuse: bool, device: torch.device) -> None:
        self.state = state
        self.group = group
        self.lane_group = lane_group
        self.fuse = fuse
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.layers = {id(m._parameters["weight"]): m._gift_layer for m in state.modules.values()}
        self.lane = _Lane(device)
        # bucket layouts whose compiled bodies exist: a new one is exchanged before the hook
        # returns, so that no compilation runs beside the backward's own (torch.compile's state
        # is process-wide); every later one overlaps
        self.warm: set[tuple] = set()
        # every other parameter's item (`euclidean.outside_item`), built once: plan and tensors
        world = dist.get_world_size(group)
        layout = node_layout(group, state.config.ranks_per_node, state.config.intra_node_format)
        self.outside = {id(p): outside_item(state, n, tuple(p.shape), world, p.device,
                                            collective=Collective.ALL_REDUCE, layout=layout)
                        for n, p in model.named_parameters() if id(p) not in self.layers and p.requires_grad}


def _gift_hook(hs: "_HookState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    if not hs.state.active:  # gift_compile.remove was called: DDP's default behaviour
        _, world, _ = group_info(hs.group)
        work = dist.all_reduce(buf.div_(world), group=hs.group, async_op=True)
        return work.get_future().then(lambda f: f.value()[0])
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
    shared, lane_group = hs.state.shared, hs.lane_group

    def exchange() -> torch.Tensor:
        sync_buffer(buf, segments, shared, op=Collective.ALL_REDUCE, group=lane_group,
                    average=config.reduce_op is ReduceOp.AVG, out=buf,
                    plan_check=per_call_check(config),
                    compiled=hs.fuse, ranks_per_node=config.ranks_per_node,
                    intra_node_format=config.intra_node_format)
        return buf

    queue_backward_check(hs.state, after_framework=True)
    fut, handle = hs.lane.submit(exchange)
    if hs.fuse:
        key = (buf.dtype, *((s.name, s.rows, s.cols, s.plan) for s in segments))
        if key not in hs.warm:
            handle.exception()  # waits without raising: the future carries any error to DDP
            hs.warm.add(key)
    return fut


def _lane_group(pg: dist.ProcessGroup, config: GiftConfig) -> dist.ProcessGroup:
    """A process group of `pg`'s ranks for the lane alone (made by every rank of `pg`, at
    `apply`, which is collective), its node layout resolved now rather than on the lane."""
    ranks = dist.get_process_group_ranks(pg)
    lane = dist.new_group(ranks, backend=dist.get_backend(pg), use_local_synchronization=True)
    node_layout(lane, config.ranks_per_node, config.intra_node_format)
    return lane


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
    try:
        device = next((p.device for p in model.module.parameters()), torch.device("cpu"))
        hook = _HookState(state, model.module, model.process_group, _lane_group(model.process_group, config), fuse,
                          device)
    except BaseException:
        unmanage(model.module, state)  # all or nothing
        raise
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
