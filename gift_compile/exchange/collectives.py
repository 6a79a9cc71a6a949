"""GIFT's quantized collectives as callers use them: one bucket from a flat buffer, and the
one-tensor public API.

`sync_buffer` (with `Segment` and `bucket_plan`) is the one bucket helper every eager path calls
(the public `reduce_scatter` / `all_reduce`, GIFT's own sync in a weight's backward, the DDP,
FSDP2 and HSDP hooks): cut a flat buffer into items, build and check the plan, run the bucket,
copy the results back. The bucket exchange itself (encode, one all_to_all, decode and fp32 sum;
for an all-reduce the re-encoded shards' all-gather) is `gift_compile.exchange.bucket`, the wire
accounting `gift_compile.exchange.accounting` and the eager cross-rank checks `gift_compile.exchange.agreement`;
their public names are re-exported here, so `gift_compile.exchange.collectives` stays the one import for
the core.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from gift_compile.codec import Nonfinite
from gift_compile.config import NATIVE_NODE_FORMAT, GiftConfig, PlanCheck, ReduceOp
from gift_compile.exchange.accounting import HEADER_BYTES, bucket_hop_bytes, bucket_wire_bytes, wire_bytes_per_rank
from gift_compile.exchange.agreement import check_plan_agreement, raise_on_bad_headers
from gift_compile.exchange.bucket import (
    C_BASELINE, C_CALLS, C_CROSS_BASELINE, C_MISMATCH, C_MISMATCH_RANKS, C_NODE_WIRE, C_NONFINITE, C_NONFINITE_RANKS, C_PLAIN_CALLS,
    C_WIRE, N_COUNTERS, RANK_BITS, ItemTensors, Shared, bucket_core, finish, flagged_ranks, gather_finish, gather_launch,
    group_info, launch, run_bucket,
)
from gift_compile.exchange.node_stage import residual_rows
from gift_compile.exchange.plan import BucketPlan, Collective, ItemPlan, dtype_name
from gift_compile.exchange.topology import FLAT, NodeLayout, node_layout
from gift_compile.geometry.table import IDENTITY_KIND, Geometry
from gift_compile.sync import process_group

__all__ = [
    "C_BASELINE", "C_CALLS", "C_CROSS_BASELINE", "C_MISMATCH", "C_MISMATCH_RANKS", "C_NODE_WIRE", "C_NONFINITE", "C_NONFINITE_RANKS",
    "C_PLAIN_CALLS", "C_WIRE", "HEADER_BYTES", "N_COUNTERS", "RANK_BITS", "ItemTensors", "Segment", "Shared",
    "all_reduce", "bucket_core", "bucket_hop_bytes", "bucket_plan", "bucket_wire_bytes", "check_plan_agreement", "count_raw",
    "finish", "flagged_ranks",
    "gather_finish", "gather_launch", "group_info", "launch", "per_call_check", "raise_on_bad_headers", "reduce_scatter",
    "run_bucket", "sync_buffer", "wire_bytes_per_rank",
]


# ---- one bucket from a flat buffer: every eager path --------------------------------------------
class Segment(NamedTuple):
    """One gradient in a flat bucket buffer.

    `rows x cols` is the gradient's block in the buffer's layout: for an all-reduce the whole
    gradient (segments follow each other), for a reduce-scatter each rank's row block (the
    buffer is `[world, chunk]`, rank `r`'s blocks of every segment in row `r`, as FSDP2's
    `chunk_cat` and the bucketed reduce-scatters pack it). `plan` is a managed weight's plan
    (its dtype is set from the buffer) with its runtime `tensors`; `None` sends the segment at
    full precision.
    """

    name: str
    rows: int
    cols: int
    plan: ItemPlan | None = None
    tensors: ItemTensors | None = None


def bucket_plan(segments: Sequence[Segment], dtype: torch.dtype, *, world: int, group_name: str | None,
                average: bool, op: Collective | str, layout: NodeLayout = FLAT) -> BucketPlan:
    """The plan of a buffer cut into `segments` (see `Segment` for the two layouts), on the
    group's node `layout` (`topology.node_layout`)."""
    return _bucket_plan(tuple((s.name, s.rows, s.cols, s.plan) for s in segments), dtype, world, group_name, average,
                        Collective.parse(op), layout)


