"""What one bucket collective hands to the wire, by shape alone: the header, the layout of each
format's scales, and the byte accounting (`bucket_wire_bytes`, `bucket_hop_bytes`, `wire_bytes_per_rank`).

Split out of `gift_compile.exchange.collectives` because cost tables, the bench and telemetry read the
accounting without running a collective, while `collectives` packs and parses scales with the
same layout (`_scale_layout`) and re-exports the public names. `run_bucket` counts what it
really hands over at run time; the tests check the two agree.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from gift_compile.codec import FormatSpec, choose_scales
from gift_compile.exchange.plan import BucketPlan, Collective, ItemPlan

# Bytes of the header at the start of every destination's block: the plan fingerprint and the
# non-finite flag, two int64.
HEADER_BYTES = 16


def _scale_layout(spec: FormatSpec, cols: int) -> tuple[bool, torch.dtype | None, int, bool]:
    """`(per_row, dtype, count, has_tensor_scale)` of `choose_scales` for `[rows, cols]` inputs.

    `count` is scales per row when `per_row`, else the total (a per-tensor scale). Found by
    running `choose_scales` on the meta device, so any format's layout is read off the codec.
    Eager calls are memoised; a trace reads the layout directly (Dynamo would trace through
    the cache wrapper anyway, and warns when it meets one).
    """
    if torch.compiler.is_compiling():
        return _read_scale_layout(spec, cols)
    return _cached_scale_layout(spec, cols)


def _read_scale_layout(spec: FormatSpec, cols: int) -> tuple[bool, torch.dtype | None, int, bool]:
    if spec.passthrough:
        return False, None, 0, False
    scales, tscale = choose_scales(torch.empty(2, cols, device="meta"), spec)
    per_row = scales.dim() >= 1 and scales.shape[0] == 2 and not spec.single_scale
    count = scales.numel() // 2 if per_row else scales.numel()
    return per_row, scales.dtype, count, tscale is not None


_cached_scale_layout = functools.cache(_read_scale_layout)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _item_bytes_per_dest(spec: FormatSpec, rows_per_dest: int, cols: int) -> int:
    """Bytes of one managed item's block that one destination receives (codes + scales)."""
    per_row, sdtype, count, has_t = _scale_layout(spec, cols)
    n = rows_per_dest * spec.payload_cols(cols)
    if sdtype is not None:
        n += (rows_per_dest * count if per_row else count) * _itemsize(sdtype)
    return n + (4 if has_t else 0)


def bucket_wire_bytes(plan: BucketPlan) -> int:
    """Bytes this rank hands to collectives for one call of `plan` (shape-based accounting).

    The all_to_all input (`world` blocks, each with its header) plus, for an all-reduce, the
    all_gather input. `run_bucket` counts what it really hands over at run time; the tests
    check the two agree. A two-level plan's are both hops' (`bucket_hop_bytes`).
    """
    if plan.two_level:
        return sum(bucket_hop_bytes(plan))
    w = plan.world
    total = w * HEADER_BYTES
    gather = 0
    for item in plan.items:
        if item.managed:
            r = plan.rows_sent(item) // w
            total += w * _item_bytes_per_dest(item.spec, r, item.cols)
            gather += _item_bytes_per_dest(item.spec, r, item.cols)
        else:
            n = plan.flat_sent(item)
            total += n * _itemsize(item.torch_dtype)
            gather += (n // w) * _itemsize(item.torch_dtype)
    if plan.op is Collective.ALL_REDUCE and w > 1:
        total += gather
    return total


def bucket_hop_bytes(plan: BucketPlan) -> tuple[int, int]:
    """`(inside the node, across nodes)`: the bytes this rank hands to each level's collectives
    for one call of `plan`. A one-level plan hands everything to its group's exchange: across
    nodes where its group spans them (`plan.layout.spans_nodes`), else inside its one node. A
    two-level plan (`gift_compile.exchange.node_stage`): the reduce-scatter of the whole
    bucket at its dtypes (or bf16: `plan.layout.node_format`), the 16-byte header all_gather
    and, for an all-reduce, the decoded chunks' all_gather (fp32, or bf16) inside the node;
    its stage 2 (`plan.cross`) across nodes."""
    if not plan.two_level:
        return (0, bucket_wire_bytes(plan)) if plan.layout.spans_nodes else (bucket_wire_bytes(plan), 0)
    node = HEADER_BYTES
    result = _itemsize(plan.layout.node_dtype(torch.float32))
    for item in plan.items:
        sent = plan.rows_sent(item) * item.cols if item.managed else plan.flat_sent(item)
        node += sent * _itemsize(plan.layout.node_dtype(item.torch_dtype))
        if plan.op is Collective.ALL_REDUCE:
            node += plan.chunk_rows(item) * (item.cols if item.managed else 1) * result
    return node, bucket_wire_bytes(plan.cross)


def wire_bytes_per_rank(op: str, shape: Sequence[int], spec: FormatSpec, world: int) -> int:
    """`bucket_wire_bytes` of a single managed `[rows, cols]` float32 gradient (for cost tables).

    A passthrough spec (fp32, bf16) means the plain collective at that precision: its payload bytes.
    """
    rows, cols = (1, int(shape[0])) if len(shape) == 1 else (int(torch.Size(shape[:-1]).numel()), int(shape[-1]))
    if spec.passthrough:
        return rows * spec.payload_cols(cols)
    item = ItemPlan(name="w", rows=rows, cols=cols, format=spec.name, scaling=spec.scaling, block_size=spec.block_size)
    return bucket_wire_bytes(BucketPlan((item,), world, None, False, op))
