"""The frontier's pages (`bench.convergence.frontier` writes the JSON): the method x format table, the
fewest bits within fp32's CI, more ranks, the techniques tried at 2 bits, and the README's
recommendation."""

from __future__ import annotations

import json

from bench.convergence.arms import FORMATS as RUN_FORMATS
from bench.convergence.frontier import ALTERNATIVES_COMMAND as ALT_COMMAND
from bench.convergence.frontier import OUT as FRONTIER


def _frontier() -> dict:
    return json.loads(FRONTIER.read_text())


def _gap_cell(a: dict | None) -> str:
    if a is None:
        return "not run"
    g = a["gap"]
    spread = "" if g["n"] < 2 else f" ± {g['ci95']:.4f}"
    if not a["judged"]:
        return f"{g['mean']:+.4f}{spread} (n={g['n']})"
    verdict = "**within**" if a["within"] else "outside"
    return f"{g['mean']:+.4f}{spread} (n={g['n']}; bound {a['upper_adjusted']:+.4f}) {verdict}"


def config_kwargs(arm: dict) -> dict:
    """The `GiftConfig` keyword arguments of a frontier arm (with `optimizer=` for GIFT's
    defaults; `gift_compile.recipes` names the best arms' ones)."""
    kw = {**RUN_FORMATS[arm["format"]]}
    if arm["method"].startswith("Euclidean"):
        kw["geometry"] = "none"
    if "EF" in arm["method"]:
        kw["error_feedback"] = True
    if "leaky" in arm["method"]:
        kw["error_feedback_decay"] = 0.9
    if "rotation" in arm["method"]:
        kw["block_rotation"] = True
    if "SR" in arm["method"]:
        kw["stochastic_rounding"] = True
    return kw


def _spelled(arm: dict) -> str:
    """The `GiftConfig` a user writes for a frontier arm."""
    return "GiftConfig(" + ", ".join(f"{k}={v!r}".replace("'", '"') for k, v in config_kwargs(arm).items()) + ")"


def best_arms(f: dict) -> dict[str, dict]:
    """Per optimizer, the fewest bits within fp32's CI (among formats of the same width, the
    method with the smallest gap); optimizers with none inside are left out."""
    out = {}
    for opt, o in f["optimizers"].items():
        inside = [a for a in o["arms"] if a.get("within")]
        if inside:
            out[opt] = min(inside, key=lambda a: (round(a["bits_managed"], 2), a["gap"]["mean"]))
    return out


def frontier(_: dict) -> str:
    """The frontier table (method x format: gap to fp32 with its CI, bits counted at the
    collective), the fewest bits within fp32's CI per method and the gap at 2.25 bits, from
    `bench/results/convergence/frontier.json` (`python -m bench.convergence.frontier`)."""
    f = _frontier()
    s = f["study"]
    lines = [f"Reduce-scatter path (FSDP2), {s['world']} ranks, {s['steps']} steps; held-out bits/byte minus fp32's "
             "(same seed), mean ± t 95% CI over n paired seeds; bits per managed element counted at the collectives; "
             f"**within** = inside fp32's 95% CI: the gap's upper bound, Bonferroni-adjusted over the arms with n >= "
             f"{f['min_seeds']} (family-wise {100 * f['alpha']:.0f}%; `bound` in each cell), below the half-width of "
             f"fp32's own CI over its seeds. GIFT arms run the product's defaults (`-dflt`). Command: "
             f"`{f['command']}`.", ""]
    methods = list(next(iter(f["optimizers"].values()))["fewest_within"])
    lines += ["| optimizer | format | bits / managed element (whole gradient) | " + " | ".join(methods) + " |",
              "|---|---|---|" + "---|" * len(methods)]
    for opt, o in f["optimizers"].items():
        by = {(a["format"], a["method"]): a for a in o["arms"]}
        for fmt in dict.fromkeys(a["format"] for a in o["arms"]):
            bits = next(a for a in o["arms"] if a["format"] == fmt)
            lines.append(f"| {opt} | {fmt} | {bits['bits_managed']:.2f} ({bits['bits_whole']:.1f}) | "
                         + " | ".join(_gap_cell(by.get((fmt, m))) for m in methods) + " |")
    lines.append("")
    for opt, o in f["optimizers"].items():
        arms = {a["arm"]: a for a in o["arms"]}
        fewest = "; ".join(f"{m}: " + (f"{arms[a]['format']} at {arms[a]['bits_managed']:.2f} bits" if a else
                                        "no format") for m, a in o["fewest_within"].items())
        shifts = "; ".join(f"{k}: " + ("no comparison (a side has no point within)" if v is None else
                                       f"{v:+.2f} bits") for k, v in o["shift_bits"].items())
        at2 = "; ".join(f"{a['method']} {_gap_cell(a)}" for a in o["arms"] if a["format"] == "int2")
        lines.append(f"* **{opt}** (fp32 {o['fp32']['mean']:.4f} ± {o['fp32']['band95']:.4f}, n={o['fp32']['n']}; "
                     f"{o['family_size']} arms judged). Fewest bits within fp32's CI: {fewest}. GIFT's point left of "
                     f"Euclidean's: {shifts}. At 2.25 bits (int2, block 32): {at2 or 'not run'}.")
    return "\n".join(lines + _alternatives(f.get("alternatives")) + _long(f.get("long")) + _frontier_ranks(f.get("ranks"))
                     + _frontier_techniques(f.get("techniques")))


