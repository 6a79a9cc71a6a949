"""`apply` / `remove` / `step` / `no_sync`: put a model's weight gradients on the GIFT path.

One entry point for every way a model is data-parallel:

* a plain module (one replica per rank): GIFT does the gradient sync itself. Each managed
  linear's forward routes its weight through an identity autograd function whose backward
  emits, in a traced graph, `gift::mark(grad, [state tensors], plan)` followed by a
  functional `all_reduce`; the FX pass (registered with Inductor) rewrites the pair into the
  quantized collective. Eagerly the same backward calls the same core directly. Other
  parameters travel at full precision in one bucket per backward (`gift_compile.plain_sync`).
* `fully_shard` (FSDP2): its reduce-scatter never enters a graph; `FSDPModule.
  set_custom_reduce_scatter` gets GIFT's bucketed reduce-scatter (`gift_compile.fsdp2`).
* `DistributedDataParallel`: a DDP comm hook runs GIFT's bucketed all-reduce on each bucket
  (`gift_compile.ddp`).
* SimpleFSDP-style models whose parameters are DTensors with a traced reduce-scatter
  (torchtitan's graph_trainer): only the mark is added; the pass rewrites the framework's
  (possibly bucketed) reduce-scatters.

The state advances once per optimizer step (`apply(..., optimizer=opt)` installs the hooks,
or call `gift_compile.step(model)`), not per backward pass.
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
from torch._subclasses.fake_tensor import is_fake

from gift_compile import collectives
from gift_compile.config import GiftConfig
from gift_compile.health import check_replicas
from gift_compile.plan import BucketPlan, ItemPlan
from gift_compile.selection import leaf_optimizers
from gift_compile.state import GiftState, LayerState, unpack_mark_tensors

logger = logging.getLogger("gift_compile")
_c10d = torch.ops._c10d_functional
_warned_unrewritten: set[str] = set()
_applied: set[int] = set()  # ids of models with GIFT applied: the Inductor pass stays while any is left

# How a managed weight's backward behaves (a forward argument, so a change is a dynamo guard:
# at most three graph variants, never a recompile from step to step).
SYNC, ACCUMULATE, SYNC_PENDING = "sync", "accumulate", "sync_pending"


@torch.library.custom_op("gift::mark", mutates_args=())
def mark(grad: torch.Tensor, state: list[torch.Tensor], plan: str) -> torch.Tensor:
    """Identity on a managed weight's gradient that carries its static plan and state tensors.

    The FX pass consumes it; executing it means no pass rewrote the graph (a backend without
    Inductor's post-grad hooks, or an eager SimpleFSDP model), so the gradient would travel at
    full precision. That raises unless the layer's config says `unrewritten="warn"`.
    """
    item = ItemPlan.from_str(plan)
    message = (f"GIFT: the gradient of {item.name} reached gift::mark without the GIFT pass rewriting its "
               "collective (compiled without Inductor's post-grad passes, or run eagerly on a framework whose "
               "collective GIFT only rewrites in graphs); it would travel at full precision")
    if item.unrewritten == "error":
        raise RuntimeError(message + ". Set GiftConfig(unrewritten='warn') to allow that.")
    if item.name not in _warned_unrewritten:
        _warned_unrewritten.add(item.name)
        logger.warning("%s (unrewritten='warn')", message)
    return grad.clone()


@mark.register_fake
def _mark_fake(grad: torch.Tensor, state: list[torch.Tensor], plan: str) -> torch.Tensor:
    return torch.empty_like(grad)


def _tracing(t: torch.Tensor) -> bool:
    return torch.compiler.is_compiling() or is_fake(t)


class _GiftTag(torch.autograd.Function):
    """Identity whose backward marks the gradient for a framework-owned collective."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, plan: str, *state: torch.Tensor) -> torch.Tensor:
        # State tensors are ctx attributes, not saved tensors: other layers' backward passes
        # update the shared counters in place before this one runs, which autograd's version
        # check on saved tensors would reject.
        ctx.plan, ctx.state = plan, state
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        state = list(ctx.state)
        return (torch.ops.gift.mark(grad, state, ctx.plan), None, *[None] * len(state))


class _GiftSync(torch.autograd.Function):
    """Identity whose backward synchronises the gradient over the data-parallel group.

    `mode` SYNC communicates this backward's gradient; ACCUMULATE adds it to `pending` and
    returns no gradient (gradient accumulation without communication); SYNC_PENDING
    communicates gradient + `pending` and clears it, so an accumulated step is sent once.
    """

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, plan: str, group_name: str, op: str, mode: str,
                pending: torch.Tensor | None, *state: torch.Tensor) -> torch.Tensor:
        ctx.plan, ctx.group_name, ctx.op, ctx.mode = plan, group_name, op, mode
        ctx.pending, ctx.state = pending, state  # attributes, not saved tensors: see _GiftTag
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved, pending = list(ctx.state), ctx.pending
        nones = [None] * (5 + len(saved))
        if ctx.mode == ACCUMULATE:
            pending.add_(grad)
            return (None, *nones)
        if ctx.mode == SYNC_PENDING:
            grad = grad + pending
            pending.zero_()
        if _tracing(grad):
            marked = torch.ops.gift.mark(grad, saved, ctx.plan)
            return (_c10d.wait_tensor(_c10d.all_reduce(marked, ctx.op, ctx.group_name)), *nones)
        item = ItemPlan.from_str(ctx.plan).with_dtype(grad.dtype)
        tensors, shared = unpack_mark_tensors(item, saved)
        _, world, _ = collectives.group_info(ctx.group_name)
        plan = BucketPlan((item,), world, ctx.group_name, ctx.op == "avg", "all_reduce")
        # eager only: layers taken in another order on another rank raise instead of hanging
        collectives.check_plan_agreement(plan, dist.distributed_c10d._resolve_process_group(ctx.group_name))
        outs, _ = collectives.run_bucket([grad], [tensors], shared, plan)
        return (outs[0].to(grad.dtype).reshape(grad.shape), *nones)


