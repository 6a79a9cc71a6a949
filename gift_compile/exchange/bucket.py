"""The bucket exchange at the heart of every GIFT collective, built from `torch.ops._c10d_functional` ops.

One bucket (a framework's bucketed reduce-scatter, an FSDP2 module's flat buffer, a DDP bucket,
or a single weight) becomes ONE all_to_all of bytes:

    per managed item: transform (+ beta * EF residual) -> local scales -> encode -> row block j of the
                      codes and of their scales goes to rank j
    per other item:   raw bytes of row block j go to rank j
    + a 16-byte header to every rank: the bucket plan's fingerprint and a non-finite flag
      (set when any item of the bucket, managed or passed through, holds NaN/Inf)
    -> all_to_all_single (uint8)
    -> per item: decode every sender's block with that sender's scales, (each / world when
       averaging: a finite mean never overflows in the sum), sum in fp32 in rank order,
       inverse transform

Where the group spans nodes (`BucketPlan.layout`, `gift_compile.exchange.topology`) the same
functions run it in two levels (`gift_compile.exchange.node_stage`): `launch` first
reduce-scatters the bucket natively inside the node and then encodes only the node's 1/g chunk
for the all_to_all across nodes (`BucketPlan.cross`), `finish` and the all-gather stages decode
that, and `gather_finish` ends an all-reduce with an all_gather of the fp32 chunks inside the
node; every caller (eager hooks, the FX pass, compiled bodies) gets the two levels from its plan.

For an all-reduce the reduced shards (still in transformed coordinates) are re-encoded with
local scales and all-gathered (one all_gather_into_tensor of codes + scales), and every rank
decodes the very same bytes, so replicas stay bit-identical. With second-hop error feedback the
owner of a shard adds (beta times) what re-encoding that shard left out last step before it
encodes, and keeps the new remainder: the correction travels inside the gathered bytes, so
every rank still applies the same update.

Why this shape:
- no collective ever adds low-bit codes, and every receiver decodes with the scales the sender
  encoded with (no scale agreement round: one collective launch per bucket, exactly as many as
  the reduce-scatter it replaces, and tighter local scales);
- the header lets every rank see, in the same step, whether any rank's plan differs (same
  bytes but another format, say) or any rank's gradient was non-finite; that is how all ranks
  fail together instead of one raising while its peers wait (see `GiftState.check_health`);
- the rank is data (a tensor, used only for stochastic-rounding seeds), never a graph
  constant, so one traced graph serves every rank;
- every byte handed to a collective is counted, when it is handed over, into a `counters`
  tensor (in place; compiled graphs do it too), so telemetry reports what was sent, and
  `bucket_wire_bytes` (the shape-based accounting) can be checked against it.

The functions are plain traceable PyTorch: the FX pass splices `launch`/`finish` into graphs
(the launch where the framework launched its collective, the finish where it waited, so the
scheduler's overlap is kept); FSDP2's and DDP's hooks and the public `reduce_scatter` /
`all_reduce` call `run_bucket` eagerly or through `torch.compile`. gloo carries no float8 or
float4 dtypes, so everything travels as uint8.

This module is the bucket glue (`launch`/`finish`/`gather_launch`/`gather_finish`, `bucket_core`,
`run_bucket`, the counter slots): the header, the one collective per stage, the counters, and a
loop over the items. The codec of one item is `gift_compile.exchange.item_codec`; `run_bucket(...,
compiled=True)` runs each item through a body compiled for that item's plan alone
(`gift_compile.exchange.compiled_bodies`), so the compilations are bounded by the model's distinct
item plans, not by its buckets' patterns; traced callers (the FX pass, a `torch.compile` of
`bucket_core`) get the same per-item functions inlined into their graph.
`gift_compile.exchange.collectives` is what callers use (the flat-buffer helper `sync_buffer` and the one-tensor API) and re-exports all of it. The
shape-based accounting lives in `gift_compile.exchange.accounting`, the eager cross-rank checks in
`gift_compile.exchange.agreement`.
"""


from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from gift_compile import kernels
from gift_compile.exchange import compiled_bodies
from gift_compile.exchange.accounting import HEADER_BYTES
from gift_compile.exchange.item_codec import (
    ItemTensors, Shared, _as_bytes, _from_bytes, _take, decode_item, decode_stage, encode_item, encode_stage,
    gather_decode_item, gather_decode_stage, item_plan, item_width, reduce_reencode_stage, reencode_item,
)
from gift_compile.exchange.node_stage import node_gather, node_rank_flags, node_reduce
from gift_compile.exchange.plan import BucketPlan, Collective, ItemPlan
from gift_compile.sync import process_group

