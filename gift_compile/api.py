"""`apply` / `remove`: put a model's weight gradients on the GIFT path.

`apply` gives each managed linear module a subclass of its own class (same parameters,
same state-dict keys) whose `weight` property routes the weight through an identity autograd
function, and a forward pre-hook that feeds the K-FAC statistics. Its backward emits, in a traced graph,

    gift::mark(grad, [transform tensors, residual?, probe, seed], layer_id)

followed (for a model without traceable data parallelism of its own) by a functional
`all_reduce`. The FX pass in `gift_compile.passes` recognises the mark under the collective
and rewrites the pair into the quantized collective. Eagerly (no compile) the same backward
calls the core collective directly, so eager and compiled training agree.

For models whose data parallelism already puts the reduce-scatter into the graph (SimpleFSDP
in torchtitan's graph_trainer) `apply` only tags the gradient and leaves the collective to
that framework; the pass then rewrites its reduce-scatter.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from gift_compile import collectives
from gift_compile.config import GiftConfig
from gift_compile.state import GiftState, LayerState, lookup_layer

logger = logging.getLogger("gift_compile")
_c10d = torch.ops._c10d_functional
_LAYER_SEED_STRIDE = 7919
_warned_unrewritten: set[int] = set()
_applied: set[int] = set()  # ids of models with GIFT applied: the Inductor pass stays while any is left


@torch.library.custom_op("gift::mark", mutates_args=())
def mark(grad: torch.Tensor, state: list[torch.Tensor], layer: int) -> torch.Tensor:
    """Identity on a managed weight's gradient that names its layer and GIFT state.

    Executing it means no GIFT pass rewrote the graph (e.g. a backend without Inductor's
    post-grad hooks): the gradient then travels at full precision, and we say so once.
    """
    if layer not in _warned_unrewritten:
        _warned_unrewritten.add(layer)
        logger.warning(
            "GIFT: gradient of %s was not rewritten by the GIFT pass (compiled without Inductor, or "
            "the pass did not run); it is communicated at full precision", lookup_layer(layer).fqn
        )
    return grad.clone()


@mark.register_fake
def _mark_fake(grad: torch.Tensor, state: list[torch.Tensor], layer: int) -> torch.Tensor:
    return torch.empty_like(grad)


def _tracing(t: torch.Tensor) -> bool:
    return torch.compiler.is_compiling() or is_fake(t)


def layer_seed(layer: LayerState, seed: torch.Tensor) -> torch.Tensor:
    """Per-layer, per-step stochastic-rounding seed (per-rank offset added by the collective)."""
    return seed + layer.layer_id * _LAYER_SEED_STRIDE


class _GiftTag(torch.autograd.Function):
    """Identity whose backward marks the gradient for a framework-owned collective."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, layer_id: int, *state: torch.Tensor) -> torch.Tensor:
        ctx.layer_id = layer_id
        ctx.save_for_backward(*state)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        state = list(ctx.saved_tensors)
        return (torch.ops.gift.mark(grad, state, ctx.layer_id), None, *[None] * len(state))


class _GiftSync(torch.autograd.Function):
    """Identity whose backward all-reduces the gradient over the data-parallel group."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, layer_id: int, group_name: str, op: str, *state: torch.Tensor) -> torch.Tensor:
        ctx.layer_id, ctx.group_name, ctx.op = layer_id, group_name, op
        ctx.save_for_backward(*state)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        state = list(ctx.saved_tensors)
        nones = [None] * (3 + len(state))
        if _tracing(grad):
            marked = torch.ops.gift.mark(grad, state, ctx.layer_id)
            return (_c10d.wait_tensor(_c10d.all_reduce(marked, ctx.op, ctx.group_name)), *nones)
        layer = lookup_layer(ctx.layer_id)
        seed = state[-1]
        with torch.no_grad():
            layer.probe.copy_(grad.reshape(layer.shape)[: layer.probe.shape[0]])
            out = collectives.all_reduce(
                grad, ctx.group_name, layer.config, layer.transform, layer.residual, seed=layer_seed(layer, seed)
            )
        return (out, *nones)


def observe_inputs(module: nn.Module, args: tuple[Any, ...]) -> None:
    """Forward pre-hook feeding a managed layer's K-FAC statistics (training passes only)."""
    if torch.is_grad_enabled():
        module._gift_layer.stats.observe(args[0])


_MANAGED_CLASSES: dict[type, type] = {}


def _managed_class(cls: type) -> type:
    """Cached subclass of `cls` whose `weight` routes through GIFT while grads are recorded.

    A `weight` property (rather than a new `forward`) works for any linear class, for
    frameworks that store a bound `forward` on the instance (torchtitan's graph_trainer),
    and on top of SimpleFSDP's own `weight` property, which all-gathers the shard: the
    marked gradient then flows into SimpleFSDP's reduce-scatter.
    """
    if cls in _MANAGED_CLASSES:
        return _MANAGED_CLASSES[cls]
    base = getattr(cls, "weight", None)

    def weight(self: nn.Module) -> torch.Tensor:
        w = base.__get__(self, cls) if isinstance(base, property) else self._parameters["weight"]
        if not (torch.is_grad_enabled() and w.requires_grad):
            return w
        layer: LayerState = self._gift_layer
        state = layer.graph_tensors(self._gift_seed)
        if self._gift_group_name is None:
            return _GiftTag.apply(w, layer.layer_id, *state)
        return _GiftSync.apply(w, layer.layer_id, self._gift_group_name, layer.config.reduce_op, *state)

    managed = type(f"Gift{cls.__name__}", (cls,), {"weight": property(weight), "_gift_base_class": cls})
    _MANAGED_CLASSES[cls] = managed
    return managed


