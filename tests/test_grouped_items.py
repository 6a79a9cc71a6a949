"""Grouped items (`ItemPlan.groups`): a grouped GEMM's weight `[G*out, in]` sent as one item whose
row blocks each go through their own map (MoE experts, each whitened on its own).

Ranks are simulated in one process: each sender's `encode_item` blocks (row d for rank d) are
regrouped into what rank d's all_to_all would receive, as `tests/bit_checks.exchange_round_trip`
stands one buffer in for the received one.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from bit_checks import fake_cuda
from conftest import require
from gift_compile.exchange.item_codec import (
    ItemTensors, Shared, _fused_receiver, _fused_sender, decode_item, encode_item, gather_decode_item, reencode_item,
    shard_tensors,
)
from gift_compile.exchange.plan import BucketPlan, ItemPlan
from gift_compile.geometry.maps import LowRank

G, OUT, D_IN, RANK = 4, 8, 64, 4


def _maps(seed: int = 0, groups: int = G) -> list[tuple[torch.Tensor, ...]]:
    """`groups` distinct, strongly anisotropic low-rank whitenings (one per expert)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for e in range(groups):
        x = torch.randn(256, D_IN, generator=gen) * torch.logspace(0, 2, D_IN)[torch.randperm(D_IN, generator=gen)]
        m = LowRank(D_IN, RANK)
        m.refresh_from(x.t() @ x / 256, 1e-3)
        out.append(m.tensors)
    return out


def _stack(maps: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.stack(ts) for ts in zip(*maps))


def _item(fmt: str, groups: int = G, rows: int = G * OUT, **kw: object) -> ItemPlan:
    return ItemPlan(name="experts.w1", rows=rows, cols=D_IN, format=fmt, kind="lowrank", n_tensors=5, groups=groups,
                    **kw)


def _grads(world: int, seed: int = 1, rows: int = G * OUT) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, D_IN, generator=gen) for _ in range(world)]


def _encoded(item: ItemPlan, x: torch.Tensor, transform: tuple[torch.Tensor, ...], world: int = 1,
             op: str = "reduce_scatter") -> list[torch.Tensor]:
    blocks, bad = encode_item(x, ItemTensors(transform), Shared(), item, BucketPlan((item,), world, None, False, op))
    assert not bool(bad)
    return blocks


def _exchange(item: ItemPlan, xs: list[torch.Tensor], states: list[ItemTensors], op: str) -> list[torch.Tensor]:
    """Every simulated rank's result of one bucket of `item` (sum, not average): its
    reduce-scatter shard, or the all-reduce's full result."""
    w = len(xs)
    p = BucketPlan((item,), w, None, False, op)
    sent = [torch.cat(encode_item(x, s, Shared(rank=r), item, p)[0], dim=1) for r, (x, s) in enumerate(zip(xs, states))]
    recv = [torch.stack([sent[r][d] for r in range(w)]) for d in range(w)]
    if op == "reduce_scatter":
        return [decode_item(recv[d], 0, states[d], item, p)[0] for d in range(w)]
    moved = [decode_item(recv[d], 0, states[d], item, p, transformed=True)[0] for d in range(w)]
    gathered = torch.stack([torch.cat(reencode_item(moved[d], states[d], Shared(rank=d), item, p)) for d in range(w)])
    return [gather_decode_item(gathered, 0, states[d], item, p)[0] for d in range(w)]


def _grouped_states(item: ItemPlan, transform: tuple[torch.Tensor, ...], world: int) -> list[ItemTensors]:
    return [ItemTensors(transform, shard_transform=shard_tensors(item, transform, d, world)) for d in range(world)]


def _per_block_reference(fmt: str, xs: list[torch.Tensor], maps: list[tuple[torch.Tensor, ...]],
                         op: str) -> torch.Tensor:
    """The full result of the same exchange with each block sent as an item of its own."""
    blocks = []
    for e, m in enumerate(maps):
        item = ItemPlan(name=f"experts.w1.{e}", rows=OUT, cols=D_IN, format=fmt, kind="lowrank", n_tensors=5)
        outs = _exchange(item, [x[e * OUT:(e + 1) * OUT] for x in xs], [ItemTensors(m)] * len(xs), op)
        blocks.append(torch.cat(outs) if op == "reduce_scatter" else outs[0])
    return torch.cat(blocks)