_c10d = torch.ops._c10d_functional

# Slots of the int64 `counters` tensor every GiftState keeps (updated in place on every call).
C_WIRE = 0  # bytes handed to GIFT's collectives (codes, scales, headers, full-precision items)
C_BASELINE = 1  # bytes the replaced collective would have been handed (the gradients' own dtype)
C_CALLS = 2  # bucket collectives run
C_NONFINITE = 3  # calls in which some rank's gradient (any item of the bucket) had NaN/Inf
C_MISMATCH = 4  # calls in which some rank's plan differed from this rank's
# Bit masks of ranks (bit r = group rank r; ranks >= RANK_BITS share the top bit), OR-ed in by
# every call and cleared when `GiftState.check_health` reads them, so its error names the ranks.
C_NONFINITE_RANKS = 5  # ranks whose header flagged a non-finite gradient
C_MISMATCH_RANKS = 6  # ranks whose plan fingerprint differed from this rank's
C_PLAIN_CALLS = 7  # bucket collectives of the full-precision sync of unmanaged parameters
# bytes of C_WIRE handed to collectives inside a node: a two-level exchange's native
# reduce-scatter, header all_gather and (all-reduce) result all_gather, and every collective of
# a group inside one node; C_WIRE minus this is what crossed nodes (the network)
C_NODE_WIRE = 8
# bytes the same layout's exchange at the gradients' own dtype (fp32) would have handed to
# collectives that cross nodes: a two-level stage 2's node-reduced chunks, a one-level group
# spanning nodes' gradients; 0 inside one node (the network compression's denominator side)
C_CROSS_BASELINE = 9
N_COUNTERS = 10
RANK_BITS = 62

__all__ = [
    "C_BASELINE", "C_CALLS", "C_CROSS_BASELINE", "C_MISMATCH", "C_MISMATCH_RANKS", "C_NONFINITE", "C_NONFINITE_RANKS", "C_NODE_WIRE",
    "C_PLAIN_CALLS", "C_WIRE", "N_COUNTERS", "RANK_BITS", "ItemTensors", "Shared", "bucket_core", "finish", "flagged_ranks",
    "gather_finish", "gather_launch", "group_info", "launch", "run_bucket",
]


def group_info(group: dist.ProcessGroup | str | None) -> tuple[str | None, int, int]:
    """`(group_name, world_size, rank)`; `None` or a one-rank group means no communication."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return None, 1, 0
    pg = process_group(group)
    world = dist.get_world_size(pg)
    if world == 1:
        return None, 1, 0
    return pg.group_name, world, dist.get_rank(pg)


def _count(shared: Shared, wire: int, baseline: int, calls: int, nonfinite: torch.Tensor | int = 0,
           mismatch: torch.Tensor | int = 0, node: int = 0, cross_baseline: int = 0) -> None:
    """Add to the counters in one in-place op (no tensor constants: graph-spliceable); `node`
    of the `wire` bytes went to collectives inside a node; `cross_baseline`: what the same
    layout's exchange at the gradients' dtype would have handed across nodes."""
    c = shared.counters
    if c is None:
        return
    idx = torch.arange(c.shape[0], device=c.device)
    delta = ((idx == C_WIRE) * wire + (idx == C_BASELINE) * baseline + (idx == C_CALLS) * calls
             + (idx == C_NONFINITE) * nonfinite + (idx == C_MISMATCH) * mismatch + (idx == C_NODE_WIRE) * node
             + (idx == C_CROSS_BASELINE) * cross_baseline)
    c.add_(delta.to(c.dtype))


def _flag_ranks(shared: Shared, nonfinite: torch.Tensor, mismatch: torch.Tensor) -> None:
    """OR the ranks flagged in `nonfinite` / `mismatch` (bool `[world]`) into the counters'
    rank masks, in place and without tensor constants (graph-spliceable)."""
    c = shared.counters
    if c is None:
        return
    w = nonfinite.shape[0]
    ranks = torch.arange(w, device=c.device).clamp(max=RANK_BITS)
    bits = torch.bitwise_left_shift(torch.ones_like(ranks), ranks)

    def mask(flags: torch.Tensor) -> torch.Tensor:
        low = (flags[:RANK_BITS].to(torch.int64) * bits[:RANK_BITS]).sum()  # distinct bits: sum == OR
        if w <= RANK_BITS:
            return low
        return low | (flags[RANK_BITS:].any().to(torch.int64) * bits[RANK_BITS])

    idx = torch.arange(c.shape[0], device=c.device)
    c.bitwise_or_(((idx == C_NONFINITE_RANKS) * mask(nonfinite) + (idx == C_MISMATCH_RANKS) * mask(mismatch)).to(c.dtype))


def flagged_ranks(mask: int) -> list[int]:
    """Group ranks set in a rank mask of the counters (`RANK_BITS` stands for "that rank or
    a higher one")."""
    return [r for r in range(RANK_BITS + 1) if mask >> r & 1]


def _key(item: ItemPlan, state: ItemTensors | None, plan: BucketPlan) -> BucketPlan:
    """The single-item plan an item's compiled body is keyed by, anonymous where no code reads
    the name (passthrough items, managed items with a seed-offset tensor), so equally shaped
    layers of different blocks share one body. Eager callers agree on the full bucket plan,
    names and order included, before they launch (`check_plan_agreement`), and the header
    then guards shapes and formats."""
    anonymous = not item.managed or (state is not None and state.seed_offset is not None)
    return item_plan(item, plan.world, plan.average, plan.op, anonymous)


def _body_shared(shared: Shared, device: torch.device) -> Shared:
    """`shared` as a compiled body takes it: seed and rank as int64 tensors (a Python int is a
    graph constant, so a seed that changes per call would recompile per value), no counters
    (the glue counts)."""
    def as_tensor(v: torch.Tensor | int) -> torch.Tensor:
        return v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.int64, device=device)

    return Shared(as_tensor(shared.seed), as_tensor(shared.rank), None)


