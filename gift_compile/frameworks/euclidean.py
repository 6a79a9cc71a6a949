"""The one rule for gradients GIFT sends on its codec with no map, outside its layers.

A parameter group a framework reduce-scatters over another process group than GIFT's state
(torchtitan's routed experts on the ``efsdp`` mesh under expert parallelism) has no GIFT layer:
GIFT's statistics, transforms and selection belong to the state's group, and a grouped-GEMM
expert weight ``[E, out, in]`` is one tensor for a rank's experts, each fed only its routed
tokens, so no linear layer's statistics describe it. Its gradient is still a stack of
``[out, in]`` matrices, and a dim-0 shard gives each rank whole rows, so it goes as one Euclidean
item ``[E * out, in]``: every row with its own scales, at the state's format.
An error-feedback residual is a rank's own (what its last encode left out of its local
gradient), so it needs no group: the framework that sends the item keeps one where the config
asks for error feedback, registered with the state (`GiftState.add_outside_residual`), which
checkpoints it with the layers'.

Both data-parallel frameworks send such gradients by this rule, so they quantize the same
parameters the same way: FSDP2 in its custom reduce-scatter
(`gift_compile.frameworks.fsdp2.EuclideanReduceScatter`), SimpleFSDP through a `gift::mark` the
FX pass rewrites (`gift_compile.frameworks.simple_fsdp`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from gift_compile.config import layer_format
from gift_compile.exchange.plan import ItemPlan
from gift_compile.geometry.table import IDENTITY_KIND
from gift_compile.runtime.state import GiftState

__all__ = ["NO_MAP", "describe", "describe_items", "euclidean_plan", "gathered_shape"]

# why graph_trainer's routed experts go with no map, for their log lines (on the FSDP2 trainer
# each local expert is a GIFT layer of its own: `frameworks.fsdp2._whitened_experts`)
NO_MAP = ("GIFT's statistics and transforms span its own group, and the pass does not carry a grouped-GEMM weight's "
          "per-expert maps")


def gathered_shape(local: Sequence[int], world: int) -> tuple[int, ...]:
    """The shape of the gradient a collective over `world` ranks reduces for a parameter whose
    dim-0 shard on this rank is `local`: `world` times its rows (`euclidean_plan`'s `shape`)."""
    return (world * local[0], *local[1:]) if local else ()


def euclidean_plan(state: GiftState, fqn: str, shape: Sequence[int], world: int, *,
                   error_feedback: bool = False) -> ItemPlan | None:
    """The Euclidean item parameter `fqn` goes as when the tensor a collective reduces over
    `world` ranks, then splits along dim 0 among them, has `shape` (this rank's gradient before
    the reduce-scatter): viewed ``[prod(shape[:-1]), shape[-1]]``, at the state's format (or
    its `layer_formats` entry), with none of a layer's own tensors (map, gate). With
    `error_feedback` (the caller keeps the item's residual, `GiftState.add_outside_residual`) it
    has the state's error feedback (its decay and residual format) where the config asks for
    it; otherwise none. None where it goes raw: fewer than two dims, under `min_numel`, a dim 0
    that does not split evenly over `world` (a rank's rows would not be whole), or excluded
    (`GiftConfig.is_excluded`)."""
    config, spec = state.config, state.layer_spec
    if len(shape) < 2 or math.prod(shape) < config.min_numel or shape[0] % world or config.is_excluded(fqn):
        return None
    plan = dataclasses.replace(
        spec.plan, name=fqn, rows=math.prod(shape[:-1]), cols=shape[-1], kind=IDENTITY_KIND, n_tensors=0,
        format=layer_format(spec.layer_formats, fqn, spec.plan.format), second_hop_error_feedback=False)
    if error_feedback and plan.error_feedback:
        return plan
    return dataclasses.replace(plan, error_feedback=False, error_feedback_decay=1.0, residual_format="fp32")


def describe_items(plans: Sequence[tuple[str, ItemPlan | None]], error_feedback: bool, fmt: str | None = None) -> str:
    """How one module's parameters go, for its log line: each planned one as its item at its
    format (or at `fmt`, a hop with a format of its own), the rest raw, and "without error
    feedback" where the config asks for it (`error_feedback`) and a planned item has none."""
    coded = ", ".join(f"{name} as [{plan.rows}, {plan.cols}] at {fmt or plan.format}"
                      for name, plan in plans if plan is not None) or "nothing quantized"
    raw = [name for name, plan in plans if plan is None]
    missing = error_feedback and any(plan is not None and not plan.error_feedback for _, plan in plans)
    return f"{coded}{'; raw: ' + ', '.join(raw) if raw else ''}{'; without error feedback' if missing else ''}"


def describe(owner: str, kind: str, mesh: str, ranks: int, how: str, why: str = NO_MAP) -> str:
    """The log line of a module whose parameters reduce-scatter over `mesh` (`ranks` ranks) on
    GIFT's codec with no map (`why`); `how` is `describe_items`'."""
    return (f"GIFT: {owner} ({kind}) reduce-scatters over mesh {mesh!r} ({ranks} ranks) on GIFT's codec with no map "
            f"({why}): {how}")
