"""One item of a bucket exchange: the codec, as per-item traced functions.

`gift_compile.exchange.bucket` packs a bucket (header, one all_to_all, counters); everything that
depends on one gradient's plan lives here, item by item:

    encode_item         transform, block rotation (+ beta * EF residual) -> local scales -> encode
                        -> the item's blocks of the send buffer (one row per destination) and
                        its non-finite flag
    decode_item         decode every sender's block with that sender's scales, fp32 sum in rank
                        order, (average), un-rotation and inverse transform (or not: the
                        all-reduce's first stage)
    reencode_item       the all-reduce's second hop: re-encode this rank's reduced shard (+ the
                        owner's second-hop residual) into its all_gather bytes
    gather_decode_item  decode every rank's re-encoded shard, inverse transform, crop the padding

Why per item: a bucket's plan is the pattern of its items (which layers a selection put on
which path), and a model has as many patterns as blocks with different selections; an item's
plan is one of a few (shape, dtype, format, map) combinations. The traced bucket functions
(`exchange.launch`/`finish`/...) are loops over these functions, so a graph that holds a whole
bucket (the FX pass, `torch.compile` of `bucket_core`) fuses exactly what it fused before, and
the eager compiled path (`gift_compile.exchange.compiled_bodies`) compiles them one item plan at a time:
one implementation of the codec, two ways to run it.

The codec steps (scales, encode, decode, the decoded sum) go through `gift_compile.kernels`: on
CUDA, for the two-level and fp8 formats, explicit Triton kernels registered as operators, which a trace
keeps as operators (their traffic is theirs, not the installed Inductor's); elsewhere the
reference codec, compiled by Inductor as before. Both write the same bytes. A low-rank item whose
map and codec both run as kernels sends through `kernels.fused_sender` instead: the map's
expansion computed inside the block statistics and the encode, never written (`_fused_sender`
says when: no error feedback, no block rotation, a format whose words tile the kernels), and
its all-reduce receiver through `kernels.fused_receiver`: the inverse map's expansion decodes
the gathered codes instead of reading the decoded result back (`_fused_receiver`).

Every function takes its item's `ItemPlan` and a `BucketPlan` of which it reads the world
size, op and average only, so its code depends on nothing else the bucket holds; the compiled
stages (`encode_stage`, ...) take a single-item plan (`item_plan`), their key.

Why one module: the encoders and decoders are the two ends of one per-item wire format; the byte
layout the sender writes (`_as_bytes`, `_stored_codes`, `_scale_blocks`) is the one every receiver
parses (`_from_bytes`, `_parse_scales`), and keeping both ends in one file defines it once.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from gift_compile.codec import FormatSpec, scales_nonfinite
from gift_compile.codec import residual as residual_store
from gift_compile.codec.rotation import rotate, unrotate
from gift_compile.kernels import choose_scales_and_encode, decode, decode_sum
from gift_compile.exchange.accounting import _item_bytes_per_dest, _itemsize, _scale_layout
from gift_compile.exchange.plan import BucketPlan, ItemPlan
from gift_compile.geometry import apply_forward, apply_inverse, gated_tensors
from gift_compile.geometry.maps import LowRank, _traced
from gift_compile.geometry.table import map_class
from gift_compile.kernels.fused_receiver import decode_inverse_lowrank, receiver_path
from gift_compile.kernels.fused_sender import encode_lowrank, sender_path

RANK_SEED_STRIDE = 1_000_003
_ALL_GATHER_SEED = 7

__all__ = ["RANK_SEED_STRIDE", "ItemTensors", "Shared", "decode_item", "decode_stage", "encode_item", "encode_stage",
           "gather_decode_item", "gather_decode_stage", "item_plan", "item_width", "reduce_reencode_stage",
           "reencode_item", "shard_tensors"]


class ItemTensors(NamedTuple):
    """Runtime tensors of one managed item (`None` for a full-precision item).

    `seed_offset` (int64, 0-d) decorrelates the layer's stochastic rounding from other
    layers'; as data, not a plan constant, it lets equally shaped layers share one graph.
    Without it the plan's name-derived offset is used.

    A grouped item's (`ItemPlan.groups` = G > 1) `transform` holds its map kind's tensors each
    stacked on a leading dim of G (block e's map is row e of each; a gated plan's gate follows,
    0-d for the item or `[G]` one per block), its `probe` may be `[G, p, cols]` (each block's
    first rows), and its reduce-scatter receiver needs `shard_transform`.
    """

    transform: tuple[torch.Tensor, ...]
    residual: tuple[torch.Tensor, ...] | None = None  # the buffers of `gift_compile.codec.residual`
    probe: torch.Tensor | None = None
    seed_offset: torch.Tensor | None = None
    # the all-reduce's second hop: this rank's reduced shard's residual, `[rows_sent/world, cols]`
    second_hop_residual: tuple[torch.Tensor, ...] | None = None
    # a grouped item's (`ItemPlan.groups`) reduce-scatter receiver: the maps of this rank's
    # blocks (`shard_tensors`); None for every other item and path
    shard_transform: tuple[torch.Tensor, ...] | None = None


def shard_tensors(item: ItemPlan, transform: tuple[torch.Tensor, ...], rank: int,
                  world: int) -> tuple[torch.Tensor, ...]:
    """`ItemTensors.shard_transform` of a grouped item on group rank `rank`: views of the
    stacked tensors' rows `[rank * G/W, (rank + 1) * G/W)` (the blocks of the rows the
    reduce-scatter leaves on this rank), the gate of a gated plan passed through.

    Why the caller slices, not the codec: the plan must be the same on every rank (the header
    check compares plans, and a traced graph serves every rank), so the rank cannot be a plan
    constant; and slicing by the `Shared.rank` tensor inside the graph would gather (copy)
    the maps on every call. The caller knows its rank when it builds the item's runtime
    tensors, as it does for the rank's own `second_hop_residual`; the views follow refreshes
    of the stacked tensors in place, so they are built once."""
    per_rank = item.groups // world
    stacked = transform[:-1] if item.gated else transform
    views = tuple(t.narrow(0, rank * per_rank, per_rank) for t in stacked)
    if not item.gated:
        return views
    gate = transform[-1]
    return (*views, gate if gate.dim() == 0 else gate.narrow(0, rank * per_rank, per_rank))


def _map_tensors(item: ItemPlan, transform: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The tensors one map runs with: as carried, or, for a gated plan, computed from the
    layer's map and its path gate (the last tensor), so the selection is data in the graph."""
    return gated_tensors(item.kind, transform) if item.gated else transform


