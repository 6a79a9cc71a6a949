"""The Inductor internals the pass uses, in one place, behind a torch version check.

Inductor rewrites collectives to registered ops (`micro_pipeline_tp`); GIFT instead splices
the traced Python body of its codec into the post-grad graph, which is what lets Inductor fuse
the codec with the surrounding kernels on the CPU (a registered op would be opaque there;
the GPU kernels enter as `torch.library.triton_op`s, which Inductor keeps in the graph). The
splice needs three things Inductor does not export as API: tracing a function to a functional
ATen graph under the graph's fake mode (`pattern_matcher.fwd_only`, `virtualized.V`), the fake
mode of a graph's values (`torch._guards.detect_fake_mode`), and the op Inductor's bucketing
packs reduce-scatter inputs with (`bucketing::_pre_bucket_reduce_scatter`). They are read only
here, and only on a torch the pass was tested with (`TESTED_TORCH`): another version raises
naming it when the pass would first use them, so a user of the hooks (FSDP2, DDP) is not
affected. The pass's registration (`post_grad_custom_post_pass`, `CustomGraphPass`) is
Inductor's documented extension point and lives in `.inductor`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from gift_compile.torch_release import require_tested_torch

__all__ = ["TESTED_TORCH", "check_torch", "pre_bucket_reduce_scatter_op", "splice"]

# (major, minor) releases whose Inductor internals match what this module calls.
TESTED_TORCH = ((2, 13), (2, 14))


def check_torch(version: str = torch.__version__) -> None:
    """Raise unless `version` is a torch release the splice was tested with."""
    require_tested_torch(TESTED_TORCH, "GIFT's graph pass splices its codec through Inductor internals",
                         "Use a tested torch, or the FSDP2/DDP hooks (no graph pass)", version)


def _fake_mode(vals: list[Any]) -> contextlib.AbstractContextManager:
    from torch._guards import detect_fake_mode
    from torch._inductor.virtualized import NullHandler, V

    mode = detect_fake_mode(vals)
    if mode is None and not isinstance(V.fake_mode, NullHandler):
        mode = V.fake_mode
    return mode if mode is not None else contextlib.nullcontext()


def splice(graph: fx.Graph, fn: Callable, args: list[fx.Node], before: fx.Node, meta: dict[str, Any]) -> fx.Node:
    """Trace `fn(*args' values)` to a functional ATen graph and copy its nodes into `graph`
    before `before`, each with a copy of `meta`; returns the node of its (single tensor) output."""
    check_torch()
    from torch._inductor.pattern_matcher import fwd_only

    vals = [a.meta["val"] for a in args]
    with _fake_mode(vals):
        sub = fwd_only(fn, vals, run_functional_passes=False)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env = dict(zip(placeholders, args))
    with graph.inserting_before(before):
        for node in sub.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            new = graph.node_copy(node, lambda a: env[a])
            new.meta.update(copy.deepcopy(meta))
            env[node] = new
    (out,) = torch.utils._pytree.tree_leaves(sub.graph.output_node().args[0])
    return env[out]


def pre_bucket_reduce_scatter_op() -> Any:
    """`bucketing::_pre_bucket_reduce_scatter` (registered when Inductor's bucketing loads): the
    matcher looks through it to the gradients a bucketed reduce-scatter carries."""
    check_torch()
    import torch._inductor.fx_passes.bucketing  # noqa: F401  (registers the op)

    return torch.ops.bucketing._pre_bucket_reduce_scatter.default
