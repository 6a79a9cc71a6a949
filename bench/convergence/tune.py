"""Short paired runs that judge GIFT variants where Euclidean communication costs loss.

    python -m bench.convergence.tune [--format nvfp4] [--seeds 0,1,2] [--steps 200] [--optimizer muon|adamw]
        [--variants plain,mom,...] [--baselines plain,ef,...] [--out bench/results/convergence/tuning.json]

Under Muon (the paper's optimizer, or `--optimizer adamw`), at one wire format, every arm of a seed shares init and
data order with that seed's fp32 arm (`bench.convergence.runner`): Euclidean and GIFT, each plain and
with stochastic rounding (`-sr`) or error feedback (`-ef`), and GIFT with dense whitening
(`-dense`), exact statistics instead of the sketch (`-exact`), rank 64 (`-r64`), a refresh
every 5 steps (`-rf5`), the gradient-side factor (`-grad`) and the gradient-side factor of
the optimizer's momentum (`-mom`, `GiftConfig(geometry="momentum")`, with damping 1e-2: `-mom-d2`),
and the two-sided experiment (`-two`, `bench.convergence.runner.TwoSided`, not in the product). The fidelity bench is the
fast instrument that proposes variants; these runs decide. Writes the per-run records and
the paired summary (GIFT variant minus Euclidean with the same rounding, 95% CI) as JSON and
prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from bench.convergence import runner as convergence, arms as convergence_arms
from bench.lib.settings import profile
from gift_compile.torchtitan_ext.cpu import corpus
from bench.lib.paths import RESULTS

VARIANTS = ("gift-{f}", "gift-{f}-sr", "gift-{f}-ef", "gift-{f}-dense", "gift-{f}-exact", "gift-{f}-r64",
            "gift-{f}-rf5", "gift-{f}-grad", "gift-{f}-mom", "gift-{f}-mom-d2", "gift-{f}-two")
BASELINES = ("euclid-{f}", "euclid-{f}-sr", "euclid-{f}-ef")


def _suffix(arm: str) -> str:
    """`plain` for `*-{f}`, else the modifier after the format (`sr`, `ef`, `mom`, ...)."""
    return arm.split("-", 2)[-1] if arm.count("-") > 1 else "plain"  # "mom-d2" stays whole


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="nvfp4", choices=sorted(convergence_arms.FORMATS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--variants", default=",".join(_suffix(v) for v in VARIANTS),
                   help="which GIFT variants (plain, sr, ef, dense, exact, r64, rf5, grad, mom, mom-d2, two)")
    p.add_argument("--baselines", default=",".join(_suffix(b) for b in BASELINES),
                   help="which Euclidean arms besides fp32 (plain, sr, ef)")
    p.add_argument("--optimizer", default="muon", choices=("muon", "adamw"))
    p.add_argument("--profile", choices=("smoke", "full"), default="full",
                   help="model and batch sizes of the runs (smoke: the tiny CI model)")
    p.add_argument("--out", type=Path, default=RESULTS / "convergence" / "tuning.json")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    f = a.format
    wanted, baselines = set(a.variants.split(",")), set(a.baselines.split(","))
    gift = [v.format(f=f) for v in VARIANTS if _suffix(v) in wanted]
    arms = ("fp32",) + tuple(b.format(f=f) for b in BASELINES if _suffix(b) in baselines) + tuple(gift)
    base = profile(a.profile).convergence
    s = dataclasses.replace(base, steps=a.steps, seeds=tuple(int(x) for x in a.seeds.split(",")),
                            arms=((a.optimizer, arms),), eval_every=a.steps)
    result = convergence.run(s, corpus.prepare(), print, jsonl=a.out.with_suffix(".jsonl"))
    result["command"] = "python -m bench.convergence.tune " + " ".join(argv if argv is not None else sys.argv[1:])
    a.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    res = result["optimizers"][a.optimizer]
    print(f"\n{f}, {a.optimizer}, {a.steps} steps, seeds {s.seeds}: held-out bits/byte minus fp32 (95% CI), and GIFT "
          "minus the Euclidean arm with the same rounding / error feedback")
    for arm, v in res["arms"].items():
        d = v["paired_diff_bpb"]
        line = f"  {arm:24s} {d['mean']:+.4f} ± {d['ci95']:.4f}"
        gap = res["gaps"].get(arm.removeprefix("gift-"))
        if gap is not None:
            g = gap["gift_minus_euclid"]
            line += f"   vs Euclidean {g['mean']:+.4f} ± {g['ci95']:.4f}, gap closed {100 * gap['share_closed']:.0f}%"
        print(line)
    return result


if __name__ == "__main__":
    main()
