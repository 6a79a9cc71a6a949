"""GIFT: geometry-informed low-precision gradient communication, as a torch.compile pass.

    import gift_compile
    opt = torch.optim.AdamW(model.parameters())
    model = gift_compile.apply(model, gift_compile.GiftConfig(format="fp8_e4m3"), optimizer=opt)
    model = torch.compile(model)

`apply` works on plain modules (GIFT all-reduces the gradients in the compiled backward),
FSDP2 (`fully_shard`) and `DistributedDataParallel` models. See `GiftConfig` for the knobs,
`gift_compile.codec` / `gift_compile.exchange.collectives` for the core, and `gift_compile.passes`
for the FX rewrite.
"""

from gift_compile.api import apply, attach_optimizer, manage, no_sync, remove, report, state, step
from gift_compile.config import GiftConfig

__all__ = ["GiftConfig", "apply", "attach_optimizer", "manage", "no_sync", "remove", "report", "state", "step"]
__version__ = "0.3.0"
