"""Quantized gradient collectives built from `torch.ops._c10d_functional` ops.

    transform -> (+ residual) -> agree scales (all-reduce MAX) -> encode -> all_to_all of codes
    -> decode every sender's codes and sum in fp32 (fixed order) -> inverse transform

`all_reduce` continues from that reduce-scatter: each rank re-encodes its own fp32 shard with
its own scales, all-gathers codes and scales, decodes them all and applies the inverse. No
collective is ever asked to add low-bit codes, every receiver decodes with the scales the
sender encoded with, and every rank of an all-reduce decodes the very same bytes, so all
replicas end with bit-identical gradients.

The functions are plain traceable PyTorch: the FX pass splices `gift_reduce_scatter` /
`gift_all_reduce` into backward graphs, the FSDP2 fallback calls them eagerly or compiled,
and the benchmarks call them with `group=None` (a single-rank round trip). gloo cannot carry
float8/float4 dtypes, so every payload travels as uint8.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gift_compile.config import GiftConfig
from gift_compile.formats import FormatSpec, as_rows, choose_scales, decode, encode, wire_bytes_for
from gift_compile.geometry import Transform, apply_forward, apply_inverse

_c10d = torch.ops._c10d_functional
_RANK_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class CommPlan:
    """Everything static about one quantized collective: it fixes the traced graph."""

    spec: FormatSpec
    kind: str
    world: int
    rank: int
    group_name: str | None
    average: bool
    stochastic_rounding: bool = False

    @classmethod
    def make(cls, config: GiftConfig, group: dist.ProcessGroup | str | None, kind: str = "identity") -> "CommPlan":
        name, world, rank = group_info(group)
        return cls(FormatSpec(config.format, config.scaling, config.block_size), kind, world, rank, name,
                   config.reduce_op == "avg", config.stochastic_rounding)


def group_info(group: dist.ProcessGroup | str | None) -> tuple[str | None, int, int]:
    """`(group_name, world_size, rank)`; `None` or a one-rank group means no communication."""
    if group is None:
        return None, 1, 0
    if isinstance(group, str):
        pg = dist.distributed_c10d._resolve_process_group(group)
    else:
        pg = group
    world = dist.get_world_size(pg)
    if world == 1:
        return None, 1, 0
    return pg.group_name, world, dist.get_rank(pg)


def _wait(t: torch.Tensor) -> torch.Tensor:
    return _c10d.wait_tensor(t)


def _agree_max(plan: CommPlan):
    if plan.group_name is None:
        return lambda t: t
    return lambda t: _wait(_c10d.all_reduce(t, "max", plan.group_name))


def _all_to_all_rows(t: torch.Tensor, plan: CommPlan) -> torch.Tensor:
    """Row block j of `t` goes to rank j; returns `[world, rows/world, ...]` (sender-major)."""
    rows = t.shape[0] // plan.world
    if plan.group_name is not None:
        splits = [rows] * plan.world
        t = _wait(_c10d.all_to_all_single(t.contiguous(), splits, splits, plan.group_name))
    return t.reshape(plan.world, rows, *t.shape[1:])


def _all_gather(t: torch.Tensor, plan: CommPlan) -> torch.Tensor:
    """`[world * d0, ...]` concatenation of every rank's `t` (rank order)."""
    if plan.group_name is None:
        return t
    return _wait(_c10d.all_gather_into_tensor(t.contiguous(), plan.world, plan.group_name))


def _shard_rows(t: torch.Tensor | None, plan: CommPlan, rows: int) -> torch.Tensor | None:
    """This rank's rows of a per-row/per-block scale tensor (per-tensor scales pass through)."""
    if t is None or t.dim() == 0 or t.shape[0] != rows * plan.world:
        return t
    return t[plan.rank * rows:(plan.rank + 1) * rows]


