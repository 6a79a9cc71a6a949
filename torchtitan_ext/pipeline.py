"""The ``gift`` pass pipeline for torchtitan's graph_trainer.

graph_trainer traces the whole training step (forward, loss, backward) into one FX graph
in which SimpleFSDP's gradient reduce-scatters are ``_c10d_functional.reduce_scatter_tensor``
nodes. ``--compile.pass_pipeline gift`` selects this pipeline: torchtitan's default passes
with :func:`gift_compile.passes.rewrite_gradient_collectives` inserted after every
FSDP/bucketing pass and before the terminal Inductor / cudagraph passes, so the rewrite sees
the final collectives (bucketed or not) and Inductor compiles the quantize/dequantize code
together with the rest of the step.

The rewrite finds each managed weight's gradient by the ``gift::mark`` node that
:func:`gift_compile.torchtitan_ext.layers.manage_linears` put on it; the mark names the
layer's GIFT state, so the pipeline needs nothing but the graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from gift_compile.passes import rewrite_gradient_collectives

from . import cpu_compat
from torchtitan.experiments.graph_trainer.passes import (
    construct_default_graph_passes,
    final_inductor_compile_passes,
)
from torchtitan.experiments.graph_trainer.registry import register_pass_pipeline
from torchtitan.tools.logging import logger

__all__ = ["GIFT_PASS_PIPELINE", "gift_pass_pipeline", "gift_rewrite_pass"]

GIFT_PASS_PIPELINE = "gift"
# The node annotation graph_trainer's regional_inductor_pass compiles (see its
# annotate_flex_attention_for_regional_inductor_pass).
_INDUCTOR_TAG = "compile_with_inductor"


def _pass_name(pass_fn: Callable) -> str:
    return pass_fn.func.__name__ if isinstance(pass_fn, functools.partial) else pass_fn.__name__


def gift_rewrite_pass(gm: torch.fx.GraphModule, example_inputs: Any, *, fuse: bool) -> torch.fx.GraphModule:
    """graph_trainer pass ``(gm, example_inputs) -> gm`` around the GIFT rewrite.

    With ``fuse``, every node the rewrite inserted is tagged ``compile_with_inductor`` so
    that graph_trainer's default *regional* Inductor pass compiles GIFT's code (transform
    and quantize, dequantize, sum and inverse fuse into a few kernels) while the rest of
    the step keeps its bitwise-eager numerics; under ``inductor_compilation="full"`` the
    whole graph is compiled anyway. Raises when the graph has managed gradients but none
    of them could be rewritten: the run would silently train at full precision.
    """
    before = set(gm.graph.nodes)
    import os
    if os.environ.get("GIFT_DUMP"):
        import torch.distributed as _d
        if _d.get_rank() == 0:
            open(os.environ["GIFT_DUMP"], "w").write(gm.print_readable(print_output=False))
    report = rewrite_gradient_collectives(gm)
    if report.fallbacks and not report.rewritten:
        raise RuntimeError(f"GIFT rewrote no gradient collective; every managed layer fell back: {report.fallbacks}")
    logger.info(
        f"GIFT rewrite: {len(report.rewritten)} reduce-scatters, {len(report.fallbacks)} at full precision, "
        f"managed bytes per step {report.fp32_bytes} (fp32) -> {report.wire_bytes}"
    )
    if fuse:
        for node in gm.graph.nodes:
            if node not in before and node.op == "call_function":
                node.meta.setdefault("custom", {})[_INDUCTOR_TAG] = {"inductor_configs": {}}
    return gm


@register_pass_pipeline(GIFT_PASS_PIPELINE)
def gift_pass_pipeline(traced_result: Any, config: Any, *, parallel_dims: Any = None) -> list[Callable]:
    """Default graph_trainer passes, plus the GIFT rewrite when ``config.gift.enable``."""
    passes = construct_default_graph_passes(traced_result, config, parallel_dims=parallel_dims)
    if cpu_compat.is_active():
        remat = next((i for i, p in enumerate(passes) if _pass_name(p) == "selective_activation_remat_pass"), None)
        if remat is not None:
            passes.insert(remat, cpu_compat.save_deterministic_sdpa_pass)
    if not config.gift.enable:
        return passes
    if config.compile.precompile_artifact_dir:
        raise ValueError(
            "gift.enable cannot rewrite a precompiled graph artifact "
            "(--compile.precompile_artifact_dir): the graph was compiled without GIFT."
        )
    terminal = {_pass_name(p) for p in final_inductor_compile_passes(config.compile, use_cudagraph=True)}
    terminal.add("cudagraph_pass")
    index = next((i for i, p in enumerate(passes) if _pass_name(p) in terminal), len(passes))
    passes.insert(index, functools.partial(gift_rewrite_pass, fuse=config.gift.fuse))
    return passes