@functools.lru_cache(maxsize=1024)
def _bucket_plan(segments: tuple[tuple[str, int, int, ItemPlan | None], ...], dtype: torch.dtype, world: int,
                 group_name: str | None, average: bool, op: Collective, layout: NodeLayout) -> BucketPlan:
    """`bucket_plan` memoised on what the plan is made of (the segments' names, shapes and
    plans, not their tensors): an eager hook asks for the same few plans every step, and a
    `BucketPlan` fingerprints its items (and builds its cross-node stage) when it is made."""
    per_item = world if op is Collective.REDUCE_SCATTER else 1
    items = tuple(ItemPlan.passthrough(name, per_item * rows * cols, dtype) if plan is None
                  else plan.with_dtype(dtype) for name, rows, cols, plan in segments)
    return BucketPlan(items, world, group_name, average, op, layout)


def count_raw(counters: torch.Tensor, layout: NodeLayout, wire: int, baseline: int) -> None:
    """Bytes a framework's own full-precision collective was handed (`wire`; `baseline`: the
    gradients' own bytes) into GIFT's counters, all across nodes where the group's `layout`
    spans them, else inside one node: the raw collectives GIFT runs beside its codec (a plain
    module's unmanaged parameters, HSDP's native shard hop) count as its coded ones do."""
    crossing = layout.two_level or layout.spans_nodes
    counters[C_WIRE] += wire
    counters[C_BASELINE] += baseline
    counters[C_NODE_WIRE] += 0 if crossing else wire
    counters[C_CROSS_BASELINE] += baseline if crossing else 0


def per_call_check(config: GiftConfig) -> PlanCheck | None:
    """The `plan_check` a framework hook of a `GiftState` passes to `sync_buffer`: None, except
    in the debug mode `plan_check="always"`. The state's ranks compare every layer's plan and the
    config when it is set up and after every refresh (`GiftState.check_agreement`), the only
    points where a plan changes, and each collective's header carries its bucket plan's
    fingerprint into the counters; a per-call check would add a small all-reduce and a host
    read to every bucket, inside the backward, where the framework overlaps its collectives."""
    return PlanCheck.ALWAYS if config.plan_check is PlanCheck.ALWAYS else None


