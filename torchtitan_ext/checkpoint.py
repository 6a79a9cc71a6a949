"""torchtitan's DCP checkpoint manager, with the GIFT state of the model saved and restored.

The manager checkpoints the model, optimizers, dataloader, LR schedulers and the trainer's
``train_state``; GIFT's state (transforms, statistics, residuals, seed, step) is added as one
more stateful, found on the model part that `gift_compile.api.manage` set it up on. Residuals,
probes and statistics accumulators differ between ranks, and DCP keeps one copy of a plain
tensor saved under the same key on every rank, so each rank saves under ``gift.rank<r>`` (like
torchtitan's dataloader state); resuming needs the same data-parallel size. Loading goes
through `GiftState.load_state_dict`, which validates the checkpoint before touching the state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torchtitan.components.checkpoint import CheckpointManager

from gift_compile.runtime.state import GiftState

__all__ = ["GiftCheckpointManager"]

GIFT_KEY = "gift"


class _PerRankGiftState:
    """`GiftState` as a DCP stateful under a per-rank key."""

    def __init__(self, state: GiftState) -> None:
        self.state = state
        self.key = f"rank{dist.get_rank()}"

    def state_dict(self) -> dict[str, Any]:
        return {self.key: self.state.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get(self.key)
        if saved is None:
            raise ValueError(f"checkpoint has no GIFT state for {self.key}; it was saved without gift.enable "
                             "or with another data-parallel size")
        self.state.load_state_dict(saved)


class GiftCheckpointManager(CheckpointManager):
    """`CheckpointManager` that also checkpoints the model's GIFT state (when it has one)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        states = [m._gift_state for m in kwargs["model_parts"] if getattr(m, "_gift_state", None) is not None]
        if states:
            self.states[GIFT_KEY] = _PerRankGiftState(states[0])