def manage_module(module: nn.Module, layer: LayerState, seed: torch.Tensor, group_name: str | None) -> list[Any]:
    """Put `module.weight` on the GIFT path; returns the hook handles to remove later.

    `group_name=None` only marks the gradient (the framework owns the collective); a group
    name makes the weight's backward all-reduce over that group itself.
    """
    module._gift_layer = layer
    module._gift_seed = seed
    module._gift_group_name = group_name
    module.__class__ = _managed_class(type(module))
    return [module.register_forward_pre_hook(observe_inputs)] if layer.stats is not None else []


def unmanage_module(module: nn.Module) -> None:
    """Undo `manage_module` (the caller removes the returned hooks)."""
    base = getattr(type(module), "_gift_base_class", None)
    if base is not None:
        module.__class__ = base
    for attr in ("_gift_layer", "_gift_group_name", "_gift_seed"):
        module.__dict__.pop(attr, None)


def _has_traceable_dp(model: nn.Module) -> bool:
    """True when parameters are DTensors (SimpleFSDP / FSDP2): the framework owns the sync."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _default_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if group is not None:
        return group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def apply(model: nn.Module, config: GiftConfig | None = None, *, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Manage `model`'s eligible linear weights with GIFT; call before `torch.compile(model)`.

    Eligible: 2-D `nn.Linear` weights with at least `config.min_numel` elements whose FQN is
    not matched by `config.exclude`. If the model has no data parallelism of its own, its
    gradients are synchronised over `group` (default: the world): managed weights through the
    traced GIFT all-reduce, all other parameters by a full-precision all-reduce hook. Applying
    twice with the same config is a no-op; with another config it is an error.
    """
    config = config or GiftConfig()
    existing: GiftState | None = getattr(model, "_gift_state", None)
    if existing is not None:
        if existing.config == config:
            return model
        raise ValueError("gift_compile.apply: model already has GIFT with a different config; call gift_compile.remove first")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError("gift_compile.apply: pass the module, not a DistributedDataParallel wrapper (GIFT does the sync)")
    owns_sync = _has_traceable_dp(model)
    group = _default_group(group)
    state = GiftState(config, group, collective="reduce_scatter" if owns_sync else "all_reduce")
    world = state.world()
    if not owns_sync and world == 1:
        logger.warning("gift_compile.apply: single process, no gradient communication to compress; nothing managed")
    group_name = None if owns_sync else (group.group_name if world > 1 else None)
    managed: list[nn.Parameter] = []
    handles: list[Any] = []
    for fqn, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or (not owns_sync and world == 1):
            continue
        w = mod._parameters.get("weight")
        name = f"{fqn}.weight" if fqn else "weight"
        if w is None or w.dim() != 2 or w.numel() < config.min_numel or config.is_excluded(name):
            continue
        if not w.is_floating_point() or (owns_sync and w.shape[0] % world):
            logger.warning("GIFT: %s stays at full precision (dtype %s, shape %s)", name, w.dtype, tuple(w.shape))
            continue
        layer = state.add_layer(name, tuple(w.shape), w.device)
        handles += manage_module(mod, layer, state.seed, group_name)
        managed.append(w)
    if not owns_sync and world > 1:
        handles += _install_sync_hooks(model, state, managed, group)
    by_name = dict(zip(state.layers, managed))
    state.grad_source = lambda name: by_name[name].grad  # geometry="gradient": the reduced grad
    model._gift_state = state
    model._gift_handles = handles
    _applied.add(id(model))
    from gift_compile.passes.inductor import register_inductor_pass

    register_inductor_pass()
    logger.info("gift_compile.apply: %d weights managed (%s)", len(state.layers), ", ".join(state.layers))
    return model


def _install_sync_hooks(
    model: nn.Module, state: GiftState, managed: list[nn.Parameter], group: dist.ProcessGroup
) -> list[Any]:
    """Full-precision all-reduce for unmanaged params; `state.step()` once all managed grads landed."""
    managed_ids = {id(p) for p in managed}
    average = state.config.reduce_op == "avg"
    world = state.world()
    handles = []
    seen = [0]

    def sync_plain(p: torch.Tensor) -> None:
        dist.all_reduce(p.grad, group=group)
        if average:
            p.grad.div_(world)

    def count_managed(p: torch.Tensor) -> None:
        seen[0] += 1
        if seen[0] == len(managed):
            seen[0] = 0
            state.step()

    for p in model.parameters():
        if not p.requires_grad:
            continue
        hook = count_managed if id(p) in managed_ids else sync_plain
        handles.append(p.register_post_accumulate_grad_hook(hook))
    return handles


def remove(model: nn.Module) -> nn.Module:
    """Undo `apply`: plain `nn.Linear` modules, no hooks, no GIFT state."""
    state: GiftState | None = getattr(model, "_gift_state", None)
    if state is None:
        return model
    for mod in model.modules():
        unmanage_module(mod)
    for h in model._gift_handles:
        h.remove()
    del model._gift_state
    del model._gift_handles
    _applied.discard(id(model))
    if not _applied:
        from gift_compile.passes.inductor import unregister_inductor_pass

        unregister_inductor_pass()
    return model


def state(model: nn.Module) -> GiftState:
    """The `GiftState` of a model `apply` was called on."""
    s = getattr(model, "_gift_state", None)
    if s is None:
        # torch.compile wraps the module: look through the wrapper
        s = getattr(getattr(model, "_orig_mod", None), "_gift_state", None)
    if s is None:
        raise ValueError("gift_compile.state: gift_compile.apply was not called on this model")
    return s

