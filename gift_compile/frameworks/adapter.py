"""The adapter protocol: what every way of training GIFT hooks into offers `gift_compile.api`.

An adapter owns one framework's gradient path (plain modules, DDP, FSDP2, SimpleFSDP's traced
reduce-scatters): it recognises a model of its framework (`detect`), manages the model's
weights and puts GIFT into the framework's gradient reduction (`install`, which returns the
`GiftState`), accumulates without communicating the framework's way (`no_sync`), takes its
hooks back out (`remove`) and reports what it measured itself (`telemetry`). `api.apply`,
`api.no_sync` and `api.remove` call adapters only through the table
(`gift_compile.frameworks.table`), so a new framework is one module with one adapter and one
table entry: nothing in `api` or `GiftState` names it.

What an adapter keeps per state (FSDP2's comm timer, HSDP's replica hop) lives in the state's
one generic slot, `GiftState.adapters`, under the adapter's name (`attach`, `attached`): the
state's fields stay those of every framework.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist
import torch.nn as nn

from gift_compile.config import GiftConfig
from gift_compile.runtime.state import GiftState

__all__ = ["Adapter", "attach", "attached"]


@runtime_checkable
class Adapter(Protocol):
    """One framework's hook into GIFT (see the module docstring)."""

    name: str
    """The adapter's key in the table and in `GiftState.adapters`."""

    kind: str
    """How the managed gradients travel, for `apply`'s log line."""

    split_rows: bool
    """Whether the framework reduce-scatters: a managed weight's rows must then split over the
    group (weight eligibility, `gift_compile.frameworks.routing.eligible_linears`)."""

    def detect(self, model: nn.Module) -> bool:
        """Whether `model` is of this adapter's framework (the table asks in order; first wins)."""
        ...

    def install(self, model: nn.Module, config: GiftConfig, group: dist.ProcessGroup | None, *,
                fuse: bool) -> GiftState:
        """Manage `model`'s weights with `config` over `group` and hook GIFT into the
        framework's gradient reduction; the returned state has this adapter `attach`ed and is
        reachable as `model._gift_state`. `fuse` compiles eager collectives (fused kernels)."""
        ...

    def no_sync(self, model: nn.Module, state: GiftState) -> AbstractContextManager[None]:
        """A context inside which backward passes accumulate gradients without communicating."""
        ...

    def remove(self, model: nn.Module, state: GiftState) -> None:
        """Undo what `install` did to the framework (the managed modules' classes, the state's
        handles and the state itself are undone by `api.remove` for every adapter)."""
        ...

    def telemetry(self, state: GiftState) -> dict[str, float]:
        """What this adapter measured itself since the last call (the state's counters are
        `GiftState.comm_totals`), by metric name; the caller normalises per step."""
        ...


def attach(state: GiftState, name: str, kept: Any) -> None:
    """Record that adapter `name` is installed on `state`, keeping `kept` (None: nothing) in
    the state's per-adapter slot; raises if it is already installed there."""
    if name in state.adapters:
        raise ValueError(f"GIFT: the {name!r} adapter is already installed on this state")
    state.adapters[name] = kept


def attached(state: GiftState, name: str) -> Any:
    """What adapter `name` keeps on `state` (raises naming it when it is not installed)."""
    if name not in state.adapters:
        raise KeyError(f"GIFT: the {name!r} adapter is not installed on this state (installed: "
                       f"{', '.join(state.adapters) or 'none'})")
    return state.adapters[name]
