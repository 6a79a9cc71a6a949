"""The memory traffic of each codec kernel, from its arguments: what its loads and stores move.

A kernel of `gift_compile.kernels.triton_codec` reads each of its input tensors once and writes
its output once: the loads of a program are its own rows and words, the padding past `cols` is
masked (never read), and the values read many times (a block's scale code by each of its
elements, the tensor scale by every element; the expansion's `[rank, cols]` basis and `[rows,
rank]` projection by every tile that shares them, both a few MB at most) come from the cache
after their first load, not from memory. So a kernel's bytes are the sizes of its tensor
arguments plus its output, fixed by the shapes and dtypes the exchange hands it, whichever
torch or Inductor compiles the code around it. `op_traffic` applies that rule to an operator
call (a traced graph's node, or the tensors themselves); `bench.fidelity.kernel_traffic` sums it over
the operators a codec body emits and sets it beside the body's floor
(`bench.fidelity.codec_minimum.minimum_bytes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["KERNEL_OPS", "Traffic", "node_traffic", "op_traffic"]

# The registered operators (`torch.ops.gift_kernels.<name>`) whose traffic this module knows.
KERNEL_OPS = ("block_stat", "scale_codes", "encode", "decode", "lowrank_project", "lowrank_expand",
              "lowrank_block_stat", "lowrank_encode", "lowrank_decode_expand", "fp8_scales", "fp8_scale_encode",
              "fp8_encode", "fp8_decode", "lowrank_fp8_scales", "lowrank_fp8_encode", "lowrank_fp8_decode_expand")


class Traffic(NamedTuple):
    """Bytes one kernel call reads from and writes to memory."""

    op: str
    reads: int
    writes: int


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def op_traffic(op: str, args: Sequence[object], out: torch.Tensor | Sequence[torch.Tensor]) -> Traffic:
    """Traffic of one call of `torch.ops.gift_kernels.<op>` with `args` (tensors, real or fake,
    and the format constants) returning `out` (a tensor, or several: `fp8_scale_encode`'s codes
    and scales): every tensor argument read once, every output written once. Raises for an
    operator this module does not describe."""
    if op not in KERNEL_OPS:
        raise ValueError(f"op_traffic: {op!r} is not a codec kernel; known: {', '.join(KERNEL_OPS)}")
    outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
    return Traffic(op, sum(_nbytes(a) for a in args if isinstance(a, torch.Tensor)), sum(map(_nbytes, outs)))


def node_traffic(node: torch.fx.Node) -> Traffic | None:
    """`op_traffic` of a traced graph's node (arguments and result read off the nodes' fake
    values), or None for a node that is not a codec kernel."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if target.namespace != "gift_kernels":
        return None
    args = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in node.args]
    return op_traffic(target._opname, args, node.meta["val"])
