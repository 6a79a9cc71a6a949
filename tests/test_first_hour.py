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
        out[name] = {"totals": st.comm_totals(), "compression": st.compression()}
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

