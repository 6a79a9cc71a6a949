"""Error-feedback residuals stored in a low-bit format.

Error feedback keeps, for every managed weight on every rank, what the last encode left out
(`g - decode(encode(g))`, in transformed coordinates) and adds it to the next gradient. That is
a full-size tensor per weight and rank — the one part of GIFT's state that scales with the
model — and it cannot be sharded like FSDP's gradients: each rank's residual belongs to its own
unreduced local gradient. So it is stored compressed, in any wire format of
`gift_compile.codec` with per-row scales (`GiftConfig.residual_format`; "fp32" keeps it
exact). The residual is itself a small, noise-like quantity; an 8-bit copy keeps most of what
error feedback needs (the benchmark measures how much).

A residual is a tuple of buffers (codes, then scales, then a tensor scale, as the format needs;
or, for a family with a `residual_dtype` (fp32, bf16), one tensor of that dtype), allocated once and rewritten in place, so compiled graphs read and
write it like any other state tensor.
"""

from __future__ import annotations

import torch

from gift_compile.codec import FormatSpec, Scaling, choose_scales, decode, encode

__all__ = ["allocate", "buffer_count", "read", "write"]


def _spec(fmt: str) -> FormatSpec:
    return FormatSpec(fmt, Scaling.ROW)


def allocate(fmt: str, rows: int, cols: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """Zero residual buffers for a `[rows, cols]` residual in `fmt` (zero decodes to zero)."""
    spec = _spec(fmt)
    if spec.family.residual_dtype is not None:
        return (torch.zeros(rows, cols, dtype=spec.family.residual_dtype, device=device),)
    meta = torch.empty(rows, cols, device="meta")
    scales, tscale = choose_scales(meta, spec)
    codes = encode(meta, spec, scales, tscale)
    # all-zero codes and scales decode to exactly zero in every format
    bufs = [torch.zeros(codes.shape, dtype=torch.uint8, device=device),
            torch.zeros(scales.shape, dtype=scales.dtype, device=device)]
    if tscale is not None:
        bufs.append(torch.zeros(tscale.shape, dtype=tscale.dtype, device=device))
    return tuple(bufs)


def buffer_count(fmt: str) -> int:
    """How many tensors a residual in `fmt` is stored as."""
    family = _spec(fmt).family
    if family.residual_dtype is not None:
        return 1
    return 3 if family.has_tensor_scale else 2


def read(fmt: str, bufs: tuple[torch.Tensor, ...], cols: int) -> torch.Tensor:
    """The residual as fp32 `[rows, cols]`."""
    spec = _spec(fmt)
    if spec.family.residual_dtype is not None:
        return bufs[0].float()
    tscale = bufs[2] if len(bufs) > 2 else None
    return decode(bufs[0], spec, bufs[1], tscale, cols)


def write(fmt: str, bufs: tuple[torch.Tensor, ...], value: torch.Tensor) -> None:
    """Store `value` (fp32 `[rows, cols]`) into the buffers, in place."""
    spec = _spec(fmt)
    if spec.family.residual_dtype is not None:
        bufs[0].copy_(value)
        return
    scales, tscale = choose_scales(value, spec)
    bufs[0].copy_(encode(value, spec, scales, tscale))
    bufs[1].copy_(scales)
    if tscale is not None:
        bufs[2].copy_(tscale)
