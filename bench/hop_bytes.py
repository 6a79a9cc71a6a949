"""Bytes per hop of one backward on each gradient path, one level against two: a measurement.

`python -m bench.hop_bytes` runs a small MLP (three linears at NVFP4, their biases at fp32) for
one backward on 4 gloo ranks simulated as 2 nodes x 2 (`GiftConfig.ranks_per_node`), on every
eager path GIFT installs (a plain module, DDP, FSDP2, FSDP2 + HSDP's replica hop on a 2 x 2 mesh)
and one bucket through `sync_buffer` (what the public `reduce_scatter` / `all_reduce` and every
hook run), each at `ranks_per_node=0` (one level),
`ranks_per_node=2` (two levels) and `ranks_per_node=2, intra_node_format="bf16"`. It writes
`bench/results/hop_bytes.json` and `bench/results/hop_bytes.md`: per path and arm the bytes
rank 0 handed to collectives inside a node (`node_wire`) and to the rest (`cross_wire`: across
nodes, where the group spans them), as the counters in `GiftState.comm_totals()` (and HSDP's
replica hop's own, `hsdp.hop_totals`) counted them at the collectives, the fp32 bytes of the
gradients the replaced collectives would have sent, and the report's line for the path
(`gift_compile.report(model).exchanges`).

Why: the accounting (`bucket_hop_bytes`) says what each hop should carry; this is what the
collectives were handed on a real (simulated) layout, the same numbers `comm_totals()` reports
in training. The FX pass's rewrite hands the same bytes as the eager bucket it splices in
(`tests/test_two_level.py::test_graph_pass_rewrites_into_two_levels` checks it), so it is not
run here: on CPU its compile would dominate the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "hop_bytes.json"
TABLE = ROOT / "bench" / "results" / "hop_bytes.md"
COMMAND = "python -m bench.hop_bytes"
WORLD = 4
ARMS: dict[str, dict[str, Any]] = {
    "one level": {"ranks_per_node": 0},
    "two levels": {"ranks_per_node": 2},
    "two levels, bf16 in node": {"ranks_per_node": 2, "intra_node_format": "bf16"},
}


class _Net(nn.Module):
    """Three linears (managed at NVFP4) with biases (full precision); the same weights on every rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 128), nn.Linear(128, 128), nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _config(**kw: Any) -> Any:
    from gift_compile.config import GiftConfig

    return GiftConfig(format="nvfp4", block_size=16, geometry="lowrank", select="all", rank=4, min_numel=1024,
                      exclude=(), **kw)


def _backward(model: nn.Module, rank: int) -> None:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()


def _fp32_bytes() -> int:
    return sum(4 * p.numel() for p in _Net().parameters())


def _totals(state: Any) -> tuple[int, int]:
    t = state.comm_totals()
    return int(t["node_wire"]), int(t["cross_wire"])


