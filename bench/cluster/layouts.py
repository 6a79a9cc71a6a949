"""Every torchtitan layout with GIFT, measured: one row per layout and trainer.

The layouts torchtitan combines for a Llama run (FSDP, DDP, HSDP, TP, PP, CP and their
products, 2 to 8 gloo ranks of the debug Llama), each on both trainers, and expert parallelism
with FSDP, HSDP (a one-rank and a two-rank efsdp), TP or PP on the debug MoE, on both trainers;
the table is `bench.cluster.layout_table`. A row runs, holds the refusal GIFT raised (whose
reason must name the torch or torchtitan limit), or, where a run failed otherwise, that failure
with whether GIFT off fails too (torchtitan's limit then, not GIFT's); a planned row not measured
yet renders "not run". The suite checks each 4-rank layout on its own (tests/test_torchtitan_*.py);
the 8-rank ones take about a minute per FSDP2 run and up to four per graph_trainer run on a
2-core box, so the suite holds only the FSDP2 rows of HSDP x TP and PP x TP x FSDP
(tests/test_torchtitan_layouts8.py), and the 8-rank CP layouts (HSDP x CP x TP, PP x CP x TP)
are measured here only. This bench records, per layout and trainer, three runs with the same
seed, init and data (GIFT low-bit, GIFT fp32, GIFT off), or the refusal the first run raised.
Per run: the bytes each hop handed to its collectives (counted at run time) against the bytes
its plans account for, at every step and on every rank that writes telemetry (rank 0; under PP
the first rank of each pipeline rank), against fp32's; the losses; whether a refusal or a GIFT
warning is in the log. Per row: whether fp32 reproduces GIFT-off's losses exactly, and the
low-bit run's largest per-step loss distance from GIFT-off.

    python -m bench.cluster.layouts [--only hsdp_tp/graph ...] [--steps 3]
    python -m bench.cluster.layouts --kill-resume [--only ...]

writes (merges its rows into) bench/results/cluster/layouts.json; `bench.pages.layouts.layouts` renders
the table on docs/benchmarks.md. ``--kill-resume`` adds to each row that runs the fault the
suite checks on 2 and 4 ranks (tests/test_torchtitan_train.py): 6 steps at nvfp4 with the low-rank K-FAC
map, error feedback and a checkpoint every 3 steps, uninterrupted; then the same command with
rank 1 SIGKILLed after step 4, relaunched on its folder: the losses of steps 4-6 and every
trained tensor of the final checkpoint (parameters, optimizer, GIFT state) against the
uninterrupted run's (`gift_compile.torchtitan_ext.cpu.kill_resume`). Where they differ, the same
fault runs with GIFT off too, so the row says whether the difference is GIFT's or torchtitan's
own resume on that layout (with the tensors that differ in each).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cluster.layout_table import EXTRA, LAYOUT_GIFT, LAYOUTS, configs, order, planned
from bench.lib.provenance import commit
from gift_compile.torchtitan_ext.hooks import REFUSAL
from gift_compile.torchtitan_ext.cpu.kill_resume import KillResume, kill_and_resume
from gift_compile.torchtitan_ext.cpu.runs import RunResult, run_config
from bench.lib.paths import RESULTS

RESULTS = RESULTS / "cluster" / "layouts.json"
LOW_BIT = "nvfp4"
# GIFT's arms: a refresh after step 2 puts step 3 on the measured selection; the replica hop
# (HSDP) at the shard hop's format
ARMS = {"low_bit": [f"--gift.format={LOW_BIT}", f"--gift.replica-format={LOW_BIT}"],
        "fp32": ["--gift.format=fp32", "--gift.replica-format=fp32"]}
GIFT = ["--gift.refresh-every=2", "--gift.no-fuse"]
# (hop, counted-at-run-time key, accounted key, fp32 key); the shard hop's accounting is
# `gift/accounted_bytes_per_backward` without HSDP and the per-hop key with it
HOPS = (("shard", "gift/wire_bytes_per_step", ("gift/shard_accounted_bytes_per_backward",
                                                "gift/accounted_bytes_per_backward"), "gift/baseline_bytes_per_step"),
        ("replica", "gift/replica_wire_bytes_per_step", ("gift/replica_accounted_bytes_per_backward",),
         "gift/replica_baseline_bytes_per_step"))


def user_command(run: RunResult) -> str:
    """The torchrun command of `run` as a user types it (no interpreter path, no dump folder)."""
    args = run.command[3:]  # after `python -m torch.distributed.run`
    i = args.index("--dump-folder")
    return " ".join(["torchrun", *args[:i], *args[i + 2:]])


def hop_bytes(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per hop, over the logged steps of one rank's records: the bytes counted at the collective,
    the accounted bytes and fp32's (each a list by step), and whether counted == accounted at
    every step."""
    steps = [r for r in records if "loss" in r or "gift/wire_bytes_per_step" in r]
    out = {}
    for hop, counted, accounted_keys, fp32 in HOPS:
        if not any(counted in r for r in steps):
            continue
        accounted = next(k for k in accounted_keys if any(k in r for r in steps))
        row = {"counted": [r[counted] for r in steps], "accounted": [r[accounted] for r in steps],
               "fp32": [r[fp32] for r in steps]}
        row["counted_equals_accounted"] = row["counted"] == row["accounted"]
        out[hop] = row
    return out


