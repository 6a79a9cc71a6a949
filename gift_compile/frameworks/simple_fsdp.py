"""GIFT for SimpleFSDP-style models (torchtitan's graph_trainer): DTensor parameters whose
reduce-scatters are traced into the backward graph.

Such a framework launches its gradient collectives from the graph, where the FX pass
(`gift_compile.passes.gift_pass`) rewrites each (possibly bucketed) reduce-scatter that carries
a managed weight's gradient into GIFT's collective. So the adapter only manages the weights in
"tag" mode: each managed weight's gradient gets its `gift::mark`, which the pass reads.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch.distributed as dist
import torch.nn as nn

from gift_compile.config import GiftConfig
from gift_compile.frameworks.adapter import attach
from gift_compile.frameworks.parts import Parts
from gift_compile.frameworks.routing import ManageMode, manage
from gift_compile.runtime.state import GiftState

__all__ = ["SIMPLE_FSDP"]


class _SimpleFSDPAdapter:
    """Models whose parameters are DTensors with a traced reduce-scatter (see the module docstring)."""

    name = "simple_fsdp"
    kind = "rewrite of the traced reduce-scatters"
    split_rows = True

    def detect(self, model: nn.Module) -> bool:
        from torch.distributed.tensor import DTensor

        return any(isinstance(p, DTensor) for p in model.parameters())

    def install(self, model: Parts, config: GiftConfig, group: dist.ProcessGroup | None, *,
                fuse: bool) -> GiftState:
        """Manage the linears in "tag" mode (the marks the pass rewrites); `fuse` concerns eager
        collectives, and these run in the compiled graph. `model` may be the parts one rank
        holds (torchtitan hands its model parts)."""
        state = manage(model, config, group, mode=ManageMode.TAG, split_rows=True)
        attach(state, self.name, None)
        return state

    def no_sync(self, model: nn.Module, state: GiftState) -> AbstractContextManager[None]:
        """Refused: the reduce-scatters are part of the traced backward and run in every one."""
        raise ValueError("gift_compile.no_sync: a SimpleFSDP model's reduce-scatters are traced into its backward "
                         "and run in every backward; GIFT cannot defer them. Accumulate the framework's way "
                         "(torchtitan: --training.global-batch-size over several local batches)")

    def remove(self, model: nn.Module, state: GiftState) -> None:
        """Nothing of the framework's to restore: without the marks (the managed classes are
        restored by `api.remove`) the pass leaves the framework's collectives alone."""

    def telemetry(self, state: GiftState) -> dict[str, float]:
        """Nothing beyond the state's counters: the rewritten collectives count into them."""
        return {}


SIMPLE_FSDP = _SimpleFSDPAdapter()
