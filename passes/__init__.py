"""FX passes that rewrite gradient collectives into GIFT quantized collectives."""

from gift_compile.passes.gift_pass import (
    CollectiveMatch,
    RewriteRecord,
    RewriteReport,
    count_ops,
    find_gradient_collectives,
    last_reports,
    rewrite_collective,
    rewrite_gradient_collectives,
)
from gift_compile.passes.inductor import GiftGraphPass, register_inductor_pass, unregister_inductor_pass

__all__ = [
    "CollectiveMatch", "GiftGraphPass", "RewriteRecord", "RewriteReport", "count_ops", "find_gradient_collectives",
    "last_reports", "register_inductor_pass", "rewrite_collective", "rewrite_gradient_collectives",
    "unregister_inductor_pass",
]
