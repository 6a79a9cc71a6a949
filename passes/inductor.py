"""Hook the GIFT rewrite into Inductor's post-grad custom passes.

The pass is appended to `torch._inductor.config.post_grad_custom_post_pass` (turned into a
list if the user already installed one, so theirs keeps running). It runs after Inductor's
own post-grad pattern passes and before re-inplacing, on the functional post-grad graph.
Its `uuid` covers this package's source only: the pass is a pure function of the graph (every
managed gradient's plan is an argument of its `gift::mark` node, and the rank is a tensor),
so the FX graph cache key already distinguishes formats and layers, and one cached artifact
serves every rank.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch.fx as fx
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from gift_compile.passes.gift_pass import rewrite_gradient_collectives

_SOURCES = tuple(
    str(p) for d in (Path(__file__).parent, Path(__file__).parent.parent / "gift_compile")
    for p in sorted(d.glob("*.py"))
)


class GiftGraphPass(CustomGraphPass):
    """`CustomGraphPass` running `rewrite_gradient_collectives` on post-grad graphs."""

    def __call__(self, graph: fx.Graph) -> None:
        rewrite_gradient_collectives(graph)

    def uuid(self) -> Any:
        return hashlib.sha256(get_hash_for_files(_SOURCES)).hexdigest()


_PASS = GiftGraphPass()


def register_inductor_pass() -> None:
    """Install the pass once, after any post-grad custom pass already configured."""
    current = inductor_config.post_grad_custom_post_pass
    passes = list(current) if isinstance(current, (list, tuple)) else ([] if current is None else [current])
    if any(isinstance(p, GiftGraphPass) for p in passes):
        return
    inductor_config.post_grad_custom_post_pass = [*passes, _PASS] if passes else _PASS


def unregister_inductor_pass() -> None:
    """Remove the pass (used by `gift_compile.remove` when no managed model is left)."""
    current = inductor_config.post_grad_custom_post_pass
    passes = list(current) if isinstance(current, (list, tuple)) else ([] if current is None else [current])
    kept = [p for p in passes if not isinstance(p, GiftGraphPass)]
    inductor_config.post_grad_custom_post_pass = kept if len(kept) > 1 else (kept[0] if kept else None)
