"""FX passes that rewrite gradient collectives into GIFT quantized collectives."""

from gift_compile.passes.gift_pass import (
    BucketMatch,
    GiftRewriteError,
    RewriteRecord,
    RewriteReport,
    count_ops,
    find_gradient_collectives,
    last_reports,
    reports_seen,
    rewrite_bucket,
    rewrite_gradient_collectives,
)
from gift_compile.passes.inductor import (
    GiftGraphPass, hold_inductor_pass, register_inductor_pass, release_inductor_pass, unregister_inductor_pass,
)

__all__ = [
    "BucketMatch", "GiftGraphPass", "GiftRewriteError", "RewriteRecord", "RewriteReport", "count_ops",
    "find_gradient_collectives", "hold_inductor_pass", "last_reports", "register_inductor_pass",
    "release_inductor_pass", "reports_seen", "rewrite_bucket",
    "rewrite_gradient_collectives", "unregister_inductor_pass",
]
