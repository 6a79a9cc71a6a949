"""Step time of Llama-3-8B on 64 GPUs per communication config, priced from the H200 measurement.

`python -m bench.step_model.gpu` writes `bench/results/step_model/gpu_step_model.json`, which the
`gpu_step_model` block of docs/benchmarks.md renders (`bench.pages.readme`). Unlike `bench.step_model.cpu`
(a projection: codec bytes counted on the CPU, priced at an assumed share of HBM bandwidth, and
compute from an assumed MFU), every time here that a GPU measured is read from
`bench/results/gpu/gpu_h200/` (`bench.step_model.pricing`: the rules for shapes it did not measure):

    per managed layer: step = GEMMs + f * comm + codec + statistics + refresh

- GEMMs (calibrated): the layer's bf16 forward, weight- and input-gradient GEMMs at 8192 tokens
  per GPU, measured on the H200 (forward priced as the input-gradient GEMM);
- codec (calibrated): the compiled all-reduce codec body of the layer's path and shape, its
  device time (the CPU is assumed to run ahead of the GPU, as it does when each layer's GEMMs take
  longer than the host's launches); the launch-bound wall time is the sensitivity;
- comm (code + assumed link): the bytes each rank sends for the layer's plan
  (`bench.step_model.cpu.arm_layers`, from `bucket_wire_bytes`; fp32 is a ring all-reduce) over an
  assumed 50 GB/s x 0.8 per GPU; f, the exposed share of it, is assumed 1 (nothing hidden behind
  the backward, the case most favourable to compression), and the share at which GIFT would
  reach the goal is solved for;
- statistics and refresh (code-counted FLOPs, assumed rates): GIFT's only, as in `bench.step_model.cpu`.

The network rule here (every arm's bytes at one link rate per GPU, fp32 as a ring at that rate)
flatters GIFT at scale: it credits neither the ring's use of the node's NICs nor the all-to-all's
limit of one NIC per GPU. `bench.step_model.topology` prices each collective where its bytes go, with
the two-level exchange (`GiftConfig.ranks_per_node`) among its arms; this model stays the
per-layer codec/GEMM account at one link rate.

Which layers are managed, with which plan, is what `GiftState` does for the configs in `ARMS`
(fp8 E4M3 per row and NVFP4, the measured formats; the low-rank map at rank 32 on every layer for
GIFT). The unmanaged parameters (embeddings, output layer, norms) take the fp32 all-reduce in every
arm and add their GEMMs; attention's score and value GEMMs, norms, activations and the optimizer
are not priced (the same in every arm: they lower the percentages, not the time saved or GIFT's
share of Euclidean's saving).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from bench.step_model.pricing import (CODEC_FILE, GEMM_FILE, GEMM_REPEAT_FILE, GEMM_TOKENS, PATHS, CodecPricer,
                               GemmPricer, copy_bandwidth, load_bodies, load_gemms, repeat_spread)
from bench.lib.formatting import signed_pct
from bench.step_model.cpu import StepModelInputs, arm_layers
from bench.lib.wire import MODEL_CONFIGS, meta_model
from gift_compile.config import GiftConfig
from gift_compile.geometry.table import IDENTITY_KIND, LowRank
from gift_compile.runtime.selection import transform_flops
from bench.lib import paths

MODEL = "Llama-3-8B"
OUT = paths.RESULTS / "step_model" / "gpu_step_model.json"
RESULTS = paths.RESULTS / "results.json"  # the CPU-bytes projection, for the comparison
COMMAND = "python -m bench.step_model.gpu"
GOAL = 0.8  # issue 26: GIFT on every layer saves at least 80% of what Euclidean saves per step
_FORMATS = {"fp8": dict(format="fp8_e4m3", scaling="row"), "nvfp4": dict(format="nvfp4", scaling="row")}
# format -> (Euclidean, GIFT) config, as measured: every eligible layer, low-rank r = 32 for GIFT
ARMS: dict[str, tuple[GiftConfig, GiftConfig]] = {
    f: (GiftConfig(**kw, geometry="none"), GiftConfig(**kw, geometry="lowrank", select="all"))
    for f, kw in _FORMATS.items()}
INPUTS = StepModelInputs(gpus=64, tokens_per_gpu=GEMM_TOKENS, exposed_fraction=1.0)
# the StepModelInputs fields this model uses, and why each is an assumption
ASSUMED = {
    "gpus": "data-parallel ranks, one all-reduce per gradient: the deployment priced",
    "tokens_per_gpu": "the token count of the measured GEMMs; a 0.5 M-token global batch",
    "link_gbytes": "GB/s per GPU: InfiniBand NDR 400 Gb/s, one NIC per GPU",
    "link_efficiency": "share of the link large collectives achieve (nccl-tests)",
    "exposed_fraction": "share of the gradient communication exposed: all of it, none overlapped with the backward",
    "fp32_tflops": "fp32 peak TFLOP/s for GIFT's statistics update (not measured on the GPU)",
    "fp32_efficiency": "share of that peak",
    "refresh_tflops": "effective fp64 TFLOP/s of the transforms' refresh, sharded over the ranks",
}


def _check_plans(euclid: list, gift: list, rank: int) -> None:
    """Each arm runs the plans that were measured, or the pricing would be of something else."""
    bad = [c.fqn for c in euclid if c.plan.kind != IDENTITY_KIND] + [c.fqn for c in gift if c.plan.kind != LowRank.kind]
    if bad or len(euclid) != len(gift):
        raise ValueError(f"gpu_step_model: layers not on the measured paths: {bad[:5]}")
    if gift and gift[0].plan.kind == LowRank.kind and ARMS["fp8"][1].rank != rank:
        raise ValueError(f"gpu_step_model: GIFT's rank {ARMS['fp8'][1].rank} is not the measured rank {rank}")


def _share(saves_e: float, saves_g: float) -> float | None:
    return saves_g / saves_e if saves_e > 0 else None


def _goal_share(d_e: float, k_e: float, d_g: float, k_g: float, goal: float = GOAL) -> float | None:
    """Exposed share f at which GIFT saves `goal` of Euclidean's saving: f d_g - k_g = goal (f d_e - k_e),
    d = full communication time saved, k = time added. None where no f makes it (denominator <= 0)."""
    denom = d_g - goal * d_e
    return (k_g - goal * k_e) / denom if denom > 0 else None


def _row(arms: dict[str, dict[str, float]], f: float) -> dict[str, object]:
    """Step, savings and GIFT's share for per-arm costs (`compute`, `comm`, `added` in µs)."""
    step = {a: c["compute"] + f * c["comm"] + c["added"] for a, c in arms.items()}
    saves = {a: step["fp32"] - step[a] for a in ("euclid", "gift")}
    d = {a: arms["fp32"]["comm"] - arms[a]["comm"] for a in ("euclid", "gift")}
    return {"step_us": step, "saves_us": saves, "share": _share(saves["euclid"], saves["gift"]),
            "exposed_share_for_goal": _goal_share(d["euclid"], arms["euclid"]["added"], d["gift"], arms["gift"]["added"]),
            "exposed_share_gift_pays": arms["gift"]["added"] / d["gift"] if d["gift"] > 0 else None}


