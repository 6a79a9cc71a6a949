"""Timing and generated-kernel accounting for `bench.gpu.check`: the wall-clock budget, CUDA-event
(or host-clock) timers, the profiler's per-kernel times and the bytes Inductor's Triton kernels
declare. Kept apart from the sections so each section reads as what it measures."""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["Budget", "fp8_types", "kernel_times", "median_time", "timer", "triton_kernel_bytes"]


class Budget:
    """Wall-clock budget of the whole check: sections skip work that would overrun it."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """Seconds per call of `fn` over `n` calls: CUDA events on a GPU, the host clock on a CPU."""
    def cuda(fn: Callable[[], object], n: int) -> float:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop) / 1e3 / n

    def host(fn: Callable[[], object], n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    return cuda if device.type == "cuda" else host


def median_time(fn: Callable[[], object], device: torch.device, repeats: int = 7, target_s: float = 0.05) -> float:
    """Median seconds per call over `repeats` samples of ~`target_s` each, after a warm-up."""
    per_call = timer(device)
    one = max(per_call(fn, 3), 1e-7)
    n = max(1, min(2000, int(target_s / one)))
    return statistics.median(per_call(fn, n) for _ in range(repeats))


def fp8_types(codes: list[str]) -> list[str]:
    """float8 types named in generated source: Triton's `tl.float8*`, C++'s `at::Float8_*`."""
    return sorted({m for c in codes for m in re.findall(r"tl\.float8\w+|at::Float8_\w+", c)})


def triton_kernel_bytes(codes: list[str]) -> dict[str, float]:
    """Bytes each generated Triton kernel moves, by kernel name, from the `kernel_num_gb`
    Inductor writes into a kernel's metadata when compiled with `benchmark_kernel` (its own
    count of the buffers the kernel reads and writes). C++ kernels carry no such figure."""
    out = {}
    for code in codes:
        for m in re.finditer(r"'kernel_name': '(triton_\w+)'[^\n]*?'kernel_num_gb': ([0-9.e+-]+)", code):
            out[m.group(1)] = float(m.group(2)) * 1e9
    return out


def kernel_times(fn: Callable[[], object], device: torch.device, calls: int = 10) -> dict[str, float]:
    """Seconds per call of each generated kernel (Triton kernels on a GPU, Inductor's C++
    kernels on a CPU, which it labels for the profiler under `cpp.enable_kernel_profile`) and
    of extern kernels, from the profiler's device (GPU) or host (CPU) times over `calls` calls."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with torch.no_grad():
        fn()
        with profile(activities=activities) as prof:
            for _ in range(calls):
                fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    times: dict[str, float] = {}
    for ev in prof.key_averages():
        name = ev.key
        if device.type == "cuda":
            total = ev.device_time_total
        elif "cpp_fused" in name or name.startswith("aten::mm"):  # C++ kernels: `graph_<n>_cpp_fused_...`
            total = ev.cpu_time_total
        else:
            continue
        if total > 0:
            times[name] = total / 1e6 / calls
    return times
