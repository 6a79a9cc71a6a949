"""Context parallelism: GIFT's statistics summed over the CP group are those of whole sequences.

Under context parallelism each rank of a CP group holds a slice of every sequence (torchtitan's
head-tail load balancer: with CP 2 a sequence is cut into 4 chunks, rank 0 takes chunks 0 and
3, rank 1 chunks 1 and 2), and torchtitan's FSDP mesh is dp_shard x cp, so GIFT's state group
spans the CP ranks. The K-FAC input factor is a sum over tokens divided by their count; each
rank adds its slice's tokens to its window and a refresh all-reduces both sums over the group
(`KFACStatistics.consolidate`, or `SketchStatistics.consolidate` onto the layer's owner), so
the slices add up to the factor of the whole sequences. This checks it on a plain module
(`gift_compile.apply` over a 2-rank gloo "CP group"): the factor and the transforms after
each refresh equal those of one rank that sees the whole sequences, and are the same bits on
both CP ranks. The positions carry different input scales, so a rank's slice alone has a very
different factor (checked too): statistics kept per rank would fail the comparison.

A torchtitan run does not expose its statistics (its transforms only in its checkpoints); its
CP runs (losses against the same sequences without CP, GIFT at nvfp4 and fp32) are
tests/test_torchtitan_cp.py; CP with TP, HSDP and PP, whose final checkpoints hold the same
transforms on every CP rank, are tests/test_torchtitan_cp_layouts.py.
"""

from __future__ import annotations

import pytest
import torch

from mlp import MLP
from multirank import run_ranks

WIDTH, BATCH, SEQ, CP = 64, 4, 32, 2
STEPS = 2
GEOMETRIES = ("dense", "lowrank")  # the exact K-FAC factor, and its sketch (reduced onto each layer's owner)
# Sequences short enough that no layer subsamples its tokens (stats_tokens >= BATCH * SEQ): a
# strided subsample of a slice is not the subsample of the whole sequences. fp32 on the wire keeps
# both arms' weights equal up to summation order, so fc2's inputs (after fc1) stay comparable at
# the second refresh. rank 8: a 16-column sketch, smaller than either layer's factor.
CFG = dict(format="fp32", select="all", min_numel=1024, refresh_every=1, refresh_warmup=0, rank=8, exclude=())


def _sequences(step: int) -> torch.Tensor:
    """`[BATCH, SEQ, WIDTH]` inputs whose column scales depend on the position: the outer chunks
    (CP rank 0's) are strongly anisotropic one way and the other, the inner ones (rank 1's) mildly."""
    x = torch.randn(BATCH, SEQ, WIDTH, generator=torch.Generator().manual_seed(1000 + step))
    position = (torch.arange(SEQ, dtype=torch.float32) - (SEQ - 1) / 2) / (SEQ / 2)  # in (-1, 1)
    return x * torch.logspace(-1.0, 1.0, WIDTH) ** (2 * position)[:, None]


def head_tail_positions(rank: int, cp: int, seq: int) -> torch.Tensor:
    """The positions CP rank `rank` holds under torchtitan's head-tail load balancer: chunks
    `rank` and `2 cp - 1 - rank` of `2 cp` equal chunks."""
    chunk = seq // (2 * cp)
    ids = (rank, 2 * cp - 1 - rank)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk) for i in ids])


def _train(rank: int, world: int, context_parallel: bool) -> dict[str, dict]:
    """Per geometry, what a few GIFT steps leave. `context_parallel`: this CP rank's slice of
    every sequence; else data parallelism over the same tokens, this rank's share of the
    sequences, whole. Each rank's loss is the mean over its tokens: with equal shares, the
    group's average gradient is the same in both."""
    return {geometry: _run(rank, world, geometry, context_parallel) for geometry in GEOMETRIES}


