"""HSDP (replicas x shards) on FSDP2: GIFT on both hops, each at its own format.

Hybrid sharding reduces a gradient in two hops: a reduce-scatter over the shard group (inside
a node, fast, mostly overlapped with backward) and an all-reduce of the reduced shard over
the replica group (across nodes, 10-20x slower, exposed). FSDP2 in torch 2.13 lets a user
replace the reduce-scatter (`set_custom_reduce_scatter`) but not the replica all-reduce: under
a native 2-D HSDP mesh it is a hard-coded `dist.all_reduce`, and `set_all_reduce_hook` runs
*after* it. The supported route is therefore "custom HSDP":

* `fully_shard` on the shard-only (1-D) mesh, so FSDP2 itself never all-reduces across
  replicas and every parameter's DTensor lives on the shard mesh;
* the shard hop through `gift_compile.frameworks.fsdp2.GiftReduceScatter` at `GiftConfig.format`;
* an all-reduce hook on every FSDP module (`ReplicaAllReduce`), which FSDP2 calls with the
  module's reduced flat shard right after the reduce-scatter (before its post-divide and the
  copy into `.grad`), and which all-reduces that shard over the replica group through GIFT's
  bucketed core (`gift_compile.exchange.collectives.run_bucket`, op "all_reduce") at
  `GiftConfig.replica_hop_format`. The shard of a managed weight holds whole rows, so the
  input-side transform (which acts on columns) is valid on it unchanged.

One shard (a shard group of one rank, replication only): FSDP2 then never calls the custom
reduce-scatter (its one-rank "reduce-scatter" is a local copy), so there is no shard hop and
nothing crosses a one-rank group. The replica hop is then the only collective and carries the
whole reduction of each full local gradient, as GIFT's DDP hook does: the layers' own plans at
`GiftConfig.format`, with their error feedback and the gradient probe the refresh measures
(without it every layer's measurement would read a never-written, zero probe). A separate
`replica_format` is refused there (the selection measures at `format`), and so is an explicit
gradient divide factor other than 1 (under the SUM reductions `fsdp2.install` forces, FSDP2
applies it twice at one shard: in its copy and after the hook); FSDP2's default mean becomes
GIFT's averaging all-reduce over the replicas.

Every rank of a replica group decodes the same all-gathered bytes, so replicas stay
bit-identical. Each hop counts the bytes it hands to its collective in its own counters
(`GiftState.counters` for the shard hop, `ReplicaHop.counters` here), so telemetry reports
bytes per hop as they were sent; `accounted_bytes` is the shape-based figure to compare.

What else sees the shard-only mesh (and why it stays correct): gradient-norm clipping reduces
the norm over the shard mesh, which is the global norm because the gradients are identical on
every replica after the hook; the optimizer steps identical shards with identical gradients;
checkpoints (DCP) see each shard once per replica and deduplicate equal entries. The GIFT state
itself must be built on the whole data-parallel group (shards x replicas): statistics, transforms
and selection are then the same on every rank, which the replica hop's decode requires. That
group may span nodes in two levels (torchrun's `LOCAL_WORLD_SIZE`) where neither hop's group
does (a shard group inside one node, a replica group with one rank per node): each hop's items
and residuals follow its own group's layout (`fsdp2.install` puts the layers' residuals on the
shard group's, `GiftState.exchange_over`; this hop runs one level).
A module sharded on a per-parameter mesh (torchtitan's MoE blocks under expert parallelism:
routed experts on ``efsdp``, the rest on ``fsdp``) has one parameter group per mesh, each with its
own all-reduce hook (`fsdp_internals.set_group_all_reduce_hook`; FSDP2's public setter refuses
such modules), each the hook above over its group's reduced shard: the experts' group, which
`fsdp2.install` put on `EuclideanReduceScatter`, has its reduced shard all-reduced by GIFT's
codec at the replica format too (also where ``efsdp`` has one rank and this is its only hop: it
then carries the experts' error feedback, `EuclideanReduceScatter.keep_error_feedback`).
The graph path (`install_graph`: torchtitan's graph_trainer, whose traced replica all-reduces the
FX pass rewrites) carries the same hop on the managed linears' marks and on the routed experts'
(`gift_compile.frameworks.simple_fsdp.set_replica_hop`), at the replica format, with no map for
the experts, also where their efsdp has one rank and this hop is their only collective.

Limits: with two or more shards error feedback covers the shard hop only (its residual is the
full local gradient; the replica hop's input is already reduced).

`GiftConfig.shard_hop="native"` moves the layers to the hop that crosses nodes: the shard hop is
FSDP2's own reduce-scatter at the gradient's dtype (`GiftReduceScatter` passes it through and
counts its bytes), and the replica hop all-reduces each rank's reduced row shard with the layers'
own plans at `format`, as the one-shard case does with whole gradients: their maps (which act on
columns), error feedback and probes sized for the shard's rows (`LayerState.carry_row_shard`).
One rounding instead of two, and the codec runs on 1/shards of each gradient; the bytes on the
fast in-node links are fp32's. Refused by `install_graph` and for per-parameter meshes.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
import torch.distributed as dist

from gift_compile.codec import FormatSpec
from gift_compile.config import NATIVE_NODE_FORMAT
from gift_compile.exchange.collectives import (C_WIRE, C_BASELINE, C_CALLS, N_COUNTERS, ItemTensors, Shared,
                                      bucket_plan, bucket_wire_bytes, check_plan_agreement, per_call_check,
                                      run_bucket)
from gift_compile.exchange.plan import BucketPlan, Collective, ItemPlan, replica_hop_plan
from gift_compile.frameworks.adapter import attach, attached
from gift_compile.frameworks.fsdp2 import GiftReduceScatter, discarding
from gift_compile.frameworks.fsdp_internals import (all_reduce_hook, check_torch, custom_reduce_scatter, fsdp_modules,
                                         gradient_divide_factor, is_native_hsdp, param_group_id,
                                         set_group_all_reduce_hook, set_group_divide_factor, shard_process_group,
                                         shard_process_groups)
from gift_compile.frameworks.parts import Parts, model_parts
from gift_compile.frameworks import simple_fsdp
from gift_compile.runtime.state import GiftState
from gift_compile.runtime.telemetry import CommTimer
from gift_compile.sync import GroupByName

__all__ = ["NAME", "ReplicaAllReduce", "ReplicaHop", "accounted_bytes", "check_replicas_identical", "hop_totals",
           "install", "install_graph", "replica_hop"]

NAME = "hsdp"  # the replica hop's key in `GiftState.adapters`


class ReplicaHop:
    """The replica group and what the replica hop counted (bytes handed over, calls)."""

    # held by name, so a destroyed group's threads end with it (`gift_compile.sync.GroupByName`)
    group = GroupByName()

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = torch.full((), dist.get_rank(group), dtype=torch.int64, device=device)
        self.counters = torch.zeros(N_COUNTERS, dtype=torch.int64, device=device)
        self.timer = CommTimer()
        # Error probe: with `measure_every = N > 0`, the backward of every N-th optimizer step
        # (and the first) also all-reduces the managed shards at fp32 and accumulates the squared
        # error of GIFT's result against it and the squared reference (`take_error`).
        self.measure_every = 0
        self.err_sq = torch.zeros((), dtype=torch.float64, device=device)
        self.ref_sq = torch.zeros((), dtype=torch.float64, device=device)

    def measuring(self, steps: int) -> bool:
        """Whether the backward of the optimizer step after `steps` completed ones is probed."""
        n = self.measure_every
        return n > 0 and (steps == 0 or (steps + 1) % n == 0)

    def take_error(self) -> float | None:
        """Relative L2 error of the replica hop over the managed shards probed since the last
        call (None when nothing was probed)."""
        ref = float(self.ref_sq)
        out = None if ref == 0.0 else (float(self.err_sq) / ref) ** 0.5
        self.err_sq.zero_()
        self.ref_sq.zero_()
        return out


class ReplicaAllReduce:
    """FSDP2 all-reduce hook of one FSDP parameter group: GIFT all-reduce of its reduced shard
    over the replica group (see the module docstring). `comm` is the group's `GiftReduceScatter`, whose
    parameter segments (FSDP2's order, rows per shard) the flat shard is cut into. `sole`: the shard group has one rank, so this hop is the only one and runs the
    layers' own plans and tensors (error feedback, probe), averaging over the replicas when
    `average`."""

    def __init__(self, comm: GiftReduceScatter, hop: ReplicaHop, compiled: bool, *, sole: bool = False,
                 native: bool = False, average: bool = False) -> None:
        self.comm = comm
        self.hop = hop
        self.compiled = compiled
        self.sole = sole
        # `shard_hop="native"`: the shard hop was FSDP2's own reduce-scatter, so this hop carries
        # the layers' own plans on this rank's rows (`LayerState.carry_row_shard`)
        self.native = native
        self.average = average
        self.last_plan: BucketPlan | None = None

    @property
    def state(self) -> GiftState:
        return self.comm.state

    def plan(self, dtype: torch.dtype) -> BucketPlan:
        """One item per parameter: managed weights' row shards at the replica format (no error
        feedback: the residual belongs to the shard hop), the others at full precision. An
        fp32 replica format sends managed shards as raw fp32 too (exact, no transform). As the
        `sole` hop: the layers' own plans (`GiftConfig.format`, their error feedback), as
        GIFT's DDP all-reduce runs them; a group without layers (`fsdp2.EuclideanReduceScatter`)
        keeps the replica format then too, with its items' error feedback, averaging when
        `average`."""
        segments = self.comm._segments()
        fmt = self.state.config.replica_hop_format
        if self.native:
            rows = [seg if seg.plan is None or seg.plan.rows == seg.rows
                    else seg._replace(plan=dataclasses.replace(seg.plan, rows=seg.rows)) for seg in segments]
            return bucket_plan(rows, dtype, world=self.hop.world, group_name=self.hop.group_name,
                               average=self.average, op=Collective.ALL_REDUCE)
        if self.sole and (self.comm.has_layers or not FormatSpec(fmt).family.lossless):
            if not self.comm.has_layers:  # no layers: the replica format, their error feedback
                segments = [seg if seg.plan is None or seg.plan.spec.passthrough
                            else seg._replace(plan=dataclasses.replace(seg.plan, format=fmt))
                            for seg in segments]
            return bucket_plan(segments, dtype, world=self.hop.world, group_name=self.hop.group_name,
                               average=self.average, op=Collective.ALL_REDUCE)
        shards = [ItemPlan.passthrough(seg.name, seg.rows * seg.cols, dtype) if seg.plan is None
                  else dataclasses.replace(seg.plan.with_dtype(dtype), rows=seg.rows,
                                           groups=seg.plan.groups // self._shards() if seg.plan.block_maps else 1)
                  for seg in segments]
        return replica_hop_plan(shards, fmt, self.hop.world, self.hop.group_name, self.average)

    def _shards(self) -> int:
        """Ranks of the shard hop before this one: a grouped item's reduced shard holds
        `groups / shards` of its blocks (`ItemPlan.groups`: the routed experts' own maps)."""
        return self.comm.over.size() if self.comm.over is not None else 1

    def __call__(self, reduce_output: torch.Tensor) -> None:
        if discarding():  # gradients the framework drops (`gift_compile.frameworks.fsdp2.discarded_gradients`)
            dist.all_reduce(reduce_output, group=self.hop.group)
            if self.average:
                reduce_output.div_(self.hop.world)
            return
        segments = self.comm._segments()
        expected = sum(seg.rows * seg.cols for seg in segments)
        if reduce_output.numel() != expected:
            raise RuntimeError(
                f"GIFT HSDP: the reduced shard has {reduce_output.numel()} elements, the module's parameters "
                f"that require gradients make {expected}; cannot map it to parameters"
            )
        plan = self.plan(reduce_output.dtype)
        self.last_plan = plan
        xs: list[torch.Tensor] = []
        tensors: list[ItemTensors | None] = []
        offset = 0
        for seg, item in zip(segments, plan.items):
            piece = reduce_output[offset:offset + seg.rows * seg.cols]
            offset += seg.rows * seg.cols
            xs.append(piece.view(seg.rows, seg.cols) if item.managed else piece)
            # the layer's transform and seed; no residual and no probe (both belong to the shard
            # hop), unless this hop is the only one
            # (a grouped item's shard: the maps of its blocks, `ItemTensors.shard_transform`; one
            # block: that block's own map, unstacked, as an item of its own)
            own = seg.tensors.shard_transform if item.managed and seg.plan.block_maps else None
            if own is not None and item.groups == 1:
                own = tuple(t[0] if t.dim() > 0 else t for t in own)
            tensors.append(None if not item.managed else seg.tensors if self.sole or self.native
                           else ItemTensors(own if own is not None else seg.tensors.transform, None, None,
                                            seg.tensors.seed_offset))
        if per_call_check(self.state.config) is not None:  # debug mode: the ranks agreed at apply and refresh
            check_plan_agreement(plan, self.hop.group, always=True)
        managed = [i for i, seg in enumerate(segments) if seg.plan is not None]
        exact = None
        if managed and self.hop.measuring(self.state.steps):
            exact = torch.cat([xs[i].reshape(-1).float() for i in managed])
            dist.all_reduce(exact, group=self.hop.group)
            if self.average:
                exact.div_(self.hop.world)
        shared = Shared(self.state.seed, self.hop.rank, self.hop.counters)
        with self.hop.timer.timing(reduce_output.device):
            outs, _ = run_bucket(xs, tensors, shared, plan, compiled=self.compiled)
        if exact is not None:
            got = torch.cat([outs[i].reshape(-1) for i in managed])
            self.hop.err_sq += (got - exact).double().square().sum()
            self.hop.ref_sq += exact.double().square().sum()
        # the replica hop's health flags are in its counters (`finish` reads the headers), which
        # the step driver checks with the state's on every rank (`GiftState.check_health`)
        reduce_output.copy_(torch.cat([o.reshape(-1) for o in outs]))


def install(model: Parts, state: GiftState, replica_group: dist.ProcessGroup, *, compiled: bool = True) -> ReplicaHop:
    """Set the replica hop on every FSDP parameter group of `model` (after
    `gift_compile.frameworks.fsdp2.install`).

    `model` must be `fully_shard`ed on the shard-only mesh (a native HSDP mesh would all-reduce
    before the hook: the gradient would cross the replica group twice). A group left at FSDP2's
    default gradient division divides by shards x replicas, what native HSDP divides by; an
    explicit factor (torchtitan's 1.0) is kept. With one shard the hop is the only collective
    (see the module docstring: `format` only, factor 1 or FSDP2's default, which GIFT's
    all-reduce then averages). A parameter group on another mesh (`fsdp2.EuclideanReduceScatter`:
    the routed experts) gets the same hook, at the replica format even where its own mesh has one
    rank (it has no layers whose selection would ask for `format`; as the only hop it carries
    their error feedback). Keeps the hop in the state's per-adapter slot (`replica_hop`).
    """
    device = state.counters.device
    hop = ReplicaHop(replica_group, device)
    native = state.config.shard_hop == NATIVE_NODE_FORMAT
    n = 0
    check_torch()
    for module in fsdp_modules(model):
        groups = shard_process_groups(module)
        several = len(groups) > 1
        if native and several:
            raise ValueError(
                "gift_compile.frameworks.hsdp.install: shard_hop='native' puts the layers' plans on the replica hop of "
                "each FSDP module's one parameter group; this model has modules sharded on several meshes (per-parameter "
                "meshes: expert parallelism's routed experts). Use shard_hop='gift'")
        comms = [custom_reduce_scatter(module, pg if several else None) for pg in groups]
        if not all(isinstance(c, GiftReduceScatter) for c in comms):
            raise ValueError("gift_compile.frameworks.hsdp.install: call gift_compile.frameworks.fsdp2.install first "
                             "(the replica hop reads the parameter layout of GIFT's reduce-scatter)")
        for pg, comm in zip(groups, comms):
            over = pg if several else None
            if is_native_hsdp(module, over):
                raise ValueError(
                    "gift_compile.frameworks.hsdp.install: the model is fully_shard-ed on a 2-D (native HSDP) mesh, "
                    "whose replica all-reduce FSDP2 runs itself at full precision before any hook; shard it on the "
                    "shard-only mesh and let GIFT's replica hop all-reduce across replicas")
            shards, factor = pg.size(), gradient_divide_factor(module, over)
            if shards == 1:  # no shard hop: this hop is the only collective
                _check_sole_factor(factor)
                if comm.has_layers:
                    _check_sole_hop(state, hop)
                else:  # the experts' group: this hop carries their error feedback too
                    comm.keep_error_feedback()
            elif factor is None:  # FSDP2's default mean would only count the shard group
                set_group_divide_factor(module, pg, float(shards * hop.world))
            average = shards == 1 and factor is None
            carried = native and shards > 1  # the layers' plans ride this hop, on this rank's rows
            if carried:
                for layer, rows in comm.layer_rows():
                    layer.carry_row_shard(rows, hop.world)
            set_group_all_reduce_hook(module, pg, ReplicaAllReduce(comm, hop, compiled, sole=shards == 1, native=carried,
                                                                   average=average))
            n += 1
    if n == 0:
        raise ValueError("gift_compile.frameworks.hsdp.install: the model has no FSDP module")
    _attach(state, hop)
    check_replicas_identical(model, replica_group)
    return hop


def _check_sole_factor(factor: float | None) -> None:
    """Raise unless FSDP2 applies a one-shard group's divide factor once (see the module docstring)."""
    if factor is not None and factor != 1.0:
        raise ValueError(
            f"gift_compile.frameworks.hsdp.install: the shard group has one rank and the gradient divide factor is "
            f"{factor}; FSDP2 (under the SUM reductions GIFT forces) divides a one-rank reduce-scatter's copy by an explicit "
            "factor and again after the all-reduce hook (by factor squared). Leave the factor at FSDP2's default (GIFT's all-reduce then averages over "
            "the replicas) or set 1.0 (sum)")


def _check_sole_hop(state: GiftState, hop: ReplicaHop) -> None:
    """Raise unless a one-shard model can run the replica hop as its only collective (see the
    module docstring): one format, a state over the replicas."""
    config = state.config
    if config.replica_hop_format != config.format:
        raise ValueError(
            f"gift_compile.frameworks.hsdp.install: the shard group has one rank, so there is no shard hop and the "
            f"replica all-reduce carries every gradient at format={config.format!r} (what the selection measures and error "
            f"feedback covers); replica_format={config.replica_format!r} would send it at another format. Set "
            f"replica_format='same' (or format={config.replica_hop_format!r})")
    if state.world() != hop.world:
        raise ValueError(
            f"gift_compile.frameworks.hsdp.install: the GIFT state spans {state.world()} ranks but the replica group "
            f"{hop.world}; with one shard they must be the same group (shards x replicas)")


def install_graph(state: GiftState, replica_group: dist.ProcessGroup) -> ReplicaHop:
    """HSDP's replica hop for a traced framework (torchtitan's graph_trainer / SimpleFSDP),
    whose graph the FX pass rewrites: every managed weight's plan gets
    `replica_format = config.replica_hop_format` and its `gift::mark` then carries this hop's
    rank and counters, so the pass can put GIFT's all-reduce of the reduced shard over
    `replica_group` into the graph (`gift_compile.passes.gift_pass`, "HSDP"). The marks the
    SimpleFSDP adapter put on parameters outside GIFT's layers (torchtitan's routed experts,
    replicated over the same ranks) get the hop too, at the same format with no map
    (`simple_fsdp.set_replica_hop`), also where their shard dim has one rank and this hop is
    their only collective (as FSDP2's experts' group, they have no layers whose selection or
    error feedback would ask for `format`). Call it after `manage(..., mode="tag")` (the
    SimpleFSDP adapter's install) and before the step is traced. Keeps the hop in the state's
    per-adapter slot (`replica_hop`).

    The hop has no error probe in a graph (the probe's extra fp32 all-reduce is a per-step
    host decision a traced step cannot take); `ReplicaHop.take_error` returns None there.
    """
    if state.config.shard_hop == NATIVE_NODE_FORMAT:
        raise ValueError("gift_compile.frameworks.hsdp.install_graph: shard_hop='native' (the shard hop left to the "
                         "framework, the layers coded on the replica hop) runs on FSDP2's eager hooks only "
                         "(gift_compile.frameworks.hsdp.install); a traced HSDP step takes shard_hop='gift'")
    hop = ReplicaHop(replica_group, state.counters.device)
    _attach(state, hop)
    replica = Shared(state.seed, hop.rank, hop.counters)
    for layer in state.layers.values():
        layer.set_replica_hop(state.config.replica_hop_format, replica)
    simple_fsdp.set_replica_hop(state, state.config.replica_hop_format, replica, replica_group)
    return hop


def _attach(state: GiftState, hop: ReplicaHop) -> None:
    """Keep `hop` on `state` (the per-adapter slot, `NAME`); its counters enter the health check.
    Refuses per-layer formats: the replica hop sends every layer at the one `replica_format`
    (its plans, error probes and byte accounting have one format), so a layer given more bits
    on the shard hop would lose them on the replica hop."""
    if state.config.layer_formats:
        raise ValueError(f"gift_compile.frameworks.hsdp: layer_formats={state.config.layer_formats!r} with an HSDP "
                         f"replica hop: the hop sends every layer at replica_format={state.config.replica_hop_format!r}; "
                         "drop layer_formats, or train without the replica hop (FSDP over every rank)")
    attach(state, NAME, hop)
    state.hop_counters.append(hop.counters)


def replica_hop(state: GiftState) -> ReplicaHop | None:
    """The replica hop `install` / `install_graph` put on `state`, or None without one."""
    return attached(state, NAME) if NAME in state.adapters else None


def _hooks(model: Parts) -> list[ReplicaAllReduce]:
    """The replica hooks of `model`, one per FSDP parameter group (modules sharded together,
    `fully_shard([norm, output])`, share one group and appear once)."""
    out: dict[int, ReplicaAllReduce] = {}
    for module in fsdp_modules(model):
        groups = shard_process_groups(module)
        for pg in groups:
            over = pg if len(groups) > 1 else None
            hook = all_reduce_hook(module, over)
            if isinstance(hook, ReplicaAllReduce):
                out[param_group_id(module, over)] = hook
    return list(out.values())


def accounted_bytes(model: Parts) -> dict[str, int]:
    """Shape-based bytes one rank hands over per synchronising backward, per hop, from the plans
    the hooks ran last (`bucket_wire_bytes`): what `hop_totals` should grow by per backward."""
    shard = replica = 0
    for hook in _hooks(model):
        if hook.last_plan is None:
            raise RuntimeError("gift_compile.frameworks.hsdp.accounted_bytes: run a backward first (no plan ran yet)")
        dtype = hook.last_plan.items[0].torch_dtype
        comm = hook.comm
        pg = comm.over or shard_process_group(comm.module)
        # one shard: FSDP2 copies, nothing is handed to a collective; outside GIFT: FSDP2's own
        if pg.size() > 1 and isinstance(comm, GiftReduceScatter):
            shard += (comm.raw_bytes(pg.size(), dtype) if comm.native
                      else bucket_wire_bytes(comm.plan(pg.size(), dtype, pg.group_name)))
        replica += bucket_wire_bytes(hook.last_plan)
    return {"shard": shard, "replica": replica}


def hop_totals(state: GiftState) -> dict[str, dict[str, int]]:
    """Bytes counted when they were handed to each hop's collectives (cumulative): `wire`,
    `baseline` (what the replaced fp32 collective would have been handed) and `calls`."""
    out = {"shard": state.counters.tolist()}
    hop = replica_hop(state)
    if hop is not None:
        out["replica"] = hop.counters.tolist()
    return {k: {"wire": c[C_WIRE], "baseline": c[C_BASELINE], "calls": c[C_CALLS]} for k, c in out.items()}


def check_replicas_identical(model: Parts, replica_group: dist.ProcessGroup) -> None:
    """Raise on every rank unless every replica holds bit-identical parameter shards (a hop
    that sums identical-by-construction replicas is only correct if they start identical)."""
    digests = []
    for name, p in (named for part in model_parts(model) for named in part.named_parameters()):
        local = p.to_local() if hasattr(p, "to_local") else p
        raw = local.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()
        digests.append((name, hashlib.blake2b(raw, digest_size=16).hexdigest()))
    mine = tuple(digests)
    everyone: list[tuple[tuple[str, str], ...] | None] = [None] * dist.get_world_size(replica_group)
    dist.all_gather_object(everyone, mine, group=replica_group)
    bad = [r for r, t in enumerate(everyone) if t != mine]
    if bad:
        raise RuntimeError(f"GIFT HSDP: replica rank(s) {bad} hold parameters that differ from replica rank "
                           f"{dist.get_rank(replica_group)}; replicas must start bit-identical")
