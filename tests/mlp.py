"""The small MLP the multi-rank tests train (seeded: every rank builds the same weights)."""

from __future__ import annotations

import torch
import torch.nn as nn

from gift_compile.config import RAW_OUTSIDE_LAYERS

# The opt-out of compressing the gradients outside GIFT's layers (`GiftConfig.unmapped_format`,
# `excluded_format`, `tiny_format`): they travel raw, exactly. Tests of the managed weights'
# exchange (pairing, accounting, replicas) keep them exact so that any error they measure there
# is a bug, not bf16's rounding; tests/test_whole_gradient.py tests the defaults.
EXACT_OUTSIDE = RAW_OUTSIDE_LAYERS


class MLP(nn.Module):
    """`fc1` (`width -> hidden`), `fc2` (back to `width`), optionally a `side` linear added on
    the steps that use it (a parameter without a gradient on the others) and an `out` head of
    `classes` (small enough to stay at full precision)."""

    def __init__(self, width: int = 64, hidden: int = 128, *, classes: int | None = 4, side: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.side = nn.Linear(width, width) if side else None
        self.out = nn.Linear(width, classes) if classes else None

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        h = self.fc2(torch.relu(self.fc1(x)))
        if self.side is not None and use_side:
            h = h + self.side(h)
        return self.out(torch.relu(h)) if self.out is not None else h