def _long(long: dict | None) -> list[str]:
    """The 2.5-bit recommendation over 4x the steps (`bench.convergence.frontier.long_horizon`)."""
    if not long:
        return []
    cells = "; ".join(f"`{arm}` " + (f"{_cell(a['gap'])} (n={a['n']})" if a["gap"] else f"{a['n']} paired seed(s) so far")
                      for arm, a in long["arms"].items())
    d = long["difference"]
    diff = (f"GIFT minus Euclidean {_cell(d)} (paired, n={d['n']}, "
            f"{'resolved' if abs(d['mean']) > d['ci95'] else 'not resolved'} at 95%)" if d else
            "GIFT minus Euclidean: fewer than two paired seeds so far")
    return ["", f"Longer horizon ({long['optimizer']}, {long['steps']} steps, 4x the frontier's; gap to fp32 of the same "
            f"seed and length, mean ± t 95% CI): {cells}; {diff}. `{long['command']}`."]


def _cell(g: dict) -> str:
    if g["n"] < 2:
        return f"{g['mean']:+.4f} (one seed, no CI)"
    return f"{g['mean']:+.4f} ± {g['ci95']:.4f}"


def _alternatives(alt: dict | None) -> list[str]:
    """GIFT's best arm against the best Euclidean arm at the same bits (`bench.convergence.frontier.alternatives`)."""
    if not alt:
        return []
    lines = ["", "GIFT against the strongest cheap alternative at the same bits: per optimizer and format, the GIFT "
             "arm and the Euclidean arm (plain, + EF, + leaky EF, + leaky EF + block rotation) with the smallest mean "
             f"gap among the arms with n >= 5; difference = GIFT minus Euclidean in final held-out bits/byte, paired by "
             f"seed, mean ± t 95% CI, Holm over the {alt['family_size']} comparisons (family-wise 5%). Each side's best "
             "is chosen on the same seeds it is judged on, which flatters both alike. Bytes against the production bar "
             f"(the bf16 wire summed in fp32). `{alt['command']}`:", "",
             "| optimizer | format | GIFT's best (gap) | best Euclidean (gap) | GIFT minus Euclidean | resolved (Holm 5%) "
             "| bits / managed element | fewer bits than bf16 |", "|---|---|---|---|---|---|---|---|"]
    for r in alt["rows"]:
        if not r["compared"]:
            have = "; ".join(f"{side}: {', '.join(arms) or 'no arm with n >= 5'}" for side, arms in r["candidates"].items())
            lines.append(f"| {r['optimizer']} | {r['format']} | not compared ({have}) | | | | | |")
            continue
        d = r["difference"]
        verdict = f"**{_alternative_verdict(r)}**" if r["resolved_holm"] else "no"
        bar = "" if r["fewer_bits_than_bar"] is None else f"{r['fewer_bits_than_bar']:.1f}x"
        lines.append(f"| {r['optimizer']} | {r['format']} | {r['gift']} ({_cell(r['gap_gift'])}) | {r['euclid']} "
                     f"({_cell(r['gap_euclid'])}) | {_cell(d)} | {verdict} (n={d['n']}) | {r['bits_gift']:.2f} | {bar} |")
    for opt, bar in alt["bar"].items():
        lines.append("")
        lines.append(f"* production bar, {opt}: " + ("the bf16 wire has no run with n >= 5 yet." if bar is None else
                     f"`{bar['arm']}` sends {bar['bits_managed']:.2f} bits per managed element, gap to fp32 "
                     f"{_cell(bar['gap'])} (n={bar['gap']['n']}), {'within' if bar['within'] else 'outside'} fp32's CI."))
    return lines


