"""`apply` / `remove` / `step` / `no_sync`: put a model's weight gradients on the GIFT path.

One entry point for every way a model is data-parallel, each an adapter of the table
`gift_compile.frameworks.table` (the first whose `detect` accepts the model installs GIFT):

* a plain module (one replica per rank): GIFT does the gradient sync itself. Each managed
  linear's forward routes its weight through an identity autograd function whose backward
  emits, in a traced graph, `gift::mark(grad, [state tensors], plan)` followed by a
  functional `all_reduce`; the FX pass (registered with Inductor) rewrites the pair into the
  quantized collective. Eagerly the same backward calls the same core directly. Other
  parameters travel at full precision in one bucket per backward (`gift_compile.frameworks.plain_sync`).
* `fully_shard` (FSDP2): its reduce-scatter never enters a graph; `FSDPModule.
  set_custom_reduce_scatter` gets GIFT's bucketed reduce-scatter (`gift_compile.frameworks.fsdp2`).
* `DistributedDataParallel`: a DDP comm hook runs GIFT's bucketed all-reduce on each bucket
  (`gift_compile.frameworks.ddp`).
* SimpleFSDP-style models whose parameters are DTensors with a traced reduce-scatter
  (torchtitan's graph_trainer): only the mark is added; the pass rewrites the framework's
  (possibly bucketed) reduce-scatters (`gift_compile.frameworks.simple_fsdp`).

The state advances once per optimizer step (`apply(..., optimizer=opt)` installs the hooks,
or call `gift_compile.step(model)`), not per backward pass.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from gift_compile.config import AUTO_GEOMETRY, FALLBACK_GEOMETRY, GiftConfig, SelectMetric
from gift_compile.exchange import collectives
from gift_compile.exchange.agreement import first_difference
from gift_compile.exchange.plan import dtype_name
from gift_compile.frameworks import table
from gift_compile.frameworks.exchanges import describe_exchanges
from gift_compile.frameworks.parts import Parts
from gift_compile.frameworks.routing import (_unmanage_module, eligible_linears, linear_weight_names,  # noqa: F401
                                             manage, unmanage)
from gift_compile.geometry.optimizer_maps import leaf_optimizers
from gift_compile.geometry.optimizers import geometry_for, optimizer_family, select_metric_for
from gift_compile.geometry.table import Geometry, geometry_class
from gift_compile.passes.inductor import hold_inductor_pass, release_inductor_pass
from gift_compile.recipes import check_recipe_optimizer
from gift_compile.runtime.health import check_health_group
from gift_compile.runtime.report import ApplyReport, current, log_report, summarize
from gift_compile.runtime.state import GiftState

logger = logging.getLogger("gift_compile")

def _default_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if group is not None:
        return group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def apply(model: nn.Module, config: GiftConfig | None = None, *, group: dist.ProcessGroup | None = None,
          optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
          fuse: bool = True) -> nn.Module:
    """Manage `model`'s eligible linear weights with GIFT; call before `torch.compile(model)`.

    `model` may be a plain module (GIFT synchronises its gradients over `group`, default the
    world), a `fully_shard`ed (FSDP2) model, a `DistributedDataParallel` model, or a model
    whose parameters are DTensors with a traced reduce-scatter (SimpleFSDP): the first adapter
    of `gift_compile.frameworks.table` that detects it installs GIFT. `optimizer` installs the
    step driver (health check before its step, `GiftState.step()` after); without it call
    `gift_compile.step(model)` after each optimizer step; a list (`[muon, adamw]`: Muon for the
    matrices, AdamW for the rest) is one step driver, and "auto" follows the optimizer that
    owns the managed weights. `fuse` runs the FSDP2/DDP hooks'
    collective through `torch.compile` (fused kernels). Applying twice with the same config is
    a no-op; with another config it is an error.
    """
    config = config or GiftConfig()
    group = _default_group(group)
    if optimizer is not None:
        check_optimizer(optimizer)  # before anything is installed
    adapter = table.adapter_for(model)
    weights = managed_weights(model, config, group, split_rows=adapter.split_rows) if optimizer is not None else []
    config = resolve_auto(config, optimizer, weights)
    if geometry_class(config.geometry).needs_optimizer and optimizer is None:
        raise ValueError(f"gift_compile.apply: geometry={config.geometry!r} builds each layer's map from the "
                         "optimizer's state; pass optimizer=")
    existing: GiftState | None = getattr(model, "_gift_state", None)
    if existing is not None:
        if existing.config == config:
            if optimizer is not None and not _driven_by(existing, optimizer):
                reattach_optimizer(existing, optimizer)
            return model
        diff = first_difference(dataclasses.asdict(existing.config), dataclasses.asdict(config))
        raise ValueError(f"gift_compile.apply: model already has GIFT with a different config ({diff}: applied vs "
                         "requested); call gift_compile.remove first")
    _refuse_unsupported_dtypes(model)
    try:  # all or nothing: a failure leaves the model as it was, so apply can be called again
        state = adapter.install(model, config, group, fuse=fuse)
        if adapter.name not in state.adapters or getattr(model, "_gift_state", None) is not state:
            raise RuntimeError(f"gift_compile.apply: the {adapter.name!r} adapter's install did not attach itself to "
                               "the state it returned and set it as model._gift_state (gift_compile.frameworks.adapter)")
        if optimizer is not None:
            attach_optimizer(state, optimizer)
    except BaseException:
        _undo_apply(model)
        raise
    if optimizer is None:
        logger.warning("gift_compile.apply: no optimizer given; call gift_compile.step(model) after every optimizer "
                       "step, or GIFT's geometry never refreshes (the fault checks run at the end of each backward)")
    hold_inductor_pass(model)  # installed while a model with GIFT applied is alive (see passes.inductor)
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model  # DDP: its module's names
    state.report = dataclasses.replace(summarize(state, adapter.kind, linear_weight_names(inner),
                                                 describe_exchanges(state)), fused=fuse)
    log_report(state.report)
    return model


def report(model: nn.Module) -> ApplyReport:
    """What `apply` installed on `model`, current now: the path, format, geometry and metric as
    resolved, the layers managed and those mapped at this step, the last refresh's outcome and
    the next refresh's step, the linear weights at full precision, the globs that matched
    nothing (`gift_compile.runtime.report`; logged at WARNING on rank 0 by `apply`)."""
    st = state(model)
    return current(st.report, st)


def check_optimizer(optimizer: Any) -> None:
    """Refuse, before `apply` installs anything, an `optimizer=` GIFT cannot drive: not an
    optimizer (or a container of them), or a list naming one optimizer twice."""
    if isinstance(optimizer, (list, tuple)):
        bad = [f"{i}: {type(o).__name__}" for i, o in enumerate(optimizer) if not isinstance(o, torch.optim.Optimizer)]
        if bad or not optimizer:
            raise TypeError("gift_compile.apply: optimizer=[...] must list torch.optim.Optimizer objects"
                            + (f" (not {', '.join(bad)})" if bad else " (the list is empty)"))
        if len({id(o) for o in optimizer}) != len(optimizer):
            raise ValueError("gift_compile.apply: optimizer=[...] names the same optimizer twice")
    leaf_optimizers(optimizer)  # raises naming the type when it is no optimizer


def _undo_apply(model: nn.Module) -> None:
    """Take out what a failed `apply` installed: `remove` for a state already set on the model,
    else (a failure inside `manage`, which undoes itself) any managed class left behind."""
    if getattr(model, "_gift_state", None) is not None:
        remove(model)
    for mod in model.modules():
        _unmanage_module(mod)


def resolve_auto(config: GiftConfig, optimizer: Any | None, weights: list[torch.Tensor]) -> GiftConfig:
    """`config` with its optimizer-dependent choices made for the optimizer that steps `weights`.

    `geometry="auto"` becomes `geometry_for(optimizer, weights)`; `select_metric="auto"`
    becomes `select_metric_for(optimizer, weights, geometry)` ("whitened" under a matrix
    preconditioner such as Muon, or for a map in the optimizer's own coordinates): the
    selection then judges each layer by the error the optimizer's update sees, which is what
    the convergence study found GIFT lowers. Without an optimizer the geometry falls back to
    K-FAC's `lowrank` and the metric to "euclidean" (both logged as warnings). The one
    resolution of "auto": the torchtitan hook and the bench call it too, with the weights of the
    model the optimizer steps (`managed_weights`); what it chose is logged as
    ``GIFT: geometry='auto' -> '<name>', select_metric='auto' -> '<name>'`` (the demo reads it).
    """
    geometry_auto, metric_auto = config.geometry == AUTO_GEOMETRY, config.select_metric is SelectMetric.AUTO
    # a recipe measured under another optimizer: said on every rank, where "auto" follows the
    # optimizer (a named geometry consults no optimizer: geometry="none" takes any)
    if config.recipe and geometry_auto and optimizer is not None and weights:
        check_recipe_optimizer(config, optimizer_family(optimizer, weights),
                               ", ".join(type(o).__name__ for o in leaf_optimizers(optimizer)))
    if not (geometry_auto or metric_auto):
        return config
    if optimizer is None:
        if geometry_auto:
            logger.warning("gift_compile.apply: geometry='auto' without optimizer=: using K-FAC's %r map; under "
                           "Adam/AdamW it loses to plain low-bit (pass optimizer= or name a geometry)",
                           FALLBACK_GEOMETRY)
            config = dataclasses.replace(config, geometry=FALLBACK_GEOMETRY)
        if metric_auto:
            logger.warning("gift_compile.apply: select_metric='auto' without optimizer=: layers are selected by the "
                           "plain (euclidean) error; under Muon/Shampoo pass optimizer= or set "
                           "select_metric='whitened'")
            config = dataclasses.replace(config, select_metric=SelectMetric.EUCLIDEAN)
        return config
    if not weights:  # nothing managed: nothing mapped or selected
        return dataclasses.replace(config, geometry=Geometry.name if geometry_auto else config.geometry,
                                   select_metric=SelectMetric.EUCLIDEAN)
    if not geometry_auto and geometry_class(config.geometry).is_identity:
        # no map, so nothing is selected: the metric is moot, whichever optimizer steps what
        return dataclasses.replace(config, select_metric=SelectMetric.EUCLIDEAN)
    chosen = dataclasses.replace(config, geometry=geometry_for(optimizer, weights)) if geometry_auto else config
    if metric_auto:
        chosen = dataclasses.replace(chosen, select_metric=select_metric_for(optimizer, weights, chosen.geometry))
    made = [f"{f}='auto' -> {getattr(chosen, f)!r}" for f, auto in (("geometry", geometry_auto),
                                                                     ("select_metric", metric_auto)) if auto]
    logger.info("GIFT: %s (optimizer %s)", ", ".join(made), ", ".join(type(o).__name__ for o in leaf_optimizers(optimizer)))
    return chosen


def _refuse_unsupported_dtypes(model: nn.Module) -> None:
    """Refuse, at `apply` and naming the parameter, a trainable parameter whose gradient GIFT's
    collectives cannot carry (fp64): every trainable gradient travels in a GIFT bucket (managed
    or passed through), and otherwise the first backward fails inside a hook, far from the cause."""
    for name, p in model.named_parameters():
        if p.requires_grad and p.is_floating_point():
            try:
                dtype_name(p.dtype)
            except TypeError as e:
                raise TypeError(f"gift_compile.apply: parameter {name} is {p.dtype}: {e}; cast the model "
                                "(model.float()) before apply") from None


def managed_weights(model: Parts, config: GiftConfig, group: dist.ProcessGroup | None, *,
                    split_rows: bool) -> list[torch.Tensor]:
    """The weights `manage` will take from `model` on the data-parallel `group` (`split_rows`:
    a reduce-scatter path), what `resolve_auto` inspects the optimizer for. Eligibility reads
    neither the geometry nor the metric, so it is computed before "auto" is resolved; the weights
    it leaves out are logged by `manage`, once."""
    world = collectives.group_info(group)[1]
    return [m._parameters["weight"] for _, m in eligible_linears(model, world, min_numel=config.min_numel,
                                                                 excluded=config.is_excluded,
                                                                 split_rows=split_rows, group=group, quiet=True)]


def attach_optimizer(state: GiftState, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], *,
                     health_group: dist.ProcessGroup | None = None) -> None:
    """Drive `state` from `optimizer`: before each step, refuse gradients accumulated under
    `no_sync` that were never synchronised; after each step, `state.step()` (seed, refresh).
    A list of optimizers is one driver: checks before the first of them steps, `state.step()`
    after the last (`_one_step_per_round`).
    The refreshes of `state` and of the states it drives (`GiftState.substates`: the routed
    experts') read gradient-side factors from `optimizer`'s state (`GiftState.factor_source`).
    The fault checks need no optimizer: they run at the end of each backward
    (`gift_compile.runtime.health.end_of_backward`).

    `health_group`: a group wider than the state's whose every rank must raise a fault any of
    them saw (the job's world when other ranks run other GIFT states: pipeline stages,
    tensor-parallel blocks), each rank's `optimizer` stepped once per step. The checks then
    record, and this pre-hook raises on all of them in the same step, before any weight changes
    (`gift_compile.runtime.health.check_health_group`)."""
    state.health_group = health_group
    state.stepped_by_optimizer = True
    first = len(state.handles)

    def before(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        check_health_group(state)  # first: a collective every rank of the group takes part in
        state.check_pending()

    def after(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        state.step()

    if isinstance(optimizer, (list, tuple)):
        before, after = _one_step_per_round(list(optimizer), before, after)
    for opt in optimizer if isinstance(optimizer, (list, tuple)) else (optimizer,):
        state.handles.append(opt.register_step_pre_hook(before))
        state.handles.append(opt.register_step_post_hook(after))
    # weakly: a driver the user dropped is not kept alive (nor its state) by GIFT
    state.driver = (tuple(weakref.ref(o) for o in leaf_optimizers(optimizer)), state.handles[first:])
    for st in (state, *state.substates):
        st.grad_source = st.factor_source(optimizer)


def _driven_by(state: GiftState, optimizer: Any) -> bool:
    """Whether `optimizer` (or the list) is what drives `state` now (`attach_optimizer`)."""
    if state.driver is None:
        return False
    return [r() for r in state.driver[0]] == list(leaf_optimizers(optimizer))


def reattach_optimizer(state: GiftState, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> None:
    """`apply` again with another optimizer (one re-created after a restart, a new schedule):
    drive `state` from it instead. The old driver's hooks are removed and its state released
    (the refreshes read the new optimizer's), so steps are counted once, by the new one; a
    silent no-op would freeze `state.steps` and the refreshes with the old optimizer gone."""
    if state.driver is not None:
        for handle in state.driver[1]:
            handle.remove()
        state.handles = [h for h in state.handles if all(h is not d for d in state.driver[1])]
        state.driver = None
    attach_optimizer(state, optimizer, health_group=state.health_group)
    logger.info("GIFT: apply with a new optimizer (%s): it drives GIFT's state from now on, the previous one is "
                "released", ", ".join(type(o).__name__ for o in leaf_optimizers(optimizer)))


def _one_step_per_round(optimizers: list[torch.optim.Optimizer], before: Any, after: Any) -> tuple[Any, Any]:
    """Hooks for an optimizer list (Muon for the matrices, AdamW for the rest): one training
    step steps each of them once, in any order, and GIFT's state must advance once, so the
    checks run before the first of them changes a weight and `after` once the last has
    stepped. An optimizer stepped twice before the others is refused, naming it: the state
    would otherwise count steps the user did not mean."""
    stepped: set[int] = set()  # the optimizers of the list that stepped in this training step
    names = {id(o): f"{type(o).__name__} (optimizer {i} of the list)" for i, o in enumerate(optimizers)}

    def first_before(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if id(opt) in stepped:
            missing = ", ".join(names[id(o)] for o in optimizers if id(o) not in stepped)
            raise RuntimeError(f"gift_compile: {names[id(opt)]} stepped again before {missing}: with optimizer=[...] "
                               "every optimizer of the list steps once per training step (GIFT advances once they "
                               "all have)")
        if not stepped:
            before(opt, args, kwargs)

    def last_after(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        stepped.add(id(opt))
        if len(stepped) == len(optimizers):
            stepped.clear()
            after(opt, args, kwargs)

    return first_before, last_after


def step(model: nn.Module) -> None:
    """Advance GIFT's state by one optimizer step (call after `optimizer.step()` when `apply`
    got no optimizer). The fault checks have already run at the end of the backward."""
    st = state(model)
    if st.stepped_by_optimizer:
        raise RuntimeError("gift_compile.step: apply got optimizer=, whose step already advances GIFT's state; a "
                           "second advance per step would run refreshes and seeds twice as often. Drop this call")
    st.check_pending()
    st.step()


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside accumulate gradients locally without communicating; the next
    backward outside sends the accumulated gradient once (like DDP's `no_sync`).

    Each installed adapter's own switch (`gift_compile.frameworks.table`): DDP's
    `model.no_sync()`, FSDP2's `set_requires_gradient_sync(False)`; for GIFT's own sync,
    managed weights accumulate into a GIFT buffer (their `.grad` stays unset until the
    synchronising backward) and the other parameters into `.grad`. Each distinct mode is one
    compiled graph variant.
    """
    st = state(model)
    with ExitStack() as stack:
        for adapter in table.installed(st):
            stack.enter_context(adapter.no_sync(model, st))
        yield


def remove(model: nn.Module) -> nn.Module:
    """Undo `apply`: original module classes, no hooks, no GIFT state, and each installed
    adapter's `remove` (FSDP2 gets its default reduce-scatter back; a DDP comm hook cannot be
    unregistered, so it switches to DDP's plain fp32 all-reduce, logged)."""
    st: GiftState | None = getattr(model, "_gift_state", None)
    if st is None:
        return model
    unmanage(model, st)
    for mod in model.modules():
        mod.__dict__.pop("_gift_state", None)
    for adapter in table.installed(st):
        adapter.remove(model, st)
    release_inductor_pass(model)
    return model


def state(model: nn.Module) -> GiftState:
    """The `GiftState` of a model `apply` was called on (looks through `torch.compile`)."""
    s = getattr(model, "_gift_state", None)
    if s is None:
        s = getattr(getattr(model, "_orig_mod", None), "_gift_state", None)
    if s is None:
        raise ValueError("gift_compile.state: gift_compile.apply was not called on this model")
    return s
