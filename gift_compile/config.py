"""`GiftConfig`: every knob of GIFT in one validated, immutable dataclass.

Validation happens at construction so that a typo in a TOML file or a CLI flag fails
before any process group is created, with a message that names the field and lists the
allowed values, instead of surfacing as a shape error deep inside a compiled graph. Types
are checked strictly: ints reject bools and floats, floats accept ints but must be finite,
strings must be `str`; every failure is a `GiftConfigError` (a ValueError) naming the field.

The modes (`reduce_op`, `nonfinite`, `select_metric`, `unrewritten`, `plan_check`,
`statistics`, `map_precision`, the keywords of `select`) are given by their spelling and held
as members of their `Choice` (a `StrEnum`, defined here, or in the lower layer that reads it:
the codec for `Nonfinite`, the kernels for `MapPrecision`): the package
compares members, and a member equals, prints, reprs and serialises as its spelling, so TOML,
JSON, checkpoints and messages are unchanged. `scaling` stays its spelling: `FormatSpec`
turns it into the codec's `Scaling`.

Why one module: `GiftConfig` is the one validated dataclass every layer reads; most of its length
is each field's documentation next to its check, kept together so that a field, what it means and
how it is validated change in one place.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NoReturn

# The format names belong to the codec, the layer below this one (docs/architecture.md).
from gift_compile.codec.spec import BLOCK_SIZE_CHOICES, BLOCK_SIZE_FORMATS, FORMATS, SCALINGS, Choice, FormatSpec, Nonfinite
from gift_compile.kernels.map_dispatch import MapPrecision

# `replica_format` value meaning "the cross-replica hop uses `format` too".
SAME_FORMAT = "same"
# `GiftConfig.tiny_format`: a tiny gradient (`is_tiny`: norms, biases, small weights) goes at
# bf16 in its bucket's collective, or "fp32" (the opt-out: raw, at the gradient's own dtype).
# No low-bit choice: a scale block per few elements saves next to nothing on these bytes.
TINY_FORMATS = ("bf16", "fp32")
# the opt-out value of `unmapped_format` / `excluded_format` / `tiny_format`: raw bytes at the gradient's own dtype
FULL_PRECISION = "fp32"
# The whole opt-out of the whole-gradient defaults: every gradient outside GIFT's layers travels
# raw (`GiftConfig(**RAW_OUTSIDE_LAYERS, ...)`; with `format="fp32"` too, GIFT on reproduces GIFT
# off bit for bit). One mapping, so the CLI's flags and the Python keywords name the same fields.
RAW_OUTSIDE_LAYERS: Mapping[str, str] = MappingProxyType(
    {"unmapped_format": FULL_PRECISION, "excluded_format": FULL_PRECISION, "tiny_format": FULL_PRECISION})


def is_tiny(shape: tuple[int, ...] | list[int], min_numel: int) -> bool:
    """Whether a gradient of `shape` is tiny (`GiftConfig.tiny_format`): fewer than two dims (a
    norm's gain, a bias) or fewer than `min_numel` elements (`GiftConfig.min_numel`, the size
    under which a linear gets no map either)."""
    return len(shape) < 2 or math.prod(shape) < min_numel
# `GiftConfig.intra_node_format`: the precision of a two-level exchange's collectives inside a
# node. "native" sends the gradient's own dtype (and an all-reduce's decoded chunks as fp32);
# "bf16" sends both at bf16, half the node's bytes of an fp32 gradient. Only bf16 among the
# 16-bit types: it keeps fp32's exponent range, so a node sum that is finite in fp32 stays so.
NATIVE_NODE_FORMAT = "native"
INTRA_NODE_FORMATS = (NATIVE_NODE_FORMAT, "bf16")
# `GiftConfig.shard_hop`: where HSDP's layers go on GIFT's codec. "gift": on the shard hop (the
# reduce-scatter, at `format`) and again on the replica hop (at `replica_format`); "native": the
# shard hop is FSDP2's own reduce-scatter at the gradient's dtype and only the replica hop, the
# one that crosses nodes, carries the layers at `format` with their maps, error feedback and probes.
GIFT_SHARD_HOP = "gift"
SHARD_HOPS = (GIFT_SHARD_HOP, NATIVE_NODE_FORMAT)
# The names of the geometry table (`gift_compile.geometry.table.GEOMETRIES`), in its order.
# Spelled here because the config sits below the geometry layer and validates at construction
# (a typo fails before any process group exists); the table checks at import that its classes
# carry exactly these names.
GEOMETRIES = ("none", "hadamard", "dense", "lowrank", "gradient", "momentum", "second_moment")
# `geometry` value resolved by `apply(..., optimizer=)` to the optimizer's geometry
# (`gift_compile.geometry.optimizers.geometry_for`).
AUTO_GEOMETRY = "auto"
# What `geometry="auto"` (the default) becomes when `apply` is given no optimizer: K-FAC's
# input-side map, GIFT's own geometry (logged as a warning: under AdamW it is the wrong map).
FALLBACK_GEOMETRY = "lowrank"


class ReduceOp(Choice):
    """`GiftConfig.reduce_op`: the data-parallel mean or the sum of the ranks' gradients."""

    AVG = "avg"
    SUM = "sum"


