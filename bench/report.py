"""REPORT.md from the results dict of `bench.run` (every number in it comes from that dict).

Sections that were not run (`--only`) are left out; every table states its units, and the
caveats that decide how far a number can be trusted (CPU timings, model size, seeds) sit
next to the number rather than at the end.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

from bench.codec_minimum import UNFUSED, realisation_limits, unfused
from bench.plots import FOCUS_FORMATS
from gift_compile.geometry.table import IDENTITY_KIND, LowRank
from gift_compile.codec.spec import FormatSpec

# The codec rows set side by side: the Euclidean body and GIFT's low-rank one.
CODEC_PAIR = (IDENTITY_KIND, LowRank.kind)


def _fmt(v: Any, digits: int = 4) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.{digits - 1}e}"
        return f"{v:.{digits}f}"
    return str(v)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 4) -> str:
    """A GitHub-flavoured markdown table; floats with `digits` decimals."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(v, digits) for v in row) + " |")
    return "\n".join(lines)


def _pm(s: dict[str, float], digits: int = 4, scale: float = 1.0) -> str:
    if s["n"] > 1:
        return f"{s['mean'] * scale:.{digits}f} ± {s['std'] * scale:.{digits}f}"
    return f"{s['mean'] * scale:.{digits}f}"


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
        "**No GPU was lent to this task: every time in this report is a CPU time.** "
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
        out += _overhead_headline(ov)
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
        out += _verdict_lines(cv)
    sm = r.get("step_model")
    if sm:    sm = r.get("step_model")
    if sm:
        names = list(sm["scenarios"])
        arms = list(sm["scenarios"][names[0]]["arms"])
        rows = [[a] + [f"{100 * sm['scenarios'][n]['arms'][a]['vs_fp32']:+.1f}%" for n in names]
                + [f"{100 * sm['paper'][a]:+.1f}%" if a in sm["paper"] else ""] for a in arms]
        first = sm["scenarios"][names[0]]
        out += [f"Projected {first['model']} step time on {first['inputs']['gpus']} GPUs vs fp32 communication "
                "(section 6; codec bytes measured from the generated kernels, hardware assumed):", "",
                table(["arm", *names, "paper"], rows), ""]
    mem = r.get("memory")
    if mem:
        out += _memory_headline(mem)
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
                "with weight 1 - 0.95^2; `bench.fidelity_sweep` measures that too, section 2.5).", "",
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


def _ratio_to(rows: list[dict], path: str, base: str, key: str) -> float:
    a = next((x[key] for x in rows if x["path"] == path), math.nan)
    b = next((x[key] for x in rows if x["path"] == base), math.nan)
    return a / b


def _overhead_headline(ov: dict) -> list[str]:
    tr = ov["traffic"]["rows"]
    rows = []
    for shape in dict.fromkeys(x["shape"] for x in ov["rows"]):
        timed = {x["path"]: x for x in ov["rows"] if x["shape"] == shape}
        if "gift-fp8" not in timed:
            continue
        t = timed["gift-fp8"]
        one = [x for x in tr if x["shape"] == shape and x["world"] == 1]
        scaled = [[x for x in tr if x["shape"] == shape and x["op"] == op and x["world"] > 1]
                  for op in ("all_reduce", "reduce_scatter")]
        rows.append([shape, _ratio_to(one, "gift-fp8", "euclid-fp8", "bytes_per_element"), _pm_ratio(t)]
                    + [_ratio_to(rs, "gift-fp8", "euclid-fp8", "bytes_per_element") for rs in scaled if rs])
    world = next((x["world"] for x in tr if x["world"] > 1), None)
    at_scale = [f"bytes, {world} ranks all-reduce", f"bytes, {world} ranks reduce-scatter"] if world else []
    return [f"GIFT fp8 codec (low-rank r{ov['rank']}) over the Euclidean fp8 codec: bytes per gradient element "
            f"moved by the compiled kernels (measured from the generated code), and CPU time ({ov['mode']}; paired "
            f"ratio, median ± half-IQR over {ov['repeats']} rounds):", "",
            table(["gradient", "bytes, 1 rank", "CPU time, 1 rank", *at_scale], [r[:3 + len(at_scale)] for r in rows],
                  2), ""]


