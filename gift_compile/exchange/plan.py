"""Static plans of GIFT collectives: everything a traced graph must know about them.

A plan fixes the shape of the code (formats, transform kind, which tensors exist), never the
data (transforms, residuals, seeds, the rank: those are tensors). `ItemPlan` describes one
gradient, `BucketPlan` one collective over a list of gradients (a framework's bucket, an FSDP2
module's flat buffer, a DDP bucket, or a single weight).

An `ItemPlan` is carried *inside* the graph, as the string argument of the `gift::mark` op
that tags a managed weight's gradient, so the FX pass needs no process-global registry: the
graph describes itself, and the same graph (and the same compiled artifact) serves every rank
and every process, whatever layers were created before.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gift_compile.codec import FormatSpec
from gift_compile.config import NATIVE_NODE_FORMAT, Unrewritten
from gift_compile.kernels.map_dispatch import MapPrecision
from gift_compile.exchange.topology import FLAT, NodeLayout
from gift_compile.geometry.table import IDENTITY_KIND, map_class

__all__ = ["BucketPlan", "ItemPlan", "dtype_name", "replica_hop_plan"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """Name of a gradient dtype GIFT can carry (raises for anything else)."""
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise TypeError(f"GIFT: unsupported gradient dtype {dtype}; expected float32, bfloat16 or float16")


@dataclass(frozen=True, kw_only=True)
class ItemPlan:
    """One gradient of a collective.

    `managed` items are transformed and quantized; the others (norm weights, embeddings, small
    or excluded weights that share a bucket with managed ones) travel as raw bytes of their
    dtype and are summed in fp32. `rows x cols` is the gradient's 2-D view for managed items
    (rows are what collectives split); passthrough items are handled flat (`rows * cols`
    elements).
    """

    name: str
    rows: int
    cols: int
    dtype: str = "float32"
    managed: bool = True
    format: str = "fp32"
    scaling: str = "row"
    block_size: int = 32
    kind: str = IDENTITY_KIND  # the map (`gift_compile.geometry.table.map_class`)
    n_tensors: int = 0
    error_feedback: bool = False
    stochastic_rounding: bool = False
    # `gift_compile.codec.rotation`: codes are chosen on each scale block rotated after the map
    block_rotation: bool = False
    unrewritten: Unrewritten = Unrewritten.ERROR
    residual_format: str = "fp32"
    # HSDP in a traced graph: the wire format of the replica hop (the all-reduce of the reduced
    # shard over the replica group), "" without one. When set, the `gift::mark` carries the
    # replica hop's rank and counters after the shared tensors (`unpack_replica_shared`).
    replica_format: str = ""
    # the all-reduce's second hop: the owner's residual of re-encoding its reduced shard
    second_hop_error_feedback: bool = False
    error_feedback_decay: float = 1.0  # beta of both residuals: send g + beta e
    # The selection as data (issue 31): the item's tensors end with the layer's 0-d bool path
    # gate (counted in `n_tensors`), and the map runs as the identity where it is off. Traced
    # graphs carry this plan whatever the selection, so a selection change is no recompile.
    gated: bool = False
    # `GiftConfig.map_precision`: the arithmetic of a low-rank map's matmuls, resolved against
    # the device where the map runs (`gift_compile.kernels.map_dispatch.map_path`); static, so
    # traced code picks its kernels at trace time
    map_precision: MapPrecision = MapPrecision.AUTO
    # A grouped GEMM's weight (MoE experts, `[E*out, in]`): the rows are `groups` equal
    # consecutive blocks, block e mapped with its own map. The item's transform tensors are then
    # each stacked on a leading dim of `groups` (`item_codec.ItemTensors`). 1: one map.
    groups: int = 1
    # `GiftConfig.ranks_per_node`, carried so that a traced graph's rewrite (which sees plans,
    # not the config) puts the bucket on the same node layout as the eager hooks
    # (`gift_compile.exchange.topology.node_layout`); None: the launcher's LOCAL_WORLD_SIZE
    ranks_per_node: int | None = None
    # `GiftConfig.intra_node_format`, carried for the same reason: the precision of the
    # two-level exchange's collectives inside the node
    intra_node_format: str = NATIVE_NODE_FORMAT
    # GIFT's own sync sends this gradient (a plain module's `_GiftSync`, traced): no framework
    # decides the graph's collectives, so the FX pass makes every rank agree on the graph's
    # plans before its first exchange (`agreement.agree_plans`), as the eager calls do
    own_sync: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.groups, int) or isinstance(self.groups, bool) or self.groups < 1:
            raise ValueError(f"GIFT: item {self.name}: groups must be an int >= 1, got {self.groups!r}")
        if self.rows % self.groups:
            raise ValueError(f"GIFT: item {self.name}: its {self.rows} rows do not split into groups={self.groups} "
                             "equal blocks")
        # Derived values are computed once here (not fields: they stay out of eq/hash/to_str),
        # so traced code only reads constants.
        object.__setattr__(self, "unrewritten", Unrewritten.parse(self.unrewritten, "ItemPlan.unrewritten"))
        object.__setattr__(self, "map_precision", MapPrecision.parse(self.map_precision, "ItemPlan.map_precision"))
        object.__setattr__(self, "_seed_offset", (zlib.crc32(self.name.encode()) % 1_000_003) * 7919)

    @classmethod
    def passthrough(cls, name: str, numel: int, dtype: torch.dtype) -> "ItemPlan":
        """A full-precision item of `numel` elements."""
        return cls(name=name, rows=1, cols=int(numel), dtype=dtype_name(dtype), managed=False)

    @property
    def spec(self) -> FormatSpec:
        return FormatSpec(self.format, self.scaling, self.block_size)

    @property
    def block_maps(self) -> bool:
        """Whether each of the item's `groups` row blocks runs a map of its own (a grouped item
        with a map; a map-free grouped item is sent as any other)."""
        return self.groups > 1 and not map_class(self.kind).is_identity

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def seed_offset(self) -> int:
        """Stochastic-rounding seed offset of this layer: a stable hash of its name, so seeds do
        not depend on how many layers a process registered before."""
        return self._seed_offset

    def with_dtype(self, dtype: torch.dtype) -> "ItemPlan":
        return dataclasses.replace(self, dtype=dtype_name(dtype))

    def as_dict(self) -> dict:
        """The fields as plain data, `groups` left out at its default 1, `ranks_per_node` at
        None, `intra_node_format` at native and `own_sync` at False: plan strings and
        descriptions exchanged between ranks, stored in checkpoints and compared by golden tests
        read exactly as before grouped items existed (`from_str`/`__init__` default it back)."""
        d = dataclasses.asdict(self)
        if self.groups == 1:
            del d["groups"]
        if self.ranks_per_node is None:
            del d["ranks_per_node"]
        if self.intra_node_format == NATIVE_NODE_FORMAT:
            del d["intra_node_format"]
        if not self.own_sync:
            del d["own_sync"]
        return d

    def to_str(self) -> str:
        """Compact, stable text form (the `gift::mark` op's plan argument)."""
        return _item_text(self)

    @classmethod
    def from_str(cls, text: str) -> "ItemPlan":
        return cls(**json.loads(text))

    def describe(self) -> str:
        if not self.managed:
            return f"{self.name}: {self.numel} x {self.dtype} full precision"
        blocks = f" x{self.groups} blocks" if self.groups > 1 else ""
        return (f"{self.name}: [{self.rows}, {self.cols}]{blocks} {self.dtype} -> {self.format}/{self.scaling}"
                f"/b{self.block_size} {self.kind}{' gated' if self.gated else ''} ef={int(self.error_feedback)}{int(self.second_hop_error_feedback)}"
                f"{'' if self.error_feedback_decay == 1.0 else f' beta={self.error_feedback_decay}'}"
                f" sr={int(self.stochastic_rounding)}{' rot' if self.block_rotation else ''}")


class Collective(enum.StrEnum):
    """The collective a bucket runs. A `StrEnum`: a member equals, prints and serialises as its
    spelling, so plan descriptions, fingerprints and `as_dict` keep the strings they had."""

    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"

    @classmethod
    def parse(cls, value: object) -> Collective:
        """The member spelled `value` (a member passes through); ValueError naming `value` otherwise.
        A dict lookup, which Dynamo folds, rather than `Collective(value)`."""
        member = _COLLECTIVES.get(value) if isinstance(value, str) else None
        if member is None:
            raise ValueError(f"unknown collective op {value!r}; allowed: {', '.join(_COLLECTIVES)}")
        return member


_COLLECTIVES: dict[str, Collective] = {c.value: c for c in Collective}


@functools.lru_cache(maxsize=8192)
def _item_text(item: ItemPlan) -> str:
    """`ItemPlan.to_str`, memoised per plan (equal plans, equal text): every `BucketPlan` made
    fingerprints its items' texts, and eager hooks make one per bucket and call, where
    `dataclasses.asdict` (a deep copy) and `json.dumps` per item were a measurable share of the
    exchange's host time."""
    return json.dumps(item.as_dict(), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class BucketPlan:
    """One quantized collective over `items` on a group of `world` ranks.

    `op` is `Collective.REDUCE_SCATTER` (each rank receives the sum of its 1/world row block of
    every item) or `ALL_REDUCE` (every rank receives every full sum); its spelling is accepted
    and stored as the member. `average` divides by `world`.

    `layout` (`gift_compile.exchange.topology.node_layout`) puts the group's ranks on nodes: a
    two-level layout runs the node's native reduce-scatter first and GIFT's exchange on the
    node-reduced chunk over the cross-node group (`cross`, the stage-2 plan, built here once),
    whose headers carry each node's flags (`node_headers`, the node's rank count; 0 in a
    one-level plan). The one-level plan's fingerprint and description are what they were
    before layouts existed.
    """

    items: tuple[ItemPlan, ...]
    world: int
    group_name: str | None
    average: bool
    op: Collective = Collective.REDUCE_SCATTER
    layout: NodeLayout = FLAT
    node_headers: int = 0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "op", Collective.parse(self.op))
        except ValueError:
            raise ValueError(f"BucketPlan.op={self.op!r}; allowed: {', '.join(_COLLECTIVES)}") from None
        if not self.items:
            raise ValueError("BucketPlan: a bucket needs at least one item")
        for i in self.items:
            # each rank's shard then starts and ends on block boundaries, and no rows are padded
            if i.block_maps and i.groups % self.world:
                raise ValueError(f"GIFT: item {i.name}: groups={i.groups} is not divisible by the world size "
                                 f"{self.world}; a grouped item's shards must hold whole blocks")
        # Item names and order are in: two equally shaped layers taken in another order on
        # another rank must not pair (their seeds and transforms differ).
        text = repr((tuple(i.to_str() for i in self.items), self.world, self.average, self.op.value))
        if self.layout.two_level or self.node_headers:  # one level: the fingerprint it always had
            text += repr((self.layout.ranks_per_node, self.node_headers))
        if self.layout.node_format != NATIVE_NODE_FORMAT:  # native: the fingerprint before the setting existed
            text += repr(self.layout.node_format)
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        object.__setattr__(self, "_fingerprint", int.from_bytes(digest, "little", signed=True))
        object.__setattr__(self, "_cross", self._cross_plan() if self.layout.two_level else None)

    @property
    def two_level(self) -> bool:
        """Whether this bucket runs in two levels (its `layout` spans nodes)."""
        return self.layout.two_level

    @property
    def cross(self) -> BucketPlan:
        """Stage 2 of a two-level plan: GIFT's exchange of the node-reduced chunks over the
        cross-node group. Each item keeps its plan with the chunk's rows (`chunk_rows`); its
        shards are the very rows this rank's shard of the one-level plan holds."""
        if self._cross is None:
            raise ValueError("BucketPlan.cross: a one-level plan has no cross-node stage")
        return self._cross

    def chunk_rows(self, item: ItemPlan) -> int:
        """Rows of a managed item's node-reduced chunk in a two-level plan: the item's rows as
        sent (`rows_sent`) over the node's `g` ranks; a passthrough item's elements likewise
        (`flat_sent` / g)."""
        g = self.layout.ranks_per_node
        return (self.rows_sent(item) if item.managed else self.flat_sent(item)) // g

    def _cross_plan(self) -> BucketPlan:
        g, nodes = self.layout.ranks_per_node, self.layout.nodes
        if g * nodes != self.world:
            raise ValueError(f"BucketPlan: layout of {nodes} nodes x {g} ranks does not match the world size {self.world}")
        items = []
        for i in self.items:
            if not i.managed:
                items.append(ItemPlan.passthrough(i.name, self.chunk_rows(i), i.torch_dtype))
            elif i.block_maps:
                raise ValueError(f"GIFT: item {i.name} (groups={i.groups}, a map per block) cannot run the two-level "
                                 "exchange: a node's chunk holds other ranks' blocks, whose maps this rank does not "
                                 "slice; set GiftConfig.ranks_per_node=0 for the one-level exchange")
            else:  # the chunk's rows; a map-free grouped item's blocks need no bookkeeping there
                items.append(dataclasses.replace(i, rows=self.chunk_rows(i), groups=1))
        # averaging: stage 1 sums the node's shares (each / g), stage 2 averages over the nodes,
        # so no partial sum exceeds the mean's scale (a mean near fp32's largest stays finite)
        # and stage 2 (its residuals included) runs at the one-level exchange's scale
        return BucketPlan(tuple(items), nodes, self.layout.cross_group, self.average, self.op, NodeLayout(1, nodes), g)

    def rows_sent(self, item: ItemPlan) -> int:
        """Rows of a managed item as communicated: an all-reduce pads them to a multiple of
        the world size; a reduce-scatter needs them divisible."""
        if self.op is Collective.ALL_REDUCE:
            return -(-item.rows // self.world) * self.world
        return item.rows

    def flat_sent(self, item: ItemPlan) -> int:
        """Elements of a passthrough item as communicated (padded for an all-reduce)."""
        if self.op is Collective.ALL_REDUCE:
            return -(-item.numel // self.world) * self.world
        return item.numel

    def fingerprint(self) -> int:
        """A signed 64-bit hash of everything static that decides the bytes and their meaning,
        item names and order included (not the group name, which may be spelled differently on
        different ranks)."""
        return self._fingerprint

    def as_dict(self) -> dict:
        """Plain-data form (what ranks exchange to name the first difference of two plans)."""
        d = {"op": self.op.value, "world": self.world, "average": self.average,
             "items": [i.as_dict() for i in self.items]}
        if self.two_level:
            d["ranks_per_node"] = self.layout.ranks_per_node
        elif self.layout.spans_nodes:
            d["nodes"] = self.layout.nodes
        if self.layout.node_format != NATIVE_NODE_FORMAT:
            d["intra_node_format"] = self.layout.node_format
        if self.node_headers:
            d["node_headers"] = self.node_headers
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "BucketPlan":
        g = d.get("ranks_per_node", 1)
        layout = NodeLayout(1, d.get("nodes", 1)) if g == 1 else NodeLayout(g, d["world"] // g, node_format=d.get("intra_node_format",
                                                                                      NATIVE_NODE_FORMAT))
        return cls(tuple(ItemPlan(**i) for i in d["items"]), d["world"], None, d["average"], d["op"], layout,
                   d.get("node_headers", 0))

    def describe(self) -> str:
        head = f"{self.op} over {self.world} ranks ({'avg' if self.average else 'sum'})"
        if self.two_level:
            node = "" if self.layout.node_format == NATIVE_NODE_FORMAT else f", {self.layout.node_format} inside the node"
            head += f" in two levels ({self.layout.nodes} nodes x {self.layout.ranks_per_node}{node})"
        return head + ": " + "; ".join(i.describe() for i in self.items)


def replica_hop_plan(shards: Sequence[ItemPlan], fmt: str, world: int, group_name: str | None,
                     average: bool) -> BucketPlan:
    """HSDP's replica hop: the all-reduce over the replica group of the row shards the shard hop
    left on this rank, whose items (`shards`: managed ones with their layer's plan, rows those
    of the shard) it sends in one bucket. A managed shard goes at `fmt` without error feedback
    (the residual belongs to the shard hop), a 16-bit one (bf16: a tiny gradient,
    `GiftConfig.tiny_format`, or a layer at bf16) at its own format; a managed one at fp32
    goes at `fmt` like a coded one. A lossless `fmt` (fp32) sends it raw, like
    every other item.
    The one rule for both places that run the hop: FSDP2's all-reduce hook
    (`gift_compile.frameworks.hsdp`) and the FX pass's rewrite of a traced HSDP step."""
    items = tuple(ItemPlan.passthrough(i.name, i.numel, i.torch_dtype) if not i.managed or FormatSpec(fmt).family.lossless
                  else i if i.spec.passthrough and not i.spec.family.lossless  # 16-bit: keeps its format
                  else dataclasses.replace(i, format=fmt, error_feedback=False, second_hop_error_feedback=False,
                                           error_feedback_decay=1.0, residual_format="fp32")
                  for i in shards)
    return BucketPlan(items, world, group_name, average, Collective.ALL_REDUCE)
