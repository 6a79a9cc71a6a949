"""Which linears GIFT manages and how their weights reach it: `manage`, the class swap that
routes a weight through the `gift::mark` autograd functions, and the statistics hook.

`manage` registers a model's eligible linear weights with a new `GiftState` (the one function
behind `gift_compile.apply` and the framework adapters); `_managed_class` gives a managed
linear a cached subclass whose forward routes the weight through `_GiftTag` / `_GiftSync`;
`observe_inputs` feeds the layer's input statistics, except inside `statistics_paused` (forward
passes that are not training data, such as a pipeline schedule's shape inference).

`model` may be the several parts (pipeline stages) one rank holds (`gift_compile.frameworks.parts`): one
state then manages the linears of all of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from gift_compile.codec.layout import Choice
from gift_compile.config import AUTO_GEOMETRY, GiftConfig
from gift_compile.exchange.mark import SyncMode, _GiftSync, _GiftTag, tracing
from gift_compile.exchange.accounting import bucket_wire_bytes
from gift_compile.exchange.plan import BucketPlan, Collective
from gift_compile.frameworks.parts import Parts, model_parts
from gift_compile.frameworks.tensor_parallel import local_input, local_matrix_shape, on_local_block
from gift_compile.runtime.layer import LayerState
from gift_compile.runtime.state import GiftState

__all__ = ["ManageMode", "eligible_linears", "manage", "observe_inputs", "statistics_paused", "statistics_paused_now",
           "unmanage"]

logger = logging.getLogger("gift_compile")


class ManageMode(Choice):
    """How `manage` hooks a managed linear: `SYNC` (GIFT all-reduces the gradient itself, in the
    weight's backward), `TAG` (only the `gift::mark`: a traced framework collective is rewritten
    by the pass) or `STATS` (only the K-FAC statistics hook: a framework hook calls GIFT's
    collective)."""

    SYNC = "sync"
    TAG = "tag"
    STATS = "stats"


# How many `statistics_paused` contexts are open (a Python global: a compiled forward guards on it).
_paused = 0


@contextmanager
def statistics_paused() -> Iterator[None]:
    """Forward passes inside feed no statistics: they run on inputs that are not training data
    (torch's pipeline stages infer shapes with a real forward on uninitialized tensors on their
    first step), which would otherwise enter the K-FAC factors."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1


def statistics_paused_now() -> bool:
    """Whether a `statistics_paused` context is open (hooks outside this module ask it)."""
    return _paused > 0


def observe_inputs(module: nn.Module, args: tuple[Any, ...]) -> None:
    """Forward pre-hook feeding a managed layer's K-FAC statistics (training passes only: grad
    enabled and the module in training mode, so an evaluation under `model.eval()` with grad
    enabled adds nothing; only while the layer's selection needs them; never inside
    `statistics_paused`).

    Eagerly the need is a Python flag (`collect_stats`: no work for a layer that needs none).
    Traced, it is the layer's `stats_gate` tensor, and the statistic is computed and masked:
    a flag would be a guard, so every pattern of selected layers would be one compilation of
    the forward, and the blocks of a per-block compiled model (torchtitan), which share one
    code object, would hit dynamo's `recompile_limit` once more than 8 of them differ (issue
    31). The price is the statistic of a deselected layer computed for nothing in compiled
    forwards (one `[m, d_in]` product per layer, m <= `stats_tokens`). Whether a layer leads
    its statistic (`leader`) is structure that changes once, at the first refresh."""
    layer: LayerState = module._gift_layer
    if not (torch.is_grad_enabled() and module.training) or _paused:
        return
    if torch.compiler.is_compiling():
        if layer.leader is None:
            layer.stats.observe(local_input(args[0]), gate=layer.stats_gate)
    elif layer.collect_stats:
        layer.stats.observe(local_input(args[0]))


def _routed_weight(module: nn.Module, w: torch.Tensor) -> torch.Tensor:
    """`w` routed through GIFT's autograd function (identity forward)."""
    if not (torch.is_grad_enabled() and w.requires_grad):
        return w
    layer: LayerState = module._gift_layer
    gstate: GiftState = module._gift_state
    # Traced, the weight carries the selection-independent plan (the map gated by data), so a
    # compiled model has one graph whatever its layers' selection (issue 31); eagerly, the
    # active path's own plan (a deselected layer runs no map).
    traced = tracing(w)
    plan = layer.traced_plan_str if traced else layer.plan_str
    tensors = layer.mark_tensors(gstate.shared, traced=traced)
    if module._gift_group_name is None:
        return on_local_block(w, lambda block: _GiftTag.apply(block, plan, *tensors))
    pending = layer.pending if layer.mode is not SyncMode.SYNC else None
    if traced:  # GIFT's own collective: the graph's ranks agree on its plans (`ItemPlan.own_sync`)
        plan = layer.traced_sync_plan_str
    return _GiftSync.apply(w, plan, module._gift_group_name, gstate.config.reduce_op, layer.mode, pending, *tensors)