def _pm_ratio(x: dict) -> str:
    if math.isnan(x["vs_baseline"]):
        return "-"
    return f"{x['vs_baseline']:.2f} ± {x['vs_baseline_iqr'] / 2:.2f}"


def _overhead(ov: dict, plots: dict) -> list[str]:
    tr = ov["traffic"]
    out = ["## 3. Overhead", "",
           "The body of the collective (`gift_compile.exchange.bucket.bucket_core`: transform, local scales, encode, "
           "decode every sender + fp32 sum, re-encode and gather for an all-reduce, inverse) compiled with "
           "`torch.compile(fullgraph=True, dynamic=False)`. `bf16` = cast to bf16 and back; `gift-*` = low-rank "
           f"rank-{ov['rank']} whitening; `*-fp8` = E4M3 per-row.", "",
           "### 3.1 Bytes moved, measured from the generated kernels", "",
           "`bench.overhead.generated_traffic`: for every kernel Inductor generated (fused C++ kernels and extern "
           "calls such as the projection matmul) the bytes it reads and writes, by Inductor's own per-kernel count "
           "(each buffer a kernel touches counted once at the size it touches: the traffic of an ideal schedule of "
           "*these* kernels; a kernel that re-reads a buffer in a second loop is counted once). Collective kernels "
           "are excluded (their traffic is the network's). `N ranks`: the same plan compiled for N ranks on torch's "
           "fake process group (the collectives are no-ops, the kernels are those of an N-rank job). Per gradient "
           "element:", ""]
    rows = []
    for x in tr["rows"]:
        base = BASE_PATH.get(x["path"])
        same = [y for y in tr["rows"] if (y["shape"], y["world"], y["op"]) == (x["shape"], x["world"], x["op"])]
        ratio = f"{_ratio_to(same, x['path'], base, 'bytes_per_element'):.2f}" if base else "-"
        rows.append([x["shape"], x["path"], x["world"], x["op"], x["bytes_per_element"], x["reads_per_element"],
                     x["writes_per_element"], x["kernels"], ratio])
    out += [table(["gradient", "path", "ranks", "plan", "bytes/el", "read", "written", "kernels", "vs Euclidean"],
                  rows, 2), ""]
    detail = tr["kernels"]
    if "gift-fp8" in detail and "euclid-fp8" in detail:
        rows = []
        for path in ("euclid-fp8", "gift-fp8"):
            for k in detail[path]:
                if k["bytes_per_element"] >= 0.05:
                    rows.append([path, k["name"], k["reads"] / 1e6, k["writes"] / 1e6, k["bytes_per_element"]])
        out += [f"Kernels of the one-rank all-reduce at {tr['detail_shape']} (those moving >= 0.05 B/element; "
                "`fused[...]` lists telling aten ops of a fused kernel, `+n` the others):", "",
                table(["path", "kernel", "MB read", "MB written", "bytes/el"], rows, 2), ""]
    out += ["### 3.2 CPU time", "",
            f"{ov['mode']}, CPU, {ov['threads']} threads, load average {ov['loadavg']:.1f} when it started (other jobs "
            "share the 2 cores: absolute times are noisy). Paths timed round-robin in one process, "
            f"{ov['repeats']} rounds (each sample loops enough calls to last ~20 ms); `vs Euclidean` = median over "
            "rounds of the paired ratio to the same-format Euclidean path in the same round (± half the IQR). "
            "Transform FLOPs (forward + inverse) from `gift_compile.runtime.selection.transform_flops`. A CPU runs these "
            "kernels compute-bound (the fp8 conversions and the rank-r multiply-adds), a GPU memory-bound: the "
            "bytes above are what transfers (section 6).", ""]
    rows = [[x["shape"], x["path"], x["median_ms"], x["min_ms"], x["iqr_ms"], _pm_ratio(x), x["vs_bf16"],
             x["transform_gflop"], x["bytes_per_element"]] for x in ov["rows"]]
    out += [table(["gradient", "path", "median ms", "min ms", "IQR ms", "vs Euclidean", "vs bf16", "GFLOP",
                   "bytes/el"], rows, 3), ""]
    if ov["refresh"]:
        rows = [[x["d_in"], x["lowrank_s"], x["dense_s"], x["lowrank_gflops"]] for x in ov["refresh"]]
        out += ["Geometry refresh per layer as implemented (eager, fp64, on the layer's owner rank, every "
                "`refresh_every` steps): low-rank = top-r eigenpairs by subspace iteration + thin SVD; dense = "
                "Cholesky + triangular inverse.", "",
                table(["d_in", "low-rank s", "dense s", "low-rank GFLOP/s"], rows, 3), ""]
    out += [f"![overhead]({plots['overhead']})", ""]
    return out


