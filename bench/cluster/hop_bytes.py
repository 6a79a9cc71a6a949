"""Bytes per hop of the gradient exchange, flat against two levels, on 8 ranks as 2 nodes x 4 and
4 nodes x 2: a measurement of the eager paths and of torchtitan's two trainers.

`python -m bench.cluster.hop_bytes` writes `bench/results/cluster/hop_bytes.json` and `bench/results/cluster/hop_bytes.md`:

- eager paths (`--part eager`): a small MLP (three linears at NVFP4, their biases at fp32) for
  one backward on 8 gloo ranks simulated as 2 nodes x 4 and as 4 nodes x 2
  (`GiftConfig.ranks_per_node`), on every eager path GIFT installs (a plain module, DDP, FSDP2,
  FSDP2 + HSDP's replica hop on a nodes x ranks-per-node mesh) and one bucket through
  `sync_buffer` (what the public `reduce_scatter` / `all_reduce` and every hook run), each at
  `ranks_per_node=0` (flat: one level), `ranks_per_node=g` (two levels) and `ranks_per_node=g,
  intra_node_format="bf16"`. Per path and arm: the bytes rank 0 handed to collectives inside a
  node (`node_wire`) and to the rest (`cross_wire`: across nodes, where the group spans them), as
  `GiftState.comm_totals()` (and HSDP's replica hop's own counters, `hsdp.hop_totals`) counted
  them at the collectives; the package's shape-based accounting of the same exchanges
  (`bucket_hop_bytes` of every bucket plan that ran, the plain module's native fp32 all-reduce
  of its unmanaged parameters' buffer, `hsdp.accounted_bytes` for HSDP's hops), which the
  counted bytes must equal; and the ratio of the cross-node bytes to flat's, against 1/g.
- torchtitan (`--part torchtitan`): the debug Llama for a few steps on 8 gloo ranks under
  `torchrun`, on the FSDP2 trainer (`llama3_debug_gift_fsdp2`) and graph_trainer
  (`llama3_debug_gift_graph`: SimpleFSDP + the FX pass), flat (`--gift.ranks-per-node=0`) and
  two levels as 2 x 4 and 4 x 2 (`--gift.ranks-per-node=4` / `2`, and with
  `--gift.intra-node-format=bf16`), at nvfp4 without fusion; per step rank 0's
  `gift/node_wire_bytes_per_step` and `gift/cross_wire_bytes_per_step` from the run's
  JSON-lines telemetry, against `gift/accounted_bytes_per_backward`. Each launch's exact command
  is in the JSON. The flat run is one launch per trainer: at `ranks_per_node=0` the layout does
  not enter. Each part merges into the JSON, so a part, trainer or arm reruns alone
  (`--part`, `--trainers`, `--arms`).

Why: the accounting (`bucket_hop_bytes`) says what each hop should carry; this is what the
collectives were handed on a real (simulated) layout, the numbers `comm_totals()` and the
trainers' telemetry report in training.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from bench.lib.paths import ROOT, RESULTS

OUT = RESULTS / "cluster" / "hop_bytes.json"
TABLE = RESULTS / "cluster" / "hop_bytes.md"
COMMAND = "python -m bench.cluster.hop_bytes"
WORLD = 8
LAYOUTS: dict[str, int] = {"2 nodes x 4": 4, "4 nodes x 2": 2}  # name -> ranks per node (g)
PARTS = ("eager", "torchtitan")


def arms(g: int) -> dict[str, dict[str, Any]]:
    """The three arms on a layout of `g` ranks per node."""
    return {"flat": {"ranks_per_node": 0},
            "two levels": {"ranks_per_node": g},
            "two levels, bf16 in node": {"ranks_per_node": g, "intra_node_format": "bf16"}}


ARMS = tuple(arms(2))
ARM_KEYS = dict(zip(("flat", "two", "bf16"), ARMS))  # --arms spelling -> arm
# torchtitan: trainer -> (config function, its own overrides)
TRAINERS: dict[str, tuple[str, list[str]]] = {
    "FSDP2 trainer": ("llama3_debug_gift_fsdp2", []),
    "graph_trainer": ("llama3_debug_gift_graph", []),
}
STEPS = 3
TITAN_COMMON = ["--validator.no-enable", f"--training.steps={STEPS}", "--metrics.log-freq=1",
                "--gift.format=nvfp4", "--gift.no-fuse"]
DUMPS = ROOT / "outputs" / "hop_bytes"


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


@contextlib.contextmanager
def _recording() -> Iterator[list[Any]]:
    """The bucket plans every `sync_buffer` ran while inside (the plain module's weights, DDP's
    and FSDP2's buckets, the public API's bucket): their `bucket_hop_bytes` is the accounting."""
    from gift_compile.exchange import collectives as C

    plans: list[Any] = []
    original = C.run_bucket

    def run_bucket(xs: Any, tensors: Any, shared: Any, plan: Any, **kw: Any) -> Any:
        plans.append(plan)
        return original(xs, tensors, shared, plan, **kw)

    C.run_bucket = run_bucket
    try:
        yield plans
    finally:
        C.run_bucket = original


def _accounted(plans: list[Any]) -> list[int]:
    from gift_compile.exchange.collectives import bucket_hop_bytes

    hops = [bucket_hop_bytes(p) for p in plans]
    return [sum(h[0] for h in hops), sum(h[1] for h in hops)]


def _row(node: int, cross: int, baseline: int, accounted: list[int], exchanges: list[str]) -> dict[str, Any]:
    return {"node": node, "cross": cross, "baseline": baseline, "accounted": list(accounted),
            "exchanges": exchanges}


def _paths(rank: int, arm: dict[str, Any], g: int) -> dict[str, dict[str, Any]]:
    """Every path's row on this rank for one arm on a layout of `g` ranks per node."""
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
        with _recording() as plans:
            C.sync_buffer(buf, segments, C.Shared(0, rank, counters), op=op, group=dist.group.WORLD, average=True,
                          ranks_per_node=arm["ranks_per_node"],
                          intra_node_format=arm.get("intra_node_format", "native"))
        node = int(counters[C.C_NODE_WIRE])
        out[f"one bucket, {op} (sync_buffer)"] = _row(node, int(counters[C.C_WIRE]) - node, 4 * buf.numel(),
                                                      _accounted(plans), [])
    model = _Net()
    gift_compile.apply(model, _config(**arm), fuse=False)
    with _recording() as plans:
        _backward(model, rank)
    state = gift_compile.state(model)
    node, cross = _totals(state)
    accounted = _accounted(plans)
    # the unmanaged parameters' one native fp32 all-reduce (one level by design) of
    # `plain_sync`'s buffer: their values, an arrival flag each, a non-finite and a
    # layout-changed flag per rank
    unmanaged = [p for n, p in model.named_parameters() if n not in state.layers]
    accounted[1] += 4 * (sum(p.numel() for p in unmanaged) + len(unmanaged) + 2 * WORLD)
    out["plain module"] = _row(node, cross, baseline, accounted, list(gift_compile.report(model).exchanges))
    ddp = nn.parallel.DistributedDataParallel(_Net(), bucket_cap_mb=100)
    gift_compile.apply(ddp, _config(**arm), fuse=False)
    with _recording() as plans:
        _backward(ddp, rank)
    node, cross = _totals(gift_compile.state(ddp))
    out["DDP"] = _row(node, cross, baseline, _accounted(plans), list(gift_compile.report(ddp).exchanges))
    model = _Net()
    for layer in (model.fc1, model.fc2, model.fc3):
        fully_shard(layer)
    fully_shard(model)
    gift_compile.apply(model, _config(**arm), fuse=False)
    with _recording() as plans:
        _backward(model, rank)
    node, cross = _totals(gift_compile.state(model))
    accounted = _accounted(plans)
    assert sum(accounted) == fsdp2.accounted_bytes(model), (accounted, fsdp2.accounted_bytes(model))
    out["FSDP2"] = _row(node, cross, baseline, accounted, list(gift_compile.report(model).exchanges))
    # HSDP: a shard group per node (g ranks), the replica group one rank per node
    mesh = init_device_mesh("cpu", (WORLD // g, g), mesh_dim_names=("replicate", "shard"))
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
    accounted_hops = hsdp.accounted_bytes(model)
    lines = list(describe_exchanges(state))
    out["HSDP shard hop (its group on one node)"] = _row(node, cross, baseline, [0, accounted_hops["shard"]],
                                                         lines[:1])
    out["HSDP replica hop (one rank per node)"] = _row(0, int(replica["wire"]), int(replica["baseline"]),
                                                       [0, accounted_hops["replica"]], lines[1:])
    return out


def _worker(rank: int, world: int, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        results = {name: {arm: _paths(rank, cfg, g) for arm, cfg in arms(g).items()} for name, g in LAYOUTS.items()}
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run_eager() -> dict[str, Any]:
    """The eager measurement (8 spawned gloo ranks; rank 0's counters), per layout and arm."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(WORLD, os.path.join(tmp, "store"), out), nprocs=WORLD, join=True)
        layouts = json.loads(Path(out).read_text())
    return {"command": f"{COMMAND} --part eager", "world": WORLD, "torch": torch.__version__,
            "model": "3 linears 64-128-128-64 at nvfp4 (block 16), biases fp32; one backward of 16 rows per rank",
            "layouts": {name: {"ranks_per_node": g, "arms": layouts[name]} for name, g in LAYOUTS.items()}}


# ---- torchtitan --------------------------------------------------------------------------------
_KEYS = {"node": "gift/node_wire_bytes_per_step", "cross": "gift/cross_wire_bytes_per_step",
         "wire": "gift/wire_bytes_per_step", "baseline": "gift/baseline_bytes_per_step",
         "accounted": "gift/accounted_bytes_per_backward", "untouched": "gift/untouched_bytes_per_step",
         "compression": "gift/total_compression"}


def titan_launches() -> list[tuple[str, str, str, int, list[str]]]:
    """(trainer, layout, arm, ranks_per_node, overrides) of every launch, in the order run: per
    trainer flat once, then per layout two levels and two levels with bf16 inside the node."""
    out = []
    for trainer, (_, extra) in TRAINERS.items():
        out.append((trainer, "any (flat)", "flat", 0, [*TITAN_COMMON, *extra, "--gift.ranks-per-node=0"]))
        for layout, g in LAYOUTS.items():
            out.append((trainer, layout, "two levels", g, [*TITAN_COMMON, *extra, f"--gift.ranks-per-node={g}"]))
            out.append((trainer, layout, "two levels, bf16 in node", g,
                        [*TITAN_COMMON, *extra, f"--gift.ranks-per-node={g}", "--gift.intra-node-format=bf16"]))
    return out


def run_launch(trainer: str, overrides: list[str], folder: str, timeout_s: float) -> dict[str, Any]:
    """One 8-rank torchtitan launch: its command, outcome and per-step hop bytes (rank 0)."""
    from gift_compile.torchtitan_ext.cpu.runs import config_command, run_config

    config = TRAINERS[trainer][0]
    command = config_command(config, overrides, dump_folder=folder, nproc=WORLD)
    shown = ["python" if c == sys.executable else c.replace(f"{ROOT}/", "") for c in command]
    try:
        run = run_config(config, overrides, dump_folder=folder, nproc=WORLD, timeout_s=timeout_s)
    except Exception as err:  # a timeout: recorded, the other launches go on
        return {"command": shlex.join(shown), "returncode": None, "error": repr(err)[:2000], "steps": []}
    steps = [{"step": r["step"], **{k: r[v] for k, v in _KEYS.items() if v in r}}
             for r in run.records if "gift/wire_bytes_per_step" in r]
    # the apply report's / rewrite log's lines naming the exchange's levels, less the log prefix
    report = sorted({re.sub(r"^(\[rank\d+\]:)?(\[titan\] )?[\d-]+ [\d:,.]+ - \S+ - [A-Z]+ - ", "", line).strip()
                     for line in run.output.splitlines() if "two levels" in line or "one level" in line})
    out = {"command": shlex.join(shown), "returncode": run.returncode, "wall_s": round(run.wall_s, 1),
           "steps": steps, "report": report[:8]}
    if run.returncode != 0:
        out["output_tail"] = run.output[-4000:]
    return out


def run_torchtitan(trainers: list[str], arms_run: list[str], timeout_s: float, save: Any = None) -> dict[str, Any]:
    """Every launch of `trainers` and `arms_run` (8 ranks each, one after the other); `save(d)`
    after each; the JSON's other launches stay."""
    d: dict[str, Any] = {"command": f"{COMMAND} --part torchtitan", "world": WORLD, "steps": STEPS,
                         "common": TITAN_COMMON, "runs": []}
    planned = [launch for launch in titan_launches() if launch[0] in trainers and launch[2] in arms_run]
    keys = {launch[:3] for launch in planned}
    if OUT.exists():  # the launches not rerun now stay
        before = json.loads(OUT.read_text()).get("torchtitan", {}).get("runs", [])
        d["runs"] = [r for r in before if (r["trainer"], r["layout"], r["arm"]) not in keys]
    for trainer, layout, arm, g, overrides in planned:
        folder = DUMPS / f"{TRAINERS[trainer][0]}_rpn{g}{'_bf16' if 'bf16' in arm else ''}"
        shutil.rmtree(folder, ignore_errors=True)  # the telemetry appends
        start = time.time()
        print(f"[hop_bytes] {trainer}, {layout}, {arm} ...", flush=True)
        r = run_launch(trainer, overrides, str(folder), timeout_s)
        print(f"[hop_bytes]   rc={r['returncode']} in {time.time() - start:.0f} s", flush=True)
        d["runs"].append({"trainer": trainer, "layout": layout, "arm": arm, "ranks_per_node": g, **r})
        order = {launch[:3]: i for i, launch in enumerate(titan_launches())}
        d["runs"].sort(key=lambda x: order.get((x["trainer"], x["layout"], x["arm"]), 99))
        if save is not None:
            save(d)
    return d


# ---- rendering ---------------------------------------------------------------------------------
def _ratio(x: float, flat: float) -> str:
    return f"{x / flat:.3f}" if flat else "-"


def _eager_table(e: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for name, lay in e["layouts"].items():
        g, a = lay["ranks_per_node"], lay["arms"]
        head = ["path", "fp32 gradient bytes", "flat: cross", "two levels: node", "two levels: cross",
                f"cross / flat (1/g = {1 / g:.3f})", "bf16 in node: node", "bf16 in node: cross", "cross / flat",
                "counted = accounted"]
        out += [f"### {name} (ranks_per_node = {g})", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for path in a["flat"]:
            f, t, b = (a[arm][path] for arm in ("flat", "two levels", "two levels, bf16 in node"))
            ok = all([a[arm][path]["node"], a[arm][path]["cross"]] == a[arm][path]["accounted"] for arm in a)
            out.append("| " + " | ".join([
                path, f"{f['baseline']:,}", f"{f['cross']:,}", f"{t['node']:,}", f"{t['cross']:,}",
                _ratio(t["cross"], f["cross"]), f"{b['node']:,}", f"{b['cross']:,}", _ratio(b["cross"], f["cross"]),
                "yes" if ok else "**no**"]) + " |")
        out.append("")
    return out


def _titan_table(t: dict[str, Any]) -> list[str]:
    head = ["trainer", "layout", "arm", "node bytes / step", "cross bytes / step", "cross / flat", "1/g",
            "node + cross = accounted", "untouched / step", "steps", "wall s"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    flat = {r["trainer"]: r["steps"][-1]["cross"] for r in t["runs"] if r["arm"] == "flat" and r["steps"]}
    for r in t["runs"]:
        if not r["steps"]:
            out.append(f"| {r['trainer']} | {r['layout']} | {r['arm']} | failed (rc {r['returncode']}) |"
                       " | | | | | | |")
            continue
        s = r["steps"]
        last = s[-1]
        same = all(x["node"] == last["node"] and x["cross"] == last["cross"] for x in s)
        ok = all(x["node"] + x["cross"] == x["wire"] == x.get("accounted") for x in s)
        g = r["ranks_per_node"]
        out.append("| " + " | ".join([
            r["trainer"], r["layout"], r["arm"], f"{last['node']:,.0f}", f"{last['cross']:,.0f}",
            _ratio(last["cross"], flat.get(r["trainer"], 0)) if g else "1.000", f"{1 / g:.3f}" if g else "-",
            "yes" if ok else "**no**", f"{last.get('untouched', 0):,.0f}",
            f"{len(s)}" + ("" if same else " (last shown; they differ)"),
            f"{r.get('wall_s', 0):.0f}"]) + " |")
    return out


def table(d: dict[str, Any]) -> str:
    """The markdown of `d`: per layout the eager paths' bytes per hop, then the trainers'."""
    e = d["eager"]
    lines = [f"# Bytes per hop, flat against two levels ({e['world']} gloo ranks as 2 nodes x 4 and 4 nodes x 2)", "",
             f"`{COMMAND}` (torch {e['torch']}). Rank 0's bytes, as `comm_totals()` (and the trainers' telemetry) "
             "counted them at the collectives: `node` handed to collectives inside a node (`node_wire`), `cross` the "
             "rest (`cross_wire`: across nodes where the group spans them; a flat exchange counts everything there). "
             "`counted = accounted`: every arm's counted (node, cross) equals the package's shape-based accounting "
             "(`bucket_hop_bytes` of the bucket plans that ran, the plain module's native all-reduce of its "
             "unmanaged parameters (values, an arrival flag each, two flags per rank), `hsdp.accounted_bytes`). "
             "`cross / flat` against 1/g: a reduce-scatter's all_to_all across nodes is exactly 1/g of flat's; an "
             "all-reduce still all-gathers one coded shard per rank across nodes, and the plain module's unmanaged "
             "parameters stay one level, so those paths sit above 1/g; HSDP's hops stay one level by layout (its "
             "shard group inside a node, its replica group one rank per node).", "",
             f"## Eager paths: {e['model']}", "", f"`{e['command']}`", "", *_eager_table(e)]
    notes = sorted({f"{p}: {line}" for lay in e["layouts"].values() for p, r in lay["arms"]["two levels"].items()
                    for line in r["exchanges"]})
    lines += ["What the apply report says for each path (the two-level arms):", "", *(f"- {n}" for n in notes), ""]
    t = d.get("torchtitan")
    if t:
        lines += [f"## torchtitan, debug Llama, {t['world']} gloo ranks, {t['steps']} steps", "",
                  f"`{t['command']}`: per step, rank 0's `gift/node_wire_bytes_per_step` and "
                  "`gift/cross_wire_bytes_per_step` from the run's telemetry (`gift_metrics.jsonl`); `node + cross = "
                  "accounted` holds at every step against `gift/accounted_bytes_per_backward`. graph_trainer's "
                  "buckets without a managed weight (embedding, head) are outside both figures "
                  "(`gift/untouched_bytes_per_step`, their native reduce-scatters: one level, so they cross nodes as "
                  "in flat); the FSDP2 trainer's embedding and head ride in GIFT's buckets at fp32 and split in two "
                  "levels with the rest. The flat run does not depend on the layout (one launch per "
                  "trainer). Every launch's exact command is in hop_bytes.json.", "", *_titan_table(t), ""]
        lines += ["What each launch logged about its exchange (rank 0's apply report or rewrite log):", "",
                  *(f"- {r['trainer']}, {r['layout']}, {r['arm']}: {'; '.join(r.get('report') or ['(nothing)'])}"
                    for r in t["runs"]), ""]
        done = {(r["trainer"], r["layout"], r["arm"]) for r in t["runs"] if r["steps"]}
        missing = [", ".join(launch[:3]) for launch in titan_launches() if launch[:3] not in done]
        if missing:
            lines += ["Not run:", "", *(f"- {m}" for m in missing), ""]
    return "\n".join(lines)


def _merge(part: str, value: dict[str, Any]) -> dict[str, Any]:
    d = json.loads(OUT.read_text()) if OUT.exists() else {}
    d = d if ("eager" in d or "torchtitan" in d) else {}  # an earlier format: replaced
    d[part] = value
    d["command"] = COMMAND
    OUT.write_text(json.dumps(d, indent=1) + "\n")
    if "eager" in d:
        TABLE.write_text(table(d))
    return d


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=PARTS, action="append",
                   help="run only this part (repeatable; default both) and merge it into the JSON")
    p.add_argument("--trainers", default=",".join(TRAINERS), help="torchtitan trainers, comma-separated")
    p.add_argument("--arms", default=",".join(ARM_KEYS), help=f"torchtitan arms, comma-separated, of {ARM_KEYS}")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per torchtitan launch")
    p.add_argument("--render", action="store_true", help="only re-render the table from the JSON")
    args = p.parse_args(argv)
    if args.render:
        TABLE.write_text(table(json.loads(OUT.read_text())))
        return 0
    parts = args.part or list(PARTS)
    if "eager" in parts:
        _merge("eager", run_eager())
    if "torchtitan" in parts:
        trainers = [t.strip() for t in args.trainers.split(",")]
        keys = [a.strip() for a in args.arms.split(",")]
        unknown = sorted(set(trainers) - set(TRAINERS)) + sorted(set(keys) - set(ARM_KEYS))
        if unknown:
            p.error(f"unknown trainer or arm: {unknown}; trainers {list(TRAINERS)}, arms {list(ARM_KEYS)}")
        arms_run = [ARM_KEYS[k] for k in keys]
        run_torchtitan(trainers, arms_run, args.timeout, save=lambda t: _merge("torchtitan", t))
    d = json.loads(OUT.read_text())
    if "eager" in d:
        print(table(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
