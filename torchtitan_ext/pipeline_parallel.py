"""GIFT under torchtitan's pipeline parallelism (FSDP2 trainer): what differs from one model part.

A PP rank holds one model part per pipeline stage it runs (one with 1F1B/GPipe, several with
interleaved schedules). `.hooks.gift_post_optimizer_build` manages all of them with one
`GiftState` over the rank's data-parallel group (the FSDP group, shards x replicas with HSDP):
the ranks of that group run the same stages, so setup agreement, the collectives' plan checks,
statistics and selection run among ranks that hold the same layers, never over the PP group.
One `attach_optimizer` on torchtitan's optimizer container (one optimizer per part, stepped by
one ``container.step()``) drives the state once per optimizer step.

The gradient path needs nothing new: torch's pipeline stage runs every microbatch's backward
with FSDP2's gradient sync off and then calls each FSDP parameter group's ``post_backward``
once, so GIFT's reduce-scatter runs once per FSDP module per optimizer step, on the gradient
accumulated over all microbatches; its bytes are counted once there.

What this module adds:

* `guard_shape_inference`: on its first step a torch pipeline stage infers the shapes it sends
  with a real forward, on ``torch.empty`` tensors for every stage but the first
  (`PipelineStage._forward_metadata_inference`), and a real backward from them
  (``_backward_metadata_inference``), whose gradients FSDP2 reduce-scatters (once more in that
  step) and the stage then drops. Those uninitialized values would enter the K-FAC statistics,
  the error-feedback residuals, the byte counters and the health checks of the stage's GIFT
  state; both passes run inside `gift_compile.frameworks.routing.statistics_paused` and
  `gift_compile.frameworks.fsdp2.discarded_gradients` (FSDP2's default reduce-scatter, state untouched)
  instead.
* `stage_of`: the pipeline stage coordinate of this rank, which the telemetry uses to write one
  JSON-lines file per stage (each stage's state manages different layers, and only the last
  stage sees the loss).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from gift_compile.frameworks.fsdp2 import discarded_gradients
from gift_compile.frameworks.routing import statistics_paused

__all__ = ["guard_shape_inference", "stage_of"]

_SHAPE_INFERENCE = ("_forward_metadata_inference", "_backward_metadata_inference")


def guard_shape_inference() -> None:
    """Run torch's pipeline-stage shape inference (forward and backward) without feeding GIFT's
    statistics or state (idempotent). Raises when this torch has no such methods: its stages
    would infer shapes some other way, which GIFT has not been checked against."""
    from torch.distributed.pipelining import PipelineStage

    for name in _SHAPE_INFERENCE:
        original = getattr(PipelineStage, name, None)
        if original is None:
            raise RuntimeError(f"gift.enable with pipeline parallelism: torch's PipelineStage has no {name} (the "
                               "first step's shape inference, which GIFT keeps out of its statistics and state); "
                               "this torch version's pipelining is not supported")
        if not getattr(original, "_gift_guarded", False):
            setattr(PipelineStage, name, _guarded(original))


def _guarded(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def infer(self: Any, *args: Any, **kwargs: Any) -> Any:
        with statistics_paused(), discarded_gradients():
            return original(self, *args, **kwargs)

    infer._gift_guarded = True  # type: ignore[attr-defined]
    return infer


def stage_of(parallel_dims: Any) -> int | None:
    """This rank's coordinate on the pipeline mesh, or None without pipeline parallelism."""
    if getattr(parallel_dims, "pp", 1) <= 1:
        return None
    return parallel_dims.get_mesh("pp").get_local_rank()
