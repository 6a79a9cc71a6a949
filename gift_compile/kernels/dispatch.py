"""Which implementation runs a codec step: the explicit kernels on CUDA, the reference codec elsewhere.

The exchange's per-item codec (`gift_compile.exchange.item_codec`) calls the functions here
instead of `gift_compile.codec` directly. They take the reference codec's arguments and give
its results bit for bit; what differs is how they run:

- CUDA tensors of a format with kernels (`formats.KERNEL_FORMATS`, the two-level formats, and
  `formats.FP8_KERNEL_FORMATS`, the fp8 formats at every scaling; round to nearest): the
  registered Triton operators of `gift_compile.kernels.ops` and `gift_compile.kernels.ops_fp8`.
  Traced (Dynamo, or the FX pass's `make_fx`), they stay operators in the graph, so their
  memory traffic is the kernels' own, whatever fusion choices the installed Inductor makes
  around them.
- everything else (CPU tensors; on CUDA, the E8M0 formats, fp8 blocks longer than
  `formats.FP8_MAX_BLOCK` and stochastic rounding's encoder; or kernels switched off with
  `use_kernels(False)`): the reference codec, which a compiled body or the FX pass hands to
  Inductor as today. On the CPU that is the tested path
  (Inductor's C++ kernels); the Triton kernels are never launched on CPU tensors outside the
  interpreter tests.

The choice depends only on the format, the device and the rounding, all fixed per item plan,
so a traced body never branches on data. Each CUDA choice is logged once per process with its
reason (`note_path`; INFO for the kernels, WARNING where CUDA runs the generated codec instead):
logging is not traceable, so it happens in eager code (here when not compiling, and in the
bucket's eager launch before a compiled body runs).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import NamedTuple

import torch

from gift_compile import codec
from gift_compile.codec import FormatSpec, as_rows
from gift_compile.codec.scales import _global_max, _tensor_scale
from gift_compile.kernels.formats import FP8_KERNEL_FORMATS, FP8_MAX_BLOCK, KERNEL_FORMATS

try:
    from gift_compile.kernels import ops, ops_fp8
except ModuleNotFoundError as exc:  # the package runs without Triton where no kernel is needed (CPU)
    if exc.name != "triton":
        raise
    ops = ops_fp8 = None

logger = logging.getLogger("gift_compile")

__all__ = ["CodecPath", "choose_scales", "choose_scales_and_encode", "codec_path", "decode", "decode_sum", "encode",
           "kernels_enabled", "note_path", "use_kernels"]


class CodecPath(NamedTuple):
    """How an item's codec runs: `kernels` (the explicit Triton operators) or not, and why."""

    kernels: bool
    reason: str


class _Switch:
    """The process-wide on/off of the kernels (on by default), read when a body is traced: a
    compiled body guards on it, so switching retraces rather than running a stale choice."""

    enabled = True


# (format, block, device type, stochastic, enabled) already logged: a handful of keys per process
_noted: set[tuple[str, int | None, str, bool, bool]] = set()


def kernels_enabled() -> bool:
    """Whether CUDA items of a kernel format use the explicit kernels (the default)."""
    return _Switch.enabled


@contextlib.contextmanager
def use_kernels(enabled: bool) -> Iterator[None]:
    """Within the block, trace CUDA codecs with (True) or without (False) the explicit kernels;
    `bench.gpu.check` compiles the Inductor-generated bodies beside the kernel ones this way.
    A graph the FX pass traced keeps its choice; a `torch.compile`d body guards on the switch,
    so calling it under the other setting retraces it (run a body under the setting it was
    compiled with)."""
    previous = _Switch.enabled
    _Switch.enabled = bool(enabled)
    try:
        yield
    finally:
        _Switch.enabled = previous