def sync_buffer(buffer: torch.Tensor, segments: Sequence[Segment], shared: Shared, *, op: Collective | str,
                group: dist.ProcessGroup | str | None, average: bool, out: torch.Tensor | None = None,
                plan_check: PlanCheck | None = None, nonfinite: Nonfinite | None = None, compiled: bool = False,
                timing: contextlib.AbstractContextManager | None = None,
                ranks_per_node: int | None = None, intra_node_format: str = NATIVE_NODE_FORMAT) -> list[torch.Tensor]:
    """One bucket collective over a flat buffer, the steps every eager caller shares (the
    public one-tensor API, GIFT's own sync in a weight's backward, the DDP and FSDP2 hooks):
    cut `buffer` into `segments`, build the `BucketPlan`, check it across ranks, `run_bucket`,
    copy the results into `out`.

    `plan_check` (`GiftConfig.plan_check`) runs `check_plan_agreement`
    before data moves (None: the caller checked the plan when it was set up). `nonfinite`
    (`GiftConfig.nonfinite`) raises on every rank for bad headers now (None: left to the
    counters, checked once per optimizer step). `out` receives the results: for an
    all-reduce at the segments' offsets (it may be `buffer` itself), for a reduce-scatter
    this rank's shards concatenated. `timing` is entered around the collective.
    `ranks_per_node` (`GiftConfig.ranks_per_node`) decides whether the bucket runs in two
    levels (`topology.node_layout`), `intra_node_format` (`GiftConfig.intra_node_format`) at
    which precision its collectives inside the node run. Returns the fp32 outputs (all-reduce: full gradients;
    reduce-scatter: this rank's shards).
    """
    op = Collective.parse(op)
    group_name, world, _ = group_info(group)
    xs: list[torch.Tensor] = []
    if op is Collective.REDUCE_SCATTER:
        chunks = buffer.view(world, sum(s.rows * s.cols for s in segments))
    offset = 0
    for seg in segments:
        n = seg.rows * seg.cols
        if op is Collective.REDUCE_SCATTER:
            piece = chunks[:, offset:offset + n]
            xs.append(piece if seg.plan is None else piece.reshape(world * seg.rows, seg.cols))
        else:
            piece = buffer[offset:offset + n]
            xs.append(piece if seg.plan is None else piece.view(seg.rows, seg.cols))
        offset += n
    layout = node_layout(group, ranks_per_node, intra_node_format) if group_name else FLAT
    plan = bucket_plan(segments, buffer.dtype, world=world, group_name=group_name, average=average, op=op,
                       layout=layout)
    if plan_check is not None:
        pg = process_group(group)
        check_plan_agreement(plan, pg if group_name else None, always=plan_check is PlanCheck.ALWAYS)
    with timing if timing is not None else contextlib.nullcontext():
        outs, headers = run_bucket(xs, [s.tensors for s in segments], shared, plan, compiled=compiled)
    if nonfinite is not None:
        raise_on_bad_headers(headers, plan, nonfinite)
    if out is not None and op is Collective.REDUCE_SCATTER:
        out.copy_(torch.cat([o.reshape(-1) for o in outs]))
    elif out is not None:
        offset = 0
        for x, o in zip(xs, outs):
            out[offset:offset + x.numel()].copy_(o.reshape(-1))
            offset += x.numel()
    return outs


