"""A grouped-GEMM module's local experts as GIFT layers: each expert's weight its own matrix.

A MoE's routed experts (torchtitan's `GroupedExperts`: `w1_EFD`, `w3_EFD` `[E, F, D]`, `w2_EDF`
`[E, D, F]`) keep every local expert's weight in one 3-D tensor and feed expert e only the tokens
routed to it, and their gradients reduce over the experts' own data-parallel group (``efsdp``),
not GIFT's main state's. `ExpertLayers` makes each local expert of each grouped weight a
`LayerState` of a state over that group (its layers are the experts: statistics, refresh,
selection, error feedback and checkpoints are the per-layer ones, run by that state's refresh
engine) whose tensors are views of stacked ones: the map tensors `[E, ...]`, the path gates
`[E]`, the probes `[E, p, in]` and the residual rows, so the collective sends the grouped weight as
one grouped item (`ItemPlan.groups`) with the stacked tensors, with no copy, and every in-place
update of a layer (a refresh, a broadcast, a selection, a loaded checkpoint) is what the item
carries next. The experts' input statistics are per-expert windows of one grouped statistic per
distinct input (`geometry.grouped_statistics`): w1 and w3 read the same tokens (w3's layers follow
w1's, `GiftState.share_statistics`), w2 its hidden activations.
"""

from __future__ import annotations

import dataclasses

import torch

from gift_compile.codec import residual as residual_store
from gift_compile.exchange.collectives import ItemTensors
from gift_compile.exchange.item_codec import shard_tensors
from gift_compile.exchange.plan import ItemPlan
from gift_compile.exchange.topology import TopologyError
from gift_compile.geometry.grouped_statistics import GroupedKFACStatistics, GroupedSketchStatistics, \
    make_grouped_statistics
from gift_compile.runtime.layer import PROBE_ROWS, LayerState
from gift_compile.runtime.state import GiftState

__all__ = ["ExpertLayers", "GroupedWeight"]


@dataclasses.dataclass
class GroupedWeight:
    """One grouped weight `[E, out, in]` of a rank's local experts: its layers (one per expert,
    named ``<module>.<weight>[<local expert>]``) and the stacked tensors their own are views of."""

    name: str  # the parameter's FQN
    layers: list[LayerState]
    transform: tuple[torch.Tensor, ...]  # each map tensor stacked over the experts
    gate: torch.Tensor  # [E] bool: each expert's path gate (`LayerState.path_gate` views)
    probe: torch.Tensor  # [E, p, in]: each expert's gradient rows a refresh measures
    residual: tuple[torch.Tensor, ...] | None  # the error-feedback buffers of all [E * out, in] rows
    seed_offset: torch.Tensor  # the item's, from its plan

    @property
    def plan(self) -> ItemPlan:
        """The grouped item of the whole weight `[E * out, in]`: the layers' selection-independent
        plan (the map gated by data) with one block per expert; the identity's plain plan where the
        geometry has no map."""
        first = self.layers[0]
        out, _ = first.shape
        return dataclasses.replace(first.traced_plan, name=self.name, rows=len(self.layers) * out,
                                   groups=len(self.layers))

    def tensors(self, rank: int, world: int) -> ItemTensors:
        """The item's runtime tensors on group rank `rank` of `world`: the stacked maps and gates,
        the residual, the probes, and the maps of the experts this rank's shard holds."""
        plan = self.plan
        transform = (*self.transform, self.gate) if plan.gated else ()
        shard = shard_tensors(plan, transform, rank, world) if plan.block_maps else None
        return ItemTensors(transform, self.residual, self.probe, self.seed_offset, shard_transform=shard)