def _codec(c: dict) -> list[str]:
    """Section 3b: every codec path's generated bytes next to the minimum it needs, before and
    after the codec work, and the kernels that stay apart with the reason."""
    st = c["settings"]
    label, rows, cols = st["shape"]
    out = ["## 3b. The codec at the memory-traffic limit", "",
           f"`bench.codec_minimum` at {label}, rank {st['rank']}, a {st['world']}-rank plan (fake process group). "
           "`minimum` = bytes per gradient element the body needs (`bench.codec_minimum.minimum_bytes`, computed from "
           "shapes and formats: each input read and output written once per sweep the math needs, codes and scales "
           "at their wire size, the projection's extra gradient read and the inverse's materialised fp32 input); "
           "`generated` = what Inductor's kernels move (section 3.1's count); `CPU vs Eucl.` = median over rounds "
           f"of the paired time ratio to the Euclidean body of the same op and format ({st['repeats']} rounds, "
           f"load average {c['loadavg']:.1f})."]
    if "before" in c:
        out[-1] += (f" `before` columns: `{c['before']['file']}` (`{c['before']['command']}` on the code before the "
                    f"codec work, load average {c['before']['loadavg']:.1f}).")
    out.append("")
    has_before = "before" in c
    body = []
    for x in c["rows"]:
        row = [x["op"], x["format"], x["kind"], x["minimum"]]
        if has_before:
            row += [x["before_bytes_per_element"], x["before_vs_minimum"]]
        row += [x["bytes_per_element"], x["vs_minimum"]]
        row += [x["before_kernels"], x["kernels"]] if has_before else [x["kernels"]]
        if has_before:
            row.append(x["before_vs_euclid_time"])
        row.append(x["vs_euclid_time"])
        body.append(row)
    heads = ["op", "format", "map", "minimum B/el"] + (["before B/el", "before / min"] if has_before else []) + [
        "generated B/el", "generated / min"] + (["kernels before", "kernels"] if has_before else ["kernels"]) + (
        ["CPU vs Eucl. before"] if has_before else []) + ["CPU vs Eucl."]
    out += [table(heads, body, 2), ""]
    within = [f"{x['op']} {x['format']} {x['kind']}" for x in c["rows"] if x["vs_minimum"] <= 1.3]
    out.append(f"Within 1.3x of the minimum: {len(within)} of {len(c['rows'])} paths ({', '.join(within) or 'none'}).")
    cat_free = [x for x in c["rows"] if (x["bytes_per_element"] - sum(
        k["bytes_per_element"] for k in c["kernels"][f"{x['op']} {x['format']} {x['kind']}"]
        if k["name"].startswith("aten.cat"))) / x["minimum"] <= 1.3]
    out.append(f"A projection, not a measurement: without the CPU-only copy of the codes (`aten.cat`, below), "
               f"{len(cat_free)} of {len(c['rows'])} paths would be within 1.3x (the generated bytes minus that kernel's; "
               "unverified: on other devices Inductor lowers the cat to a ConcatKernel, but the codes reach it as a reshape "
               "of the encoder's output, which it copies in a kernel of its own unless the backend fuses that copy with "
               "the encoder).")
    for op in st["ops"]:
        for fmt, _ in st["formats"]:
            pair = {x["kind"]: x for x in c["rows"] if x["op"] == op and x["format"] == fmt}
            if set(CODEC_PAIR) <= set(pair):
                e, g = (pair[kind] for kind in CODEC_PAIR)
                gen, least = g["bytes_per_element"] / e["bytes_per_element"], g["minimum"] / e["minimum"]
                out.append(f"GIFT low-rank / Euclidean, {op} {fmt}: generated {gen:.2f}x, minimum {least:.2f}x.")
    out.append("")
    over = [x for x in c["rows"] if x["vs_minimum"] > 1.3]
    if over:
        out += ["Bodies above 1.3x of their minimum, with their excess and their three biggest kernels "
                "(B/element):", ""]
        for x in over:
            ks = sorted(c["kernels"][f"{x['op']} {x['format']} {x['kind']}"], key=lambda k: -k["bytes_per_element"])
            biggest = [f"`{k['name']}` {k['bytes_per_element']:.2f}" for k in ks if not k["collective"]][:3]
            out.append(f"- {x['op']} {x['format']} {x['kind']}: {x['bytes_per_element'] - x['minimum']:.2f} B/el over; "
                       + "; ".join(biggest))
        out.append("")
    two_level = [x for x in c["rows"] if x["kind"] == LowRank.kind and FormatSpec(x["format"]).has_tensor_scale
                 and x["vs_minimum"] > 1.3]
    if two_level:
        lim = realisation_limits()
        biggest = []
        for x in two_level:
            ks = [k for k in c["kernels"][f"{x['op']} {x['format']} {x['kind']}"] if k["name"].startswith("fused")]
            k = max(ks, key=lambda k: k["bytes_per_element"])
            biggest.append(f"{x['op']} {x['format']} `{k['name']}` {k['bytes_per_element']:.2f}")
        out += ["Why the low-rank map with a two-level format stays above 1.3x: the expansion "
                "`G D^{-1/2} + (sum_k P_k C_k U^T_k) D^{1/2}` reads 2r + 3 = "
                f"{2 * st['rank'] + 3} operands per element, and Inductor writes a pointwise expression to memory once it "
                f"accumulates more reads than {lim['cpu_reads']} (CPU; {lim['gpu_reads']} on other devices) or more "
                f"than {lim['cpu_ops']} ops ({lim['gpu_ops']}). Under row scaling (fp8) the written tensor's two "
                "consumers, the row amax and the encoder, fuse into one kernel and the buffer stays local; a two-level "
                "format's tensor scale needs every block's statistic before any block is encoded, so the block amax "
                "and the encoder each read the written transform back (the minimum counts one more read of G "
                "instead: the expansion recomputed). Tried and not kept: spelling the expansion once per consumer "
                "makes Inductor write each copy; spelling it over the blocks (`[rows * d_in / 16, 16]`, the block "
                "amax's loop) lets the CPU backend compute it inside the amax loop (4 B/element less) but indexes "
                "the per-row and per-column operands by a division and a modulo, which it does not vectorize, and the "
                "body ran several times slower on this CPU than with the extra pass. A raised threshold is a global "
                "Inductor setting the package does not change. The largest fused kernel of each such body "
                "(B/element): " + "; ".join(biggest) + ".", ""]
    notes = []
    for key, ks in c["kernels"].items():
        for k in unfused(ks):
            notes.append([key, k["name"], k["bytes_per_element"], k["why"]])
    if notes:
        out += ["Kernels that stay outside the codec's fused loops (>= 0.05 B/element), with the reason:", "",
                table(["body", "kernel", "B/el", "reason"], notes, 2), ""]
        out += [f"- **{short}**: {why}." for short, why in UNFUSED.values() if any(n[3] == short for n in notes)]
        out.append("")
    return out


