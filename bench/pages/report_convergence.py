"""REPORT.md's convergence sections: the study per path and optimizer, its verdicts, both
paths side by side, the studies at other ranks or steps, and the tuning runs, rendered from the
summary `bench.convergence.summary` wrote into `bench.run`'s results dict (`bench.pages.report` puts
the sections together).
"""

from __future__ import annotations


from bench.lib.formatting import paired_ci, share_closed, table

def _ci(p: dict) -> str:
    """A paired difference as the report writes it: ` *` marks one whose CI excludes zero."""
    return paired_ci(p, mark_resolved=True)


def _share(v: dict) -> str:
    """The report's wording of a gap's share closed (`NN% (95% CI lo% to hi%)`)."""
    return share_closed(v, unresolved="n/a (no resolved Euclidean gap)", ci_label="95% CI ")


def _family(w: dict) -> str:
    """`k bit widths tested, Holm-corrected` for a verdict's family."""
    fam = w.get("family", [])
    return (f"Holm-corrected over the {len(fam)} bit width(s) with n >= 2 "
            f"({', '.join(f['key'] + ' p=' + format(f['p'], '.2g') for f in fam)})")


def verdict_lines(cv: dict) -> list[str]:
    out = []
    paths = cv.get("paths") or {"all-reduce": {"optimizers": cv["optimizers"]}}
    for path, pv in paths.items():
        for opt, o in pv["optimizers"].items():
            v = o["verdict"]
            parts = []
            for label, w in (("without error feedback", v), ("with error feedback", v.get("with_ef", {}))):
                if not w.get("family"):
                    continue
                key = w.get("first_costly")
                if key is None:
                    parts.append(f"{label}: no bit width where Euclidean communication costs loss ({_family(w)})")
                    continue
                parts.append(f"{label}: Euclidean first costs loss at **{key}** ({w['bits']:.2f} bits/element; "
                             f"{_family(w)}): {_ci(o['gaps'][key]['euclid_minus_fp32'])} bits/byte; GIFT closes "
                             f"**{_share(w)}** of that gap (GIFT minus Euclidean {_ci(w['gift_minus_euclid'])})")
            controls = ", ".join(v["positive_controls"]) or "none: the design cannot resolve any arm's loss cost"
            out += [f"**{path}, {opt}**: " + ("; ".join(parts) or "no Euclidean/GIFT pair with n >= 2 yet")
                    + f". Arms whose loss cost's own 95% CI excludes zero (uncorrected): {controls}.", ""]
    return out


def _classes(cv: dict) -> str:
    """Which optimizer classes each optimizer name ran as (from the results)."""
    return "; ".join(f"`{opt}` = {' + '.join(f'`{c}`' for c in v['classes'])} ({v['source']})"
                     for opt, v in cv.get("optimizer_classes", {}).items())


def _both_paths(cv: dict) -> list[str]:
    """The two paths side by side: each arm's paired difference to fp32 and share closed per
    path, and the reduce-scatter minus all-reduce difference of the same arm and seed."""
    paths = cv.get("paths", {})
    if len(paths) < 2:
        return []
    ar, rs = paths["all-reduce"]["optimizers"], paths["reduce-scatter"]["optimizers"]
    rows = []
    for opt in rs:
        for arm in rs[opt]["arms"]:
            a = ar.get(opt, {}).get("arms", {}).get(arm)
            gap_key = arm.removeprefix("gift-")
            share = {name: p.get(opt, {}).get("gaps", {}).get(gap_key) for name, p in (("ar", ar), ("rs", rs))}
            between = cv.get("rs_minus_ar", {}).get(opt, {}).get(arm)
            rows.append([opt, arm, "—" if a is None else _ci(a["paired_diff_bpb"]), _ci(rs[opt]["arms"][arm]["paired_diff_bpb"]),
                         "" if share["ar"] is None else _share(share["ar"]), "" if share["rs"] is None else _share(share["rs"]),
                         "—" if between is None else _ci(between)])
    return ["### Both paths side by side", "",
            "Same arms, same seeds, same init and data; `all-reduce` = GIFT's all-reduce on plain modules (each rank's "
            "contribution quantized, then the reduced shard re-encoded for the all-gather); `reduce-scatter` = FSDP2 "
            "(`fully_shard`, 1-D mesh) with GIFT's reduce-scatter (one quantization; `bench.convergence.runner.ShardedTwin`). "
            "Held-out bits/byte minus the same seed's fp32 run of the same path, mean ± 95% CI (t, n seeds); share "
            "closed with its Fieller 95% CI; last column: the reduce-scatter run minus the all-reduce run of the same "
            "arm and seed (paired, 95% CI).", "",
            table(["optimizer", "arm", "all-reduce minus fp32", "reduce-scatter minus fp32", "share closed, all-reduce",
                   "share closed, reduce-scatter", "RS minus AR"], rows), ""]