class ExpertLayers:
    """The local experts of one grouped-GEMM module as layers of `state` (a `GiftState` over the
    experts' data-parallel group), built before any graph is traced (see the module docstring).

    `shapes` maps each grouped weight's parameter name to its local shape `[E, out, in]` and
    `inputs` each to the name of the input it reads (weights reading the same input share its
    statistics), `params` each to its parameter (a refresh of a gradient-side geometry reads
    each expert's rows of its optimizer state or gradient: `GiftState.blocks`). A layer is named
    by its expert's local index on the rank: every rank of the state's group holds the same
    local experts, and GIFT's checkpoint state is the rank's own."""

    def __init__(self, state: GiftState, owner: str, shapes: dict[str, tuple[int, int, int]], inputs: dict[str, str],
                 params: dict[str, torch.nn.Parameter], device: torch.device | str) -> None:
        if state.layout.two_level and not state.geometry.is_identity:
            _refuse_two_levels(state, owner, shapes)
        self.state = state
        self.owner = owner
        self.weights: dict[str, GroupedWeight] = {}
        self.stats: dict[str, GroupedSketchStatistics | GroupedKFACStatistics] = {}
        leaders: dict[str, list[LayerState]] = {}
        for name, (experts, out, d_in) in shapes.items():
            fqn = f"{owner}.{name}" if owner else name
            layers = [state.add_layer(f"{fqn}[{e}]", (out, d_in), device) for e in range(experts)]
            for e, layer in enumerate(layers):
                state.blocks[layer.fqn] = (params[name], e, experts)
            self.weights[name] = self._stack(fqn, layers)
            key = inputs[name]
            if layers[0].stats is None:  # a geometry without input statistics: each weight its own factor
                continue
            if key in leaders:
                for leader, layer in zip(leaders[key], layers):
                    state.share_statistics([leader.fqn, layer.fqn])
                continue
            leaders[key] = layers
            grouped = make_grouped_statistics(state.layer_spec.statistics, experts, d_in, device)
            if type(grouped.expert(0)) is not type(layers[0].stats):
                raise ValueError(f"GIFT: {fqn}: the experts' grouped statistics ({type(grouped).__name__}) differ from "
                                 f"the statistics a layer of width {d_in} keeps ({type(layers[0].stats).__name__})")
            for e, layer in enumerate(layers):
                layer.stats = grouped.expert(e)
            self.stats[key] = grouped
        self._leaders = leaders

    @staticmethod
    def _stack(fqn: str, layers: list[LayerState]) -> GroupedWeight:
        """Stack the layers' map tensors, path gates, probes and residual rows, and make each
        layer's own tensors views of its expert's row of them."""
        transform = tuple(torch.stack(ts) for ts in zip(*(l.transform.tensors for l in layers)))
        gate = torch.stack([l.path_gate for l in layers])
        out, d_in = layers[0].shape
        probe = torch.zeros(len(layers), min(out, PROBE_ROWS), d_in, device=gate.device)
        residual = None
        if layers[0].residual is not None:
            fmt = layers[0].plan.residual_format
            if residual_store.buffer_count(fmt) > 2:
                raise ValueError(f"GIFT: {fqn}: residual_format={fmt!r} keeps one tensor scale per residual; the "
                                 "experts of a grouped weight share one residual of all their rows, so it needs a "
                                 "format with per-row scales only (fp32, bf16, fp8_e4m3, ...)")
            residual = tuple(torch.cat(bufs) for bufs in zip(*(l.residual for l in layers)))
        for e, layer in enumerate(layers):
            layer.transform.tensors = tuple(t[e] for t in transform)
            layer.path_gate = gate[e]
            layer.probe = probe[e]
            if residual is not None:
                layer.residual = tuple(b.narrow(0, e * out, out) for b in residual)
        seed_offset = torch.tensor(dataclasses.replace(layers[0].plan, name=fqn).seed_offset, dtype=torch.int64,
                                   device=gate.device)
        return GroupedWeight(fqn, layers, transform, gate, probe, residual, seed_offset)

    def stats_gate(self, key: str) -> torch.Tensor:
        """Whether any expert reading input `key` needs its statistics (bool, 0-d; a traced
        forward masks the grouped statistic with it, as a layer's `stats_gate`)."""
        return torch.stack([l.stats_gate for l in self._leaders[key]]).any()

    def observe(self, key: str, x: torch.Tensor, offsets: torch.Tensor) -> None:
        """Feed input `key` (`[R, in]`, rows sorted by expert, `offsets` the experts' cumulative
        token ends) to each expert's statistics, where any expert needs them."""
        if key in self.stats:
            self.stats[key].observe(x, offsets, self.stats_gate(key))


def _refuse_two_levels(state: GiftState, owner: str, shapes: dict[str, tuple[int, int, int]]) -> None:
    """Raise, naming the layout, for mapped experts on a group that spans nodes: their grouped
    item has a map per expert, and a two-level exchange's node chunk holds rows of other ranks'
    experts, whose maps this rank does not hold sliced (`BucketPlan.cross`). Refused when the
    layers are built (at `apply`), so no step starts and no exchange falls back to one level,
    which would put g times the bytes on the network unannounced."""
    layout = state.layout
    raise TopologyError(
        f"GIFT: the grouped experts of {owner or 'the model'} ({', '.join(shapes)}: a map per expert, geometry "
        f"{state.config.geometry!r}) cannot run the two-level exchange: their data-parallel group spans "
        f"{layout.nodes} nodes x {layout.ranks_per_node} ranks (GiftConfig.ranks_per_node="
        f"{state.config.ranks_per_node!r}), and a node's chunk would hold other ranks' experts, whose maps this rank "
        "does not slice. Keep the experts' data-parallel group inside one node, or set ranks_per_node=0 (every "
        "collective one level), or geometry='none' (map-free experts run in two levels)")