def _frontier_ranks(r: dict | None) -> list[str]:
    """2 vs 4 ranks at int2 (`bench.convergence.frontier.ranks`): the gap at each rank count and its change."""
    if not r or not r["arms"]:
        return []

    def kept(v: float | None) -> str:
        return "" if v is None else f" ({v:.0f} layers transformed)"

    lines = ["", f"More ranks, same global batch ({r['optimizer']}, int2; gap to fp32 at the same rank count, mean ± "
             "t 95% CI over the seeds; change = 4 ranks minus 2, paired by seed, Holm over the arms; "
             f"`{r['command']}`):", "",
             "| arm | 2 ranks | 4 ranks | change | resolved (Holm 5%) |", "|---|---|---|---|---|"]
    for a in r["arms"]:
        lines.append(f"| {a['arm']} | {_cell(a['gap2'])}{kept(a['selected2'])} | {_cell(a['gap4'])}{kept(a['selected4'])} "
                     f"| {_cell(a['change'])} | {'yes' if a['change_resolved_holm'] else 'no'} (n={a['change']['n']}) |")
    if r.get("layers"):
        lines += ["", "Layers the defaults transform (of 28), by rank count: `gift-int2-dflt` under the former "
                  "FLOPs-only cost side, `gift-int2-dflt-priced` under the cost side priced against the layer's step "
                  "time (`auto_network_gbps` 100)" + (": the priced rule's 2-rank runs are the former's, its seed-0 "
                  "run at 2 ranks having reproduced them bit for bit" if r.get("priced_reuses_two_rank_runs") else "")
                  + ": " + "; ".join(f"{x['arm']} at {x['world']} ranks {x['selected']:.0f} (n={x['n']})"
                                     for x in r["layers"]) + "."]
    if r.get("versus_euclid"):
        lines += ["", "The defaults against Euclidean int2 at the same rank count (paired by seed, mean ± t 95% CI, "
                  "Holm over these rows):", "", "| arm | ranks | gap to fp32 | minus Euclidean | resolved (Holm 5%) |",
                  "|---|---|---|---|---|"]
        for v in r["versus_euclid"]:
            d = v["minus_euclid"]
            verdict = (("yes, better" if d["mean"] < 0 else "yes, worse") if v["resolved_holm"]
                       else "no" if d["n"] >= 2 else "not tested")
            lines.append(f"| {v['arm']} | {v['world']} | {_cell(v['gap'])} | {_cell(d)} | {verdict} (n={d['n']}) |")
    return lines


