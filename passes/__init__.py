"""FX passes that rewrite gradient collectives into GIFT quantized collectives."""

from gift_compile.passes.gift_pass import (
    BucketMatch,
    GiftRewriteError,
    RewriteRecord,
    RewriteReport,
    count_ops,
    find_gradient_collectives,
    last_reports,
    rewrite_bucket,
    rewrite_gradient_collectives,
)
from gift_compile.passes.inductor import GiftGraphPass, register_inductor_pass, unregister_inductor_pass

__all__ = [
    "BucketMatch", "GiftGraphPass", "GiftRewriteError", "RewriteRecord", "RewriteReport", "count_ops",
    "find_gradient_collectives", "last_reports", "register_inductor_pass", "rewrite_bucket",
    "rewrite_gradient_collectives", "unregister_inductor_pass",
]
