"""Selection churn: compilations when every block's selection differs and changes at every refresh.

What `select="auto"` with `reselect_every=1` can do to a deep model: each block keeps its own
subset of layers on the transformed path, and the subsets move at every refresh. Before the
exchange compiled per item plan and traced graphs carried the selection as data (issue 31), each
distinct pattern was one more compilation and the 9th killed the run (dynamo's recompile_limit).

`fsdp2` measures it on the path a user of `gift_compile.apply` takes: TinyLlama with `--blocks`
fully_shard-ed blocks, each block compiled as torchtitan compiles it (`block.compile(fullgraph=True)`,
Inductor), GIFT refreshing its maps every step; before every step each block's four attention
linears get another selected subset (`_pattern`: a different one per block and per step, set
with `GiftState.set_selected` as a refresh's decision does). It records the steps run, the
selection changes, how many distinct patterns ran, the exchange's compiled bodies and their
recompiles, the compiled block's graphs, dynamo's graph count for the process, and the bytes
handed to the collectives.

`graph_trainer` reads a torchtitan graph_trainer run (`llama3_debug_gift_graph`, measured
selection re-decided at every refresh) from its log and telemetry: retraces of the step, their
time, and the selection changes that did not retrace.

`codec` records what carrying the selection as data costs a traced graph's codec, in bytes per
element from the generated kernels (`bench.fidelity.codec_per_item.gated`), before and after.

    python -m bench.cluster.selection_churn fsdp2 --blocks 12 32
    python -m bench.cluster.selection_churn graph_trainer --steps 24
    python -m bench.cluster.selection_churn codec

Each writes its section of bench/results/selection_churn.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from bench.lib.paths import RESULTS

RESULTS = RESULTS / "cluster" / "selection_churn.json"
LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
FSDP2_CFG = dict(format="nvfp4", geometry="lowrank", rank=8, refresh_every=1, refresh_warmup=0, min_numel=1024,
                 select="none", exclude=("*embed*", "*output*", "*feed_forward*"))


def _pattern(block: int, step: int) -> tuple[bool, ...]:
    """Which of a block's linears are selected at `step`: one of the 16 subsets, different from
    block to block (5 is odd, so 16 consecutive blocks get all 16) and from step to step."""
    code = (block * 5 + step * 3 + 1) % (2 ** len(LINEARS))
    return tuple(bool(code >> i & 1) for i in range(len(LINEARS)))


def _fsdp2_worker(rank: int, world: int, store: str, n_blocks: int, steps: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import gift_compile
    from bench.lib.tiny_llama import TinyLlama, TinyLlamaConfig, TransformerBlock, loss
    from gift_compile.config import GiftConfig
    from gift_compile.exchange import compiled_bodies

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = TinyLlama(TinyLlamaConfig(dim=64, n_layers=n_blocks, n_heads=2, vocab_size=128, multiple_of=64,
                                      max_seq_len=16))
    for block in model.layers:
        block.compile(fullgraph=True, dynamic=False)
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gift_compile.apply(model, GiftConfig(**FSDP2_CFG), optimizer=opt)
    st = gift_compile.state(model)
    step_s, patterns = [], set()
    for step in range(steps):
        for b in range(n_blocks):
            for lin, on in zip(LINEARS, _pattern(b, step)):
                st.set_selected(st.layers[f"layers.{b}.{lin}.weight"], on)
        patterns.add(tuple(_pattern(b, step) for b in range(n_blocks)))
        x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        start = time.perf_counter()
        loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        step_s.append(time.perf_counter() - start)
    entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(TransformerBlock.forward.__code__)
    totals = st.comm_totals()
    result = {
        "blocks": n_blocks, "steps": steps, "world": world, "selection_changes": st.selection_changes,
        "refreshes": len(st.history), "distinct_model_patterns": len(patterns),
        "distinct_block_patterns": len({_pattern(b, s) for b in range(n_blocks) for s in range(steps)}),
        "exchange_bodies": compiled_bodies.stats(), "item_plans": compiled_bodies.live_item_plans(),
        "block_graphs": len(entries), "dynamo_unique_graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
        "plan_version": st.plan_version, "first_step_s": step_s[0], "later_step_s_median": sorted(step_s[1:])[len(step_s[1:]) // 2],
        "wire_bytes": int(totals["wire"]), "fp32_bytes": int(totals["baseline"]),
    }
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def fsdp2(blocks: list[int], steps: int) -> list[dict]:
    """One 2-rank FSDP2 job per block count (a fresh process each: no compilation carried over)."""
    rows = []
    for n in blocks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            start = time.perf_counter()
            mp.spawn(_fsdp2_worker, args=(2, os.path.join(tmp, "store"), n, steps, out), nprocs=2, join=True)
            row = json.loads(Path(out).read_text())
        row["wall_s"] = time.perf_counter() - start
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def graph_trainer(steps: int, fmt: str, folder: str) -> dict:
    """A graph_trainer run whose measured selection is re-decided at every refresh (every 2 steps):
    retraces counted from the pre-step hook's log lines, selection changes from telemetry."""
    from gift_compile.torchtitan_ext.cpu.runs import run_config

    overrides = ["--validator.no-enable", f"--training.steps={steps}", f"--gift.format={fmt}",
                 "--gift.refresh-every=2", "--gift.refresh-warmup=1", "--gift.reselect-every=1",
                 "--gift.geometry=lowrank", "--gift.auto-max-overhead=1.0"]
    run = run_config("llama3_debug_gift_graph", overrides, dump_folder=folder, nproc=2, timeout_s=60 * steps + 900)
    run.check()
    retraces = re.findall(r"retracing the step", run.output)
    times = {r["step"]: r["time"] for r in run.records}
    steps_s = {s: times[s] - times[s - 1] for s in sorted(times) if s - 1 in times}
    decided = [{k.split("/", 2)[2]: bool(v) for k, v in r.items() if k.startswith("gift/selected/")}
               for r in run.records]
    decided = [d for d in decided if d]
    flips = [sum(a[k] != b[k] for k in b) for a, b in zip(decided, decided[1:])]
    ordered = sorted(steps_s.values())
    return {"config": "llama3_debug_gift_graph", "overrides": overrides, "nproc": 2, "steps": steps,
            "wall_s": run.wall_s, "retraces_all_ranks": len(retraces),
            "selection_changes": run.last("gift/selection_changes"), "plan_version": run.last("gift/plan_version"),
            "refreshes_measured": len(decided), "layer_flips_between_refreshes": flips,
            "selected_by_step": {r["step"]: r["gift/selected_layers"] for r in run.records},
            "step_s": steps_s, "step_s_median": ordered[len(ordered) // 2] if ordered else None}


def _save(section: str, value: object) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[section] = value
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    f = sub.add_parser("fsdp2")
    f.add_argument("--blocks", type=int, nargs="+", default=[12, 32])
    f.add_argument("--steps", type=int, default=10)
    g = sub.add_parser("graph_trainer")
    g.add_argument("--steps", type=int, default=24)
    g.add_argument("--format", default="int2")
    g.add_argument("--folder", default=None)
    c = sub.add_parser("codec")
    c.add_argument("--format", default="nvfp4")
    c.add_argument("--world", type=int, default=8)
    args = parser.parse_args(argv)
    command = "python -m bench.cluster.selection_churn " + " ".join(argv if argv is not None else os.sys.argv[1:])
    if args.what == "fsdp2":
        _save("fsdp2", {"command": command, "date": time.strftime("%Y-%m-%d"), "runs": fsdp2(args.blocks, args.steps)})
    elif args.what == "codec":
        from bench.fidelity.codec_per_item import gated

        _save("codec", {"command": command, "date": time.strftime("%Y-%m-%d"), "format": args.format,
                        "world": args.world, "shape": [256, 512], "rank": 8,
                        "bytes_per_element": {op: gated(args.format, op, args.world)
                                              for op in ("reduce_scatter", "all_reduce")}})
    else:
        with tempfile.TemporaryDirectory() as tmp:
            row = graph_trainer(args.steps, args.format, args.folder or tmp)
        _save("graph_trainer", {"command": command, "date": time.strftime("%Y-%m-%d"), **row})


if __name__ == "__main__":
    main()