def price_format(fmt: str, codec: CodecPricer, gemm: GemmPricer, x: StepModelInputs, rank: int) -> dict[str, object]:
    """Per layer shape (one layer) and for the whole model (every layer, per step), in µs."""
    cfg = MODEL_CONFIGS[MODEL]
    zero = lambda plan, r: 0.0  # noqa: E731 -- codec bytes are not used: the codec is priced from the GPU
    euclid, gift = (arm_layers(c, cfg, x, zero) for c in ARMS[fmt])
    _check_plans(euclid, gift, rank)
    link = x.link_gbytes * 1e9 * x.link_efficiency / 1e6  # bytes per µs
    fp32_rate, refresh_rate = x.fp32_tflops * x.fp32_efficiency * 1e6, x.refresh_tflops * 1e6  # FLOPs per µs
    ring = 2.0 * (x.gpus - 1) / x.gpus
    groups: dict[tuple[int, int], dict[str, object]] = {}
    for e, g in zip(euclid, gift):
        key = (e.rows, e.cols)
        grp = groups.setdefault(key, {"names": [], "count": 0, "e": e, "g": g})
        name = e.fqn.split(".")[-2]
        if name not in grp["names"]:
            grp["names"].append(name)
        grp["count"] += 1
    rows, totals, wall = [], {a: {"compute": 0.0, "comm": 0.0, "added": 0.0} for a in ("fp32", "euclid", "gift")}, {}
    for (r, c), grp in groups.items():
        e, g = grp["e"], grp["g"]
        gp = gemm.price(r, c, x.tokens_per_gpu)
        pe, pg = codec.price(PATHS[("identity", e.plan.format)], r, c), codec.price(PATHS[("lowrank", g.plan.format)], r, c)
        stats, refresh = g.stats_flops / fp32_rate, g.refresh_flops / refresh_rate
        arms = {"fp32": {"compute": gp.total_us, "comm": ring * 4.0 * r * c / link, "added": 0.0},
                "euclid": {"compute": gp.total_us, "comm": e.sent_bytes / link, "added": pe.device_us},
                "gift": {"compute": gp.total_us, "comm": g.sent_bytes / link, "added": pg.device_us + stats + refresh}}
        launch = {a: dict(v) for a, v in arms.items()}
        launch["euclid"]["added"], launch["gift"]["added"] = pe.wall_us, pg.wall_us + stats + refresh
        for a in arms:
            for k in totals[a]:
                totals[a][k] += grp["count"] * arms[a][k]
            wall.setdefault(a, {"compute": 0.0, "comm": 0.0, "added": 0.0})
            for k in wall[a]:
                wall[a][k] += grp["count"] * launch[a][k]
        rows.append({"layers": grp["names"], "rows": r, "cols": c, "count": grp["count"],
                     "gemm_us": dataclasses.asdict(gp), "comm_us": {a: v["comm"] for a, v in arms.items()},
                     "codec_us": {"euclid": pe.device_us, "gift": pg.device_us},
                     "codec_launch_bound_us": {"euclid": pe.wall_us, "gift": pg.wall_us},
                     "codec_basis": pe.basis, "stats_us": stats, "refresh_us": refresh,
                     **_row(arms, x.exposed_fraction), "launch_bound": _row(launch, x.exposed_fraction)})
    # the unmanaged parameters: fp32 all-reduce in every arm; the output layer's GEMMs
    params = sum(p.numel() for p in meta_model(cfg).parameters())
    unmanaged = params - sum(c.rows * c.cols for c in euclid)
    out_gemm = gemm.price(cfg.vocab_size, cfg.dim, x.tokens_per_gpu)
    for t in (totals, wall):
        for a in t:
            t[a]["comm"] += ring * 4.0 * unmanaged / link
            t[a]["compute"] += out_gemm.total_us
    return {"format": dict(_FORMATS[fmt]), "rows": rows,
            "total": {"managed_layers": len(euclid), "unmanaged_params": unmanaged, "output_gemm_us": out_gemm.total_us,
                      "compute_us": totals["fp32"]["compute"], **_row(totals, x.exposed_fraction)},
            "total_launch_bound": _row(wall, x.exposed_fraction)}


