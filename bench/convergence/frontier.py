"""The rate-distortion frontier: how few wire bits per gradient element still train as well as fp32.

The convergence study compares one format at a time against a share-of-gap target; a user asks
instead how few bits can be sent without losing to fp32. This module answers that from the
study's own runs (no new measurement here: `bench/convergence/frontier_runs.sh` makes the runs, this reads
them). Design: the reduce-scatter path (FSDP2), 2 gloo ranks, 120 steps, paired seeds; every
arm is paired per seed with the fp32 run of the same seed (`bench/results/convergence/convergence_runs_rs.jsonl`
holds fp32 and the study's arms, `convergence_runs_frontier.jsonl` the frontier's).

- x: wire bits per managed gradient element, from the collectives' own byte counters
  (`GiftState.comm_totals`): `8 * (wire - unmanaged) / managed elements`, the unmanaged
  parameters (embeddings, norms) being sent in fp32 by every arm (their bytes are the baseline's
  minus 4 per managed element). The whole gradient's bits (`32 * wire / baseline`) are kept too.
- y: held-out bits/byte minus fp32's (same seed), mean with a t-based 95% CI over n seeds.
- fp32's band: the 95% CI half-width of fp32's own mean held-out bits/byte over its seeds (its
  run-to-run spread, measured, not assumed).
- "within fp32's CI": the arm's paired gap, at its Bonferroni-adjusted two-sided level over the
  arms judged for that optimizer (family-wise 5%), has its upper bound inside fp32's band. Only
  arms with n >= `MIN_SEEDS` are judged.

Methods: Euclidean (`geometry="none"`; at bf16 the production bar, a 16-bit wire summed in fp32,
with stochastic rounding as well), Euclidean + error feedback, Euclidean + a leaky residual
(`error_feedback_decay=0.9`) with and without a Hadamard rotation in each scale block (the cheap
stabilizer GIFT's map must beat), GIFT as a user gets it (`-dflt`: `GiftConfig(format=F)` with
`optimizer=`), GIFT + error feedback, + a leaky residual, + the rotation (the same defaults), where
each was run. `alternatives` holds GIFT's best arm to the best Euclidean arm at the same bits. Writes
`bench/results/convergence/frontier.json` and `frontier.png`; `bench.pages.frontier` renders the tables from
the JSON.

Beside the frontier's own design: torch's PowerSGD against GIFT's all-reduce arms at the nearest
bits (`powersgd`), the two-level exchange against flat at 2 x 2 (`two_level`), the 2.5-bit pair
over 4x the steps (`long_horizon`) and on a 4x model (`larger_model`); a comparison with fewer
than `MIN_SEEDS` paired seeds is shown with its n and never called resolved.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from bench.convergence.arms import FORMATS, run_key
from bench.lib.stats import holm, paired, t_quantile
from bench.lib import paths

RESULTS = paths.RESULTS / "convergence"
# the strongest cheap alternatives (`bash bench/convergence/alternatives_runs.sh`): the bf16 wire, Euclidean +
# leaky EF (+ block rotation), GIFT's counterparts
ALTERNATIVES_FILE = RESULTS / "convergence_runs_alternatives.jsonl"
RUN_FILES = (RESULTS / "convergence_runs_rs.jsonl", RESULTS / "convergence_runs_frontier.jsonl", ALTERNATIVES_FILE,
             RESULTS / "convergence_runs_techniques.jsonl")
OUT = RESULTS / "frontier.json"
STUDY = ("reduce-scatter", 2, 120)  # (path, ranks, steps) of every run the frontier pairs
MIN_SEEDS = 5
ALPHA = 0.05
# method -> arm name pattern
METHODS: dict[str, str] = {
    # at bf16: the production bar, a 16-bit wire summed in fp32
    "Euclidean": "euclid-{fmt}",
    "Euclidean + SR": "euclid-{fmt}-sr",
    "Euclidean + EF": "euclid-{fmt}-ef",
    "Euclidean + rotation": "euclid-{fmt}-rot",
    # error feedback whose residual decays (send g + 0.9 e): the leaky variant, and with it a
    # Hadamard rotation inside each scale block (SDP4Bit / THC's cheap stabilizer at 2-3 bits)
    "Euclidean + leaky EF": "euclid-{fmt}-ef-b9",
    "Euclidean + leaky EF + rotation": "euclid-{fmt}-ef-b9-rot",
    "GIFT (defaults)": "gift-{fmt}-dflt",
    "GIFT + EF (defaults)": "gift-{fmt}-ef-dflt",
    "GIFT + leaky EF (defaults)": "gift-{fmt}-ef-b9-dflt",
    "GIFT + leaky EF + rotation (defaults)": "gift-{fmt}-ef-b9-dflt-rot",
}
# the bit widths at which GIFT's best arm is held to the best Euclidean one (`alternatives`)
ALTERNATIVE_FORMATS = ("int3", "int2b16", "int2")
# the production bar every byte count is also said against
BAR_ARM = "euclid-bf16"
COMMAND = "bash bench/convergence/frontier_runs.sh && python -m bench.convergence.frontier && python -m bench.pages.readme"
ALTERNATIVES_COMMAND = "bash bench/convergence/alternatives_runs.sh && python -m bench.convergence.frontier && python -m bench.pages.readme"
# 2 vs 4 ranks on the same global batch, at 2 bits: the 4-rank runs (and their fp32) against the
# study's 2-rank ones, seed by seed (`bash bench/convergence/frontier_ranks_runs.sh`)
RANKS_FILES = (*RUN_FILES, RESULTS / "convergence_runs_rs4.jsonl", RESULTS / "convergence_runs_frontier4.jsonl")
RANKS_ARMS = ("euclid-int2", "gift-int2", "gift-int2-dflt", "gift-int2-dflt-priced")
RANKS_COMMAND = "bash bench/convergence/frontier_ranks_runs.sh && bash bench/convergence/defaults_ranks_runs.sh && python -m bench.convergence.frontier"
# the defaults after the selection's cost side was priced against the layer's step time
# (`gift_compile.runtime.selection.overhead`): their runs carry the arm name `gift-int2-dflt` and
# are read from their own file under `PRICED_ARM`, so they never mix with the runs of the former
# FLOPs-only rule (`convergence_runs_frontier4.jsonl`)
PRICED_FILE = RESULTS / "convergence_runs_defaults_ranks.jsonl"
PRICED_ARM = "gift-int2-dflt-priced"
# Techniques that could move the 2-bit point, each an arm of the frontier's design that adds one
# technique to a frontier arm (`bash bench/convergence/frontier_techniques_runs.sh`): technique arm ->
# (technique, the arm it modifies). Kept only if it beats that arm, paired by seed.
TECHNIQUE_FILES = RUN_FILES
TECHNIQUES: dict[str, tuple[str, str]] = {
    "gift-int2-ef-b9-dflt-rot": ("block rotation", "gift-int2-ef-b9-dflt"),
    "euclid-int2-rot": ("block rotation", "euclid-int2"),
    "gift-int2-ef-b9-dflt-alloc": ("per-layer bits", "gift-int2-ef-b9-dflt"),
    "euclid-int2-alloc": ("per-layer bits", "euclid-int2"),
}
TECHNIQUES_COMMAND = ("python -m bench.convergence.bit_allocation && bash bench/convergence/frontier_techniques_runs.sh && "
                      "python -m bench.convergence.frontier")


def load(files: tuple[Path, ...] = RUN_FILES, designs: tuple[tuple[str, int, int], ...] = (STUDY,)) -> list[dict]:
    """The runs of the given (path, ranks, steps) designs (the frontier's, `STUDY`) from `files`,
    the last record of a key winning."""
    runs: dict[tuple, dict] = {}
    for f in files:
        if not f.exists():
            continue
        for line in f.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                key = run_key(r)
                if key[:3] in designs:
                    runs[key] = r
    return list(runs.values())


def _final(r: dict) -> float:
    return float(r["evals"][-1][1])


def _bits(r: dict, managed: int) -> tuple[float, float]:
    """(bits per managed element, bits per gradient element) of a run, from its byte counters."""
    wire, base = r["wire_bytes_per_step"], r["baseline_bytes_per_step"]
    return 8.0 * (wire - (base - 4.0 * managed)) / managed, 32.0 * wire / base


def summarise(runs: list[dict]) -> dict[str, object]:
    """Per optimizer: fp32's band, each (method, format) arm's gap and bits, the judgements."""
    runs = [r for r in runs if run_key(r)[:3] == STUDY]  # never pair runs of another design
    by: dict[tuple[str, str], dict[int, dict]] = defaultdict(dict)
    for r in runs:
        by[(r["optimizer"], r["arm"])][r["seed"]] = r
    managed = {r["managed_elements"] for r in runs if "managed_elements" in r}
    if len(managed) != 1:
        raise ValueError(f"frontier: runs disagree on (or never record) the managed element count: {managed}")
    m_el = managed.pop()
    out: dict[str, object] = {"study": {"path": STUDY[0], "world": STUDY[1], "steps": STUDY[2]},
                              "managed_elements": m_el, "min_seeds": MIN_SEEDS, "alpha": ALPHA,
                              "command": COMMAND, "optimizers": {}}
    for opt in sorted({o for o, _ in by}):
        fp32 = by.get((opt, "fp32"), {})
        if len(fp32) < 2:
            continue
        vals = [_final(r) for r in fp32.values()]
        band = t_quantile(0.975, len(vals) - 1) * statistics.stdev(vals) / math.sqrt(len(vals))
        arms = []
        for fmt in FORMATS:
            for method, pattern in METHODS.items():
                arm = pattern.format(fmt=fmt)
                runs_ = by.get((opt, arm), {})
                seeds = sorted(s for s in runs_ if s in fp32)
                if not seeds:
                    continue
                gap = paired([_final(runs_[s]) - _final(fp32[s]) for s in seeds])
                bits = [_bits(runs_[s], m_el) for s in seeds]
                arms.append({"method": method, "format": fmt, "arm": arm, "n": len(seeds), "seeds": seeds,
                             "bits_managed": statistics.fmean(b[0] for b in bits),
                             "bits_whole": statistics.fmean(b[1] for b in bits), "gap": gap.as_dict(),
                             "geometry": runs_[seeds[0]].get("geometry"),
                             "selected_layers": statistics.fmean(runs_[s].get("selected_layers", math.nan) for s in seeds),
                             "managed_layers": runs_[seeds[0]].get("managed_layers")})
        for a in arms:
            a["judged"] = a["n"] >= MIN_SEEDS
        judged = [a for a in arms if a["judged"]]
        for a in judged:
            g = a["gap"]
            t_adj = t_quantile(1.0 - ALPHA / (2 * len(judged)), g["n"] - 1)
            a["upper_adjusted"] = g["mean"] + t_adj * g["std"] / math.sqrt(g["n"])
            a["within"] = a["upper_adjusted"] <= band
        fewest = {}
        for method in METHODS:
            inside = [a for a in judged if a["method"] == method and a["within"]]
            fewest[method] = min(inside, key=lambda a: a["bits_managed"])["arm"] if inside else None
        out["optimizers"][opt] = {
            "fp32": {"n": len(vals), "mean": statistics.fmean(vals), "std": statistics.stdev(vals), "band95": band},
            "family_size": len(judged), "arms": arms, "fewest_within": fewest,
            "shift_bits": _shifts(arms, fewest),
        }
    return out


def ranks(files: tuple[Path, ...] = RANKS_FILES, optimizer: str = "muon",
          priced: Path = PRICED_FILE) -> dict[str, object]:
    """Whether the 2-bit gap shrinks with more data-parallel ranks (independent rounding
    averages down in the sum): each arm's gap to fp32 (same ranks, same seed) at 2 and at 4
    ranks, and the change `gap(4) - gap(2)` paired by seed (same global batch and data), Holm
    over the arms compared (family-wise 5%). Arms without runs at both rank counts are left out.
    The defaults under the priced cost side (`PRICED_ARM`, from `priced`) take the former
    defaults' 2-rank runs where their seed-0 run at 2 ranks reproduced the former one's losses bit
    for bit (the same layers chosen: both rules keep all 28 at 512 tokens per rank), else their
    own; `layers` lists every rank count either rule was run at, with the layers it transformed,
    and `versus_euclid` each rule's defaults minus Euclidean int2 at the same rank count (paired,
    Holm over the rows with two seeds or more; a rank count run on one seed is shown without a CI)."""
    by: dict[tuple[int, str], dict[int, float]] = defaultdict(dict)
    selected: dict[tuple[int, str], list[float]] = defaultdict(list)
    losses: dict[tuple[int, str], list[float]] = {}
    designs = tuple((STUDY[0], world, STUDY[2]) for world in (2, 4, 8))
    for arm_of, runs in ((lambda r: r["arm"], load(files, designs)),
                         (lambda r: PRICED_ARM if r["arm"] == "gift-int2-dflt" else r["arm"], load((priced,), designs))):
        for r in runs:
            if r["optimizer"] == optimizer:
                world, arm = run_key(r)[1], arm_of(r)
                by[(world, arm)][r["seed"]] = _final(r)
                if "selected_layers" in r:
                    selected[(world, arm)].append(r["selected_layers"])
                if r["seed"] == 0:
                    losses[(world, arm)] = r["losses"]
    reused = (2, PRICED_ARM) in losses and losses[(2, PRICED_ARM)] == losses.get((2, "gift-int2-dflt"))
    if reused:
        by[(2, PRICED_ARM)] = {**by[(2, "gift-int2-dflt")], **by[(2, PRICED_ARM)]}
        selected[(2, PRICED_ARM)] = selected[(2, "gift-int2-dflt")]
    layers = [{"arm": arm, "world": w, "n": len(v), "selected": statistics.fmean(v)}
              for (w, arm), v in sorted(selected.items()) if arm in ("gift-int2-dflt", PRICED_ARM)]
    # each rule's defaults against Euclidean int2 at the same rank count, paired by seed: what a
    # user on that many ranks gets from the defaults (needs no 2-rank run)
    versus = []
    for arm in ("gift-int2-dflt", PRICED_ARM):
        for world in (2, 4, 8):
            seeds = sorted(set(by[(world, arm)]) & set(by[(world, "euclid-int2")]) & set(by[(world, "fp32")]))
            if seeds:
                versus.append({"arm": arm, "world": world, "seeds": seeds,
                               "gap": paired([by[(world, arm)][s] - by[(world, "fp32")][s] for s in seeds]).as_dict(),
                               "minus_euclid": paired([by[(world, arm)][s] - by[(world, "euclid-int2")][s]
                                                       for s in seeds]).as_dict()})
    # a rank count run on one seed only is shown without a CI and stays out of the family
    tested = [v for v in versus if len(v["seeds"]) >= 2]
    for row in versus:
        row["resolved_holm"] = False
    for row, rejected in zip(tested, holm([v["minus_euclid"]["p"] for v in tested])):
        row["resolved_holm"] = rejected
    rows = []
    for arm in RANKS_ARMS:
        seeds = sorted(set.intersection(*(set(by[(w, a)]) for w in (2, 4) for a in (arm, "fp32"))))
        if len(seeds) < 2:
            continue
        gaps = {w: [by[(w, arm)][s] - by[(w, "fp32")][s] for s in seeds] for w in (2, 4)}
        rows.append({"arm": arm, "seeds": seeds, "gap2": paired(gaps[2]).as_dict(), "gap4": paired(gaps[4]).as_dict(),
                     "change": paired([b - a for a, b in zip(gaps[2], gaps[4])]).as_dict(),
                     "selected2": statistics.fmean(selected[(2, arm)]) if selected[(2, arm)] else None,
                     "selected4": statistics.fmean(selected[(4, arm)]) if selected[(4, arm)] else None})
    for row, rejected in zip(rows, holm([r["change"]["p"] for r in rows])):
        row["change_resolved_holm"] = rejected
    return {"optimizer": optimizer, "arms": rows, "layers": layers, "versus_euclid": versus,
            "priced_reuses_two_rank_runs": reused,
            "command": RANKS_COMMAND}


def techniques(summary: dict, files: tuple[Path, ...] = TECHNIQUE_FILES, optimizer: str = "muon") -> dict[str, object]:
    """Each technique arm against the arm it modifies, paired by seed (the change in final
    held-out bits/byte; negative: the technique helps), Holm over the technique arms (family-wise
    5%): kept where the change is resolved and negative. Also each technique arm's own gap to
    fp32, judged as the frontier judges (Bonferroni over the frontier's judged arms plus these)
    against fp32's band from `summary`. Arms with fewer than two paired seeds are left out."""
    o = summary["optimizers"].get(optimizer)
    if o is None:
        return {"optimizer": optimizer, "arms": [], "command": TECHNIQUES_COMMAND}
    runs = [r for r in load(files) if r["optimizer"] == optimizer]
    m_el = summary["managed_elements"]
    by: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in runs:
        by[r["arm"]][r["seed"]] = r
    rows = []
    for arm, (technique, base) in TECHNIQUES.items():
        seeds = sorted(set(by[arm]) & set(by[base]) & set(by["fp32"]))
        if len(seeds) < 2:
            continue
        rows.append({"arm": arm, "technique": technique, "base": base, "seeds": seeds,
                     "bits_managed": statistics.fmean(_bits(by[arm][s], m_el)[0] for s in seeds),
                     "base_bits_managed": statistics.fmean(_bits(by[base][s], m_el)[0] for s in seeds),
                     "change": paired([_final(by[arm][s]) - _final(by[base][s]) for s in seeds]).as_dict(),
                     "gap": paired([_final(by[arm][s]) - _final(by["fp32"][s]) for s in seeds]).as_dict()})
    family = o["family_size"] + len(rows)
    for row, rejected in zip(rows, holm([r["change"]["p"] for r in rows])):
        row["change_resolved_holm"] = rejected
        row["kept"] = rejected and row["change"]["mean"] < 0
        g = row["gap"]
        t_adj = t_quantile(1.0 - ALPHA / (2 * family), g["n"] - 1)
        row["upper_adjusted"] = g["mean"] + t_adj * g["std"] / math.sqrt(g["n"])
        row["within"] = g["n"] >= MIN_SEEDS and row["upper_adjusted"] <= o["fp32"]["band95"]
    return {"optimizer": optimizer, "family_size": family, "band95": o["fp32"]["band95"], "arms": rows,
            "command": TECHNIQUES_COMMAND}


def alternatives(summary: dict, runs: list[dict]) -> dict[str, object]:
    """GIFT against the strongest cheap alternative at the same bits: per optimizer and format
    of `ALTERNATIVE_FORMATS`, the GIFT arm and the Euclidean arm with the smallest mean gap to
    fp32 among the arms with n >= `MIN_SEEDS`, their final held-out bits/byte differenced seed
    by seed (negative: GIFT better), Holm over every comparison made (family-wise 5%). Choosing
    each side's best on the same seeds favours both sides alike; the comparison inherits that
    optimism, which the table says. Also each optimizer's production bar (`BAR_ARM`, the bf16
    wire): its gap and bits, and how many times fewer bits each compared arm sends."""
    by: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for r in runs:
        if run_key(r)[:3] == STUDY:
            by[(r["optimizer"], r["arm"])][r["seed"]] = _final(r)
    rows, bars = [], {}
    for opt, o in summary["optimizers"].items():
        judged = [a for a in o["arms"] if a["judged"]]
        bar = next((a for a in judged if a["arm"] == BAR_ARM), None)
        bars[opt] = None if bar is None else {"arm": bar["arm"], "bits_managed": bar["bits_managed"],
                                              "gap": bar["gap"], "within": bar["within"]}
        for fmt in ALTERNATIVE_FORMATS:
            sides = {side: [a for a in judged if a["format"] == fmt and a["method"].startswith(side)]
                     for side in ("GIFT", "Euclidean")}
            row = {"optimizer": opt, "format": fmt,
                   "candidates": {side: [a["arm"] for a in arms] for side, arms in sides.items()}}
            if not all(sides.values()):
                rows.append({**row, "compared": False})
                continue
            best = {side: min(arms, key=lambda a: a["gap"]["mean"]) for side, arms in sides.items()}
            g, e = by[(opt, best["GIFT"]["arm"])], by[(opt, best["Euclidean"]["arm"])]
            seeds = sorted(set(g) & set(e))
            row.update({"compared": True, "gift": best["GIFT"]["arm"], "euclid": best["Euclidean"]["arm"],
                        "bits_gift": best["GIFT"]["bits_managed"], "bits_euclid": best["Euclidean"]["bits_managed"],
                        "gap_gift": best["GIFT"]["gap"], "gap_euclid": best["Euclidean"]["gap"],
                        "within_gift": best["GIFT"]["within"], "within_euclid": best["Euclidean"]["within"],
                        "difference": paired([g[s] - e[s] for s in seeds]).as_dict(),
                        "fewer_bits_than_bar": None if bar is None else bar["bits_managed"] / best["GIFT"]["bits_managed"]})
            rows.append(row)
    compared = [r for r in rows if r["compared"]]
    for row, rejected in zip(compared, holm([r["difference"]["p"] for r in compared])):
        row["resolved_holm"] = rejected
    return {"rows": rows, "bar": bars, "family_size": len(compared), "formats": list(ALTERNATIVE_FORMATS),
            "command": ALTERNATIVES_COMMAND}


LONG_FILES = (RESULTS / "convergence_runs_long.jsonl", RESULTS / "convergence_runs_long_lowbit.jsonl")
LONG_STEPS = 480
LONG_ARMS = ("gift-int2b16-ef-b9-dflt", "euclid-int2b16-ef-b9-rot")
LONG_COMMAND = "bash bench/convergence/long_lowbit_runs.sh && python -m bench.convergence.frontier"


def long_horizon(files: tuple[Path, ...] = LONG_FILES, optimizer: str = "muon") -> dict[str, object]:
    """The recommended 2.5-bit configuration over `LONG_STEPS` steps (4x the frontier's): each
    of `LONG_ARMS`' gap to fp32 of the same seed and length, and GIFT minus Euclidean paired by
    seed (mean, t 95% CI; one comparison, so no correction). Arms with fewer than two paired
    seeds are reported with their seed count only."""
    by: dict[str, dict[int, float]] = defaultdict(dict)
    for r in load(files, ((STUDY[0], STUDY[1], LONG_STEPS),)):
        if r["optimizer"] == optimizer:
            by[r["arm"]][r["seed"]] = _final(r)
    out: dict[str, object] = {"optimizer": optimizer, "steps": LONG_STEPS, "arms": {}, "command": LONG_COMMAND}
    for arm in LONG_ARMS:
        seeds = sorted(set(by[arm]) & set(by["fp32"]))
        out["arms"][arm] = {"n": len(seeds), "gap": paired([by[arm][s] - by["fp32"][s] for s in seeds]).as_dict()
                            if len(seeds) >= 2 else None}
    gift, euclid = LONG_ARMS
    seeds = sorted(set(by[gift]) & set(by[euclid]))
    out["difference"] = paired([by[gift][s] - by[euclid][s] for s in seeds]).as_dict() if len(seeds) >= 2 else None
    out["difference_seeds"] = seeds
    d = out["difference"]
    out["resolved"] = bool(d and d["n"] >= MIN_SEEDS and abs(d["mean"]) > d["ci95"])  # n < 5: never resolved
    return out


# torch's PowerSGD (DDP + `powerSGD_hook`, `bash bench/powersgd_runs.sh`) against GIFT's all-reduce
# arms and the fp32 all-reduce of the study (convergence_runs.jsonl): the all-reduce path, 2 ranks,
# 120 steps
ALLREDUCE_FILE = RESULTS / "convergence_runs.jsonl"
POWERSGD_FILE = RESULTS / "convergence_runs_powersgd.jsonl"
POWERSGD_STUDY = ("all-reduce", 2, 120)
POWERSGD_COMMAND = "bash bench/convergence/powersgd_runs.sh && python -m bench.convergence.frontier && python -m bench.pages.readme"


def _by_arm(runs: list[dict]) -> dict[tuple[str, str], dict[int, dict]]:
    by: dict[tuple[str, str], dict[int, dict]] = defaultdict(dict)
    for r in runs:
        by[(r["optimizer"], r["arm"])][r["seed"]] = r
    return by


def _gap(arm: dict[int, dict], ref: dict[int, dict]) -> dict | None:
    """`arm` minus `ref` in final held-out bits/byte over their common seeds (None: no common seed)."""
    seeds = sorted(set(arm) & set(ref))
    return paired([_final(arm[s]) - _final(ref[s]) for s in seeds]).as_dict() if seeds else None


def _holm_rows(rows: list[dict], key: str) -> None:
    """`resolved_holm` on each row: Holm (family-wise `ALPHA`) over the rows whose `key`
    difference has n >= `MIN_SEEDS`; a row with fewer seeds is shown with its n, never resolved."""
    for r in rows:
        r["judged"] = r[key] is not None and r[key]["n"] >= MIN_SEEDS
        r["resolved_holm"] = False
    judged = [r for r in rows if r["judged"]]
    for r, rejected in zip(judged, holm([r[key]["p"] for r in judged], ALPHA)):
        r["resolved_holm"] = rejected


def powersgd(managed: int, files: tuple[Path, ...] = (ALLREDUCE_FILE, POWERSGD_FILE)) -> dict[str, object]:
    """torch's PowerSGD at each rank against fp32 and against GIFT's all-reduce arm at the nearest
    bits, per optimizer (the all-reduce path: DDP and GIFT's quantized all-reduce both send every
    gradient to an all-reduce).

    PowerSGD's bits per managed element are those its runs counted from the tensors the hook
    sent (`bench.convergence.powersgd`), over the compressed steps (r (m + n) 32 / (m n) per matrix; the
    steps before `start_powerSGD_iter` send fp32, counted in `bits_all_steps`); GIFT's are its
    collectives' counters (`_bits`, `managed` elements). The GIFT arm paired with a PowerSGD
    rank is, among GIFT's all-reduce arms with n >= `MIN_SEEDS`, the one whose bits are nearest,
    and among arms at those bits the one with the smallest mean gap (chosen on the seeds it is
    judged on: flatters GIFT). GIFT minus PowerSGD is paired by seed, Holm over every row with
    n >= `MIN_SEEDS` (both optimizers). `ddp_check`: the plain DDP arm (`fp32-ddp`) against the
    study's fp32 all-reduce, seed by seed, to show the two paths train alike."""
    by = _by_arm(load(files, (POWERSGD_STUDY,)))
    out: dict[str, object] = {"study": {"path": POWERSGD_STUDY[0], "world": POWERSGD_STUDY[1],
                                        "steps": POWERSGD_STUDY[2]},
                              "min_seeds": MIN_SEEDS, "command": POWERSGD_COMMAND, "optimizers": {}}
    rows: list[dict] = []
    for opt in sorted({o for o, _ in by}):
        fp32, ddp = by.get((opt, "fp32"), {}), by.get((opt, "fp32-ddp"), {})
        ranks = sorted(int(a.removeprefix("powersgd-r")) for o, a in by if o == opt and a.startswith("powersgd-r"))
        if not fp32 or not ranks:
            continue
        check = [{"seed": s, "losses_identical": ddp[s]["losses"] == fp32[s]["losses"],
                  "max_loss_difference": max(abs(a - b) for a, b in zip(ddp[s]["losses"], fp32[s]["losses"])),
                  "final_difference": _final(ddp[s]) - _final(fp32[s])} for s in sorted(set(ddp) & set(fp32))]
        gift = []
        for (o, arm), runs_ in by.items():
            seeds = sorted(set(runs_) & set(fp32))
            # GIFT's arms whose collectives counted their bytes (the two-sided experiment's did not)
            if (o == opt and arm.startswith("gift-") and len(seeds) >= MIN_SEEDS
                    and all("wire_bytes_per_step" in runs_[s] for s in seeds)):
                gift.append({"arm": arm, "n": len(seeds), "gap": _gap(runs_, fp32),
                             "bits_managed": statistics.fmean(_bits(runs_[s], managed)[0] for s in seeds)})
        for rank in ranks:
            arm = f"powersgd-r{rank}"
            runs_ = by[(opt, arm)]
            seeds = sorted(runs_)
            info = [runs_[s]["powersgd"] for s in seeds]
            row = {"optimizer": opt, "rank": rank, "arm": arm, "n": len(seeds), "seeds": seeds,
                   "gap": _gap(runs_, fp32),
                   "bits_managed": statistics.fmean(i["bits_managed_compressed"] for i in info),
                   "bits_all_steps": statistics.fmean(i["bits_managed"] for i in info),
                   "bits_whole": statistics.fmean(i["bits_whole_compressed"] for i in info),
                   "start_iter": info[0]["start_iter"], "min_compression_rate": info[0]["min_compression_rate"],
                   "compressed_matrices": len(info[0]["matrices"]),
                   "gift": None, "difference": None}
            if gift:
                near = min(abs(g["bits_managed"] - row["bits_managed"]) for g in gift)
                best = min((g for g in gift if abs(g["bits_managed"] - row["bits_managed"]) <= near + 1e-9),
                           key=lambda g: g["gap"]["mean"])
                row["gift"] = best
                row["difference"] = _gap(by[(opt, best["arm"])], runs_)
            rows.append(row)
        out["optimizers"][opt] = {"fp32_n": len(fp32), "ddp_check": check, "gift_candidates": gift}
    _holm_rows(rows, "difference")
    out["rows"] = rows
    out["family_size"] = sum(r["judged"] for r in rows)
    return out


# two levels at 2 x 2 (`bash bench/two_level_runs.sh`): each arm flat and with `-2l`, 4 ranks, the
# reduce-scatter path, 120 steps; fp32 at 4 ranks from convergence_runs_rs4.jsonl
TWO_LEVEL_FILE = RESULTS / "convergence_runs_two_level.jsonl"
TWO_LEVEL_FP32_FILE = RESULTS / "convergence_runs_rs4.jsonl"
TWO_LEVEL_STUDY = ("reduce-scatter", 4, 120)
TWO_LEVEL_ARMS = ("gift-int2-dflt", "gift-nvfp4-dflt", "gift-int2-ef-b9-dflt-rot")
TWO_LEVEL_COMMAND = "bash bench/convergence/two_level_runs.sh && python -m bench.convergence.frontier && python -m bench.pages.readme"


def two_level(file: Path = TWO_LEVEL_FILE, fp32_file: Path = TWO_LEVEL_FP32_FILE,
              reproduce_file: Path = PRICED_FILE, optimizer: str = "muon") -> dict[str, object]:
    """Each of `TWO_LEVEL_ARMS` flat and two-level (`-2l`, 2 nodes x 2 ranks): gap to fp32 at 4
    ranks (same seed) and two-level minus flat paired by seed, Holm over the arms with n >=
    `MIN_SEEDS`. GIFT's runs come from `file` only (flat and two-level from the same code); fp32
    from `fp32_file`. `reproduced`: the flat defaults' runs against the committed 4-rank runs of
    the same arm (`reproduce_file`), seed by seed: where they agree bit for bit, the training
    pipeline did not change since fp32's runs either."""
    fp32 = {r["seed"]: r for r in load((fp32_file,), (TWO_LEVEL_STUDY,))
            if r["optimizer"] == optimizer and r["arm"] == "fp32"}
    mine = {k: v for k, v in _by_arm(load((file,), (TWO_LEVEL_STUDY,))).items() if k[0] == optimizer}
    rows = []
    for arm in TWO_LEVEL_ARMS:
        flat, two = mine.get((optimizer, arm), {}), mine.get((optimizer, f"{arm}-2l"), {})
        if not flat and not two:
            continue
        layouts = sorted({(r["node_layout"]["nodes"], r["node_layout"]["ranks_per_node"]) for r in two.values()})
        rows.append({"arm": arm, "n_flat": len(flat), "n_two_level": len(two), "gap_flat": _gap(flat, fp32),
                     "gap_two_level": _gap(two, fp32), "change": _gap(two, flat), "two_level_layouts": layouts})
    _holm_rows(rows, "change")
    earlier = {r["seed"]: r for r in load((reproduce_file,), (TWO_LEVEL_STUDY,))
               if r["optimizer"] == optimizer and r["arm"] == TWO_LEVEL_ARMS[0]}
    flat = mine.get((optimizer, TWO_LEVEL_ARMS[0]), {})
    reproduced = [{"seed": s, "identical": flat[s]["losses"] == earlier[s]["losses"],
                   "final_difference": _final(flat[s]) - _final(earlier[s])} for s in sorted(set(flat) & set(earlier))]
    return {"optimizer": optimizer, "world": TWO_LEVEL_STUDY[1], "ranks_per_node": 2, "fp32_n": len(fp32),
            "arms": rows, "family_size": sum(r["judged"] for r in rows), "reproduced": reproduced,
            "command": TWO_LEVEL_COMMAND}


# the whole gradient (`bash bench/convergence/whole_gradient_runs.sh`): the recipe-like arm with the
# embedding and the output head at its own format (`-uw`) and at bf16 (`-ubf`, the product's
# default `excluded_format`), against the same arm with them raw at fp32 (the study's arms,
# convergence_runs_techniques.jsonl) and fp32; the frontier's design
WHOLE_FILE = RESULTS / "convergence_runs_whole_gradient.jsonl"
WHOLE_BASE = "gift-int2-ef-b9-dflt-rot"
WHOLE_COMMAND = ("bash bench/convergence/whole_gradient_runs.sh && python -m bench.convergence.frontier && "
                 "python -m bench.pages.readme")


def whole_gradient(file: Path = WHOLE_FILE, study_files: tuple[Path, ...] = RUN_FILES,
                   optimizer: str = "muon") -> dict[str, object]:
    """The embedding and head at the arm's format, at bf16 and at fp32 (`WHOLE_BASE` with `-uw`,
    `-ubf`, and without): each one's gap to fp32 and bytes per step (the collectives' counters), and
    two comparisons paired by seed, Holm over those with n >= `MIN_SEEDS`: the arm's format minus
    bf16 (what `excluded_format="same"` costs against the default) and bf16 minus fp32 (what the
    default costs against raw). fp32 and the raw arm come from `study_files`, the others from `file`."""
    runs = [r for r in load((*study_files, file)) if r["optimizer"] == optimizer]
    by = {arm: seeds for (_, arm), seeds in _by_arm(runs).items()}
    fp32 = by.get("fp32", {})
    names = {"format": f"{WHOLE_BASE}-uw", "bf16": f"{WHOLE_BASE}-ubf", "fp32": WHOLE_BASE}
    arms = {}
    for outside, arm in names.items():
        seeds = by.get(arm, {})
        arms[outside] = {"arm": arm, "n": len(seeds), "gap": _gap(seeds, fp32),
                         "wire_mb_per_step": (statistics.fmean(r["wire_bytes_per_step"] for r in seeds.values()) / 1e6
                                              if seeds else None)}
    rows = [{"comparison": f"{a} minus {b}", "difference": _gap(by.get(names[a], {}), by.get(names[b], {}))}
            for a, b in (("format", "bf16"), ("bf16", "fp32"))]
    _holm_rows(rows, "difference")
    return {"optimizer": optimizer, "base": WHOLE_BASE, "fp32_n": len(fp32), "arms": arms, "rows": rows,
            "family_size": sum(r["judged"] for r in rows), "command": WHOLE_COMMAND}


# the 2.5-bit pair on the 4x model (`bash bench/larger_model_runs.sh`)
LARGER_FILE = RESULTS / "convergence_runs_x4.jsonl"
LARGER_MODEL = "x4"
LARGER_COMMAND = "bash bench/convergence/larger_model_runs.sh && python -m bench.convergence.frontier && python -m bench.pages.readme"


def _pair(by: dict[str, dict[int, dict]], arms: tuple[str, str]) -> dict[str, object]:
    """Each of `arms`' gap to fp32 and the first minus the second, paired by seed; the
    difference is called resolved (95% CI excludes 0; one comparison) only with n >= `MIN_SEEDS`."""
    out: dict[str, object] = {"arms": {arm: {"n": len(set(by.get(arm, {})) & set(by.get("fp32", {}))),
                                              "gap": _gap(by.get(arm, {}), by.get("fp32", {}))} for arm in arms}}
    d = _gap(by.get(arms[0], {}), by.get(arms[1], {}))
    out["difference"] = d
    out["resolved"] = bool(d and d["n"] >= MIN_SEEDS and abs(d["mean"]) > d["ci95"])
    return out


def larger_model(file: Path = LARGER_FILE, optimizer: str = "muon") -> dict[str, object]:
    """`LONG_ARMS` (the 2.5-bit pair) on the 4x model at the frontier's design (`_pair`)."""
    runs = [r for r in load((file,)) if r.get("model") == LARGER_MODEL and r["optimizer"] == optimizer]
    by = {arm: seeds for (_, arm), seeds in _by_arm(runs).items()}
    params = sorted({r["model_params"] for r in runs})
    return {"optimizer": optimizer, "model": LARGER_MODEL, "model_params": params, "steps": STUDY[2],
            **_pair(by, LONG_ARMS), "command": LARGER_COMMAND}


def _shifts(arms: list[dict], fewest: dict[str, str | None]) -> dict[str, float | None]:
    """How many bits left of its Euclidean counterpart GIFT's fewest-within point sits (positive:
    GIFT needs fewer bits), per pair; None where either side has no point within the band."""
    bits = {a["arm"]: a["bits_managed"] for a in arms}
    out = {}
    for gift, euclid in (("GIFT (defaults)", "Euclidean"), ("GIFT + EF (defaults)", "Euclidean + EF")):
        g, e = fewest.get(gift), fewest.get(euclid)
        out[f"{gift} vs {euclid}"] = None if g is None or e is None else bits[e] - bits[g]
    return out


def plot(summary: dict, out: Path = RESULTS) -> str:
    """Gap to fp32 against bits per managed element, one panel per optimizer, fp32's band shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    opts = list(summary["optimizers"])
    fig, axes = plt.subplots(1, len(opts), figsize=(7 * len(opts), 4.8), squeeze=False)
    styles = {"Euclidean": ("tab:blue", "o", "-"), "Euclidean + EF": ("tab:blue", "s", "--"),
              "GIFT (defaults)": ("tab:orange", "o", "-"), "GIFT + EF (defaults)": ("tab:orange", "s", "--"),
              "GIFT + leaky EF (defaults)": ("tab:red", "^", ":"),
              "Euclidean + leaky EF": ("tab:cyan", "^", ":"),
              "Euclidean + leaky EF + rotation": ("tab:green", "v", ":"),
              "GIFT + leaky EF + rotation (defaults)": ("tab:purple", "v", ":")}
    for ax, opt in zip(axes[0], opts):
        o = summary["optimizers"][opt]
        ax.axhspan(-o["fp32"]["band95"], o["fp32"]["band95"], color="0.85",
                   label=f"fp32's 95% CI (n={o['fp32']['n']})")
        for method, (color, marker, ls) in styles.items():
            # arms still short of MIN_SEEDS are in the table, not on the plot (no CI to draw yet)
            pts = sorted((a for a in o["arms"] if a["method"] == method and a["judged"]),
                         key=lambda a: a["bits_managed"])
            if not pts:
                continue
            ci = [0.0 if a["gap"]["ci95"] != a["gap"]["ci95"] else a["gap"]["ci95"] for a in pts]
            ax.errorbar([a["bits_managed"] for a in pts], [a["gap"]["mean"] for a in pts], yerr=ci, color=color,
                        marker=marker, ls=ls, capsize=3, label=method)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(sorted({round(a["bits_managed"], 2) for a in o["arms"] if a["judged"]}))
        ax.set_xlabel("wire bits per managed gradient element (counted at the collective)")
        ax.set_ylabel("held-out bits/byte minus fp32 (same seed), mean ± 95% CI")
        ax.set_title(f"{opt}: {summary['study']['path']}, {summary['study']['world']} ranks, "
                     f"{summary['study']['steps']} steps")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=110)
    plt.close(fig)
    return "frontier.png"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.convergence.frontier", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args(argv)
    runs = load()
    summary = summarise(runs)
    summary["alternatives"] = alternatives(summary, runs)
    summary["ranks"] = ranks()
    summary["long"] = long_horizon()
    summary["techniques"] = techniques(summary)
    summary["powersgd"] = powersgd(summary["managed_elements"])
    summary["two_level"] = two_level()
    summary["larger_model"] = larger_model()
    summary["whole_gradient"] = whole_gradient()
    a.out.write_text(json.dumps(summary, indent=1) + "\n")
    if not a.no_plot:
        plot(summary, a.out.parent)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
