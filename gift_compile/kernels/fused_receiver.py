"""GIFT's all-reduce receiver on CUDA: the inverse map's expansion decodes the gathered codes itself.

The all-reduce's last stage decodes every rank's re-encoded shard into the full fp32 result and
maps it back (`LowRank.apply_inverse`). Unfused that is `decode` (reads the gathered codes,
writes the result Z), `lowrank_project` (reads Z) and `lowrank_expand` (reads Z again, writes
the output). Here the expansion takes the gathered codes instead of Z and decodes its tile
with the decode kernels' own helpers (`ops.lowrank_decode_expand`;
`ops_fp8.lowrank_fp8_decode_expand` for the fp8 formats), so its second look at the values
costs the codes' bytes (0.5-1 per element) instead of Z's 4; the projection still reads Z, as
the byte floor's receiver does (`bench.fidelity.codec_minimum`). The output is decode -> expand's bit for
bit: the same decoded values, the same tile arithmetic (`triton_codec._expand_values`).

`receiver_path` is the static choice: fused where the map runs as kernels
(`map_dispatch.map_path`), the codec runs as kernels (`dispatch.codec_path`; decoding does
not depend on the rounding), the item has no block rotation (the decoded values are then
un-rotated before the inverse map) and the format's words tile the expansion's 128 columns
(`ops.fused_reason`: every two-level kernel format but ternary; every fp8 kernel spec, whose
bytes are one per value). Otherwise the unfused chain, unchanged; the reason is logged once
per process (INFO: both paths give the same bits, only the traffic differs).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from gift_compile.codec import FormatSpec
from gift_compile.kernels.dispatch import codec_path, decode, ops, ops_fp8
from gift_compile.kernels.formats import FP8_KERNEL_FORMATS
from gift_compile.kernels.map_dispatch import map_path

logger = logging.getLogger("gift_compile")

__all__ = ["ReceiverPath", "decode_inverse_lowrank", "receiver_path"]


class ReceiverPath(NamedTuple):
    """Whether a low-rank item's all-reduce receiver runs fused (`decode_inverse_lowrank`), the
    map's operand precision it then runs at (`ops.MAP_PRECISIONS`), and why."""

    fused: bool
    precision: str
    reason: str


# (format, scaling, block, device type, map precision, rotation, switch) already logged
_noted: set[tuple[object, ...]] = set()


def receiver_path(spec: FormatSpec, device: torch.device, map_precision: str, block_rotation: bool) -> ReceiverPath:
    """Whether the all-reduce receiver of a low-rank item with these plan constants runs fused
    (module docstring); logged once per process per key unless Dynamo is tracing."""
    mp = map_path(map_precision, device)
    codec = codec_path(spec, device)
    if not mp.kernels:
        path = ReceiverPath(False, "", f"the map is not kernels ({mp.reason})")
    elif not codec.kernels:
        path = ReceiverPath(False, "", f"the codec is not kernels ({codec.reason})")
    elif block_rotation:
        path = ReceiverPath(False, "", "block rotation un-rotates the decoded result before the inverse map")
    elif spec.name not in FP8_KERNEL_FORMATS and (why := ops.fused_reason(spec.name, spec.block_size)) is not None:
        path = ReceiverPath(False, "", why)
    else:
        path = ReceiverPath(True, mp.precision.value, f"{spec.name}: the inverse map's expansion decodes the gathered "
                                                      f"codes itself ({mp.precision.value} operands)")
    key = (spec.name, spec.scaling, spec.block, device.type, str(map_precision), block_rotation, codec.kernels)
    if device.type == "cuda" and mp.kernels and not torch.compiler.is_compiling() and key not in _noted:
        _noted.add(key)
        logger.info("GIFT all-reduce receiver on CUDA: %s",
                    path.reason if path.fused else f"unfused decode and inverse map: {path.reason}")
    return path


def decode_inverse_lowrank(payload: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor | None,
                           basis: torch.Tensor, coef: torch.Tensor, pre: torch.Tensor, post: torch.Tensor,
                           precision: str, spec: FormatSpec, cols: int) -> torch.Tensor:
    """`lowrank_map(decode(payload, spec, scales, tensor_scale, cols), basis, coef, pre, post,
    precision)` of every sender's shard (`payload` `[senders, rows, payload_cols]`, the scales
    as `item_codec` parses them: a sender dim first), fp32 `[senders * rows, cols]`: the decoded
    result is written once for the projection, and the expansion decodes the codes again
    instead of reading it (`ops.lowrank_decode_expand`, `ops_fp8.lowrank_fp8_decode_expand`)."""
    senders, rows = payload.shape[0], payload.shape[1]
    n = senders * rows
    full = decode(payload, spec, scales, tensor_scale, cols).reshape(n, cols)
    p = ops.lowrank_project(full, basis, precision)
    flat = payload.reshape(n, -1)
    if spec.name in FP8_KERNEL_FORMATS:
        if spec.single_scale:
            s = scales.reshape(senders)
        else:
            s = scales.reshape(n) if spec.block is None else scales.reshape(n, -1)
        return ops_fp8.lowrank_fp8_decode_expand(flat, s, p, pre, coef, basis, post, precision, spec.name,
                                                 spec.scaling.value, spec.block_size, cols)
    assert tensor_scale is not None, f"{spec.name}: a two-level format has a tensor scale"
    return ops.lowrank_decode_expand(flat, scales.reshape(n, -1), tensor_scale.reshape(senders), p, pre, coef, basis,
                                     post, precision, spec.name, spec.block_size, cols)