def cpu_projection_vs_gpu(codec: CodecPricer, copy_bw: float, x: StepModelInputs, rank: int,
                          results: Path = RESULTS) -> list[dict[str, object]]:
    """The codec of an 8B w2 layer as `bench.step_model.cpu` prices it (its own bytes per element,
    counted on the CPU at 600M w2 on 64 ranks, over HBM x kernel efficiency, plus the map's FLOPs
    at the fp32 rate) against the GPU's own bytes at the measured copy bandwidth and the measured
    device time. The projection's fp8 arm is E5M2 per tensor; the GPU measured E4M3 per row."""
    measured = json.loads(results.read_text())["step_model"]["codec_measured"]
    rows, cols = 4096, 14336
    hbm = x.hbm_tbytes * 1e12 * x.kernel_efficiency
    out = []
    for (kind, fmt), path in PATHS.items():
        cpu_fmt = "fp8_e5m2" if fmt == "fp8_e4m3" else fmt
        cpu = next((m for m in measured if (m["format"], m["kind"], m["rows"], m["cols"]) == (cpu_fmt, kind, 1280, 3456)),
                   None)
        if cpu is None:
            raise KeyError(f"results.json step_model.codec_measured has no {cpu_fmt} {kind} [1280, 3456] row")
        flops = transform_flops(kind, rows, cols, rank)
        body = next(b for b in codec.family(path, rows, cols) if (b.rows, b.cols) == (rows, cols))
        out.append({"path": path, "rows": rows, "cols": cols, "cpu_format": f"{cpu['format']}/{cpu['scaling']}",
                    "cpu_bytes_per_element": cpu["bytes_per_element"],
                    "projection_us": (cpu["bytes_per_element"] * rows * cols / hbm
                                      + flops / (x.fp32_tflops * 1e12 * x.fp32_efficiency)) * 1e6,
                    "gpu_bytes_per_element": body.bytes_per_element,
                    "gpu_bytes_at_copy_us": body.bytes_per_element * rows * cols / copy_bw * 1e6,
                    "measured_device_us": body.device_us, "measured_wall_us": body.wall_us})
    return out