def _each_block_tensors(item: ItemPlan, transform: tuple[torch.Tensor, ...],
                        blocks: int) -> list[tuple[torch.Tensor, ...]]:
    """Each of `blocks` blocks' map tensors from a grouped item's stacked ones (row e of each),
    gated: a gated grouped plan carries after the stacked tensors either one 0-d bool for the
    whole item or one per block (`[blocks]`, block e's path gate: experts selected one by one),
    and each block runs its kind's own `gated` on its row with its gate, so every map kind gates
    stacked tensors exactly as it gates one layer's."""
    stacked = transform[:-1] if item.gated else transform
    gate = transform[-1] if item.gated else None
    for t in (*stacked, *(() if gate is None or gate.dim() == 0 else (gate,))):
        if t.dim() == 0 or t.shape[0] != blocks:
            raise ValueError(f"GIFT: grouped item {item.name}: a stacked map tensor has shape {tuple(t.shape)}, "
                             f"expected a leading dim of {blocks} blocks (groups={item.groups})")

    def gate_of(e: int) -> tuple[torch.Tensor, ...]:
        return () if gate is None else (gate if gate.dim() == 0 else gate[e],)

    return [_map_tensors(item, (*(t[e] for t in stacked), *gate_of(e))) for e in range(blocks)]


