"""Overhead: what the GIFT path costs in kernels, next to the Euclidean path and a bf16 cast.

Each path is the single-rank body of the collective (`gift_compile.collectives.bucket_core`
with no peers: transform, agree scales, encode, decode, sum, inverse), compiled with
`torch.compile(dynamic=False)` so Inductor fuses it as it would inside a training step. The
paths are timed round-robin within one process, so machine load hits them alike, and the
median over repeats is reported together with ratios from the same run. This machine has no
GPU: the times are CPU times. What transfers to a GPU is the accounting next to them (FLOPs
of the transform and bytes each path moves through memory), which `bench.step_model` uses.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch

from bench.settings import OverheadSettings
from gift_compile.collectives import ItemTensors, Shared, bucket_core
from gift_compile.plan import BucketPlan, ItemPlan
from gift_compile.geometry import Transform, dense_whitening, lowrank_refresh_flops, lowrank_whitening
from gift_compile.selection import transform_flops

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
_CODE_BYTES = {"bf16": 2.0, "fp8_e4m3": 1.0, "nvfp4": 0.5}


def bytes_per_element(path: str) -> float:
    """Memory traffic per gradient element of `path` in an ideally fused implementation.

    Sender: one pass reads fp32 `G` for the scale amax and one reads it again to write the
    codes; receiver: one pass reads the codes and writes fp32 (a bf16 cast needs no amax
    pass). Low-rank whitening adds one fp32 read of `G` for the projection `G D^{-1/2} V` on
    the sender and one extra read of the codes for the projection on the receiver; a dense
    whitening materialises the transformed fp32 matrix on both sides (write + read each);
    the Hadamard butterfly runs in registers inside the fused kernels (no extra traffic).
    """
    fmt, kind = PATHS[path]
    q = _CODE_BYTES[fmt]
    base = (4 + q + q + 4) if fmt == "bf16" else (4 + 4 + q + q + 4)
    extra = {"identity": 0.0, "hadamard": 0.0, "lowrank": 4 + q, "dense": 16.0}[kind]
    return base + extra


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


def _make(path: str, rows: int, cols: int, rank: int, compiled: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    fmt, kind = PATHS[path]
    if fmt == "bf16":
        def cast(g: torch.Tensor) -> torch.Tensor:
            return g.to(torch.bfloat16).to(torch.float32)
        return torch.compile(cast, dynamic=False) if compiled else cast
    transform = Transform(kind, cols, rank, seed=0)
    if transform.adaptive:
        transform.refresh_from(_synthetic_factor(cols), 1e-3)
    item = ItemPlan("g", rows, cols, "float32", True, fmt, "row", 32, kind, len(transform.tensors))
    plan = BucketPlan((item,), 1, None, False, "all_reduce")
    tensors = transform.tensors

    def body(g: torch.Tensor) -> torch.Tensor:
        return bucket_core([g], [ItemTensors(tensors)], Shared(), plan)[0][0]

    return torch.compile(body, dynamic=False) if compiled else body


def run(s: OverheadSettings, log: Log) -> dict[str, object]:
    """Median kernel times per (shape, path), ratios, and the FLOP/byte accounting."""
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
                fns[path] = _make(path, rows, cols, s.rank, s.compile)
                fns[path](g)  # compiles when compiled; warms caches either way
                fns[path](g)
                log(f"  {label} {path}: ready in {time.perf_counter() - start:.1f} s")
            inner = {p: _calls_per_sample(fn, g) for p, fn in fns.items()}
            times: dict[str, list[float]] = {p: [] for p in s.paths}
            for _ in range(s.repeats):
                for path, fn in fns.items():
                    t0 = time.perf_counter()
                    for _ in range(inner[path]):
                        fn(g)
                    times[path].append((time.perf_counter() - t0) / inner[path])
            med = {p: statistics.median(t) * 1e3 for p, t in times.items()}
            for path in s.paths:
                numel = rows * cols
                rows_out.append({
                    "shape": label, "rows": rows, "cols": cols, "path": path, "mode": mode,
                    "median_ms": med[path],
                    "min_ms": min(times[path]) * 1e3,
                    "iqr_ms": _iqr(times[path]) * 1e3,
                    "vs_euclid": med[path] / med["euclid-fp8"] if "euclid-fp8" in med else float("nan"),
                    "vs_bf16": med[path] / med["bf16"] if "bf16" in med else float("nan"),
                    "transform_gflop": path_flops(path, rows, cols, s.rank) / 1e9,
                    "mbytes_moved": bytes_per_element(path) * numel / 1e6,
                })
            log(f"  {label}: " + ", ".join(f"{p} {m:.2f} ms" for p, m in med.items()))
    return {"mode": mode, "repeats": s.repeats, "rank": s.rank, "threads": torch.get_num_threads(), "loadavg": load,
            "rows": rows_out, "bytes_per_element": {p: bytes_per_element(p) for p in s.paths},
            "refresh": refresh_times(s.refresh_dims, s.rank, log)}


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
    t0 = time.perf_counter()
    fn(g)
    one = max(time.perf_counter() - t0, 1e-6)
    return max(1, min(1000, int(target_s / one)))


def _iqr(xs: list[float]) -> float:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return q[2] - q[0]