def run(x: StepModelInputs = INPUTS) -> dict[str, object]:
    """The whole result: per format the per-shape and whole-model rows, the calibrated inputs
    (named, with their files) and the assumed ones, and the comparison with the CPU projection."""
    codec_json = json.loads(CODEC_FILE.read_text())
    rank = int(codec_json["rank"])
    bodies, gemms = load_bodies(), load_gemms()
    codec, gemm = CodecPricer(bodies), GemmPricer(gemms)
    copy_bw = copy_bandwidth()
    rel = lambda p: str(p.relative_to(paths.ROOT))  # noqa: E731
    fits = []
    for path in sorted({b.path for b in bodies}):
        for (r, c) in sorted({(b.rows, b.cols) for b in bodies if b.path == path}):
            p = codec.price(path, r, c)
            fits.append({"path": path, "rows": r, "cols": c, "device_us": p.device_us, "wall_us": p.wall_us,
                         "fixed_us": p.fixed_us, "ps_per_element": p.ps_per_element, "host_floor_us": p.host_floor_us,
                         "launch_us_per_kernel": codec.launch_cost_us(path, r, c)})
    return {
        "command": COMMAND, "model": MODEL, "goal": GOAL,
        "device": {k: codec_json["sections"]["device"]["result"][k] for k in ("name", "torch", "triton", "cuda")},
        "sources": {"codec": rel(CODEC_FILE), "gemm": rel(GEMM_FILE), "gemm_repeat": rel(GEMM_REPEAT_FILE),
                    "cpu_projection": rel(RESULTS)},
        "calibrated": {"copy_bytes_per_s": copy_bw, "codec_rank": rank, "codec_bodies": fits,
                       "gemm_tflops": {g.shape: dict(zip(("dW", "dX"), gemm.rate_tflops(g))) for g in gemms},
                       "gemm_repeat_spread": repeat_spread()},
        "assumed": {k: {"value": getattr(x, k), "why": v} for k, v in ASSUMED.items()},
        "formats": {f: price_format(f, codec, gemm, x, rank) for f in ARMS},
        "cpu_projection_vs_gpu": cpu_projection_vs_gpu(codec, copy_bw, x, rank)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    a.out.write_text(json.dumps(run(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _ms(us: float, digits: int = 2) -> str:
    return f"{us / 1e3:.{digits}f}"


def _f(x: float | None) -> str:
    return "never" if x is None or x > 1 else f"{x:.2f}"


def block(_: dict | None = None, path: Path = OUT) -> str:
    """The docs/benchmarks.md block: per format and layer shape, step time fp32 / Euclidean / GIFT,
    the savings and GIFT's share of Euclidean's, from `bench/results/step_model/gpu_step_model.json`."""
    d = json.loads(path.read_text())
    dev, cal, asm = d["device"], d["calibrated"], d["assumed"]
    goal = d["goal"]
    head = ["format", "layer [rows, cols]", "layers", "fp32 ms", "Euclidean ms", "GIFT ms", "Euclidean saves ms",
            "GIFT saves ms", "GIFT / Euclidean", "exposed share for the goal", "GIFT pays above"]
    lines, pays, short, extra = [], [], [], []
    for fmt, v in d["formats"].items():
        for r in v["rows"]:
            s, sv = r["step_us"], r["saves_us"]
            cells = [fmt, f"{', '.join(r['layers'])} [{r['rows']}, {r['cols']}]", str(r["count"]), _ms(s["fp32"]),
                     _ms(s["euclid"]), _ms(s["gift"]), _ms(sv["euclid"]), _ms(sv["gift"]),
                     "n/a" if r["share"] is None else f"{r['share']:.3f}", _f(r["exposed_share_for_goal"]),
                     _f(r["exposed_share_gift_pays"])]
            lines.append("| " + " | ".join(cells) + " |")
            (pays if r["share"] is not None and r["share"] >= goal else short).append(
                f"{fmt} {'/'.join(r['layers'])} ({r['share']:.2f}, goal from f = {_f(r['exposed_share_for_goal'])})")
        t = v["total"]
        s, sv = t["step_us"], t["saves_us"]
        lines.append("| " + " | ".join([
            f"**{fmt}**", f"**every layer** (+ {t['unmanaged_params'] / 1e9:.2f} B unmanaged params at fp32)",
            str(t["managed_layers"]), _ms(s["fp32"], 0), f"{_ms(s['euclid'], 0)} ({signed_pct(s['euclid'] / s['fp32'] - 1)})",
            f"{_ms(s['gift'], 0)} ({signed_pct(s['gift'] / s['fp32'] - 1)})", _ms(sv["euclid"], 0), _ms(sv["gift"], 0),
            f"**{t['share']:.3f}**", _f(t["exposed_share_for_goal"]), _f(t["exposed_share_gift_pays"])]) + " |")
        extra.append(f"{fmt}: GIFT adds {_ms(s['gift'] - s['euclid'], 0)} ms of GPU time per step over Euclidean "
                     f"({(s['gift'] - s['euclid']) / t['compute_us']:.0%} of the priced GEMMs, {_ms(t['compute_us'], 0)} ms); "
                     f"with the launch-bound codec GIFT's share is {v['total_launch_bound']['share']:.3f}")
    fits = cal["codec_bodies"]

    def span(path_prefix: str, key: str, digits: int = 1) -> str:
        xs = [b[key] for b in fits if b["path"] == path_prefix]
        return f"{min(xs):.{digits}f}-{max(xs):.{digits}f}"

    per_el = ", ".join(f"{p} {span(p, 'ps_per_element')} ps/element + {span(p, 'fixed_us', 0)} µs per call"
                       for p in ("euclid-fp8", "gift-fp8", "euclid-nvfp4", "gift-nvfp4"))
    rates = [x for g in cal["gemm_tflops"].values() for x in g.values()]
    comp = "; ".join(f"{c['path']} projected {c['projection_us']:.0f} µs ({c['cpu_bytes_per_element']:.1f} B/el, "
                     f"{c['cpu_format']}), the GPU's own {c['gpu_bytes_per_element']:.1f} B/el at copy bandwidth "
                     f"{c['gpu_bytes_at_copy_us']:.0f} µs, measured {c['measured_device_us']:.0f} µs"
                     for c in d["cpu_projection_vs_gpu"])
    assumed = "; ".join(f"{k} = {v['value']} ({v['why']})" for k, v in asm.items())  # sorted by name
    return "\n".join([
        f"* **Step time priced from the GPU measurement** ({d['model']}, {asm['gpus']['value']} GPUs, one data-parallel "
        f"all-reduce per gradient, {asm['tokens_per_gpu']['value']} tokens per GPU; `{d['command']}` -> "
        "[bench/results/step_model/gpu_step_model.json](../bench/results/step_model/gpu_step_model.json), rules in `bench/step_model/pricing.py`). "
        f"**Calibrated** on one {dev['name']} (torch {dev['torch']}, Triton {dev['triton']}; "
        "[bench/results/gpu/gpu_h200/PROVENANCE.md](../bench/results/gpu/gpu_h200/PROVENANCE.md)): each layer's codec from the "
        f"measured device time of its path's compiled all-reduce body (rank {cal['codec_rank']}), a line through the "
        f"600M and 8B sizes of its orientation: {per_el}; the bf16 forward + backward GEMMs at the measured "
        f"{min(rates):.0f}-{max(rates):.0f} TFLOP/s (a repeat run within {cal['gemm_repeat_spread']:.1%}). "
        f"**Taken from the code**: which layers are managed and the bytes each rank sends (`GiftState`, "
        "`bucket_wire_bytes`), GIFT's statistics and refresh FLOPs. "
        f"**Assumed**: {assumed}; the codec's time does not depend on the world size (the measured body is the "
        "one-rank all-reduce; at 64 ranks its re-encode covers 1/64 of the gradient, so this overstates both arms a "
        "little); the host runs ahead of the GPU, so a codec costs its kernels' device time (the launch-bound wall "
        "time, the host floor measured at the 600M shapes, is the sensitivity below). Not priced: attention's score/value GEMMs, norms, activations, optimizer (the same "
        "in every arm). Per layer shape, ms per layer per step; the last row of a format is the whole step. "
        f"The goal: GIFT saves at least {goal:.0%} of what Euclidean saves. \"Exposed share for the goal\" / "
        "\"GIFT pays above\": the exposed share of the communication (f, 1 in the table) from which GIFT reaches the "
        "goal / saves anything (`never`: not at f <= 1).",
        "",
        "  " + "| " + " | ".join(head) + " |",
        "  |" + "|".join("---" for _ in head) + "|",
        *("  " + x for x in lines),
        "",
        f"  With all of it exposed, GIFT reaches the goal on: {', '.join(pays) or 'no shape'}; it falls short on: "
        f"{', '.join(short) or 'no shape'}. {'; '.join(extra)}. Since GIFT sends the same bytes as Euclidean, its "
        "share falls as less of the communication is exposed: overlapped with the backward (f = 0) both only add "
        "their codec. How this differs from the CPU-bytes projection above (an 8B w2 layer's codec; the projection "
        "prices its CPU-counted bytes at 4 TB/s x 0.7 plus the map's FLOPs at the fp32 rate): " + comp + ".",
    ])
