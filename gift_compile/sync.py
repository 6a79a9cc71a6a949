"""Blocking host collectives for refresh-time statistics (off the compiled hot path).

Refresh averages K-FAC factors (or reduces their sketches onto the layer's owner), gradient factors and selection measurements over the
data-parallel group and broadcasts the new transforms. These are ordinary blocking
``torch.distributed`` calls, with one catch on gloo: its worker thread releases a finished
collective's tensors a moment *after* the caller's ``wait`` returns. When that release is
the tensor's last reference (a temporary), the worker must take the GIL to free the
Python object; if the interpreter is already shutting down (a refresh on the final step,
then exit) it cannot, and the process aborts with "terminate called without an active
exception". Every collective here therefore keeps its tensor referenced until a few later
collectives have run, so the worker's release is never the last one.

The same release can come from collectives this package does not own (the trainer's metric
reductions, FSDP2's, a process group that outlives ``destroy_process_group`` because a device
mesh or the trainer still references it; GIFT's own objects hold groups by name,
:class:`GroupByName`). A process whose distributed work is finished and
whose output is flushed therefore leaves through :func:`exit_without_finalization`, which
skips interpreter finalization and with it the race (seen in 2 of 4 four-rank HSDP runs
under CI load, and in the convergence workers).
"""

from __future__ import annotations

import logging
import os
import sys
from collections import deque
from typing import NoReturn

import torch
import torch.distributed as dist

__all__ = ["GroupByName", "all_gather_object_", "all_reduce_", "broadcast_", "exit_without_finalization",
           "group_rank", "process_group", "reduce_", "world_size"]

# The most recent communicated tensors (see the module docstring). Bounded so at most a few
# refresh buffers outlive their use.
_RECENT: deque[torch.Tensor] = deque(maxlen=4)


def process_group(group: dist.ProcessGroup | str) -> dist.ProcessGroup:
    """`group`, or the process group registered under that name: traced collectives name their
    group (functional collectives take names), eager code holds the object, and plans carry the
    name; this is the one place that turns a name back into the group."""
    return dist.distributed_c10d._resolve_process_group(group) if isinstance(group, str) else group


class GroupByName:
    """A process-group attribute kept as the group's registered name, resolved on each read.

    A `ProcessGroup` object referenced from Python outlives `destroy_process_group`, and with
    it gloo's worker and transport threads: they keep running into interpreter finalization,
    where a worker that drops a collective's last tensor reference cannot take the GIL and the
    process aborts ("terminate called without an active exception") after the job has finished.
    GIFT's states live as long as the model, so they hold no group object:
    `destroy_process_group` then really ends the group's threads. Reading the attribute after
    the group was destroyed raises, naming the group (it is used only where the group must
    still exist). The name itself is the public attribute `<attribute>_name` (`group_name` for
    `group`): plans and traced code read that, without resolving the group.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.slot = f"{name}_name"

    def __get__(self, obj: object, owner: type | None = None) -> dist.ProcessGroup | None:
        if obj is None:
            return self  # type: ignore[return-value]  # the class attribute itself
        name = getattr(obj, self.slot)
        if name is None:
            return None
        try:
            return process_group(name)
        except RuntimeError as e:
            raise RuntimeError(f"GIFT: {type(obj).__name__}.{self.name}: process group {name!r} no longer exists "
                               "(destroy_process_group was called); GIFT cannot communicate over it") from e

    def __set__(self, obj: object, group: dist.ProcessGroup | str | None) -> None:
        setattr(obj, self.slot, group if group is None or isinstance(group, str) else group.group_name)


def world_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group``; 1 without a group or an initialised process group."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank within ``group`` (0 without communication)."""
    return dist.get_rank(group) if world_size(group) > 1 else 0


def all_reduce_(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``t`` over ``group`` in place (no-op on one rank); returns ``t``."""
    if world_size(group) > 1:
        _RECENT.append(t)
        dist.all_reduce(t, group=group)
    return t


def reduce_(t: torch.Tensor, group: dist.ProcessGroup | None, dst: int = 0) -> torch.Tensor:
    """Sum ``t`` over ``group`` into group rank ``dst``'s copy, in place (no-op on one rank).

    Only ``dst`` may read the result: backends use the other ranks' ``t`` as scratch, so it
    is unspecified there. Cheaper than ``all_reduce_`` when one rank alone consumes the sum
    (the owner that rebuilds a layer's transform). Returns ``t``.
    """
    if world_size(group) > 1:
        _RECENT.append(t)
        dist.reduce(t, dst=dist.get_global_rank(group, dst), group=group)
    return t


def broadcast_(t: torch.Tensor, group: dist.ProcessGroup | None, src: int = 0) -> torch.Tensor:
    """Overwrite ``t`` with group rank ``src``'s copy, in place (no-op on one rank); returns ``t``."""
    if world_size(group) > 1:
        _RECENT.append(t)
        dist.broadcast(t, src=dist.get_global_rank(group, src), group=group)
    return t


def all_gather_object_(obj: object, group: dist.ProcessGroup | None) -> list[object]:
    """Every rank's ``obj`` (picklable), in group rank order; ``[obj]`` on one rank."""
    if world_size(group) <= 1:
        return [obj]
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def exit_without_finalization(code: int = 0) -> NoReturn:
    """Flush logs and standard streams, then end the process with ``code`` at once.

    For the end of a distributed program whose process group is destroyed and whose results
    are written (see the module docstring): gloo's worker threads may still release a
    collective's last tensor reference, which aborts a process that is finalizing the
    interpreter. Only a success path calls this; errors propagate as usual.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
