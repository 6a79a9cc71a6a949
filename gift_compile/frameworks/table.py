"""The table of framework adapters (`gift_compile.frameworks.adapter.Adapter`), by name.

`api.apply` takes the first adapter, in table order, whose `detect` accepts the model; `api.
no_sync`, `api.remove` and telemetry reach the adapters a state has installed by the names in
`GiftState.adapters`. The order matters only where frameworks nest: DDP and FSDP2 wrap plain
modules, SimpleFSDP's DTensor parameters are not FSDP2 modules, and the plain adapter accepts
every model, so it is last.

HSDP's replica hop, tensor parallelism and pipeline parts are not entries: each composes with
an adapter here instead of owning a gradient path (`frameworks.hsdp` adds a second hop on top
of FSDP2's reduce-scatter or the traced one, and keeps its `ReplicaHop` in the same per-adapter
slot; `frameworks.tensor_parallel` sizes every adapter's managed blocks; `frameworks.parts`
is the list of modules every adapter takes).
"""

from __future__ import annotations

import torch.nn as nn

from gift_compile.frameworks.adapter import Adapter
from gift_compile.frameworks.ddp import DDP
from gift_compile.frameworks.fsdp2 import FSDP2
from gift_compile.frameworks.plain_sync import PLAIN
from gift_compile.frameworks.simple_fsdp import SIMPLE_FSDP
from gift_compile.runtime.state import GiftState

__all__ = ["ADAPTERS", "adapter_for", "installed", "register", "unregister"]

ADAPTERS: dict[str, Adapter] = {a.name: a for a in (DDP, FSDP2, SIMPLE_FSDP, PLAIN)}
"""Every adapter, in the order `adapter_for` asks them."""


def register(adapter: Adapter, *, before: str | None = None) -> None:
    """Add `adapter` to the table: before the entry `before` (it is then asked first among
    them), or else just before the plain adapter, which accepts every model."""
    if not isinstance(adapter, Adapter):
        raise TypeError(f"GIFT: {adapter!r} does not implement the adapter protocol "
                        "(name, kind, split_rows, detect, install, no_sync, remove, telemetry)")
    if adapter.name in ADAPTERS:
        raise ValueError(f"GIFT: an adapter named {adapter.name!r} is already registered")
    anchor = PLAIN.name if before is None else before
    if anchor not in ADAPTERS:
        raise KeyError(f"GIFT: no adapter named {anchor!r} to register {adapter.name!r} before")
    entries = list(ADAPTERS.items())
    at = [name for name, _ in entries].index(anchor)
    entries.insert(at, (adapter.name, adapter))
    ADAPTERS.clear()
    ADAPTERS.update(entries)


def unregister(name: str) -> Adapter:
    """Take adapter `name` out of the table (the four built-in ones stay); returns it."""
    if name in (DDP.name, FSDP2.name, SIMPLE_FSDP.name, PLAIN.name):
        raise ValueError(f"GIFT: the built-in {name!r} adapter cannot be unregistered")
    return ADAPTERS.pop(name)


def adapter_for(model: nn.Module) -> Adapter:
    """The first adapter, in table order, that detects `model`'s framework."""
    for adapter in ADAPTERS.values():
        if adapter.detect(model):
            return adapter
    raise AssertionError("GIFT: the plain adapter accepts every model")  # unreachable while PLAIN is last


def installed(state: GiftState) -> list[Adapter]:
    """The table's adapters installed on `state`, in the order they were installed (names the
    table does not hold, such as HSDP's replica hop, are layered on one of them)."""
    return [ADAPTERS[name] for name in state.adapters if name in ADAPTERS]