def observe_inputs(module: nn.Module, args: tuple[Any, ...]) -> None:
    """Forward pre-hook feeding a managed layer's K-FAC statistics (training passes only, and
    only while the layer's selection needs them: a Python flag, so a compiled forward stops
    computing them after one recompilation)."""
    layer: LayerState = module._gift_layer
    if torch.is_grad_enabled() and layer.collect_stats:
        layer.stats.observe(args[0])


def _routed_weight(module: nn.Module, w: torch.Tensor) -> torch.Tensor:
    """`w` routed through GIFT's autograd function (identity forward)."""
    if not (torch.is_grad_enabled() and w.requires_grad):
        return w
    layer: LayerState = module._gift_layer
    gstate: GiftState = module._gift_state
    plan = layer.plan_str
    tensors = layer.mark_tensors(gstate.shared)
    if module._gift_group_name is None:
        return _GiftTag.apply(w, plan, *tensors)
    pending = layer.pending if layer.mode != SYNC else None
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


def eligible_linears(model: nn.Module, config: GiftConfig, world: int, *, split_rows: bool) -> Iterator[tuple[str, nn.Module]]:
    """`(fqn of the weight, module)` of every linear GIFT manages in `model`.

    Eligible: weights of `nn.Linear` (sub)class modules, 2-D, floating point, at least
    `config.min_numel` elements, FQN not matched by `config.exclude`, and (`split_rows`, for
    reduce-scatter paths) a row count divisible by the world size. Ineligible weights that
    are big enough are logged with the reason: they travel at full precision.
    """
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        w = module._parameters.get("weight")
        name = f"{fqn}.weight" if fqn else "weight"
        if w is None or w.dim() != 2 or w.numel() < config.min_numel or config.is_excluded(name):
            continue
        if not w.is_floating_point():
            logger.warning("GIFT: %s stays at full precision: dtype %s is not floating point", name, w.dtype)
            continue
        if split_rows and w.shape[0] % world:
            logger.warning("GIFT: %s stays at full precision: %d rows do not split over %d ranks", name, w.shape[0], world)
            continue
        yield name, module