# ---- (a) the sender: each block through its own map ---------------------------------------------
@pytest.mark.parametrize("scaling", ["row", "block"])
def test_grouped_codes_equal_each_block_sent_alone(scaling: str) -> None:
    """With per-row (or per-row-block) scales, a grouped item's codes and scales are the
    concatenation of each block's, sent as an item of its own with its own map, bit for bit."""
    maps, x = _maps(), _grads(1)[0]
    item = _item("fp8_e4m3", scaling=scaling)
    grouped = _encoded(item, x, _stack(maps))
    alone = [_encoded(dataclasses.replace(item, groups=1, rows=OUT), x[e * OUT:(e + 1) * OUT], m)
             for e, m in enumerate(maps)]
    assert len(grouped) == 2  # codes, scales
    for part, pieces in zip(grouped, zip(*alone)):
        assert torch.equal(part, torch.cat(pieces, dim=1))


def test_two_level_format_maps_each_block_with_its_own_map() -> None:
    """nvfp4 has one tensor scale per item, so codes differ from separate items; the decoded
    (still mapped) values match each block's own mapped gradient within the format's error, and
    are far from what a neighbour's map gives."""
    maps, x = _maps(), _grads(1)[0]
    item = _item("nvfp4")
    p = BucketPlan((item,), 1, None, False, "all_reduce")
    sent = torch.cat(encode_item(x, ItemTensors(_stack(maps)), Shared(), item, p)[0], dim=1)
    mapped = decode_item(sent, 0, None, item, p, transformed=True)[0]
    for e, m in enumerate(maps):
        own = LowRank.apply_forward(x[e * OUT:(e + 1) * OUT], m)
        other = LowRank.apply_forward(x[e * OUT:(e + 1) * OUT], maps[(e + 1) % G])
        got = mapped[e * OUT:(e + 1) * OUT]
        assert (got - own).norm() < 0.2 * own.norm()
        assert (got - other).norm() > 0.5 * own.norm()


# ---- (f) the map is not ignored -----------------------------------------------------------------
def test_swapping_two_blocks_maps_changes_their_codes() -> None:
    maps, x = _maps(), _grads(1)[0]
    item = _item("fp8_e4m3")
    codes = _encoded(item, x, _stack(maps))[0].reshape(G, -1)
    swapped = _encoded(item, x, _stack([maps[0], maps[2], maps[1], maps[3]]))[0].reshape(G, -1)
    assert torch.equal(codes[0], swapped[0]) and torch.equal(codes[3], swapped[3])
    assert not torch.equal(codes[1], swapped[1]) and not torch.equal(codes[2], swapped[2])


# ---- (b), (c) the receivers over two simulated ranks ---------------------------------------------
@pytest.mark.parametrize("op", ["reduce_scatter", "all_reduce"])
def test_fp32_exchange_returns_each_blocks_exact_sum(op: str) -> None:
    """fp32 codes are the mapped values themselves: every rank gets the true sums of its blocks
    (all of them for the all-reduce) up to the maps' fp32 round trip."""
    world, maps = 2, _maps()
    item, xs = _item("fp32"), _grads(2)
    outs = _exchange(item, xs, _grouped_states(item, _stack(maps), world), op)
    total = xs[0] + xs[1]
    for d, out in enumerate(outs):
        want = total.chunk(world)[d] if op == "reduce_scatter" else total
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", ["reduce_scatter", "all_reduce"])
def test_fp8_exchange_matches_each_block_exchanged_alone(op: str) -> None:
    """Quantized, each rank's blocks equal the same blocks exchanged as items of their own (the
    same codes, scales and fp32 sums; only the inverse map runs on more rows at once), and sit
    within fp8's error of the true sums."""
    world, maps = 2, _maps()
    item, xs = _item("fp8_e4m3"), _grads(2)
    outs = _exchange(item, xs, _grouped_states(item, _stack(maps), world), op)
    ref = _per_block_reference("fp8_e4m3", xs, maps, op)
    total = xs[0] + xs[1]
    for d, out in enumerate(outs):
        want, exact = (ref.chunk(world)[d], total.chunk(world)[d]) if op == "reduce_scatter" else (ref, total)
        torch.testing.assert_close(out, want)
        assert (out - exact).norm() < 0.1 * exact.norm()


