"""Where a platform adapter adjusts the integration, without the integration importing it.

The integration runs as it is on an accelerator. Without one, two of its steps need the
platform's help: FSDP2 must reduce with a plain SUM (gloo has no PREMUL_SUM), and the
graph_trainer pipeline must save, not recompute, the CPU attention nodes. The CPU stand-in
(`gift_compile.torchtitan_ext.cpu.cpu_compat`) registers those adjustments here when it
activates; the integration calls `after_fsdp2` and `edit_graph_passes`, which do nothing when
nothing is registered. So the dependency goes one way: the stand-ins import the integration,
never the reverse (tests/test_architecture.py checks it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

GraphPasses = list[Callable]

_AFTER_FSDP2: list[Callable[[nn.Module], None]] = []
_GRAPH_PASS_EDITS: list[Callable[[GraphPasses], GraphPasses]] = []


def register_after_fsdp2(adjust: Callable[[nn.Module], None]) -> None:
    """Run `adjust(model)` on every model part after FSDP2 has sharded it (once per callable)."""
    if adjust not in _AFTER_FSDP2:
        _AFTER_FSDP2.append(adjust)


def register_graph_pass_edit(edit: Callable[[GraphPasses], GraphPasses]) -> None:
    """Let `edit` change graph_trainer's default pass list before GIFT's rewrite joins it."""
    if edit not in _GRAPH_PASS_EDITS:
        _GRAPH_PASS_EDITS.append(edit)


def after_fsdp2(model: nn.Module) -> None:
    """The registered adjustments of an FSDP2-sharded model part (none on an accelerator box)."""
    for adjust in _AFTER_FSDP2:
        adjust(model)


def edit_graph_passes(passes: GraphPasses) -> GraphPasses:
    """`passes` after every registered edit, in registration order."""
    for edit in _GRAPH_PASS_EDITS:
        passes = edit(passes)
    return passes
