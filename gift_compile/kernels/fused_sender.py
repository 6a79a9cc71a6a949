"""GIFT's sender on CUDA as three kernels: the low-rank map fused into the scale choice and the encode.

Unfused, the sender of a low-rank item runs `lowrank_project` (reads G), `lowrank_expand` (reads
G, writes the mapped gradient Y), `block_stat` (reads Y) and `encode` (reads Y): Y, as large as
G, is written once and read twice. Here the expansion is recomputed inside the two kernels that
consume it (`ops.lowrank_block_stat`, `ops.lowrank_encode`, sharing `lowrank_expand`'s tile
arithmetic), so the sender reads G three times and writes only the projection, the block
statistics and the codes (issue 26's byte goal; `python -m bench.fidelity.kernel_traffic` counts it).
The fp8 formats' sender is the same three reads: `lowrank_expand`, `fp8_scale_encode` (or
`fp8_scales`, then `fp8_encode`) become `ops_fp8.lowrank_fp8_scales` (the per-row or per-block
scales, or per tensor the rows' amax, of the expansion's tiles) and `ops_fp8.lowrank_fp8_encode`.
The recomputed rank-r product costs ~4r FLOPs per element again, far below what the tensor
cores do in the time the saved 8 bytes take.

`sender_path` is the static choice: fused where the map runs as kernels (`map_dispatch.map_path`),
the codec runs as kernels (`dispatch.codec_path`: a kernel format, round to nearest), the item
has no error-feedback residual (whose add would have to enter the tile too) and no block
rotation (the codes' axes are then the rotated ones), and the format's words and blocks tile the
kernels' columns (`ops.fused_reason`: every two-level kernel format but ternary;
`ops_fp8.lowrank_fp8_reason`: the fp8 formats at every scaling, blocks that divide 128 columns).
Otherwise the exchange keeps the
unfused chain, unchanged; the reason is logged once per process (INFO: both paths write the
codes of the same mapped values, only the traffic differs). The tensor scale keeps the exact
two-pass form (statistics, their maximum, `_tensor_scale`, `scale_codes`; for fp8 per tensor the
rows' amax, their maximum, `scales_of`).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from gift_compile.codec import FormatSpec
from gift_compile.codec.scales import _global_max, _tensor_scale
from gift_compile.kernels.dispatch import codec_path, ops, ops_fp8
from gift_compile.kernels.formats import FP8_KERNEL_FORMATS
from gift_compile.kernels.map_dispatch import map_path

logger = logging.getLogger("gift_compile")

__all__ = ["SenderPath", "encode_lowrank", "sender_path"]


class SenderPath(NamedTuple):
    """Whether a low-rank item's sender runs fused (`encode_lowrank`), the map's operand
    precision it then runs at (`ops.MAP_PRECISIONS`), and why."""

    fused: bool
    precision: str
    reason: str


# (format, scaling, block, device type, map precision, error feedback, rotation, switch) already logged
_noted: set[tuple[object, ...]] = set()


def _fused_reason(spec: FormatSpec) -> str | None:
    """Why the fused sender ops cannot serve `spec` (a kernel format), or None: the fp8 formats'
    (`ops_fp8.lowrank_fp8_reason`) or the two-level formats' (`ops.fused_reason`)."""
    if spec.name in FP8_KERNEL_FORMATS:
        return ops_fp8.lowrank_fp8_reason(spec)
    return ops.fused_reason(spec.name, spec.block_size)


def _scale_step(spec: FormatSpec) -> str:
    """What the fused map feeds besides the encode: the fp8 scales or the block statistics."""
    if spec.name in FP8_KERNEL_FORMATS:
        return f"{spec.scaling.value} scales" if not spec.single_scale else "row amax statistics"
    return "block statistics"


def sender_path(spec: FormatSpec, device: torch.device, map_precision: str, stochastic_rounding: bool,
                error_feedback: bool, block_rotation: bool) -> SenderPath:
    """Whether the sender of a low-rank item with these plan constants runs fused (module
    docstring); logged once per process per key unless Dynamo is tracing."""
    mp = map_path(map_precision, device)
    codec = codec_path(spec, device, stochastic_rounding)
    if not mp.kernels:
        path = SenderPath(False, "", f"the map is not kernels ({mp.reason})")
    elif not codec.kernels:
        path = SenderPath(False, "", f"the codec is not kernels ({codec.reason})")
    elif error_feedback:
        path = SenderPath(False, "", "error feedback adds its residual to the mapped gradient, which the unfused "
                                     "chain writes")
    elif block_rotation:
        path = SenderPath(False, "", "block rotation codes the mapped gradient on rotated axes")
    elif (why := _fused_reason(spec)) is not None:
        path = SenderPath(False, "", why)
    else:
        path = SenderPath(True, mp.precision.value, f"{spec.name}: the low-rank map fused into the "
                                                    f"{_scale_step(spec)} and the encode ({mp.precision.value} "
                                                    "operands)")
    key = (spec.name, spec.scaling, spec.block, device.type, str(map_precision), error_feedback, block_rotation,
           codec.kernels)
    if device.type == "cuda" and mp.kernels and not torch.compiler.is_compiling() and key not in _noted:
        _noted.add(key)
        logger.info("GIFT sender on CUDA: %s", path.reason if path.fused else f"unfused map and codec: {path.reason}")
    return path


def encode_lowrank(g: torch.Tensor, basis: torch.Tensor, coef: torch.Tensor, pre: torch.Tensor, post: torch.Tensor,
                   precision: str, spec: FormatSpec) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Scale codes, tensor scale and packed codes of the mapped gradient
    `g * pre + ((g @ basis) * coef) @ basis.T * post` (`map_dispatch.lowrank_map`'s operands,
    `g` `[rows, cols]` fp32) as `dispatch.choose_scales` and `dispatch.encode` give them on the
    kernel path, without writing the mapped gradient: the projection, the fused statistics,
    their maximum and the tensor scale, the scale codes, the fused encode. For an fp8 format:
    the projection, the fused scales (per tensor: the rows' amax, their maximum, `scales_of`),
    the fused encode; no tensor scale (None), as `dispatch.choose_scales_and_encode`."""
    p = ops.lowrank_project(g, basis, precision)
    if spec.name in FP8_KERNEL_FORMATS:
        fmt = (spec.name, spec.scaling.value, spec.block_size)
        scales = ops_fp8.lowrank_fp8_scales(g, p, pre, coef, basis, post, precision, *fmt)
        if spec.single_scale:
            scales = spec.family.scales_of(_global_max(scales))
        return scales, None, ops_fp8.lowrank_fp8_encode(g, p, pre, coef, basis, post, scales, precision, *fmt)
    stat = ops.lowrank_block_stat(g, p, pre, coef, basis, post, precision, spec.name, spec.block_size)
    tscale = _tensor_scale(_global_max(stat), spec.family.level)
    scales = ops.scale_codes(stat, tscale, spec.name, spec.block_size)
    codes = ops.lowrank_encode(g, p, pre, coef, basis, post, scales, tscale, precision, spec.name, spec.block_size)
    return scales, tscale, codes
