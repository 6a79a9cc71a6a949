"""REPORT.md from the results dict of `bench.run` (every number in it comes from that dict).

Sections that were not run (`--only`) are left out; every table states its units, and the
caveats that decide how far a number can be trusted (CPU timings, model size, seeds) sit
next to the number rather than at the end.

This module puts the report together and renders the headline, reference, fidelity and wire
sections; the cost sections are `bench.pages.report_cost`, the convergence ones
`bench.pages.report_convergence`, and every page formats numbers through `bench.lib.formatting`.
"""

from __future__ import annotations

import math
import statistics

from bench.pages import report_convergence, report_cost
from bench.lib.formatting import table
from bench.pages.plots import FOCUS_FORMATS


def _header(meta: dict) -> list[str]:
    return [
        "# GIFT benchmark report",
        "",
        f"Produced by `{meta['command'].strip()}` (profile `{meta['profile']}`) on {meta['started']}, "
        f"{meta['duration_s'] / 60:.1f} min. torch {meta['torch']}, {meta['cpu_count']} CPU cores, "
        f"{meta['threads']} torch threads, load average at start {meta['loadavg_start']:.1f} "
        f"(the machine is shared), gloo for multi-rank runs.",
        "",
        *(["Sections come from several runs (`--merge`); each section's command:", "",
           table(["section", "command", "profile", "started"],
                 [[k, f"`{v['command'].strip()}`", v["profile"], v["started"]] for k, v in meta["sections"].items()]),
           ""] if meta.get("merged_into") and meta.get("sections") else []),
        "**No GPU ran these benchmarks: every time in this report is a CPU time.** "
        "Kernel-time ratios on CPU are not GPU ratios (a CPU is compute-bound where a GPU codec "
        "kernel is memory-bound); the GPU-scale claims are the projections of section 6, built "
        "from the bytes the generated kernels move, the code's FLOP counts and documented hardware assumptions.",
        "",
        "Results JSON: `results.json` (same directory). Re-run: `python -m bench.run --quick` "
        "(minutes once the reference model is cached) or `python -m bench.run` (full profile; the convergence "
        "study alone takes ~1.7 h on 2 free cores). `--from-json results.json` re-renders this report and the figures.",
        "",
    ]


