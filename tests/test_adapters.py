"""The framework adapter table (`gift_compile.frameworks.table`): `apply`, `no_sync` and `remove`
reach a framework only through it, so a registered adapter is detected, installed, switched and
removed without any change to `gift_compile.api`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
import torch.distributed as dist
import torch.nn as nn

import gift_compile
from gift_compile.config import GiftConfig
from gift_compile.frameworks import table
from gift_compile.frameworks.adapter import Adapter, attach, attached
from gift_compile.frameworks.routing import manage
from gift_compile.runtime.state import GiftState
from mlp import MLP

CONFIG = GiftConfig(geometry="hadamard", select="all", min_numel=1024)


class _Framework(MLP):
    """A model of the dummy framework (what the dummy adapter detects)."""


class _Dummy:
    """An adapter that records every call the table routes to it."""

    name = "dummy"
    kind = "the dummy framework's hook"
    split_rows = False

    def __init__(self, *, attaches: bool = True) -> None:
        self.attaches = attaches
        self.calls: list[str] = []

    def detect(self, model: nn.Module) -> bool:
        return isinstance(model, _Framework)

    def install(self, model: nn.Module, config: GiftConfig, group: dist.ProcessGroup | None, *,
                fuse: bool) -> GiftState:
        self.calls.append("install")
        state = manage(model, config, group, mode="stats")
        if self.attaches:
            attach(state, self.name, {"installed_with_fuse": fuse})
        return state

    def no_sync(self, model: nn.Module, state: GiftState) -> AbstractContextManager[None]:
        @contextmanager
        def switched() -> Iterator[None]:
            self.calls.append("no_sync enter")
            yield
            self.calls.append("no_sync exit")

        return switched()

    def remove(self, model: nn.Module, state: GiftState) -> None:
        self.calls.append("remove")

    def telemetry(self, state: GiftState) -> dict[str, float]:
        return {"dummy_s": 1.5}


@pytest.fixture
def dummy() -> Iterator[_Dummy]:
    adapter = _Dummy()
    table.register(adapter)
    try:
        yield adapter
    finally:
        table.unregister(adapter.name)


def test_a_registered_adapter_is_detected_installed_switched_and_removed_through_the_table(dummy: _Dummy) -> None:
    assert isinstance(dummy, Adapter)
    assert list(table.ADAPTERS)[-2:] == ["dummy", "plain"]  # asked before the plain adapter, which takes anything
    model = _Framework()
    gift_compile.apply(model, CONFIG, fuse=False)
    st = gift_compile.state(model)
    assert dummy.calls == ["install"]
    assert list(st.layers) == ["fc1.weight", "fc2.weight"]  # the dummy's manage, not the plain sync's
    assert table.installed(st) == [dummy] and attached(st, "dummy") == {"installed_with_fuse": False}
    assert table.installed(st)[0].telemetry(st) == {"dummy_s": 1.5}
    with gift_compile.no_sync(model):
        assert dummy.calls[-1] == "no_sync enter"
    assert dummy.calls[-1] == "no_sync exit"
    gift_compile.remove(model)
    assert dummy.calls[-1] == "remove" and not hasattr(model, "_gift_state")
    assert not any(type(m).__name__.startswith("Gift") for m in model.modules())

    plain = MLP()  # not the dummy's framework: the next entry that detects it (plain) installs
    gift_compile.apply(plain, CONFIG)
    assert table.installed(gift_compile.state(plain)) == [table.ADAPTERS["plain"]]
    assert dummy.calls.count("install") == 1
    gift_compile.remove(plain)


def test_the_table_refuses_a_non_adapter_a_duplicate_name_and_an_install_that_does_not_attach() -> None:
    with pytest.raises(TypeError, match="does not implement the adapter protocol"):
        table.register(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'plain' is already registered"):
        table.register(table.ADAPTERS["plain"])
    with pytest.raises(ValueError, match="built-in 'fsdp2' adapter cannot be unregistered"):
        table.unregister("fsdp2")
    forgetful = _Dummy(attaches=False)
    table.register(forgetful, before="ddp")
    try:
        assert next(iter(table.ADAPTERS)) == "dummy"
        with pytest.raises(RuntimeError, match="'dummy' adapter's install did not attach itself"):
            gift_compile.apply(_Framework(), CONFIG)
    finally:
        table.unregister("dummy")
    assert list(table.ADAPTERS) == ["ddp", "fsdp2", "simple_fsdp", "plain"]


def test_the_state_keeps_adapters_in_one_generic_slot() -> None:
    st = GiftState(CONFIG, None)
    attach(st, "fsdp2", "a timer")
    with pytest.raises(ValueError, match="'fsdp2' adapter is already installed"):
        attach(st, "fsdp2", "another")
    with pytest.raises(KeyError, match="'hsdp' adapter is not installed on this state \\(installed: fsdp2\\)"):
        attached(st, "hsdp")
    assert not {"comm_timer", "replica_hop", "retraces"} & set(GiftState.__slots__)
