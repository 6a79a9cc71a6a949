"""GIFT: geometry-informed low-precision gradient communication, as a torch.compile pass.

    import gift_compile
    model = gift_compile.apply(model, gift_compile.GiftConfig(format="fp8_e4m3"))
    model = torch.compile(model)

See `GiftConfig` for the knobs, `gift_compile.formats` / `gift_compile.collectives` for the
core, and `gift_compile.passes` for the FX rewrite.
"""

from gift_compile.api import apply, remove, state
from gift_compile.config import GiftConfig

__all__ = ["GiftConfig", "apply", "remove", "state"]
__version__ = "0.1.0"
