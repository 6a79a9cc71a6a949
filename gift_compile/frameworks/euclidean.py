"""The one rule for gradients GIFT sends on its codec with no map, outside its layers.

Every gradient outside GIFT's layers that a hook sends in its buckets goes by `euclidean_plan`
(`outside_item` adds its runtime tensors): the embedding and head (`exclude`) at
`excluded_format`, other weights at `unmapped_format`, in plain coordinates; tiny ones (norms,
biases) at `tiny_format`; raw only where the config opts out. The DDP hook, FSDP2's reduce-scatter
(`GiftReduceScatter`), a plain module's sync (`plain_sync`) and HSDP's replica hop (which cuts the
shard hop's segments) ask it, so a parameter goes the same way on every path
(docs/design.md, "The whole gradient").

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
import logging
import math
from collections.abc import Sequence

import torch

from gift_compile.codec.spec import FormatSpec, wire_bytes_for
from gift_compile.config import FULL_PRECISION, is_tiny
from gift_compile.exchange.collectives import ItemTensors
from gift_compile.exchange.node_stage import residual_rows
from gift_compile.exchange.plan import Collective, ItemPlan
from gift_compile.exchange.topology import NodeLayout
from gift_compile.geometry.table import IDENTITY_KIND
from gift_compile.runtime.state import GiftState

__all__ = ["NO_MAP", "describe", "describe_items", "euclidean_plan", "gathered_shape", "outside_item"]

logger = logging.getLogger("gift_compile")

# why graph_trainer's routed experts go with no map, for their log lines (on the FSDP2 trainer
# each local expert is a GIFT layer of its own: `frameworks.fsdp2._whitened_experts`)
NO_MAP = ("GIFT's statistics and transforms span its own group, and the pass does not carry a grouped-GEMM weight's "
          "per-expert maps")


def gathered_shape(local: Sequence[int], world: int) -> tuple[int, ...]:
    """The shape of the gradient a collective over `world` ranks reduces for a parameter whose
    dim-0 shard on this rank is `local`: `world` times its rows (`euclidean_plan`'s `shape`)."""
    return (world * local[0], *local[1:]) if local else ()


def euclidean_plan(state: GiftState, fqn: str, shape: Sequence[int], world: int, *,
                   error_feedback: bool = False, split_rows: bool = True) -> ItemPlan | None:
    """The one rule for a gradient GIFT sends without a map (a parameter outside its layers):
    the item parameter `fqn` goes as when the tensor a collective reduces over `world` ranks
    has `shape` (this rank's whole gradient before the collective; for a reduce-scatter,
    `split_rows`, one that splits along dim 0 among the ranks). None where it goes raw, at its
    own dtype: the opt-outs (`GiftConfig.unmapped_format` / `excluded_format` / `tiny_format`
    "fp32") and a shape with no element. Otherwise:

    - tiny (`config.is_tiny`: fewer than two dims or `min_numel` elements: norms, biases) at
      `tiny_format` (bf16), viewed `[numel, 1]` so that an all-reduce's row padding adds at
      most `world` elements and a reduce-scatter's row blocks are each rank's elements;
    - the rest viewed ``[prod(shape[:-1]), shape[-1]]`` at `unmapped_format`, or
      `excluded_format` where `exclude` matches it (`GiftConfig.unmapped_format_for`; a
      `layer_formats` entry wins), with none of a layer's own tensors (map, gate), every row with
      its own scales; at `tiny_format` instead, logged naming it, where its codes would take
      at least bf16's bytes (a scale block longer than a row) or, `split_rows`, its dim 0 does
      not split over `world` (a rank's rows would not be whole).

    With `error_feedback` (the caller keeps the item's residual, `GiftState.add_outside_residual`)
    a low-bit item has the state's error feedback (its decay and residual format) where the
    config asks for it; otherwise none, and a 16-bit item never (its rounding is below the
    codes' noise)."""
    config, spec = state.config, state.layer_spec
    if not shape or math.prod(shape) == 0:
        return None
    numel = math.prod(shape)
    base = dataclasses.replace(spec.plan, name=fqn, kind=IDENTITY_KIND, n_tensors=0, second_hop_error_feedback=False)
    if not is_tiny(tuple(shape), config.min_numel):
        fmt = config.unmapped_format_for(fqn)
        if fmt == FULL_PRECISION:
            return None  # the opt-out: raw at its dtype
        rows, cols = math.prod(shape[:-1]), shape[-1]
        coded = FormatSpec(fmt, config.scaling, config.block_size)
        why = (f"its {shape[0]} rows do not split over {world} ranks" if split_rows and shape[0] % world
               else f"{fmt} codes of its [{rows}, {cols}] view take at least bf16's bytes (block_size "
                    f"{config.block_size})" if not coded.passthrough and wire_bytes_for(coded, rows, cols) >= 2 * numel
               else None)
        if why is None:
            plan = dataclasses.replace(base, rows=rows, cols=cols, format=fmt,
                                       block_rotation=base.block_rotation and coded.block is not None)
            keep = error_feedback and plan.error_feedback and not coded.passthrough
            return plan if keep else _without_feedback(plan)
        logger.warning("GIFT: %s goes at tiny_format=%s, not %s: %s", fqn, config.tiny_format, fmt, why)
    if config.tiny_format == FULL_PRECISION:
        return None
    return _without_feedback(dataclasses.replace(base, rows=numel, cols=1, format=config.tiny_format,
                                                 block_rotation=False))


def _without_feedback(plan: ItemPlan) -> ItemPlan:
    return dataclasses.replace(plan, error_feedback=False, error_feedback_decay=1.0, residual_format="fp32")


def outside_item(state: GiftState, fqn: str, shape: Sequence[int], world: int, device: torch.device, *,
                 collective: Collective, layout: NodeLayout) -> tuple[ItemPlan | None, ItemTensors | None]:
    """The plan and runtime tensors of a parameter outside the layers whose gradient a hook
    sends in its bucket (`euclidean_plan`'s rule; `shape` the gradient the collective reduces):
    a seed offset, and where the item has error feedback a residual the state keeps
    (`GiftState.add_outside_residual`, checkpointed), `[rows, cols]` of the item or under a
    two-level `layout` its node chunk's rows. `(None, None)`: raw. The DDP hook, FSDP2's
    reduce-scatter and GIFT's own sync of a plain module build their items here; each is
    recorded on the state (`GiftState.outside_items`) for the apply report."""
    plan = euclidean_plan(state, fqn, shape, world, error_feedback=True,
                          split_rows=collective is Collective.REDUCE_SCATTER)
    state.outside_items[fqn] = plan, tuple(shape)  # what the apply report prices
    if plan is None:
        return None, None
    residual = None
    if plan.error_feedback:
        residual = state.add_outside_residual(fqn, (residual_rows(plan.rows, world, layout), plan.cols), device)
    seed = torch.tensor(plan.seed_offset, dtype=torch.int64, device=device)
    return plan, ItemTensors((), residual, None, seed)


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
