"""The ``gift`` pass pipeline for torchtitan's graph_trainer.

graph_trainer traces the whole training step (forward, loss, backward) into one FX graph
in which SimpleFSDP's gradient reduce-scatters are ``_c10d_functional.reduce_scatter_tensor``
nodes. ``--compile.pass_pipeline gift`` selects this pipeline: torchtitan's default passes
with :func:`gift_compile.passes.rewrite_gradient_collectives` inserted after every
FSDP/bucketing pass and before the terminal Inductor / cudagraph passes, so the rewrite sees
the final collectives: each transformer block's bucketed reduce-scatter becomes one GIFT
all_to_all (per-layer encode, fp32 for the bucket's other gradients, per-layer decode), so the
number of collective launches does not grow.

The rewrite finds each managed weight's gradient by the ``gift::mark`` node that
:func:`gift_compile.api.manage` put on it; the mark carries the layer's plan and state
tensors, so the pipeline needs nothing but the graph.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from gift_compile.frameworks.hsdp import check_replicas_identical, replica_hop
from gift_compile.passes import rewrite_gradient_collectives

from . import platform_hooks
from torchtitan.experiments.graph_trainer.passes import (
    construct_default_graph_passes,
    final_inductor_compile_passes,
)
from torchtitan.experiments.graph_trainer.registry import register_pass_pipeline, register_pre_train_step_hook
from torchtitan.tools.logging import logger

__all__ = ["GIFT_PASS_PIPELINE", "gift_pass_pipeline", "gift_retrace_on_new_plan", "gift_rewrite_pass"]

GIFT_PASS_PIPELINE = "gift"
# The node annotation graph_trainer's regional_inductor_pass compiles (see its
# annotate_flex_attention_for_regional_inductor_pass).
_INDUCTOR_TAG = "compile_with_inductor"


def _pass_name(pass_fn: Callable) -> str:
    return pass_fn.func.__name__ if isinstance(pass_fn, functools.partial) else pass_fn.__name__


def _kept_launches(report: Any, kept: dict[str, str]) -> str:
    """The rewrite log's account of the collectives the pass must leave as they were, per label
    (``TP``; under expert parallelism ``EP``, the token all-to-alls): it rewrites only the
    data-parallel reduce-scatters the marks reach."""
    return "".join(f"; {label} collectives left as they were: " + ", ".join(
        f"{phase} {before} -> {after}" for phase, (before, after) in report.group_launches(group).items())
        for label, group in kept.items())


def _other_rewritten(report: Any, other: dict[str, str]) -> str:
    """The rewrite log's account of the collectives it rewrote over other data-parallel groups
    than GIFT's, per label (under expert parallelism ``efsdp``, the routed experts'
    reduce-scatters, marked with no map: `gift_compile.frameworks.simple_fsdp.mark_outside`)."""
    parts = []
    for label, group in other.items():
        n, weights = report.rewritten_over(group)
        parts.append(f"; {label} collectives rewritten: {n} carrying {weights} weights")
    return "".join(parts)


def gift_rewrite_pass(gm: torch.fx.GraphModule, example_inputs: Any, *, fuse: bool,
                      kept: dict[str, str] | None = None,
                      other: dict[str, str] | None = None) -> torch.fx.GraphModule:
    """graph_trainer pass ``(gm, example_inputs) -> gm`` around the GIFT rewrite.

    With ``fuse``, every node the rewrite inserted is tagged ``compile_with_inductor`` so
    that graph_trainer's default *regional* Inductor pass compiles GIFT's code (transform
    and quantize, dequantize, sum and inverse fuse into a few kernels) while the rest of
    the step keeps its bitwise-eager numerics; under ``inductor_compilation="full"`` the
    whole graph is compiled anyway. The collectives themselves stay untagged, so the encode
    side, the collective and the decode side are separate regions and the all_to_all keeps
    the place (and overlap) the bucketing scheduler gave the reduce-scatter. A managed
    gradient that cannot be rewritten raises inside the pass (no silent fp32). `kept` (label ->
    process group name: TP's group with tensor parallelism, EP's with expert parallelism) makes
    the log count those groups' collectives before and after the rewrite, forward and backward;
    `other` (efsdp's with expert parallelism) the collectives it rewrote over those groups.
    """
    before = set(gm.graph.nodes)
    report = rewrite_gradient_collectives(gm)
    buckets = sum(r.passthrough > 0 or len(r.layers) > 1 for r in report.rewritten)
    kinds = Counter(r.op for r in report.rewritten)  # reduce-scatters (FSDP, HSDP), all-reduces (DDP)
    collectives = " + ".join(f"{n} {op.replace('_', '-')}s" for op, n in sorted(kinds.items(), reverse=True)) or "0 collectives"
    logger.info(
        f"GIFT rewrite: {collectives} ({buckets} buckets) carrying {len(report.layers)} "
        f"managed weights, {len(report.fallbacks)} fallbacks; collective launches per step "
        f"{report.launches(report.ops_before)} -> {report.launches(report.ops_after)}; bytes per step of the "
        f"rewritten collectives {report.baseline_bytes} -> {report.wire_bytes}"
        + (f"; replica hop (HSDP): {report.replica_hops - report.sole_replica_hops} all-reduces of the reduced shards "
           "after them" + (f" and {report.sole_replica_hops} of gradients with a one-rank shard group (their only "
                           "collective)" if report.sole_replica_hops else "")
           + f", bytes per step {report.replica_baseline_bytes} -> {report.replica_wire_bytes}"
           if report.replica_hops else "")
        + _kept_launches(report, kept or {}) + _other_rewritten(report, other or {})
    )
    if fuse:
        for node in gm.graph.nodes:
            if node not in before and node.op == "call_function" and "_c10d_functional" not in str(node.target):
                node.meta["custom"] = {**node.meta.get("custom", {}), _INDUCTOR_TAG: {"inductor_configs": {}}}
    return gm


@register_pass_pipeline(GIFT_PASS_PIPELINE)
def gift_pass_pipeline(traced_result: Any, config: Any, *, parallel_dims: Any = None) -> list[Callable]:
    """Default graph_trainer passes, plus the GIFT rewrite when ``config.gift.enable``."""
    passes = construct_default_graph_passes(traced_result, config, parallel_dims=parallel_dims)
    passes = platform_hooks.edit_graph_passes(passes)
    if not config.gift.enable:
        return passes
    if config.compile.precompile_artifact_dir:
        raise ValueError(
            "gift.enable cannot use a precompiled graph artifact (--compile.precompile_artifact_dir): GIFT's "
            "state tensors (transforms, residuals, counters) enter the traced step as graph constants, which "
            "an artifact would carry as frozen copies the refreshes never update, and a selection decision "
            "retraces the step."
        )
    terminal = {_pass_name(p) for p in final_inductor_compile_passes(config.compile, use_cudagraph=True)}
    terminal.add("cudagraph_pass")
    index = next((i for i, p in enumerate(passes) if _pass_name(p) in terminal), len(passes))
    kept, other = _logged_groups(parallel_dims)
    passes.insert(index, functools.partial(gift_rewrite_pass, fuse=config.gift.fuse, kept=kept, other=other))
    return passes


def _logged_groups(parallel_dims: Any) -> tuple[dict[str, str], dict[str, str]]:
    """The process groups the rewrite log accounts for (`gift_rewrite_pass`): those whose
    collectives it must leave as they were (TP's with tensor parallelism, EP's, the token
    all-to-alls, with expert parallelism) and the other data-parallel ones it rewrites (efsdp's
    with expert parallelism: the routed experts' reduce-scatters; under HSDP also their mesh's
    dp_replicate group's: the experts' replica all-reduces, GIFT's replica hop)."""
    if parallel_dims is None:
        return {}, {}
    kept, other = {}, {}
    if parallel_dims.tp > 1:
        kept["TP"] = parallel_dims.get_mesh("tp").get_group().group_name
    if parallel_dims.ep > 1:
        kept["EP"] = parallel_dims.get_mesh("ep").get_group().group_name
        other["efsdp"] = parallel_dims.get_mesh("efsdp").get_group().group_name
        if parallel_dims.dp_replicate > 1:  # HSDP: SimpleFSDP all-reduces the experts over their mesh's replicas
            other["experts' dp_replicate"] = parallel_dims.get_mesh(["dp_replicate", "efsdp"]).get_group(0).group_name
    return kept, other


@register_pre_train_step_hook(GIFT_PASS_PIPELINE)
def gift_retrace_on_new_plan(trainer: Any) -> None:
    """graph_trainer hook before every step: retrace when GIFT's plan changed.

    The traced step carries each managed weight's map gated by a tensor, so selection
    changes reach it as data. What it carries as structure moves once per run: the first
    refresh lets layers that read one input share a statistic (``plan_version``). Then the
    traced step is dropped and graph_trainer traces, rewrites and compiles it again at this
    step (`bench.cluster.selection_churn graph_trainer` counts the retraces of a run whose selection
    changes at every refresh).
    """
    state = getattr(trainer.model_parts[0], "_gift_state", None)
    if state is None:
        return
    _check_replicas_after_refresh(trainer, state)
    traced = getattr(trainer, "_gift_plan_version", None)
    if traced is not None and traced != state.plan_version and trainer._traced_step is not None:
        trainer._gift_retraces = getattr(trainer, "_gift_retraces", 0) + 1
        logger.info(f"GIFT: plan changed (version {traced} -> {state.plan_version}); retracing the step "
                    f"(retrace {trainer._gift_retraces} of this run)")
        trainer._traced_step = None
    trainer._gift_plan_version = state.plan_version


def _check_replicas_after_refresh(trainer: Any, state: Any) -> None:
    """HSDP: after each refresh, check (on every rank, the same step) that every replica still
    holds bit-identical parameter shards, which GIFT's replica hop promises (every rank decodes
    the same all-gathered bytes); raises naming the replica ranks that differ. One digest
    exchange per refresh, not per step."""
    hop = replica_hop(state)
    if hop is None or not state.history or getattr(trainer, "_gift_replicas_checked", None) == state.steps:
        return
    if state.history[-1].step != state.steps:
        return
    trainer._gift_replicas_checked = state.steps
    check_replicas_identical(trainer.model_parts[0], hop.group)
    logger.info(f"GIFT HSDP: replicas bit-identical after {state.steps} optimizer steps")