def _run(rank: int, world: int, geometry: str, context_parallel: bool) -> dict:
    import gift_compile
    from gift_compile.config import GiftConfig
    from gift_compile.geometry.statistics import KFACStatistics

    model = MLP(WIDTH, classes=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gift_compile.apply(model, GiftConfig(**CFG, geometry=geometry), optimizer=opt)
    st = gift_compile.state(model)
    positions = head_tail_positions(rank, world, SEQ) if context_parallel else torch.arange(SEQ)
    sequences = torch.arange(BATCH) if context_parallel else torch.arange(BATCH).chunk(world)[rank]
    out: dict = {"factors": [], "transforms": [], "slice_factor": None,
                 "initial": {n: [t.clone() for t in l.transform.tensors] for n, l in st.layers.items()}}
    for step in range(STEPS):
        x = _sequences(step)[sequences][:, positions]
        if step == 0:  # fc1 reads x itself: the factor of this rank's tokens alone
            flat = x.reshape(-1, WIDTH)
            out["slice_factor"] = flat.t() @ flat / flat.shape[0]
        model(x).pow(2).mean().backward()
        opt.step()  # the post-step hook refreshes (refresh_every=1)
        opt.zero_grad()
        out["factors"].append({n: l.stats.factor.clone() for n, l in st.layers.items()
                               if isinstance(l.stats, KFACStatistics)})
        out["transforms"].append({n: [t.clone() for t in l.transform.tensors] for n, l in st.layers.items()})
    out["refreshes"] = len(st.history)
    out["selected"] = sorted(n for n, l in st.layers.items() if l.selected)
    out["totals"] = st.comm_totals()
    out["stats_kind"] = {n: type(l.stats).__name__ for n, l in st.layers.items()}
    return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def arms() -> tuple[list[dict], dict]:
    """The 2 CP ranks' results, and one rank's of the same tokens without CP (2 ranks, whole sequences)."""
    return run_ranks(_train, CP, True), run_ranks(_train, CP, False)[0]


def test_head_tail_positions_are_torchs_load_balancer() -> None:
    """The slices this test hands each CP rank are those torchtitan's CP sharding gives it
    (`torchtitan.distributed.context_parallel.cp_shard` with its default "headtail" balancer)."""
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    order = _HeadTailLoadBalancer(SEQ, CP, "cpu")._generate_indices().reshape(-1)
    for rank, chunk in enumerate(order.chunk(CP)):
        assert torch.equal(head_tail_positions(rank, CP, SEQ), chunk), rank


@pytest.mark.parametrize("geometry,stats_kind", [("dense", "KFACStatistics"), ("lowrank", "SketchStatistics")])
def test_statistics_summed_over_the_cp_group_are_the_whole_sequences(
        arms: tuple[list[dict], dict], geometry: str, stats_kind: str) -> None:
    cp, whole = [r[geometry] for r in arms[0]], arms[1][geometry]
    first = cp[0]
    assert first["stats_kind"] == {"fc1.weight": stats_kind, "fc2.weight": stats_kind}
    # GIFT ran: both layers managed and transformed, a refresh after each step, bytes through
    # its collectives (the same as without CP: the same gradients cross the same group)
    for r in (*cp, whole):
        assert r["refreshes"] == STEPS and r["selected"] == ["fc1.weight", "fc2.weight"]
    assert first["totals"]["calls"] == 2 * STEPS and first["totals"]["wire"] > 0
    assert first["totals"] == whole["totals"]
    for step in range(STEPS):
        for name, tensors in whole["transforms"][step].items():
            # every CP rank holds the same bits after each refresh (the owner's broadcast) ...
            assert all(torch.equal(a, b) for a, b in zip(first["transforms"][step][name],
                                                         cp[1]["transforms"][step][name])), (step, name)
            # ... the refresh moved them away from the identity ...
            assert not all(torch.allclose(t, t0) for t, t0 in zip(tensors, whole["initial"][name])), name
            # ... to the transforms of the whole sequences: the factors agree to fp32 summation
            # order (~1e-7), which the dense map's inverse square root amplifies on fc2's
            # rank-deficient factor (128 tokens, 128 inputs after a ReLU) to ~1e-4
            for a, b in zip(first["transforms"][step][name], tensors):
                assert _relative(a, b) < 1e-3, (step, name, _relative(a, b))
    # the exact factor (dense): the group's sum is the whole sequences' factor, which no slice is
    full = _sequences(0).reshape(-1, WIDTH)
    expected = full.t() @ full / full.shape[0]
    if stats_kind == "KFACStatistics":
        for r in cp:
            assert _relative(r["factors"][0]["fc1.weight"], expected) < 1e-5
        for step in range(STEPS):
            for name, factor in whole["factors"][step].items():
                assert _relative(first["factors"][step][name], factor) < 1e-5, (step, name)
    for r in cp:  # a rank's slice alone: a factor off by far more than the tolerances above
        assert _relative(r["slice_factor"], expected) > 0.5