def codec_path(spec: FormatSpec, device: torch.device, stochastic_rounding: bool = False) -> CodecPath:
    """Which implementation encodes `spec` on `device` (decoding and the scale choice follow the
    format and device alone: stochastic rounding only changes the encoder). Raises where CUDA
    needs the kernels and Triton is missing."""
    if device.type != "cuda":
        return CodecPath(False, f"{device.type} tensors: the reference codec as Inductor compiles it (the explicit "
                                "kernels run on CUDA only)")
    if not _Switch.enabled:
        return CodecPath(False, "explicit kernels switched off (gift_compile.kernels.use_kernels(False)): the "
                                "Inductor-generated codec")
    if spec.name not in KERNEL_FORMATS + FP8_KERNEL_FORMATS:
        return CodecPath(False, f"format {spec.name!r} has no explicit kernels (they exist for "
                                f"{', '.join(KERNEL_FORMATS + FP8_KERNEL_FORMATS)}): the Inductor-generated codec")
    if spec.name in FP8_KERNEL_FORMATS and (spec.block or 0) > FP8_MAX_BLOCK:
        return CodecPath(False, f"{spec.name} with block_size={spec.block}: the fp8 kernels take scale blocks of at "
                                f"most {FP8_MAX_BLOCK} elements, so this codec runs as Inductor-generated code")
    if stochastic_rounding:
        return CodecPath(False, f"{spec.name} with stochastic rounding: its encoder has no explicit kernel, so the "
                                "encode runs as Inductor-generated code (scales and decode use the kernels)")
    if ops is None:
        raise RuntimeError(f"GIFT: the {spec.name} codec on CUDA runs as Triton kernels, but triton does not import "
                           "here; install the Triton release that matches this torch")
    return CodecPath(True, f"{spec.name}: explicit Triton kernels (torch.ops.gift_kernels)")


def note_path(spec: FormatSpec, device: torch.device, stochastic_rounding: bool = False) -> CodecPath:
    """`codec_path`, logged once per process per (format, block, device type, rounding, switch)
    on CUDA: INFO where the kernels run, WARNING where CUDA runs the generated codec instead.
    Eager only (logging breaks a Dynamo trace)."""
    path = codec_path(spec, device, stochastic_rounding)
    key = (spec.name, spec.block, device.type, stochastic_rounding, _Switch.enabled)
    if device.type == "cuda" and key not in _noted:
        _noted.add(key)
        if path.kernels:
            logger.info("GIFT codec on CUDA: %s", path.reason)
        else:
            logger.warning("GIFT codec on CUDA: %s (logged once)", path.reason)
    return path


def _path(spec: FormatSpec, t: torch.Tensor, stochastic_rounding: bool = False) -> CodecPath:
    """`codec_path` for a tensor on its device; noted (logged) unless Dynamo is tracing."""
    if torch.compiler.is_compiling():
        return codec_path(spec, t.device, stochastic_rounding)
    return note_path(spec, t.device, stochastic_rounding)


