"""Full-precision sync of the parameters GIFT does not manage, for `apply` on a plain module.

GIFT synchronises a plain (non-DDP, non-FSDP) module itself: managed weights through their
quantized collective in the backward, every other parameter (biases, norms, embeddings,
excluded or small weights) here. Those gradients are packed in a FIXED order, the model's
parameter order, into ONE bucket that runs through the same bucketed core as passthrough items
elsewhere (`collectives.run_bucket`: one all_to_all plus one all_gather of raw bytes, summed in
fp32 in rank order), launched once per synchronising backward, at its end, when every gradient
has arrived. So:

* a rank whose backward produces gradients in another order cannot pair the wrong tensors
  (each parameter has its slot; item names and order are in the plan fingerprint);
* the bucket's header carries the non-finite flag and fingerprint of the plain gradients too,
  so a NaN/Inf in a norm gain on one rank raises on every rank at the optimizer step
  (`GiftState.check_health`), like a managed weight's;
* one launch per backward instead of one per parameter (`comm_totals()["plain_calls"]`).

A parameter that received a gradient on no rank keeps `.grad` unset; one that received it on
some rank only gets the synchronised sum on every rank (an arrival flag travels in the
bucket), so replicas stay identical. Every rank must run the same number of synchronising
backward passes that reach unmanaged parameters (as with DDP).

Accumulation: a synchronising backward routes each incoming gradient into its slot and lets
autograd accumulate zeros, then adds the synchronised value to `.grad`, so gradients summed
over several synchronising backward passes stay right for `avg` and `sum`. Inside
`gift_compile.no_sync` gradients accumulate locally and the parameter is marked dirty; the
next synchronising backward sends its whole accumulated `.grad` once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from gift_compile import collectives
from gift_compile.collectives import C_CALLS, C_MISMATCH_RANKS, C_NONFINITE_RANKS, C_PLAIN_CALLS
from gift_compile.plan import BucketPlan, ItemPlan
from gift_compile.state import GiftState

__all__ = ["PlainSync", "ARRIVED_ITEM"]

ARRIVED_ITEM = "<plain-sync arrivals>"  # the bucket's last item: which parameters got a gradient


class PlainSync:
    """The bucket of a model's unmanaged parameters and the hooks that fill and flush it."""

    def __init__(self, model: nn.Module, state: GiftState, group: dist.ProcessGroup) -> None:
        managed = {id(m._parameters["weight"]) for m in state.modules.values()}
        self.state = state
        self.group = group
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in managed]
        name, world, _ = collectives.group_info(group)
        items = [ItemPlan.passthrough(n, p.numel(), p.dtype) for n, p in self.params]
        items.append(ItemPlan.passthrough(ARRIVED_ITEM, len(self.params), torch.float32))
        self.plan = BucketPlan(tuple(items), world, name, state.config.reduce_op == "avg", "all_reduce")
        self.slots = [torch.zeros_like(p, memory_format=torch.contiguous_format) for _, p in self.params]
        self.arrived = torch.zeros(len(self.params), device=self.slots[0].device if self.slots else None)
        self._queued = False

    def install(self) -> list[Any]:
        """Agree on the bucket's plan across ranks (names, order, sizes) and register the hooks."""
        if not self.params:
            return []
        collectives.check_plan_agreement(self.plan, self.group, always=True)
        return [p.register_hook(self._incoming(i, p)) for i, (_, p) in enumerate(self.params)]

    def _incoming(self, i: int, p: torch.Tensor) -> Any:
        key = id(p)
        st = self.state

        def hook(g: torch.Tensor) -> torch.Tensor | None:
            if st.sync_mode != "sync":
                st.dirty_params.add(key)
                return None
            self._queue_flush()
            if key in st.dirty_params:
                return None  # the whole accumulated .grad is sent at the flush
            self.slots[i].add_(g)
            self.arrived[i] = 1.0
            return torch.zeros_like(g)  # autograd accumulates nothing; the flush adds the sum

        return hook

    def _queue_flush(self) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    @torch.no_grad()
    def flush(self) -> None:
        """End of a synchronising backward: one bucket collective over every slot, then each
        parameter that got a gradient on any rank receives the synchronised sum."""
        self._queued = False
        st = self.state
        for i, (_, p) in enumerate(self.params):
            if id(p) in st.dirty_params:
                st.dirty_params.discard(id(p))
                if p.grad is not None:
                    self.slots[i].add_(p.grad)
                    self.arrived[i] = 1.0
                    p.grad.zero_()
        counters = torch.zeros_like(st.counters)
        shared = collectives.Shared(st.seed, st.rank, counters)
        outs, _ = collectives.run_bucket([*self.slots, self.arrived], [None] * len(self.plan.items), shared, self.plan)
        counters[C_PLAIN_CALLS] += counters[C_CALLS]  # counted apart from GIFT's quantized calls
        counters[C_CALLS] = 0
        masks = slice(C_NONFINITE_RANKS, C_MISMATCH_RANKS + 1)  # rank masks are OR-ed, the rest added
        st.counters[masks].bitwise_or_(counters[masks])
        counters[masks] = 0
        st.counters.add_(counters)
        for (_, p), slot, out, arrived in zip(self.params, self.slots, outs, outs[-1].tolist()):
            if arrived > 0:
                synced = out.reshape(p.shape).to(p.dtype)
                if p.grad is None:
                    p.grad = synced
                else:
                    p.grad.add_(synced)
            slot.zero_()
        self.arrived.zero_()