# the Euclidean path each transformed path is compared with (bench.overhead.BASELINE)
BASE_PATH = {"gift-fp8": "euclid-fp8", "hadamard-fp8": "euclid-fp8", "dense-fp8": "euclid-fp8",
             "gift-nvfp4": "euclid-nvfp4"}


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
            "algorithms, `bench.wire.sent_bytes`).", "",
            table(["model", "ranks", "collective", "fp32 MB/step/rank", *formats[1:]], rows, 1), ""]
    rows = [[m["name"]] + [next(x["managed_bits_per_element"] for x in wr["rows"] if x["model"] == m["name"]
                                and x["world"] == 64 and x["op"] == "reduce_scatter" and x["format"] == f)
                           for f in formats] for m in wr["models"]]
    out += ["Exact wire bits per managed element (payload + scales, reduce-scatter):", "",
            table(["model", *formats], rows, 3), "", f"![wire]({plots['wire']})", ""]
    return out


def _ci(p: dict, digits: int = 4) -> str:
    """`mean ± 95% CI half-width (n)`; `*` marks a difference whose CI excludes zero."""
    if p["n"] < 2:
        return f"{p['mean']:+.{digits}f} (n=1)"
    return f"{p['mean']:+.{digits}f} ± {p['ci95']:.{digits}f}{' *' if p['resolved'] else ''} (n={p['n']})"


