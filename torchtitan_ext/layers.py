"""Register a parallelized torchtitan model's linear weights with a :class:`GiftState`.

``gift_compile.apply`` targets plain ``nn.Linear`` models: it swaps ``type(m) is
nn.Linear`` modules to ``GiftLinear`` and relies on that class's ``forward``. A torchtitan
model defeats each of those assumptions: its linears are ``torchtitan...Linear``
(``nn.Linear`` subclasses), graph_trainer's SimpleFSDP replaces their classes by dynamic
subclasses whose ``weight`` is a property that all-gathers the shard, and graph_trainer's
``annotate_module_fqns`` stores each module's bound ``forward`` as an instance attribute,
so a class-level ``forward`` is never called. This module therefore builds the same state
(``GiftState.add_layer``, K-FAC statistics, the ``gift::mark`` gradient tag that the FX
pass looks for) through mechanisms that survive all three:

* statistics: a forward pre-hook per managed module (hooks run whatever ``forward`` is);
* gradient tag (graph_trainer only): the module's class is swapped to a cached subclass of
  its *current* class whose ``weight`` property returns ``gift::mark``-tagged weight, on
  top of SimpleFSDP's property when there is one, so the marked gradient flows into
  SimpleFSDP's reduce-scatter and the pass rewrites exactly that collective.

With FSDP2 no tag is needed: its reduce-scatter never enters a graph and
:mod:`.fsdp2` replaces it directly, reading the same ``GiftState``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from gift_compile.config import GiftConfig
from gift_compile.state import GiftState, LayerState

__all__ = ["gift_state", "manage_linears"]


class _TagGradient(torch.autograd.Function):
    """Identity in forward; backward wraps the weight gradient in ``gift::mark``."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, layer_id: int, *state: torch.Tensor) -> torch.Tensor:
        ctx.layer_id = layer_id
        ctx.save_for_backward(*state)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        state = list(ctx.saved_tensors)
        return (torch.ops.gift.mark(grad, state, ctx.layer_id), None, *[None] * len(state))


_TAGGED_CLASSES: dict[type, type] = {}


def _tagged_class(cls: type) -> type:
    """Subclass of ``cls`` whose ``weight`` is tagged while gradients are recorded."""
    if cls in _TAGGED_CLASSES:
        return _TAGGED_CLASSES[cls]
    base_property = getattr(cls, "weight", None)

    def weight(self: nn.Module) -> torch.Tensor:
        w = base_property.__get__(self, cls) if isinstance(base_property, property) else self._parameters["weight"]
        layer: LayerState = self._gift_layer
        if not (torch.is_grad_enabled() and w.requires_grad):
            return w
        return _TagGradient.apply(w, layer.layer_id, *layer.graph_tensors(self._gift_seed))

    tagged = type(f"Gift{cls.__name__}", (cls,), {"weight": property(weight)})
    _TAGGED_CLASSES[cls] = tagged
    return tagged


def _observe_inputs(module: nn.Module, args: tuple[Any, ...]) -> None:
    if torch.is_grad_enabled():
        module._gift_layer.stats.observe(args[0])


def manage_linears(
    model: nn.Module,
    config: GiftConfig,
    group: dist.ProcessGroup,
    *,
    device: torch.device,
    tag_gradients: bool,
) -> GiftState:
    """Manage ``model``'s eligible linear weights; returns the new state.

    Eligible: weights of ``nn.Linear`` (sub)class modules, 2-D, at least
    ``config.min_numel`` elements, FQN not excluded, and a row count divisible by the
    data-parallel size (both FSDP flavours then shard rows evenly, so the collective's
    input is exactly the weight's gradient). ``tag_gradients`` installs the ``gift::mark``
    tag for graph rewriting (graph_trainer); without it only statistics are collected.
    The state's tensors live on ``device``: torchtitan parallelizes the model on the meta
    device and only then materializes it, so the weights' device is not the one to use.
    The state is also stored as ``model._gift_state`` so ``gift_compile.state(model)``
    finds it.
    """
    if getattr(model, "_gift_state", None) is not None:
        raise ValueError("GIFT is already applied to this model")
    state = GiftState(config, group, collective="reduce_scatter")
    world = dist.get_world_size(group)
    modules: dict[str, nn.Module] = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        w = module._parameters.get("weight")
        name = f"{fqn}.weight" if fqn else "weight"
        if w is None or w.dim() != 2 or not w.is_floating_point():
            continue
        shape = tuple(w.shape)  # a DTensor reports its global shape
        if shape[0] * shape[1] < config.min_numel or config.is_excluded(name) or shape[0] % world:
            continue
        layer = state.add_layer(name, (shape[0], shape[1]), device)
        module._gift_layer = layer
        module._gift_seed = state.seed
        if layer.stats is not None:
            module.register_forward_pre_hook(_observe_inputs)
        if tag_gradients:
            module.__class__ = _tagged_class(type(module))
        modules[name] = module
    if config.geometry == "gradient":
        # The sharded gradient of the parameter object FSDP registered (looked up per call:
        # SimpleFSDP's ``weight`` property would all-gather).
        state.grad_source = lambda name: modules[name]._parameters["weight"].grad
    model._gift_state = state
    return state


def gift_state(model: nn.Module) -> GiftState | None:
    """The state :func:`manage_linears` attached to ``model`` (None when GIFT is off)."""
    return getattr(model, "_gift_state", None)

