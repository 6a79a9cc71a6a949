"""The bucket exchange at the heart of every GIFT collective, built from `torch.ops._c10d_functional` ops.

One bucket (a framework's bucketed reduce-scatter, an FSDP2 module's flat buffer, a DDP bucket,
or a single weight) becomes ONE all_to_all of bytes:

    per managed item: transform (+ beta * EF residual) -> local scales -> encode -> row block j of the
                      codes and of their scales goes to rank j
    per other item:   raw bytes of row block j go to rank j
    + a 16-byte header to every rank: the bucket plan's fingerprint and a non-finite flag
      (set when any item of the bucket, managed or passed through, holds NaN/Inf)
    -> all_to_all_single (uint8)
    -> per item: decode every sender's block with that sender's scales, sum in fp32 in rank
       order, (average), inverse transform

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

This module is the traced exchange itself (`launch`/`finish`/`gather_launch`/`gather_finish`,
`bucket_core`, `run_bucket`, the counter slots); `gift_compile.collectives` is what callers use
(the flat-buffer helper `sync_buffer` and the one-tensor API) and re-exports all of it. The
shape-based accounting lives in `gift_compile.accounting`, the eager cross-rank checks in
`gift_compile.agreement`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from gift_compile.accounting import HEADER_BYTES, _itemsize, _scale_layout
from gift_compile.formats import FormatSpec, choose_scales, decode, encode, scales_nonfinite
from gift_compile import residual as residual_store
from gift_compile.geometry import apply_forward, apply_inverse
from gift_compile.maps import _traced
from gift_compile.plan import BucketPlan, ItemPlan

logger = logging.getLogger("gift_compile")

_c10d = torch.ops._c10d_functional
RANK_SEED_STRIDE = 1_000_003
_ALL_GATHER_SEED = 7

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
N_COUNTERS = 8
RANK_BITS = 62

__all__ = [
    "C_BASELINE", "C_CALLS", "C_MISMATCH", "C_MISMATCH_RANKS", "C_NONFINITE", "C_NONFINITE_RANKS", "C_PLAIN_CALLS",
    "C_WIRE", "N_COUNTERS", "RANK_BITS", "ItemTensors", "Shared", "bucket_core", "finish", "flagged_ranks",
    "gather_finish", "gather_launch", "group_info", "launch", "run_bucket",
]


class ItemTensors(NamedTuple):
    """Runtime tensors of one managed item (`None` for a full-precision item).

    `seed_offset` (int64, 0-d) decorrelates the layer's stochastic rounding from other
    layers'; as data, not a plan constant, it lets equally shaped layers share one graph.
    Without it the plan's name-derived offset is used.
    """

    transform: tuple[torch.Tensor, ...]
    residual: tuple[torch.Tensor, ...] | None = None  # the buffers of `gift_compile.residual`
    probe: torch.Tensor | None = None
    seed_offset: torch.Tensor | None = None
    # the all-reduce's second hop: this rank's reduced shard's residual, `[rows_sent/world, cols]`
    second_hop_residual: tuple[torch.Tensor, ...] | None = None


class Shared(NamedTuple):
    """Runtime tensors shared by every item of a GiftState.

    `seed` (int64, advanced once per optimizer step) and `rank` (int64, this process's rank in
    the group) drive stochastic rounding; `counters` (int64 [N_COUNTERS]) receives the byte
    counts and health flags. Any of them may be None for one-off calls.
    """

    seed: torch.Tensor | int = 0
    rank: torch.Tensor | int = 0
    counters: torch.Tensor | None = None


def group_info(group: dist.ProcessGroup | str | None) -> tuple[str | None, int, int]:
    """`(group_name, world_size, rank)`; `None` or a one-rank group means no communication."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return None, 1, 0
    pg = dist.distributed_c10d._resolve_process_group(group) if isinstance(group, str) else group
    world = dist.get_world_size(pg)
    if world == 1:
        return None, 1, 0
    return pg.group_name, world, dist.get_rank(pg)


