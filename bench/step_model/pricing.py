"""Prices read off the codec's first GPU measurement (one H200, `bench/results/gpu/gpu_h200/`,
PROVENANCE.md there): the codec body's time per path and layer shape, which the step model
(`bench.step_model.topology`) charges at its wall time.

Codec (`CodecPricer`). Measured: the compiled one-rank all-reduce body of each path
(`euclid-fp8`, `gift-fp8`, `euclid-nvfp4`, `gift-nvfp4`: fp8 E4M3 per row or NVFP4, identity or
low-rank r = 32 map) at two sizes per orientation, 600M (4.4 M elements) and 8B (58.7 M): w2-like
(rows <= cols: [1280, 3456], [4096, 14336]) and w1-like (rows > cols: [3456, 1280], [14336, 4096]).
Two times per body: the wall time per call (CUDA events over back-to-back calls) and the device
time (the sum of the profiler's per-kernel times). At 8B the two agree within 2-4% (the GPU is
the bottleneck); at 600M the wall time is 2-6x the device time (the host's launch of 6-23
kernels, ~20-50 µs per kernel, is the bottleneck). The rule for any shape:

- device time = the straight line in the element count through the two measured sizes of the
  same path and orientation (a fixed cost per call plus a cost per element; exact at the measured
  shapes, interpolated between, extrapolated along the same line outside, flagged as such);
- launch-bound wall time = max(host floor, device time), the host floor being the wall time
  measured at the smaller, launch-bound shape (the host's cost does not grow with the shape):
  the codec's cost when the host cannot run ahead of the GPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from bench.lib.paths import RESULTS

GPU_DIR = RESULTS / "gpu" / "gpu_h200"
CODEC_FILE = GPU_DIR / "gpu_check_codec.json"
# (map kind, wire format) -> the path name the measured bodies carry
PATHS = {("identity", "fp8_e4m3"): "euclid-fp8", ("lowrank", "fp8_e4m3"): "gift-fp8",
         ("identity", "nvfp4"): "euclid-nvfp4", ("lowrank", "nvfp4"): "gift-nvfp4"}


def orientation(rows: int, cols: int) -> str:
    """Which measured family a shape is priced from: "w2-like" (rows <= cols) or "w1-like"."""
    return "w2-like" if rows <= cols else "w1-like"


@dataclass(frozen=True)
class Body:
    """One measured codec body."""

    shape: str
    path: str
    rows: int
    cols: int
    wall_us: float  # median wall time per call
    device_us: float  # sum of the profiler's per-kernel device times
    kernels: int
    bytes_per_element: float

    @property
    def elements(self) -> int:
        return self.rows * self.cols


def load_bodies(path: Path = CODEC_FILE) -> list[Body]:
    """The codec rows of a `bench.gpu.check` result that ran (`status` ok)."""
    d = json.loads(path.read_text())
    out = []
    for r in d["sections"]["codec"]["result"]:
        if r.get("status") != "ok":
            continue
        out.append(Body(r["shape"], r["path"], r["rows"], r["cols"], r["time_us"],
                        sum(k["us"] for k in r["per_kernel"]), r["kernels"], r["bytes_per_element"]))
    return out


@dataclass(frozen=True)
class CodecPrice:
    """What one codec call of one layer costs, and where the price came from."""

    path: str
    rows: int
    cols: int
    device_us: float
    wall_us: float  # launch-bound: max(host floor, device time)
    fixed_us: float  # the fit's cost per call
    ps_per_element: float  # the fit's cost per element
    host_floor_us: float
    basis: str  # the measured shapes, and whether interpolated / extrapolated / measured


class CodecPricer:
    """Codec time of a path at any shape, from the measured bodies (module docstring: the rule)."""

    def __init__(self, bodies: list[Body]) -> None:
        self.families: dict[tuple[str, str], list[Body]] = {}
        for b in bodies:
            self.families.setdefault((b.path, orientation(b.rows, b.cols)), []).append(b)
        for fam in self.families.values():
            fam.sort(key=lambda b: b.elements)

    def family(self, path: str, rows: int, cols: int) -> list[Body]:
        """The measured bodies a shape is priced from; raises naming the missing body."""
        key = (path, orientation(rows, cols))
        fam = self.families.get(key, [])
        if len({b.elements for b in fam}) < 2:
            have = sorted(f"{p} {o} ({len(v)} size(s))" for (p, o), v in self.families.items())
            raise KeyError(f"no two measured H200 codec bodies of path {path!r} at {key[1]} shapes "
                           f"(to price [{rows}, {cols}]); measured: {', '.join(have) or 'none'}")
        return fam

    def price(self, path: str, rows: int, cols: int) -> CodecPrice:
        fam = self.family(path, rows, cols)
        n = rows * cols
        # the two measured sizes that bracket n, else the nearest two
        lo = max((b for b in fam if b.elements <= n), key=lambda b: b.elements, default=fam[0])
        hi = min((b for b in fam if b.elements >= n and b.elements != lo.elements), key=lambda b: b.elements,
                 default=None)
        if hi is None:  # beyond the largest: the last two
            lo, hi = fam[-2], fam[-1]
        slope = (hi.device_us - lo.device_us) / (hi.elements - lo.elements)
        fixed = lo.device_us - slope * lo.elements
        device = fixed + slope * n
        floor = fam[0].wall_us  # the smallest measured size: launch-bound
        if n in (lo.elements, hi.elements):
            how = "measured"
        elif lo.elements < n < hi.elements:
            how = "interpolated"
        else:
            how = "extrapolated"
        basis = f"{how} from {lo.shape} [{lo.rows}, {lo.cols}] and {hi.shape} [{hi.rows}, {hi.cols}]"
        return CodecPrice(path, rows, cols, device, max(floor, device), fixed, slope * 1e6, floor, basis)