def _paths(rank: int, arm: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every path's `{node, cross, baseline, exchanges}` on this rank for one arm."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gift_compile
    from gift_compile.api import manage
    from gift_compile.exchange import collectives as C
    from gift_compile.exchange.plan import ItemPlan
    from gift_compile.frameworks import fsdp2, hsdp
    from gift_compile.frameworks.exchanges import describe_exchanges

    out: dict[str, dict[str, Any]] = {}
    baseline = _fp32_bytes()
    # one bucket as every eager caller runs it (`sync_buffer`: the public API, the hooks): a
    # managed [256, 64] fp32 weight and a 64-element bias, reduce-scattered and all-reduced
    for op in ("reduce_scatter", "all_reduce"):
        counters = torch.zeros(C.N_COUNTERS, dtype=torch.int64)
        per = 256 // WORLD if op == "reduce_scatter" else 256
        bias = 64 // WORLD if op == "reduce_scatter" else 64
        item = ItemPlan(name="w", rows=256, cols=64, format="nvfp4", block_size=16)
        segments = [C.Segment("w", per, 64, item, C.ItemTensors(())), C.Segment("b", 1, bias)]
        buf = torch.randn(256 * 64 + 64, generator=torch.Generator().manual_seed(rank))
        C.sync_buffer(buf, segments, C.Shared(0, rank, counters), op=op, group=dist.group.WORLD, average=True,
                      ranks_per_node=arm["ranks_per_node"], intra_node_format=arm.get("intra_node_format", "native"))
        node = int(counters[C.C_NODE_WIRE])
        out[f"one bucket, {op} (sync_buffer)"] = {"node": node, "cross": int(counters[C.C_WIRE]) - node,
                                                  "baseline": 4 * buf.numel(), "exchanges": []}
    model = _Net()
    gift_compile.apply(model, _config(**arm), fuse=False)
    _backward(model, rank)
    node, cross = _totals(gift_compile.state(model))
    out["plain module"] = {"node": node, "cross": cross, "baseline": baseline,
                           "exchanges": list(gift_compile.report(model).exchanges)}
    ddp = nn.parallel.DistributedDataParallel(_Net(), bucket_cap_mb=100)
    gift_compile.apply(ddp, _config(**arm), fuse=False)
    _backward(ddp, rank)
    node, cross = _totals(gift_compile.state(ddp))
    out["DDP"] = {"node": node, "cross": cross, "baseline": baseline,
                  "exchanges": list(gift_compile.report(ddp).exchanges)}
    model = _Net()
    for layer in (model.fc1, model.fc2, model.fc3):
        fully_shard(layer)
    fully_shard(model)
    gift_compile.apply(model, _config(**arm), fuse=False)
    _backward(model, rank)
    node, cross = _totals(gift_compile.state(model))
    out["FSDP2"] = {"node": node, "cross": cross, "baseline": baseline,
                    "exchanges": list(gift_compile.report(model).exchanges)}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _Net()
    for layer in (model.fc1, model.fc2, model.fc3):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = manage(model, _config(reduce_op="sum", **arm), mesh.get_group("shard"), mode="stats", split_rows=True)
    fsdp2.install(model, state, compiled=False)
    hsdp.install(model, state, mesh.get_group("replicate"), compiled=False)
    _backward(model, rank)
    node, cross = _totals(state)
    replica = hsdp.hop_totals(state)["replica"]
    lines = list(describe_exchanges(state))
    out["HSDP shard hop (its group on one node)"] = {"node": node, "cross": cross, "baseline": baseline,
                                                     "exchanges": lines[:1]}
    out["HSDP replica hop (one rank per node)"] = {"node": 0, "cross": int(replica["wire"]),
                                                   "baseline": int(replica["baseline"]), "exchanges": lines[1:]}
    return out


def _worker(rank: int, world: int, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        results = {name: _paths(rank, arm) for name, arm in ARMS.items()}
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run() -> dict[str, Any]:
    """The measurement (4 spawned gloo ranks; rank 0's counters)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(WORLD, os.path.join(tmp, "store"), out), nprocs=WORLD, join=True)
        arms = json.loads(Path(out).read_text())
    return {"command": COMMAND, "world": WORLD, "ranks_per_node": 2, "torch": torch.__version__,
            "model": "3 linears 64-128-128-64 at nvfp4 (block 16), biases fp32; one backward of 16 rows per rank",
            "arms": arms}


def table(d: dict[str, Any]) -> str:
    """The markdown table of `d` (per path and arm: bytes inside the node, across, their sum)."""
    arms = list(d["arms"])
    paths = list(d["arms"][arms[0]])
    head = ["path", "fp32 gradient bytes", *(f"{a}: {k}" for a in arms for k in ("node", "cross"))]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for path in paths:
        cells = [path, f"{d['arms'][arms[0]][path]['baseline']:,}"]
        for a in arms:
            r = d["arms"][a][path]
            cells += [f"{r['node']:,}", f"{r['cross']:,}"]
        lines.append("| " + " | ".join(cells) + " |")
    notes = sorted({f"{p}: {line}" for a in arms[1:2] for p in paths for line in d["arms"][a][p]["exchanges"]})
    return "\n".join([
        f"# Bytes per hop, one level against two ({d['world']} gloo ranks as 2 nodes x {d['ranks_per_node']})", "",
        f"`{d['command']}` (torch {d['torch']}): {d['model']}. Bytes rank 0 handed to collectives in one backward, "
        "as `comm_totals()` counted them at the collectives: `node` inside a node (`node_wire`), `cross` the rest "
        "(`cross_wire`: across nodes where the group spans them; a one-level exchange counts everything there, so "
        "the HSDP shard hop's, whose group sits on one node, stay inside it). The HSDP replica hop's are its own "
        "counters (`hsdp.hop_totals`); its fp32 column is the shard it all-reduces.", "", *lines, "",
        "What the apply report says for each path (the two-level arm):", "", *(f"- {n}" for n in notes), ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    p.parse_args(argv)
    d = run()
    OUT.write_text(json.dumps(d, indent=1) + "\n")
    TABLE.write_text(table(d))
    print(table(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
