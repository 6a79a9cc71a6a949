"""Hook the GIFT rewrite into Inductor's post-grad custom passes.

The pass is appended to `torch._inductor.config.post_grad_custom_post_pass` (turned into a
list if the user already installed one, so theirs keeps running). It runs after Inductor's
own post-grad pattern passes and before re-inplacing, on the functional post-grad graph.
Its `uuid` covers this package's source, the configuration of every registered layer and
the rank, so the FX graph cache never serves a graph rewritten for another format or rank.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.fx as fx
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from gift_compile.passes.gift_pass import rewrite_gradient_collectives
from gift_compile.state import _LAYERS

_SOURCES = tuple(
    str(p) for d in (Path(__file__).parent, Path(__file__).parent.parent / "gift_compile")
    for p in sorted(d.glob("*.py"))
)


class GiftGraphPass(CustomGraphPass):
    """`CustomGraphPass` running `rewrite_gradient_collectives` on post-grad graphs."""

    def __call__(self, graph: fx.Graph) -> None:
        rewrite_gradient_collectives(graph)

    def uuid(self) -> Any:
        h = hashlib.sha256(get_hash_for_files(_SOURCES))
        for lid in sorted(_LAYERS.keys()):
            layer = _LAYERS.get(lid)
            if layer is not None:
                h.update(repr((lid, layer.fqn, layer.shape, layer.kind, sorted(layer.config.to_dict().items()))).encode())
        h.update(repr(dist.get_rank() if dist.is_initialized() else 0).encode())
        return h.hexdigest()


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