def replica_only(hops: dict[str, dict[str, Any]], rewrite: str | None) -> dict[str, dict[str, Any]]:
    """`hops` with graph_trainer's DDP hop named for what it is: replication alone (SimpleFSDP's
    replicate mode) traces one all-reduce per gradient over the replicas, which the pass rewrites
    and the telemetry counts on GIFT's first hop (its ``gift/wire_bytes_per_step``); the row calls
    it the replica hop, as the FSDP2 trainer's DDP row does."""
    if rewrite and " all-reduces " in rewrite and " reduce-scatters " not in rewrite and set(hops) == {"shard"}:
        return {"replica": hops["shard"]}
    return hops


def describe(run: RunResult) -> dict[str, Any]:
    """What one run recorded (see the module docstring)."""
    lines = run.output.splitlines()
    rewrite = [line.split(" - INFO - ", 1)[1] for line in lines if "GIFT rewrite:" in line]
    out: dict[str, Any] = {
        "command": user_command(run), "wall_s": round(run.wall_s, 1), "returncode": run.returncode,
        "losses": run.losses(), "refusal_in_log": REFUSAL in run.output,
        "gift_warnings": len(run.gift_warnings()),
        # each distinct warning once (every rank logs it), from its "GIFT" on
        "gift_warning_lines": sorted({line[line.index("GIFT"):] for line in run.gift_warnings()}),
        "replicas_bit_identical_logged": "replicas bit-identical" in run.output,
        "rewrite": rewrite[-1] if rewrite else None,
    }
    if run.stages:
        out["hops_by_pipeline_rank"] = {str(k): hop_bytes(v) for k, v in sorted(run.stages.items())}
    elif run.records and any("gift/wire_bytes_per_step" in r for r in run.records):
        out["hops"] = replica_only(hop_bytes(run.records), out["rewrite"])
    errs = [r["gift/err_euclidean_mean"] for r in run.records if "gift/err_euclidean_mean" in r]
    if errs:
        out["err_euclidean_mean_at_refresh"] = errs[-1]
    return out


def refusal(run: RunResult) -> str | None:
    """The refusal a failed run raised (its message), or None when it failed otherwise."""
    found = re.search(rf"ValueError: ({re.escape(REFUSAL)}.*)", run.output)
    return found.group(1) if found else None


