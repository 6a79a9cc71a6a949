"""What the kernel tests compare, feed and trace (test-only helpers, imported from tests/ like ``conftest``).

The codec kernels are checked bit for bit against the reference codec or against the unfused
chain they replace; every such test needs the same notion of equal bits, the same gradients
with the edge cases a codec must survive, the same fake CUDA tensors to trace what CUDA would
run without a GPU, and the same exchange round trip run on and off the kernel path.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from gift_compile.codec import residual as residual_store
from gift_compile.exchange.item_codec import (ItemTensors, Shared, decode_item, encode_item, gather_decode_item,
                                              reencode_item)
from gift_compile.exchange.plan import BucketPlan, ItemPlan
from gift_compile.kernels import dispatch


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


def fake_cuda(mode: FakeTensorMode, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A fake tensor on `cuda` (metadata only): traces what CUDA would run, with no GPU."""
    return FakeTensor(mode, torch.empty(shape, dtype=dtype, device="meta"), torch.device("cuda"))


def kernel_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The registered kernel operators (`gift_kernels::*`) a traced graph calls, in order."""
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "gift_kernels" in str(n.target)]


def exchange_round_trip(item: ItemPlan, world: int = 2) -> list[torch.Tensor]:
    """Every exchange stage of a Euclidean `item` with an error-feedback residual, on CPU tensors:
    the sent bytes and non-finite flag, the updated residual, the reduce-scatter's averaged
    shard, the all-reduce's transformed shard, its re-encoded bytes and the gathered result
    (the sent buffer stands in for a received one: `world` senders' blocks)."""
    rows, cols = item.rows, item.cols
    rs = BucketPlan((item,), world, None, True, "reduce_scatter")
    ar = BucketPlan((item,), world, None, True, "all_reduce")
    state = ItemTensors((), residual_store.allocate(item.residual_format, rows, cols, "cpu"))
    residual_store.write(item.residual_format, state.residual,
                         0.01 * edge_gradient(rows, cols, seed=12, huge=False, nonfinite=False))
    blocks, bad = encode_item(edge_gradient(rows, cols, seed=11, huge=False, nonfinite=False), state, Shared(),
                              item, rs)
    sent = torch.cat(blocks, dim=1)
    shard, _ = decode_item(sent, 0, state, item, rs)
    moved, _ = decode_item(sent, 0, state, item, ar, transformed=True)
    gathered_bytes = torch.cat(reencode_item(moved, state, Shared(), item, ar))
    full, _ = gather_decode_item(torch.stack([gathered_bytes, gathered_bytes]), 0, state, item, ar)
    return [sent, bad, residual_store.read(item.residual_format, state.residual, cols), shard, moved,
            gathered_bytes, full]


def on_kernel_path(monkeypatch: pytest.MonkeyPatch, ops: ModuleType, names: Sequence[str]) -> list[str]:
    """Make the codec dispatch take the kernel path for CPU tensors (the kernels then run in
    Triton's interpreter) and record each call of the operators `names` of `ops`: the returned
    list fills as they run, so a test can show the kernel path really ran."""
    original = dispatch.codec_path
    monkeypatch.setattr(dispatch, "codec_path", lambda spec, device, stochastic_rounding=False: original(
        spec, torch.device("cuda") if device.type == "cpu" else device, stochastic_rounding))
    calls: list[str] = []
    for name in names:
        op = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _op=op, _name=name: calls.append(_name) or _op(*a))
    return calls
