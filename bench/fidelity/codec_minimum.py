"""The codec at the memory-traffic limit: the bytes per gradient element each collective body
NEEDS, computed from shapes and formats, next to what Inductor's generated kernels move.

`minimum_bytes` derives, term by term, the traffic of one managed `[rows, cols]` fp32 gradient
through GIFT's bucket body (`gift_compile.exchange.bucket.bucket_core`) on a `world`-rank plan, for a
reduce-scatter and an all-reduce, with the Euclidean (`identity`), low-rank and dense maps and
any quantized format. `measure` compiles the same body on a fake `world`-rank process group
(`bench.fidelity.overhead.codec_traffic`'s way: collectives are no-ops, the codec is what it would be),
reads each kernel's bytes from the generated code (`bench.fidelity.overhead.generated_traffic`), times
the bodies round-robin (paired CPU time ratios against the Euclidean body of the same op and
format) and reports generated / minimum.

`python -m bench.fidelity.codec_minimum --out FILE.json` writes one run (the committed
`bench/results/fidelity/codec_before.json` is this command on the code before the codec work);
`bench.run`'s overhead section embeds the same measurement (`results["overhead"]["minimum"]`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from bench.fidelity.overhead import codec_body, fake_group, generated_traffic, traffic_summary
from bench.lib.settings import CodecMinimumSettings
from gift_compile.codec import FormatSpec, wire_bytes_for
from gift_compile.exchange.accounting import HEADER_BYTES
from gift_compile.geometry.table import Dense, Geometry, LowRank

Log = Callable[[str], None]
FP32 = 4
OPS = CodecMinimumSettings.ops


def scale_sweeps(spec: FormatSpec) -> int:
    """Full sweeps over the values to encode that the scales force.

    Row and block scales are reductions inside one row, which a kernel computes and consumes
    in the same pass (Inductor fuses a row reduction with its pointwise consumer): one sweep.
    A tensor-wide scale (the two-level formats' fp32 scale, fp8 `tensor` scaling) needs the
    whole tensor's statistic before the first code, so the values are read twice.
    """
    if spec.passthrough:
        raise ValueError(f"minimum_bytes: format {spec.name!r} is sent raw, it has no codec to measure")
    return 2 if spec.has_tensor_scale or spec.single_scale else 1


@dataclass(frozen=True)
class _MapTraffic:
    """What one map kind adds to a body's traffic (terms of `minimum_bytes`), kept in a table by
    kind so no code here compares map names (the geometry table owns them)."""

    floats: Callable[[int, int], tuple[int, int]]  # (cols, rank) -> fp32 values read by forward, inverse
    projection: Callable[[float, int], float] | None  # (one projection per element, sweeps) -> B/el
    inverse: Callable[[float, float, float], float] | None  # (output share, wire B/el, projection) -> B/el


# `(D^-1/2, V, C, D^1/2)` and `(V, C', D^1/2)` for the low rank map, `T^T` and `T^-T` for the dense
# one (`gift_compile.geometry.maps`); the identity reads nothing and adds no term.
_MAP_TRAFFIC: dict[str, _MapTraffic] = {
    Geometry.kind: _MapTraffic(lambda cols, rank: (0, 0), None, None),
    LowRank.kind: _MapTraffic(lambda cols, rank: (2 * cols + cols * rank + rank, cols + cols * rank + rank),
                              lambda proj, sweeps: FP32 + proj * (1 + sweeps),
                              lambda share, w, proj: 2 * FP32 * share + min(FP32 * share, w) + 2 * proj * share),
    Dense.kind: _MapTraffic(lambda cols, rank: (cols * cols, cols * cols), lambda proj, sweeps: 2 * FP32,
                            lambda share, w, proj: 2 * FP32 * share),
}


def _map_traffic(kind: str) -> _MapTraffic:
    """The traffic model of map `kind` (raises naming the modelled kinds)."""
    if kind not in _MAP_TRAFFIC:
        raise ValueError(f"minimum_bytes: no traffic model for transform kind {kind!r}; modelled: {', '.join(_MAP_TRAFFIC)}")
    return _MAP_TRAFFIC[kind]


def minimum_bytes(op: str, fmt: str, scaling: str, kind: str, rows: int, cols: int, rank: int,
                  world: int) -> dict[str, float]:
    """Bytes per element of the local `[rows, cols]` gradient that the body of a `world`-rank
    `op` must move through memory, term by term (`"total"` is their sum).

    Model: every input is read and every output written once per sweep the math needs; a
    buffer handed to a collective is written once by its producer and read once by its
    consumer (the collective's own traffic is the network's, not the codec's); codes and
    scales count at their wire size (`wire_bytes_for`: payload at the format's bit width
    plus its scales) and the 16-byte header per destination counts both ways. With
    `n = rows * cols`, `w` the wire bytes per element, `P = world`, `S` = `scale_sweeps`:

    - `gradient`: 4 S, the fp32 gradient read by each sweep the scales force (4 for row or
      block scales: amax, scale and encode share one pass).
    - transform, send side. Low rank: `G D^-1/2 + (G U) C V^T` needs the projection `G U`
      of a whole row before the row's first value, and the projection is a matmul (an
      extern kernel, not fusable): one more gradient read (`projection`: 4), plus the
      `[rows, r]` projection written once and read by each sweep (`4 r / cols (1 + S)`).
      Dense: the matmul reads G (4) and writes `G T^T` (4), which each sweep reads (4 S)
      instead of G: `projection` 4 + 4.
    - `map`: the map's tensors, read once per direction (`_MAP_TRAFFIC`), over n.
    - `send`: the codes and scales written into the send buffer: `w` (rows padded to a
      multiple of P for an all-reduce); `headers`: 2 x 16 P / n.
    - `receive`: every sender's codes read once by the decode-and-sum: `w`.
    - reduce-scatter output: the fp32 shard written once (`output`: 4 / P). With a map the
      shard is decoded in transformed coordinates into an fp32 buffer the inverse's matmul
      reads (write + read, 8 / P); the low-rank expansion then needs the values once more,
      the cheaper of reading that buffer (4 / P) or decoding every sender's codes again
      (`w`), and its `[rows / P, r]` projection (write + read); the dense matmul writes the
      output.
    - all-reduce: the reduced shard is re-encoded. With row scales the decode, sum, amax
      and encode of a row share one pass (no fp32 shard in memory); a tensor-wide scale
      needs a second sweep: the cheaper of reading the received codes again (`w`) or
      writing the fp32 shard and reading it twice (`12 / P`) (`reduced shard`). Then the
      shard's codes are written for the all-gather (`gather send`: w / P), every shard
      read back (`gather receive`: w) and the fp32 result written (`output`: 4); a map's
      inverse costs as for the reduce-scatter, on the full tensor (`inverse`; there the
      expansion's second look at the values is the gathered codes, `w`, when cheaper than 4).
    """
    if op not in OPS:
        raise ValueError(f"minimum_bytes: op {op!r}; allowed: {', '.join(OPS)}")
    if op == "reduce_scatter" and rows % world:
        raise ValueError(f"minimum_bytes: a reduce-scatter needs rows ({rows}) divisible by the world size ({world})")
    spec = FormatSpec(fmt, scaling)
    sweeps = scale_sweeps(spec)
    n = rows * cols
    rows_sent = -(-rows // world) * world
    w = wire_bytes_for(spec, rows_sent, cols) / n
    proj = FP32 * rank / cols  # one [rows, r] fp32 projection, per element of [rows, cols]
    traffic = _map_traffic(kind)
    fwd_map, inv_map = traffic.floats(cols, rank)
    t: dict[str, float] = {"gradient": FP32 * sweeps}
    if traffic.projection is not None:
        t["projection"] = traffic.projection(proj, sweeps)
    t["map"] = FP32 * (fwd_map + inv_map) / n
    t["send"] = w
    t["headers"] = 2 * HEADER_BYTES * world / n
    t["receive"] = w
    # the fp32 tensor the inverse map starts from: the shard (reduce-scatter) or the whole result
    out_share = 1 / world if op == "reduce_scatter" else rows_sent / rows
    if op == "all_reduce":
        t["reduced shard"] = 0.0 if sweeps == 1 else min(w, 3 * FP32 / world)
        t["gather send"] = w / world
        t["gather receive"] = w
    if traffic.inverse is not None:
        t["inverse"] = traffic.inverse(out_share, w, proj)
    t["output"] = FP32 * (1 / world if op == "reduce_scatter" else 1.0)
    t["total"] = sum(t.values())
    return t


def _time_round_robin(fns: dict[str, Callable[[torch.Tensor], object]], g: torch.Tensor,
                      repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each function, `repeats` rounds, every function once per round (so
    load from other jobs hits a round's functions alike)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    with torch.no_grad():
        for fn in fns.values():
            fn(g)
        for _ in range(repeats):
            for key, fn in fns.items():
                t0 = time.perf_counter()
                fn(g)
                times[key].append(time.perf_counter() - t0)
    return times


def measure(s: CodecMinimumSettings, log: Log) -> dict[str, object]:
    """Per (op, format, map): the minimum (with its terms), the generated kernels' bytes per
    element and kernel count, generated / minimum, and the median CPU time with its paired
    ratio to the Euclidean body of the same op and format (per round, then the median)."""
    label, rows, cols = s.shape
    g = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1)) * 1e-3
    rows_out, kernels = [], {}
    with fake_group(s.world) as group, torch._dynamo.config.patch(recompile_limit=64, cache_size_limit=64):
        torch._dynamo.reset()
        for op in s.ops:
            for fmt, scaling in s.formats:
                fns = {}
                for kind in s.kinds:
                    start = time.perf_counter()
                    body = codec_body(fmt, scaling, kind, rows, cols, s.rank, world=s.world, group_name=group, op=op)
                    ks, fns[kind] = generated_traffic(body, g, reset=False)
                    key = f"{op} {fmt} {kind}"
                    kernels[key] = [{**asdict(k), "bytes_per_element": (k.reads + k.writes) / (rows * cols)}
                                    for k in ks if k.reads + k.writes > 0]
                    minimum = minimum_bytes(op, fmt, scaling, kind, rows, cols, s.rank, s.world)
                    summary = traffic_summary(ks, rows * cols)
                    rows_out.append({"op": op, "format": fmt, "scaling": scaling, "kind": kind, "shape": label,
                                     "rows": rows, "cols": cols, "world": s.world, "rank": s.rank,
                                     "minimum": minimum["total"], "minimum_terms": minimum, **summary,
                                     "vs_minimum": summary["bytes_per_element"] / minimum["total"]})
                    log(f"  {key}: {summary['bytes_per_element']:.2f} B/el in {summary['kernels']} kernels, minimum "
                        f"{minimum['total']:.2f} ({summary['bytes_per_element'] / minimum['total']:.2f}x; "
                        f"compiled in {time.perf_counter() - start:.0f} s)")
                times = _time_round_robin(fns, g, s.repeats)
                base = times.get(Geometry.kind)
                for r in rows_out[-len(s.kinds):]:
                    t = times[r["kind"]]
                    r["median_ms"] = statistics.median(t) * 1e3
                    r["vs_euclid_time"] = (statistics.median(a / b for a, b in zip(t, base)) if base else math.nan)
                log(f"  {op} {fmt} CPU ms: " + ", ".join(f"{k} {statistics.median(v) * 1e3:.1f}"
                                                         for k, v in times.items()))
        torch._dynamo.reset()
    return {"settings": asdict(s), "threads": torch.get_num_threads(), "loadavg": os.getloadavg()[0],
            "rows": rows_out, "kernels": kernels}


# Kernels the generated code keeps apart from the codec's fused loops, by kernel-name prefix:
# (short reason, why).
UNFUSED = {
    "aten.mm": ("extern matmul", "the rank-r projection and the dense map are extern matmuls: each reads its fp32 "
                "operand from memory, so the send side reads the gradient once more and the receive side writes "
                "the decoded values out for it"),
    "aten.cat": ("CPU uint8 cat", "Inductor lowers a cat whose inputs are all uint8 on the CPU to aten.cat "
                 "(`torch._inductor.lowering.cat`: inputs realised, then copied), so the codes are written once by "
                 "the encode kernel and copied once more into the send buffer; other devices take Inductor's "
                 "ConcatKernel, which writes an input in place only when it is a computed buffer of the cat's layout "
                 "(the codes are a reshape of one: not measured here, no GPU)"),
    "aten.view.dtype": ("extern dtype view", "a size-changing dtype view is an extern kernel over a realised input"),
}


def realisation_limits() -> dict[str, int]:
    """Inductor's limits past which a pointwise expression is written to memory instead of
    inlined into its consumers (`ir.StorageBox.has_exceeded_max_reads` / `has_large_inner_fn`),
    on the CPU and on other devices, as the installed torch sets them. The low-rank map's
    expansion reads 2r + 3 operands per element, over both at r = 32."""
    import torch._inductor.config as inductor

    return {"cpu_reads": inductor.realize_cpu_acc_reads_threshold,
            "gpu_reads": inductor._realize_acc_reads_threshold_default,
            "cpu_ops": inductor.realize_cpu_opcount_threshold, "gpu_ops": inductor._realize_opcount_threshold_default}


def unfused(kernels: list[dict], threshold: float = 0.05) -> list[dict[str, object]]:
    """The kernels of one body that `UNFUSED` explains, moving at least `threshold` B/element:
    name, bytes per element and the short reason (a key of `UNFUSED`'s values)."""
    return [{"name": k["name"], "bytes_per_element": k["bytes_per_element"], "why": short}
            for k in kernels if k["bytes_per_element"] >= threshold and not k["collective"]
            for prefix, (short, _) in UNFUSED.items() if k["name"].startswith(prefix)]


def run(s: CodecMinimumSettings, before: Path | None, log: Log) -> dict[str, object]:
    """`measure`, with the matching rows of an earlier run's JSON (`before`, e.g. the committed
    `bench/results/fidelity/codec_before.json` of the code before the codec work) beside each row."""
    result = measure(s, log)
    if before is not None and before.exists():
        old = json.loads(before.read_text())
        rows = compare(old, result)
        if all(r["before_bytes_per_element"] is not None for r in rows):  # the same bodies were measured
            result["before"] = {"file": before.name, "command": old["command"], "loadavg": old["loadavg"]}
            result["rows"] = rows
        else:
            log(f"  {before.name} measured other bodies (shape, world, formats): no before columns")
    return result


def compare(before: dict, after: dict) -> list[dict[str, object]]:
    """Rows of `after` with the generated bytes, kernel count and time ratio of the matching
    row of `before` (same op, format, map, shape and world) next to them."""
    key = lambda r: (r["op"], r["format"], r["kind"], r["shape"], r["world"])  # noqa: E731
    old = {key(r): r for r in before["rows"]}
    out = []
    for r in after["rows"]:
        b = old.get(key(r))
        out.append({**r, "before_bytes_per_element": b["bytes_per_element"] if b else None,
                    "before_kernels": b["kernels"] if b else None,
                    "before_vs_minimum": b["vs_minimum"] if b else None,
                    "before_vs_euclid_time": b.get("vs_euclid_time") if b else None})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fidelity.codec_minimum", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--world", type=int, default=CodecMinimumSettings.world)
    p.add_argument("--repeats", type=int, default=CodecMinimumSettings.repeats)
    p.add_argument("--formats", default=",".join(f for f, _ in CodecMinimumSettings.formats),
                   help="comma-separated quantized formats (row scaling where the format has a choice)")
    a = p.parse_args(argv)
    s = replace(CodecMinimumSettings(), world=a.world, repeats=a.repeats,
                formats=tuple((f, "row") for f in a.formats.split(",")))
    result = measure(s, lambda m: print(m, flush=True))
    result["command"] = "python -m bench.fidelity.codec_minimum " + " ".join(sys.argv[1:] if argv is None else argv)
    a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