# ---- encode side ----------------------------------------------------------------------------
_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes, uint8 `[..., n * itemsize]` for `t` `[..., n]`, in the little-endian order
    `t.view(torch.uint8)` gives on every host torch supports.

    Traced, it is spelled as a same-width bitcast and shifts: a pointwise expression that
    Inductor fuses into the kernel writing the send buffer. A size-changing dtype view is an
    extern kernel that needs its input in memory, which also turns the buffer's `cat` into a
    copy of every block (codes included) instead of writing each block in place. Eager
    calls take the view itself (one copy, where the shifts would be several full passes
    over a large full-precision item); both give the same bytes.
    """
    size = t.element_size()
    if size == 1:
        return t.view(torch.uint8)
    if not _traced(t):
        return t.contiguous().view(torch.uint8)
    ints = t.view(_INT_OF_SIZE[size])
    shifts = torch.arange(size, dtype=ints.dtype, device=t.device) * 8
    return ((ints.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8).reshape(*t.shape[:-1], t.shape[-1] * size)


def _stored_codes(codes: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """`codes` (uint8) as a pointwise expression of their own where they are a dtype view.

    fp8 codes are a bitcast view of the encoder's float8 values; a `cat` that meets a view
    copies it into a buffer before concatenating (one more write and read of every code),
    while a pointwise uint8 result is stored by the encode kernel itself (`| 0` changes no
    bit). Packed 4/2-bit codes are pointwise already, and the raw bytes of fp32/bf16 are a
    size-changing view (an extern kernel), which a pointwise op would copy once more.
    """
    return codes | 0 if spec.float8_codes else codes


def _from_bytes(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `_as_bytes`: uint8 `[..., n * itemsize]` -> `dtype` `[..., n]`; traced, by
    shifts and a same-width bitcast (pointwise, so the consumer's kernel reads the bytes
    directly), eagerly by the dtype view."""
    size = torch.empty((), dtype=dtype).element_size()
    if size == 1:
        return raw.view(dtype)
    if not _traced(raw):
        return raw.contiguous().view(dtype)
    itype = _INT_OF_SIZE[size]
    b = raw.reshape(*raw.shape[:-1], raw.shape[-1] // size, size).to(itype)
    word = b[..., 0]
    for i in range(1, size):
        word = word | (b[..., i] << (8 * i))
    return word.view(dtype)


def _scale_blocks(spec: FormatSpec, cols: int, scales: torch.Tensor, tscale: torch.Tensor | None,
                  world: int) -> list[torch.Tensor]:
    """Scale bytes, one row per destination: each rank receives the scales of its rows (or a
    copy of the per-tensor scale)."""
    per_row, sdtype, _, _ = _scale_layout(spec, cols)
    out = []
    if sdtype is not None:
        b = _as_bytes(scales.reshape(scales.shape[0], -1) if per_row else scales.reshape(1, -1))
        out.append(b.reshape(world, -1) if per_row else b.reshape(1, -1).expand(world, -1))
    if tscale is not None:
        out.append(_as_bytes(tscale.reshape(1)).reshape(1, -1).expand(world, -1))
    return out


def _rank_seed(shared: Shared, item: ItemPlan, state: ItemTensors, extra: int = 0) -> torch.Tensor | int:
    offset = item.seed_offset if state.seed_offset is None else state.seed_offset
    return shared.seed + offset + shared.rank * RANK_SEED_STRIDE + extra


def _count(shared: Shared, wire: int, baseline: int, calls: int, nonfinite: torch.Tensor | int = 0,
           mismatch: torch.Tensor | int = 0) -> None:
    """Add to the counters in one in-place op (no tensor constants: graph-spliceable)."""
    c = shared.counters
    if c is None:
        return
    idx = torch.arange(c.shape[0], device=c.device)
    delta = ((idx == C_WIRE) * wire + (idx == C_BASELINE) * baseline + (idx == C_CALLS) * calls
             + (idx == C_NONFINITE) * nonfinite + (idx == C_MISMATCH) * mismatch)
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


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else torch.nn.functional.pad(x, (0, 0, 0, rows - x.shape[0]))


def _pad_flat(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if x.shape[0] == n else torch.nn.functional.pad(x, (0, n - x.shape[0]))


def launch(xs: Sequence[torch.Tensor], items: Sequence[ItemTensors | None], shared: Shared,
           plan: BucketPlan) -> torch.Tensor:
    """Encode every item, pack one block per destination and start the all_to_all.

    Returns the collective's (not yet waited) output `[world * N]` uint8, or the packed input
    itself on one rank. Updates error-feedback residuals, gradient probes and the counters.
    """
    w = plan.world
    blocks: list[torch.Tensor] = []
    nonfinite = None
    baseline = 0
    for x, state, item in zip(xs, items, plan.items):
        baseline += x.numel() * x.element_size()
        if not item.managed:
            flat = x.reshape(-1)
            bad = ~torch.isfinite(flat).all()  # read in the same kernel as the byte copy once fused
            nonfinite = bad if nonfinite is None else nonfinite | bad
            blocks.append(_as_bytes(_pad_flat(flat, plan.flat_sent(item))).reshape(w, -1))
            continue
        assert state is not None, f"GIFT: no runtime tensors for managed item {item.name}"
        spec, rows = item.spec, plan.rows_sent(item)
        g = x.reshape(item.rows, item.cols)
        if state.probe is not None:
            state.probe.copy_(g[: state.probe.shape[0]])
        g = apply_forward(item.kind, _pad_rows(g.float(), rows), state.transform)
        if state.residual is not None:
            g = g + _pad_rows(_decayed(item, residual_store.read(item.residual_format, state.residual, item.cols)), rows)
        scales, tscale = choose_scales(g, spec)
        # the flag read off the scales: a separate `all` over g would cost one more full read
        # of g (and, with a map, a materialised g)
        bad = ~torch.isfinite(g).all() if spec.passthrough else scales_nonfinite(spec, scales, tscale)
        nonfinite = bad if nonfinite is None else nonfinite | bad
        seed = _rank_seed(shared, item, state) if item.stochastic_rounding else 0
        codes = encode(g, spec, scales, tscale, stochastic_rounding=item.stochastic_rounding, seed=seed)
        if state.residual is not None:
            new = g - decode(codes, spec, scales, tscale, item.cols)
            residual_store.write(item.residual_format, state.residual, new[: item.rows])
        blocks.append(_stored_codes(codes, spec).reshape(w, -1))
        blocks.extend(_scale_blocks(spec, item.cols, scales, tscale, w))
    flag = torch.zeros((), dtype=torch.int64, device=xs[0].device) if nonfinite is None else nonfinite.to(torch.int64)
    header = torch.stack([torch.full_like(flag, plan.fingerprint()), flag])
    blocks.insert(0, _as_bytes(header).reshape(1, -1).expand(w, -1))
    send = torch.cat(blocks, dim=1)
    _count(shared, send.numel(), baseline, 1)
    if plan.group_name is None:
        return send.reshape(-1)
    n = send.shape[1]
    return _c10d.all_to_all_single(send.reshape(-1), [n] * w, [n] * w, plan.group_name)


def _decayed(item: ItemPlan, e: torch.Tensor) -> torch.Tensor:
    """`beta * e` (`ItemPlan.error_feedback_decay`, a plan constant); plain error feedback
    (beta = 1) adds the residual itself, so its bits are what they were before decay existed."""
    return e if item.error_feedback_decay == 1.0 else e * item.error_feedback_decay


def _take(recv: torch.Tensor, offset: int, n: int) -> tuple[torch.Tensor, int]:
    """Columns `[offset, offset + n)` of every sender's block, as a dense `[world, n]` copy
    (a clone, not `contiguous()`: with one sender the slice already counts as contiguous
    but keeps the parent's row stride, which a dtype view cannot reinterpret)."""
    return recv[:, offset:offset + n].clone(memory_format=torch.contiguous_format), offset + n


def _parse_scales(recv: torch.Tensor, offset: int, spec: FormatSpec, cols: int,
                  rows: int) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """Scales of every sender for a `rows`-row block: shaped for `decode` with a sender dim."""
    per_row, sdtype, count, has_t = _scale_layout(spec, cols)
    w = recv.shape[0]
    scales = tscale = None
    if sdtype is not None:
        n = (rows * count if per_row else count) * _itemsize(sdtype)
        raw, offset = _take(recv, offset, n)
        s = _from_bytes(raw, sdtype)
        if per_row:
            scales = s.reshape(w, rows) if count == 1 and spec.block is None else s.reshape(w, rows, count)
        else:
            scales = s.reshape(w, 1, 1)
    if has_t:
        raw, offset = _take(recv, offset, 4)
        # The dtype view, not `_from_bytes`'s shifts: the view is an extern kernel over these
        # 4 bytes per sender, so the tensor scale reaches the decode as one realised fp32
        # value. Spelled as shifts, its 4 byte loads count as reads of every block scale
        # that multiplies it (and the decoded values), past Inductor's limit for a pointwise
        # value with several users, and the unit of every block is written out at fp32 and
        # read back (0.5 B per gradient element for NVFP4; `bench.codec_minimum`).
        tscale = raw.view(torch.float32).reshape(w, 1, 1)
    return scales, tscale, offset


def finish(recv: torch.Tensor, items: Sequence[ItemTensors | None], shared: Shared, plan: BucketPlan, *,
           transformed: bool = False) -> list[torch.Tensor]:
    """Decode and sum what `launch`'s all_to_all delivered (already waited).

    Returns one fp32 tensor per item: a managed item's `[rows_sent/world, cols]` shard (in the
    item's original coordinates, or still transformed with `transformed=True`, which the
    all-reduce's second stage needs), a passthrough item's flat shard. Reads the headers: a
    plan mismatch or a non-finite gradient on any rank is added to the counters.
    """
    w = plan.world
    recv = recv.reshape(w, -1)
    header = _from_bytes(_take(recv, 0, HEADER_BYTES)[0], torch.int64)  # [w, 2]
    mismatch = header[:, 0] != plan.fingerprint()
    nonfinite = header[:, 1] != 0
    _count(shared, 0, 0, 0, nonfinite.any().to(torch.int64), mismatch.any().to(torch.int64))
    _flag_ranks(shared, nonfinite, mismatch)
    offset = HEADER_BYTES
    outs = []
    for state, item in zip(items, plan.items):
        if not item.managed:
            per = plan.flat_sent(item) // w
            raw, offset = _take(recv, offset, per * _itemsize(item.torch_dtype))
            total = _from_bytes(raw, item.torch_dtype).float().sum(dim=0)
            outs.append(total / w if plan.average else total)
            continue
        spec, r = item.spec, plan.rows_sent(item) // w
        payload, offset = _take(recv, offset, r * spec.payload_cols(item.cols))
        scales, tscale, offset = _parse_scales(recv, offset, spec, item.cols, r)
        parts = decode(payload.reshape(w, r, -1), spec, scales, tscale, item.cols)
        total = parts.sum(dim=0)
        if plan.average:
            total = total / w
        outs.append(total if transformed else apply_inverse(item.kind, total, state.transform))
    return outs


def gather_launch(shards: Sequence[torch.Tensor], items: Sequence[ItemTensors | None], shared: Shared,
                  plan: BucketPlan) -> torch.Tensor:
    """All-reduce stage 2: re-encode this rank's reduced shards (transformed coordinates) with
    local scales and start one all_gather of codes + scales (not yet waited). Items with
    second-hop error feedback add their owner's residual first and keep the new one."""
    pieces = []
    for shard, state, item in zip(shards, items, plan.items):
        if not item.managed:
            pieces.append(_as_bytes(shard.to(item.torch_dtype)).reshape(-1))
            continue
        spec = item.spec
        residual = state.second_hop_residual if item.second_hop_error_feedback else None
        if item.second_hop_error_feedback:
            if residual is None:
                raise ValueError(f"GIFT: {item.name} has second-hop error feedback but no second-hop residual tensors")
            e = residual_store.read(item.residual_format, residual, item.cols)
            if e.shape != shard.shape:
                raise ValueError(f"GIFT: {item.name}: second-hop residual {tuple(e.shape)} != this rank's shard "
                                 f"{tuple(shard.shape)} (rows padded to a multiple of the world size {plan.world}, / world)")
            shard = shard + _decayed(item, e)
        scales, tscale = choose_scales(shard, spec)
        seed = _rank_seed(shared, item, state, _ALL_GATHER_SEED) if item.stochastic_rounding else 0
        codes = encode(shard, spec, scales, tscale, stochastic_rounding=item.stochastic_rounding, seed=seed)
        if residual is not None:
            residual_store.write(item.residual_format, residual, shard - decode(codes, spec, scales, tscale, item.cols))
        pieces.append(_stored_codes(codes, spec).reshape(-1))
        pieces.extend(b.reshape(-1) for b in _scale_blocks(spec, item.cols, scales, tscale, 1))
    buf = torch.cat(pieces)
    _count(shared, buf.numel(), 0, 0)
    if plan.group_name is None:
        return buf
    return _c10d.all_gather_into_tensor(buf, plan.world, plan.group_name)


def gather_finish(gathered: torch.Tensor, items: Sequence[ItemTensors | None], plan: BucketPlan) -> list[torch.Tensor]:
    """Decode every rank's shard (the same bytes on every rank), inverse-transform, crop the
    padding: full fp32 results, managed items as `[rows, cols]`, passthrough items flat."""
    w = plan.world
    allb = gathered.reshape(w, -1)
    offset = 0
    outs = []
    for state, item in zip(items, plan.items):
        if not item.managed:
            per = plan.flat_sent(item) // w
            raw, offset = _take(allb, offset, per * _itemsize(item.torch_dtype))
            outs.append(_from_bytes(raw, item.torch_dtype).reshape(-1)[: item.numel].float())
            continue
        spec, r = item.spec, plan.rows_sent(item) // w
        payload, offset = _take(allb, offset, r * spec.payload_cols(item.cols))
        scales, tscale, offset = _parse_scales(allb, offset, spec, item.cols, r)
        full = decode(payload.reshape(w, r, -1), spec, scales, tscale, item.cols).reshape(w * r, item.cols)
        outs.append(apply_inverse(item.kind, full, state.transform)[: item.rows])
    return outs


def _wait(t: torch.Tensor, plan: BucketPlan) -> torch.Tensor:
    return t if plan.group_name is None else _c10d.wait_tensor(t)


def bucket_core(xs: Sequence[torch.Tensor], items: Sequence[ItemTensors | None], shared: Shared,
                plan: BucketPlan) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The whole collective in one function: `(fp32 outputs, headers [world, 2] int64)`.

    Reduce-scatter outputs are shards, all-reduce outputs full tensors (see `finish` /
    `gather_finish`). The headers let an eager caller raise on every rank at once.
    """
    recv = _wait(launch(xs, items, shared, plan), plan)
    headers = _from_bytes(_take(recv.reshape(plan.world, -1), 0, HEADER_BYTES)[0], torch.int64)
    if plan.op == "reduce_scatter":
        return finish(recv, items, shared, plan), headers
    shards = finish(recv, items, shared, plan, transformed=True)
    gathered = _wait(gather_launch(shards, items, shared, plan), plan)
    return gather_finish(gathered, items, plan), headers


@functools.cache
def _compiled_core() -> object:
    """`bucket_core` under `torch.compile(fullgraph=True, dynamic=False)`: one graph per plan
    (the plan is a frozen, hashable dataclass), tensors as inputs."""
    return torch.compile(bucket_core, fullgraph=True, dynamic=False)



def run_bucket(xs: Sequence[torch.Tensor], items: Sequence[ItemTensors | None], shared: Shared, plan: BucketPlan,
               *, compiled: bool = False) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Eager entry point of one bucket: `bucket_core`, op by op or compiled (fused kernels).

    `compiled` runs it through `torch.compile` (one compile per plan). Returns the outputs and
    the headers; callers without a GiftState check them with `raise_on_bad_headers`, stateful
    callers leave it to the counters (checked once per optimizer step, so the hot path never
    synchronizes the host).
    """
    if compiled:
        return _run_compiled(xs, items, shared, plan)
    with torch.no_grad():
        return bucket_core(list(xs), list(items), shared, plan)


def _graph_plan(plan: BucketPlan, items: Sequence[ItemTensors | None]) -> BucketPlan:
    """The plan the compiled core specialises on: item names dropped where no code reads them
    (passthrough items, managed items with a seed-offset tensor), so equally shaped buckets of
    different blocks share one graph instead of one compile each (Dynamo's recompile limit).
    Eager callers agree on the full plan, names and order included, before they launch
    (`check_plan_agreement`); the header then guards shapes and formats."""
    anonymous = tuple(
        dataclasses.replace(item, name="") if not item.managed or (t is not None and t.seed_offset is not None) else item
        for item, t in zip(plan.items, items))
    return dataclasses.replace(plan, items=anonymous)


def _run_compiled(xs: Sequence[torch.Tensor], items: Sequence[ItemTensors | None], shared: Shared,
                  plan: BucketPlan) -> tuple[list[torch.Tensor], torch.Tensor]:
    with torch.no_grad():
        return _compiled_core()(list(xs), list(items), shared, _graph_plan(plan, items))
