"""The frontier's pages (`bench.convergence.frontier` writes the JSON): the method x format table, the
fewest bits within fp32's CI, more ranks, the techniques tried at 2 bits, and the README's
recommendation."""

from __future__ import annotations

import json

from bench.convergence.arms import FORMATS as RUN_FORMATS
from bench.convergence.frontier import ALTERNATIVES_COMMAND as ALT_COMMAND
from bench.convergence.frontier import OUT as FRONTIER
from bench.convergence.frontier import POWERSGD_COMMAND


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
    return "\n".join(lines + _alternatives(f.get("alternatives")) + _powersgd(f.get("powersgd"))
                     + _long(f.get("long")) + _larger(f.get("larger_model")) + _frontier_ranks(f.get("ranks"))
                     + _two_level(f.get("two_level")) + _whole_gradient(f.get("whole_gradient"))
                     + _frontier_techniques(f.get("techniques")))


def _n_cell(g: dict | None) -> str:
    """A paired difference with its n (`not run` where there is none)."""
    return "not run" if g is None else f"{_cell(g)} (n={g['n']})"


def _verdict(row: dict, key: str, better: str, worse: str) -> str:
    """A Holm-judged row's verdict: resolved one way or the other, not resolved, or (n < 5)
    shown with its n and never called resolved."""
    d = row[key]
    if d is None:
        return "not compared"
    if not row["judged"]:
        return f"not judged (n={d['n']} < 5)"
    if not row["resolved_holm"]:
        return f"not resolved (n={d['n']})"
    return f"**{better if d['mean'] < 0 else worse}** (n={d['n']})"


def _powersgd(p: dict | None) -> list[str]:
    """torch's PowerSGD against fp32 and GIFT at the nearest bits (`bench.convergence.frontier.powersgd`)."""
    if not p or not p["rows"]:
        return ["", f"Against torch's PowerSGD: no runs yet (`{POWERSGD_COMMAND}`)."]
    s = p["study"]
    lines = ["", f"Against torch's PowerSGD (what a DDP user already has): torch's `DistributedDataParallel` with "
             "torch's `powerSGD_hook`, error feedback and warm start on, torch's default `min_compression_rate` (2), "
             f"compression from step {p['rows'][0]['start_iter']} (the end of the learning-rate warm-up; fp32 before), "
             f"on the {s['path']} path, {s['world']} ranks, {s['steps']} steps, the study's model, data and optimizers. "
             "Bits per managed element: counted from the tensors the hook sent, r (m + n) 32 / (m n) per compressed "
             "matrix, over the compressed steps (over all steps, the fp32 warm-up included, in brackets; PowerSGD also "
             "compresses the embedding and the head, which GIFT sends in fp32: whole gradient in the last column). GIFT: "
             "its all-reduce arm (n >= 5) at the nearest bits as its collectives counted them, the smallest gap among "
             "arms at those bits. GIFT minus PowerSGD in final held-out bits/byte, paired by seed, mean ± t 95% CI, "
             f"Holm over the {p['family_size']} rows with n >= 5 (family-wise 5%); rows with fewer seeds are shown "
             f"with their n and never called resolved. Time at equal loss is not measured here (CPU ranks: their "
             f"seconds are no speed measurement). `{p['command']}`:", "",
             "| optimizer | PowerSGD rank | bits / managed element (all steps) | gap to fp32 | GIFT at the nearest bits "
             "(bits, gap) | GIFT minus PowerSGD | verdict (Holm 5%) | bits / gradient element |",
             "|---|---|---|---|---|---|---|---|"]
    for r in p["rows"]:
        g = r["gift"]
        gift = "no GIFT arm with n >= 5" if g is None else f"`{g['arm']}` ({g['bits_managed']:.2f}, {_n_cell(g['gap'])})"
        lines.append(f"| {r['optimizer']} | {r['rank']} | {r['bits_managed']:.3f} ({r['bits_all_steps']:.2f}) | "
                     f"{_n_cell(r['gap'])} | {gift} | {_n_cell(r['difference'])} | "
                     f"{_verdict(r, 'difference', 'GIFT better', 'PowerSGD better')} | {r['bits_whole']:.3f} |")
    for opt, o in p["optimizers"].items():
        check = o["ddp_check"]
        if check:
            same = sum(c["losses_identical"] for c in check)
            worst = max(abs(c["max_loss_difference"]) for c in check)
            final = max(abs(c["final_difference"]) for c in check)
            lines += ["", f"* DDP's own fp32 path (`fp32-ddp`) against the study's fp32 all-reduce, {opt}, seed(s) "
                      f"{', '.join(str(c['seed']) for c in check)}: largest per-step training-loss difference "
                      f"{worst:.1e}, final held-out bits/byte {final:.1e} apart (bit-identical curves on {same} of "
                      f"{len(check)}); the PowerSGD rows pair with the study's fp32 runs."]
    return lines


