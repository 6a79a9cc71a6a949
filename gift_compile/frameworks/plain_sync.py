"""The sync of the parameters GIFT does not manage, for `apply` on a plain module.

GIFT synchronises a plain (non-DDP, non-FSDP) module itself: managed weights through their
quantized collective in the backward, every other parameter (biases, norms, embeddings,
excluded or small weights) here. Those gradients are packed in a FIXED order, the model's
parameter order, into ONE flat fp32 buffer (one slot per parameter, an arrival flag per
parameter, a non-finite flag per rank) and all-reduced once per synchronising backward, at its
end, when every gradient has arrived (DDP's reducer with a single bucket), on GIFT's bucket
exchange: each parameter by the rule for gradients outside the layers
(`gift_compile.frameworks.euclidean`: plain coordinates at `unmapped_format`, tiny ones at
`tiny_format`, raw fp32 where the config opts out), the flags as exact fp32 sums. So:

* a rank whose backward produces gradients in another order cannot pair the wrong tensors
  (each parameter has its slot; item names and order are in the plan fingerprint);
* each rank's non-finite flag travels in the same all-reduce, so a NaN/Inf in a norm gain on
  one rank raises on every rank at the end of the backward, naming it (the flush runs in the
  same end-of-backward callback as `gift_compile.runtime.health`'s checks, before them),
  like a managed weight's; the layout (names, order, sizes) is agreed across ranks at `apply`;
* one launch per backward instead of one per parameter (`comm_totals()["plain_calls"]`).

A parameter that received a gradient on no rank keeps `.grad` unset; one that received it on
some rank only gets the synchronised sum on every rank (an arrival flag travels in the
bucket), so replicas stay identical. The flush runs at the end of every synchronising backward
that reaches GIFT (a managed or an unmanaged parameter's gradient), so every rank must run the
same number of those (as with DDP).

The bucket is not frozen at `apply`: a parameter frozen then and unfrozen later, a layer added
later, or parameters replaced by `load_state_dict(assign=True)` are found at the next flush
(each rank's layout-changed flag rides in the same all-reduce) and synchronised from that
backward on (`PlainSync._relayout`, logged). `torch.autograd.grad` on an unmanaged parameter
is refused: its synchronised value only exists at the end of the backward, in `.grad`.

Accumulation: a synchronising backward routes each incoming gradient into its slot and lets
autograd accumulate zeros, then adds the synchronised value to `.grad`, so gradients summed
over several synchronising backward passes stay right for `avg` and `sum`. Inside
`gift_compile.no_sync` gradients accumulate locally and the parameter is marked dirty; the
next synchronising backward sends its whole accumulated `.grad` once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from gift_compile.config import GiftConfig, ReduceOp
from gift_compile.exchange import collectives
from gift_compile.exchange.collectives import (C_CALLS, C_NONFINITE, C_NONFINITE_RANKS, C_PLAIN_CALLS, RANK_BITS,
                                               ItemTensors, Segment)
from gift_compile.exchange.mark import SyncMode
from gift_compile.exchange.plan import Collective, ItemPlan
from gift_compile.frameworks.adapter import attach
from gift_compile.frameworks.euclidean import outside_item
from gift_compile.frameworks.routing import ManageMode, manage
from gift_compile.runtime.health import queue_backward_check
from gift_compile.runtime.state import GiftState
from gift_compile.sync import GroupByName

__all__ = ["ARRIVED_ITEM", "PLAIN", "PlainSync"]

logger = logging.getLogger("gift_compile")

ARRIVED_ITEM = "<plain-sync arrivals>"  # the bucket's last item: which parameters got a gradient


class PlainSync:
    """The bucket of a model's unmanaged parameters and the hooks that fill and flush it.

    The bucket follows the model: at the end of every synchronising backward each rank
    compares the parameters that require a gradient now (unmanaged ones, and the managed
    weights' tensors) with those it hooked, and says whether they changed in the same
    all-reduce as the gradients (one flag per rank). If any rank's did (a norm frozen at
    `apply` and unfrozen since, a layer added after `apply`, parameters replaced by
    `load_state_dict(assign=True)`), every rank rebuilds the bucket, agrees on the new layout
    (a rank that changed alone makes every rank raise, naming the difference), hooks the new
    parameters and sends the gradients they accumulated unhooked in a second all-reduce, so
    no parameter that requires a gradient ever stays unsynchronised (logged once per change).
    """

    # held by name, so a destroyed group's threads end with it (`gift_compile.sync.GroupByName`)
    group = GroupByName()

    def __init__(self, model: nn.Module, state: GiftState, group: dist.ProcessGroup) -> None:
        self.model = model
        self.state = state
        self.group = group
        self.average = state.config.reduce_op is ReduceOp.AVG
        _, self.world, self.me = collectives.group_info(group)
        self._hooks: dict[int, Any] = {}  # id(parameter) -> its hook handle(s)
        # each parameter's item by name (`euclidean.outside_item`): plan and runtime tensors
        self._items: dict[str, tuple[ItemPlan | None, ItemTensors | None]] = {}
        self._layout(*self._current())

    def _current(self) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
        """The unmanaged parameters that require a gradient now, in parameter order, and the
        managed weights that do."""
        managed = list({id(w): w for w in map(self.state.weight, self.state.layers)}.values())
        ids = {id(w) for w in managed}
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in ids]
        return params, [w for w in managed if w.requires_grad]

    def _layout(self, params: list[tuple[str, torch.Tensor]], watched: list[torch.Tensor]) -> None:
        """Cut the flat buffer for `params`: every parameter's slot in parameter order, one
        arrival flag per parameter, then per rank a non-finite flag and a layout-changed flag
        (each rank sets its own; the sum names them)."""
        self.params, self.watched = params, watched
        self.state.backward_watch.synced_params = list(params)  # the replica check compares them too
        self.index = {id(p): i for i, (_, p) in enumerate(params)}
        self.key = tuple(id(p) for _, p in params) + (-1,) + tuple(id(w) for w in watched)
        device = params[0][1].device if params else self.state.counters.device
        layout = self.state.layout
        for n, p in params:  # each name's item once: its residual lives in the state (checkpointed)
            if n not in self._items:
                self._items[n] = outside_item(self.state, n, tuple(p.shape), self.world, device,
                                              collective=Collective.ALL_REDUCE, layout=layout)
        self.segments = [Segment(n, 1, p.numel()) if self._items[n][0] is None
                         else Segment(n, self._items[n][0].rows, self._items[n][0].cols, *self._items[n])
                         for n, p in params]
        self.segments.append(Segment(ARRIVED_ITEM, 1, len(params) + 2 * self.world))  # flags: exact fp32 sums
        self.plan = collectives.bucket_plan(self.segments, torch.float32, world=self.world, group_name=self.group_name,
                                            average=False, op=Collective.ALL_REDUCE, layout=layout)
        self.n_values = sum(p.numel() for _, p in params)
        # nothing coded (the fp32 opt-outs): one native all-reduce, whose ring costs what the
        # bucket's all_to_all + all_gather would at fp32 in fewer steps and one launch
        self.raw = all(self._items[n][0] is None for n, _ in params)
        self.baseline_bytes = sum(p.numel() * p.element_size() for _, p in params)
        self.flat = torch.zeros(self.n_values + len(params) + 2 * self.world, device=device)
        self.slots, offset = [], 0
        for _, p in params:
            self.slots.append(self.flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.arrived = self.flat[offset:offset + len(params)]
        self.flags = self.flat[offset + len(params):offset + len(params) + self.world]
        self.changed = self.flat[offset + len(params) + self.world:]

    def install(self) -> list[Any]:
        """Agree on the bucket's plan across ranks (names, order, sizes) and register the
        hooks; the one handle returned takes every hook out (`api.remove`)."""
        collectives.check_plan_agreement(self.plan, self.group, always=True)
        self._rehook()
        self.state.backward_watch.flushes.append(self.flush)  # every synchronising backward's end
        # `load_state_dict(assign=True)` replaces parameters: the hooks move to the new tensors
        # now, since none of the old ones would fire to start the next backward's flush
        self._loaded = self.model.register_load_state_dict_post_hook(lambda module, keys: self._rebind())
        return [self]

    def remove(self) -> None:
        """Take out every hook this bucket registered and its flush (the state's handle protocol)."""
        if self.flush in self.state.backward_watch.flushes:
            self.state.backward_watch.flushes.remove(self.flush)
        self._loaded.remove()
        self.state.backward_watch.synced_params = []
        for handles in self._hooks.values():
            for h in handles:
                h.remove()
        self._hooks.clear()

    def _rebind(self) -> None:
        """Hook the tensors now at the bucket's names when the layout (names, order, shapes,
        dtypes) is unchanged: a local change, nothing to agree on. Any other change is found
        by the next flush."""
        params, watched = self._current()
        same = [(n, p.shape, p.dtype) for n, p in params] == [(n, p.shape, p.dtype) for n, p in self.params]
        if same and len(watched) == len(self.watched):
            self._layout(params, watched)
            self._rehook()

    def _rehook(self) -> list[str]:
        """Hook what the layout holds and unhook what it no longer does; the names of the
        unmanaged parameters newly hooked."""
        wanted = {id(p): (i, p) for i, (_, p) in enumerate(self.params)}
        wanted.update({id(w): (-1, w) for w in self.watched})
        for key in [k for k in self._hooks if k not in wanted]:
            for h in self._hooks.pop(key):
                h.remove()
        new = []
        for key, (i, p) in wanted.items():
            if key in self._hooks:
                continue
            if i < 0:  # a managed weight: its accumulated gradient queues the end-of-backward work
                self._hooks[key] = [p.register_post_accumulate_grad_hook(lambda _: queue_backward_check(self.state))]
            else:
                self._hooks[key] = [p.register_hook(self._incoming(p))]
                new.append(self.params[i][0])
        return new

    def _incoming(self, p: torch.Tensor) -> Any:
        key = id(p)
        st = self.state
        # the parameter's gradient accumulator, held so the engine can be asked whether this
        # backward will accumulate into `.grad` (not under `torch.autograd.grad`)
        with torch.enable_grad():  # also when re-hooking in the flush (no_grad)
            accumulator = p.view_as(p).grad_fn.next_functions[0][0]

        def hook(g: torch.Tensor) -> torch.Tensor | None:
            try:
                torch._C._will_engine_execute_node(accumulator)
            except RuntimeError:  # torch raises this for a leaf only inside torch.autograd.grad
                st.backward_watch.queued = False  # the failed backward runs no end-of-backward callback
                raise RuntimeError(
                    f"GIFT: torch.autograd.grad asked for the gradient of {self._name(key)}, a parameter GIFT "
                    "synchronises at the end of a backward into .grad (one all-reduce for all "
                    "of them, in a fixed order); autograd.grad would return its local gradient unsynchronised. "
                    "Call loss.backward() (or torch.autograd.backward(loss, inputs=...)) and read .grad") from None
            if st.sync_mode is not SyncMode.SYNC:
                st.dirty_params.add(key)
                return None
            queue_backward_check(st)
            if key in st.dirty_params:
                return None  # the whole accumulated .grad is sent at the flush
            i = self.index[key]
            self.slots[i].add_(g)
            self.arrived[i] = 1.0
            return torch.zeros_like(g)  # autograd accumulates nothing; the flush adds the sum

        return hook

    def _name(self, key: int) -> str:
        return next((n for n, p in self.params if id(p) == key), "a parameter")

    @torch.no_grad()
    def flush(self) -> None:
        """End of a synchronising backward: one all-reduce of the flat buffer, then each
        parameter that got a gradient on any rank receives the synchronised sum (or mean);
        if any rank's trainable parameters changed, every rank re-lays the bucket out and
        sends what the new parameters accumulated (`_relayout`)."""
        st = self.state
        params, watched = self._current()
        key = tuple(id(p) for _, p in params) + (-1,) + tuple(id(w) for w in watched)
        for i, (_, p) in enumerate(self.params):
            if id(p) in st.dirty_params:
                st.dirty_params.discard(id(p))
                if p.grad is not None:
                    self.slots[i].add_(p.grad)
                    self.arrived[i] = 1.0
                    p.grad.zero_()
        values = self.flat[: self.n_values]
        self.flags[self.me] = 0.0 if bool(torch.isfinite(values).all()) else 1.0
        self.changed[self.me] = float(key != self.key)
        counted = int(st.counters[C_NONFINITE])
        config = st.config
        if self.raw:
            dist.all_reduce(self.flat, group=self.group)
            self._count_raw()
        else:
            collectives.sync_buffer(self.flat, self.segments, st.shared, op=Collective.ALL_REDUCE, group=self.group,
                                    average=False, out=self.flat, ranks_per_node=config.ranks_per_node,
                                    intra_node_format=config.intra_node_format)
        bad = [r for r, f in enumerate(self.flags.tolist()) if f > 0]
        # a coded item's header already counted its non-finite collective: the ranks are still ours
        self._count(bad, counted=int(st.counters[C_NONFINITE]) > counted)
        for (_, p), slot, arrived in zip(self.params, self.slots, self.arrived.tolist()):
            if arrived > 0:
                synced = (slot / self.world if self.average else slot).to(p.dtype)
                if p.grad is None:
                    p.grad = synced.clone() if synced.data_ptr() == slot.data_ptr() else synced
                else:
                    p.grad.add_(synced)
        changed = [r for r, f in enumerate(self.changed.tolist()) if f > 0]
        self.flat.zero_()
        if changed:
            self._relayout(params, watched, changed)

    def _relayout(self, params: list[tuple[str, torch.Tensor]], watched: list[torch.Tensor],
                  changed: list[int]) -> None:
        """Every rank, when rank(s) `changed` found other trainable parameters than the bucket
        holds: lay the bucket out for them, agree on it (raises on every rank, naming the
        first difference, when the ranks changed differently), hook them, and send the
        gradients the newly hooked parameters accumulated without a hook (as after `no_sync`)."""
        self._layout(params, watched)
        collectives.check_plan_agreement(self.plan, self.group, always=True)
        new = self._rehook()
        self.state.dirty_params.update(id(p) for n, p in params if n in new and p.grad is not None)
        logger.warning("GIFT: the model's trainable parameters changed after apply (rank(s) %s): now synchronised "
                       "outside the layers (unmapped_format / tiny_format): %d unmanaged parameter(s)%s. Parameters added, unfrozen or replaced after "
                       "apply are not quantized; gift_compile.remove + apply to manage new linears.", changed,
                       len(params), f", newly: {', '.join(new)}" if new else "")
        if new:
            self.flush()

    def _count_raw(self) -> None:
        """The native all-reduce's bytes: the flat buffer handed (flags included) against the
        parameters' own bytes, all across nodes where the group spans them."""
        collectives.count_raw(self.state.counters, self.state.layout, self.flat.numel() * self.flat.element_size(),
                              self.baseline_bytes)

    def _count(self, bad: list[int], counted: bool = False) -> None:
        """The launch (as a plain call, not a managed one) and the ranks whose gradients were not
        finite into the state's counters (read by `GiftState.check_health`); the bytes the
        bucket counted itself. `counted`: a
        coded item's header counted the non-finite collective already."""
        c = self.state.counters
        c[C_PLAIN_CALLS] += 1
        if not self.raw:
            c[C_CALLS] -= 1  # the bucket counted itself a call; `calls` stays the managed weights' collectives
        if bad:
            if not counted:
                c[C_NONFINITE] += 1
            mask = 0
            for r in bad:
                mask |= 1 << min(r, RANK_BITS)
            c[C_NONFINITE_RANKS : C_NONFINITE_RANKS + 1].bitwise_or_(mask)


class _PlainAdapter:
    """A plain module, one replica per rank: GIFT synchronises every gradient itself (managed
    weights in their backward, the rest in `PlainSync`'s bucket). Accepts every model, so the
    table asks it last."""

    name = "plain"
    kind = "GIFT all-reduce in the backward graph"
    split_rows = False

    def detect(self, model: nn.Module) -> bool:
        return True

    def install(self, model: nn.Module, config: GiftConfig, group: dist.ProcessGroup | None, *,
                fuse: bool) -> GiftState:
        """Manage the linears in "sync" mode, put the other parameters on `PlainSync`, and arm
        the end-of-backward checks on each managed weight's gradient reaching `.grad` (eagerly
        after a compiled backward too; also for a weight read directly). One process has no
        gradient to communicate: nothing is managed (logged). `fuse` concerns the framework
        hooks' eager collectives; here the collective is in the compiled backward itself."""
        world = collectives.group_info(group)[1]
        if world == 1:
            logger.warning("gift_compile.apply: single process, no gradient communication to compress; nothing managed")
            state = GiftState(config, None)
            model._gift_state = state
        else:
            state = manage(model, config, group, mode=ManageMode.SYNC)
            state.handles.extend(PlainSync(model, state, group).install())
            state.handles.append(model.register_forward_pre_hook(_refuse_outer_data_parallel))
        attach(state, self.name, None)
        return state

    def no_sync(self, model: nn.Module, state: GiftState) -> AbstractContextManager[None]:
        """Managed weights accumulate into their pending buffers, the other parameters into
        `.grad` (marked dirty); the next backward outside sends the sum once."""
        return _accumulating(state)

    def remove(self, model: nn.Module, state: GiftState) -> None:
        """Nothing of the framework's to restore: every hook `install` registered is one of the
        state's handles, which `api.remove` takes out for every adapter."""

    def telemetry(self, state: GiftState) -> dict[str, float]:
        """Nothing beyond the state's counters (`plain_calls` counts `PlainSync`'s all-reduces)."""
        return {}


def wrapped_after_apply(model: nn.Module) -> str | None:
    """The data-parallel wrapper put around `model` after GIFT synchronises it itself, or None.

    `apply` on a plain module makes GIFT the model's gradient sync; a `fully_shard` or a
    `DistributedDataParallel` added afterwards brings the framework's own fp32 reduction, so
    every gradient would travel twice (GIFT's codes, then FSDP2's reduce-scatter or DDP's
    bucket all-reduce) while `comm_totals()` still reports compression. FSDP2 shows as an
    `FSDPModule` class on the model or a managed linear, DTensor weights (a parent sharded
    without the root), or FSDP2's mark on every module whose parameters it manages
    (`_is_fsdp_managed_module`: a parent sharded with the root, `nn.Sequential(model)` or
    `torch.compile(model)`, swaps unsharded tensors into the forward, so the weights read there
    are no DTensors); DDP as the module its forward is running (`_get_active_ddp_module`, set
    around the wrapped module's call, also when that call is compiled), unless that DDP was told
    to ignore every parameter of `model` (the valid split: DDP for the rest, GIFT for `model`)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    state: GiftState = model._gift_state
    if isinstance(model, FSDPModule) or getattr(model, "_is_fsdp_managed_module", False) or any(
            isinstance(m, FSDPModule) or getattr(m, "_is_fsdp_managed_module", False)
            or isinstance(m._parameters["weight"], DTensor) for m in state.modules.values()):
        return "fully_shard (FSDP2)"
    ddp = nn.parallel.DistributedDataParallel._get_active_ddp_module()
    if ddp is not None and not _ignored_by(ddp, model):
        return "DistributedDataParallel"
    return None


def _ignored_by(ddp: nn.parallel.DistributedDataParallel, model: nn.Module) -> bool:
    """Whether `ddp` ignores every trainable parameter of `model` (its submodule): then DDP's
    reducer never carries them and GIFT's sync is their only one."""
    ignored = {id(p) for n, p in ddp.module.named_parameters() if n in ddp.parameters_to_ignore}
    return all(id(p) in ignored for p in model.parameters() if p.requires_grad)


def _refuse_outer_data_parallel(model: nn.Module, args: Any) -> None:
    """Forward pre-hook of a model GIFT synchronises itself: raise, on every rank (each wrapped
    its model the same way) and before any gradient moves, when a data-parallel wrapper was put
    around it after `apply` (`wrapped_after_apply`)."""
    wrapper = wrapped_after_apply(model)
    if wrapper is not None:
        first = "fully_shard(...) the model" if wrapper.startswith("fully_shard") else \
            "model = DistributedDataParallel(model)"
        raise RuntimeError(
            f"gift_compile: {wrapper} was applied after gift_compile.apply, so every gradient would be sent twice "
            f"(GIFT's codes, then {wrapper}'s own fp32 reduction); wrap first, then apply: {first}, then "
            "gift_compile.apply(model, ...) (gift_compile.remove undoes this apply)")


@contextmanager
def _accumulating(state: GiftState) -> Iterator[None]:
    state.enter_accumulate()
    try:
        yield
    finally:
        state.exit_accumulate()


PLAIN = _PlainAdapter()