def test_reduce_scatter_receiver_uses_its_own_blocks_maps() -> None:
    """Rank 1 decoding with rank 0's blocks' maps gets a badly wrong result: the shard's maps
    decide the output, so the test above would notice a receiver that took the wrong ones."""
    world, maps = 2, _maps()
    item, xs = _item("fp32"), _grads(2)
    transform = _stack(maps)
    states = _grouped_states(item, transform, world)
    states[1] = states[1]._replace(shard_transform=shard_tensors(item, transform, 0, world))
    out = _exchange(item, xs, states, "reduce_scatter")[1]
    want = (xs[0] + xs[1]).chunk(world)[1]
    assert (out - want).norm() > 0.5 * want.norm()


def test_shard_tensors_are_views_of_the_rank_blocks() -> None:
    transform = _stack(_maps())
    item = _item("fp32")
    shard = shard_tensors(item, transform, 1, 2)
    for s, t in zip(shard, transform):
        assert s.shape[0] == G // 2 and s.data_ptr() == t[G // 2].data_ptr()


# ---- gating: one 0-d gate per grouped item ------------------------------------------------------
def test_gated_grouped_item_is_its_maps_when_on_and_the_identity_when_off() -> None:
    maps, x = _maps(), _grads(1)[0]
    item = _item("fp8_e4m3")
    gated = dataclasses.replace(item, gated=True, n_tensors=6)
    on = _encoded(gated, x, (*_stack(maps), torch.tensor(True)))
    off = _encoded(gated, x, (*_stack(maps), torch.tensor(False)))
    ident = _encoded(ItemPlan(name="experts.w1", rows=G * OUT, cols=D_IN, format="fp8_e4m3"), x, ())
    assert all(torch.equal(a, b) for a, b in zip(on, _encoded(item, x, _stack(maps))))
    assert all(torch.equal(a, b) for a, b in zip(off, ident))
    shard = shard_tensors(gated, (*_stack(maps), torch.tensor(True)), 1, 2)
    assert len(shard) == 6 and shard[-1].dim() == 0


def test_a_gate_per_block_selects_each_blocks_map_on_its_own() -> None:
    """Experts are selected one by one: a `[G]` gate runs block e's map where gate[e] is on and
    the identity where it is off, block by block, and `shard_tensors` hands a rank its blocks'
    gates."""
    maps, x = _maps(), _grads(1)[0]
    gated = dataclasses.replace(_item("fp32"), gated=True, n_tensors=6)
    gate = torch.tensor([True, False, True, False])
    got = torch.cat(_encoded(gated, x, (*_stack(maps), gate)), dim=1).view(torch.float32).reshape(G * OUT, D_IN)
    for e in range(G):
        rows = x[e * OUT:(e + 1) * OUT]
        want = LowRank.apply_forward(rows, maps[e]) if gate[e] else rows
        assert torch.equal(got[e * OUT:(e + 1) * OUT], want), e
    shard = shard_tensors(gated, (*_stack(maps), gate), 1, 2)
    assert torch.equal(shard[-1], gate[2:])
    with pytest.raises(ValueError, match="leading dim of 4 blocks"):
        _encoded(gated, x, (*_stack(maps), gate[:3]))


def test_a_grouped_probe_keeps_each_blocks_first_rows() -> None:
    x = _grads(1)[0]
    item = _item("fp8_e4m3")
    probe = torch.zeros(G, 3, D_IN)
    p = BucketPlan((item,), 1, None, False, "reduce_scatter")
    encode_item(x, ItemTensors(_stack(_maps()), probe=probe), Shared(), item, p)
    assert torch.equal(probe, x.reshape(G, OUT, D_IN)[:, :3])
    with pytest.raises(ValueError, match="probe"):
        encode_item(x, ItemTensors(_stack(_maps()), probe=torch.zeros(G - 1, 3, D_IN)), Shared(), item, p)


