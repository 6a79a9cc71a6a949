"""The convergence study's summary: from finished runs (`bench.convergence.runner`), per study and
optimizer, each arm's paired difference to fp32, the gap each bit width leaves and the share
GIFT closes, the verdicts and the product defaults against the study's arms (`bench.lib.stats` does
the statistics). Pure over the run records, so the results can be re-summarised without
training (`python -m bench.run --merge`).
"""

from __future__ import annotations

import statistics
from typing import Callable, Iterable

from bench.convergence.arms import (MAP_MODIFIERS, PATHS, arm_config, bits_per_element, parse_arm, resolve_arm_auto,
                                     study)
from bench.lib.reference import make_optimizers
from bench.lib.settings import ConvergenceSettings
from bench.lib.stats import holm, paired, ratio_ci
from bench.lib.tiny_llama import TinyLlama

def summarise(runs: list[dict], s: ConvergenceSettings) -> dict[str, object]:
    """Per study (`all-reduce` / `reduce-scatter`, or one of them at other ranks or steps:
    `study`), per optimizer: per-arm paired statistics and per-(bit width, EF) gaps from
    finished runs. `paths` is keyed by study (each entry names its collective path); `world`
    and `steps` are the settings' own.

    Every run is either summarised or listed under `excluded` with the reason. Arms come from
    `s.arms` (in that order) plus any other arm found in the runs (at whatever n it has), so a
    run outside the profile's arm list is shown rather than silently dropped. `optimizers` is
    the all-reduce path's summary (the study's first path) or, without all-reduce runs, the
    only path's.
    """
    used: dict[tuple[str, str, int, str], dict] = {}
    excluded: list[dict[str, object]] = []

    def key_of(r: dict) -> tuple[str, str, int, str]:
        return study(r, s), r["optimizer"], r["seed"], r["arm"]

    keys = {key_of(r) for r in runs}
    for r in runs:
        r.setdefault("path", "all-reduce")  # records written before the path existed
        tail = r["losses"][-max(1, len(r["losses"]) // 10):]
        r["final_train_loss"] = statistics.fmean(tail)
        r["final_bpb"] = r["evals"][-1][1]
        if "geometry" not in r and r["arm"] != "fp32":  # recorded before the field: the arm's configured map
            r["geometry"] = arm_config(r["arm"], s, r["seed"]).geometry
        key = key_of(r)
        if key in used:
            excluded.append({"key": list(key), "reason": "duplicate of an earlier run with the same study, optimizer, "
                                                          "seed and arm (the first is used)"})
        elif (key[0], key[1], key[2], "fp32") not in keys:
            excluded.append({"key": list(key), "reason": "no fp32 run of the same seed, optimizer and study to pair with"})
        else:
            used[key] = r
    arm_order = {opt: list(arms) for opt, arms in s.arms}
    for _, opt, _, arm in used:
        arm_order.setdefault(opt, ["fp32"])
        if arm not in arm_order[opt]:
            arm_order[opt].append(arm)
    paths = {}
    found = {k[0] for k in used}
    for label in [*(p for p in PATHS if p in found), *sorted(found - set(PATHS))]:
        mine = {k: r for k, r in used.items() if k[0] == label}
        paths[label] = {"path": next(iter(mine.values()))["path"], "seeds": sorted({k[2] for k in mine}),
                        "runs": len(mine), "optimizers": _per_optimizer(mine, arm_order)}
    primary = "all-reduce" if "all-reduce" in paths else next(iter(paths), None)
    between: dict[str, dict[str, dict]] = {}  # reduce-scatter minus all-reduce, same seed (same init and data)
    for (path, opt, seed, arm), r in used.items():
        other = used.get(("all-reduce", opt, seed, arm))
        if path == "reduce-scatter" and other is not None:
            between.setdefault(opt, {}).setdefault(arm, []).append(r["final_bpb"] - other["final_bpb"])
    return {
        "mode": "compiled" if s.compile else "eager", "world": s.world, "steps": s.steps,
        "tokens_per_step": s.world * s.local_batch * s.seq_len, "seeds": sorted({k[2] for k in used}),
        "arms": arm_order, "runs": runs, "excluded": excluded, "paths": paths, "primary_path": primary,
        "optimizers": paths[primary]["optimizers"] if primary else {},
        "rs_minus_ar": {opt: {arm: paired(d).as_dict() for arm, d in arms.items()} for opt, arms in between.items()},
        "optimizer_classes": _optimizer_classes(runs, list(arm_order), s),
        "default_geometry": {opt: default_geometry(opt, s) for opt in arm_order},
        "gift_config": {"rank": s.rank, "refresh_every": s.refresh_every, "select": "all", "geometry": "lowrank"},
        "all_replicas_identical": all(r["replicas_identical"] for r in runs),
    }


def default_geometry(opt: str, s: ConvergenceSettings) -> str:
    """The geometry the product picks for optimizer `opt` (`geometry="auto"`), resolved as a
    `-geo` run resolves it: the GIFT arm that records this geometry and no codec modifier is the
    product's per-optimizer default in the study."""
    model = TinyLlama(s.model, seed=0)
    optimizers, _ = make_optimizers(model, opt, s.lr, s.muon_lr)
    config = resolve_arm_auto(arm_config("gift-nvfp4-geo", s, 0), model, optimizers, split_rows=False)
    assert config is not None
    return config.geometry


def _optimizer_classes(runs: list[dict], opts: list[str], s: ConvergenceSettings) -> dict[str, dict[str, object]]:
    """The optimizer classes each optimizer name ran as: recorded per run, or (runs recorded
    before the field existed, all on CPU) what `make_optimizers` builds for a CPU model."""
    out = {}
    for opt in opts:
        recorded = {tuple(r["optimizer_classes"]) for r in runs if r["optimizer"] == opt and "optimizer_classes" in r}
        if recorded:
            out[opt] = {"classes": sorted({c for t in recorded for c in t}), "source": "recorded in the runs"}
        else:
            built, _ = make_optimizers(TinyLlama(s.model, seed=0), opt, s.lr, s.muon_lr)
            out[opt] = {"classes": [type(o).__name__ for o in built],
                        "source": "not recorded; what make_optimizers builds on CPU, where every run of this study ran"}
    return out


def _per_optimizer(by: dict[tuple[str, str, int, str], dict], arm_order: dict[str, list[str]]) -> dict[str, dict]:
    """Per optimizer: paired statistics per arm, the gaps, the verdict (runs of one path)."""
    seeds = sorted({k[2] for k in by})
    path = next(iter(by))[0]
    per_opt: dict[str, dict[str, object]] = {}
    for opt_name, arms in arm_order.items():
        summary, gaps = {}, {}

        def bpb(seed: int, arm: str) -> float:
            return by[(path, opt_name, seed, arm)]["final_bpb"]

        def have(seed: int, arm: str) -> bool:
            return (path, opt_name, seed, arm) in by

        for arm in arms:
            done = [seed for seed in seeds if have(seed, arm) and have(seed, "fp32")]
            if not done:
                continue
            diff = [bpb(seed, arm) - bpb(seed, "fp32") for seed in done]
            _, fmt, _ = parse_arm(arm)
            summary[arm] = {
                "bits": 32.0 if fmt is None else bits_per_element(fmt),
                "final_bpb": statistics.fmean(bpb(seed, arm) for seed in done), "n": len(done), "seeds": done,
                "paired_diff_bpb": paired(diff).as_dict(),
                "seconds": statistics.fmean(by[(path, opt_name, seed, arm)]["seconds"] for seed in done),
                # the geometry the runs resolved (`-geo`: chosen from the optimizer); None for fp32
                "geometry": by[(path, opt_name, done[0], arm)].get("geometry"),
                # the selection metric the runs resolved and the layers their selection kept at the
                # end (mean over seeds); absent for runs recorded before the fields existed
                **_selection(by[(path, opt_name, seed, arm)] for seed in done),
            }
        for arm in arms:
            side, fmt, ef = parse_arm(arm)
            twin = "-".join(["euclid", *arm.split("-")[1:]]) if side == "gift" else ""
            if twin not in summary:  # GIFT-only modifiers (dense, rank, ...): the twin keeps only the codec's
                twin = "-".join(["euclid", *(p for p in arm.split("-")[1:] if p not in MAP_MODIFIERS)])
            if side != "gift" or twin not in summary or arm not in summary:
                continue
            done = [seed for seed in seeds if have(seed, arm) and have(seed, twin)]
            g_minus_e = [bpb(seed, arm) - bpb(seed, twin) for seed in done]
            gap_e, gap_g = summary[twin]["paired_diff_bpb"]["mean"], summary[arm]["paired_diff_bpb"]["mean"]
            with_ref = [seed for seed in done if have(seed, "fp32")]
            closed = ratio_ci([bpb(seed, twin) - bpb(seed, arm) for seed in with_ref],
                              [bpb(seed, twin) - bpb(seed, "fp32") for seed in with_ref])
            gaps[arm.removeprefix("gift-")] = {
                "format": fmt, "error_feedback": ef, "bits": summary[arm]["bits"],
                "euclid_minus_fp32": summary[twin]["paired_diff_bpb"], "gift_minus_fp32": summary[arm]["paired_diff_bpb"],
                "gift_minus_euclid": paired(g_minus_e).as_dict(),
                # a share of a gap only where that gap is resolved (its CI excludes zero): at n=1 or an
                # unresolved Euclidean cost the ratio is noise over noise
                "share_closed": 1.0 - gap_g / gap_e if gap_e > 0 and summary[twin]["paired_diff_bpb"]["resolved"]
                else float("nan"),
                # Fieller 95% CI of (Euclidean - GIFT) / (Euclidean - fp32); None: unbounded
                "share_closed_ci95": None if closed is None else list(closed),
            }
        if summary:
            per_opt[opt_name] = {"arms": summary, "gaps": gaps, "verdict": _verdict(summary, gaps),
                                 "defaults": _defaults_vs_study(summary, bpb, have, seeds)}
    return per_opt


def _defaults_vs_study(summary: dict, bpb: Callable[[int, str], float], have: Callable[[int, str], bool],
                       seeds: list[int]) -> dict[str, dict[str, object]]:
    """Per `-dflt` arm (the product's defaults): its paired difference in held-out bits/byte to
    the study's arm of the same map on every layer (`gift-<fmt>[-ef]`, or `-geo` where the
    default resolved the optimizer's geometry) and, where run, to the same default judged by
    the plain-L2 metric (`-euc`). The comparisons of one optimizer and study form one family:
    `holm_rejects` is Holm's 5% family-wise decision on each paired t test's p-value."""
    rows: dict[str, dict[str, object]] = {}
    for arm, v in summary.items():
        parts = arm.split("-")
        if parts[0] != "gift" or "dflt" not in parts or "euc" in parts:
            continue
        base = [p for p in parts if p not in ("dflt", "nowarm")]  # the study's arms have no warm-up
        study = next((a for a in ("-".join(base), "-".join([*base, "geo"]))
                      if a in summary and summary[a].get("geometry") == v.get("geometry")), None)
        plain = next((a for a in summary if set(a.split("-")) == {*parts, "euc"}), None)  # any modifier order
        for other, label in ((study, "study"), (plain, "plain_metric")):
            if other is None or other not in summary:
                continue
            done = [seed for seed in seeds if have(seed, arm) and have(seed, other)]
            rows.setdefault(arm, {})[label] = {"arm": other, **paired([bpb(x, arm) - bpb(x, other) for x in done]).as_dict()}
    tests = [(arm, label) for arm, cmp in rows.items() for label in cmp if cmp[label]["n"] > 1]
    for (arm, label), rejects in zip(tests, holm([rows[arm][label]["p"] for arm, label in tests])):
        rows[arm][label]["holm_rejects"] = rejects
    return rows


def _selection(records: Iterable[dict]) -> dict[str, object]:
    """`select_metric`, mean `selected_layers` and `managed_layers` of an arm's runs, where recorded."""
    rs = [r for r in records if "selected_layers" in r]
    if not rs:
        return {}
    return {"select_metric": rs[0].get("select_metric"), "managed_layers": rs[0]["managed_layers"],
            "selected_layers": statistics.fmean(r["selected_layers"] for r in rs)}


def _verdict(summary: dict, gaps: dict) -> dict[str, object]:
    """Per EF setting, the widest bit width at which Euclidean costs loss, GIFT's share of that
    gap (with its Fieller CI); and the arms that are resolved positive controls.

    "Costs loss" is a claim picked from a family (every study bit width of that EF setting),
    so it is made only where Holm's procedure over the family's paired t tests (Euclidean minus
    fp32) rejects at 5% family-wise; `family` lists the tests and their decisions. The no-EF
    answer sits at the top level (`first_costly`, `bits`, `share_closed`, ...), the
    error-feedback answer under `with_ef` in the same shape."""

    def first(ef: bool) -> dict[str, object]:
        keys = [k for k, g in gaps.items() if g["error_feedback"] == ef and _plain(k)
                and g["euclid_minus_fp32"]["n"] >= 2]  # a single seed is no test: outside the family
        pvalues = [gaps[k]["euclid_minus_fp32"]["p"] for k in keys]
        rejected = holm(pvalues)
        family = [{"key": k, "bits": gaps[k]["bits"], "p": p, "holm_rejected": rej,
                   "mean": gaps[k]["euclid_minus_fp32"]["mean"]} for k, p, rej in zip(keys, pvalues, rejected)]
        costly = [(f["bits"], f["key"]) for f in family if f["holm_rejected"] and f["mean"] > 0]
        if not costly:
            return {"first_costly": None, "family": family}
        bits, key = max(costly)
        return {"first_costly": key, "bits": bits, "share_closed": gaps[key]["share_closed"], "family": family,
                "share_closed_ci95": gaps[key]["share_closed_ci95"], "gift_minus_euclid": gaps[key]["gift_minus_euclid"]}

    controls = [a for a, v in summary.items() if v["paired_diff_bpb"]["resolved"] and v["paired_diff_bpb"]["mean"] > 0]
    return {**first(False), "with_ef": first(True), "positive_controls": controls}


def _plain(gap_key: str) -> bool:
    """Whether a gap key (`<format>[-ef]`) is a study arm rather than a tuning variant."""
    return all(p == "ef" for p in gap_key.split("-")[1:])
