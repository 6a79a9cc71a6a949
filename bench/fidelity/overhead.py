"""Overhead: what the GIFT codec costs in memory traffic and kernel time, next to the Euclidean one.

Each path is the body of the collective (`gift_compile.exchange.collectives.bucket_core`: transform,
local scales, encode, decode every sender, fp32 sum, re-encode and gather for an all-reduce,
inverse), compiled with `torch.compile(fullgraph=True, dynamic=False)` so Inductor fuses it as
it would inside a training step.

Bytes are *measured from the generated code*: `generated_traffic` compiles the body and
records, for every kernel Inductor scheduled (fused kernels and extern calls such as the
projection matmul), the bytes it reads and writes, using Inductor's own per-kernel count
(`BaseSchedulerNode.get_read_buffer_sizes` / `get_write_buffer_sizes`: each buffer a kernel
touches counted once, at the size it touches). The same count applies to the C++ kernels
compiled here and to the Triton kernels of a GPU (`bench.gpu.check`). Collective kernels are
listed apart: their traffic is the network's, which `bench.step_model.cpu` models as link time.

Kernel times are CPU times (this machine has no GPU). The paths are timed round-robin in one
process, so load from other jobs hits them alike; the ratios are paired (per round, a path's
time over the Euclidean time of the same round), which cancels most of that noise.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Callable
from unittest import mock

import torch
import torch.distributed as dist
from torch._inductor import compile_fx
from torch._inductor.graph import GraphLowering
from torch._inductor.utils import aggregate_origins

from bench.lib.settings import OverheadSettings
from gift_compile.exchange.collectives import ItemTensors, Shared, bucket_core
from gift_compile.exchange.plan import BucketPlan, ItemPlan
from gift_compile.geometry import Transform, dense_whitening, lowrank_refresh_flops, lowrank_whitening
from gift_compile.runtime.selection import transform_flops

Log = Callable[[str], None]

# path -> (wire format, transform kind); "bf16" is a plain cast to bf16 and back.
PATHS: dict[str, tuple[str, str]] = {
    "bf16": ("bf16", "identity"),
    "euclid-fp8": ("fp8_e4m3", "identity"),
    "gift-fp8": ("fp8_e4m3", "lowrank"),
    "hadamard-fp8": ("fp8_e4m3", "hadamard"),
    "dense-fp8": ("fp8_e4m3", "dense"),
    "euclid-nvfp4": ("nvfp4", "identity"),
    "gift-nvfp4": ("nvfp4", "lowrank"),
}
# the Euclidean path each transformed path is compared with (same wire format)
BASELINE = {"gift-fp8": "euclid-fp8", "hadamard-fp8": "euclid-fp8", "dense-fp8": "euclid-fp8",
            "gift-nvfp4": "euclid-nvfp4"}


@dataclass(frozen=True)
class KernelTraffic:
    """Bytes one scheduled kernel reads and writes (Inductor's count); `collective` marks the
    communication kernels (`_c10d_functional` ops), whose traffic is not the codec's."""

    name: str
    reads: int
    writes: int
    collective: bool


# aten ops that say what a fused kernel does, in the order its label lists them
_TELLING_OPS = ("amax", "all", "sum", "mm", "cat", "clone", "_to_copy", "mul", "add", "sub", "where")


def _describe(node: object) -> tuple[str, bool]:
    """A short name for a scheduler node and whether it is a collective."""
    ir_node = getattr(node, "node", None)
    op = getattr(ir_node, "op_overload", None)
    if isinstance(op, torch._ops.OpOverload):
        return str(op), op.namespace == "_c10d_functional"
    kernel = getattr(ir_node, "python_kernel_name", None)
    if kernel:
        return str(kernel), False
    ops = set()
    for origin in aggregate_origins(node.get_nodes()):  # type: ignore[attr-defined]
        aten = origin.meta.get("original_aten")
        if isinstance(aten, torch._ops.OpOverload):
            ops.add(aten._overloadpacket.__name__)
    telling = [o for o in _TELLING_OPS if o in ops] or sorted(ops)[:3]
    rest = len(ops) - len(telling)
    return f"fused[{','.join(telling)}{f',+{rest}' if rest else ''}]", False


def generated_traffic(fn: Callable[..., object], *args: torch.Tensor,
                      reset: bool = True) -> tuple[list[KernelTraffic], Callable[..., object]]:
    """Compile `fn(*args)` with Inductor (fullgraph, static shapes); return the bytes each
    generated kernel reads and writes, and the compiled function (valid until the next call
    of this function, which resets dynamo; call it under `torch.no_grad()` like the first call).
    `reset=False` keeps dynamo's caches, so compiled functions of earlier calls stay valid (a
    caller comparing several bodies side by side; each new `fn` still compiles, as a new
    function or a new guard set).

    Inductor computes these counts from its scheduler nodes only when its metrics log is on,
    and only while compiling: so the FX-graph cache is bypassed, dynamo's caches are reset
    first (every earlier compiled function recompiles on its next call), and the metrics
    logger is switched on for the duration (its records go nowhere unless the user routed
    that logger somewhere with TORCH_LOGS).
    """
    records: list[KernelTraffic] = []
    original = GraphLowering.count_bytes

    def counting(self: GraphLowering) -> object:
        result = original(self)
        for node in self.scheduler.nodes:
            name, collective = _describe(node)
            records.append(KernelTraffic(name, int(node.get_read_buffer_sizes()), int(node.get_write_buffer_sizes()),
                                         collective))
        return result

    log = compile_fx.inductor_metrics_log
    level = log.level
    if reset:
        torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    try:
        log.setLevel(logging.INFO)
        with mock.patch.object(GraphLowering, "count_bytes", counting), \
                torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
            compiled(*args)
    finally:
        log.setLevel(level)
    if not records:
        raise RuntimeError("generated_traffic: Inductor compiled no graph (was the function traced at all?)")
    return records, compiled


def traffic_summary(kernels: list[KernelTraffic], numel: int) -> dict[str, object]:
    """Per-gradient-element figures of a kernel list: codec bytes (reads + writes of every
    non-collective kernel), their split, the collectives' own buffer traffic, kernel count."""
    codec = [k for k in kernels if not k.collective]
    reads, writes = sum(k.reads for k in codec), sum(k.writes for k in codec)
    return {
        "bytes_per_element": (reads + writes) / numel,
        "reads_per_element": reads / numel,
        "writes_per_element": writes / numel,
        "collective_bytes_per_element": sum(k.reads + k.writes for k in kernels if k.collective) / numel,
        "kernels": len([k for k in codec if k.reads + k.writes > 0]),
    }


@contextlib.contextmanager
def fake_group(world: int) -> Iterator[str | None]:
    """A `world`-rank process group on torch's fake backend (collectives are no-ops), so the
    codec of a `world`-rank plan compiles in one process; yields its name (None for 1 rank)."""
    if world == 1:
        yield None
        return
    if dist.is_initialized():
        raise RuntimeError("fake_group: a process group already exists in this process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def codec_body(fmt: str, scaling: str, kind: str, rows: int, cols: int, rank: int, *, world: int = 1,
               group_name: str | None = None, op: str = "all_reduce", factor: bool = True,
               device: torch.device | str = "cpu") -> Callable[[torch.Tensor], torch.Tensor]:
    """`bucket_core` of one managed `[rows, cols]` fp32 gradient under a `world`-rank plan.

    `factor` builds adaptive transforms from a synthetic factor (realistic values for timing;
    the refresh runs on the CPU and is seeded, so every device gets the same tensors); traffic
    does not depend on the values, so byte counts skip that refresh.
    """
    transform = Transform(kind, cols, rank, seed=0)
    if transform.adaptive and factor:
        transform.refresh_from(_synthetic_factor(cols), 1e-3)
    item = ItemPlan(name="g", rows=rows, cols=cols, format=fmt, scaling=scaling, block_size=32, kind=kind,
                    n_tensors=len(transform.tensors))
    plan = BucketPlan((item,), world, group_name, False, op)
    tensors = tuple(t.to(device) for t in transform.tensors)

    def body(g: torch.Tensor) -> torch.Tensor:
        return bucket_core([g], [ItemTensors(tensors)], Shared(), plan)[0][0]

    return body


def _cast(g: torch.Tensor) -> torch.Tensor:
    return g.to(torch.bfloat16).to(torch.float32)


def path_body(path: str, rows: int, cols: int, rank: int, **kwargs: object) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function a path times: the bf16 cast, or the codec of `PATHS[path]` (row scaling);
    `kwargs` go to `codec_body`."""
    fmt, kind = PATHS[path]
    if fmt == "bf16":
        return _cast
    return codec_body(fmt, "row", kind, rows, cols, rank, **kwargs)  # type: ignore[arg-type]


def codec_traffic(fmt: str, scaling: str, kind: str, rows: int, cols: int, rank: int, world: int,
                  op: str) -> dict[str, object]:
    """Measured traffic per gradient element of the codec of one `[rows, cols]` gradient on a
    `world`-rank `op` plan (a fake process group stands in for the peers)."""
    g = torch.zeros(rows, cols)
    with fake_group(world) as name:
        body = codec_body(fmt, scaling, kind, rows, cols, rank, world=world, group_name=name, op=op, factor=False)
        kernels, _ = generated_traffic(body, g)
    return traffic_summary(kernels, rows * cols)


def path_flops(path: str, rows: int, cols: int, rank: int) -> float:
    """Transform FLOPs (forward plus inverse) of `path` on a `[rows, cols]` gradient."""
    _, kind = PATHS[path]
    return transform_flops(kind, rows, cols, rank)


def _synthetic_factor(d: int, seed: int = 0) -> torch.Tensor:
    """An anisotropic SPD factor (power-law spectrum) to build timing transforms from.

    Kernel time does not depend on the factor's values, only on its shape.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * d, d, generator=gen) * torch.arange(1, d + 1).float().pow(-0.75)
    return x.t() @ x / x.shape[0]


def measure_traffic(s: OverheadSettings, log: Log) -> dict[str, object]:
    """Bytes per element of every path at every shape on one rank (the timed bodies), and of
    the Euclidean / GIFT fp8 codecs at `s.scale_world` ranks (all-reduce and reduce-scatter;
    skipped for `scale_world=1`) for the first shape, with the kernel list of each path at the
    first shape."""
    rows_out, detail = [], {}
    for label, rows, cols in s.shapes:
        for path in s.paths:
            kernels, _ = generated_traffic(path_body(path, rows, cols, s.rank, factor=False), torch.zeros(rows, cols))
            rows_out.append({"shape": label, "rows": rows, "cols": cols, "path": path, "world": 1, "op": "all_reduce",
                             **traffic_summary(kernels, rows * cols)})
            if label == s.shapes[0][0]:
                detail[path] = [{**asdict(k), "bytes_per_element": (k.reads + k.writes) / (rows * cols)}
                                for k in kernels if k.reads + k.writes > 0]
        log(f"  traffic {label}: " + ", ".join(f"{r['path']} {r['bytes_per_element']:.1f} B/el"
                                               for r in rows_out if r["shape"] == label))
    label, rows, cols = s.shapes[0]
    for path in [p for p in s.paths if p in ("euclid-fp8", "gift-fp8") and s.scale_world > 1]:
        fmt, kind = PATHS[path]
        for op in ("all_reduce", "reduce_scatter"):
            t = codec_traffic(fmt, "row", kind, rows, cols, s.rank, s.scale_world, op)
            rows_out.append({"shape": label, "rows": rows, "cols": cols, "path": path, "world": s.scale_world,
                             "op": op, **t})
            log(f"  traffic {label} {path} {op} on {s.scale_world} ranks: {t['bytes_per_element']:.1f} B/el")
    return {"rows": rows_out, "kernels": detail, "detail_shape": s.shapes[0][0]}


def run(s: OverheadSettings, log: Log) -> dict[str, object]:
    """Measured traffic, median kernel times and paired time ratios per (shape, path), and
    the refresh times."""
    traffic = measure_traffic(s, log)
    mode = "compiled" if s.compile else "eager"
    load = os.getloadavg()[0]
    rows_out = []
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64, cache_size_limit=64):
        for label, rows, cols in s.shapes:
            g = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1)) * 1e-3
            fns = {}
            for path in s.paths:
                start = time.perf_counter()
                body = path_body(path, rows, cols, s.rank)
                fns[path] = torch.compile(body, dynamic=False) if s.compile else body
                with torch.no_grad():
                    fns[path](g)  # compiles when compiled; warms caches either way
                    fns[path](g)
                log(f"  {label} {path}: ready in {time.perf_counter() - start:.1f} s")
            inner = {p: _calls_per_sample(fn, g) for p, fn in fns.items()}
            times: dict[str, list[float]] = {p: [] for p in s.paths}
            with torch.no_grad():
                for _ in range(s.repeats):
                    for path, fn in fns.items():
                        t0 = time.perf_counter()
                        for _ in range(inner[path]):
                            fn(g)
                        times[path].append((time.perf_counter() - t0) / inner[path])
            med = {p: statistics.median(t) * 1e3 for p, t in times.items()}
            for path in s.paths:
                base = BASELINE.get(path)
                paired = ([a / b for a, b in zip(times[path], times[base])] if base in times else [float("nan")])
                measured = next(r for r in traffic["rows"] if r["shape"] == label and r["path"] == path
                                and r["world"] == 1)
                rows_out.append({
                    "shape": label, "rows": rows, "cols": cols, "path": path, "mode": mode,
                    "median_ms": med[path],
                    "min_ms": min(times[path]) * 1e3,
                    "iqr_ms": _iqr(times[path]) * 1e3,
                    "baseline": base,
                    "vs_baseline": statistics.median(paired),
                    "vs_baseline_iqr": _iqr(paired),
                    "vs_bf16": med[path] / med["bf16"] if "bf16" in med else float("nan"),
                    "transform_gflop": path_flops(path, rows, cols, s.rank) / 1e9,
                    "bytes_per_element": measured["bytes_per_element"],
                })
            log(f"  {label}: " + ", ".join(f"{p} {m:.2f} ms" for p, m in med.items()))
    return {"mode": mode, "repeats": s.repeats, "rank": s.rank, "threads": torch.get_num_threads(), "loadavg": load,
            "rows": rows_out, "traffic": traffic, "refresh": refresh_times(s.refresh_dims, s.rank, log)}