def launch(xs: Sequence[torch.Tensor], items: Sequence[ItemTensors | None], shared: Shared,
           plan: BucketPlan, *, compiled: bool = False) -> torch.Tensor:
    """Encode every item (`item_codec.encode_item`; with `compiled`, through its compiled body),
    pack one block per destination behind the header and start the all_to_all.

    Returns the collective's (not yet waited) output `[world * N]` uint8, or the packed input
    itself on one rank. Updates error-feedback residuals, gradient probes and the counters.
    A two-level plan first runs stage 1 inside the node (`node_stage.node_reduce`, waited)
    and then this on the node's chunks over `plan.cross`, whose headers carry the node's flags.
    """
    if not plan.two_level:
        return _launch(xs, items, shared, plan, compiled, None)
    chunks, stage2, flag, handed, baseline = node_reduce(xs, items, plan)
    _count(shared, handed, baseline, 1, node=handed)
    return _launch(chunks, stage2, shared, plan.cross, compiled, flag)


def _launch(xs: Sequence[torch.Tensor], items: Sequence[ItemTensors | None], shared: Shared, plan: BucketPlan,
            compiled: bool, node_flag: torch.Tensor | None) -> torch.Tensor:
    """`launch` of a one-level plan, or (`node_flag`, the node's flag word) of a two-level
    plan's stage 2, whose header carries that word and whose call and baseline stage 1 counted."""
    w = plan.world
    blocks: list[torch.Tensor] = []
    nonfinite = None
    baseline = 0
    body_shared = _body_shared(shared, xs[0].device) if compiled else shared
    for x, state, item in zip(xs, items, plan.items):
        baseline += x.numel() * x.element_size()
        if compiled:  # contiguous: a bucket's strides would be guards, i.e. one body per bucket layout
            if item.managed:  # the body's codec path (kernels or generated code), logged here: eager
                kernels.note_path(item.spec, x.device, item.stochastic_rounding)
            body = compiled_bodies.body("encode", encode_stage, _key(item, state, plan))
            item_blocks, bad = body(x.contiguous(), state, body_shared)
        else:
            item_blocks, bad = encode_item(x, state, shared, item, plan)
        blocks.extend(item_blocks)
        nonfinite = bad if nonfinite is None else nonfinite | bad
    flag = nonfinite.to(torch.int64) if node_flag is None else node_flag
    header = torch.stack([torch.full_like(flag, plan.fingerprint()), flag])
    blocks.insert(0, _as_bytes(header).reshape(1, -1).expand(w, -1))
    send = torch.cat(blocks, dim=1)
    # a stage 2 (`plan.cross`) always crosses nodes; its inputs are the node-reduced chunks an
    # fp32 exchange over the same layout would have sent across
    crossing = plan.layout.spans_nodes
    cross_baseline = baseline if crossing else 0
    node = 0 if crossing else send.numel()
    if node_flag is None:
        _count(shared, send.numel(), baseline, 1, node=node, cross_baseline=cross_baseline)
    else:
        _count(shared, send.numel(), 0, 0, node=node, cross_baseline=cross_baseline)
    if plan.group_name is None:
        return send.reshape(-1)
    n = send.shape[1]
    return _c10d.all_to_all_single(send.reshape(-1), [n] * w, [n] * w, plan.group_name)


