"""The pages' measured-number blocks (README.md, docs/*.md), rendered from the committed results.

A number typed into a page by hand goes stale when its section is re-run (the step-time
bullet said -9.1% for GIFT fp8 on 13 fc2 layers, from the step model of 13:06, after the
re-run of 14:50 that prices deselected layers as the code runs them gave -10.2%). So the
blocks between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` are generated, each on the page
`PAGES` names: `python -m bench.pages.readme` rewrites them and bench/results/REPORT.md (which
`bench.pages.report.render` writes from results.json), `--check` exits non-zero when any of them
differs from what its generator gives (a test runs the check on the committed files). The
blocks that read results.json are here; those that read other committed files are in
`bench.pages.blocks`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

from bench.cluster import emulated as cluster_emulated
from bench.fidelity.sweep import ORACLES
from bench.fidelity import delayed_scale, kernel_traffic, map_precision
from bench.cluster import exit_stress
from bench.step_model import topology as topology_model
from bench.convergence import map_precision_arms
from bench.pages import blocks as pages, frontier as pages_frontier, layouts as pages_layouts, report
from bench.pages import selection as pages_selection
from bench.lib.formatting import paired_ci, share_closed, signed_pct
from bench.pages.report_cost import CODEC_PAIR
from gift_compile.geometry.table import IDENTITY_KIND
from gift_compile.config import GiftConfig
from bench.lib import paths

ROOT = paths.ROOT
RESULTS = paths.RESULTS / "results.json"
REPORT = paths.RESULTS / "REPORT.md"


def _share(g: dict) -> str:
    """The pages' wording of a gap's share closed (`NN% closed (lo% to hi%)`)."""
    return share_closed(g, unresolved="no resolved Euclidean gap to close", closed=" closed")


def step_model(r: dict) -> str:
    """The step-time projection bullet (calibrated scenario, and with TF32 matmuls): a projection
    from codec bytes counted on the CPU, priced at an assumed share of HBM bandwidth (the GPU-priced
    model is `bench.step_model.topology`)."""
    sm = r["step_model"]
    cal, tf32 = sm["scenarios"]["calibrated"], sm["scenarios"]["calibrated, TF32 matmuls"]
    a = {k: v["vs_fp32"] for k, v in cal["arms"].items()}
    t = {k: v["vs_fp32"] for k, v in tf32["arms"].items()}
    return (f"* **Step-time projection from CPU-counted bytes** ({cal['model']}, {cal['inputs']['gpus']} GPUs; a projection, "
            "not a GPU measurement: codec bytes counted in the kernels Inductor generates for the CPU, priced at copy "
            f"bandwidth ({cal['inputs']['hbm_tbytes']:g} TB/s x {cal['inputs']['kernel_efficiency']:g}, assumed) plus the "
            "map's FLOPs at an assumed fp32 rate, statistics FLOPs counted, hardware figures assumed, the "
            "exposed-communication fraction "
            f"calibrated so Euclidean FP8 reproduces the paper's {signed_pct(sm['paper']['euclid-fp8'])}): GIFT fp8 on 13 fc2 "
            f"layers {signed_pct(a['gift-fp8 (13 fc2)'])} (paper {signed_pct(sm['paper']['gift-fp8 (13 fc2)'])}; as the code runs "
            "it, the deselected layers take the Euclidean codec without statistics), GIFT fp8 on all layers "
            f"{signed_pct(a['gift-fp8 (all layers)'])}, GIFT NVFP4 on all layers {signed_pct(a['gift-nvfp4 (all layers)'])}, "
            f"Euclidean NVFP4 {signed_pct(a['euclid-nvfp4'])}; with TF32 matmuls for the codec "
            f"{signed_pct(t['gift-fp8 (13 fc2)'])} / {signed_pct(t['gift-fp8 (all layers)'])} (13 fc2 / all layers). "
            f"Step model run: `{r['meta']['sections']['step_model']['command']}`.")


def convergence(r: dict) -> str:
    """The convergence bullet: per path and optimizer, each bit width's gaps and share closed,
    and where GIFT is resolved better or worse than Euclidean (all computed from the summary)."""
    cv = r["convergence"]
    classes = "; ".join(f"`{o}` = {' + '.join(v['classes'])}" for o, v in cv["optimizer_classes"].items())
    lines = [f"* **Convergence** ({cv['world']} gloo ranks, the bench's small Llama, {cv['steps']} steps of "
             f"{cv['tokens_per_step']:,} tokens; every arm of a seed shares init and data order; held-out bits/byte "
             "minus fp32 communication of the same seed and path, mean ± t-based 95% CI over n seeds; share closed "
             f"with Fieller's 95% CI; report section 5). Optimizers as run: {classes}."]
    for path, pv in cv["paths"].items():
        for opt, o in pv["optimizers"].items():
            parts = []
            for key, g in o["gaps"].items():
                parts.append(f"{key} ({g['bits']:.2f} bits): Euclidean {paired_ci(g['euclid_minus_fp32'])}, GIFT "
                             f"{paired_ci(g['gift_minus_fp32'])}, {_share(g)}")
            better = [k for k, g in o["gaps"].items() if g["gift_minus_euclid"]["resolved"] and g["gift_minus_euclid"]["mean"] < 0]
            worse = [k for k, g in o["gaps"].items() if g["gift_minus_euclid"]["resolved"] and g["gift_minus_euclid"]["mean"] > 0]
            v = o["verdict"]
            first = v.get("first_costly")
            lines.append(
                f"  **{path}, {opt}**: " + ("; ".join(parts) if parts else "no Euclidean/GIFT pair yet")
                + ". Euclidean first costs loss (Holm over the tested bit widths, 5% family-wise) at "
                + (f"**{first}**" if first else "no tested width")
                + f"; GIFT resolved better than Euclidean at: {', '.join(better) or 'none'}; worse at: "
                + f"{', '.join(worse) or 'none'}.")
    return "\n".join(lines)


def fidelity(r: dict) -> str:
    """The fidelity bullets: which metric GIFT improves (plain, whitened, Muon; per layer) and
    summing over ranks against the fair baselines (section 2 of the report)."""
    f, ref = r["fidelity"], r["wire"]["models"][0]
    layers = len(f["layers"])

    def cell(metric: str, fmt: str, t: str = "kfac-r32") -> tuple[float, float, float]:
        e, g = f[metric][fmt]["euclidean"], f[metric][fmt][t]
        return e, g, e / g

    def better(per_layer: str, fmt: str) -> int:
        e, g = f[per_layer][fmt]["euclidean"], f[per_layer][fmt]["kfac-r32"]
        return sum(g[k] < e[k] for k in e)

    def gains(metric: str) -> str:
        (e8, g8, x8), (e4, g4, x4) = cell(metric, "e4m3/row"), cell(metric, "nvfp4")
        return f"{x8:.2f}x for E4M3 ({e8:.3f} -> {g8:.3f}), {x4:.2f}x for NVFP4 ({e4:.3f} -> {g4:.3f})"

    (pe8, pg8, _), (pe4, pg4, _) = cell("energy_weighted", "e4m3/row"), cell("energy_weighted", "nvfp4")
    sketch = [f[m][fmt]["kfac-sketch-r32"] / f[m][fmt]["kfac-r32"] for m in ("whitened", "muon")
              for fmt in ("e4m3/row", "nvfp4")]
    dense = [cell("muon", fmt, "kfac-dense")[2] for fmt in ("e4m3/row", "nvfp4")]
    r64 = [cell("muon", fmt, "kfac-r64")[2] / cell("muon", fmt)[2] for fmt in ("e4m3/row", "nvfp4")]
    worse = [t for t in ("hadamard", "grad-r32") if cell("muon", "nvfp4", t)[2] < cell("muon", "nvfp4")[2]]
    ranks = sorted(f["multirank"], key=int)
    lo, hi = ranks[0], ranks[-1]
    m = {p: f["multirank"][p]["e4m3/row"]["euclidean"] for p in (lo, hi)}
    return "\n".join([
        f"* **Which metric GIFT improves** (one round trip over the {layers} managed layers of a "
        f"{ref['params'] / 1e6:.1f}M-parameter Llama trained on the corpus, transforms from the previous batch's K-FAC "
        f"factor; deterministic, no error bars; GIFT = rank 32, E4M3 per row). Plain L2: GIFT is "
        f"{'*worse*' if pg8 > pe8 and pg4 > pe4 else 'mixed'} (E4M3 {pe8:.4f} -> {pg8:.4f}, NVFP4 {pe4:.3f} -> "
        f"{pg4:.3f}; better on {better('per_layer', 'e4m3/row')} of {layers} layers). Whitened (this batch's A, a "
        f"K-FAC-style preconditioner's view): {gains('whitened')}, {better('per_layer_whitened', 'e4m3/row')} of "
        f"{layers} layers. Muon's orthogonalized update: {gains('muon')}, {better('per_layer_muon', 'e4m3/row')} of "
        f"{layers} layers; dense whitening {dense[0]:.2f}x / {dense[1]:.2f}x, r=64 over r=32 {r64[0]:.2f}x / "
        f"{r64[1]:.2f}x, the sketch's error {min(sketch):.3f}-{max(sketch):.3f}x exact statistics' in the whitened "
        f"and Muon metrics; worse than K-FAC in the Muon metric: {', '.join(worse) or 'none'}.",
        f"* **Summing over ranks, fair baselines** (relative error of the mean, E4M3 per row, real gradients split "
        f"into P simulated ranks): ours (local scales, each sender decoded with its own scales, fp32 sum) "
        f"{m[lo]['ours_reduce_scatter']:.3f} reduce-scatter / {m[lo]['ours_all_reduce']:.3f} all-reduce at P={lo} "
        f"and {m[hi]['ours_reduce_scatter']:.3f} / {m[hi]['ours_all_reduce']:.3f} at P={hi}; an in-network FP8 sum "
        f"with one agreed scale {m[lo]['agreed_in_network']:.3f} (P={lo}) and {m[hi]['agreed_in_network']:.3f} "
        f"(P={hi}; {m[hi]['agreed_in_network_headroom']:.3f} with log2(P) bits of headroom); the original method's "
        f"sum of differently scaled codes {m[lo]['original']:.2f} / {m[hi]['original']:.2f}, with replicas that "
        f"disagree (spread {m[lo]['replica_spread']:.2f} / {m[hi]['replica_spread']:.2f}).",
    ])


def wire(r: dict) -> str:
    """The wire-bytes bullet: the largest model at the largest world, all-reduce, as handed to
    the collectives (the tests check this accounting equals the bytes counted at run time)."""
    rows = r["wire"]["rows"]
    world = max(x["world"] for x in rows)
    model = r["wire"]["models"][-1]["name"]
    by = {x["format"]: x for x in rows if (x["model"], x["world"], x["op"]) == (model, world, "all_reduce")}
    cells = [f"{fmt} {by[fmt]['vs_fp32']:.2f}x of fp32 ({by[fmt]['managed_bits_per_element']:.2f} bits per managed "
             "element)" for fmt in ("fp8 row", "nvfp4") if fmt in by]
    return (f"* **Wire bytes** ({model}, {world} ranks, all-reduce, unmanaged parameters fp32; the collectives' own "
            "accounting, which the tests check equals the bytes counted at run time): " + ", ".join(cells)
            + "; the integer formats' bits per element are in the formats table of [design.md](design.md).")


# The value study's targets (issue text, not results): NVFP4 with the per-optimizer default within
# fp32's 95% CI or closing this share of Euclidean's gap; int2 closing this share.
TARGETS = {"nvfp4": 0.8, "int2": 0.5}


def study_gap(o: dict, fmt: str, geometry: str) -> str | None:
    """The gap key of the study's arm of the per-optimizer map at `fmt`: the GIFT arm with no
    codec modifier (plain or `-geo`: every layer, the study's refresh) whose runs resolved
    `geometry`."""
    for key, g in o["gaps"].items():
        parts = key.split("-")
        if parts[0] == fmt and set(parts[1:]) <= {"geo"} and o["arms"][f"gift-{key}"].get("geometry") == geometry:
            return key
    return None


def default_gap(o: dict, fmt: str, geometry: str) -> str | None:
    """The gap key the targets and the headline judge at `fmt`: the product's defaults
    (`<fmt>-dflt`, what `GiftConfig(format=..., geometry="auto")` with `optimizer=` runs) once
    they have as many seeds as the study's arm of the default map (`study_gap`), else that arm
    (a default still running is not judged on fewer seeds than the arm it replaces)."""
    study, key = study_gap(o, fmt, geometry), f"{fmt}-dflt"
    if key not in o["gaps"] or o["arms"][f"gift-{key}"].get("geometry") != geometry:
        return study
    if study is not None and o["gaps"][key]["gift_minus_fp32"]["n"] < o["gaps"][study]["gift_minus_fp32"]["n"]:
        return study
    return key


def _versus(c: dict) -> str:
    """One paired comparison of a default arm with another arm (`_defaults_vs_study`)."""
    if c["n"] < 2:
        return f"minus `{c['arm']}` {c['mean']:+.4f} (n=1)"
    verdict = ("resolved (Holm 5%)" if c.get("holm_rejects") else "not resolved (Holm 5%)")
    return f"minus `{c['arm']}` {c['mean']:+.4f} ± {c['ci95']:.4f} (n={c['n']}, {verdict})"


def defaults(r: dict) -> str:
    """What a user gets by default, per study and optimizer: the `-dflt` arms (map and selection
    metric chosen from the optimizer, measured selection, the product's refresh cadence) against
    Euclidean, the study's every-layer arm and the plain-L2 metric, all from the summary."""
    cv = r["convergence"]
    lines = [f"* **What the defaults deliver** (`GiftConfig(format=F, geometry=\"auto\")` with `optimizer=`: the "
             "map and the selection metric chosen from the optimizer, `select=\"auto\"`, refreshes after "
             f"a warm-up from step {GiftConfig.refresh_warmup} every {GiftConfig.refresh_every} steps: the `-dflt` "
             "arms; `-nowarm`: without the warm-up; against Euclidean at the same format, the "
             f"study's arm of the same map on every layer (refresh every {cv['gift_config']['refresh_every']}), and "
             "the same default judging layers by the plain-L2 error (`-dflt-euc`, the metric before it followed "
             "the optimizer); held-out bits/byte minus fp32, mean ± 95% CI over n seeds; default minus another "
             "arm paired per seed, Holm over each optimizer's comparisons):"]
    for study, pv in cv["paths"].items():
        for opt, o in pv["optimizers"].items():
            for arm, cmp in o.get("defaults", {}).items():
                key, a = arm.removeprefix("gift-"), o["arms"][arm]
                g = o["gaps"][key]
                kept = (f", {a['selected_layers']:.1f} of {a['managed_layers']} layers kept" if "selected_layers" in a
                        else "")
                cells = [f"Euclidean {paired_ci(g['euclid_minus_fp32'])}",
                         f"default `{arm}` (`{a['geometry']}`, `{a.get('select_metric')}` metric{kept}): "
                         f"{paired_ci(g['gift_minus_fp32'])}, {_share(g)}"]
                if "study" in cmp:
                    cells.append(f"study's arm `{cmp['study']['arm']}`: {_share(o['gaps'][cmp['study']['arm'].removeprefix('gift-')])}")
                if "plain_metric" in cmp:
                    e = o["arms"][cmp["plain_metric"]["arm"]]
                    kept_e = f" ({e['selected_layers']:.1f} layers kept)" if "selected_layers" in e else ""
                    cells.append(f"plain-L2 metric{kept_e}: "
                                 f"{_share(o['gaps'][cmp['plain_metric']['arm'].removeprefix('gift-')])}")
                cells.extend(f"default {_versus(c)}" for c in cmp.values())
                lines.append(f"  {study}, {opt}: " + "; ".join(cells) + ".")
    return "\n".join(lines)


def closing(r: dict) -> str:
    """Where the per-optimizer default stands against the study's targets, per study (path,
    ranks, steps), and what the Muon sweep and the trained candidates say about the rest."""
    cv = r["convergence"]
    lines = ["* **Against the targets** (NVFP4 with the per-optimizer default (the `-dflt` arm, the product's "
             "defaults, where the study ran it) within fp32's 95% CI or closing >= "
             f"{TARGETS['nvfp4']:.0%} of Euclidean's gap; int2 closing >= {TARGETS['int2']:.0%}; computed from the "
             "convergence summary, n seeds per study; judged only where Euclidean's own cost is resolved):"]
    for study, pv in cv["paths"].items():
        for opt, o in pv["optimizers"].items():
            geometry = cv["default_geometry"][opt]
            cells = []
            for fmt, target in TARGETS.items():
                key = default_gap(o, fmt, geometry)
                if key is None:
                    continue
                g = o["gaps"][key]
                if g["gift_minus_fp32"]["n"] < 2:
                    cells.append(f"{fmt} (`gift-{key}`): n={g['gift_minus_fp32']['n']}, no test yet")
                    continue
                within = not g["gift_minus_fp32"]["resolved"]
                cell = (f"{fmt} (`gift-{key}`): Euclidean {paired_ci(g['euclid_minus_fp32'])}, GIFT {paired_ci(g['gift_minus_fp32'])}"
                        + (" (its 95% CI includes fp32)" if within else "") + f", {_share(g)} -> ")
                if not g["euclid_minus_fp32"]["resolved"]:
                    # the design cannot tell a cost from none: "within fp32's CI" would be noise
                    better = g["gift_minus_euclid"]["resolved"] and g["gift_minus_euclid"]["mean"] < 0
                    cell += ("no verdict (Euclidean's own cost is not resolved at this n)"
                             + ("; GIFT resolved better than Euclidean (paired)" if better else ""))
                else:
                    share = g["share_closed"]
                    met = (fmt == "nvfp4" and within) or (share == share and share >= target)
                    cell += "**met**" if met else "not met"
                cells.append(cell)
            if cells:
                lines.append(f"  {study}, {opt} (default `{geometry}`): " + "; ".join(cells) + ".")
    sweeps = {sw["file"]: sw for sw in r.get("sweeps", [])}
    ar = cv["paths"].get("all-reduce", {}).get("optimizers", {}).get("muon", {}).get("gaps", {})
    main, mom, two = (sweeps.get(f) for f in ("fidelity_sweep.json", "fidelity_sweep_mom.json",
                                              "fidelity_sweep_two_sided.json"))
    if main and mom and two and "nvfp4-mom-d2" in ar and "nvfp4-two" in ar:
        def gain(sw: dict, t: str) -> float:
            e = sw["errors"]["muon-mom"]["nvfp4"]
            return e["euclidean"] / e[t]

        damp = [gain(main, t) for t in ("kfac-r32-d1e-4", "kfac-r32", "kfac-r32-d1e-2", "kfac-r32-d1e-1")]
        mlp_in = [main["by_kind"]["muon-mom"]["nvfp4"]["kfac-r32"][k] for k in ("w1", "w3")]  # gains per layer kind
        lines.append(
            "  What limits it under Muon (`fidelity_sweep.json`, Muon-trained reference, error of Muon's momentum "
            f"update at NVFP4, gain over Euclidean): K-FAC r=32 {gain(main, 'kfac-r32'):.2f}x, r=64 "
            f"{gain(main, 'kfac-r64'):.2f}x, the sketch {gain(main, 'kfac-sketch-r32'):.2f}x, damping 1e-4..1e-1 "
            f"{min(damp):.2f}-{max(damp):.2f}x, this batch's own A {gain(main, 'kfac-cur-r32'):.2f}x, dense "
            f"{gain(main, 'kfac-dense'):.2f}x; the MLP input layers w1 / w3 gain {mlp_in[0]:.2f}x / {mlp_in[1]:.2f}x "
            "(their inputs are nearly isotropic). Trained (all-reduce, NVFP4): the momentum map (damping 1e-2, "
            f"{gain(mom, 'mom-r32-d1e-2'):.2f}x in its sweep) {_share(ar['nvfp4-mom-d2'])}; two-sided whitening "
            f"from the momentum ({gain(two, 'mom2-dense-d1e-2'):.2f}x; an experiment, not a product geometry) "
            f"{_share(ar['nvfp4-two'])}. Runs summarised: {len(cv['runs'])} "
            f"(`{r['meta']['sections']['convergence']['command']}`).")
    return "\n".join(lines)


def adamw_sweep(r: dict) -> str:
    """The AdamW geometry candidates of the fidelity sweeps that carry the AdamW metrics: each
    candidate's gain over Euclidean in AdamW's update (one round trip / 2-rank reduce-scatter)
    and in plain L2, its extra bits, and the best candidate that costs no extra bits."""
    sweeps = [sw for sw in r.get("sweeps", []) if "adamw" in sw["errors"]]
    if not sweeps:
        return "* **AdamW geometry sweep**: not run (no sweep with the AdamW metrics attached)."
    lines = ["* **AdamW geometry sweep** (report 2.5; AdamW-trained reference with its saved optimizer state; gain "
             "over Euclidean = Euclidean error / candidate error in AdamW's next update after one round trip / after a "
             "2-rank reduce-scatter, and in plain L2; extra bits per element where a side channel costs them):"]
    for sw in sweeps:
        err, extra = sw["errors"], sw.get("extra_bits", {})
        for f in sw["formats"]:
            def gain(m: str, t: str) -> float:
                return err[m][f]["euclidean"] / err[m][f][t]
            cells = [f"{t} {gain('adamw', t):.2f}x/{gain('adamw-rs2', t):.2f}x (plain {gain('plain', t):.2f}x"
                     + (f", +{extra[t]:.2f} bits" if extra.get(t, 0) > 0 else "") + ")"
                     for t in sw["transforms"] if t != "euclidean"]
            free = [t for t in sw["transforms"] if t != "euclidean" and extra.get(t, 0) == 0 and t not in ORACLES]
            best = max(free, key=lambda t: gain("adamw-rs2", t)) if free else None
            lines.append(f"  `{sw['file']}` {f}: " + "; ".join(cells)
                         + (f". Best runnable candidate at no extra bits (reduce-scatter; oracles "
                            f"{', '.join(sorted(ORACLES & set(sw['transforms']))) or 'none'} left out): **{best}** "
                            f"{gain('adamw-rs2', best):.2f}x." if best else "."))
    return "\n".join(lines)


def codec(r: dict) -> str:
    """The codec bullet: per op and format, the Euclidean and GIFT low-rank bodies' generated
    bytes next to their minimum (and the run before the codec work, when attached)."""
    c = r["codec"]
    st = c["settings"]
    parts = []
    for op in st["ops"]:
        for fmt, _ in st["formats"]:
            cells = []
            for x in c["rows"]:
                if (x["op"], x["format"]) == (op, fmt) and x["kind"] in CODEC_PAIR:
                    was = (f", was {x['before_bytes_per_element']:.1f} in {x['before_kernels']}"
                           if x.get("before_bytes_per_element") is not None else "")
                    cells.append(f"{'Euclidean' if x['kind'] == IDENTITY_KIND else 'GIFT'} {x['bytes_per_element']:.1f} B "
                                 f"in {x['kernels']} kernels ({x['vs_minimum']:.2f}x its minimum "
                                 f"{x['minimum']:.1f}{was})")
            parts.append(f"{op} {fmt}: " + ", ".join(cells))
    within = sum(x["vs_minimum"] <= 1.3 for x in c["rows"])
    return (f"* **Codec cost** ({st['shape'][0]}, rank {st['rank']}, {st['world']}-rank plans; bytes per gradient "
            "element read off Inductor's generated kernels, next to the minimum the work needs, computed from "
            "shapes and formats by `bench.fidelity.codec_minimum.minimum_bytes`; report section 3b): " + "; ".join(parts)
            + f". Within 1.3x of the minimum: {within} of {len(c['rows'])} paths (all maps and formats). "
            f"Codec run: `{r['meta']['sections']['codec']['command']}`.")


def headline(r: dict) -> str:
    """The README's one results table: per study and optimizer, the map `geometry="auto"` picks,
    at NVFP4 and int2, against plain low-bit at the same bytes (from the convergence summary), and
    the bytes each format hands to the collectives."""
    cv = r["convergence"]
    lines = ["| study | optimizer | map of `geometry=\"auto\"` | format | GIFT arm | plain low-bit − fp32 | GIFT − fp32 | "
             "share of plain's gap closed | GIFT vs plain (paired) |", "|---|---|---|---|---|---|---|---|---|"]
    for study, pv in cv["paths"].items():
        for opt, o in pv["optimizers"].items():
            geometry = cv["default_geometry"][opt]
            for fmt in TARGETS:
                key = default_gap(o, fmt, geometry)
                if key is None:
                    continue
                g, d = o["gaps"][key], o["gaps"][key]["gift_minus_euclid"]
                verdict = ("**better**" if d["mean"] < 0 else "worse") if d["resolved"] else "not resolved"
                arm = "the defaults" if "dflt" in key.split("-") else "every layer"
                lines.append(f"| {study} | {opt} | `{geometry}` | {fmt} | {arm} | {paired_ci(g['euclid_minus_fp32'])} | "
                             f"{paired_ci(g['gift_minus_fp32'])} | {_share(g)} | {verdict} |")
    rows = r["wire"]["rows"]
    world, model = max(x["world"] for x in rows), r["wire"]["models"][-1]["name"]
    by = {x["format"]: x for x in rows if (x["model"], x["world"], x["op"]) == (model, world, "all_reduce")}
    small = next(m for m in r["wire"]["models"] if m["name"].startswith("small"))  # bench.lib.settings' _SMALL
    return "\n".join(lines + ["", f"Model: the bench's small Llama, {small['params'] / 1e6:.1f}M parameters "
                                   f"({small['description']}), trained on {cv['world']} CPU ranks (4 where the study "
                                   "says so): a statistics study, not a speed measurement (what GIFT costs in step "
                                   "time and memory: [benchmarks](docs/benchmarks.md)). "
                                   f"Held-out bits/byte minus fp32 communication of the same seed, mean ± 95% CI over n "
                                   f"seeds, {cv['steps']} steps; \"resolved\" = the paired 95% CI excludes 0. GIFT arm: "
                                   "\"the defaults\" = `GiftConfig(format=..., geometry=\"auto\")` with `optimizer=` as "
                                   f"a user gets it (measured selection, refreshes from step {GiftConfig.refresh_warmup}, then every "
                                   f"{GiftConfig.refresh_every} steps), where the "
                                   "study ran it; \"every layer\" = the study's arm (every layer mapped, refresh every "
                                   f"{cv['gift_config']['refresh_every']} steps). Bytes "
                                   f"handed to the collectives ({model}, {world} ranks, all-reduce, unmanaged "
                                   "parameters fp32): " + ", ".join(f"{f} {by[f]['vs_fp32']:.2f}x of fp32"
                                                                    for f in ("fp8 row", "nvfp4") if f in by) + "."])


def measured_step_row(path: Path = cluster_emulated.OUT) -> str:
    """The "what you pay" step-time row, measured: the emulated cluster's DDP run
    (`bench/results/cluster/emulated.json`), fp32 against the Euclidean int2 arm and GIFT's
    recipe at each shaped rate, slowest first, median step with its ratio to fp32's."""
    d = json.loads(path.read_text())
    rows = cluster_emulated.summarise(d["records"])
    rates = sorted({x["rate"] for x in rows if x["rate"] != "none"}, key=cluster_emulated._rate_key)
    med = {(x["arm"], x["rate"]): x["step"]["median"] for x in rows if x["path"] == "ddp"}
    layout = next(x["layout"] for x in rows if x["path"] == "ddp")

    def cell(arm: str) -> str:
        return " / ".join(f"{med[(arm, x)]:.2f} s" + ("" if arm == "fp32" else f" ({med[(arm, x)] / med[('fp32', x)]:.2f}x)")
                          for x in rates)
    nodes, g = layout.split("x")
    return (f"| measured step time (both low-bit arms: int2, leaky error feedback, block rotation) | the emulated "
            f"cluster below: DDP, {nodes} nodes x {g} ranks, {d['model']['params'] / 1e6:.2f}M-parameter Llama, at "
            f"{' / '.join(rates)} per node; median of {d['steps']} steps | {cell('fp32')} | "
            f"{cell(cluster_emulated.EUCLID)} | {cell(cluster_emulated.RECIPE)} (`{cluster_emulated.RECIPE}`) |")


def pays(r: dict) -> str:
    """The README's "what you pay and get": bytes of the whole gradient at NVFP4, the measured step
    time (the emulated cluster, `measured_step_row`), the paper's setting as the step model prices it
    (`bench.step_model.topology`), GIFT's state memory, and which optimizers the convergence study
    found GIFT helps, each from its committed results file, next to fp32 and plain low-bit at the
    same format."""
    rows = r["wire"]["rows"]
    world, model = max(x["world"] for x in rows), r["wire"]["models"][-1]["name"]
    wire = next(x for x in rows if (x["model"], x["world"], x["op"], x["format"]) == (model, world, "all_reduce", "nvfp4"))
    paper = json.loads(topology_model.OUT.read_text())["paper"]
    po = paper["overlapped"]
    pa = po["arms"]
    mem = {x["config"]: x for x in r["memory"]["rows"] if (x["model"], x["world"]) == ("Llama-600M", 8)}
    gift_mem = next(x for c, x in mem.items() if c.startswith("GIFT defaults ("))
    plain_mem = next(x for c, x in mem.items() if c.startswith("Euclidean low-bit"))
    cv = r["convergence"]
    verdicts: dict[str, list[str]] = {}
    for pv in cv["paths"].values():
        for opt, o in pv["optimizers"].items():
            for fmt in TARGETS:
                key = default_gap(o, fmt, cv["default_geometry"][opt])
                if key is not None:
                    d = o["gaps"][key]["gift_minus_euclid"]
                    verdicts.setdefault(opt, []).append("better" if d["resolved"] and d["mean"] < 0 else
                                                        "worse" if d["resolved"] else "not resolved")
    helps = "; ".join(f"{opt}: better in {v.count('better')} of {len(v)} study rows"
                      + (f", worse in {v.count('worse')}" if "worse" in v else "")
                      + (f", not resolved in {v.count('not resolved')}" if "not resolved" in v else "")
                      for opt, v in verdicts.items())

    def ms(s: float) -> str:
        return f"{s * 1e3:,.0f} ms"

    def mb(b: float) -> str:
        return f"{b / 1e6:,.0f} MB"

    scaling = sorted((x for x in r["memory"]["rows"] if x["config"] == gift_mem["config"]),
                     key=lambda x: (x["gift_total"], x["world"]))
    by_model: dict[str, list[dict]] = {}
    for x in scaling:
        by_model.setdefault(x["model"], []).append(x)
    grows = "; ".join(f"{m} {mb(xs[0]['gift_total'])} ("
                      + ", ".join(f"{x['gift_vs_fsdp']:.2f}x FSDP's at {x['world']} ranks" for x in xs) + ")"
                      for m, xs in by_model.items())
    lines = ["| each row at the format it names | setup | fp32 | plain low-bit (`geometry=\"none\"`) | GIFT (the defaults) |",
             "|---|---|---|---|---|",
             f"| bytes of the whole gradient per rank and step (NVFP4) | {model}, {world} ranks, all-reduce; bytes handed "
             f"to the collectives | 1.00x | {wire['vs_fp32']:.2f}x | {wire['vs_fp32']:.2f}x (the same codes) |",
             measured_step_row(),
             f"| the paper's setting, modelled (FP8 E5M2) | {paper['model']}, {paper['nodes']} nodes x "
             f"{paper['gpus_per_node']} GH200; all-reduce, the map on 13 fc2 layers; overlapped with the backward | "
             f"{ms(pa['fp32 all-reduce']['step'])} | {ms(pa['Euclidean FP8']['step'])} "
             f"({signed_pct(po['euclid_vs_fp32'])}; the paper: {signed_pct(paper['paper_euclid_vs_fp32'])}) | "
             f"{ms(pa['GIFT FP8 (13 fc2)']['step'])} ({signed_pct(po['gift_vs_fp32'])}; the paper: "
             f"{signed_pct(paper['paper_gift_vs_fp32'])}) |",
             f"| state memory per rank | Llama-600M, 8 ranks; FSDP's params + grads + optimizer: "
             f"{mb(gift_mem['fsdp_per_rank'])} | 0 | {mb(plain_mem['gift_total'])} | {mb(gift_mem['gift_total'])} "
             f"({gift_mem['gift_vs_fsdp']:.2f}x FSDP's) |",
             f"| loss against plain low-bit at the same bytes | the convergence study below (its own small model) | | | "
             f"{helps} |"]
    return "\n".join(lines + ["", "How GIFT's state grows (`GiftConfig()` defaults: each rank keeps every managed "
                               "layer's map and statistics, so it does not shrink with more ranks as FSDP's shards "
                               f"do; it grows far more slowly than the parameters, with width and depth): {grows}. Rows from "
                               "`bench/results/results.json` (wire, memory, convergence), the emulated cluster "
                               "(`bench/results/cluster/emulated.json`, measured step time) and the step model "
                               "(`python -m bench.step_model.topology`, the paper's setting: every input and its source in "
                               "bench/results/step_model/step_model_inputs.json, per arm and network in "
                               "[benchmarks](docs/benchmarks.md#step-time-by-topology))."])


BLOCKS: dict[str, Callable[[dict], str]] = {
    "fidelity": fidelity, "wire": wire, "step_model": step_model, "codec": codec, "memory": pages.memory,
    "second_hop": pages.second_hop, "convergence": convergence, "closing": closing, "adamw_sweep": adamw_sweep,
    "soak": pages.soak, "headline": headline, "formats": pages.formats,
    "plan_check": pages.plan_check, "demo": pages.demo, "demo_summary": pages.demo_summary, "skips": pages.skips, "tiers": pages.tiers,
    "defaults": defaults, "faults": pages.faults, "frontier": pages_frontier.frontier,
    "delayed_scale": delayed_scale.block, "map_precision": map_precision.block,
    "map_precision_arms": map_precision_arms.block,
    "kernel_traffic": kernel_traffic.block,
    "frontier_headline": pages_frontier.frontier_headline, "selection_churn": pages_selection.selection_churn,
    "layouts": pages_layouts.layouts, "pays": pays, "exit": exit_stress.block,
    "topology_model": topology_model.block, "when_it_pays": topology_model.when_it_pays,
    "cluster": cluster_emulated.block,
    **{name: pages.torchtitan_run(name) for name in pages.torchtitan_runs()},
}
# Which page holds each block (relative to the repository root); every block is on exactly one
# page, and a page that lacks one of its blocks' markers, or carries a marker of another's, fails.
PAGES: dict[str, tuple[str, ...]] = {
    "README.md": ("pays", "cluster", "headline", "frontier_headline", "when_it_pays", "demo_summary"),
    "docs/benchmarks.md": ("fidelity", "wire", "codec", "step_model", "map_precision",
                           "map_precision_arms", "kernel_traffic",
                           "topology_model",
                           "memory", "second_hop",
                           "convergence", "defaults", "adamw_sweep", "closing", "frontier", "selection_churn", "layouts"),
    "docs/reliability.md": ("faults", "exit", "plan_check", "soak", "tiers", "skips"),
    "docs/design.md": ("formats", "delayed_scale"),
    "docs/torchtitan/start.md": ("demo",),
    "docs/torchtitan/layouts.md": ("tt_graph_hsdp", "tt_fsdp2_hsdp", "tt_pp", "tt_tp"),
    "docs/torchtitan/telemetry.md": ("tt_early_demo",),
}
_MARKER = re.compile(r"<!-- bench:([\w:]+) -->")


def render(page: str, results: dict, blocks: tuple[str, ...] = tuple(BLOCKS)) -> str:
    """`page` with each of `blocks` replaced by what `results` gives; raises when a block's
    markers are missing (a block is never silently skipped) or the page carries a block that is
    not its own (it would never be rewritten)."""
    stray = set(_MARKER.findall(page)) - set(blocks)
    if stray:
        raise ValueError(f"page has blocks that belong elsewhere or to no generator: {sorted(stray)}")
    for name in blocks:
        pattern = re.compile(rf"(<!-- bench:{name} -->\n)(?:.*?\n)?(<!-- /bench:{name} -->)", re.S)
        if not pattern.search(page):
            raise ValueError(f"page has no block <!-- bench:{name} --> ... <!-- /bench:{name} -->")
        text = BLOCKS[name](results)
        page = pattern.sub(lambda m: m.group(1) + text + "\n" + m.group(2), page)
    return page


def generated_files(root: Path, results: dict) -> dict[Path, tuple[str, str]]:
    """Every generated file under `root` as `path -> (committed text, generated text)`: the
    pages, and REPORT.md as `bench.pages.report.render` writes it from the same results."""
    out = {}
    for rel, blocks in PAGES.items():
        text = (root / rel).read_text()
        out[root / rel] = (text, render(text, results, blocks))
    report_path = root / REPORT.relative_to(ROOT)
    out[report_path] = (report_path.read_text(), report.render(results))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pages.readme", description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--root", type=Path, default=ROOT, help="tree holding the pages (default: this repository)")
    p.add_argument("--check", action="store_true", help="exit 1 if a page or REPORT.md differs from its generator")
    a = p.parse_args(argv)
    stale = []
    for path, (text, new) in generated_files(a.root, json.loads(a.results.read_text())).items():
        if new == text:
            continue
        stale.append(path)
        if not a.check:
            path.write_text(new)
    if a.check and stale:
        print(f"generated text differs from {a.results} in: {', '.join(map(str, stale))}; run python -m bench.pages.readme",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