def refresh_times(dims: tuple[int, ...], rank: int, log: Log) -> list[dict[str, float]]:
    """Seconds of one geometry refresh per layer at input widths `dims`, as implemented.

    The low-rank map comes from the top-`rank` eigenpairs by fp64 subspace iteration
    (`gift_compile.geometry.top_eigenpairs`, FLOPs from `lowrank_refresh_flops`) and the
    dense map from a Cholesky factorisation plus a triangular inverse; both run eagerly at
    every refresh, on the layer's owner rank. Measured once each.
    """
    out = []
    for n in dims:
        a = _synthetic_factor(n)
        t0 = time.perf_counter()
        lowrank_whitening(a, rank, 1e-3)
        t1 = time.perf_counter()
        dense_whitening(a, 1e-3)
        t2 = time.perf_counter()
        out.append({"d_in": n, "lowrank_s": t1 - t0, "dense_s": t2 - t1,
                    "lowrank_gflops": lowrank_refresh_flops(n, rank) / (t1 - t0) / 1e9})
        log(f"  refresh at d_in={n}: low-rank {t1 - t0:.2f} s, dense (Cholesky) {t2 - t1:.2f} s")
    return out


def _calls_per_sample(fn: Callable[[torch.Tensor], torch.Tensor], g: torch.Tensor, target_s: float = 0.02) -> int:
    """Calls per timing sample so that one sample lasts about `target_s`.

    Sub-millisecond kernels timed one call at a time mostly measure scheduler noise on a
    shared 2-core machine; looping amortises it.
    """
    with torch.no_grad():
        t0 = time.perf_counter()
        fn(g)
        one = max(time.perf_counter() - t0, 1e-6)
    return max(1, min(1000, int(target_s / one)))


def _iqr(xs: list[float]) -> float:
    if any(x != x for x in xs):  # NaN: no paired baseline
        return float("nan")
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return q[2] - q[0]