# ---- one-tensor public API -----------------------------------------------------------------------
@torch.compiler.disable
def _single(x: torch.Tensor, group: dist.ProcessGroup | str | None, config: GiftConfig, transform: Geometry | None,
            residual: torch.Tensor | None, seed: torch.Tensor | int, op: Collective, compiled: bool,
            second_hop_residual: torch.Tensor | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"GIFT {op}: x must be a tensor, got {type(x).__name__}")
    dtype_name(x.dtype)
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"GIFT {op}: x must have at least one dimension and one element, got shape {tuple(x.shape)}")
    rows, cols = (1, x.shape[0]) if x.dim() == 1 else (x.numel() // x.shape[-1], x.shape[-1])
    if op is Collective.REDUCE_SCATTER:
        rows, cols = x.shape[0], x.numel() // x.shape[0]
    kind = IDENTITY_KIND if transform is None else transform.kind
    tensors = () if transform is None else transform.tensors
    if transform is not None and cols != transform.d_in:
        raise ValueError(f"GIFT {op}: x's last dim {cols} != transform d_in {transform.d_in}")
    name, world, rank = group_info(group)
    layout = node_layout(group, config.ranks_per_node, config.intra_node_format) if name else FLAT
    if residual is not None and not layout.two_level and residual.shape != x.shape:
        raise ValueError(f"GIFT {op}: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    chunk = (residual_rows(rows, world, layout), cols)
    if residual is not None and layout.two_level and tuple(residual.shape) != chunk:
        raise ValueError(f"GIFT {op}: residual shape {tuple(residual.shape)} != the node chunk {chunk} the two-level "
                         f"exchange rounds ({layout.nodes} nodes x {layout.ranks_per_node} ranks)")
    if second_hop_residual is not None and second_hop_residual.shape != (-(-rows // world), cols):
        raise ValueError(f"GIFT {op}: second_hop_residual shape {tuple(second_hop_residual.shape)} != this rank's "
                         f"shard {(-(-rows // world), cols)} (rows {rows} padded to a multiple of {world}, / {world})")
    if op is Collective.REDUCE_SCATTER and rows % world:
        raise ValueError(f"GIFT reduce_scatter: dim 0 of x ({rows}) is not divisible by the world size {world}")
    item = ItemPlan(name="x", rows=rows, cols=cols, dtype=dtype_name(x.dtype), managed=True, format=config.format,
                    scaling=config.scaling, block_size=config.block_size, kind=kind, n_tensors=len(tensors),
                    error_feedback=residual is not None, stochastic_rounding=config.stochastic_rounding,
                    block_rotation=config.block_rotation,
                    second_hop_error_feedback=second_hop_residual is not None,
                    error_feedback_decay=config.error_feedback_decay, map_precision=config.map_precision)
    res2 = None if residual is None else (residual.reshape(-1, cols),)
    hop2 = None if second_hop_residual is None else (second_hop_residual,)
    seg_rows = rows // world if op is Collective.REDUCE_SCATTER else rows
    segment = Segment("x", seg_rows, cols, item, ItemTensors(tensors, res2, None, second_hop_residual=hop2))
    outs = sync_buffer(x.reshape(-1), [segment], Shared(seed, rank, None), op=op, group=group,
                       average=config.reduce_op is ReduceOp.AVG, plan_check=config.plan_check, nonfinite=config.nonfinite,
                       compiled=compiled, ranks_per_node=config.ranks_per_node,
                       intra_node_format=config.intra_node_format)
    return outs[0]


def reduce_scatter(
    x: torch.Tensor,
    group: dist.ProcessGroup | str | None,
    config: GiftConfig,
    transform: Geometry | None = None,
    residual: torch.Tensor | None = None,
    *,
    seed: torch.Tensor | int = 0,
    compiled: bool = False,
) -> torch.Tensor:
    """Low-bit reduce-scatter along dim 0: this rank's shard of the sum (or mean) of `x`.

    `x.shape[0]` must be divisible by the world size. `residual` (fp32, shape of `x`) is error
    feedback in transformed coordinates, updated in place; where the group spans nodes
    (`GiftConfig.ranks_per_node`) it is the node chunk's, `[rows / g, cols]`
    (`node_stage.residual_rows`). A non-finite `x` on any rank raises
    on every rank under `nonfinite="error"`; ranks calling with different plans raise
    before any data moves. `compiled` runs the core through `torch.compile`.

    This is an eager API (its checks talk to the host); inside your own compiled code call
    `bucket_core` with a `BucketPlan`, which traces with `fullgraph=True`.
    """
    out = _single(x, group, config, transform, residual, seed, Collective.REDUCE_SCATTER, compiled)
    return out.to(x.dtype).reshape(-1, *x.shape[1:])


def all_reduce(
    x: torch.Tensor,
    group: dist.ProcessGroup | str | None,
    config: GiftConfig,
    transform: Geometry | None = None,
    residual: torch.Tensor | None = None,
    *,
    second_hop_residual: torch.Tensor | None = None,
    seed: torch.Tensor | int = 0,
    compiled: bool = False,
) -> torch.Tensor:
    """Low-bit all-reduce of `x` (at least 1-D): bit-identical result on every rank.

    Arguments as in `reduce_scatter`; rows need not divide by the world size (padded).
    `second_hop_residual` (fp32 `[ceil(rows / world), cols]`, rows and cols of `x`'s 2-D view)
    is the owner-side error feedback of this rank's reduced shard, updated in place. Both
    residuals are decayed by `config.error_feedback_decay`.
    """
    return _single(x, group, config, transform, residual, seed, Collective.ALL_REDUCE, compiled,
                   second_hop_residual).to(x.dtype).reshape(x.shape)