def _share(v: dict) -> str:
    """`NN% [lo%, hi%]` of a gap's share closed with its Fieller 95% CI, or `n/a`."""
    share = v.get("share_closed", math.nan)
    if share != share:
        return "n/a (no resolved Euclidean gap)"
    ci = v.get("share_closed_ci95")
    bounds = "CI unbounded" if ci is None else f"95% CI {100 * ci[0]:.0f}% to {100 * ci[1]:.0f}%"
    return f"{100 * share:.0f}% ({bounds})"


def _family(w: dict) -> str:
    """`k bit widths tested, Holm-corrected` for a verdict's family."""
    fam = w.get("family", [])
    return (f"Holm-corrected over the {len(fam)} bit width(s) with n >= 2 "
            f"({', '.join(f['key'] + ' p=' + format(f['p'], '.2g') for f in fam)})")


def _verdict_lines(cv: dict) -> list[str]:
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
            "(`fully_shard`, 1-D mesh) with GIFT's reduce-scatter (one quantization; `bench.convergence.ShardedTwin`). "
            "Held-out bits/byte minus the same seed's fp32 run of the same path, mean ± 95% CI (t, n seeds); share "
            "closed with its Fieller 95% CI; last column: the reduce-scatter run minus the all-reduce run of the same "
            "arm and seed (paired, 95% CI).", "",
            table(["optimizer", "arm", "all-reduce minus fp32", "reduce-scatter minus fp32", "share closed, all-reduce",
                   "share closed, reduce-scatter", "RS minus AR"], rows), ""]