def _reduce_scatter_transformed(
    x: torch.Tensor,
    tensors: tuple[torch.Tensor, ...],
    residual: torch.Tensor | None,
    seed: torch.Tensor | int,
    plan: CommPlan,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reduce-scatter stage, result left in transformed coordinates (see `gift_reduce_scatter`)."""
    g = apply_forward(plan.kind, x.float(), tensors)
    if residual is not None:
        g = g + residual
    spec = plan.spec
    scales, tscale = choose_scales(g, spec, _agree_max(plan))
    sr_seed = seed + plan.rank * _RANK_SEED_STRIDE if plan.stochastic_rounding else 0
    payload = encode(g, spec, scales, tscale, stochastic_rounding=plan.stochastic_rounding, seed=sr_seed)
    cols = g.shape[-1]
    new_residual = None
    if residual is not None:
        new_residual = g - decode(payload, spec, scales, tscale, cols)
    rows = g.shape[0] // plan.world
    recv = _all_to_all_rows(payload, plan)
    parts = decode(recv, spec, _shard_rows(scales, plan, rows), tscale, cols)
    total = parts.sum(dim=0)
    if plan.average:
        total = total / plan.world
    return total, new_residual


def gift_reduce_scatter(
    x: torch.Tensor,
    tensors: tuple[torch.Tensor, ...],
    residual: torch.Tensor | None,
    seed: torch.Tensor | int,
    plan: CommPlan,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Functional core of `reduce_scatter`: returns `(fp32 shard [rows/world, cols], new residual)`.

    `x` is the local gradient viewed as `[rows, cols]` (rows divisible by the world size);
    `tensors` are the transform's tensors for `plan.kind`; `residual` (transformed
    coordinates, same shape as `x`) is added before encoding and the new residual returned.
    """
    total, new_residual = _reduce_scatter_transformed(x, tensors, residual, seed, plan)
    return apply_inverse(plan.kind, total, tensors), new_residual


def gift_all_reduce(
    x: torch.Tensor,
    tensors: tuple[torch.Tensor, ...],
    residual: torch.Tensor | None,
    seed: torch.Tensor | int,
    plan: CommPlan,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Functional core of `all_reduce` on a `[rows, cols]` view: `(fp32 result, new residual)`.

    Rows are zero-padded to a multiple of the world size for the reduce-scatter stage.
    """
    rows = x.shape[0]
    pad = (-rows) % plan.world
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        if residual is not None:
            residual = torch.nn.functional.pad(residual, (0, 0, 0, pad))
    shard, new_residual = _reduce_scatter_transformed(x, tensors, residual, seed, plan)
    if plan.world > 1:
        spec = plan.spec
        scales, tscale = choose_scales(shard, spec)
        sr_seed = seed + plan.rank * _RANK_SEED_STRIDE + 7 if plan.stochastic_rounding else 0
        payload = encode(shard, spec, scales, tscale, stochastic_rounding=plan.stochastic_rounding, seed=sr_seed)
        w, r = plan.world, shard.shape[0]
        gp = _all_gather(payload, plan).reshape(w, r, -1)
        gs = _all_gather(scales, plan) if scales.numel() else scales
        if gs.numel():
            gs = gs.reshape(w, 1, 1) if spec.scaling == "tensor" and spec.block is None else gs.reshape(w, r, *scales.shape[1:])
        gt = _all_gather(tscale, plan).reshape(w, 1, 1) if tscale is not None else None
        shard = decode(gp, spec, gs, gt, shard.shape[-1]).reshape(w * r, -1)
    out = apply_inverse(plan.kind, shard, tensors)
    if pad:
        out = out[:rows]
        if new_residual is not None:
            new_residual = new_residual[:rows]
    return out, new_residual


def _prepare(
    x: torch.Tensor, config: GiftConfig, group: dist.ProcessGroup | str | None, transform: Transform | None
) -> tuple[CommPlan, tuple[torch.Tensor, ...]]:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"GIFT collective: unsupported gradient dtype {x.dtype}; expected float32, bfloat16 or float16")
    kind = "identity" if transform is None else transform.kind
    tensors = () if transform is None else transform.tensors
    if transform is not None and x.shape[-1] != transform.d_in:
        raise ValueError(f"GIFT collective: gradient last dim {x.shape[-1]} != transform d_in {transform.d_in}")
    if config.nonfinite == "error" and not torch.compiler.is_compiling():
        if not bool(torch.isfinite(x).all()):
            raise ValueError(
                "GIFT collective: the local gradient has NaN/Inf values; set nonfinite='propagate' to "
                "communicate them as NaN rows instead of raising"
            )
    return CommPlan.make(config, group, kind), tensors


@functools.cache
def _compiled(core: Callable) -> Callable:
    """`core` under `torch.compile(fullgraph=True, dynamic=False)`.

    Transform tensors, residual and seed are graph inputs and the plan is a frozen dataclass,
    so one graph serves every layer of a given gradient shape and plan; a new shape compiles
    once. Past dynamo's recompile limit a shape runs eagerly (same numbers, bit for bit).
    """
    return torch.compile(core, fullgraph=True, dynamic=False)


def _run(core: Callable, x: torch.Tensor, tensors: tuple[torch.Tensor, ...], residual: torch.Tensor | None,
         seed: torch.Tensor | int, plan: CommPlan, compiled: bool) -> torch.Tensor:
    """Call a functional core on the row view of `x`; update `residual` in place."""
    fn = _compiled(core) if compiled else core
    out, new_res = fn(as_rows(x), tensors, None if residual is None else as_rows(residual), seed, plan)
    if residual is not None:
        residual.copy_(new_res.reshape(residual.shape))
    return out.to(x.dtype)


def reduce_scatter(
    x: torch.Tensor,
    group: dist.ProcessGroup | str | None,
    config: GiftConfig,
    transform: Transform | None = None,
    residual: torch.Tensor | None = None,
    *,
    seed: torch.Tensor | int = 0,
    compiled: bool = False,
) -> torch.Tensor:
    """Low-bit reduce-scatter along dim 0: this rank's shard of the sum (or mean) of `x`.

    `x.shape[0]` must be divisible by the world size. `residual` (if given, fp32, shape of
    `x`) is error feedback in transformed coordinates and is updated in place. `compiled`
    runs the functional core through `torch.compile` (fused kernels for eager callers such
    as FSDP2's comm hook; one compile per gradient shape).
    """
    plan, tensors = _prepare(x, config, group, transform)
    if x.shape[0] % plan.world:
        raise ValueError(f"reduce_scatter: dim 0 ({x.shape[0]}) is not divisible by the world size {plan.world}")
    out = _run(gift_reduce_scatter, x, tensors, residual, seed, plan, compiled)
    return out.reshape(x.shape[0] // plan.world, *x.shape[1:])


def all_reduce(
    x: torch.Tensor,
    group: dist.ProcessGroup | str | None,
    config: GiftConfig,
    transform: Transform | None = None,
    residual: torch.Tensor | None = None,
    *,
    seed: torch.Tensor | int = 0,
    compiled: bool = False,
) -> torch.Tensor:
    """Low-bit all-reduce of `x` (any shape): bit-identical result on every rank.

    `compiled` as in `reduce_scatter`.
    """
    plan, tensors = _prepare(x, config, group, transform)
    return _run(gift_all_reduce, x, tensors, residual, seed, plan, compiled).reshape(x.shape)


def wire_bytes_per_rank(op: str, shape: torch.Size | tuple[int, ...], spec: FormatSpec, world: int) -> int:
    """Bytes this rank hands to collectives for one quantized `op` on a tensor of `shape`.

    Counts the codes entering the all-to-all, the scale statistics entering the agreement
    all-reduce and, for `all_reduce`, this rank's codes and scales entering the all-gather.
    The fp32/bf16 baselines are `numel * 4` / `numel * 2` under the same convention.
    """
    rows, cols = as_rows(torch.empty(shape, device="meta")).shape
    if op == "all_reduce":
        rows += (-rows) % world
    total = wire_bytes_for(spec, rows, cols)
    if op == "all_reduce" and world > 1:
        total += wire_bytes_for(spec, rows // world, cols)
    return total
