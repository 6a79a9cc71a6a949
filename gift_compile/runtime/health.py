"""The checks that run when a backward's collectives have completed, whatever drives the step.

Every GIFT collective writes, into the state's counters, whether any rank's gradient was
non-finite and whether any rank's plan differed (the headers all ranks exchanged). At the end
of each backward that ran GIFT's collectives (the autograd engine's final callback, queued by
`queue_backward_check` from the collective's hook or from a managed weight's gradient
accumulation) `end_of_backward` reads them (`GiftState.check_health`: the same error on every
rank, in the same backward) and runs the replica check below. So `apply` without
`optimizer=` is as safe as with it: neither the optimizer hook nor `gift_compile.step` is
needed for a fault to raise before the optimizer changes anything. A state that never
advances (no `optimizer=`, no `gift_compile.step`) is warned about once.

A fault seen by one GIFT state among several of a job (pipeline stages, tensor-parallel
blocks: each state spans only the ranks holding the same weights): `check_health_group`.
The end-of-backward check cannot raise there, since the other states saw nothing and their
ranks would wait at their next pipeline send or tensor-parallel collective for a rank that
left; nor can it run a collective over the job, since a stage's backward is interleaved with
its pipeline sends and receives, which other stages wait on in another order. So with a
health group (`GiftState.health_group`, set by `gift_compile.api.attach_optimizer`) each
check records the faults, and the optimizer's step pre-hook, which every rank reaches once per
step, sums every rank's record over the group and raises the same error on all of them before
any optimizer changes a weight.

Replica check of GIFT's own sync: a managed weight whose gradient bypassed the collective.

On a plain module GIFT synchronises a managed weight in the backward of the identity its
layer's forward routes the weight through. Code that reads the weight directly
(`F.linear(h, self.fc2.weight, self.fc2.bias)` in a custom block, a tied or wrapped weight)
puts a gradient into `.grad` that no collective saw, and the replicas drift apart without an
error. After a correct sync every rank holds bit-identical gradients (every rank decodes the
same bytes), so GIFT checks exactly that at the end of each synchronising backward: a 64-bit checksum of each
managed weight's gradient bits, and of each parameter the fp32 bucket synchronised
(`BackwardWatch.synced_params`: a rank-dependent edit of such a `.grad` shows the same way),
summed into one small table over the group, compared on every rank. A difference raises `GiftReplicaError` on every rank, naming the weights and ranks,
before the optimizer changes anything (and before `zero_grad` could hide it). The fix is to call the module (`self.fc2(h)`), or to
take the weight off GIFT's path with `GiftConfig(exclude=("*fc2*",))`: unmanaged parameters
are synchronised by `gift_compile.frameworks.plain_sync`, which hooks the parameter itself and so sees
every use of it.

DDP and FSDP2 synchronise the whole `.grad` of every parameter themselves, and SimpleFSDP
models read the weight through GIFT's property, so the check applies to GIFT's own sync only.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from gift_compile.exchange.mark import SyncMode
from gift_compile.runtime.state import Faults, GiftHealthError, GiftState
from gift_compile.sync import all_reduce_, group_rank, world_size

__all__ = ["GiftReplicaError", "check_health_group", "check_replicas", "end_of_backward", "grad_checksum",
           "queue_backward_check"]

logger = logging.getLogger("gift_compile")


class GiftReplicaError(RuntimeError):
    """Raised on every rank when managed weights' gradients differ between replicas."""