def _mapped(apply: Callable[..., torch.Tensor], item: ItemPlan, g: torch.Tensor, transform: tuple[torch.Tensor, ...],
            blocks: int) -> torch.Tensor:
    """`apply` (`apply_forward` or `apply_inverse`) of the item's map on `g`: one call, or for
    a grouped item one call per block of `g`'s rows (`blocks` of them: all the item's, or this
    rank's shard's) with that block's tensors, concatenated, so each block's result is bit for
    bit what that block alone, as an item of its own, gives."""
    if not item.block_maps:
        return apply(item.kind, g, _map_tensors(item, transform), item.map_precision)
    maps = _each_block_tensors(item, transform, blocks)
    return torch.cat([apply(item.kind, b, m, item.map_precision) for b, m in zip(g.split(g.shape[0] // blocks), maps)])


class Shared(NamedTuple):
    """Runtime tensors shared by every item of a GiftState.

    `seed` (int64, advanced once per optimizer step) and `rank` (int64, this process's rank in
    the group) drive stochastic rounding; `counters` (int64 [N_COUNTERS]) receives the byte
    counts and health flags. Any of them may be None for one-off calls.
    """

    seed: torch.Tensor | int = 0
    rank: torch.Tensor | int = 0
    counters: torch.Tensor | None = None


@functools.lru_cache(maxsize=4096)
def item_plan(item: ItemPlan, world: int, average: bool, op: str, anonymous: bool) -> BucketPlan:
    """The single-item plan a compiled body is keyed by and takes: `item` in a bucket of its
    own with no group (a body runs no collective). `anonymous` drops the name where no code
    reads it (a passthrough item, a managed item whose seed offset is a tensor), so equally
    shaped layers of different blocks share it. Memoised: eager callers build it for every
    item of every call, and a `BucketPlan` hashes its items when it is made. Never called
    inside a trace (traced callers pass the bucket's own plan and item)."""
    return BucketPlan((dataclasses.replace(item, name="") if anonymous else item,), world, None, average, op)


def item_width(item: ItemPlan, p: BucketPlan) -> int:
    """Bytes of the item's block that one destination receives (an all_to_all) or one rank
    sends (the all-reduce's all_gather): codes and scales of `rows_sent / world` rows, or the
    raw bytes of a passthrough item's `flat_sent / world` elements."""
    if not item.managed:
        return p.flat_sent(item) // p.world * _itemsize(item.torch_dtype)
    return _item_bytes_per_dest(item.spec, p.rows_sent(item) // p.world, item.cols)


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
    # `select`, not `b[..., i]`: the same op in the graph, but the ellipsis index does not trace on
    # fake CUDA tensors in a CPU-only torch (bench.fidelity.kernel_traffic traces the fp32 scales' parse)
    word = b.select(-1, 0)
    for i in range(1, size):
        word = word | (b.select(-1, i) << (8 * i))
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


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else torch.nn.functional.pad(x, (0, 0, 0, rows - x.shape[0]))


def _pad_flat(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if x.shape[0] == n else torch.nn.functional.pad(x, (0, n - x.shape[0]))


def _decayed(item: ItemPlan, e: torch.Tensor) -> torch.Tensor:
    """`beta * e` (`ItemPlan.error_feedback_decay`, a plan constant); plain error feedback
    (beta = 1) adds the residual itself, so its bits are what they were before decay existed."""
    return e if item.error_feedback_decay == 1.0 else e * item.error_feedback_decay


def _to_code_axes(item: ItemPlan, g: torch.Tensor) -> torch.Tensor:
    """The mapped gradient on the axes its codes are written on: rotated inside each scale
    block with `block_rotation` (`gift_compile.codec.rotation`), as it is otherwise. The
    residual, the scales and the all-reduce's second hop all live on these axes."""
    return rotate(g, item.spec.block) if item.block_rotation else g


def _to_original(item: ItemPlan, total: torch.Tensor, transform: tuple[torch.Tensor, ...],
                 blocks: int) -> torch.Tensor:
    """A decoded sum on the code axes back in the gradient's coordinates: un-rotated, then the
    map's inverse (a grouped item's `blocks` blocks each with its own)."""
    if item.block_rotation:
        total = unrotate(total, item.spec.block)
    return _mapped(apply_inverse, item, total, transform, blocks)


def _shard_transform(item: ItemPlan, state: ItemTensors, p: BucketPlan) -> tuple[tuple[torch.Tensor, ...], int]:
    """The map tensors of the rows a reduce-scatter leaves on this rank and their block count:
    the item's own, or a grouped item's `shard_transform` (its G/W blocks)."""
    if not item.block_maps:
        return state.transform, 1
    if state.shard_transform is None:
        raise ValueError(f"GIFT: grouped item {item.name} (groups={item.groups}) needs ItemTensors.shard_transform, "
                         "the maps of this rank's blocks (`shard_tensors`), to decode its reduce-scatter shard")
    return state.shard_transform, item.groups // p.world


def _take(recv: torch.Tensor, offset: int, n: int) -> tuple[torch.Tensor, int]:
    """Columns `[offset, offset + n)` of every sender's block, as a dense `[world, n]` copy
    (a clone, not `contiguous()`: with one sender the slice already counts as contiguous
    but keeps the parent's row stride, which a dtype view cannot reinterpret)."""
    return recv.narrow(1, offset, n).clone(memory_format=torch.contiguous_format), offset + n


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
        # read back (0.5 B per gradient element for NVFP4; `bench.fidelity.codec_minimum`).
        tscale = raw.view(torch.float32).reshape(w, 1, 1)
    return scales, tscale, offset


def _fused_sender(item: ItemPlan, state: ItemTensors, g: torch.Tensor) -> str | None:
    """The map precision at which a low-rank item's sender runs fused (`kernels.fused_sender`:
    the map inside the block statistics and the encode, the mapped gradient never written), or
    None where it runs the unfused chain: a static choice from the plan and the device. A grouped
    item (`ItemPlan.groups`) always runs the chain: the kernels take one map per item."""
    if not issubclass(map_class(item.kind), LowRank) or item.spec.passthrough or item.groups > 1:
        return None
    path = sender_path(item.spec, g.device, item.map_precision, item.stochastic_rounding, state.residual is not None,
                       item.block_rotation)
    return path.precision if path.fused else None


def _fused_receiver(item: ItemPlan, payload: torch.Tensor) -> str | None:
    """The map precision at which a low-rank item's all-reduce receiver runs fused
    (`kernels.fused_receiver`: the inverse map's expansion decodes the gathered codes instead
    of reading the decoded result back), or None where it runs the unfused chain: a static
    choice from the plan and the device; a grouped item always runs the chain, as its sender."""
    if not issubclass(map_class(item.kind), LowRank) or item.spec.passthrough or item.groups > 1:
        return None
    path = receiver_path(item.spec, payload.device, item.map_precision, item.block_rotation)
    return path.precision if path.fused else None


def _copy_probe(item: ItemPlan, probe: torch.Tensor, g: torch.Tensor) -> None:
    """Keep the gradient's first rows in `probe` (what a refresh measures the maps on): `[p, cols]`
    for the item, or for a grouped item `[G, p, cols]`, each block's first `p` rows (each
    expert's map is measured on its own rows)."""
    if probe.dim() == 3:
        if probe.shape[0] != item.groups:
            raise ValueError(f"GIFT: grouped item {item.name}: probe {tuple(probe.shape)} has {probe.shape[0]} "
                             f"blocks, the item {item.groups}")
        probe.copy_(g.reshape(item.groups, -1, item.cols)[:, : probe.shape[1]])
    else:
        probe.copy_(g[: probe.shape[0]])


# ---- the per-item codec ---------------------------------------------------------------------
def encode_item(x: torch.Tensor, state: ItemTensors | None, shared: Shared, item: ItemPlan,
                p: BucketPlan) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The item's blocks of the send buffer (uint8, `[world, *]` each, row j for rank j: codes,
    then scales) and whether it holds NaN/Inf (bool, 0-d). Updates the item's error-feedback
    residual and gradient probe in place.

    Blocks, not one concatenated block: the caller concatenates every item's blocks with the
    header in one `cat`, so a graph holding the bucket writes each block once into the send
    buffer (a `cat` of `cat`s would copy the codes twice)."""
    w = p.world
    if not item.managed:
        flat = x.reshape(-1)
        bad = ~torch.isfinite(flat).all()  # read in the same kernel as the byte copy once fused
        return [_as_bytes(_pad_flat(flat, p.flat_sent(item))).reshape(w, -1)], bad
    assert state is not None, f"GIFT: no runtime tensors for managed item {item.name}"
    spec, rows = item.spec, p.rows_sent(item)
    g = x.reshape(item.rows, item.cols)
    if state.probe is not None:
        _copy_probe(item, state.probe, g)
    g = _pad_rows(g.float(), rows)
    fused = _fused_sender(item, state, g)
    if fused is not None:
        scales, tscale, codes = encode_lowrank(g, *LowRank.forward_operands(_map_tensors(item, state.transform)),
                                               fused, spec)
        return ([_stored_codes(codes, spec).reshape(w, -1), *_scale_blocks(spec, item.cols, scales, tscale, w)],
                scales_nonfinite(spec, scales, tscale))
    g = _to_code_axes(item, _mapped(apply_forward, item, g, state.transform, item.groups))
    if state.residual is not None:
        e = residual_store.read(item.residual_format, state.residual, item.cols)
        if e.shape[0] != item.rows:  # a residual sized for another layout must not be cropped or padded silently
            raise ValueError(f"GIFT: {item.name}: error-feedback residual has {e.shape[0]} rows, the item sends "
                             f"{item.rows} (a two-level exchange keeps it for the node's chunk: "
                             "node_stage.residual_rows)")
        g = g + _pad_rows(_decayed(item, e), rows)
    sr = item.stochastic_rounding and spec.family.rounds  # an fp32 layer (`layer_formats`) has nothing to round
    seed = _rank_seed(shared, item, state) if sr else 0
    # one call: where a kernel can choose the scales while it encodes (fp8 per row or block),
    # g is read once
    scales, tscale, codes = choose_scales_and_encode(g, spec, stochastic_rounding=sr, seed=seed)
    # the flag read off the scales: a separate `all` over g would cost one more full read
    # of g (and, with a map, a materialised g)
    bad = ~torch.isfinite(g).all() if spec.passthrough else scales_nonfinite(spec, scales, tscale)
    if state.residual is not None:
        new = g - decode(codes, spec, scales, tscale, item.cols)
        residual_store.write(item.residual_format, state.residual, new[: item.rows])
    return [_stored_codes(codes, spec).reshape(w, -1), *_scale_blocks(spec, item.cols, scales, tscale, w)], bad


def decode_item(recv: torch.Tensor, offset: int, state: ItemTensors | None, item: ItemPlan, p: BucketPlan,
                transformed: bool = False) -> tuple[torch.Tensor, int]:
    """Decode and sum the item's block of every sender: columns `[offset, offset + item_width)`
    of `recv` (`[world, *]` uint8, the waited all_to_all output). Returns the fp32 result and
    the offset past the item: a managed item's `[rows_sent/world, cols]` shard (in the item's
    original coordinates, or still transformed with `transformed=True`, which the all-reduce's
    second stage needs), a passthrough item's flat shard."""
    w = p.world
    if not item.managed:
        raw, offset = _take(recv, offset, p.flat_sent(item) // w * _itemsize(item.torch_dtype))
        values = _from_bytes(raw, item.torch_dtype).float()
        return (values / w if p.average else values).sum(dim=0), offset  # each share first: no overflow
    spec, r = item.spec, p.rows_sent(item) // w
    payload, offset = _take(recv, offset, r * spec.payload_cols(item.cols))
    scales, tscale, offset = _parse_scales(recv, offset, spec, item.cols, r)
    total = decode_sum(payload.reshape(w, r, -1), spec, scales, tscale, item.cols, p.average)
    if transformed:
        return total, offset
    return _to_original(item, total, *_shard_transform(item, state, p)), offset


def reencode_item(shard: torch.Tensor, state: ItemTensors | None, shared: Shared, item: ItemPlan,
                  p: BucketPlan) -> list[torch.Tensor]:
    """All-reduce stage 2: this rank's reduced shard (transformed coordinates) re-encoded with
    local scales, as flat uint8 pieces of the all_gather input (codes, then scales). With
    second-hop error feedback the owner's residual is added first and the new one kept."""
    if not item.managed:
        return [_as_bytes(shard.to(item.torch_dtype)).reshape(-1)]
    spec = item.spec
    residual = state.second_hop_residual if item.second_hop_error_feedback else None
    if item.second_hop_error_feedback:
        if residual is None:
            raise ValueError(f"GIFT: {item.name} has second-hop error feedback but no second-hop residual tensors")
        e = residual_store.read(item.residual_format, residual, item.cols)
        if e.shape != shard.shape:
            raise ValueError(f"GIFT: {item.name}: second-hop residual {tuple(e.shape)} != this rank's shard "
                             f"{tuple(shard.shape)} (rows padded to a multiple of the world size {p.world}, / world)")
        shard = shard + _decayed(item, e)
    sr = item.stochastic_rounding and spec.family.rounds
    seed = _rank_seed(shared, item, state, _ALL_GATHER_SEED) if sr else 0
    scales, tscale, codes = choose_scales_and_encode(shard, spec, stochastic_rounding=sr, seed=seed)
    if residual is not None:
        residual_store.write(item.residual_format, residual, shard - decode(codes, spec, scales, tscale, item.cols))
    return [_stored_codes(codes, spec).reshape(-1), *(b.reshape(-1) for b in _scale_blocks(spec, item.cols, scales,
                                                                                           tscale, 1))]


def gather_decode_item(gathered: torch.Tensor, offset: int, state: ItemTensors | None, item: ItemPlan,
                       p: BucketPlan) -> tuple[torch.Tensor, int]:
    """Decode every rank's re-encoded shard of the item (columns `[offset, offset + item_width)`
    of `gathered`, `[world, *]`; the same bytes on every rank), inverse-transform, crop the
    padding: the full fp32 result, `[rows, cols]` for a managed item, flat for a passthrough
    one; and the offset past the item."""
    w = p.world
    if not item.managed:
        raw, offset = _take(gathered, offset, p.flat_sent(item) // w * _itemsize(item.torch_dtype))
        return _from_bytes(raw, item.torch_dtype).reshape(-1)[: item.numel].float(), offset
    spec, r = item.spec, p.rows_sent(item) // w
    payload, offset = _take(gathered, offset, r * spec.payload_cols(item.cols))
    scales, tscale, offset = _parse_scales(gathered, offset, spec, item.cols, r)
    payload = payload.reshape(w, r, -1)
    fused = _fused_receiver(item, payload)
    if fused is not None:
        full = decode_inverse_lowrank(payload, scales, tscale,
                                      *LowRank.inverse_operands(_map_tensors(item, state.transform)), fused, spec,
                                      item.cols)
        return full.narrow(0, 0, item.rows), offset
    full = decode(payload, spec, scales, tscale, item.cols).reshape(w * r, item.cols)
    return _to_original(item, full, state.transform, item.groups).narrow(0, 0, item.rows), offset


# ---- compiled stages: a single-item plan `p` (`item_plan`) as the last argument -----------------
def encode_stage(x: torch.Tensor, state: ItemTensors | None, shared: Shared,
                 p: BucketPlan) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`encode_item` of `p`'s item."""
    return encode_item(x, state, shared, p.items[0], p)


def decode_stage(cols: torch.Tensor, state: ItemTensors | None, p: BucketPlan) -> torch.Tensor:
    """`decode_item` of `p`'s item from its own columns (`[world, item_width]`)."""
    return decode_item(cols, 0, state, p.items[0], p)[0]


def reduce_reencode_stage(cols: torch.Tensor, state: ItemTensors | None, shared: Shared,
                          p: BucketPlan) -> list[torch.Tensor]:
    """The all-reduce's middle for one item, from its own received columns: decode and sum in
    transformed coordinates, then `reencode_item`, in one body (the fp32 shard is not written
    out between two bodies where the codec fuses, as inside a graph of the whole bucket)."""
    item = p.items[0]
    return reencode_item(decode_item(cols, 0, state, item, p, transformed=True)[0], state, shared, item, p)


def gather_decode_stage(cols: torch.Tensor, state: ItemTensors | None, p: BucketPlan) -> torch.Tensor:
    """`gather_decode_item` of `p`'s item from its own columns."""
    return gather_decode_item(cols, 0, state, p.items[0], p)[0]
