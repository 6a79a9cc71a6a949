"""Block rotation: a fixed signed Walsh-Hadamard transform inside each scale block, applied
before the codes are chosen and undone after the decoded sum.

Why: a block-scaled low-bit format spends its few levels on the range `[-amax, amax]` of each
block, so one large element in a block of 16 or 32 leaves every other element of that block on
the one or two levels near zero. An orthonormal rotation of the block spreads the block's energy
over all its elements (incoherence processing, as QuaRot and Quartet do for low-bit training):
amax moves towards the block's RMS times a Gaussian's ~2.5 for 32 elements, and the grid step
shrinks with it. The rotation is orthonormal, so the error it leaves has the norm of the error
in rotated coordinates, and exact to fp32 rounding, so decoding and un-rotating recovers the
sum of what was sent.

The rotation is the same on every rank and every step (signs from a hash of the column index,
no state): every rank encodes on the same axes, the receivers' fp32 sum commutes with the
rotation, and an error-feedback residual kept in rotated coordinates stays valid from one step
to the next. It acts on the last dimension, block by block, inside the scale blocks of the
format (its length is the largest power of two dividing the scale block), so a rotated block
still has one scale; columns past the last whole block (a ragged row end) are left as they are.

GIFT composes it after its map (`G T^T`, then the rotation): any orthonormal rotation of a
whitened gradient is still whitened, so the metric GIFT chose is kept and only the axes the
codes are written on change.
"""

from __future__ import annotations

import math

import torch

__all__ = ["fwht", "rotate", "rotation_block", "unrotate"]

# Multiplier of the column hash (Knuth's multiplicative constant, odd): a column's sign is one
# bit of `(col * _SIGN_HASH) >> _SIGN_BIT`, so neighbouring columns get unrelated signs.
_SIGN_HASH = 2654435761
_SIGN_BIT = 17


# On a CPU, blocks up to this length are transformed as one product with the block's Hadamard
# matrix (`_hadamard`): 2 x block multiply-adds per element through BLAS. Compiled, one thread,
# a [4096, 384] gradient rotated and unrotated at block 32 with a pointwise producer: 4.5 ns per
# element against the butterfly's 12.4 (eager 14.6 against 41.1), whose generated code writes a
# stack per stage.
_MATMUL_BLOCK = 64


def _hadamard(block: int, device: torch.device) -> torch.Tensor:
    """The `block x block` Sylvester Hadamard matrix (+-1, fp32), built from indices in the
    graph (no constant tensor to carry into a trace): entry (i, j) is -1 where the popcount of
    `i & j` is odd."""
    idx = torch.arange(block, device=device, dtype=torch.int64)
    both = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(both)
    for bit in range(block.bit_length() - 1):
        parity = parity ^ ((both >> bit) & 1)
    return (1 - 2 * parity).to(torch.float32)


def fwht(x: torch.Tensor, block: int) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over consecutive blocks of `block` (a power of two
    dividing the last dim) along the last dim. Self-inverse. On a CPU a block of at most
    `_MATMUL_BLOCK` goes as one product with the block's Hadamard matrix; elsewhere (and for
    longer blocks) as log2(block) butterfly stages, each a pointwise expression, so a traced call
    fuses with what produces and consumes it (on a GPU a product would also run at TF32 where a
    user allows it, and the rotation must stay exact to fp32 rounding)."""
    shape = x.shape
    if x.device.type == "cpu" and block <= _MATMUL_BLOCK:
        y = x.reshape(-1, block) @ _hadamard(block, x.device)
        return y.reshape(shape) * (1.0 / math.sqrt(block))
    y = x.reshape(-1, shape[-1] // block, block)
    h = 1
    while h < block:
        y = y.reshape(y.shape[0], y.shape[1], block // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(shape) * (1.0 / math.sqrt(block))


def rotation_block(scale_block: int) -> int:
    """The rotation's length for a format whose scales cover `scale_block` elements: the
    largest power of two dividing it (16 or 32 for the block formats; an fp8 block of 24
    rotates by 8), so no rotated block straddles two scales."""
    if scale_block < 2:
        raise ValueError(f"block rotation needs a scale block of at least 2 elements, got {scale_block}")
    return scale_block & -scale_block


def _signs(cols: int, device: torch.device) -> torch.Tensor:
    """+-1 per column (fp32 `[cols]`), the same on every rank: computed from the column index
    in the graph (no constant tensor to carry into a trace)."""
    j = torch.arange(cols, device=device, dtype=torch.int64)
    bit = ((j * _SIGN_HASH) >> _SIGN_BIT) & 1
    return (1 - 2 * bit).to(torch.float32)


def _split(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    whole = x.shape[-1] - x.shape[-1] % block
    if whole == x.shape[-1]:
        return x, None
    return x.narrow(-1, 0, whole), x.narrow(-1, whole, x.shape[-1] - whole)


def rotate(x: torch.Tensor, scale_block: int) -> torch.Tensor:
    """`x` (fp32, `[..., cols]`) with each whole rotation block of its last dim multiplied by
    the column signs and Walsh-Hadamard transformed (`unrotate` is the inverse)."""
    block = rotation_block(scale_block)
    head, tail = _split(x, block)
    if head.shape[-1] == 0:
        return x
    out = fwht(head * _signs(head.shape[-1], x.device), block)
    return out if tail is None else torch.cat((out, tail), dim=-1)


def unrotate(y: torch.Tensor, scale_block: int) -> torch.Tensor:
    """Inverse of `rotate`: the transform again (it is its own inverse), then the signs."""
    block = rotation_block(scale_block)
    head, tail = _split(y, block)
    if head.shape[-1] == 0:
        return y
    out = fwht(head, block) * _signs(head.shape[-1], y.device)
    return out if tail is None else torch.cat((out, tail), dim=-1)
