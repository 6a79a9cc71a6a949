"""Register a parallelized torchtitan model's linear weights with a :class:`GiftState`.

torchtitan parallelizes on the meta device and materializes afterwards, shards rows over a
data-parallel mesh that need not be the world, and (graph_trainer) replaces module classes
and stores bound ``forward``s on instances. This module therefore places the state on the
device the caller names and, for graph_trainer, uses ``gift_compile.api.manage_module``
(a ``weight`` property on top of SimpleFSDP's, plus a statistics pre-hook) so the
``gift::mark``-tagged gradient flows into SimpleFSDP's reduce-scatter, which the pass then
rewrites. With FSDP2 no tag is needed: its reduce-scatter never enters a graph and
:mod:`.fsdp2` replaces it directly, reading the same ``GiftState``.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn as nn
from gift_compile.api import observe_inputs, manage_module
from gift_compile.config import GiftConfig
from gift_compile.state import GiftState

__all__ = ["gift_state", "manage_linears"]


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
        if tag_gradients:
            manage_module(module, layer, state.seed, group_name=None)
        else:  # FSDP2: its reduce-scatter is replaced by .fsdp2; only the statistics are needed
            module._gift_layer = layer
            if layer.stats is not None:
                module.register_forward_pre_hook(observe_inputs)
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