def grad_checksum(grad: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """`[present, sum of the bit patterns]` (int64, on `device`) of a gradient; `[0, 0]` for
    None. Integer sums are exact and order-independent, so equal gradients give equal sums."""
    if grad is None:
        return torch.zeros(2, dtype=torch.int64, device=device)
    bits = {4: torch.int32, 2: torch.int16}[grad.element_size()]
    total = grad.detach().contiguous().view(bits).sum(dtype=torch.int64).to(device)
    return torch.stack([torch.ones((), dtype=torch.int64, device=device), total])


def synced_layers(state: GiftState) -> list[str]:
    """The managed weights GIFT synchronises itself (in their layer's backward)."""
    return [n for n, m in state.modules.items() if getattr(m, "_gift_group_name", None) is not None]


@torch.no_grad()
def check_replicas(state: GiftState) -> None:
    """Raise `GiftReplicaError` on every rank unless every rank holds bit-identical
    gradients for each managed weight of GIFT's own sync and each parameter its fp32 bucket
    synchronises (`BackwardWatch.synced_params`; one small all-reduce)."""
    layers = synced_layers(state)
    names = [*layers, *(n for n, _ in state.backward_watch.synced_params)]
    world = state.world()
    if not names or world <= 1:
        return
    device = state.counters.device  # where the group's collectives run
    grads = [state.modules[n]._parameters["weight"].grad for n in layers]
    grads += [p.grad for _, p in state.backward_watch.synced_params]
    mine = torch.stack([grad_checksum(g, device) for g in grads])
    table = torch.zeros(world, *mine.shape, dtype=torch.int64, device=device)
    table[group_rank(state.group)] = mine
    table = all_reduce_(table, state.group).cpu()
    differ = [(n, [r for r in range(world) if not torch.equal(table[r, i], table[0, i])])
              for i, n in enumerate(names) if not (table[:, i] == table[0, i]).all()]
    if any(n in layers for n, _ in differ):
        listed = "; ".join(f"{n} (rank(s) {ranks} differ from rank 0)" for n, ranks in differ)
        raise GiftReplicaError(
            f"GIFT: the gradients of {len(differ)} managed weight(s) differ between replicas before the optimizer "
            f"step: {listed}. Their gradient reached .grad without GIFT's sync: the weight is read directly "
            "(e.g. F.linear(x, module.weight)) instead of by calling its module. Call the module, or exclude the "
            "weight from GIFT (GiftConfig(exclude=...)) so it is synchronised at full precision."
        )
    if differ:
        listed = "; ".join(f"{n} (rank(s) {ranks} differ from rank 0)" for n, ranks in differ)
        raise GiftReplicaError(
            f"GIFT: the gradients of {len(differ)} parameter(s) synchronised at full precision differ between "
            f"replicas before the optimizer step: {listed}. Something on those ranks wrote into .grad besides "
            "GIFT's sync (a gradient hook, a rank-dependent edit of .grad during the backward)."
        )


def queue_backward_check(state: GiftState, *, after_framework: bool = False) -> None:
    """Run `end_of_backward(state)` once when the running backward completes (called by every
    hook through which a backward reaches GIFT's collectives; later calls in the same backward
    are no-ops). Outside a backward (a collective called directly) the checks run now.

    `after_framework`: the framework queues its own end-of-backward callback after this call
    (DDP's reducer queues its finalisation once the last bucket is handed over, and waits
    there for every bucket's future), so the check is queued from a first callback and runs
    after the framework's: it then reads counters every exchange has written, and an error it
    raises does not cut the framework's finalisation short (which left DDP's reducer expecting
    the abandoned step's buckets: every later backward failed an internal assert)."""
    watch = state.backward_watch
    if watch.queued or not state.active:
        return
    if torch._C._current_graph_task_id() == -1:
        end_of_backward(state)
        return
    watch.queued, watch.checked = True, False
    engine = torch.autograd.Variable._execution_engine
    if after_framework:
        engine.queue_callback(lambda: engine.queue_callback(lambda: end_of_backward(state)))
    else:
        engine.queue_callback(lambda: end_of_backward(state))


def end_of_backward(state: GiftState) -> None:
    """The checks of a completed backward, after the end-of-backward collectives of a
    synchronising one (`BackwardWatch.flushes`): the health counters (a non-finite gradient or a
    plan mismatch on any rank raises on every rank), the replica check of GIFT's own sync
    (skipped while `no_sync` accumulates local gradients on purpose), and a warning, once,
    when the state has not advanced for more than a refresh interval of optimizer steps."""
    watch = state.backward_watch
    watch.queued = False
    syncing = state.sync_mode is SyncMode.SYNC
    if syncing:
        for flush in watch.flushes:
            flush()
    # an optimizer step changes the managed weights in place (their version counters): one
    # between two backward passes that `GiftState.step` did not follow is a step the state
    # missed (micro-batches and pipeline stages of one step change no weight)
    versions = sum(state.weight(name)._version for name in state.modules)
    if watch.versions is not None and versions != watch.versions:
        watch.since_step += 1
    watch.versions = versions
    if watch.since_step > state.config.refresh_every and not watch.warned:
        watch.warned = True
        logger.warning(
            "GIFT: %d optimizer steps and the GIFT state has not advanced: its geometry never "
            "refreshes and stochastic-rounding seeds repeat. Pass optimizer= to gift_compile.apply, or call "
            "gift_compile.step(model) after every optimizer step.", watch.since_step)
    watch.checked = True  # set first: the check consumes the counters whether or not it raises
    state.check_health()
    if syncing:
        check_replicas(state)


# Rows of `check_health_group`'s table, one column per rank of the health group.
_NONFINITE_SEEN, _NONFINITE_FROM, _MISMATCH_SEEN, _MISMATCH_FROM = range(4)


@torch.no_grad()
def check_health_group(state: GiftState) -> None:
    """Raise the same error on every rank of `state.health_group` if any rank's GIFT state
    recorded a fault since the last call (one small all-reduce; call it where every rank of
    the group arrives once per step, before the optimizer: `attach_optimizer`'s pre-hook).

    Each rank contributes how many faulty collectives its state saw and which ranks its headers
    flagged, translated from its state's group to the health group; the error names them as
    global ranks: the ranks whose gradient was non-finite (or whose plan differed) and the
    ranks whose states saw it, so a pipeline stage's fault is named on every stage.
    """
    group = state.health_group
    if group is None:
        return
    state.check_health()  # collectives since the last backward's check: into pending_faults
    faults, state.pending_faults = state.pending_faults, Faults()
    table = torch.zeros(4, world_size(group), dtype=torch.int64, device=state.counters.device)
    me = group_rank(group)
    table[_NONFINITE_SEEN, me], table[_MISMATCH_SEEN, me] = faults.nonfinite, faults.mismatch
    for row, ranks in ((_NONFINITE_FROM, faults.nonfinite_ranks), (_MISMATCH_FROM, faults.mismatch_ranks)):
        for r in ranks:
            table[row, dist.get_group_rank(group, dist.get_global_rank(state.group, r))] = 1
    table = all_reduce_(table, group).cpu()

    def ranks(row: int) -> list[int]:
        return [dist.get_global_rank(group, r) for r in range(table.shape[1]) if int(table[row, r])]

    everyone = f"raised on all {table.shape[1]} ranks before the optimizer step"
    if table[_MISMATCH_SEEN].any():
        raise GiftHealthError(
            f"GIFT: collectives in this step ran with a plan that differs between ranks: rank(s) "
            f"{ranks(_MISMATCH_FROM)} differ from their data-parallel peers (seen by the GIFT states of rank(s) "
            f"{ranks(_MISMATCH_SEEN)}, in up to {int(table[_MISMATCH_SEEN].max())} collective(s); different format, "
            f"shapes, layers or layer order); {everyone}; the gradients of this step are garbage"
        )
    if table[_NONFINITE_SEEN].any():
        raise FloatingPointError(
            f"GIFT: gradient collectives in this step carried NaN/Inf from rank(s) {ranks(_NONFINITE_FROM)} (seen "
            f"by the GIFT states of rank(s) {ranks(_NONFINITE_SEEN)}, in up to {int(table[_NONFINITE_SEEN].max())} "
            f"collective(s)); {everyone} (nonfinite='error'). Skip the step (zero the gradients) or set "
            "nonfinite='propagate'."
        )

