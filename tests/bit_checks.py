"""What the kernel tests compare and feed (test-only helpers, imported from tests/ like ``conftest``).

The codec kernels are checked bit for bit against the reference codec or against the unfused
chain they replace; every such test needs the same notion of equal bits and the same gradients
with the edge cases a codec must survive.
"""

from __future__ import annotations

import torch


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and stored bits, NaN matching NaN whatever its payload (a kernel and
    ATen need not agree on a NaN's payload, and no decoder reads it)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        nan = torch.isnan(a)
        if not torch.equal(nan, torch.isnan(b)):
            return False
        a, b = torch.where(nan, 0.0, a), torch.where(nan, 0.0, b)
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a, b)


def edge_gradient(rows: int, cols: int, seed: int, huge: bool = True, nonfinite: bool = True,
                  fp32_max: bool = False) -> torch.Tensor:
    """Gaussian rows of different magnitudes (fp32, `cols` >= 41), with the edge cases a codec
    must handle once there are 6 rows: an all-zero stretch, values near fp32's smallest normal,
    (`huge`) a stretch near fp32's largest finite value, and with `fp32_max` fp32's largest
    value itself (its scale's codes decode past fp32's range and saturate), a row of exact
    zeros among values with a -0.0 (int2's parity rule, float8's signed zero), (`nonfinite`) a
    NaN and a -Inf. A huge stretch sets a tensor scale, so the others underflow to zero codes,
    and a non-finite value makes its block's unit NaN: each is one case, not the only one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 2, rows).unsqueeze(1)
    if rows >= 6:
        x[1, :16] = 0.0
        x[2, :16] = torch.randn(16, generator=g) * 1e-37
        if huge:
            x[3, 16:32] = torch.randn(16, generator=g) * 1e36
            if fp32_max:
                x[3, 33] = 3.4e38
        x[4, ::3] = 0.0
        x[4, 1] = -0.0
        if nonfinite:
            x[5, 3] = float("nan")
            x[5, 40] = float("-inf")
    return x