def _read_headers(recv: torch.Tensor, shared: Shared, plan: BucketPlan) -> torch.Tensor:
    """`recv` as `[world, N]`, after adding its headers' plan mismatches and non-finite flags
    to the counters."""
    recv = recv.reshape(plan.world, -1)
    header = _from_bytes(_take(recv, 0, HEADER_BYTES)[0], torch.int64)  # [w, 2]
    if plan.node_headers:  # a two-level stage 2: each header carries its node's flags
        nonfinite, mismatch = node_rank_flags(header, shared, plan)
    else:
        mismatch = header[:, 0] != plan.fingerprint()
        nonfinite = header[:, 1] != 0
    _count(shared, 0, 0, 0, nonfinite.any().to(torch.int64), mismatch.any().to(torch.int64))
    _flag_ranks(shared, nonfinite, mismatch)
    return recv


def finish(recv: torch.Tensor, items: Sequence[ItemTensors | None], shared: Shared, plan: BucketPlan, *,
           transformed: bool = False, compiled: bool = False) -> list[torch.Tensor]:
    """Decode and sum what `launch`'s all_to_all delivered (already waited): one fp32 tensor per
    item (`item_codec.decode_item`). Reads the headers: a plan mismatch or a non-finite
    gradient on any rank is added to the counters. `compiled` (original coordinates only)
    decodes each item through its compiled body, from a dense copy of its columns."""
    if compiled and transformed:
        raise ValueError("finish: the compiled bodies decode to original coordinates (the all-reduce's compiled "
                         "path re-encodes in the same body: run_bucket)")
    if plan.two_level:  # stage 2's decode: the chunk's shard is this rank's one-level shard
        return finish(recv, items, shared, plan.cross, transformed=transformed, compiled=compiled)
    recv = _read_headers(recv, shared, plan)
    offset = HEADER_BYTES
    outs = []
    for state, item in zip(items, plan.items):
        if compiled:
            cols, offset = _take(recv, offset, item_width(item, plan))
            outs.append(compiled_bodies.body("decode", decode_stage, _key(item, state, plan))(cols, state))
        else:
            out, offset = decode_item(recv, offset, state, item, plan, transformed)
            outs.append(out)
    return outs


def _gather_send(pieces: list[torch.Tensor], shared: Shared, plan: BucketPlan) -> torch.Tensor:
    buf = torch.cat(pieces)
    _count(shared, buf.numel(), 0, 0, node=0 if plan.layout.spans_nodes else buf.numel())
    if plan.group_name is None:
        return buf
    return _c10d.all_gather_into_tensor(buf, plan.world, plan.group_name)


def gather_launch(shards: Sequence[torch.Tensor], items: Sequence[ItemTensors | None], shared: Shared,
                  plan: BucketPlan) -> torch.Tensor:
    """All-reduce stage 2: re-encode this rank's reduced shards (transformed coordinates,
    `item_codec.reencode_item`) and start one all_gather of codes + scales (not yet waited);
    a two-level plan's over the cross-node group (stage 2)."""
    if plan.two_level:
        plan = plan.cross
    pieces = []
    for shard, state, item in zip(shards, items, plan.items):
        pieces.extend(reencode_item(shard, state, shared, item, plan))
    return _gather_send(pieces, shared, plan)


def _regather_launch(recv: torch.Tensor, items: Sequence[ItemTensors | None], shared: Shared,
                     plan: BucketPlan) -> torch.Tensor:
    """`finish(transformed=True)` then `gather_launch`, each item in ONE compiled body
    (`item_codec.reduce_reencode_stage`): decode, sum and re-encode share the body, so the fp32
    shard need not be written out between two bodies."""
    if plan.two_level:
        plan = plan.cross
    recv = _read_headers(recv, shared, plan)
    body_shared = _body_shared(shared, recv.device)
    offset = HEADER_BYTES
    pieces = []
    for state, item in zip(items, plan.items):
        cols, offset = _take(recv, offset, item_width(item, plan))
        body = compiled_bodies.body("reduce_reencode", reduce_reencode_stage, _key(item, state, plan))
        pieces.extend(body(cols, state, body_shared))
    return _gather_send(pieces, shared, plan)