def manage(model: nn.Module, config: GiftConfig, group: dist.ProcessGroup | None, *, mode: str,
           device: torch.device | str | None = None, split_rows: bool = False) -> GiftState:
    """Register `model`'s eligible linear weights with a new `GiftState`; the one function
    behind `apply` and the torchtitan adapter.

    `mode`: "sync" (GIFT all-reduces the gradient itself, in the weight's backward), "tag"
    (only the `gift::mark`: a traced framework collective is rewritten by the pass), or
    "stats" (only the K-FAC statistics hook: a framework hook calls GIFT's collective).
    The state's tensors live on `device` (default: each weight's), which matters for
    frameworks that parallelize on the meta device and materialize afterwards.
    """
    if mode not in ("sync", "tag", "stats"):
        raise ValueError(f"gift_compile.manage: mode={mode!r}; allowed: sync, tag, stats")
    if getattr(model, "_gift_state", None) is not None:
        raise ValueError("gift_compile: GIFT is already applied to this model; call gift_compile.remove first")
    collective = "all_reduce" if mode == "sync" else "reduce_scatter"
    state = GiftState(config, group, collective=collective)
    world = state.world()
    group_name = group.group_name if mode == "sync" and world > 1 else None
    handles: list[Any] = []
    for name, module in eligible_linears(model, config, world, split_rows=split_rows):
        w = module._parameters["weight"]
        layer = state.add_layer(name, (int(w.shape[0]), int(w.shape[1])), device if device is not None else w.device)
        module._gift_layer = layer
        state.modules[name] = module
        if mode in ("sync", "tag"):
            module._gift_state = state
            module._gift_group_name = group_name
            module.__class__ = _managed_class(type(module))
        if layer.stats is not None:
            handles.append(module.register_forward_pre_hook(observe_inputs))
    state.handles.extend(handles)
    state.grad_source = (_momentum_missing if config.geometry == "momentum"
                         else lambda name: state.modules[name]._parameters["weight"].grad)
    model._gift_state = state
    state.check_agreement()
    return state