def _larger(x: dict | None) -> list[str]:
    """The 2.5-bit pair on the 4x model (`bench.convergence.frontier.larger_model`)."""
    if not x:
        return []
    if not x["model_params"]:
        return ["", f"A larger model (the `{x['model']}` study model): no runs yet (`{x['command']}`)."]
    params = ", ".join(f"{n / 1e6:.1f}M" for n in x["model_params"])
    cells = "; ".join(f"`{arm}` {_n_cell(a['gap'])}" for arm, a in x["arms"].items())
    d = x["difference"]
    verdict = ("not compared" if d is None else f"not judged (n={d['n']} < 5)" if d["n"] < 5
               else "resolved" if x["resolved"] else "not resolved")
    return ["", f"A larger model ({x['optimizer']}, the `{x['model']}` study model, {params} parameters against the "
            f"small model's 3.3M, {x['steps']} steps, the frontier's design; gap to fp32 of the same seed, mean ± t 95% "
            f"CI): {cells}; GIFT minus Euclidean {_n_cell(d)}, {verdict} at 95%. `{x['command']}`."]


def _two_level(t: dict | None) -> list[str]:
    """Flat against two levels at 2 x 2 (`bench.convergence.frontier.two_level`)."""
    if not t:
        return []
    if not t["arms"]:
        return ["", f"Two levels at 2 x 2: no runs yet (`{t['command']}`)."]
    lines = ["", f"Two levels at 2 x 2 ({t['optimizer']}, {t['world']} ranks as 2 nodes x {t['ranks_per_node']} "
             "(`ranks_per_node=2`): each node reduce-scatters natively, GIFT's codec runs once on the node's sum), "
             "against the same arm flat (one level) and fp32 at 4 ranks (n="
             f"{t['fp32_n']}); gap to fp32 of the same seed, mean ± t 95% CI; change = two-level minus flat, paired "
             f"by seed, Holm over the {t['family_size']} arms with n >= 5; rows with fewer seeds are shown with "
             f"their n and never called resolved. `{t['command']}`:", "",
             "| arm | flat gap | two-level gap | two-level minus flat | verdict (Holm 5%) |", "|---|---|---|---|---|"]
    for r in t["arms"]:
        lines.append(f"| {r['arm']} | {_n_cell(r['gap_flat'])} | {_n_cell(r['gap_two_level'])} | "
                     f"{_n_cell(r['change'])} | {_verdict(r, 'change', 'two levels better', 'two levels cost loss')} |")
    if t["reproduced"]:
        same = sum(x["identical"] for x in t["reproduced"])
        lines += ["", f"* The flat `gift-int2-dflt` runs reproduce the committed 4-rank ones on {same} of "
                  f"{len(t['reproduced'])} seeds bit for bit (the pipeline fp32's 4-rank runs came from)."]
    return lines


