"""How the low-rank map's two matmuls run: the fixed-order exact map, or tensor-core kernels on CUDA.

`GiftConfig.map_precision` (carried by every item plan as `ItemPlan.map_precision`) picks the
arithmetic of `geometry.maps.LowRank`'s projection `P = G U` and expansion `(P C) U^T`:

- `exact`: a torch matmul for the projection and the expansion as a chain of r multiply-adds
  in a fixed order, which Inductor fuses into the consumer (`maps._low_rank_sum`); bitwise the
  same eager and compiled on the CPU. The only CPU path.
- `tf32` / `bf16`: both matmuls as the Triton kernels of `ops` (`lowrank_project`, then
  `lowrank_expand` with the map's diagonal in its epilogue), fp32 accumulation over operands
  rounded to TF32 (10 mantissa bits) or bf16 (7 bits). Each kernel sums in one fixed order
  with no split reduction, so the bits depend on the inputs and the compiled kernel only (not
  on torch's TF32 flags or a library's algorithm choice): every rank computes the same
  inverse map of the same decoded sum. CUDA only. The exchange's sender, where its codec runs
  as kernels too, computes the expansion inside the codec's kernels instead of calling
  `lowrank_map` (`kernels.fused_sender`).
- `auto` (the default): `tf32` on CUDA, `exact` elsewhere. TF32 rather than bf16: the map's
  operand rounding reaches the delivered gradient through the inverse map, whose gain on the
  factor's strong directions grows with the whitening's conditioning; on real gradients
  (`python -m bench.fidelity.map_precision`, docs/benchmarks.md) bf16's 8x coarser operands made the map
  alone err 8x more and moved the codec's error 50-120x more than TF32's (neither change to
  the codec's error resolved after the family-wise correction). Speed should not separate them: at rank
  <= 128 each matmul does about 4r FLOPs per 8 bytes of gradient it moves, far below either
  precision's tensor-core rate (an estimate; `bench.gpu.check`'s map section times both).

The choice depends only on the plan's precision, the device and the kernel switch
(`dispatch.use_kernels`), all static, so a traced body never branches on data and a plan's
choice is fixed at trace time. Where it differs from what the precision asks (tensor cores on
a CPU tensor, or the kernels switched off) it is logged once per process as a WARNING with the
reason, an `auto` or tensor-core choice on CUDA as INFO (`note_map_path`); like the codec's
dispatch, logging happens in eager code only.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from gift_compile.codec.layout import Choice
from gift_compile.kernels.dispatch import kernels_enabled, ops

logger = logging.getLogger("gift_compile")

__all__ = ["CUDA_DEFAULT", "MapPath", "MapPrecision", "lowrank_map", "map_path", "note_map_path"]


class MapPrecision(Choice):
    """`GiftConfig.map_precision` / `ItemPlan.map_precision`: the arithmetic of the low-rank map's
    matmuls (see the module docstring)."""

    AUTO = "auto"
    EXACT = "exact"
    TF32 = "tf32"
    BF16 = "bf16"


# What `auto` runs on CUDA (the module docstring says why TF32).
CUDA_DEFAULT = MapPrecision.TF32


class MapPath(NamedTuple):
    """How a low-rank map runs: `precision` is `exact` (the fixed-order torch map) or the
    tensor-core operand precision of the kernels; `reason` says why."""

    precision: MapPrecision
    reason: str

    @property
    def kernels(self) -> bool:
        return self.precision is not MapPrecision.EXACT


# (precision, device type, switch) already logged: a handful of keys per process
_noted: set[tuple[str, str, bool]] = set()


def map_path(precision: str, device: torch.device) -> MapPath:
    """Which arithmetic a low-rank map of `precision` (a `MapPrecision` spelling) runs on
    `device`. Raises for an unknown spelling, and where CUDA needs the kernels and Triton is
    missing."""
    asked = MapPrecision.parse(precision, "map_precision")
    if asked is MapPrecision.EXACT:
        return MapPath(MapPrecision.EXACT, "map_precision='exact': the fixed-order fp32 map")
    if device.type != "cuda":
        if asked is MapPrecision.AUTO:
            return MapPath(MapPrecision.EXACT, f"{device.type} tensors: the fixed-order fp32 map (map_precision='auto' "
                                               "runs tensor-core matmuls on CUDA only)")
        return MapPath(MapPrecision.EXACT, f"map_precision={asked.value!r} asks for tensor-core matmuls, which run on "
                                           f"CUDA only: {device.type} tensors run the fixed-order fp32 map")
    if not kernels_enabled():
        return MapPath(MapPrecision.EXACT, "explicit kernels switched off (gift_compile.kernels.use_kernels(False)): "
                                           "the fixed-order fp32 map as Inductor compiles it")
    if ops is None:
        raise RuntimeError(f"GIFT: map_precision={asked.value!r} on CUDA runs the low-rank map as Triton kernels, but "
                           "triton does not import here; install the Triton release that matches this torch, or set "
                           "map_precision='exact'")
    chosen = CUDA_DEFAULT if asked is MapPrecision.AUTO else asked
    return MapPath(chosen, f"map_precision={asked.value!r}: the low-rank map's matmuls as Triton kernels with "
                           f"{chosen.value} operands and fp32 accumulation")


def note_map_path(precision: str, device: torch.device) -> MapPath:
    """`map_path`, logged once per process per (precision, device type, switch): INFO where it
    runs what was asked (or `auto`'s CUDA choice), WARNING where it runs the exact map although
    tensor cores were asked for, or on CUDA with the kernels switched off. Eager only (logging
    breaks a Dynamo trace)."""
    path = map_path(precision, device)
    key = (str(precision), device.type, kernels_enabled())
    if key in _noted:
        return path
    _noted.add(key)
    downgraded = not path.kernels and (precision in (MapPrecision.TF32, MapPrecision.BF16) or device.type == "cuda")
    if downgraded:
        logger.warning("GIFT low-rank map: %s (logged once)", path.reason)
    elif path.kernels:
        logger.info("GIFT low-rank map: %s", path.reason)
    return path


def lowrank_map(g: torch.Tensor, basis: torch.Tensor, coef: torch.Tensor, pre: torch.Tensor, post: torch.Tensor,
                precision: str) -> torch.Tensor:
    """`g * pre + ((g @ basis) * coef) @ basis.T * post` for `g` `[rows, cols]` and `basis`
    `[cols, rank]` (fp32): the low-rank map in either direction (`LowRank.apply_forward`: `U`,
    `apply_inverse`: `V`) as the two kernels of `ops` with `precision` operands (`tf32`, `bf16`,
    or `ieee` for fp32 ones)."""
    p = ops.lowrank_project(g, basis, precision)
    return ops.lowrank_expand(g, p, pre, coef, basis, post, precision)