def failure(run: RunResult) -> str:
    """The error a run that failed without a refusal ended with: the first exception any rank
    printed (the others' usually follow from it: a peer's closed connection, torchrun's
    ChildFailedError), else its return code."""
    for line in run.output.splitlines():
        found = re.match(r"(?:\[rank\d+\]:\s*)?((?:\w+\.)*\w*(?:Error|Exception): .*)", line)
        if found and "ChildFailedError" not in found.group(1):
            return found.group(1)
    return f"exit code {run.returncode}, no exception in the log"


def row(layout: str, trainer: str, steps: int, folder: str) -> dict[str, Any]:
    """One layout x trainer: the three runs, the refusal its first (low-bit) run raised, or the
    failure of a run, with whether GIFT off fails too (torchtitan's limit then, not GIFT's)."""
    title, nproc, dims = LAYOUTS[layout]
    base = [*dims, *EXTRA.get((layout, trainer), []), "--validator.no-enable", f"--training.steps={steps}",
            "--metrics.log-freq=1"]
    gift_config, off_config = configs(layout, trainer)
    gift = [*GIFT, *LAYOUT_GIFT.get((layout, trainer), [])]
    out: dict[str, Any] = {"layout": title, "trainer": trainer, "nproc": nproc, "steps": steps,
                           "date": time.strftime("%Y-%m-%d"), "commit": commit(), "machine": machine()}
    arms_args = {"low_bit": (gift_config, [*base, *gift, *ARMS["low_bit"]]),
                 "fp32": (gift_config, [*base, *gift, *ARMS["fp32"]]), "off": (off_config, base)}

    def launch(arm: str) -> RunResult:
        config, overrides = arms_args[arm]
        run = run_config(config, overrides, dump_folder=os.path.join(folder, f"{layout}.{trainer}.{arm}"),
                         nproc=nproc, timeout_s=1800)
        print(f"{layout} {trainer} {arm}: rc {run.returncode}, {run.wall_s:.0f} s", flush=True)
        return run

    runs = {}
    for arm in arms_args:
        run = launch(arm)
        if run.returncode != 0:
            why = refusal(run)
            if arm == "low_bit" and why is not None:
                return {**out, "status": "refused", "reason": why, "command": user_command(run),
                        "wall_s": round(run.wall_s, 1)}
            off = run if arm == "off" else launch("off")
            return {**out, "status": "failed", "failed_arm": arm, "reason": failure(run),
                    "command": user_command(run), "wall_s": round(run.wall_s, 1),
                    "off_command": user_command(off), "off_fails": off.returncode != 0,
                    "off_reason": failure(off) if off.returncode != 0 else None}
        runs[arm] = run
    low, exact, off = (runs[a].losses() for a in ("low_bit", "fp32", "off"))
    arms = {arm: describe(run) for arm, run in runs.items()}
    hops = [h for arm in ("low_bit", "fp32") for h in _all_hops(arms[arm])]
    return {
        **out, "status": "runs", "low_bit_format": LOW_BIT, "arms": arms,
        "fp32_losses_equal_off": exact == off,
        "fp32_max_abs_loss_diff": max(abs(exact[s] - off[s]) for s in off),
        "low_bit_max_abs_loss_diff": max(abs(low[s] - off[s]) for s in off),
        "low_bit_losses_finite": all(math.isfinite(v) for v in low.values()),
        "low_bit_moved_a_loss": any(low[s] != off[s] for s in off),
        "counted_equals_accounted_every_hop": all(h["counted_equals_accounted"] for h in hops),
    }


KILL_STEPS = 6
KILL_ARGS = [f"--training.steps={KILL_STEPS}", "--validator.no-enable", "--metrics.log-freq=1", "--gift.refresh-every=3",
             "--gift.geometry=lowrank", "--gift.error-feedback", "--gift.no-fuse", "--checkpoint.enable",
             "--checkpoint.interval=3", *ARMS["low_bit"]]