def _headlines(r: dict) -> list[str]:
    out = ["## Headline numbers", ""]
    fid = r.get("fidelity")
    if fid:
        rows = []
        for f in fid["formats"]:
            e, w = fid["energy_weighted"][f], fid["whitened"][f]
            mu = fid.get("muon", {}).get(f)
            rows.append([f, e["euclidean"], e["kfac-r32"], e["euclidean"] / e["kfac-r32"],
                         w["euclidean"], w["kfac-r32"], w["euclidean"] / w["kfac-r32"],
                         w["euclidean"] / w["kfac-dense"]]
                        + ([mu["euclidean"], mu["kfac-r32"], mu["euclidean"] / mu["kfac-r32"]] if mu else [])
                        + [fid["rd_bound"][f]])
        muon_cols = ["Muon Eucl.", "Muon GIFT r32", "ratio"] if "muon" in fid else []
        out += ["Single round trip over all managed layers of the reference model (transforms from the previous "
                "batch's K-FAC factor), one gradient per layer and held-out batch, no error bars (a "
                "deterministic measurement; section 2 has the per-layer spread). Plain = relative L2 error in "
                "original coordinates, energy-weighted; whitened = the same error measured in the geometry of this "
                "batch's A (||E T^T|| / ||G T^T||, what a K-FAC-style preconditioner sees; GIFT's design target); "
                "Muon = relative error of Muon's orthogonalized update of the gradient (section 2.3). "
                "Ratio = Euclidean / GIFT (> 1: GIFT better). GIFT r32 is better in "
                + ", ".join(f"{sum(ratio > 1 for ratio in col)}/{len(col)} formats in the {name} metric"
                            for name, col in (("plain", [x[3] for x in rows]), ("whitened", [x[6] for x in rows]),
                                              *((("Muon", [x[10] for x in rows]),) if mu else ())))
                + "; which metric a training run feels depends on the optimizer (section 5).",
                "", table(["format", "plain Eucl.", "plain GIFT r32", "ratio", "whitened Eucl.", "whitened GIFT r32",
                           "ratio", "ratio dense", *muon_cols, "Gaussian RD"], rows), ""]
    ov = r.get("overhead")
    if ov:
        out += report_cost.overhead_headline(ov)
    wr = r.get("wire")
    if wr:
        rows = [[x["format"], x["vs_fp32"], x["sent_vs_fp32"], x["vs_bf16"], x["managed_bits_per_element"]]
                for x in wr["rows"] if x["world"] == 64 and x["op"] == "all_reduce" and x["model"] == "Llama-600M"
                and x["format"] != "fp32"]
        out += ["Wire bytes per step, Llama-600M, 64 ranks, all-reduce (unmanaged params at fp32); handed to "
                "collectives (library convention) and actually sent:", "",
                table(["format", "handed vs fp32", "sent vs fp32", "handed vs bf16", "managed bits/element"], rows, 3),
                ""]
    cv = r.get("convergence")
    if cv:
        out += [f"Convergence ({cv['world']} gloo ranks, {cv['steps']} steps, seeds {cv['seeds']}, {cv['mode']}; "
                "held-out bits/byte minus fp32 communication, paired by seed, mean ± 95% CI (t, n seeds)):", ""]
        out += report_convergence.verdict_lines(cv)
    sm = r.get("step_model")
    if sm:    sm = r.get("step_model")
    if sm:
        names = list(sm["scenarios"])
        arms = list(sm["scenarios"][names[0]]["arms"])
        rows = [[a] + [f"{100 * sm['scenarios'][n]['arms'][a]['vs_fp32']:+.1f}%" for n in names]
                + [f"{100 * sm['paper'][a]:+.1f}%" if a in sm["paper"] else ""] for a in arms]
        first = sm["scenarios"][names[0]]
        out += [f"Projected {first['model']} step time on {first['inputs']['gpus']} GPUs vs fp32 communication "
                "(section 6; a projection from codec bytes counted in the CPU kernels, priced at copy bandwidth; hardware "
                "assumed):", "",
                table(["arm", *names, "paper"], rows), ""]
    mem = r.get("memory")
    if mem:
        out += report_cost.memory_headline(mem)
    return out


def _reference(ref: dict) -> list[str]:
    s = ref["settings"]
    m = s["model"]
    return [
        "## 1. Reference model", "",
        f"`TinyLlama` dim {m['dim']}, {m['n_layers']} layers, {m['n_heads']} heads, vocab {m['vocab_size']} "
        f"({ref['params']:,} parameters), trained by the bench on the Shakespeare corpus (train split) for "
        f"{s['steps']} {'Muon' if s.get('optimizer') == 'muon' else 'AdamW'} steps of {s['batch_size']}x{s['seq_len']} "
        f"tokens ({ref['tokens']:,} tokens, "
        f"peak lr {s['lr']}, warmup {s['warmup']}, cosine), {ref['seconds']:.0f} s when trained; cached at "
        f"`{ref['cache']}`. Final training loss {ref['final_loss']:.3f} nats, held-out bits/byte "
        f"{ref['val_bpb']:.4f}.", "",
        f"Fidelity inputs: {ref['heldout_batches']} held-out (validation-split) batches of "
        f"{ref['micro_batches']} sequences x {ref['seq_len']} tokens, each sequence back-propagated alone "
        f"(the per-micro-batch gradients are the simulated ranks); for each of the {ref['layers']} managed "
        "linear weights (GiftConfig defaults: embeddings and head excluded) the batch gradient, the K-FAC "
        "input factor A = E[xx^T] of the same batch (the metric) and of the previous batch (what the "
        "transforms are built from, as a refreshed GIFT would), and the gradient-side factor G^T G/out of "
        "the previous batch's gradient.", "",
    ]


