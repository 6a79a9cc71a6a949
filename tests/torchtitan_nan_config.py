"""A test-only torchtitan config module: ``--module torchtitan_nan_config`` (with tests/ on
``PYTHONPATH``), to inject a non-finite gradient into one pipeline stage of a real job.

``llama3_debug_gift_fsdp2_nan`` is ``llama3_debug_gift_fsdp2`` plus, on global rank
`FAULT_RANK` (pipeline stage 1 of a PP 2 x FSDP 2 job) and only in optimizer step
`FAULT_STEP`, a NaN added to the gradient of one managed weight of that stage
(`FAULT_WEIGHT`), and nothing else: the forward values and the gradients the stage sends to
stage 0 stay finite, so only stage 1's GIFT state sees the fault. Every inner optimizer (the
ones that change weights; torchtitan's container steps them) prints ``GIFT-TEST optimizer step
<n> starts on rank <r>`` before it steps, so a test can tell that none changed a weight in the
faulty step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from gift_compile.torchtitan_ext.cpu.config_registry import llama3_debug_gift_fsdp2
from gift_compile.torchtitan_ext.hooks import bind_gift_hook
from gift_compile.torchtitan_ext.job_config import GiftTrainerConfig

FAULT_RANK = 2
FAULT_STEP = 2
FAULT_WEIGHT = "layers.2.feed_forward.w2"
STARTS = "GIFT-TEST optimizer step {step} starts on rank {rank}"


class _NanGradient(torch.autograd.Function):
    """A zero scalar in the forward (added to a module's output, it changes no value and no
    gradient flowing upstream) whose backward puts NaN into the weight's gradient."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor) -> torch.Tensor:
        ctx.like = torch.empty_like(weight, device="meta")
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.full(ctx.like.shape, float("nan"), dtype=ctx.like.dtype, device=grad.device)


def _inject(optimizers: Any, model_parts: list[nn.Module], parallel_dims: Any, *, inner: Callable | None) -> None:
    """``post_optimizer_build_fn`` (before GIFT's, which wraps it): the fault and the markers."""
    if inner is not None:
        inner(optimizers, model_parts, parallel_dims)
    rank = dist.get_rank()
    steps = [0]  # optimizer steps completed on this rank

    def starts(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        print(STARTS.format(step=steps[0] + 1, rank=rank), flush=True)

    def counted(opt: Any, args: Any, kwargs: Any) -> None:
        steps[0] += 1

    for opt in optimizers.optimizers:
        opt.register_step_pre_hook(starts)
    optimizers.register_step_post_hook(counted)
    if rank != FAULT_RANK:
        return
    modules = {name: m for part in model_parts for name, m in part.named_modules()}

    def poison(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if steps[0] + 1 != FAULT_STEP:
            return output
        return output + _NanGradient.apply(mod.weight)

    modules[FAULT_WEIGHT].register_forward_hook(poison)


def llama3_debug_gift_fsdp2_nan() -> GiftTrainerConfig:
    """``llama3_debug_gift_fsdp2`` with a NaN in one stage-1 weight's gradient in step `FAULT_STEP`."""
    config = llama3_debug_gift_fsdp2()
    inner = config.model_spec.post_optimizer_build_fn.keywords["inner"]
    config.model_spec = replace(config.model_spec, post_optimizer_build_fn=functools.partial(_inject, inner=inner))
    bind_gift_hook(config, "fsdp2")  # GIFT's hook again, with the injection as the model's own
    return config