def other_designs(cv: dict) -> list[str]:
    """Each study run at other ranks or steps (`bench.convergence.arms.study`) next to the main study
    of its path: per optimizer and gap, Euclidean's and GIFT's paired cost and the share closed,
    so a confirmation is read against the result it confirms."""
    paths = cv.get("paths", {})
    rows = []
    for label, pv in paths.items():
        base = paths.get(pv["path"])  # the main study of the same collective path
        if base is None or base is pv:
            continue
        for opt, o in pv["optimizers"].items():
            for key, g in o["gaps"].items():
                b = base["optimizers"].get(opt, {}).get("gaps", {}).get(key)
                rows.append([label, opt, key, _ci(g["euclid_minus_fp32"]), _ci(g["gift_minus_fp32"]), _share(g),
                             "—" if b is None else _ci(b["euclid_minus_fp32"]), "—" if b is None else _ci(b["gift_minus_fp32"]),
                             "—" if b is None else _share(b)])
    if not rows:
        return []
    return ["### Other ranks and longer runs", "",
            "Studies run at another number of ranks (the same global batch, so the same data per step, split over "
            "more ranks) or for more steps (warmup and evaluation scaled with them), each paired within itself by "
            "seed, next to the main study of the same path (2 ranks, the profile's steps). Held-out bits/byte minus "
            "fp32, mean ± t 95% CI (n seeds); share closed with its Fieller 95% CI.", "",
            table(["study", "optimizer", "gap", "Euclidean - fp32", "GIFT - fp32", "share closed",
                   "main: Euclidean - fp32", "main: GIFT - fp32", "main: share closed"], rows), ""]


def convergence(cv: dict, plots: dict) -> list[str]:
    runs = cv["runs"]
    if cv["mode"] == "compiled":
        gift_runs = [r for r in runs if "pass_rewritten" in r]
        how = (f"the FX pass rewrote {sum(r['pass_rewritten'] for r in gift_runs)} managed gradient all-reduces "
               f"over the quantized arms' graphs; {sum(r['pass_fallbacks'] for r in gift_runs)} stayed at full precision")
    else:
        how = ("the backward hooks call the same quantized all-reduce the compiled graph would; "
               "`--conv-compile` runs the pass instead")
    g = cv["gift_config"]
    paths = cv.get("paths") or {"all-reduce": {"optimizers": cv["optimizers"], "seeds": cv["seeds"], "runs": len(runs)}}
    out = ["## 5. Convergence", "",
           f"{cv['world']}-rank gloo data parallelism, {cv['steps']} steps of {cv['tokens_per_step']:,} tokens "
           f"(global), seeds {cv['seeds']}: a seed fixes init and data order, shared by every arm of that seed and "
           "optimizer (and by both paths). Optimizers, as run: "
           f"{_classes(cv) or 'not recorded'}. `muon`: the Muon class on the hidden matrices "
           "(adjust_lr_fn=match_rms_adamw; `Fp32Muon` = `torch.optim.Muon` with its Newton-Schulz iteration in fp32, "
           "`bench.lib.reference`, chosen on CPU), AdamW on embeddings, norms and head (the paper's setting); `adamw`: "
           "AdamW on everything. "
           "Arms: `fp32` (plain fp32 communication, the reference), `euclid-<format>` (`geometry=\"none\"`), "
           f"`gift-<format>` (`geometry=\"lowrank\"`, rank {g['rank']}, refresh every {g['refresh_every']} steps, "
           "every managed layer whitened), `-ef` = error feedback (fp32 residual); the variants that judge what limits "
           "GIFT: `-mom` the map from the "
           "optimizer's momentum (`geometry=\"momentum\"`), `-d2` damping 1e-2, `-auto` the measured selection "
           "(`select=\"auto\"`) instead of every layer, `-two` two-sided whitening from the momentum (an experiment the product "
           "cannot run on row shards, `bench.convergence.runner.TwoSided`; GIFT-only variants are compared with the "
           "plain Euclidean arm). Driver: "
           f"`gift_compile.apply(model, GiftConfig(...), optimizer=...)` run **{cv['mode']}** ({how}). Paths: "
           + ", ".join(f"`{p}` ({v['runs']} runs, seeds {v['seeds']})" for p, v in paths.items()) + ".", "",
           "Differences are final held-out bits/byte minus the same seed's fp32 arm: mean ± half-width of the "
           "t-based 95% CI over n seeds; `*` = the CI excludes zero (per comparison, uncorrected). MDE = the smallest "
           "true difference this design detects with 80% power at the 5% level. A \"first bit width that costs loss\" "
           "is claimed only where Holm's procedure over that family of bit widths rejects (5% family-wise).", ""]
    excluded = cv.get("excluded", [])
    out += ([f"Runs left out ({len(excluded)}): " + "; ".join(f"{'/'.join(map(str, e['key']))}: {e['reason']}"
                                                              for e in excluded) + ".", ""]
            if excluded else [f"Every one of the {len(runs)} runs in the runs files is summarised below (arms with "
                              "n=1 have no CI and enter no test).", ""])
    out += verdict_lines(cv)
    out += _both_paths(cv)
    out += other_designs(cv)
    for path, pv in paths.items():
        for opt, o in pv["optimizers"].items():
            rows = []
            for arm, a in o["arms"].items():
                p = a["paired_diff_bpb"]
                rows.append([arm, f"{a['bits']:.2f}", f"{a['final_bpb']:.4f}", _ci(p),
                             "n/a" if p["n"] < 2 else f"{p['mde80']:.4f}", f"{a['seconds']:.0f}"])
            out += [f"### {path}: {opt}", "", table(["arm", "bits/elem", "bits/byte", "minus fp32", "MDE", "s/run"], rows), ""]
            if o["gaps"]:
                rows = [[k, f"{gp['bits']:.2f}", _ci(gp["euclid_minus_fp32"]), _ci(gp["gift_minus_fp32"]),
                         _ci(gp["gift_minus_euclid"]), _share(gp)]
                        for k, gp in o["gaps"].items()]
                out += ["Gap per bit width (share closed = 1 - GIFT gap / Euclidean gap, where the Euclidean gap is "
                        "positive; its 95% CI is Fieller's interval for the ratio of the paired means (Euclidean - "
                        "GIFT) / (Euclidean - fp32), unbounded when the Euclidean gap itself is not resolved):", "",
                        table(["format", "bits/elem", "Euclidean - fp32", "GIFT - fp32", "GIFT - Euclidean",
                               "share closed"], rows), ""]
    out += [f"Replicas bit-identical at the end of every run: {cv['all_replicas_identical']}.", "",
            f"![convergence]({plots['convergence']})", ""]
    return out


