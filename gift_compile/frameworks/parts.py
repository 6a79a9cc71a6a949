"""A model as the parts one rank holds.

Most layouts give a rank one module. Pipeline parallelism gives it one module per pipeline
stage it runs (one, or several with interleaved schedules: torchtitan's ``model_parts``), and
GIFT manages them all with one `GiftState` driven once per optimizer step. The parts are
pieces of one model and keep its fully qualified names (torchtitan prunes a copy of the whole
model per stage), so layer names never collide across parts; `gift_compile.frameworks.routing.manage`
raises if they do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

__all__ = ["Parts", "model_parts"]

Parts = nn.Module | Sequence[nn.Module]
"""One module, or the modules (pipeline stages) one rank holds."""


def model_parts(model: Parts) -> list[nn.Module]:
    """`model` as a list of parts (a module is one part); raises on an empty or non-module list."""
    if isinstance(model, nn.Module):
        return [model]
    parts = list(model)
    if not parts or not all(isinstance(p, nn.Module) for p in parts):
        raise TypeError(f"GIFT: expected an nn.Module or a non-empty sequence of them (pipeline stages), got "
                        f"{[type(p).__name__ for p in parts] or 'an empty sequence'}")
    return parts
