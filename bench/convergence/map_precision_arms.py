"""The convergence arms at the tensor-core map's precision: what TF32 / bf16 operands in GIFT's
low-rank map do to training, paired per seed with the exact-map arms.

`bench.fidelity.map_precision` measures what the operand rounding does to the codec's error on single
gradients; whether it moves training is what a GPU user of `map_precision="auto"` (TF32 on
CUDA) needs to know. The arms `gift-<fmt>-dflt-tf32` / `-bf16` (`bench/convergence/map_precision_runs.sh`)
train exactly as the frontier's `gift-<fmt>-dflt` (reduce-scatter path, 2 gloo ranks, Muon, 120
steps, the same seeds, data and initialisation) with the map's matmul operands rounded as the
kernels round them (`bench.fidelity.map_emulation.tensor_core_map`, emulated on the CPU). No new
measurement here: this reads the runs.

- Each precision run is paired with the exact-map run of the same seed and format from the SAME
  runs file, i.e. run by the same code (the script reruns the exact arms): the committed exact
  runs (`bench.convergence.frontier.RUN_FILES`) predate code changes that move the loss before any map is
  active, so pairing with them would add that drift to the rounding's effect. The drift itself
  (exact rerun minus committed exact run, same seed) is shown for scale.
- Per arm, the paired difference `precision - exact`: the final held-out bits/byte (the
  frontier's y) and the training loss over the last `TAIL` steps, mean with a t-based 95% CI
  over the seeds (`bench.lib.stats.paired`).
- Family: every comparison with n >= 2 in the table (arms x both metrics); a difference counts
  as resolved where Holm's step-down rejects it at a family-wise 5% (`bench.lib.stats.holm`).
- Scale: fp32's own 95% CI half-width over its committed seeds (the frontier's band), the
  seed-to-seed noise a change in held-out bits/byte is read against; and what the map is for,
  GIFT's gain over Euclidean at the same format (`euclid-<fmt>` minus the exact arm, paired per
  seed over the committed runs), of which the far end of the change's CI is given as a share.

The runs file may be partial (a background study): every arm is listed with the seeds it has.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from bench.convergence.arms import EMULATED_PRECISIONS, run_key
from bench.lib.formatting import paired_ci
from bench.convergence.frontier import RESULTS, RUN_FILES, STUDY, load
from bench.lib.stats import holm, paired, t_quantile

RUNS = RESULTS / "convergence_runs_map_precision.jsonl"
# the arms in the order `bench/convergence/map_precision_runs.sh` runs them: TF32 first (the GPU default)
ARMS = ("gift-nvfp4-dflt-tf32", "gift-int2-dflt-tf32", "gift-nvfp4-dflt-bf16", "gift-int2-dflt-bf16")
SEEDS = 5  # the seeds each arm is run for (0-4, as its exact-map arm)
OPTIMIZER = "muon"
TAIL = 10  # steps of training loss averaged at the end of a run
ALPHA = 0.05
METRICS = ("held-out bits/byte", f"training loss, last {TAIL} steps")
PRECISION_NAMES = {"tf32": "TF32", "bf16": "bf16"}
DIGITS = 6  # the changes are far below the frontier's 4 digits
COMMAND = "bash bench/convergence/map_precision_runs.sh && python -m bench.pages.readme"


def exact_twin(arm: str) -> str:
    """The exact-map arm an arm is paired with: its name without the precision modifier."""
    parts = arm.split("-")
    twin = "-".join(p for p in parts if p not in EMULATED_PRECISIONS)
    if twin == arm:
        raise ValueError(f"arm {arm!r} has no map-precision modifier ({sorted(EMULATED_PRECISIONS)})")
    return twin


def _metrics(r: dict) -> tuple[float, float]:
    """(final held-out bits/byte, mean training loss over the last `TAIL` steps) of a run."""
    return float(r["evals"][-1][1]), statistics.fmean(r["losses"][-TAIL:])


def _by_arm(runs: list[dict], optimizer: str) -> dict[str, dict[int, dict]]:
    """`arm -> seed -> run` of `optimizer`'s runs of the frontier's design (`STUDY`) only."""
    by: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in runs:
        if r["optimizer"] == optimizer and run_key(r)[:3] == STUDY:
            by[r["arm"]][r["seed"]] = r
    return by


def summarise(runs: list[dict], committed: list[dict], arms: tuple[str, ...] = ARMS,
              optimizer: str = OPTIMIZER) -> dict[str, object]:
    """Per arm: the seeds it shares with its exact twin in `runs` (the same code), the paired
    differences of both metrics, Holm over every comparison with n >= 2, and the drift of the
    exact twin from its `committed` runs; fp32's band from `committed`."""
    by, old = _by_arm(runs, optimizer), _by_arm(committed, optimizer)
    fp32 = [_metrics(r)[0] for r in old["fp32"].values()]
    band = (t_quantile(0.975, len(fp32) - 1) * statistics.stdev(fp32) / math.sqrt(len(fp32))
            if len(fp32) > 1 else math.nan)
    rows = []
    for arm in arms:
        twin = exact_twin(arm)
        seeds = sorted(set(by[arm]) & set(by[twin]))
        row: dict[str, object] = {"arm": arm, "exact": twin, "format": arm.split("-")[1], "seeds": seeds,
                                  "precision": next(p for p in arm.split("-") if p in EMULATED_PRECISIONS),
                                  "unpaired": sorted(set(by[arm]) - set(seeds))}
        if seeds:
            pairs = [(_metrics(by[arm][s]), _metrics(by[twin][s])) for s in seeds]
            row["diffs"] = [paired([a[i] - b[i] for a, b in pairs]).as_dict() for i in range(len(METRICS))]
            row["emulated_calls"] = statistics.fmean(by[arm][s]["map_emulation"]["calls"] for s in seeds)
            row["selected_layers"] = statistics.fmean(by[arm][s]["selected_layers"] for s in seeds)
            row["managed_layers"] = by[arm][seeds[0]]["managed_layers"]
        euclid = f"euclid-{row['format']}"
        both = sorted(set(old[twin]) & set(old[euclid]))
        row["gift_gain"] = (paired([_metrics(old[euclid][s])[0] - _metrics(old[twin][s])[0] for s in both]).as_dict()
                            if both else None)
        drift = sorted(set(by[twin]) & set(old[twin]))
        row["drift"] = (paired([_metrics(by[twin][s])[0] - _metrics(old[twin][s])[0] for s in drift]).as_dict()
                        if drift else None)
        rows.append(row)
    family = [(i, m) for i, row in enumerate(rows) if len(row["seeds"]) >= 2 for m in range(len(METRICS))]
    rejected = dict(zip(family, holm([rows[i]["diffs"][m]["p"] for i, m in family], ALPHA)))
    for i, row in enumerate(rows):
        if "diffs" in row:
            row["resolved_holm"] = [rejected.get((i, m), False) for m in range(len(METRICS))]
    return {"optimizer": optimizer, "study": dict(zip(("path", "world", "steps"), STUDY)), "seeds_planned": SEEDS,
            "fp32": {"n": len(fp32), "band95": band}, "family_size": len(family), "alpha": ALPHA, "arms": rows}