# ---- fused paths never take a grouped item ------------------------------------------------------
def test_fused_sender_and_receiver_refuse_grouped_items() -> None:
    """On CUDA the same item ungrouped would run fused (the kernels need Triton)."""
    require("triton", "the fused paths run Triton kernels")
    item = _item("int4")
    with FakeTensorMode() as mode:
        g = fake_cuda(mode, (G * OUT, D_IN), torch.float32)
        payload = fake_cuda(mode, (2, G * OUT // 2, 32), torch.uint8)
        state = ItemTensors(())
        assert _fused_sender(dataclasses.replace(item, groups=1), state, g) is not None
        assert _fused_receiver(dataclasses.replace(item, groups=1), payload) is not None
        assert _fused_sender(item, state, g) is None
        assert _fused_receiver(item, payload) is None


# ---- (d) errors ---------------------------------------------------------------------------------
def test_grouped_item_errors_name_the_item() -> None:
    with pytest.raises(ValueError, match="experts.w1.*groups=4"):
        _item("fp8_e4m3", rows=30)
    with pytest.raises(ValueError, match="experts.w1.*groups must be an int >= 1"):
        _item("fp8_e4m3", groups=0)
    with pytest.raises(ValueError, match="experts.w1.*not divisible by the world size 3"):
        BucketPlan((_item("fp8_e4m3", rows=4 * 6),), 3, None, False, "reduce_scatter")
    # a map-free grouped item has nothing per block: any world
    BucketPlan((dataclasses.replace(_item("fp8_e4m3", rows=4 * 6), kind="identity", n_tensors=0),), 3, None, False,
               "reduce_scatter")
    maps, x = _maps(), _grads(1)[0]
    item = _item("fp8_e4m3")
    with pytest.raises(ValueError, match="experts.w1.*leading dim of 4 blocks"):
        _encoded(item, x, _stack(maps[:3]))
    with pytest.raises(ValueError, match="experts.w1.*leading dim of 4 blocks"):
        _encoded(item, x, maps[0])
    world, xs = 2, _grads(2)
    with pytest.raises(ValueError, match="experts.w1.*shard_transform"):
        _exchange(item, xs, [ItemTensors(_stack(maps))] * world, "reduce_scatter")
    with pytest.raises(ValueError, match="experts.w1.*leading dim of 2 blocks"):
        _exchange(item, xs, [ItemTensors(_stack(maps), shard_transform=_stack(maps))] * world, "reduce_scatter")


# ---- (e) plan strings ---------------------------------------------------------------------------
# `to_str` of this item and the fingerprint of its bucket on main before grouped items existed
_PLAIN = ItemPlan(name="layers.0.w", rows=16, cols=64, format="fp8_e4m3", kind="lowrank", n_tensors=5)
_PLAIN_STR = (
    '{"block_rotation":false,"block_size":32,"cols":64,"dtype":"float32","error_feedback":false,'
    '"error_feedback_decay":1.0,"format":"fp8_e4m3","gated":false,"kind":"lowrank","managed":true,'
    '"map_precision":"auto","n_tensors":5,"name":"layers.0.w","replica_format":"","residual_format":"fp32",'
    '"rows":16,"scaling":"row","second_hop_error_feedback":false,"stochastic_rounding":false,"unrewritten":"error"}'
)
_PLAIN_FINGERPRINT = 5049855687224851557


def test_plan_text_is_unchanged_for_ungrouped_items() -> None:
    assert _PLAIN.to_str() == _PLAIN_STR
    bucket = BucketPlan((_PLAIN,), 2, None, True, "reduce_scatter")
    assert bucket.fingerprint() == _PLAIN_FINGERPRINT
    assert "groups" not in bucket.as_dict()["items"][0]
    assert "blocks" not in _PLAIN.describe()


def test_grouped_plan_text_round_trips() -> None:
    item = dataclasses.replace(_PLAIN, groups=4)
    text = item.to_str()
    assert '"groups":4' in text and ItemPlan.from_str(text) == item
    bucket = BucketPlan((item,), 2, None, True, "reduce_scatter")
    assert BucketPlan.from_dict(bucket.as_dict()).items == (item,)
    assert bucket.fingerprint() != BucketPlan((_PLAIN,), 2, None, True, "reduce_scatter").fingerprint()
    assert "x4 blocks" in item.describe()
