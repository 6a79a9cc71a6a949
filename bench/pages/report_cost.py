"""REPORT.md's sections on what GIFT costs: the codec's overhead against the Euclidean one
(section 3), the codec against its minimum traffic (section 3b), the step-time projection
(section 6) and the memory (section 7), rendered from `bench.run`'s results dict
(`bench.pages.report` puts the sections together).
"""

from __future__ import annotations

import math

from bench.fidelity.codec_minimum import UNFUSED, realisation_limits, unfused
from bench.lib.formatting import table
from gift_compile.codec.spec import FormatSpec
from gift_compile.geometry.table import IDENTITY_KIND, LowRank

# The codec rows set side by side: the Euclidean body and GIFT's low-rank one.
CODEC_PAIR = (IDENTITY_KIND, LowRank.kind)


BASE_PATH = {"gift-fp8": "euclid-fp8", "hadamard-fp8": "euclid-fp8", "dense-fp8": "euclid-fp8",
             "gift-nvfp4": "euclid-nvfp4"}


def _ratio_to(rows: list[dict], path: str, base: str, key: str) -> float:
    a = next((x[key] for x in rows if x["path"] == path), math.nan)
    b = next((x[key] for x in rows if x["path"] == base), math.nan)
    return a / b


def overhead_headline(ov: dict) -> list[str]:
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


def overhead(ov: dict, plots: dict) -> list[str]:
    tr = ov["traffic"]
    out = ["## 3. Overhead", "",
           "The body of the collective (`gift_compile.exchange.bucket.bucket_core`: transform, local scales, encode, "
           "decode every sender + fp32 sum, re-encode and gather for an all-reduce, inverse) compiled with "
           "`torch.compile(fullgraph=True, dynamic=False)`. `bf16` = cast to bf16 and back; `gift-*` = low-rank "
           f"rank-{ov['rank']} whitening; `*-fp8` = E4M3 per-row.", "",
           "### 3.1 Bytes moved, measured from the generated kernels", "",
           "`bench.fidelity.overhead.generated_traffic`: for every kernel Inductor generated (fused C++ kernels and extern "
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


def codec(c: dict) -> list[str]:
    """Section 3b: every codec path's generated bytes next to the minimum it needs, before and
    after the codec work, and the kernels that stay apart with the reason."""
    st = c["settings"]
    label, rows, cols = st["shape"]
    out = ["## 3b. The codec at the memory-traffic limit", "",
           f"`bench.fidelity.codec_minimum` at {label}, rank {st['rank']}, a {st['world']}-rank plan (fake process group). "
           "`minimum` = bytes per gradient element the body needs (`bench.fidelity.codec_minimum.minimum_bytes`, computed from "
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


# the Euclidean path each transformed path is compared with (bench.fidelity.overhead.BASELINE)
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


def step_model(sm: dict, plots: dict) -> list[str]:
    first = next(iter(sm["scenarios"].values()))
    x = first["inputs"]
    out = ["## 6. Step-time model (projection from CPU-counted codec bytes at copy bandwidth, not a measurement)", "",
           f"{first['model']} ({first['model_description']}, {first['params']:,} parameters), pure data "
           f"parallelism on {x['gpus']} GPUs: step = compute + exposed comm + codec + statistics + refresh "
           "(`bench.step_model.cpu`). Every arm is a `GiftConfig` the code runs; which weights are managed, their plans, "
           "wire bytes, statistics FLOPs and refresh FLOPs are read off a `GiftState` built for the model on the "
           "meta device. Selection is structure: a layer `select` leaves out runs the Euclidean codec and gathers no "
           "statistics (`gift-fp8 (13 fc2)`: `select` = globs of 13 `feed_forward.w2` weights; every other managed "
           "weight on the Euclidean fp8 codec).", ""]
    rows = [[k, v, *_STEP_INPUTS.get(k, ("", ""))] for k, v in x.items()]
    out += ["Inputs, and how each is obtained (assumed = documented assumption, override in "
            "`bench.step_model.cpu.StepModelInputs`; calibrated = fitted to the paper; code = as implemented):", "",
            table(["input", "default", "kind", "source"], rows, 3), "",
            "Measured from the code (this run): codec bytes per element of each plan, compiled for "
            f"{x['gpus']} ranks (`bench.fidelity.overhead.codec_traffic`; all-reduce, the paper's setting):", ""]
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


def memory_headline(mem: dict) -> list[str]:
    rows = []
    for r in mem["rows"]:
        if r["config"].startswith("GIFT defaults") and r["world"] == max(x["world"] for x in mem["rows"]):
            rows.append([r["model"], r["config"], r["world"], r["fsdp_per_rank"] / 2**30, r["gift_total"] / 2**30,
                         r["gift"]["statistics"] / 2**30, r["gift"]["residuals"] / 2**30])
    return ["GIFT state per rank (section 7; the real `GiftState` on the meta device) next to FSDP's sharded "
            "parameters + gradients + AdamW state, GiB:", "",
            table(["model", "config", "ranks", "FSDP state", "GIFT state", "of which statistics", "of which residual"],
                  rows, 2), ""]


def memory(mem: dict) -> list[str]:
    out = ["## 7. Memory per rank", "",
           "`bench.fidelity.memory`: the model (`bench.lib.wire.MODEL_CONFIGS`, a Llama built on the meta device), the layers "
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