def _conclusion(row: dict, band: float, family: int) -> str:
    """One arm's reading, from its numbers: resolved or not after Holm, and where the far end of
    its held-out CI sits against fp32's seed-to-seed band."""
    name = f"{PRECISION_NAMES[row['precision']]} at {row['format']}"
    seeds = len(row["seeds"])
    if seeds < 2:
        return f"{name}: {seeds} paired seed(s) of {SEEDS}, no CI yet"
    d = row["diffs"][0]
    far = abs(d["mean"]) + d["ci95"]
    verdict = ("resolved" + (" (worse)" if d["mean"] > 0 else " (better)")) if row["resolved_holm"][0] else "not resolved"
    scale = ("inside" if far <= band else "outside") + f" fp32's own ±{band:.4f}" if band == band else "no fp32 band"
    gain = row["gift_gain"]
    share = (f", {far / gain['mean']:.0%} of GIFT's gain over Euclidean at {row['format']} ({gain['mean']:+.{DIGITS}f}, "
             f"n={gain['n']}, committed runs)" if gain and gain["mean"] > 0 else "")
    return (f"{name} ({seeds} of {SEEDS} seeds): held-out bits/byte {d['mean']:+.{DIGITS}f} ± {d['ci95']:.{DIGITS}f}, "
            f"{verdict} after Holm over {family}; its CI reaches {far:.{DIGITS}f}, {scale}{share}")