class SelectMetric(Choice):
    """`GiftConfig.select_metric`: the error `select="auto"` compares the two paths by.
    `AUTO` is resolved by `apply(..., optimizer=)` from the optimizer
    (`gift_compile.geometry.optimizers.select_metric_for`), measured as `EUCLIDEAN` where no
    optimizer is known."""

    EUCLIDEAN = "euclidean"
    WHITENED = "whitened"
    AUTO = "auto"


class SelectRule(Choice):
    """The keywords of `GiftConfig.select` (the other values are `"boundary_hits:K"` and globs)."""

    AUTO = "auto"
    ALL = "all"
    NONE = "none"


class Unrewritten(Choice):
    """`GiftConfig.unrewritten`: a managed gradient the pass did not rewrite (or an FSDP2 parameter
    group outside GIFT's process group) raises, or warns once."""

    ERROR = "error"
    WARN = "warn"


class PlanCheck(Choice):
    """`GiftConfig.plan_check`: the full plan description is compared on the first call of each plan, or always."""

    FIRST = "first"
    ALWAYS = "always"


class StatisticsKind(Choice):
    """`GiftConfig.statistics`: the K-FAC input factor of a low-rank layer as a sketch or dense."""

    SKETCH = "sketch"
    DENSE = "dense"


_BOUNDARY_RE = re.compile(r"^boundary_hits:(\d+)$")
# `seed` lives in an int64 tensor (the stochastic-rounding seed of every rank), so it must fit.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class GiftConfigError(ValueError):
    """A `GiftConfig` field holds a bad value.

    A ValueError whose `field` attribute names the field, so that front ends (the
    torchtitan launcher) can point at the TOML key or CLI flag that set it rather than
    parse the message.
    """

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        super().__init__(f"GiftConfig.{field}={value!r} is invalid; allowed: {allowed}")
        self.field = field
        self.value = value
        self.allowed = allowed


def _fail(name: str, value: Any, allowed: str) -> NoReturn:
    raise GiftConfigError(name, value, allowed)


def _is_int(value: Any) -> bool:
    # bool is an int subclass: `rank=True` is a typo for a number, not the number 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_float(name: str, value: Any, allowed: str, in_range: Callable[[float], bool]) -> float:
    """`value` as a float: ints are accepted; bools, strings, NaN and +-Inf are not. NaN
    compares false to everything, so a bare `value < bound` rejection would let it through
    to the statistics or the selection rule."""
    finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not finite or not in_range(float(value)):
        _fail(name, value, allowed)
    return float(value)


def _globs(name: str, value: Any, allowed: str) -> tuple[str, ...]:
    """A comma-separated string, list or tuple of FQN globs -> tuple of non-empty globs.

    An empty piece (`","`, `"a.*,,b.*"`) is an error, not dropped: it is a typo in a flag,
    and dropping it could silently turn a glob list into an empty one.
    """
    if isinstance(value, str):
        globs: Any = tuple(s.strip() for s in value.split(","))
    elif isinstance(value, list):
        globs = tuple(value)
    else:
        globs = value
    if not isinstance(globs, tuple) or not all(isinstance(s, str) and s.strip() for s in globs):
        _fail(name, value, allowed)
    return globs


def layer_format(layer_formats: tuple[str, ...], fqn: str, default: str) -> str:
    """The wire format of the weight `fqn` under validated `GiftConfig.layer_formats` entries
    (`"glob=format"`): the first whose glob matches, else `default`."""
    for entry in layer_formats:
        glob, _, fmt = entry.partition("=")
        if fnmatch.fnmatch(fqn, glob):
            return fmt
    return default