def _whole_gradient(w: dict | None) -> list[str]:
    """The embedding and head at the arm's format, bf16 and fp32 (`bench.convergence.frontier.whole_gradient`)."""
    if not w:
        return []
    if not any(a["n"] for outside, a in w["arms"].items() if outside != "fp32"):
        return ["", f"The whole gradient (the embedding and the head at the layers' format or at bf16): no runs yet "
                f"(`{w['command']}`)."]
    lines = ["", f"The whole gradient ({w['optimizer']}, `{w['base']}`: the recipe `muon-int2-leaky-ef`'s codec with "
             "the product's defaults, the frontier's design): the embedding and the output head at the layers' "
             "format (int2, `excluded_format=\"same\"`), at bf16 (the default) and raw at fp32 (the study's arms), "
             "the norms at bf16 in the first two; gap to fp32 of the same seed (mean ± t 95% CI), bytes handed to "
             f"collectives per step and rank (counted), and the differences paired by seed, Holm over the "
             f"{w['family_size']} comparisons with n >= 5. `{w['command']}`:", "",
             "| embedding and head at | arm | gap to fp32 | MB per step |", "|---|---|---|---|"]
    for outside, a in w["arms"].items():
        mb = "" if a["wire_mb_per_step"] is None else f"{a['wire_mb_per_step']:.2f}"
        lines.append(f"| {outside} | `{a['arm']}` | {_n_cell(a['gap'])} | {mb} |")
    lines += ["", "| comparison | difference | verdict (Holm 5%) |", "|---|---|---|"]
    for r in w["rows"]:
        lines.append(f"| {r['comparison']} | {_n_cell(r['difference'])} | "
                     f"{_verdict(r, 'difference', 'the first better', 'the first costs loss')} |")
    return lines


def _long(long: dict | None) -> list[str]:
    """The 2.5-bit recommendation over 4x the steps (`bench.convergence.frontier.long_horizon`)."""
    if not long:
        return []
    cells = "; ".join(f"`{arm}` " + (f"{_cell(a['gap'])} (n={a['n']})" if a["gap"] else f"{a['n']} paired seed(s) so far")
                      for arm, a in long["arms"].items())
    d = long["difference"]
    verdict = (("resolved" if long.get("resolved") else "not resolved") + " at 95%") if d and d["n"] >= 5 \
        else "n < 5: not judged"
    diff = (f"GIFT minus Euclidean {_cell(d)} (paired, n={d['n']}, {verdict})" if d else
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


def powersgd_verdict(p: dict | None) -> str:
    """The README's verdict against torch's PowerSGD, per optimizer, from the Holm-judged rows of
    `bench.convergence.frontier.powersgd` (rows with n < 5 named with their n, never called resolved)."""
    head = "* **against torch's PowerSGD** (DDP + `powerSGD_hook`, all-reduce path, 2 ranks, 120 steps; GIFT's all-reduce arm at the nearest bits; [the table](docs/benchmarks.md#the-frontier)): "
    if not p or not p["rows"]:
        return head + f"not measured yet (`{POWERSGD_COMMAND}`)."
    parts = []
    for opt in dict.fromkeys(r["optimizer"] for r in p["rows"]):
        cells = []
        for r in (r for r in p["rows"] if r["optimizer"] == opt):
            d = r["difference"]
            what = (f"rank {r['rank']} ({r['bits_managed']:.2f} bits): " +
                    ("no GIFT arm to pair" if d is None else
                     f"GIFT (`{r['gift']['arm']}`, {r['gift']['bits_managed']:.2f} bits) minus PowerSGD {_cell(d)}, "
                     + _verdict(r, "difference", "GIFT better", "PowerSGD better").replace("**", "")))
            cells.append(what)
        parts.append(f"{opt}: " + "; ".join(cells))
    judged = [r for r in p["rows"] if r["judged"]]
    wins = sum(r["resolved_holm"] and r["difference"]["mean"] < 0 for r in judged)
    losses = sum(r["resolved_holm"] and r["difference"]["mean"] > 0 for r in judged)
    tally = (f"Of {len(judged)} rows with n >= 5 (Holm 5%), GIFT better in {wins}, PowerSGD better in {losses}, "
             f"not resolved in {len(judged) - wins - losses}" if judged else "No row has n >= 5 yet, so none is judged")
    return head + f"{tally}. " + ". ".join(parts) + "."


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
    lines.append(powersgd_verdict(f.get("powersgd")))
    return "\n".join(lines + [f"(Reduce-scatter path, {f['study']['world']} ranks, {f['study']['steps']} steps; "
                              "the fewest bits whose gap to fp32 stays inside fp32's 95% CI, family-wise 5%; "
                              "[the frontier](docs/benchmarks.md#the-frontier); `" + f["command"] + "`.)"])