def _fidelity(fid: dict, plots: dict) -> list[str]:
    formats, transforms = fid["formats"], fid["transforms"]
    out = ["## 2. Fidelity", "",
           "Round trip = `gift_compile.exchange.collectives.all_reduce(g, None, GiftConfig(format, scaling), transform)`: "
           "transform, agree scales, encode, decode, inverse; error in original coordinates. Transforms are "
           "`gift_compile.geometry.Transform(kind, d_in, rank).refresh_from(factor, 1e-3)`. RD = Gaussian "
           "rate-distortion 2^-R at the format's exact wire bits R per element (payload + scales): what an "
           "ideal R-bit code achieves at worst (the Gaussian is the hardest source at a given variance).", "",
           "### 2.1 Energy-weighted relative L2 error of one round trip", ""]
    rows = [[f, fid["bits_per_element"][f], fid["rd_bound"][f]] + [fid["energy_weighted"][f][t] for t in transforms]
            for f in formats]
    out += [table(["format", "bits/el", "RD bound", *transforms], rows), ""]
    same = [f"{a} = {b}" for a, b in (("e4m3/tensor", "e4m3/row"), ("e4m3/row", "e4m3/block32"),
                                      ("e5m2/tensor", "e5m2/row"), ("e5m2/row", "e5m2/block32"))
            if a in formats and b in formats and fid["energy_weighted"][a] == fid["energy_weighted"][b]]
    if same:
        out += [f"Identical rows ({', '.join(same)}): the fp8 scales are powers of two, so the rounding grid "
                "relative to each value does not depend on the scale; a finer scale granularity changes the "
                "error only where values leave the format's normal range, which none of these gradients do.", ""]
    rows = [[f] + [fid["energy_weighted"][f]["euclidean"] / fid["energy_weighted"][f][t] for t in transforms[1:]]
            for f in formats]
    out += ["Gain (Euclidean error / error; > 1 is better than Euclidean):", "",
            table(["format", *transforms[1:]], rows, 3), ""]
    out += [f"![heatmap]({plots['fidelity_heatmap']})", ""]
    out += ["### 2.2 Per-layer spread", "",
            "Gain (Euclidean error / GIFT error) per layer, min / median / max over layers and the number of "
            "layers where GIFT is worse, in both metrics:", ""]
    rows = []
    for f in FOCUS_FORMATS:
        for t in ("kfac-r32", "kfac-dense"):
            for metric, key in (("plain", "per_layer"), ("whitened", "per_layer_whitened")):
                pl = fid[key][f]
                gains = sorted(pl["euclidean"][n] / pl[t][n] for n in fid["layers"])
                rows.append([f, t, metric, gains[0], gains[len(gains) // 2], gains[-1],
                             f"{sum(g < 1 for g in gains)}/{len(gains)}"])
    out += [table(["format", "transform", "metric", "min gain", "median", "max", "layers worse"], rows, 3), ""]
    kinds = list(dict.fromkeys(n.split(".")[-2] for n in fid["layers"]))
    rows = []
    for f in FOCUS_FORMATS:
        for t in ("kfac-r32", "kfac-dense"):
            row: list[object] = [f, t]
            for kind in kinds:
                names = [n for n in fid["layers"] if n.split(".")[-2] == kind]
                for key in ("per_layer", "per_layer_whitened"):
                    pl = fid[key][f]
                    row.append(math.exp(sum(math.log(pl["euclidean"][n] / pl[t][n]) for n in names) / len(names)))
            rows.append(row)
    out += ["Gain per layer kind (geometric mean over blocks; plain / whitened). The paper whitened only "
            "`fc2` = `w2`, the down projection:", "",
            table(["format", "transform", *[f"{k} {m}" for k in kinds for m in ("plain", "wh.")]], rows, 2), "",
            f"![per-layer]({plots['fidelity_layers']})", ""]
    out += ["### 2.3 Error per eigendirection of A and in the whitened metric", "",
            f"Directions of this batch's A sorted by eigenvalue into {len(next(iter(fid['eigen_buckets'][formats[0]].values())))} "
            "equal-size buckets (1 = strongest); cell = relative error of the gradient's component in "
            "that bucket, ||E U_b|| / ||G U_b||. Euclidean noise is white, so it swamps the weak directions; "
            "GIFT should be flat.", ""]
    for f in FOCUS_FORMATS:
        if f not in fid["eigen_buckets"]:
            continue
        eb = fid["eigen_buckets"][f]
        nb = len(eb["euclidean"])
        rows = [[t] + eb[t] + [eb[t][-1] / eb[t][0]] for t in transforms]
        out += [f"**{f}**", "", table(["transform", *[f"b{i + 1}" for i in range(nb)], "weak/strong"], rows, 4), ""]
    rows = [[f] + [fid["whitened"][f][t] for t in transforms] for f in formats]
    out += ["Whitened-metric relative error ||E T^T|| / ||G T^T|| with T A T^T = I (A of this batch, "
            "damped 1e-3): the error as a natural-gradient / K-FAC-preconditioned optimizer sees it.", "",
            table(["format", *transforms], rows), "", f"![eigen]({plots['fidelity_eigen']})", ""]
    if "muon" in fid:
        rows = [[f] + [fid["muon"][f][t] for t in transforms] for f in formats]
        out += ["Muon metric: ||NS(G + E) - NS(G)|| / ||NS(G)||, NS = torch.optim.Muon's Newton-Schulz "
                "orthogonalization (its coefficients and 5 steps, in fp32), i.e. how far the communication error "
                "moves the update Muon would take from this gradient alone. Orthogonalization lifts the "
                "gradient's weak singular directions to unit size, so errors there are amplified; a single "
                "gradient overstates the effect (Muon orthogonalizes its momentum, where one step's error enters "
                "with weight 1 - 0.95^2; `bench.fidelity.sweep` measures that too, section 2.5).", "",
                table(["format", *transforms], rows), ""]
        kinds = list(dict.fromkeys(n.split(".")[-2] for n in fid["layers"]))
        rows = []
        for f in FOCUS_FORMATS:
            if f not in fid["muon"]:
                continue
            pl = fid["per_layer_muon"][f]
            for t in ("kfac-r32", "kfac-dense"):
                rows.append([f, t] + [math.exp(statistics.fmean(math.log(pl["euclidean"][n] / pl[t][n])
                                                                for n in fid["layers"] if n.split(".")[-2] == k))
                                      for k in kinds])
        out += ["Muon-metric gain (Euclidean / GIFT) per layer kind, geometric mean over blocks:", "",
                table(["format", "transform", *kinds], rows, 2), ""]
    out += _multirank(fid, plots)
    return out


def _multirank(fid: dict, plots: dict) -> list[str]:
    mr = fid["multirank"]
    out = ["### 2.4 Summing over P ranks: our collective vs in-network FP8 sums", "",
           "Each simulated rank holds the gradient of its own micro-batches; target = their mean (fp32). "
           "`ours RS`: our collective as `gift_compile.exchange.collectives` runs it: each rank encodes with its own "
           "local scales, every sender's codes are decoded with that sender's scales and summed in fp32 (the "
           "reduce-scatter, FSDP). `ours AR`: plus the all-reduce's second stage (each rank's summed shard "
           "re-quantized with its own scales, all-gathered, decoded identically everywhere). The other columns "
           "add the FP8 codes themselves inside the collective, in ring order, each partial sum rounded to FP8 "
           "and saturating at the format maximum (the kindest overflow a reduction can have): `agreed` with ONE "
           "set of scales agreed by every rank before encoding (an all-reduce MAX of the scale statistics: the "
           "fair form of that design, whose replicas agree), `agreed+headroom` the same with the scales "
           "multiplied by P so that no partial sum can saturate, and `original` with each rank's local scale "
           "(replica 0 decodes with its own scale). `replica spread`: largest distance between two replicas' "
           "results under `original`, relative to the target (ours and `agreed` are bit-identical across "
           "replicas by construction). In-network sums exist for the fp8 formats only (n/a elsewhere). "
           "Energy-weighted relative L2 over layers; one deterministic measurement (no error bars).", ""]
    rows = []
    for p in sorted(mr, key=int):
        for f, by_t in mr[p].items():
            for t, v in by_t.items():
                rows.append([p, f, t, v.get("ours_reduce_scatter"), v.get("ours_all_reduce"),
                             v.get("agreed_in_network", math.nan), v.get("agreed_in_network_headroom", math.nan),
                             v.get("original", math.nan), v.get("replica_spread", math.nan)])
    out += [table(["P", "format", "transform", "ours RS", "ours AR", "agreed", "agreed+headroom", "original",
                   "replica spread"], rows), "",
            f"![multirank]({plots['multirank']})", ""]
    return out


def _wire(wr: dict, plots: dict) -> list[str]:
    out = ["## 4. Wire bytes per step", "",
           "`gift_compile.exchange.collectives.wire_bytes_per_rank` for the managed weights (codes + every scale; "
           "for an all-reduce, the all-to-all of codes plus the all-gather of this rank's re-quantized "
           "shard), unmanaged parameters at fp32; baselines `numel x 4` / `numel x 2`. Shapes assumed:", ""]
    rows = [[m["name"], m["description"], m["params"], m["managed_params"],
             "; ".join(f"{n} [{r},{c}] x{k}" for n, r, c, k in m["managed"])] for m in wr["models"]]
    out += [table(["model", "architecture", "params", "managed", "managed shapes"], rows), ""]
    formats = list(dict.fromkeys(x["format"] for x in wr["rows"]))
    groups = list(dict.fromkeys((x["model"], x["world"], x["op"]) for x in wr["rows"]))
    rows = []
    for model, world, op in groups:
        by = {x["format"]: x for x in wr["rows"] if (x["model"], x["world"], x["op"]) == (model, world, op)}
        rows.append([model, world, op, by["fp32"]["bytes"] / 1e6]
                    + [f"{by[f]['vs_fp32']:.3f} / {by[f]['sent_vs_fp32']:.3f}" for f in formats[1:]])
    out += ["Cells: bytes handed to collectives / bytes sent, both relative to fp32 (sent = ring / pairwise "
            "algorithms, `bench.lib.wire.sent_bytes`).", "",
            table(["model", "ranks", "collective", "fp32 MB/step/rank", *formats[1:]], rows, 1), ""]
    rows = [[m["name"]] + [next(x["managed_bits_per_element"] for x in wr["rows"] if x["model"] == m["name"]
                                and x["world"] == 64 and x["op"] == "reduce_scatter" and x["format"] == f)
                           for f in formats] for m in wr["models"]]
    out += ["Exact wire bits per managed element (payload + scales, reduce-scatter):", "",
            table(["model", *formats], rows, 3), "", f"![wire]({plots['wire']})", ""]
    return out


def _sweeps(sweeps: list[dict]) -> list[str]:
    """Section 2.5: `bench.fidelity.sweep` results (each attached JSON file)."""
    out = ["### 2.5 Whitening sweep: what limits GIFT, per metric", "",
           "`python -m bench.fidelity.sweep`: one round trip per candidate geometry and format on the reference "
           "model's held-out gradients, in five metrics: plain L2; whitened (this batch's A); `muon` (Muon's "
           "orthogonalized update of the gradient alone); `muon-mom` (Muon's update from its Nesterov momentum, "
           "U = w G + (1 - w) M with M the mean gradient of the other held-out batches and w = 1 - 0.95^2, so the "
           "error enters as w E: the closest proxy of what a Muon run feels); `adam` (the error divided by the "
           "root mean square gradient, AdamW's elementwise preconditioning). Cells: relative error (gain over "
           "Euclidean). Candidates: `kfac-*` whiten the previous batch's K-FAC input factor A (`-sketch` through "
           "GIFT's sketch, `-cur` this batch's A: an oracle without staleness), `grad-*` the gradient-side factor "
           "G^T G of the previous batch's gradient (`-cur`: this batch's, an oracle), `mom-*` the momentum "
           "proxy's M^T M (`geometry=\"momentum\"`), `mom2-*` two-sided: the rows also whitened by M M^T "
           "(`-cur`: the proxy updated with this gradient, an oracle; not a product geometry); `-dN` overrides the damping (default 1e-3). Deterministic measurements over "
           "layers x batches (no error bars).", ""]
    for sw in sweeps:
        metrics = list(sw["errors"])
        out += [f"`{sw['command'].strip()}` ({sw['file']}): reference trained with {sw['reference']['optimizer']} "
                f"(held-out bits/byte {sw['reference']['val_bpb']:.4f}), {sw['layers']} layers x {sw['batches']} "
                "batches.", ""]
        if "adamw" in metrics:
            out += ["AdamW metrics (this file): `adamw` = relative error of AdamW's next update m_hat / (sqrt(v_hat) + "
                    "eps) after one round trip, from the reference's saved optimizer state (betas 0.9/0.95, the "
                    "gradient clipped as training would); `adamw-rs2` the same after a 2-rank reduce-scatter (each "
                    "half of the batch quantized by its own rank, summed in fp32: FSDP2's form), `plain-rs2` its plain "
                    "L2 error. AdamW candidates (`bench.fidelity.sweep.ADAM_CANDIDATES`, prototypes): "
                    + "; ".join(f"`{t}` {sw['transforms'][t]}" for t in sw["transforms"] if isinstance(sw["transforms"][t], str))
                    + ". `extra bits` = side-channel bits per gradient element on top of the format's; `2^extra` = the "
                    "gain the same bits would buy spent on the format's precision instead (rate-distortion scaling "
                    "2^-R of the error): a side channel wins per bit only where its gain exceeds that.", ""]
        extra = sw.get("extra_bits", {})
        show_extra = any(v > 0 for v in extra.values())
        for f in sw["formats"]:
            rows = [[t] + ([f"{extra.get(t, 0.0):.3f}", f"{2 ** extra.get(t, 0.0):.2f}x"] if show_extra else [])
                    + [f"{sw['errors'][m][f][t]:.4f} ({sw['errors'][m][f]['euclidean'] / sw['errors'][m][f][t]:.2f}x)"
                       for m in metrics] for t in sw["transforms"]]
            out += [f"**{f}**", "", table(["candidate", *(["extra bits", "2^extra"] if show_extra else []), *metrics],
                                          rows), ""]
        f = "nvfp4" if "nvfp4" in sw["formats"] else sw["formats"][0]
        kinds = list(next(iter(sw["by_kind"]["muon-mom"][f].values())))
        rows = [[t] + [sw["by_kind"]["muon-mom"][f][t][k] for k in kinds] for t in sw["transforms"]]
        out += [f"`muon-mom` gain over Euclidean per layer kind ({f}, geometric mean over blocks and batches):", "",
                table(["candidate", *kinds], rows, 2), ""]
    return out


def render(r: dict) -> str:
    """The whole report as markdown."""
    plots = r.get("plots", {})
    lines = _header(r["meta"]) + _headlines(r)
    if "reference" in r:
        lines += _reference(r["reference"])
    if "fidelity" in r:
        lines += _fidelity(r["fidelity"], plots)
    if r.get("sweeps"):
        lines += _sweeps(r["sweeps"])
    if "overhead" in r:
        lines += report_cost.overhead(r["overhead"], plots)
    if "codec" in r:
        lines += report_cost.codec(r["codec"])
    if "wire" in r:
        lines += _wire(r["wire"], plots)
    if "convergence" in r:
        lines += report_convergence.convergence(r["convergence"], plots)
    if r.get("tuning"):
        lines += report_convergence.tuning(r["tuning"])
    if "step_model" in r:
        lines += report_cost.step_model(r["step_model"], plots)
    if "memory" in r:
        lines += report_cost.memory(r["memory"])
    lines += ["## 8. Hardware", "",
              "No GPU ran these benchmarks. Overhead times are CPU times (section 3); GPU-scale step times are "
              "projections (section 6). The codec ran once on one H200 (`bench/results/gpu/gpu_h200/`, the codec only); "
              "`python -m bench.step_model.topology` prices the step with the codec at those times (docs/benchmarks.md). `make gpu-check` (`bench/gpu/check.py`) is the prepared single-GPU check "
              "(Triton compile of the codecs, kernel times and achieved bandwidth, a 1-rank torchtitan step); it "
              "writes `GPU.md` into `bench/results`.", ""]
    return "\n".join(lines) + "\n"
