"""Exit stress: how often a finished 2-rank gloo job aborts as its interpreters exit.

Issue 49 case 10: after both ranks had written their results and called
`destroy_process_group`, one rank died with SIGABRT ("terminate called without an active
exception") in 1 of 3 runs of a job with activation checkpointing around managed layers. The
known mechanism: a `ProcessGroup` object that Python still references outlives
`destroy_process_group` together with gloo's worker threads, and a worker that drops a
collective's last tensor reference during interpreter finalization cannot take the GIL, so the
process aborts. Each job here is two fresh interpreters (no fork, no `exit_without_finalization`)
that finish with three 256 KiB all-reduces of temporaries (a job's last metric reductions) and
`destroy_process_group`, then exit normally. Variants:

* `no-holder`: nothing references the group after the destroy (torch alone);
* `plain-holder`: an object in a reference cycle references the world group (torch alone);
* `gift`: GIFT applied to two checkpointed blocks of managed layers (fp8, `lowrank`), six steps,
  the model reachable from a reference cycle; whatever GIFT holds is what outlives the destroy.

`--python` picks the interpreter, so the `gift` variant runs whichever checkout that
interpreter imports `gift_compile` from (the before/after of a fix). A race: counts, not a
proof; the result says how many exits ran.

    python -m bench.cluster.exit_stress --runs 12 [--python /path/to/venv/bin/python] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from bench.lib.paths import RESULTS

OUT = RESULTS / "cluster" / "exit_stress.json"
VARIANTS = ("no-holder", "plain-holder", "gift")

JOB = '''
import sys, torch, torch.distributed as dist
rank, variant, store = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
keep = []
keep.append(keep)  # a reference cycle: freed, if at all, late in finalization
if variant == "plain-holder":
    keep.append(dist.group.WORLD)
elif variant == "gift":
    import gift_compile
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.n = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64), torch.nn.LayerNorm(64)
        def forward(self, x):
            return self.n(x + self.b(torch.relu(self.a(x))))
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])
        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return x
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gift_compile.apply(model, gift_compile.GiftConfig(format="fp8_e4m3", geometry="lowrank", min_numel=1024, rank=8,
                                                      refresh_every=2, select="all"), optimizer=opt)
    for _ in range(6):
        model(torch.randn(16, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    keep.append(model)
for _ in range(3):
    dist.all_reduce(torch.randn(1 << 16) * 2)
dist.destroy_process_group()
'''


def run_job(python: str, variant: str, workdir: Path, index: int) -> dict[str, object]:
    """One 2-rank job: each rank's exit code and the abort message, if any."""
    store = workdir / f"store_{variant}_{index}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([python, str(workdir / "job.py"), str(rank), variant, str(store)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    codes, aborts = [], []
    for p in procs:
        _, err = p.communicate(timeout=600)
        codes.append(p.returncode)
        aborts.append("terminate called without an active exception" in err)
    return {"codes": codes, "abort_message": any(aborts)}


def block(_: dict) -> str:
    """docs/reliability.md's table of the committed runs (`bench.pages.readme`)."""
    d = json.loads(OUT.read_text())
    lines = [f"Exits of finished 2-rank gloo jobs (`{d['command']}`; a job failed when a rank's exit code was not 0; "
             "a race, so counts, not a proof):", "",
             "| variant | checkout | jobs | failed | with the abort message | exit codes |", "|---|---|---|---|---|---|"]
    totals: dict[tuple[str, str], dict[str, object]] = {}  # the invocations of one variant and checkout, summed
    for r in d["rows"]:
        t = totals.setdefault((r["variant"], r["label"]), {"jobs": 0, "failed_jobs": 0, "abort_message": 0, "codes": set()})
        for key in ("jobs", "failed_jobs", "abort_message"):
            t[key] += r[key]
        t["codes"] |= set(r["exit_codes"])
    for (variant, label), t in totals.items():
        lines.append(f"| {variant} | {label} | {t['jobs']} | {t['failed_jobs']} | {t['abort_message']} | "
                     f"{', '.join(map(str, sorted(t['codes'])))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=12, help="jobs per variant")
    ap.add_argument("--python", default=sys.executable, help="the interpreter (and so the checkout) that runs the jobs")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--label", default="", help="names the checkout in the result (e.g. a commit)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    results = json.loads(args.out.read_text()) if args.out.exists() else {"rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "job.py").write_text(JOB)
        for variant in args.variants.split(","):
            if variant not in VARIANTS:
                raise SystemExit(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
            jobs = [run_job(args.python, variant, work, i) for i in range(args.runs)]
            row = {"variant": variant, "label": args.label, "jobs": len(jobs),
                   "failed_jobs": sum(any(c != 0 for c in j["codes"]) for j in jobs),
                   "abort_message": sum(j["abort_message"] for j in jobs),
                   "exit_codes": sorted({c for j in jobs for c in j["codes"]})}
            results["rows"].append(row)
            print(json.dumps(row))
    results["command"] = "python -m bench.cluster.exit_stress --runs N --python PY --label LABEL"
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