# step-model inputs: (how the default was obtained, source)
def tuning(tunes: list[dict]) -> list[str]:
    """Section 5.2: the short paired runs of `bench.convergence.tune` (each attached JSON file)."""
    out = ["### 5.2 Closing the gap: tuning runs", "",
           "Short paired runs (`python -m bench.convergence.tune`): one optimizer and one wire format, every arm of a seed "
           "sharing init and data order with that seed's fp32 arm. Columns as in 5.1; `vs Euclidean` = the GIFT "
           "variant minus the Euclidean arm with the same error feedback / rounding (mean ± 95% CI, t, n seeds); "
           "share closed with Fieller's 95% CI. Variants: `-ef` error feedback, `-sr` stochastic rounding, "
           "`-dense` dense whitening, `-exact` exact K-FAC statistics instead of the sketch, `-r64` rank 64, "
           "`-rf5` refresh every 5 steps, `-grad` the gradient-side factor G^T G of the step's gradient, `-mom` "
           "the factor M^T M of the optimizer's momentum (`geometry=\"momentum\"`), `-d2` damping 1e-2, `-two` "
           "two-sided whitening from the momentum (an experiment, `bench.convergence.runner.TwoSided`, not in the product).", ""]
    for t in tunes:
        for opt, o in t["optimizers"].items():
            rows = []
            for arm, a in o["arms"].items():
                gap = o["gaps"].get(arm.removeprefix("gift-")) if arm.startswith("gift-") else None
                rows.append([arm, f"{a['bits']:.2f}", _ci(a["paired_diff_bpb"]),
                             _ci(gap["gift_minus_euclid"]) if gap else "", _share(gap) if gap else "",
                             f"{a['seconds']:.0f}"])
            out += [f"`{t.get('command', '').strip()}` ({t['file']}): {opt}, {t['steps']} steps of "
                    f"{t['tokens_per_step']:,} tokens, seeds {t['seeds']}:", "",
                    table(["arm", "bits/elem", "minus fp32", "vs Euclidean", "share closed", "s/run"], rows), ""]
    return out
