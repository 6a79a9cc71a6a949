"""GIFT for torchtitan's stock trainer: FSDP2's reduce-scatter replaced by GIFT's.

FSDP2 (``fully_shard``) runs its gradient reduce-scatter from ``torch._dynamo.disable``d
hooks, so no graph pass ever sees it. It does offer ``FSDPModule.set_custom_reduce_scatter``:
the custom comm receives the flat reduce-scatter input of one FSDP module, in which FSDP2
packs *all* of that module's gradients. The layout (``chunk_cat``) is, for ``world`` ranks::

    input.view(world, N)[r] = concat_i( rows [r*c_i, (r+1)*c_i) of grad_i, flattened )

with ``c_i`` rows of parameter ``i`` per rank (dim 0 padded to a multiple of ``world``).
:class:`GiftReduceScatter` cuts this buffer back into per-parameter gradients
(``input.view(world, N)[:, off_i:off_i + c_i*cols_i]`` reshaped to ``[world*c_i, cols_i]``
is exactly gradient ``i``), sends each GIFT-managed weight through
:func:`gift_compile.collectives.reduce_scatter` with that layer's transform, residual and
seed, and sends all other parameters (norms, embeddings, excluded or small weights) in one
full-precision reduce-scatter, writing every shard where FSDP2 expects it in the output.
Every rank computes the same layout, so the collectives match across ranks.

If a call's buffer does not match the module's full parameter list (FSDP2 leaves out
parameters that received no gradient), the per-parameter layout cannot be recovered; the
whole buffer then takes the full-precision reduce-scatter and the call is counted in the
``gift/fsdp2_unmapped_calls`` telemetry.

The comm hook itself runs eagerly (like the rest of FSDP2's backward hooks); the core
collective it calls is the same functional code the graph path splices into its graph,
``torch.compile``d by default (``--gift.no-fuse``: op by op), so both paths compute the
same numbers.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from gift_compile import collectives
from gift_compile.api import layer_seed
from gift_compile.collectives import wire_bytes_per_rank
from gift_compile.formats import FormatSpec
from gift_compile.state import GiftState, LayerState
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

__all__ = ["GiftReduceScatter", "WireCounters", "install"]


@dataclass
class WireCounters:
    """Bytes this rank handed to gradient reduce-scatters, and the time spent in them,
    since the last ``take``."""

    wire: int = 0
    fp32: int = 0
    bf16: int = 0
    unmapped_calls: int = 0
    seconds: float = 0.0
    _events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    @contextlib.contextmanager
    def timing(self, device: torch.device) -> Iterator[None]:
        """Time one comm call: CUDA events on the current stream (read at ``take``, so the
        hot path never synchronizes); host wall time elsewhere (CPU work is synchronous)."""
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - t0

    def take(self) -> "WireCounters":
        """Return the current counts and reset them (one logged step's worth)."""
        for start, end in self._events:
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1e3
        out = WireCounters(self.wire, self.fp32, self.bf16, self.unmapped_calls, self.seconds)
        self.wire = self.fp32 = self.bf16 = self.unmapped_calls = 0
        self.seconds, self._events = 0.0, []
        return out


@dataclass(frozen=True)
class _Segment:
    """One parameter's piece of every rank's chunk of the flat reduce-scatter buffer."""

    offset: int
    rows: int  # rows per rank (dim 0 padded to a multiple of world, divided by world)
    cols: int  # product of the other dims
    layer: LayerState | None  # None: full precision

    @property
    def numel(self) -> int:
        return self.rows * self.cols


class GiftReduceScatter(ReduceScatter):
    """FSDP2 custom reduce-scatter of one FSDP module (see the module docstring)."""

    def __init__(self, segments: Sequence[_Segment], state: GiftState, counters: WireCounters, compiled: bool) -> None:
        self.segments = list(segments)
        self.chunk_numel = sum(s.numel for s in self.segments)
        self.state = state
        self.counters = counters
        self.compiled = compiled
        self.spec = FormatSpec(state.config.format, state.config.scaling, state.config.block_size)

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        if op != dist.ReduceOp.SUM:
            raise ValueError(
                f"GIFT's FSDP2 reduce-scatter sums gradients; got {op}. install() forces SUM "
                "reductions (set_force_sum_reduction_for_comms); do not undo it."
            )
        with self.counters.timing(input_tensor.device):
            self._reduce_scatter(output_tensor, input_tensor, group)
        return None

    def _reduce_scatter(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        world = group.size()
        numel = input_tensor.numel()
        self.counters.fp32 += numel * 4
        self.counters.bf16 += numel * 2
        if numel != world * self.chunk_numel:
            self.counters.unmapped_calls += 1
            self.counters.wire += numel * 4
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group)
            return
        chunks = input_tensor.view(world, self.chunk_numel)
        plain = [s for s in self.segments if s.layer is None]
        for seg in self.segments:
            layer = seg.layer
            if layer is None:
                continue
            grad = chunks[:, seg.offset:seg.offset + seg.numel].reshape(world * seg.rows, seg.cols)
            with torch.no_grad():
                layer.probe.copy_(grad[: layer.probe.shape[0]])
                shard = collectives.reduce_scatter(
                    grad, group, layer.config, layer.transform, layer.residual,
                    seed=layer_seed(layer, self.state.seed), compiled=self.compiled,
                )
            output_tensor[seg.offset:seg.offset + seg.numel].copy_(shard.reshape(-1))
            self.counters.wire += wire_bytes_per_rank("reduce_scatter", (world * seg.rows, seg.cols), self.spec, world)
        if plain:
            packed = torch.cat([chunks[:, s.offset:s.offset + s.numel] for s in plain], dim=1)
            reduced = torch.empty(packed.shape[1], dtype=packed.dtype, device=packed.device)
            dist.reduce_scatter_tensor(reduced, packed.reshape(-1), op=dist.ReduceOp.SUM, group=group)
            self.counters.wire += packed.numel() * packed.element_size()
            start = 0
            for s in plain:
                output_tensor[s.offset:s.offset + s.numel].copy_(reduced[start:start + s.numel])
                start += s.numel


def _segments(module: FSDPModule, layers: dict[int, LayerState]) -> list[_Segment]:
    """Layout of ``module``'s reduce-scatter buffer, from FSDP2's parameter group.

    Reads FSDP2 internals (``_get_fsdp_state()._fsdp_param_group.fsdp_params``, their
    ``padded_sharded_param_size``, ``fsdp_placement`` and ``_module_info``), which torch
    2.13-2.14 (the versions ``pyproject.toml`` allows) lay out as used here.
    """
    group = module._get_fsdp_state()._fsdp_param_group
    segments, offset = [], 0
    if group is None:
        return segments
    for fsdp_param in group.fsdp_params:
        size = fsdp_param.padded_sharded_param_size
        rows, cols = size[0], math.prod(size[1:])
        info = fsdp_param._module_info
        layer = layers.get(id(info.module)) if info.param_name == "weight" else None
        if layer is not None and (fsdp_param.fsdp_placement.dim != 0 or cols != layer.shape[1]):
            layer = None
        segments.append(_Segment(offset, rows, cols, layer))
        offset += rows * cols
    return segments


def install(model: nn.Module, state: GiftState, *, compiled: bool = True) -> WireCounters:
    """Put every FSDP module of ``model`` on :class:`GiftReduceScatter`; returns its counters.

    ``compiled`` runs the core collective through ``torch.compile`` (fused kernels; one
    compile per gradient shape) instead of op by op.

    Also forces FSDP2's SUM reduction (torchtitan disables FSDP's gradient division, and
    GIFT's collective sums) so the comm sees ``ReduceOp.SUM`` on every device.
    """
    layers = {id(m): m._gift_layer for m in model.modules() if hasattr(m, "_gift_layer")}
    counters = WireCounters()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_custom_reduce_scatter(GiftReduceScatter(_segments(module, layers), state, counters, compiled))
    return counters