_MANAGED_CLASSES: dict[type, type] = {}


def _linear_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    return F.linear(input, _routed_weight(self, self.weight), self.bias)


def _managed_class(cls: type) -> type:
    """Cached subclass of `cls` that routes the weight through GIFT in its forward.

    For `nn.Linear` and subclasses that keep its `forward`, the subclass overrides `forward`:
    `module.weight` stays the Parameter users and optimizers expect (`.grad`,
    `requires_grad_`). A class whose `weight` is already a property (SimpleFSDP's
    all-gathering parametrization) or that brings its own `forward` gets a `weight` property
    instead, on top of its own; there `module.weight` is a computed tensor while grads are
    recorded, and the parameter is `module._parameters["weight"]`.
    """
    if cls in _MANAGED_CLASSES:
        return _MANAGED_CLASSES[cls]
    base = getattr(cls, "weight", None)
    if not isinstance(base, property) and cls.forward is nn.Linear.forward:
        managed = type(f"Gift{cls.__name__}", (cls,), {"forward": _linear_forward, "_gift_base_class": cls})
    else:
        def weight(self: nn.Module) -> torch.Tensor:
            w = base.__get__(self, cls) if isinstance(base, property) else self._parameters["weight"]
            return _routed_weight(self, w)

        managed = type(f"Gift{cls.__name__}", (cls,), {"weight": property(weight), "_gift_base_class": cls})
    _MANAGED_CLASSES[cls] = managed
    return managed


def _unmanage_module(module: nn.Module) -> None:
    base = getattr(type(module), "_gift_base_class", None)
    if base is not None:
        module.__class__ = base
    for attr in ("_gift_layer", "_gift_group_name", "_gift_state"):
        module.__dict__.pop(attr, None)


def linear_weight_names(model: Parts) -> list[str]:
    """The FQN of every `nn.Linear` (subclass) weight in `model`'s parts, named as `manage`
    names them: what the apply report lists as managed or left out of the layers."""
    return [f"{fqn}.weight" if fqn else "weight" for part in model_parts(model) for fqn, m in part.named_modules()
            if isinstance(m, nn.Linear) and m._parameters.get("weight") is not None]