def _other_designs(cv: dict) -> list[str]:
    """Each study run at other ranks or steps (`bench.convergence.study`) next to the main study
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


def _convergence(cv: dict, plots: dict) -> list[str]:
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
           "`bench.reference`, chosen on CPU), AdamW on embeddings, norms and head (the paper's setting); `adamw`: "
           "AdamW on everything. "
           "Arms: `fp32` (plain fp32 communication, the reference), `euclid-<format>` (`geometry=\"none\"`), "
           f"`gift-<format>` (`geometry=\"lowrank\"`, rank {g['rank']}, refresh every {g['refresh_every']} steps, "
           "every managed layer whitened), `-ef` = error feedback (fp32 residual); the variants that judge what limits "
           "GIFT: `-mom` the map from the "
           "optimizer's momentum (`geometry=\"momentum\"`), `-d2` damping 1e-2, `-auto` the measured selection "
           "(`select=\"auto\"`) instead of every layer, `-two` two-sided whitening from the momentum (an experiment the product "
           "cannot run on row shards, `bench.convergence.TwoSided`; GIFT-only variants are compared with the "
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
    out += _verdict_lines(cv)
    out += _both_paths(cv)
    out += _other_designs(cv)
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
_STEP_INPUTS = {
    "gpus": ("assumed", "the paper: 64 GH200"),
    "tokens_per_gpu": ("assumed", "1M-token global batch"),
    "peak_tflops": ("assumed", "H100/GH200 dense BF16 (NVIDIA datasheet)"),
    "mfu": ("assumed", "typical for sub-1B Megatron"),
    "fp32_tflops": ("assumed", "H100/GH200 fp32 non-tensor peak (datasheet): codec and statistics matmuls are fp32"),
    "fp32_efficiency": ("assumed", "share of fp32 peak for skinny matmuls / multiply-adds"),
    "tf32_tflops": ("assumed", "H100/GH200 dense TF32 peak (datasheet): used for fp32_tflops in `TF32 matmuls`"),
    "link_gbytes": ("assumed", "InfiniBand NDR 400 Gb/s per GPU"),
    "link_efficiency": ("assumed", "nccl-tests bus bandwidth share"),
    "hbm_tbytes": ("assumed", "GH200 HBM3 (NVIDIA datasheet)"),
    "kernel_efficiency": ("assumed", "share of HBM bandwidth the codec kernels reach (`make gpu-check` measures it)"),
    "exposed_fraction": ("calibrated", "share of comm not overlapped: 1.0 in `defaults`, fitted in `calibrated`"),
    "refresh_tflops": ("assumed", "effective fp64 rate of the refresh (matmuls and tall-skinny QR)"),
    "refresh_sharded": ("code", "True = each rank rebuilds 1/gpus of the transforms (GiftState.owners)"),
}


def _tuning(tunes: list[dict]) -> list[str]:
    """Section 5.2: the short paired runs of `bench.tune` (each attached JSON file)."""
    out = ["### 5.2 Closing the gap: tuning runs", "",
           "Short paired runs (`python -m bench.tune`): one optimizer and one wire format, every arm of a seed "
           "sharing init and data order with that seed's fp32 arm. Columns as in 5.1; `vs Euclidean` = the GIFT "
           "variant minus the Euclidean arm with the same error feedback / rounding (mean ± 95% CI, t, n seeds); "
           "share closed with Fieller's 95% CI. Variants: `-ef` error feedback, `-sr` stochastic rounding, "
           "`-dense` dense whitening, `-exact` exact K-FAC statistics instead of the sketch, `-r64` rank 64, "
           "`-rf5` refresh every 5 steps, `-grad` the gradient-side factor G^T G of the step's gradient, `-mom` "
           "the factor M^T M of the optimizer's momentum (`geometry=\"momentum\"`), `-d2` damping 1e-2, `-two` "
           "two-sided whitening from the momentum (an experiment, `bench.convergence.TwoSided`, not in the product).", ""]
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


def _sweeps(sweeps: list[dict]) -> list[str]:
    """Section 2.5: `bench.fidelity_sweep` results (each attached JSON file)."""
    out = ["### 2.5 Whitening sweep: what limits GIFT, per metric", "",
           "`python -m bench.fidelity_sweep`: one round trip per candidate geometry and format on the reference "
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
                    "L2 error. AdamW candidates (`bench.fidelity_sweep.ADAM_CANDIDATES`, prototypes): "
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


def _step_model(sm: dict, plots: dict) -> list[str]:
    first = next(iter(sm["scenarios"].values()))
    x = first["inputs"]
    out = ["## 6. Step-time model (projection, not a measurement)", "",
           f"{first['model']} ({first['model_description']}, {first['params']:,} parameters), pure data "
           f"parallelism on {x['gpus']} GPUs: step = compute + exposed comm + codec + statistics + refresh "
           "(`bench.step_model`). Every arm is a `GiftConfig` the code runs; which weights are managed, their plans, "
           "wire bytes, statistics FLOPs and refresh FLOPs are read off a `GiftState` built for the model on the "
           "meta device. Selection is structure: a layer `select` leaves out runs the Euclidean codec and gathers no "
           "statistics (`gift-fp8 (13 fc2)`: `select` = globs of 13 `feed_forward.w2` weights; every other managed "
           "weight on the Euclidean fp8 codec).", ""]
    rows = [[k, v, *_STEP_INPUTS.get(k, ("", ""))] for k, v in x.items()]
    out += ["Inputs, and how each is obtained (assumed = documented assumption, override in "
            "`bench.step_model.StepModelInputs`; calibrated = fitted to the paper; code = as implemented):", "",
            table(["input", "default", "kind", "source"], rows, 3), "",
            "Measured from the code (this run): codec bytes per element of each plan, compiled for "
            f"{x['gpus']} ranks (`bench.overhead.codec_traffic`; all-reduce, the paper's setting):", ""]
    rows = [[m["format"], m["scaling"], m["kind"], f"[{m['rows']},{m['cols']}]", m["bytes_per_element"]]
            for m in sm["codec_measured"]]
    out += [table(["format", "scaling", "transform", "gradient", "bytes/el"], rows, 2), ""]
    f = sm["calibrated_exposed_fraction"]
    out += [f"Calibrated scenarios: exposed-communication share chosen so that Euclidean FP8 reproduces the "
            f"paper's {100 * sm['paper']['euclid-fp8']:+.1f}%: "
            f"{'no share in [0, 1] fits' if f is None else f'{f:.3f}'}.", ""]
    names = list(sm["scenarios"])
    arms = list(first["arms"])
    rows = [[a] + [f"{100 * sm['scenarios'][n]['arms'][a]['vs_fp32']:+.1f}%" for n in names]
            + [f"{100 * sm['paper'][a]:+.1f}%" if a in sm["paper"] else ""] for a in arms]
    out += [table(["arm", *names, "paper"], rows), ""]
    base = sm["scenarios"]["calibrated" if "calibrated" in sm["scenarios"] else "defaults"]
    rows = [[a, v["compute_s"] * 1e3, v["exposed_comm_s"] * 1e3, v["codec_s"] * 1e3, v["stats_s"] * 1e3,
             v["refresh_s"] * 1e3, v["sent_bytes"] / 1e9, v["codec_bytes_per_element"]] for a, v in base["arms"].items()]
    out += [f"Breakdown, `{'calibrated' if 'calibrated' in sm['scenarios'] else 'defaults'}` scenario (ms per step; "
            "`sent` = GB each rank transmits; `codec B/el` = measured codec bytes per managed element):", "",
            table(["arm", "compute", "exposed comm", "codec", "statistics", "refresh", "sent GB", "codec B/el"],
                  rows, 2), "", f"![step model]({plots['step_model']})", ""]
    return out


def _memory_headline(mem: dict) -> list[str]:
    rows = []
    for r in mem["rows"]:
        if r["config"].startswith("GIFT defaults") and r["world"] == max(x["world"] for x in mem["rows"]):
            rows.append([r["model"], r["config"], r["world"], r["fsdp_per_rank"] / 2**30, r["gift_total"] / 2**30,
                         r["gift"]["statistics"] / 2**30, r["gift"]["residuals"] / 2**30])
    return ["GIFT state per rank (section 7; the real `GiftState` on the meta device) next to FSDP's sharded "
            "parameters + gradients + AdamW state, GiB:", "",
            table(["model", "config", "ranks", "FSDP state", "GIFT state", "of which statistics", "of which residual"],
                  rows, 2), ""]


def _memory(mem: dict) -> list[str]:
    out = ["## 7. Memory per rank", "",
           "`bench.memory`: the model (`bench.wire.MODEL_CONFIGS`, a Llama built on the meta device), the layers "
           "`gift_compile.api.eligible_linears` manages, a real `GiftState` holding them and "
           "`GiftState.memory_bytes()` (every tensor it keeps, by kind); FSDP = parameters + gradients + AdamW "
           "state (`torch.optim.AdamW` after one step on meta), fp32, sharded over the ranks. GIFT's transforms, "
           "statistics and probes are replicated on every rank and the error-feedback residual has the full local "
           "gradient's size, so GIFT's bytes do not shrink with the rank count. Re-running the section re-sizes "
           "whatever the code keeps (a sketched statistic or a compressed residual shows up here as written).", ""]
    rows = [[m["model"], m["description"], m["params"]] for m in mem["models"]]
    out += [table(["model", "shape", "parameters"], rows), ""]
    rows = []
    for r in mem["rows"]:
        g = r["gift"]
        rows.append([r["model"], r["world"], r["config"], r["layers"], r["fsdp_per_rank"] / 2**30,
                     g["transforms"] / 2**30, g["statistics"] / 2**30, g["residuals"] / 2**30, g["probes"] / 2**30,
                     r["gift_total"] / 2**30, r["gift_vs_fsdp"]])
    out += ["GiB per rank:", "",
            table(["model", "ranks", "config", "layers", "FSDP state", "transforms", "statistics", "residual", "probes",
                   "GIFT total", "GIFT / FSDP"], rows, 2), ""]
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
        lines += _overhead(r["overhead"], plots)
    if "codec" in r:
        lines += _codec(r["codec"])
    if "wire" in r:
        lines += _wire(r["wire"], plots)
    if "convergence" in r:
        lines += _convergence(r["convergence"], plots)
    if r.get("tuning"):
        lines += _tuning(r["tuning"])
    if "step_model" in r:
        lines += _step_model(r["step_model"], plots)
    if "memory" in r:
        lines += _memory(r["memory"])
    lines += ["## 8. Hardware", "",
              "No GPU was lent to this task. Overhead times are CPU times (section 3); GPU-scale step times are "
              "projections (section 6). `make gpu-check` (`bench/gpu_check.py`) is the prepared single-GPU check "
              "(Triton compile of the codecs, kernel times and achieved bandwidth, a 1-rank torchtitan step); it "
              "writes `bench/results/GPU.md`.", ""]
    return "\n".join(lines) + "\n"
