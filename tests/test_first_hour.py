"""What a new user reads off a run (issue 57): the compression figures on a two-node layout and
on one node, `report(model)` before and after the first refresh, and the mismatches GIFT says
out loud (recipe vs optimizer, a block size the format does not use).

Nodes are simulated on 4 gloo ranks with `GiftConfig.ranks_per_node` (2 x 2 against 1 x 4).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import gift_compile
from gift_compile.config import GiftConfig
from mlp import MLP
from multirank import run_ranks

INT2 = dict(format="int2", block_size=32)


def _int2_ddp_run(rank: int, world: int) -> dict[str, object]:
    """Three DDP steps of int2 GIFT as 2 nodes x 2, then as one node of 4 (`ranks_per_node=4`):
    each state's `comm_totals()` and `compression()`."""
    out: dict[str, object] = {}
    for name, per_node in (("two_nodes", 2), ("one_node", 4)):
        model = MLP(64, 256)
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=100)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        gift_compile.apply(ddp, GiftConfig(**INT2, geometry="none", min_numel=1024, exclude=(),
                                           ranks_per_node=per_node), optimizer=opt, fuse=False)
        for i in range(3):
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(10 * i + rank))
            ddp(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        st = gift_compile.state(ddp)
        out[name] = {"totals": st.comm_totals(), "compression": st.compression(), "report": str(gift_compile.report(ddp))}
        gift_compile.remove(ddp)
    return out


def test_network_compression_counts_what_crosses_nodes_and_the_total_is_named_apart() -> None:
    """2 x 2 at int2: the network's figure (bytes across nodes against an fp32 exchange over the
    same two levels) is several times smaller than fp32, while the whole total, which adds the
    node's full-precision reduce-scatter, is a separately named and far smaller figure. On one
    node nothing is called cross-node."""
    for r in run_ranks(_int2_ddp_run, 4):
        two, one = r["two_nodes"], r["one_node"]
        t, c = two["totals"], two["compression"]
        assert t["cross_wire"] > 0 and t["node_wire"] > 0 and t["cross_wire"] + t["node_wire"] == t["wire"]
        # an fp32 exchange over the same layout sends the node-reduced half across nodes
        assert 0 < t["cross_baseline"] < t["baseline"]
        assert c["network"] is not None and c["network"] > 4.0, c
        assert set(c) == {"network", "total"} and c["total"] < c["network"] / 2, c
        t1, c1 = one["totals"], one["compression"]
        assert t1["cross_wire"] == 0 and t1["cross_baseline"] == 0 and t1["node_wire"] == t1["wire"] > 0, t1
        assert c1["network"] is None and c1["total"] > 4.0, c1
        # the report says the same figures under the same names
        assert f"{c['network']:.2f}x fewer across nodes (the network)" in two["report"], two["report"]
        assert f"in total, inside nodes and across, {c['total']:.2f}x fewer than fp32" in two["report"]
        assert f"nothing crossed a network; {c1['total']:.2f}x fewer than fp32 in total" in one["report"], one["report"]


def _report_run(rank: int, world: int) -> dict[str, object]:
    """The docs' small model under Muon + AdamW at int2 on 2 ranks, through the first refresh: the
    report before it, after it, and the rank's `gift_compile` INFO lines about refreshes."""
    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("gift_compile")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.GELU(), nn.Linear(256, 256))
    # Muon for the matrices, AdamW for the rest: the map (lowrank) pays on these low-rank gradients
    opts = [torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02),
            torch.optim.AdamW([p for p in model.parameters() if p.ndim < 2], lr=1e-3)]
    gift_compile.apply(model, GiftConfig(**INT2), optimizer=opts, fuse=False)
    out: dict[str, object] = {}
    first = gift_compile.report(model).first_refresh
    for step in range(first):
        if step == 3:
            out["before"] = gift_compile.report(model)
        x = torch.randn(32, 256, generator=torch.Generator().manual_seed(1000 * rank + step))
        model(x).pow(2).mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    out["after"] = gift_compile.report(model)
    out["mapped"] = sorted(n for n, layer in gift_compile.state(model).layers.items() if layer.selected)
    out["refresh_lines"] = [m for m in lines if m.startswith("GIFT refresh at step")]
    log.removeHandler(handler)
    return out


def test_the_report_is_current_before_and_after_the_first_refresh() -> None:
    """Before the first refresh the report says when it comes and that no layer is mapped yet;
    after it, the mapped layers (what the state runs), the refresh's step and the next one's; the
    rank-0 log line at the refresh says the same, and no other rank logs it."""
    ranks = run_ranks(_report_run, 2)
    for rank, r in enumerate(ranks):
        before, after = r["before"], r["after"]
        assert before.selected is None and before.step == 3 and before.last_refresh is None
        assert any(f"first refresh (optimizer step {before.first_refresh}; now after step 3)" in line
                   for line in before.lines()), before.lines()
        assert r["mapped"], "the measured selection mapped no layer: the test cannot tell a stale report"
        assert after.selected == tuple(r["mapped"]) and after.step == before.first_refresh
        text = str(after)
        assert f"mapped ({len(r['mapped'])} of 3): {', '.join(r['mapped'])}" in text, text
        assert f"last refresh: optimizer step {before.first_refresh}: {len(r['mapped'])} of 3 managed layers" in text
        assert f"next refresh at optimizer step {after.next_refresh}" in text and after.next_refresh > after.step
        if rank == 0:
            assert len(r["refresh_lines"]) == 1, r["refresh_lines"]
            line = r["refresh_lines"][0]
            assert f"mapped: {', '.join(r['mapped'])}; next refresh at optimizer step {after.next_refresh}" in line
        else:
            assert r["refresh_lines"] == [], r["refresh_lines"]