def eligible_linears(model: Parts, world: int, *, min_numel: int, excluded: Callable[[str], bool], split_rows: bool,
                     group: dist.ProcessGroup | None = None, quiet: bool = False) -> Iterator[tuple[str, nn.Module]]:
    """`(fqn of the weight, module)` of every linear GIFT manages in `model` (each of its parts).

    Eligible: weights of `nn.Linear` (sub)class modules, 2-D, floating point, at least
    `min_numel` elements, not tied (registered on another module too: an embedding's decoder),
    FQN not `excluded` (`GiftConfig.min_numel`, `GiftConfig.is_excluded`:
    the rule's two settings, so callers that resolve "auto" read the config once), and (`split_rows`, for
    reduce-scatter paths) a row count divisible by the world size. Sizes are those of the
    matrix one rank of the data-parallel `group` holds (`local_matrix_shape`: a tensor-parallel
    rank's block). Ineligible weights that are big enough are logged with the reason: they
    travel with the gradients outside the layers (`frameworks.euclidean`: `unmapped_format`,
    `tiny_format`; `quiet`: not logged, for a caller that only looks ahead at what
    `manage` will take, so that each weight is said once).
    """
    def say(msg: str, *args: object) -> None:
        if not quiet:
            logger.warning(msg, *args)

    holders: dict[int, list[str]] = {}  # id(parameter) -> every "module.name" it is registered as
    for part in model_parts(model):
        for fqn, module in part.named_modules(remove_duplicate=False):
            for pname, p in module._parameters.items():
                if p is not None:
                    holders.setdefault(id(p), []).append(f"{fqn}.{pname}" if fqn else pname)
    for fqn, module in (named for part in model_parts(model) for named in part.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        w = module._parameters.get("weight")
        name = f"{fqn}.weight" if fqn else "weight"
        if w is None or w.dim() != 2 or excluded(name):
            continue
        tied = sorted(set(holders.get(id(w), ())) - {name})
        if tied:
            # the other module's use reaches the gradient outside this linear's forward: the
            # frameworks file the gradient under one name, plain sync would see a partial one
            say("GIFT: %s is not one of GIFT's layers: it is tied to %s (one parameter, several modules); it "
                "travels with the gradients outside them", name, ", ".join(tied))
            continue
        rows, cols = local_matrix_shape(w, group)
        if rows * cols < min_numel:
            continue
        if not w.is_floating_point():
            say("GIFT: %s is not one of GIFT's layers: dtype %s is not floating point", name, w.dtype)
            continue
        if split_rows and rows % world:
            say("GIFT: %s is not one of GIFT's layers: %d rows do not split over %d ranks; it travels with the "
                "gradients outside them", name, rows, world)
            continue
        yield name, module


def manage(model: Parts, config: GiftConfig, group: dist.ProcessGroup | None, *, mode: ManageMode | str,
           device: torch.device | str | None = None, split_rows: bool = False,
           collective: str | None = None) -> GiftState:
    """Register `model`'s eligible linear weights with a new `GiftState`; the one function
    behind `apply` and the torchtitan adapter.

    `mode` (`ManageMode`, or its spelling): how the weights are hooked. `collective`
    ("all_reduce" / "reduce_scatter") is what the gradients go through; by default `SYNC`
    all-reduces and the others reduce-scatter (DDP's hook all-reduces).
    The state's tensors live on `device` (default: each weight's), which matters for
    frameworks that parallelize on the meta device and materialize afterwards. With several
    parts (the pipeline stages a rank holds) the one state spans all of them; `group` is then
    the data-parallel group of those stages (never the pipeline group), so agreement,
    statistics and selection run among the ranks that hold the same layers.
    """
    parts = model_parts(model)
    mode = ManageMode.parse(mode, "gift_compile.manage: mode")
    if any(getattr(part, "_gift_state", None) is not None for part in parts):
        raise ValueError("gift_compile: GIFT is already applied to this model; call gift_compile.remove first")
    if config.geometry == AUTO_GEOMETRY:
        raise ValueError("gift_compile.manage: geometry='auto' is resolved from the optimizer before managing "
                         "(gift_compile.apply(..., optimizer=) does it, or pass geometry_for(optimizer, weights))")
    if collective is None:  # a framework hook that all-reduces (DDP) says so
        collective = Collective.ALL_REDUCE if mode is ManageMode.SYNC else Collective.REDUCE_SCATTER
    state = GiftState(config, group, collective=collective)
    world = state.world()
    group_name = group.group_name if mode is ManageMode.SYNC and world > 1 else None
    try:
        for name, module in eligible_linears(parts, world, min_numel=config.min_numel, excluded=config.is_excluded,
                                             split_rows=split_rows, group=group):
            if name in state.layers:
                raise ValueError(f"gift_compile.manage: {name} is in two model parts; the parts (pipeline stages) "
                                 "of one rank must hold disjoint layers under the whole model's names")
            w = module._parameters["weight"]
            layer = state.add_layer(name, local_matrix_shape(w, group), device if device is not None else w.device)
            module._gift_layer = layer
            state.modules[name] = module
            if mode is not ManageMode.STATS:
                module._gift_state = state
                module._gift_group_name = group_name
                module.__class__ = _managed_class(type(module))
            if layer.stats is not None:
                state.handles.append(module.register_forward_pre_hook(observe_inputs))
        state.grad_source = state.factor_source(None)
        for part in parts:
            part._gift_state = state
        state.check_agreement()
        _warn_costly_layers(state)
    except BaseException:
        unmanage(parts, state)  # all or nothing
        raise
    return state


def _warn_costly_layers(state: GiftState) -> None:
    """Name, once at set-up, the managed layers whose codes would take at least as many bytes
    as their fp32 gradient (a scale block longer than a row: `block_size=4096` on 64 columns
    pads each row to a whole block), so a config that saves nothing never runs silently. A layer
    at `format="fp32"` is full precision by choice (the layout tests' exact arm), not named."""
    world = state.world()
    costly = []
    for name, layer in state.layers.items():
        rows, cols = layer.shape
        sent = bucket_wire_bytes(BucketPlan((layer.plan,), world, None, False, state.collective))
        if layer.plan.managed and layer.plan.format != "fp32" and sent >= 4 * rows * cols:
            costly.append(f"{name} ({sent:,} bytes vs {4 * rows * cols:,} at fp32)")
    if costly:
        logger.warning("GIFT: %d managed layer(s) send at least their fp32 gradient's bytes with format=%r, "
                       "scaling=%r, block_size=%d: %s; pick a block_size no longer than a row (the layer's columns), or exclude them",
                       len(costly), state.config.format, state.config.scaling, state.config.block_size,
                       "; ".join(costly))


def unmanage(model: Parts, state: GiftState) -> None:
    """Undo `manage` (and whatever an adapter added to `state.handles`): every hook out, the
    original classes back, no GIFT attribute left on any module, the state inactive. What
    `gift_compile.remove` does before each adapter's own `remove`, and what a failed `apply`
    does so that it leaves the model as it found it."""
    for part in model_parts(model):
        for mod in part.modules():
            _unmanage_module(mod)
    for h in state.handles:
        h.remove()
    state.handles.clear()
    state.active = False
