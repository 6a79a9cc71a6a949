"""The "Selection churn" block of docs/benchmarks.md, from `bench/results/cluster/selection_churn.json`
(`bench.cluster.selection_churn`): compilations and retraces when every block's selection differs and
changes at every refresh, and what carrying the selection as data costs a traced codec."""

from __future__ import annotations

import json

from bench.lib.formatting import table
from bench.lib.paths import RESULTS

CHURN = RESULTS / "cluster" / "selection_churn.json"


def _fsdp2(d: dict) -> list[str]:
    rows = [[r["blocks"], r["steps"], r["selection_changes"], r["distinct_block_patterns"],
             r["distinct_model_patterns"], r["exchange_bodies"]["bodies"], r["exchange_bodies"]["recompiles"],
             r["block_graphs"], r["dynamo_unique_graphs"], r["first_step_s"], r["later_step_s_median"],
             r["fp32_bytes"] / r["wire_bytes"]] for r in d["runs"]]
    return [f"FSDP2 through `gift_compile.apply` (`{d['command']}`, {d['date']}; 2 gloo ranks, TinyLlama dim 64, "
            "every block `fully_shard`-ed and compiled with Inductor as torchtitan does, nvfp4 low-rank maps refreshed "
            "at every step, each block's four attention linears set to another selected subset before every step; the "
            "feed-forward, embedding and output weights travel at fp32, hence the small byte ratio; jobs run in the "
            "order listed, so a later one starts with the Inductor cache an earlier one filled):",
            "", table(["blocks", "steps", "selection changes", "block patterns", "model patterns", "exchange bodies",
                       "body recompiles", "block graphs", "dynamo graphs", "first step s", "later step s (median)",
                       "fp32 / wire bytes"], rows, 3), ""]


def _graph_trainer(d: dict) -> list[str]:
    steps = {int(k): v for k, v in d["step_s"].items()}
    slowest = max(steps, key=steps.get)
    after_first = d["layer_flips_between_refreshes"]
    return [f"graph_trainer (`{d['command']}`, {d['date']}: `{d['config']}` on {d['nproc']} gloo ranks, "
            f"{' '.join(d['overrides'])}): {d['steps']} steps in {d['wall_s']:.0f} s; {d['refreshes_measured']} "
            f"refreshes decided the selection, {sum(after_first)} layer flips after the first decision "
            f"({', '.join(str(f) for f in after_first)} per refresh; {d['selection_changes']:.0f} selection changes "
            f"counted in all), and the step was retraced {d['retraces_all_ranks'] // d['nproc']} time(s) per rank: "
            f"plan version {d['plan_version']:.0f}, set once by the first refresh's shared statistics. Slowest step "
            f"{slowest} ({steps[slowest]:.1f} s: the retrace); median step {d['step_s_median']:.2f} s.", ""]


def _codec(d: dict) -> list[str]:
    rows = [[op.replace("_", "-"), b["identity"], b["gated_off"], b["lowrank"], b["gated_on"]]
            for op, b in d["bytes_per_element"].items()]
    return [f"What the selection as data costs a traced graph's codec (`{d['command']}`, {d['date']}; one "
            f"{d['shape'][0]}x{d['shape'][1]} item, {d['format']}, {d['world']} ranks, rank {d['rank']}; bytes per "
            "element from the generated kernels): a deselected layer's graph now runs its map with the identity's "
            "values; the eager and hook paths still run no map for it.", "",
            table(["op", "deselected before", "deselected now", "selected before", "selected now"], rows, 3), ""]


def selection_churn(_: dict) -> str:
    """The block: one part per measurement present in the results file."""
    d = json.loads(CHURN.read_text())
    parts = {"fsdp2": _fsdp2, "graph_trainer": _graph_trainer, "codec": _codec}
    missing = sorted(set(parts) - set(d))
    if missing:
        raise ValueError(f"{CHURN.name} lacks {missing}: run `python -m bench.cluster.selection_churn <part>` for each")
    return "\n".join(line for name, render in parts.items() for line in render(d[name])).rstrip()
