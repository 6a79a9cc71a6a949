"""torchtitan job configs with a ``[gift]`` section (``--gift.*``).

A config class is the one thing torchtitan offers no hook for: adding a section means a
subclass of the trainer's ``Config``. The trainers themselves stay torchtitan's own (``build()``
constructs ``Trainer`` / ``GraphTrainer``): ``__post_init__``, which runs on the final,
CLI-parsed values, binds GIFT's ``post_optimizer_build_fn`` (:mod:`.hooks`) to this section, and
graph configs are checked here, while the command line is parsed, instead of on N ranks later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torchtitan.experiments.graph_trainer.trainer import GraphTrainer
from torchtitan.trainer import Trainer

from .hooks import bind_gift_hook
from .hsdp import bind_shard_only_parallelize
from .pipeline import GIFT_PASS_PIPELINE
from .section import GiftSection

__all__ = ["GiftGraphTrainerConfig", "GiftTrainerConfig"]


@dataclass(kw_only=True, slots=True)
class GiftTrainerConfig(Trainer.Config):
    """Stock trainer (FSDP2) plus ``gift``."""

    gift: GiftSection = field(default_factory=GiftSection)

    def __post_init__(self) -> None:
        Trainer.Config.__post_init__(self)  # explicit: slots dataclasses break zero-argument super()
        bind_gift_hook(self, "fsdp2")
        bind_shard_only_parallelize(self)  # HSDP with gift.enable: shard-only fully_shard (see .hsdp)


@dataclass(kw_only=True, slots=True)
class GiftGraphTrainerConfig(GraphTrainer.Config):
    """graph_trainer (SimpleFSDP, whole-step trace) plus ``gift``."""

    gift: GiftSection = field(default_factory=GiftSection)

    def __post_init__(self) -> None:
        GraphTrainer.Config.__post_init__(self)
        if self.gift.enable:
            if self.compile.pass_pipeline != GIFT_PASS_PIPELINE:
                raise ValueError(
                    f"gift.enable on graph_trainer needs --compile.pass_pipeline {GIFT_PASS_PIPELINE} "
                    f"(got {self.compile.pass_pipeline!r}): that pipeline rewrites the gradient collectives"
                )
            if not (self.compile.enable and self.compile.mode == "aot_fx_trace"):
                raise ValueError("gift.enable on graph_trainer needs --compile.enable with compile.mode aot_fx_trace")
            if self.compile.inductor_compilation == "full" and not torch.accelerator.is_available():
                # full_inductor_compilation_pass moves every CPU graph constant to CUDA
                # (_migrate_cpu_get_attrs_to_cuda); GIFT's state tensors are such constants.
                raise ValueError(
                    "gift.enable with --compile.inductor_compilation full needs CUDA; on CPU keep the "
                    "default regional compilation (GIFT's own ops are still compiled with gift.fuse)"
                )
        bind_gift_hook(self, "graph")