@dataclass(frozen=True)
class GiftConfig:
    """How gradients are communicated.

    Attributes:
        format: wire format of the gradient codes (see `gift_compile.codec`).
        scaling: scale granularity for the fp8 formats: one per tensor, per row, or per
            block of `block_size` elements along the last dimension. The block-scaled
            formats (mxfp8, nvfp4, mxint4, int6, int4, int3, int2, ternary) ignore this field.
        block_size: block length for fp8 with `scaling="block"` (any even size), and for
            int6/int4/int3/int2/ternary (16 or 32). mxfp8/mxint4 use 32 and nvfp4 16 regardless.
        geometry: coordinates in which the gradient is quantized. `none` is the Euclidean
            baseline, `hadamard` a random-sign block Hadamard rotation, `dense` a full
            Cholesky whitening of the K-FAC input factor, `lowrank` the rank-`rank` plus
            diagonal whitening applied in O(d_in * rank), `gradient` the same low-rank map
            built from the gradient-side factor E[G^T G] (no forward hooks), `momentum` the
            same map built from the optimizer's momentum M (torch Muon's/SGD's
            `momentum_buffer`, Adam's `exp_avg`): the factor M^T M / out of exactly what Muon
            orthogonalizes, replaced at each refresh (no EMA: M already averages); needs the
            optimizer (`apply(..., optimizer=)` or `attach_optimizer`). `second_moment`
            scales each input column by `(c_j / mean(c))^{-1/2}`, `c_j` the column sum of
            Adam's/AdamW's `exp_avg_sq` (needs the optimizer). `auto` (the default) is
            resolved by `apply(..., optimizer=)` from the optimizer, because the convergence
            study found the right map depends on it: `lowrank` under a matrix preconditioner
            (Muon, Shampoo), `second_moment` under Adam/AdamW (and then
            `select_metric="whitened"`, the error in AdamW's update coordinates), else `none`.
            Without `optimizer=` it falls back to `lowrank` with a logged warning.
        rank: rank of the low-rank part of the whitening.
        refresh_every: steps between geometry refreshes (statistics, transforms, selection).
        refresh_warmup: the first refresh comes after this many steps, and the refreshes
            double their spacing (w, 2w, 4w, ...) until they reach `refresh_every`; from then
            on every multiple of `refresh_every` (0: only the multiples). Every adaptive map is
            the identity until its first refresh, and the geometry moves fastest early in
            training: with refreshes only every 50 steps, GIFT's default closed none of
            Euclidean's NVFP4 gap in the bench's 120-step Muon runs, against 45% for the same
            map refreshed every 20 (the convergence block's `-dflt` arms). The warm-up costs
            log2(refresh_every / w) extra refreshes per run.
        ema: decay of the exponential moving average of the statistics (not used by
            `geometry="momentum"`).
        damping: relative floor of the diagonal (times the mean eigenvalue).
        select: which managed layers take the transformed path: "auto" (measured per layer
            at each refresh), "all", "none" (Euclidean low-bit everywhere),
            "boundary_hits:K" (the paper's rule: top-K layers by E5M2 saturation share), or
            a tuple of fnmatch globs over parameter FQNs (a comma-separated string is split).
        exclude: globs of parameter FQNs that never get a map (a comma-separated string is
            split; an empty tuple excludes nothing); their gradients travel at
            `excluded_format` in plain coordinates (or `tiny_format` where tiny).
        error_feedback: keep the quantization residual (in transformed coordinates) and add
            it to the next step's gradient (the first hop: each rank's own contribution).
        second_hop_error_feedback: error feedback on the all-reduce's second hop (1-bit Adam's
            server side): each rank, as the owner of its reduced shard, keeps the residual of
            re-encoding that shard before the all-gather and adds it at the next step. That
            error is the same on every rank, so it does not average down over ranks like the
            first hop's and dominates at low bits. The residual is 1/world of the tensor (in
            `residual_format`, transformed coordinates). Only the all-reduce has a second hop:
            a reduce-scatter path (FSDP2, framework tags) refuses it.
        error_feedback_decay: beta of a leaky residual, for both hops: the encoder sends
            `g + beta * e` and keeps `e <- beta * e + delta` (delta: what this encode left
            out). 1.0 is plain error feedback, 0.0 sends exactly what no error feedback sends;
            values below 1 bound how long a stale error keeps being re-sent. Needs one of the
            error feedbacks on.
        stochastic_rounding: round codes stochastically (seeded, reproducible, unbiased): every
            format but fp32, bf16 included (the 16-bit wire with stochastic rounding that
            production reduce-scatters use); a layer sent at fp32 is exact and is not rounded.
        layer_formats: bits allocated per layer: `"glob=format"` entries (a comma-separated
            string is split) matched against the weight's FQN as `exclude` is; the first
            match wins and layers no entry matches use `format`. Every entry's format shares
            `scaling` and `block_size`. `bench.convergence.bit_allocation` measures an allocation at equal
            total bytes (more bits where a layer's relative error falls most per byte). Not
            with an HSDP replica hop, which sends every layer at one `replica_format`.
        block_rotation: before the codes are chosen, rotate each scale block (after the
            geometry's map) by a fixed signed Walsh-Hadamard transform, undone after the
            decoded sum (`gift_compile.codec.rotation`): it spreads a block's outliers over its
            elements so the block's few levels cover them with a finer step. Block-scaled
            formats only (the rotation stays inside one scale); the same on every rank and
            step, so error-feedback residuals stay valid. Off by default: the frontier study
            decides where it pays (docs/benchmarks.md, "Techniques at 2 bits").
        min_numel: 2-D weights smaller than this get no map; they and every gradient with
            fewer than two dims are "tiny" and travel at `tiny_format`.
        unmapped_format: wire format of every gradient of two or more dims and at least
            `min_numel` elements that GIFT sends without a map and `exclude` does not match
            (linears it does not manage: tied, rows that do not split; other 2-D weights):
            "same" (the default) is `format`, any format name its own, "fp32" the opt-out
            (raw, at the gradient's own dtype, as all of them went before this field existed).
            A `layer_formats` entry matching the FQN wins. Such a gradient goes in plain
            (Euclidean) coordinates in the same collective as the layers, each row with its
            own scales, with the config's error feedback. Where its codes would take at least
            the bytes of bf16 (a scale block longer than its rows), or its rows do not split
            over the ranks of a reduce-scatter, it goes at `tiny_format`, logged naming it.
        excluded_format: the same for the gradients `exclude` matches (the embedding and the
            output head by default): "bf16" (the default), "same" (`format`), any format name,
            or "fp32" (the opt-out). bf16 is the measured choice: with the recipe-like int2
            arm, bf16 against fp32 there cost no resolved loss while int2 did (docs/design.md,
            "The whole gradient"); at bf16 they are ~half of a Llama-3-8B int2 step's bytes, at
            int2 about 1/8.
        tiny_format: wire format of tiny gradients (`is_tiny`: fewer than two dims or fewer
            than `min_numel` elements: norms, biases): "bf16" (the default, in the bucket's
            collective, summed in fp32) or "fp32" (the opt-out, raw at the gradient's dtype).
        stats_tokens: at most this many tokens per step and layer enter the K-FAC statistics
            (a strided subsample), which bounds the hook's cost at O(stats_tokens * d_in^2).
        nonfinite: "error" raises when an eagerly called quantizer sees NaN/Inf; in compiled
            graphs, or with "propagate", a non-finite input turns the affected rows of the
            result into NaN on every rank (never a silently finite value).
        reduce_op: "avg" (data-parallel mean) or "sum".
        seed: base seed of stochastic rounding and of the Hadamard signs; must fit int64
            (it is held in an int64 tensor).
        select_metric: how select="auto" compares the two paths: "euclidean" (relative L2
            error of the gradient), "whitened" (the error seen in the layer's whitened
            geometry, which is what preconditioned optimizers such as Muon/Shampoo amplify),
            or "auto" (the default): `apply(..., optimizer=)` picks it from the optimizer that
            steps the managed weights (`select_metric_for`: "whitened" under a matrix
            preconditioner or for a map in the optimizer's own coordinates, else
            "euclidean"). The plain L2 error rises under whitening on most layers even where
            the error Muon's update sees falls, so judging Muon's layers in plain L2 drops
            most of them and with them GIFT's gain. Without an optimizer (`apply` without
            `optimizer=`, a `GiftState` built directly) "auto" measures as "euclidean" (logged
            by `apply`).
        auto_min_gain: with select="auto", the transformed path must cut the measured error
            by at least this factor to be enabled.
        auto_max_overhead: with select="auto", the map's time may be at most this fraction
            of the time the layer costs the step without it: its backward matmuls at this
            rank's tokens plus its gradient's exchange as a bf16 reduce-scatter over
            `auto_network_gbps`, priced as on an H200 (`gift_compile.runtime.selection`).
        auto_network_gbps: with select="auto", the network bandwidth per GPU, in Gb/s, at
            which the cost side prices a layer's exchange (100: a 100 Gb/s NIC per GPU; set
            yours: 400 for InfiniBand NDR per GPU, 12.5 for 100 GbE shared by 8 GPUs).
        unrewritten: what a managed gradient does when it reaches GIFT's `gift::mark` op
            without the pass having rewritten its collective (a backend without Inductor's
            post-grad hooks, a pass that did not run): "error" raises, "warn" logs once per
            layer and lets the gradient travel at full precision. The same for parameters a
            traced framework reduce-scatters over another mesh than GIFT's group, whose
            collectives carry no mark (torchtitan's graph_trainer: the routed experts under
            expert parallelism): refused naming their modules, or with "warn" logged per module
            and left as traced. (FSDP2 sends such a group on GIFT's codec with no map.)
        reselect_every: a measured selection (`select="auto"`, `"boundary_hits:K"`) is decided
            at the first refresh and then kept; with N > 0 it is decided again every N-th
            refresh. Between decisions `select="auto"` still measures its selected layers at
            every refresh and deselects one whose gain has fallen below 1 (the transform
            hurts by the selection's own metric). A change costs no compilation: the hooks'
            codec is compiled per item plan, traced graphs read the selection from a gate
            tensor (`LayerState.path_gate`); re-deciding keeps the statistics of deselected
            layers running.
        residual_format: how error-feedback residuals are stored (any wire format, per-row
            scales; "fp32" is exact). The residual is a full-size tensor per managed weight and
            rank that cannot be sharded, so a low-bit store is what bounds GIFT's memory.
        statistics: how the K-FAC input factor of a low-rank layer is kept: "sketch" (a
            streaming randomized range sketch A·Omega plus the exact diagonal, O(d_in *
            sketch_cols) memory, rebuilt into the rank-r + diagonal map by Nyström), or
            "dense" (the exact d_in x d_in factor). The dense geometry always uses the exact
            factor, and so do layers too narrow for a sketch to be smaller (d_in <= 1.5 k).
        sketch_cols: columns k of the sketch (0: 2 * rank).
        replica_format: wire format of the cross-replica hop of hybrid sharding (HSDP: the
            all-reduce of each reduced shard over the replica group, typically across nodes
            and on the slow network), or "same" to use `format`. The intra-node shard hop
            (the reduce-scatter) uses `format` under `shard_hop="gift"`; fp32/bf16 send the
            hop unquantized.
        shard_hop: HSDP's shard hop (the reduce-scatter over the shard group, inside a node):
            "gift" (the default) sends the layers there on GIFT's codec at `format` (map, error
            feedback, probe) and the reduced shards again at `replica_format` across the
            replicas, two roundings; "native" leaves the shard hop to FSDP2's own
            reduce-scatter at the gradient's dtype (its bytes counted) and sends each rank's
            reduced row shard once, on the replica hop, with the layers' own plans at
            `format`: their maps (which act on columns, so a row shard maps alike), error
            feedback and gradient probes, as GIFT's DDP all-reduce runs them. Only the bytes that
            cross nodes are coded, and the codec runs on 1/shards of each gradient instead of on
            all of it. Needs `replica_format="same"` and one FSDP mesh per module (no
            per-parameter meshes, such as expert parallelism's routed experts); the eager
            FSDP2 path only (`gift_compile.frameworks.hsdp.install`).
        map_precision: the arithmetic of the low-rank maps' two matmuls (the projection
            `G U` and the rank-r expansion; `lowrank`, `gradient`, `momentum`): "exact" runs
            the fixed-order fp32 map (a matmul, then r multiply-adds Inductor fuses into the
            codec), the only path on the CPU; "tf32" / "bf16" run both matmuls as Triton
            tensor-core kernels on CUDA, fp32 accumulation over operands rounded to TF32 or
            bf16, each summed in one fixed order so every rank computes the same bits
            (`gift_compile.kernels.map_dispatch`); "auto" (the default) is "tf32" on CUDA and
            "exact" elsewhere. TF32 is the CUDA default because the operand rounding is
            amplified by the inverse map's gain on the factor's strong directions: on the
            bench's real gradients (`python -m bench.fidelity.map_precision`, docs/benchmarks.md) the map
            alone errs 8x more at bf16, and bf16 moved the decoded gradient's error by
            50-120x TF32's change (neither resolved after the family-wise correction), and at these
            ranks the map is memory-bound, so bf16 would buy little speed. "tf32"/"bf16" on CPU tensors run
            the exact map, logged once as a warning.
        plan_check: the public one-tensor collectives exchange every rank's plan fingerprint
            (item names and order included) in a small fixed-size collective on every call, so
            a plan that changes on one rank raises on every rank instead of hanging; the full
            description is compared on the "first" call of each plan and on a mismatch, or on
            "always" every call (debug mode). The framework hooks (DDP, FSDP2, HSDP) compare
            every layer's plan at apply and after each refresh, where plans change, and check
            the fingerprint each header carries once per step: no host read per bucket; under
            "always" they add the per-call check. Compiled graphs always compare the
            fingerprint carried in every collective's header, at no extra collective.
        ranks_per_node: the node layout of the exchange (`gift_compile.exchange.topology`).
            None (the default) reads it from the launcher (`LOCAL_WORLD_SIZE`; unset: one
            node); an int g >= 1 says the job's global ranks sit g to a node (rank r on node
            r // g), which CPU tests use to simulate nodes; 0 switches the two levels off.
            Where a group's ranks span more than one node, each collective runs in two levels:
            the ranks of a node reduce-scatter the bucket natively at the gradient's dtype
            (fast links), then GIFT's codec runs on that 1/g chunk only and exchanges it with
            the ranks of the same local index on the other nodes, so each node puts about
            bits/32 of the bucket on the network instead of g times that. A group inside one
            node (or with one rank per node) runs today's one-level exchange, bit for bit.
        intra_node_format: the precision of the two-level exchange's collectives inside a node:
            "native" (the default) sends stage 1's reduce-scatter at the gradient's dtype and
            an all-reduce's closing all_gather of the decoded chunks at fp32; "bf16" sends
            both at bf16 (the node's sum is then rounded to bf16 before GIFT's codec sees it,
            and an all-reduce's result to bf16 once after it), which halves the bytes an fp32
            gradient puts on the node's links and the time of that stage where NVLink, not the
            network, bounds it (`python -m bench.step_model.topology`). Stage 2 across nodes is
            unchanged. With ranks_per_node=0 (no two levels) anything but "native" raises,
            since the setting would do nothing.
        recipe: the named recipe (`gift_compile.recipes`) these fields came from, "" for
            none; set by `recipe()`. Each recipe was measured under one optimizer family, and
            `apply` warns on every rank, naming both, when the optimizer it is given is another
            (a Muon recipe under AdamW gets AdamW's map, not what was measured).
        progress_every: print one progress line on rank 0 every this many optimizer steps
            (step, bytes per step, the network and total compression, layers mapped); 0 turns
            it off (the torchtitan integration does: its metrics print their own).
    """

    format: str = "fp8_e4m3"
    scaling: str = "row"
    block_size: int = 32
    geometry: str = AUTO_GEOMETRY
    rank: int = 32
    refresh_every: int = 50
    refresh_warmup: int = 10
    ema: float = 0.95
    damping: float = 1e-3
    select: SelectRule | str | tuple[str, ...] = SelectRule.AUTO
    exclude: tuple[str, ...] = ("*embed*", "*output*", "*lm_head*", "head.*", "*.head.*")
    error_feedback: bool = False
    second_hop_error_feedback: bool = False
    error_feedback_decay: float = 1.0
    stochastic_rounding: bool = False
    block_rotation: bool = False
    layer_formats: tuple[str, ...] = ()
    min_numel: int = 4096
    unmapped_format: str = SAME_FORMAT
    excluded_format: str = "bf16"
    tiny_format: str = "bf16"
    stats_tokens: int = 1024
    nonfinite: Nonfinite = Nonfinite.ERROR
    reduce_op: ReduceOp = ReduceOp.AVG
    seed: int = 0
    select_metric: SelectMetric = SelectMetric.AUTO
    auto_min_gain: float = 1.05
    auto_max_overhead: float = 0.25
    auto_network_gbps: float = 100.0
    unrewritten: Unrewritten = Unrewritten.ERROR
    plan_check: PlanCheck = PlanCheck.FIRST
    reselect_every: int = 0
    residual_format: str = "fp32"
    statistics: StatisticsKind = StatisticsKind.SKETCH
    sketch_cols: int = 0
    replica_format: str = "same"
    shard_hop: str = GIFT_SHARD_HOP
    map_precision: MapPrecision = MapPrecision.AUTO
    ranks_per_node: int | None = None
    intra_node_format: str = NATIVE_NODE_FORMAT
    recipe: str = ""
    progress_every: int = 10

    def __post_init__(self) -> None:
        # Types first (a str where a float belongs must not surface as a TypeError from a
        # comparison), then ranges; every failure is a GiftConfigError naming the field.
        for name, names in (("format", FORMATS), ("scaling", SCALINGS), ("geometry", (*GEOMETRIES, AUTO_GEOMETRY)),
                            ("residual_format", FORMATS)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in names:
                _fail(name, value, ", ".join(names))
        # The modes: each spelling becomes its member here, once; the package compares members.
        for name, mode in (("nonfinite", Nonfinite), ("select_metric", SelectMetric), ("reduce_op", ReduceOp),
                           ("unrewritten", Unrewritten), ("plan_check", PlanCheck), ("statistics", StatisticsKind),
                           ("map_precision", MapPrecision)):
            member = mode.lookup(getattr(self, name))
            if member is None:
                _fail(name, getattr(self, name), ", ".join(mode))
            object.__setattr__(self, name, member)
        for name in ("block_size", "rank", "refresh_every", "stats_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                _fail(name, value, "a positive integer")
        # the format's own choices first: "an even integer" then "16 or 32" would send a user round twice
        if self.format in BLOCK_SIZE_FORMATS and self.block_size not in BLOCK_SIZE_CHOICES:
            _fail("block_size", self.block_size, f"{' or '.join(map(str, BLOCK_SIZE_CHOICES))} for format={self.format!r}")
        if self.block_size % 2:
            _fail("block_size", self.block_size, "an even positive integer")
        if not isinstance(self.replica_format, str) or self.replica_format not in (SAME_FORMAT, *FORMATS):
            _fail("replica_format", self.replica_format, ", ".join((SAME_FORMAT, *FORMATS)))
        if self.replica_hop_format in BLOCK_SIZE_FORMATS and self.block_size not in BLOCK_SIZE_CHOICES:
            _fail("block_size", self.block_size,
                  f"{' or '.join(map(str, BLOCK_SIZE_CHOICES))} for replica_format={self.replica_hop_format!r}")
        if not isinstance(self.recipe, str):
            _fail("recipe", self.recipe, "a recipe name (gift_compile.recipes.RECIPES) or \"\"")
        if not _is_int(self.progress_every) or self.progress_every < 0:
            _fail("progress_every", self.progress_every, "a non-negative integer (0: no progress lines)")
        for name in ("unmapped_format", "excluded_format"):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in (SAME_FORMAT, *FORMATS):
                _fail(name, value, ", ".join((SAME_FORMAT, *FORMATS)) + " (fp32: the opt-out, raw at the gradient's dtype)")
            resolved = self.format if value == SAME_FORMAT else value
            if resolved in BLOCK_SIZE_FORMATS and self.block_size not in BLOCK_SIZE_CHOICES:
                _fail("block_size", self.block_size, f"{' or '.join(map(str, BLOCK_SIZE_CHOICES))} for {name}={resolved!r}")
        if not isinstance(self.tiny_format, str) or self.tiny_format not in TINY_FORMATS:
            _fail("tiny_format", self.tiny_format, ", ".join(TINY_FORMATS) + " (a tiny gradient's scale blocks would "
                  "save next to nothing; fp32 is the opt-out)")
        if self.ranks_per_node is not None and (not _is_int(self.ranks_per_node) or self.ranks_per_node < 0):
            _fail("ranks_per_node", self.ranks_per_node, "None (from LOCAL_WORLD_SIZE), 0 (one level) or a positive integer")
        if not isinstance(self.shard_hop, str) or self.shard_hop not in SHARD_HOPS:
            _fail("shard_hop", self.shard_hop, ", ".join(SHARD_HOPS))
        if self.shard_hop == NATIVE_NODE_FORMAT and self.replica_format != SAME_FORMAT:
            _fail("replica_format", self.replica_format, f"{SAME_FORMAT!r} with shard_hop={self.shard_hop!r} (the replica "
                  "hop then carries the layers at `format`, the format their selection measures and error feedback covers)")
        if not isinstance(self.intra_node_format, str) or self.intra_node_format not in INTRA_NODE_FORMATS:
            _fail("intra_node_format", self.intra_node_format, ", ".join(INTRA_NODE_FORMATS))
        if self.intra_node_format != NATIVE_NODE_FORMAT and self.ranks_per_node == 0:
            _fail("intra_node_format", self.intra_node_format,
                  f"{NATIVE_NODE_FORMAT!r} with ranks_per_node=0 (one level: no collective runs inside a node)")
        if not _is_int(self.min_numel) or self.min_numel < 0:
            _fail("min_numel", self.min_numel, "a non-negative integer")
        if not _is_int(self.sketch_cols) or self.sketch_cols < 0:
            _fail("sketch_cols", self.sketch_cols, "a non-negative integer (0: twice the rank)")
        if not _is_int(self.reselect_every) or self.reselect_every < 0:
            _fail("reselect_every", self.reselect_every, "a non-negative integer")
        if not _is_int(self.refresh_warmup) or self.refresh_warmup < 0:
            _fail("refresh_warmup", self.refresh_warmup, "a non-negative integer")
        if not _is_int(self.seed) or not _INT64_MIN <= self.seed <= _INT64_MAX:
            _fail("seed", self.seed, f"an integer in [{_INT64_MIN}, {_INT64_MAX}] (int64)")
        floats = {
            "ema": _check_float("ema", self.ema, "a finite float in [0, 1)", lambda v: 0.0 <= v < 1.0),
            "damping": _check_float("damping", self.damping, "a finite float in (0, 1)", lambda v: 0.0 < v < 1.0),
            "auto_min_gain": _check_float("auto_min_gain", self.auto_min_gain, "a finite float >= 1",
                                          lambda v: v >= 1.0),
            "auto_max_overhead": _check_float("auto_max_overhead", self.auto_max_overhead, "a finite float > 0",
                                              lambda v: v > 0.0),
            "auto_network_gbps": _check_float("auto_network_gbps", self.auto_network_gbps, "a finite float > 0",
                                              lambda v: v > 0.0),
            "error_feedback_decay": _check_float("error_feedback_decay", self.error_feedback_decay,
                                                 "a finite float in [0, 1]", lambda v: 0.0 <= v <= 1.0),
        }
        for name, value in floats.items():  # ema=0 is stored as 0.0: the annotated type
            object.__setattr__(self, name, value)
        for name in ("error_feedback", "second_hop_error_feedback", "stochastic_rounding", "block_rotation"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "true or false")
        if self.error_feedback_decay != 1.0 and not (self.error_feedback or self.second_hop_error_feedback):
            _fail("error_feedback_decay", self.error_feedback_decay,
                  "1.0 unless error_feedback or second_hop_error_feedback is on (it decays their residuals)")
        self._validate_layer_formats()
        sent = {self.format, *(e.partition("=")[2] for e in self.layer_formats)}  # every layer's format
        if self.stochastic_rounding and sent == {"fp32"}:
            _fail("stochastic_rounding", self.stochastic_rounding,
                  "false when every layer is sent at fp32: an fp32 wire is exact, there is nothing to round")
        # A block size no format reads would be dropped without a word (nvfp4's blocks are 16,
        # mxfp8's 32, whatever block_size says); the default (32) is what a config gets unasked.
        default_block = GiftConfig.__dataclass_fields__["block_size"].default
        readers = sent | {self.replica_hop_format} | {
            self.format if v == SAME_FORMAT else v for v in (self.unmapped_format, self.excluded_format)}
        if self.block_size != default_block and not any(
                FormatSpec(f, self.scaling, self.block_size).block == self.block_size for f in readers):
            blocks = ", ".join(f"{f}: {FormatSpec(f, self.scaling, self.block_size).block or 'no blocks'}"
                               for f in sorted(readers))
            _fail("block_size", self.block_size,
                  f"a block size the format uses; format={self.format!r} does not read block_size ({blocks}), so "
                  f"{self.block_size} would be ignored: leave block_size out, or set it for a format whose blocks "
                  f"it sets ({', '.join(BLOCK_SIZE_FORMATS)}: {' or '.join(map(str, BLOCK_SIZE_CHOICES))}; fp8 "
                  "with scaling='block': any even size)")
        if self.block_rotation and any(FormatSpec(f, self.scaling, self.block_size).block is None for f in sent):
            _fail("block_rotation", self.block_rotation,
                  f"false for format={self.format!r} with scaling={self.scaling!r}: the rotation runs inside "
                  "a scale block, and this format has no blocks (a block-scaled format, or fp8 with "
                  "scaling='block')")
        self._validate_select()
        object.__setattr__(self, "exclude", _globs("exclude", self.exclude,
                                                   "a list (or comma-separated string) of non-empty FQN globs"))

    def _validate_select(self) -> None:
        allowed = '"auto", "all", "none", "boundary_hits:K" (K >= 1) or a non-empty list of non-empty FQN globs'
        select = self.select
        if isinstance(select, str):
            if "," in select:  # "a.*,b.*" from a CLI flag: a glob list
                object.__setattr__(self, "select", _globs("select", select, allowed))
                return
            keyword = SelectRule.lookup(select)
            if keyword is not None:
                object.__setattr__(self, "select", keyword)
                return
            m = _BOUNDARY_RE.match(select)
            if m and int(m.group(1)) >= 1:
                return
            if select.startswith("boundary_hits"):
                _fail("select", select, allowed)
            if any(c in select for c in "*?[") or "." in select:
                object.__setattr__(self, "select", (select,))
                return
            _fail("select", select, allowed)
        elif isinstance(select, (list, tuple)):
            select = _globs("select", select, allowed)
            if not select:
                _fail("select", select, allowed)
            object.__setattr__(self, "select", select)
        else:
            _fail("select", select, allowed)

    def _validate_layer_formats(self) -> None:
        allowed = ('"glob=format" entries (a list or a comma-separated string), each glob non-empty and each format '
                   f"one of {', '.join(FORMATS)} valid with block_size={self.block_size}")
        entries = _globs("layer_formats", self.layer_formats, allowed) if self.layer_formats else ()
        for entry in entries:
            glob, sep, fmt = (part.strip() for part in entry.partition("="))
            if not sep or not glob or fmt not in FORMATS:
                _fail("layer_formats", self.layer_formats, allowed)
            if fmt in BLOCK_SIZE_FORMATS and self.block_size not in BLOCK_SIZE_CHOICES:
                _fail("layer_formats", self.layer_formats, allowed)
        object.__setattr__(self, "layer_formats",
                           tuple("=".join(p.strip() for p in e.partition("=")[::2]) for e in entries))

    def format_for(self, fqn: str) -> str:
        """The wire format of the weight `fqn` (`layer_format`)."""
        return layer_format(self.layer_formats, fqn, self.format)

    @property
    def replica_hop_format(self) -> str:
        """The format of the cross-replica hop (`replica_format`, or `format` for "same")."""
        return self.format if self.replica_format == SAME_FORMAT else self.replica_format

    def unmapped_format_for(self, fqn: str) -> str:
        """The format of the gradient of `fqn`, sent without a map and not tiny: its
        `layer_formats` entry, else `excluded_format` where `exclude` matches it, else
        `unmapped_format` ("same" resolved to `format`)."""
        choice = self.excluded_format if self.is_excluded(fqn) else self.unmapped_format
        return layer_format(self.layer_formats, fqn, self.format if choice == SAME_FORMAT else choice)

    @property
    def boundary_hits_k(self) -> int | None:
        """K of `select="boundary_hits:K"`, else None."""
        if isinstance(self.select, str):
            m = _BOUNDARY_RE.match(self.select)
            if m:
                return int(m.group(1))
        return None

    def is_excluded(self, fqn: str) -> bool:
        return any(fnmatch.fnmatch(fqn, pat) for pat in self.exclude)

    def refresh_due(self, step: int) -> bool:
        """Whether the optimizer step numbered `step` (1-based) ends with a refresh: a warm-up
        step (`refresh_warmup` * 2^k below `refresh_every`) or a multiple of `refresh_every`."""
        if step % self.refresh_every == 0:
            return True
        w = self.refresh_warmup
        return w > 0 and step < self.refresh_every and step % w == 0 and (step // w) & (step // w - 1) == 0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GiftConfig":
        """Build from a plain mapping (TOML, CLI); unknown keys are an error naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown GiftConfig field(s) {unknown}; known: {sorted(names)}")
        return cls(**d)
