"""GPU.md from `bench.gpu.check`'s results: rendering only (the check measures, this writes the page)."""

from __future__ import annotations

import math

from bench.lib.formatting import table

__all__ = ["render"]


def render(results: dict[str, object]) -> str:
    """GPU.md from the results."""
    sec = results["sections"]
    dry = results["dry_run"]
    lines = ["# GPU check" + (" (DRY RUN on the CPU: small shapes, CPU kernels; not a GPU measurement)" if dry else ""),
             "", f"`{results['command']}`, started {results['started']}, {results['seconds']:.0f} s. "
             f"Low-rank rank {results['rank']}. Sections: "
             + ", ".join(f"{k} **{v['status']}**" for k, v in sec.items()) + ".", ""]
    dev = sec.get("device", {}).get("result")
    if dev:
        rows = [[k, v] for k, v in dev.items()]
        lines += ["## Device", "", table(["what", "value"], rows, 3), "",
                  f"Measured copy bandwidth {dev['copy_bytes_per_s'] / 1e12:.3f} TB/s (bytes read + written per "
                  "second of a large device-to-device copy: the practical ceiling of a memory-bound kernel).", ""]
    codec = sec.get("codec", {}).get("result")
    if codec:  # results from before the explicit kernels (752a7d2, the first H200 run) carry no `impl`:
        codec = [{"impl": "inductor", **r} for r in codec]  # every step of their bodies was generated
    copy_bw = dev["copy_bytes_per_s"] if dev else math.nan  # the per-kernel table's "of copy BW"
    traffic = sec.get("kernel_traffic", {}).get("result")
    if traffic:
        rows = [[r["shape"], r["format"], r["op"], r["world"], r["kernel_bytes_per_element"],
                 r["floor_bytes_per_element"], r["kernel_over_floor"]] for r in traffic]
        lines += ["## Kernel traffic", "",
                  "Bytes per gradient element the explicit codec kernels move in the Euclidean collective bodies "
                  "(`bench.fidelity.kernel_traffic`: the per-item stages traced on fake CUDA tensors, each kernel's bytes from "
                  "its own arguments, so they do not depend on the torch release), against the body's floor "
                  "(`bench.fidelity.codec_minimum.minimum_bytes`). Not counted: the block statistics' maximum and the "
                  "send/receive buffer glue, which Inductor generates.", "",
                  table(["gradient", "format", "op", "ranks", "kernels B/el", "floor B/el", "kernels / floor"], rows,
                        3), ""]
    lowrank = sec.get("map", {}).get("result")
    if lowrank:
        rows = [[r["shape"], r["impl"], r["status"], r.get("time_us", ""), r.get("floor_us", ""),
                 r.get("vs_floor", ""), r.get("rel_error", "")] for r in lowrank]
        lines += ["## The low-rank map alone", "",
                  "`LowRank.apply_forward` at `map_precision=\"exact\"` compiled by Inductor, against the map's "
                  "two kernels (`gift_compile.kernels.map_dispatch.lowrank_map`: the projection, then the tl.dot "
                  "expansion, fp32 accumulation; fp32, TF32 or bf16 operands, the last two through "
                  "`LowRank.apply_forward` as the exchange runs them). Floor: read G and write its image once "
                  "(8 B/el) at the measured copy bandwidth. "
                  "Error: relative L2 against the map in fp64.", "",
                  table(["gradient", "impl", "status", "µs", "floor µs", "time / floor", "rel. error"], rows, 3), ""]
    fold = sec.get("fold", {}).get("result")
    if fold:
        rows = [[r["shape"], r["tokens"], r["dw_us"], r["project_us"], r["fold_us"], r["project_bytes"] / 1e6,
                 r["fold_bytes"] / 1e6, r["project_rel_error"], r["fold_rel_error"],
                 "" if r["fold_wins"] is None else ("yes" if r["fold_wins"] else "no")] for r in fold]
        lines += ["## The projection folded into the weight-gradient matmul", "",
                  "The map's projection `G U` of the fp32 gradient, against `dY^T (X U)` from the layer's bf16 output "
                  "gradient and input (`bench.gpu.fold`), with the backward's own dW matmul for scale; bytes each way "
                  "reads and writes at least; error: relative L2 against the projection in fp64. Folding wins where "
                  "its two matmuls take less time than the projection" + (" (not decided on the CPU)." if dry else "."),
                  "", table(["gradient", "tokens", "dW µs", "project µs", "fold µs", "project MB", "fold MB",
                             "project error", "fold error", "fold wins"], rows, 3), ""]
    if codec:
        rows = []
        for r in codec:
            if r.get("status") != "ok":
                rows.append([r["shape"], r["path"], r["impl"], r.get("status"), "", "", "", "", "", ""])
                continue
            rows.append([r["shape"], r["path"], r["impl"], "ok", r["bytes_per_element"], r["time_us"],
                         r["achieved_bytes_per_s"] / 1e9, r["of_copy"],
                         "" if r["of_datasheet"] is None else r["of_datasheet"], ", ".join(r["fp8_types"])])
        lines += ["## Codec kernels", "",
                  "Compiled one-rank all-reduce body (`bench.fidelity.overhead.codec_body`), with the explicit kernels "
                  "(`gift_compile.kernels`, CUDA and their formats only) or as Inductor-generated code; bytes from "
                  "the compiled graph (`bench.fidelity.overhead.generated_traffic`), median time per call (whole codec, launch "
                  "gaps included), achieved = bytes / time.", "",
                  table(["gradient", "path", "impl", "status", "bytes/el", "µs", "GB/s", "of copy BW", "of datasheet",
                         "float8 types in source"], rows, 3), ""]
        rows = [[r["shape"], r["path"], r["impl"], r["minimum_bytes_per_element"], r["bytes_per_element"],
                 r["bytes_per_element"] / r["minimum_bytes_per_element"], r["minimum_us"], r["time_us"],
                 r["vs_minimum_time"]] for r in codec if r.get("status") == "ok"]
        lines += ["Against the minimum (`bench.fidelity.codec_minimum.minimum_bytes`, one-rank all-reduce): the bytes the body "
                  "needs, and the time they take at the measured copy bandwidth.", "",
                  table(["gradient", "path", "impl", "minimum B/el", "generated B/el", "generated / min", "minimum µs",
                         "codec µs", "time / minimum"], rows, 3), ""]
        rows = [[r["shape"], r["path"], r["impl"], k["kernel"], k["us"], "" if k["bytes"] is None else k["bytes"] / 1e6,
                 "" if k["achieved_bytes_per_s"] is None else k["achieved_bytes_per_s"] / 1e9,
                 "" if k["achieved_bytes_per_s"] is None else k["achieved_bytes_per_s"] / copy_bw]
                for r in codec if r.get("status") == "ok" for k in r["per_kernel"]]
        lines += ["Per kernel (profiler time per call; bytes from Inductor's `kernel_num_gb` in the Triton source, "
                  "and for the explicit kernels from their arguments (`gift_compile.kernels.traffic`); absent for C++ "
                  "and extern kernels):", "",
                  table(["gradient", "path", "impl", "kernel", "µs", "MB", "GB/s", "of copy BW"], rows, 3), ""]
        ratios = []
        for r in codec:
            base = {"gift-fp8": "euclid-fp8", "gift-nvfp4": "euclid-nvfp4"}.get(r["path"])
            b = next((x for x in codec if x["shape"] == r["shape"] and x["path"] == base and x["impl"] == r["impl"]),
                     None)
            if base and b and r.get("status") == b.get("status") == "ok":
                ratios.append([r["shape"], r["path"], r["impl"], r["bytes_per_element"] / b["bytes_per_element"],
                               r["time_us"] / b["time_us"]])
        if ratios:
            lines += ["GIFT over Euclidean (same format, same impl):", "",
                      table(["gradient", "path", "impl", "bytes ratio", "time ratio"], ratios, 3), ""]
        ratios = []
        for r in codec:
            b = next((x for x in codec if x["shape"] == r["shape"] and x["path"] == r["path"]
                      and x["impl"] == "inductor"), None)
            if r["impl"] == "kernels" and b and r.get("status") == b.get("status") == "ok":
                ratios.append([r["shape"], r["path"], r["time_us"], b["time_us"], r["time_us"] / b["time_us"]])
        if ratios:
            lines += ["Explicit kernels over Inductor-generated code (same body):", "",
                      table(["gradient", "path", "kernels µs", "inductor µs", "time ratio"], ratios, 3), ""]
    parity = sec.get("parity", {}).get("result")
    if parity:
        rows = [[r["shape"], r["path"], r["impl"], r["elements"], r["differ"], r["max_rel_diff"]] for r in parity]
        lines += ["## Parity with the CPU", "", "Compiled codec on this device vs the eager codec on the CPU "
                  "(same input and transform tensors): output elements that differ.", "",
                  table(["gradient", "path", "impl", "elements", "differ", "relative L2 of the difference"], rows, 3),
                  ""]
    tt = sec.get("torchtitan", {}).get("result")
    if tt:
        lines += ["## torchtitan", "", f"`{tt['command']}`: return code {tt['returncode']}, {tt['wall_s']:.0f} s; "
                  f"losses {tt['losses']}; GIFT metrics {tt['gift_metrics']}. One rank: no gradient collective, so "
                  "the managed gradients passed GIFT's marks at full precision (`unrewritten=warn`).", ""]
    failed = {k: v for k, v in sec.items() if v["status"] != "ok"}
    if failed:
        lines += ["## Not ok", ""]
        for k, v in failed.items():
            lines += [f"- {k}: {v['status']}" + (f": {v['error']}" if "error" in v else "")]
        lines += [""]
    return "\n".join(lines) + "\n"