def _fault(config: str, args: list[str], root: Path, nproc: int) -> tuple[RunResult, KillResume]:
    """One kill-and-resume fault of `config args` under `root` (its name the row's label): the
    uninterrupted run, then the killed and relaunched one compared with it."""
    full = run_config(config, args, dump_folder=str(root / "full"), nproc=nproc, timeout_s=1800).check()
    print(f"{root.name} uninterrupted: {full.wall_s:.0f} s", flush=True)
    found = kill_and_resume(config, args, root / "killed", full, root / "full", steps=KILL_STEPS, after_step=4,
                            nproc=nproc)
    return full, found


def kill_resume(layout: str, trainer: str, folder: str) -> dict[str, Any]:
    """The kill-and-resume record of one layout x trainer (module docstring)."""
    _, nproc, dims = LAYOUTS[layout]
    args = [*dims, *EXTRA.get((layout, trainer), []), *KILL_ARGS, *LAYOUT_GIFT.get((layout, trainer), [])]
    gift_config, off_config = configs(layout, trainer)
    full, found = _fault(gift_config, args, Path(folder) / f"{layout}.{trainer}.kill", nproc)
    record = {**found.summary(), "command": user_command(full), "uninterrupted_wall_s": round(full.wall_s, 1),
              "selected_layers_after_refresh": max(r.get("gift/selected_layers", 0) for r in full.records),
              "date": time.strftime("%Y-%m-%d"), "commit": commit(), "machine": machine()}
    if not found.bit_identical:  # GIFT's, or torchtitan's with GIFT off too: the same fault without GIFT
        off_args = [a for a in args if not a.startswith("--gift.")]
        off_full, off = _fault(off_config, off_args, Path(folder) / f"{layout}.{trainer}.kill_off", nproc)
        record["gift_off"] = {**off.summary(), "command": user_command(off_full),
                              "differing_names": sorted(off.differing)}
        record["differing_names"] = sorted(found.differing)
    return record


def _all_hops(described: dict[str, Any]) -> list[dict[str, Any]]:
    """Every hop record of one described run (each pipeline rank's under PP)."""
    if "hops_by_pipeline_rank" in described:
        return [h for by in described["hops_by_pipeline_rank"].values() for h in by.values()]
    return list(described.get("hops", {}).values())


def machine() -> str:
    """The box the rows ran on (cores and load when the bench started)."""
    load = os.getloadavg()
    return f"{os.cpu_count()} CPU cores shared with other jobs (load {load[0]:.1f} at start), gloo, OMP_NUM_THREADS=1"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.cluster.layouts", description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", default=None, help="rows as layout/trainer (default: all)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--kill-resume", action="store_true", help="add the kill-and-resume record to rows that run")
    a = p.parse_args(argv)
    keys = a.only or planned()
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": {}}
    data["command"] = "python -m bench.cluster.layouts"
    with tempfile.TemporaryDirectory() as folder:
        for key in keys:
            layout, trainer = key.split("/")
            start = time.perf_counter()
            if a.kill_resume:
                if data["rows"].get(key, {}).get("status") != "runs":
                    print(f"{key}: no row that runs, no kill-and-resume", flush=True)
                    continue
                data["rows"][key]["kill_resume"] = kill_resume(layout, trainer, folder)
                data["kill_resume_command"] = "python -m bench.cluster.layouts --kill-resume"
                RESULTS.write_text(json.dumps(data, indent=1) + "\n")
                print(json.dumps(data["rows"][key]["kill_resume"]), flush=True)
                continue
            data["rows"][key] = {**row(layout, trainer, a.steps, folder), "row_wall_s": round(time.perf_counter() - start),
                                 **({"kill_resume": data["rows"][key]["kill_resume"]}
                                    if "kill_resume" in data["rows"].get(key, {}) else {})}
            data["rows"] = dict(sorted(data["rows"].items(), key=lambda kv: order(kv[0])))
            RESULTS.write_text(json.dumps(data, indent=1) + "\n")  # each row as soon as it is measured
            print(json.dumps({k: v for k, v in data["rows"][key].items() if k != "arms"}), flush=True)


if __name__ == "__main__":
    main()