def _frontier_techniques(t: dict | None) -> list[str]:
    """Techniques at 2 bits (`bench.convergence.frontier.techniques`): each against the arm it modifies."""
    if not t or not t["arms"]:
        return []

    lines = ["", f"Techniques at 2 bits ({t['optimizer']}; change = the arm with the technique minus the arm without, "
             "paired by seed, mean ± t 95% CI, Holm over the techniques' arms; kept where resolved and negative; gap "
             f"to fp32 judged as above over {t['family_size']} arms against fp32's ±{t['band95']:.4f}; "
             f"`{t['command']}`):", "",
             "| technique | arm | bits (without) | change | resolved (Holm 5%) | gap to fp32 (bound) |",
             "|---|---|---|---|---|---|"]
    for a in t["arms"]:
        verdict = "**within**" if a["within"] else "outside"
        lines.append(f"| {a['technique']} | {a['arm']} | {a['bits_managed']:.3f} ({a['base_bits_managed']:.3f}) | "
                     f"{_cell(a['change'])} | {'yes, kept' if a['kept'] else 'yes, worse' if a['change_resolved_holm'] else 'no'}"
                     f" (n={a['change']['n']}) | {_cell(a['gap'])} ({a['upper_adjusted']:+.4f}) {verdict} |")
    return lines


def _alternative_verdict(row: dict) -> str:
    """`GIFT better`, `Euclidean better` or `not resolved`: a compared alternatives row's paired
    difference as Holm judged it."""
    if not row["resolved_holm"]:
        return "not resolved"
    return "GIFT better" if row["difference"]["mean"] < 0 else "Euclidean better"


def _against_alternative(f: dict, opt: str, best: dict) -> str:
    """The headline's margin of `best` against the strongest cheap alternative at its bits and
    its bytes against the bf16 wire, from `bench.convergence.frontier.alternatives` (or why it is missing)."""
    alt = f.get("alternatives") or {"rows": [], "bar": {}}
    row = next((r for r in alt["rows"] if r["optimizer"] == opt and r["format"] == best["format"]), None)
    if row is None or not row["compared"]:
        margin = f"Not yet held to the best Euclidean arm at {best['format']} (no n >= 5 pair: `{ALT_COMMAND}`)."
    else:
        d = row["difference"]
        verdict = "resolved" if row["resolved_holm"] else "not resolved"
        margin = (f"Against the strongest cheap alternative at these bits (`{row['euclid']}`), GIFT's best "
                  f"(`{row['gift']}`) differs by {_cell(d)} bits/byte (paired, n={d['n']}, {verdict} at Holm 5% "
                  f"over {alt['family_size']} comparisons).")
    widths = [r for r in alt["rows"] if r["optimizer"] == opt and r["compared"]]
    if widths:
        margin += (" Per bit width against the best Euclidean arm (same test): "
                   + ", ".join(f"{r['format']} {_alternative_verdict(r)}" for r in widths) + ".")
    bar = alt["bar"].get(opt)
    if bar is not None:
        margin += (f" It sends {bar['bits_managed'] / best['bits_managed']:.1f}x fewer bits than the bf16 wire "
                   f"(gap {_cell(bar['gap'])}).")
    return margin


def frontier_headline(_: dict) -> str:
    """The README's recommendation: per optimizer, the fewest bits within fp32's CI and the
    configuration that sends them, from `bench/results/convergence/frontier.json`."""
    f = _frontier()
    lines = []
    bests = best_arms(f)
    for opt, o in f["optimizers"].items():
        if opt not in bests:
            lines.append(f"* **{opt}**: no measured configuration within fp32's 95% CI.")
            continue
        best = bests[opt]
        lines.append(f"* **{opt}**: `{_spelled(best)}`{' with `optimizer=`' if 'GIFT' in best['method'] else ''} "
                     f"({best['method']}): {best['bits_managed']:.3f} bits per managed element as counted at the "
                     f"collective, {best['gap']['mean']:+.4f} ± {best['gap']['ci95']:.4f} bits/byte against fp32 "
                     f"(n={best['gap']['n']}; family-wise upper bound {best['upper_adjusted']:+.4f} against fp32's own "
                     f"95% CI ±{o['fp32']['band95']:.4f}). {_against_alternative(f, opt, best)}")
    return "\n".join(lines + [f"(Reduce-scatter path, {f['study']['world']} ranks, {f['study']['steps']} steps; "
                              "the fewest bits whose gap to fp32 stays inside fp32's 95% CI, family-wise 5%; "
                              "[the frontier](docs/benchmarks.md#the-frontier); `" + f["command"] + "`.)"])
