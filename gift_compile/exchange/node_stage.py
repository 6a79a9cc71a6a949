"""The inside-node stages of a two-level exchange (`BucketPlan.two_level`), and its headers.

A bucket over `W = n x g` ranks (n nodes of g, `gift_compile.exchange.topology`) runs as

    stage 1, inside the node (`node_reduce`): every item's rows are cut into the W shards of the
        one-level exchange; the g ranks of a node reduce-scatter them natively, at the gradient's
        dtype or at bf16 (`GiftConfig.intra_node_format`, `NodeLayout.node_dtype`; the chunk is
        cast back to the gradient's dtype, so stage 2's plan and bytes do not depend on it),
        so local rank l ends with the node's sum of the shards of ranks {m * g + l : m},
        in node order (its "chunk", 1/g of the bucket); one all_gather of the 16-byte headers
        inside the node gives every rank its node's non-finite flags and plan fingerprints;
    stage 2, across nodes (`gift_compile.exchange.bucket` on `BucketPlan.cross`): GIFT's codec
        (map, scales, error feedback, decode, fp32 sum, inverse map) on the chunk, exchanged with
        the n ranks of local index l: rank m * g + l receives exactly its one-level shard;
    stage 3, an all-reduce only (`node_gather`): the n ranks of each local index now hold the
        same full chunk (decoded from the same bytes); an all_gather inside the node of those
        chunks (fp32, or bf16 under `intra_node_format="bf16"`) puts the whole reduced tensor,
        bit-identical, on every rank (each rank reads its own chunk back from the gathered
        bytes too).

Why the node's flags travel in stage 2's header: a non-finite gradient on one rank reaches, by
the native sum, only the chunk of the rank owning those rows, so only one cross-node group would
see it; the node's flags (every local rank's, from the header all_gather) ride in the flag word
of every stage-2 header instead, so every rank of every node reads every rank's flags in the
same call and all of them fail together, naming the ranks. The flag word is the node's
non-finite mask in bits [0, 31) and its plan-mismatch mask (local ranks whose fingerprint
differs from the sender's) in bits [32, 63), hence `topology.MAX_RANKS_PER_NODE`.

The probes (a gradient's first rows, what refreshes measure maps on) are copied from the
local gradient in stage 1, as the one-level exchange copies them; error-feedback residuals
live in stage 2, where the rounding happens, sized to the chunk (`residual_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gift_compile.exchange.accounting import HEADER_BYTES
from gift_compile.exchange.item_codec import ItemTensors, Shared, _copy_probe, _pad_flat, _pad_rows
from gift_compile.exchange.plan import BucketPlan, ItemPlan
from gift_compile.exchange.topology import NodeLayout

_c10d = torch.ops._c10d_functional

# the flag word of a stage-2 header: non-finite mask bits [0, 31), mismatch mask bits [32, 63)
MISMATCH_SHIFT = 32

__all__ = ["MISMATCH_SHIFT", "node_gather", "node_rank_flags", "node_reduce", "residual_rows"]


def residual_rows(rows: int, world: int, layout: NodeLayout) -> int:
    """Rows of a managed `rows`-row gradient's first-hop error-feedback residual on a group of
    `world` ranks: the gradient's own, or under a two-level layout its node chunk's (the rows
    padded to a multiple of `world`, over the node's ranks), where stage 2 rounds."""
    if not layout.two_level:
        return rows
    return -(-rows // world) * world // layout.ranks_per_node


def _blocks(flat: torch.Tensor, plan: BucketPlan) -> torch.Tensor:
    """A flat item (padded to W equal shards, shard k for group rank k) as `[g, n * shard]`:
    row l holds the shards of ranks {m * g + l} in node order, what local rank l receives."""
    g, n = plan.layout.ranks_per_node, plan.layout.nodes
    return flat.reshape(n, g, -1).transpose(0, 1).reshape(g, -1)


def node_reduce(xs: Sequence[torch.Tensor], items: Sequence[ItemTensors | None], plan: BucketPlan
                ) -> tuple[list[torch.Tensor], list[ItemTensors | None], torch.Tensor, int, int]:
    """Stage 1 of a two-level `plan`: `(chunks, stage-2 item tensors, flag word, bytes handed
    to the node's collectives, bytes of the gradients)`.

    `chunks` are stage 2's inputs (`plan.cross`'s items: a managed item `[chunk rows, cols]` at
    the gradient's dtype, a passthrough item flat); the stage-2 tensors are the items' own
    without the probe, which is filled here from the local gradient. The flag word goes into
    every stage-2 header (module docstring)."""
    layout = plan.layout
    g = layout.ranks_per_node
    bad: torch.Tensor | None = None
    by_dtype: dict[torch.dtype, list[int]] = {}
    blocks: list[torch.Tensor] = []
    baseline = 0
    for i, (x, state, item) in enumerate(zip(xs, items, plan.items)):
        baseline += x.numel() * x.element_size()
        if item.managed:
            assert state is not None, f"GIFT: no runtime tensors for managed item {item.name}"
            rows = x.reshape(item.rows, item.cols)
            if state.probe is not None:
                _copy_probe(item, state.probe, rows)
            flat = _pad_rows(rows, plan.rows_sent(item)).reshape(-1)
        else:
            flat = _pad_flat(x.reshape(-1), plan.flat_sent(item))
        item_bad = ~torch.isfinite(x).all()
        bad = item_bad if bad is None else bad | item_bad
        wire = layout.node_dtype(x.dtype)
        # averaging: each rank's share (/ g) before the node's sum, whose values must not
        # overflow where their mean does not; stage 2 averages over the nodes (`BucketPlan.cross`)
        blocks.append(_blocks((flat / g if plan.average else flat).to(wire), plan))
        by_dtype.setdefault(wire, []).append(i)
    chunks: list[torch.Tensor | None] = [None] * len(blocks)
    handed = 0
    for indices in by_dtype.values():  # one reduce-scatter per dtype on the node's links
        send = torch.cat([blocks[i] for i in indices], dim=1)
        handed += send.numel() * send.element_size()
        got = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(send.reshape(-1), "sum", g, layout.node_group))
        offset = 0
        for i in indices:
            width = blocks[i].shape[1]
            piece = got.narrow(0, offset, width).to(xs[i].dtype)  # stage 2 reads the gradient's dtype
            offset += width
            item = plan.cross.items[i]
            chunks[i] = piece.view(item.rows, item.cols) if item.managed else piece
    assert bad is not None
    header = torch.stack([torch.full_like(bad, plan.cross.fingerprint(), dtype=torch.int64), bad.to(torch.int64)])
    handed += HEADER_BYTES
    heads = _c10d.wait_tensor(_c10d.all_gather_into_tensor(header, g, layout.node_group)).reshape(g, 2)
    bits = torch.bitwise_left_shift(torch.ones_like(heads[:, 1]), torch.arange(g, device=heads.device))
    bad_mask = ((heads[:, 1] != 0).to(torch.int64) * bits).sum()  # distinct bits: sum == OR
    mismatch_mask = ((heads[:, 0] != header[0]).to(torch.int64) * bits).sum()
    flag = bad_mask | torch.bitwise_left_shift(mismatch_mask, MISMATCH_SHIFT)
    stage2 = [None if s is None else s._replace(probe=None) for s in items]
    return [c for c in chunks if c is not None], stage2, flag, handed, baseline


def node_rank_flags(header: torch.Tensor, shared: Shared, plan: BucketPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group rank `[n * g]` bool non-finite and mismatch flags from stage 2's headers
    (`header` `[n, 2]` int64, from each node's rank of this rank's local index; `plan` the
    stage-2 plan): the nodes' masks, and a sender whose own fingerprint differs from this
    rank's (its rank, `node * g + this rank's local index`)."""
    g = plan.node_headers
    word = header[:, 1].unsqueeze(1)
    local = torch.arange(g, device=header.device)
    nonfinite = (torch.bitwise_right_shift(word, local) & 1) != 0
    mismatch = (torch.bitwise_right_shift(word, local + MISMATCH_SHIFT) & 1) != 0
    mine = local == (shared.rank % g)
    mismatch = mismatch | ((header[:, 0] != plan.fingerprint()).unsqueeze(1) & mine)
    return nonfinite.reshape(-1), mismatch.reshape(-1)


def node_gather(chunks: Sequence[torch.Tensor], plan: BucketPlan) -> tuple[list[torch.Tensor], int]:
    """Stage 3 of a two-level all-reduce: every item's full fp32 result from the chunks stage 2
    left on the node's ranks (`chunks`: managed `[chunk rows, cols]`, passthrough flat; the
    same bits on every rank of a local index), by one all_gather inside the node (at fp32, or
    bf16 under `intra_node_format="bf16"`, returned as fp32); and the
    bytes handed to it. Managed items come back `[rows, cols]`, passthrough items flat, the
    padding cropped, as the one-level `gather_finish` returns them."""
    layout = plan.layout
    g, n = layout.ranks_per_node, layout.nodes
    send = torch.cat([c.reshape(-1).to(layout.node_dtype(torch.float32)) for c in chunks])
    got = _c10d.wait_tensor(_c10d.all_gather_into_tensor(send, g, layout.node_group)).reshape(g, -1).float()
    outs = []
    offset = 0
    for chunk, item in zip(chunks, plan.items):
        width = chunk.numel()
        full = got.narrow(1, offset, width).reshape(g, n, -1).transpose(0, 1).reshape(-1)
        offset += width
        outs.append(_unpad(full, item))
    return outs, send.numel() * send.element_size()


def _unpad(full: torch.Tensor, item: ItemPlan) -> torch.Tensor:
    if item.managed:
        return full.reshape(-1, item.cols).narrow(0, 0, item.rows)
    return full.narrow(0, 0, item.numel)