def _default_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if group is not None:
        return group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _has_dtensor_params(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def apply(model: nn.Module, config: GiftConfig | None = None, *, group: dist.ProcessGroup | None = None,
          optimizer: torch.optim.Optimizer | None = None, fuse: bool = True) -> nn.Module:
    """Manage `model`'s eligible linear weights with GIFT; call before `torch.compile(model)`.

    `model` may be a plain module (GIFT synchronises its gradients over `group`, default the
    world), a `fully_shard`ed (FSDP2) model, a `DistributedDataParallel` model, or a model
    whose parameters are DTensors with a traced reduce-scatter (SimpleFSDP). `optimizer`
    installs the step driver (health check before its step, `GiftState.step()` after);
    without it call `gift_compile.step(model)` after each optimizer step. `fuse` runs the
    FSDP2/DDP hooks' collective through `torch.compile` (fused kernels). Applying twice
    with the same config is a no-op; with another config it is an error.
    """
    config = config or GiftConfig()
    if config.geometry == "momentum" and optimizer is None:
        raise ValueError("gift_compile.apply: geometry='momentum' builds each layer's map from the optimizer's "
                         "momentum; pass optimizer=")
    existing: GiftState | None = getattr(model, "_gift_state", None)
    if existing is not None:
        if existing.config == config:
            return model
        raise ValueError("gift_compile.apply: model already has GIFT with a different config; call gift_compile.remove first")
    group = _default_group(group)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        from gift_compile import ddp

        state = ddp.install(model, config, group, fuse=fuse)
        kind = "DDP comm hook"
    elif _fsdp2_modules(model):
        from gift_compile import fsdp2

        state = manage(model, config, fsdp2.shard_group(model, group), mode="stats", split_rows=True)
        fsdp2.install(model, state, compiled=fuse)
        kind = "FSDP2 custom reduce-scatter"
    elif _has_dtensor_params(model):
        state = manage(model, config, group, mode="tag", split_rows=True)
        kind = "rewrite of the traced reduce-scatters"
    else:
        world = collectives.group_info(group)[1]
        if world == 1:
            logger.warning("gift_compile.apply: single process, no gradient communication to compress; nothing managed")
        state = manage(model, config, group, mode="sync") if world > 1 else GiftState(config, None)
        model._gift_state = state
        if world > 1:
            from gift_compile.plain_sync import PlainSync

            state.handles.extend(PlainSync(model, state, group).install())
        kind = "GIFT all-reduce in the backward graph"
    if optimizer is not None:
        attach_optimizer(state, optimizer)
    else:
        logger.warning("gift_compile.apply: no optimizer given; call gift_compile.step(model) after every optimizer "
                       "step, or GIFT's geometry never refreshes and health checks never run")
    _applied.add(id(model))
    from gift_compile.passes.inductor import register_inductor_pass

    register_inductor_pass()
    logger.info("gift_compile.apply: %d weights managed via %s (%s)", len(state.layers), kind, ", ".join(state.layers))
    return model


def attach_optimizer(state: GiftState, optimizer: torch.optim.Optimizer) -> None:
    """Drive `state` from `optimizer`: before each step, refuse gradients accumulated under
    `no_sync` that were never synchronised and raise (on every rank) for bad headers or for
    managed gradients that differ between replicas (`gift_compile.health`); after each step,
    `state.step()` (seed, refresh)."""

    def before(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        state.check_pending()
        state.check_health()
        check_replicas(state)

    def after(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        state.step()

    state.handles.append(optimizer.register_step_pre_hook(before))
    state.handles.append(optimizer.register_step_post_hook(after))
    if state.config.geometry == "momentum":
        state.grad_source = momentum_source(state, optimizer)


# optimizer state keys holding a momentum (torch Muon / SGD, then Adam / AdamW)
MOMENTUM_KEYS = ("momentum_buffer", "exp_avg")


def _momentum_missing(name: str) -> torch.Tensor:
    raise RuntimeError(f"GIFT: geometry='momentum' but no optimizer is attached, so layer {name} has no momentum to "
                       "build its map from; pass optimizer= to gift_compile.apply or call attach_optimizer")


def momentum_source(state: GiftState, optimizer: Any) -> Callable[[str], torch.Tensor]:
    """The factor source of `geometry="momentum"`: each managed weight's momentum in the
    optimizer state (`MOMENTUM_KEYS`), identical on every rank because the replicas are (or,
    under FSDP2, the rank's shard of it). Raises naming the layer when the optimizer keeps
    none for it (an optimizer without momentum would otherwise leave the layer Euclidean)."""
    leaves = leaf_optimizers(optimizer)

    def source(name: str) -> torch.Tensor:
        weight = state.modules[name]._parameters["weight"]
        for opt in leaves:
            st = opt.state.get(weight, {})
            for key in MOMENTUM_KEYS:
                if key in st:
                    return st[key]
        kinds = ", ".join(type(o).__name__ for o in leaves)
        raise RuntimeError(f"GIFT: geometry='momentum' but the optimizer ({kinds}) keeps no momentum "
                           f"({' or '.join(MOMENTUM_KEYS)}) for layer {name} at step {state.steps}; use geometry="
                           "'lowrank' or 'gradient', or an optimizer with momentum")

    return source


def step(model: nn.Module) -> None:
    """Advance GIFT's state by one optimizer step (call after `optimizer.step()` when `apply`
    got no optimizer)."""
    st = state(model)
    st.check_pending()
    check_replicas(st)
    st.step()


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside accumulate gradients locally without communicating; the next
    backward outside sends the accumulated gradient once (like DDP's `no_sync`).

    For DDP and FSDP2 models this defers to the framework's own switch (`model.no_sync()`,
    `set_requires_gradient_sync(False)`). For GIFT's own sync, managed weights accumulate into
    a GIFT buffer (their `.grad` stays unset until the synchronising backward) and the other
    parameters into `.grad`. Each distinct mode is one compiled graph variant.
    """
    st = state(model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
        return
    fsdp = _fsdp2_modules(model)
    if fsdp:
        for m in fsdp:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for m in fsdp:
                m.set_requires_gradient_sync(True, recurse=False)
        return
    st.enter_accumulate()
    try:
        yield
    finally:
        st.exit_accumulate()


def remove(model: nn.Module) -> nn.Module:
    """Undo `apply`: original module classes, no hooks, no GIFT state. FSDP2 gets its default
    reduce-scatter back; a DDP comm hook cannot be unregistered, so it switches to DDP's
    plain fp32 all-reduce (logged)."""
    st: GiftState | None = getattr(model, "_gift_state", None)
    if st is None:
        return model
    for mod in model.modules():
        _unmanage_module(mod)
    for h in st.handles:
        h.remove()
    st.handles.clear()
    st.active = False
    for mod in model.modules():
        mod.__dict__.pop("_gift_state", None)
    if _fsdp2_modules(model):
        from gift_compile import fsdp2

        fsdp2.uninstall(model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        logger.warning("gift_compile.remove: DDP keeps its comm hook; it now runs DDP's plain fp32 all-reduce")
    _applied.discard(id(model))
    if not _applied:
        from gift_compile.passes.inductor import unregister_inductor_pass

        unregister_inductor_pass()
    return model


def state(model: nn.Module) -> GiftState:
    """The `GiftState` of a model `apply` was called on (looks through `torch.compile`)."""
    s = getattr(model, "_gift_state", None)
    if s is None:
        s = getattr(getattr(model, "_orig_mod", None), "_gift_state", None)
    if s is None:
        raise ValueError("gift_compile.state: gift_compile.apply was not called on this model")
    return s