def choose_scales(x: torch.Tensor, spec: FormatSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`codec.choose_scales(x, spec)` (no cross-rank agreement): on the kernel path the block
    statistics in one pass over `x`, their maximum (the exact two-pass tensor amax: the second
    pass reads the statistics, one per block), the tensor scale from it, then the codes."""
    if not _path(spec, x).kernels:
        return codec.choose_scales(x, spec)
    x2 = as_rows(x).float().contiguous()
    if spec.name in FP8_KERNEL_FORMATS:
        s = ops_fp8.fp8_scales(x2, spec.name, spec.scaling.value, spec.block_size)
        return (spec.family.scales_of(_global_max(s)) if spec.single_scale else s), None
    stat = ops.block_stat(x2, spec.name, spec.block_size)
    tscale = _tensor_scale(_global_max(stat), spec.family.level)
    return ops.scale_codes(stat, tscale, spec.name, spec.block_size), tscale


def encode(x: torch.Tensor, spec: FormatSpec, scales: torch.Tensor, tensor_scale: torch.Tensor | None, *,
           stochastic_rounding: bool = False, seed: torch.Tensor | int = 0) -> torch.Tensor:
    """`codec.encode` with the same arguments; the kernel path writes its bytes."""
    if not _path(spec, x, stochastic_rounding).kernels:
        return codec.encode(x, spec, scales, tensor_scale, stochastic_rounding=stochastic_rounding, seed=seed)
    if spec.name in FP8_KERNEL_FORMATS:
        return ops_fp8.fp8_encode(as_rows(x).float().contiguous(), scales.contiguous(), spec.name,
                                  spec.scaling.value, spec.block_size)
    assert tensor_scale is not None, f"{spec.name}: a two-level format has a tensor scale"
    return ops.encode(as_rows(x).float().contiguous(), scales, tensor_scale.reshape(1), spec.name, spec.block_size)


def choose_scales_and_encode(x: torch.Tensor, spec: FormatSpec, *, stochastic_rounding: bool = False,
                             seed: torch.Tensor | int = 0
                             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`(scales, tensor_scale, codes)`: `choose_scales` then `encode`, the same results. On the
    kernel path an fp8 format with row or block scaling does both in one kernel
    (`ops_fp8.fp8_scale_encode`), reading `x` once instead of once per step."""
    if spec.name in FP8_KERNEL_FORMATS and not spec.single_scale and _path(spec, x, stochastic_rounding).kernels:
        codes, scales = ops_fp8.fp8_scale_encode(as_rows(x).float().contiguous(), spec.name, spec.scaling.value,
                                                 spec.block_size)
        return scales, None, codes
    scales, tscale = choose_scales(x, spec)
    return scales, tscale, encode(x, spec, scales, tscale, stochastic_rounding=stochastic_rounding, seed=seed)


def decode(payload: torch.Tensor, spec: FormatSpec, scales: torch.Tensor, tensor_scale: torch.Tensor | None,
           cols: int) -> torch.Tensor:
    """`codec.decode` of a `[rows, payload_cols]` payload or of one per sender
    (`[senders, rows, payload_cols]`, scales `[senders, rows, nblocks]`, tensor scales
    `[senders, 1, 1]`), as `item_codec` holds them."""
    if not _path(spec, payload).kernels:
        return codec.decode(payload, spec, scales, tensor_scale, cols)
    if spec.name in FP8_KERNEL_FORMATS:
        return _fp8_decode(payload, spec, scales, cols, False, False)
    assert tensor_scale is not None, f"{spec.name}: a two-level format has a tensor scale"
    if payload.dim() == 2:
        out = ops.decode(payload.unsqueeze(0), scales.unsqueeze(0), tensor_scale.reshape(1), spec.name,
                         spec.block_size, cols, False, False)
        return out.squeeze(0)
    senders = payload.shape[0]
    return ops.decode(payload, scales, tensor_scale.reshape(senders), spec.name, spec.block_size, cols, False, False)


def decode_sum(payload: torch.Tensor, spec: FormatSpec, scales: torch.Tensor, tensor_scale: torch.Tensor | None,
               cols: int, average: bool) -> torch.Tensor:
    """The fp32 sum over senders (dim 0, in rank order) of `decode`, with `average` of each
    sender's value divided by their number (the mean of finite values near fp32's largest is
    finite, their sum is not): on the kernel path in the decoding kernel itself, so the
    per-sender values are never written out."""
    if not _path(spec, payload).kernels:
        values = codec.decode(payload, spec, scales, tensor_scale, cols)
        return (values / payload.shape[0] if average else values).sum(dim=0)
    if spec.name in FP8_KERNEL_FORMATS:
        return _fp8_decode(payload, spec, scales, cols, True, average)
    assert tensor_scale is not None, f"{spec.name}: a two-level format has a tensor scale"
    senders = payload.shape[0]
    return ops.decode(payload, scales, tensor_scale.reshape(senders), spec.name, spec.block_size, cols, True, average)


def _fp8_decode(payload: torch.Tensor, spec: FormatSpec, scales: torch.Tensor, cols: int, reduce: bool,
                average: bool) -> torch.Tensor:
    """`ops_fp8.fp8_decode` of a `[rows, payload_cols]` payload or of one per sender, with the
    scales as `item_codec` holds them (per tensor `[1]` or `[senders, 1, 1]`, per row
    `[senders, rows]`, per block `[senders, rows, nblocks]`, no sender dim for a 2-D payload)
    reshaped to the operator's `[senders, ...]`."""
    single = payload.dim() == 2
    p = payload.unsqueeze(0) if single else payload
    senders, rows = p.shape[0], p.shape[1]
    if spec.single_scale:
        s = scales.reshape(-1).expand(senders)
    elif spec.block is None:
        s = scales.reshape(senders, rows)
    else:
        s = scales.reshape(senders, rows, -1)
    out = ops_fp8.fp8_decode(p, s.contiguous(), spec.name, spec.scaling.value, spec.block_size, cols, reduce, average)
    return out.squeeze(0) if single and not reduce else out