def gather_finish(gathered: torch.Tensor, items: Sequence[ItemTensors | None], plan: BucketPlan, *,
                  shared: Shared, compiled: bool = False) -> list[torch.Tensor]:
    """Decode every rank's shard (the same bytes on every rank), inverse-transform, crop the
    padding (`item_codec.gather_decode_item`): full fp32 results, managed items as `[rows, cols]`,
    passthrough items flat. `compiled`: each item through its compiled body. A two-level plan
    decodes its node's chunks (stage 2) and gathers them inside the node (stage 3,
    `node_stage.node_gather`, counted in `shared`'s counters)."""
    if plan.two_level:
        chunks = gather_finish(gathered, items, plan.cross, shared=shared, compiled=compiled)
        outs, handed = node_gather(chunks, plan)
        _count(shared, handed, 0, 0, node=handed)
        return outs
    allb = gathered.reshape(plan.world, -1)
    offset = 0
    outs = []
    for state, item in zip(items, plan.items):
        if compiled:
            cols, offset = _take(allb, offset, item_width(item, plan))
            body = compiled_bodies.body("gather_decode", gather_decode_stage, _key(item, state, plan))
            outs.append(body(cols, state))
        else:
            out, offset = gather_decode_item(allb, offset, state, item, plan)
            outs.append(out)
    return outs


def _wait(t: torch.Tensor, plan: BucketPlan) -> torch.Tensor:
    return t if plan.group_name is None else _c10d.wait_tensor(t)  # a two-level plan spans ranks: it has one


def _headers(recv: torch.Tensor, plan: BucketPlan, shared: Shared) -> torch.Tensor:
    """`[world, 2]` int64: each rank's plan fingerprint and non-finite flag, as the headers
    say. A two-level plan's come from stage 2's node flags (`node_stage.node_rank_flags`):
    a rank flagged as mismatching gets a fingerprint other than this rank's."""
    if not plan.two_level:
        return _from_bytes(_take(recv.reshape(plan.world, -1), 0, HEADER_BYTES)[0], torch.int64)
    cross = plan.cross
    header = _from_bytes(_take(recv.reshape(cross.world, -1), 0, HEADER_BYTES)[0], torch.int64)
    nonfinite, mismatch = node_rank_flags(header, shared, cross)
    fingerprint = torch.full_like(nonfinite, plan.fingerprint(), dtype=torch.int64)
    return torch.stack([torch.where(mismatch, ~fingerprint, fingerprint), nonfinite.to(torch.int64)], dim=1)


def bucket_core(xs: Sequence[torch.Tensor], items: Sequence[ItemTensors | None], shared: Shared,
                plan: BucketPlan) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The whole collective in one traceable function: `(fp32 outputs, headers [world, 2] int64)`.

    Reduce-scatter outputs are shards, all-reduce outputs full tensors (see `finish` /
    `gather_finish`). The headers let an eager caller raise on every rank at once.
    """
    recv = _wait(launch(xs, items, shared, plan), plan)
    headers = _headers(recv, plan, shared)
    if plan.op is Collective.REDUCE_SCATTER:
        return finish(recv, items, shared, plan), headers
    shards = finish(recv, items, shared, plan, transformed=True)
    gathered = _wait(gather_launch(shards, items, shared, plan), plan)
    return gather_finish(gathered, items, plan, shared=shared), headers


def _compiled_bucket(xs: Sequence[torch.Tensor], items: Sequence[ItemTensors | None], shared: Shared,
                     plan: BucketPlan) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`bucket_core` with every item's codec in its compiled body and the glue (header, cat,
    collectives, counters) run eagerly: bit-identical to `bucket_core` (the tests check)."""
    recv = _wait(launch(xs, items, shared, plan, compiled=True), plan)
    headers = _headers(recv, plan, shared)
    if plan.op is Collective.REDUCE_SCATTER:
        return finish(recv, items, shared, plan, compiled=True), headers
    gathered = _wait(_regather_launch(recv, items, shared, plan), plan)
    return gather_finish(gathered, items, plan, shared=shared, compiled=True), headers


def run_bucket(xs: Sequence[torch.Tensor], items: Sequence[ItemTensors | None], shared: Shared, plan: BucketPlan,
               *, compiled: bool = False) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Eager entry point of one bucket: `bucket_core` op by op, or with each item's codec
    compiled (fused kernels; one compilation per distinct item plan and stage, whatever the
    bucket's pattern: `gift_compile.exchange.compiled_bodies`). Returns the outputs and the headers;
    callers without a GiftState check them with `raise_on_bad_headers`, stateful callers
    leave it to the counters (checked once per optimizer step, so the hot path never
    synchronizes the host).
    """
    with torch.no_grad():
        if compiled:
            return _compiled_bucket(list(xs), list(items), shared, plan)
        return bucket_core(list(xs), list(items), shared, plan)