def block(_: dict | None = None, runs_path: Path = RUNS, committed: tuple[Path, ...] = RUN_FILES) -> str:
    """The docs/benchmarks.md block: per arm, the paired change TF32 / bf16 operands make to
    held-out bits/byte and the training loss against the exact map, from the runs so far."""
    s = summarise(load((runs_path,)), load(committed))
    st = s["study"]
    lines = [f"GIFT's low-rank map at TF32 / bf16 operands in training ({s['optimizer']}, {st['path']} path, "
             f"{st['world']} ranks, {st['steps']} steps, GIFT's defaults `-dflt`): the map's matmul operands rounded as "
             "the tensor-core kernels round them (emulated on the CPU, `bench.fidelity.map_emulation`, in both directions: "
             "forward map before quantization, inverse after decoding), each run paired with the exact-map run of the "
             "same seed and format from the same runs file (the same code). Change = precision − exact, mean ± t 95% "
             f"CI (n); `*`: resolved, Holm's step-down over the table's {s['family_size']} comparisons with n >= 2 at a "
             f"family-wise {100 * s['alpha']:.0f}%. Runs: `{COMMAND}` -> "
             f"[bench/results/convergence/{RUNS.name}](../bench/results/convergence/{RUNS.name}).", "",
             f"| arm | seeds | {METRICS[0]} change | {METRICS[1]} change | maps emulated per run (layers mapped) | "
             "exact rerun − committed exact run (held-out) |", "|---|---|---|---|---|---|"]
    for row in s["arms"]:
        drift = paired_ci(row["drift"], DIGITS) if row["drift"] else "no rerun yet"
        if not row["seeds"]:
            lines.append(f"| {row['arm']} | 0 of {SEEDS} | {'not paired yet' if row['unpaired'] else 'not run'} | | | "
                         f"{drift} |")
            continue
        cells = [paired_ci(d, DIGITS) + (" *" if r else "") for d, r in zip(row["diffs"], row["resolved_holm"])]
        lines.append(f"| {row['arm']} vs {row['exact']} | {len(row['seeds'])} of {SEEDS} | {cells[0]} | {cells[1]} | "
                     f"{row['emulated_calls']:.0f} ({row['selected_layers']:.0f} of {row['managed_layers']}) | "
                     f"{drift} |")
    band = s["fp32"]["band95"]
    notes = [_conclusion(row, band, s["family_size"]) for row in s["arms"] if row["seeds"]]
    unpaired = [f"{row['arm']} seed(s) {row['unpaired']}" for row in s["arms"] if row["unpaired"]]
    lines += ["", "; ".join(notes) + "." if notes else "No pair of runs has finished yet.",
              f"fp32's ±{band:.4f} is the 95% CI half-width of its own held-out bits/byte over its n={s['fp32']['n']} "
              "committed seeds. The last column is how far the exact arm's committed runs are from a rerun by this "
              "code: why the pairs are rerun rather than taken from the committed files."
              + (f" Waiting for their exact-map rerun (not yet paired): {'; '.join(unpaired)}." if unpaired else "")]
    return "\n".join(lines)
