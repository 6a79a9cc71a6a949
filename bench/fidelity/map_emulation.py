"""The low-rank map's tensor-core arithmetic, emulated on the CPU.

On CUDA, `GiftConfig.map_precision` "tf32" / "bf16" ("auto" is "tf32" there) runs the low-rank
map's projection `P = G U` and expansion `(P C) U^T` as Triton kernels over operands rounded to
TF32 (10 explicit mantissa bits) or bf16 (7), with fp32 sums (`gift_compile.kernels.map_dispatch`).
The CPU runs the exact fp32 map only. This module is the one place the bench reproduces that
rounding in torch:

- `round_mantissa` / `emulated_map`: an operand rounded to nearest even at the precision's
  width, and the map as the kernels compute it (both matmuls over rounded operands, fp32 sums,
  the diagonal terms in fp32 as the kernels' epilogue computes them). `bench.fidelity.map_precision`
  measures the codec's error with them.
- `tensor_core_map`: a context within which GIFT's own low-rank maps (`LowRank.apply_forward`
  before quantization, `apply_inverse` after decoding) run `emulated_map` wherever the plan's
  `map_precision` is the emulated precision, so a training run sees the map a GPU would run
  (the convergence arms `-tf32` / `-bf16`, `bench.convergence.runner`). It swaps the two module-level
  names of `gift_compile.geometry.maps` through which `LowRank` reaches the tensor-core path
  (`_map_path`, which picks the arithmetic, and `lowrank_map`, the kernels' entry), and puts
  them back on exit: bench code only, no change to the product. Maps run at any other
  precision (the residual's re-mapping at a refresh, which runs exact on CUDA too) are
  untouched. Eager or compiled alike: Dynamo traces the swapped names into the graph (bit for
  bit the eager emulation) and replays the call count on every call.

What the emulation leaves out (as `bench.fidelity.map_precision` says): the order in which a tensor-core
MMA sums its products, and TF32's ties (Triton rounds them away from zero, the emulation to even).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from gift_compile.geometry import maps as geometry_maps
from gift_compile.kernels.map_dispatch import MapPath, MapPrecision

# explicit mantissa bits of each emulated operand precision (fp32 keeps its 23: "exact")
MANTISSA_BITS = {"tf32": 10, "bf16": 7}


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 `x` rounded to nearest (ties to even) at `bits` explicit mantissa bits, as fp32:
    the operand a tensor core sees at TF32 (10) or bf16 (7). Finite inputs (the map's are)."""
    drop = 23 - bits
    i = x.float().contiguous().view(torch.int32)
    odd = (i >> drop) & 1
    return (((i + (1 << (drop - 1)) - 1 + odd) >> drop) << drop).view(torch.float32)


def emulated_map(g: torch.Tensor, basis: torch.Tensor, coef: torch.Tensor, pre: torch.Tensor, post: torch.Tensor,
                 bits: int) -> torch.Tensor:
    """`g * pre + ((g @ basis) * coef) @ basis.T * post` (`basis` `[cols, rank]`) as
    `kernels.map_dispatch.lowrank_map` computes it: both matmuls over operands rounded to
    `bits` mantissa bits, fp32 sums."""
    b = round_mantissa(basis, bits)
    p = round_mantissa(g, bits) @ b
    return g * pre + (round_mantissa(p * coef, bits) @ b.t()) * post


@dataclasses.dataclass
class MapEmulation:
    """What a `tensor_core_map` context did: its precision and how many low-rank maps (either
    direction) ran emulated. A run records it, so a `-tf32` run shows that the emulation ran."""

    precision: str
    calls: int = 0


@contextlib.contextmanager
def tensor_core_map(precision: str) -> Iterator[MapEmulation]:
    """Within: every `LowRank` map whose plan asks for `precision` ("tf32" or "bf16") runs
    `emulated_map` at its mantissa width on whatever device, as CUDA would run it on tensor
    cores; other precisions run as before. Raises for a precision without an emulation, and
    where a context is already active (its swapped names would be restored out of order)."""
    if precision not in MANTISSA_BITS:
        raise ValueError(f"no tensor-core emulation for map precision {precision!r}; have {sorted(MANTISSA_BITS)}")
    original_path, original_map = geometry_maps._map_path, geometry_maps.lowrank_map
    if getattr(original_path, "emulating", None) is not None:
        raise RuntimeError(f"a tensor-core map emulation ({original_path.emulating}) is already active")
    bits, member, emulation = MANTISSA_BITS[precision], MapPrecision(precision), MapEmulation(precision)

    def path(asked: str, t: torch.Tensor) -> MapPath:
        if MapPrecision.parse(asked, "map_precision") is member:
            return MapPath(member, f"map_precision={precision!r} emulated on {t.device.type} (bench.fidelity.map_emulation): "
                                   f"operands rounded to {bits} mantissa bits, fp32 sums")
        return original_path(asked, t)

    def run(g: torch.Tensor, basis: torch.Tensor, coef: torch.Tensor, pre: torch.Tensor, post: torch.Tensor,
            asked: str) -> torch.Tensor:
        if asked != precision:
            raise RuntimeError(f"tensor-core map emulation of {precision!r} reached with precision {asked!r}")
        emulation.calls += 1
        return emulated_map(g, basis, coef, pre, post, bits)

    path.emulating = precision  # type: ignore[attr-defined]
    geometry_maps._map_path, geometry_maps.lowrank_map = path, run
    try:
        yield emulation
    finally:
        geometry_maps._map_path, geometry_maps.lowrank_map = original_path, original_map
