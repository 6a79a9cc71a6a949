"""torchtitan's routed experts (`GroupedExperts`) as GIFT matrices: which modules they are, how
their local experts become layers (`gift_compile.runtime.experts.ExpertLayers`), and the hooks
that feed each expert's input statistics.

A `GroupedExperts` runs `torch._grouped_mm` three times per forward on its rank's local experts:
`w1` and `w3` on the routed tokens `x` (rows sorted by expert, `offsets` their cumulative ends,
from `num_tokens_per_expert`), then `w2` on the hidden activations `h`. Its forward pre-hook sees
`x` and the token counts; `h` exists only inside the forward, and the module's `_grouped_mm`, the
seam torchtitan keeps overridable for that purpose (low-precision grouped GEMMs replace it), sees
it as the third call's operand: an instance attribute wraps it and counts the calls since the
pre-hook.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from gift_compile.frameworks.routing import statistics_paused_now
from gift_compile.frameworks.tensor_parallel import local_input
from gift_compile.runtime.experts import ExpertLayers
from gift_compile.runtime.state import GiftState

__all__ = ["INPUTS", "expert_layers", "is_grouped_experts"]

# each grouped weight and the input it reads (w1 and w3 the routed tokens, w2 the hidden activations)
INPUTS = {"w1_EFD": "x", "w3_EFD": "x", "w2_EDF": "h"}
_HIDDEN_CALL = 3  # `_grouped_mm`'s call in a forward whose operand is `h`: after w1's and w3's


def is_grouped_experts(module: nn.Module) -> bool:
    """Whether `module` is a grouped-GEMM experts module GIFT knows: torchtitan's `GroupedExperts`
    (its three 3-D weights and the `_grouped_mm` seam)."""
    return all(isinstance(module._parameters.get(n), torch.Tensor) and module._parameters[n].dim() == 3
               for n in INPUTS) and callable(getattr(type(module), "_grouped_mm", None))


def expert_layers(state: GiftState, owner: str, module: nn.Module, shapes: dict[str, tuple[int, int, int]],
                  device: torch.device | str) -> ExpertLayers:
    """`module`'s local experts as layers of `state` (its weights' local shapes `[E, out, in]` in
    `shapes`), with the hooks that feed their statistics installed on `module`."""
    experts = ExpertLayers(state, owner, shapes, INPUTS, {name: module._parameters[name] for name in shapes}, device)
    calls = [0]

    def before(mod: nn.Module, args: tuple[Any, ...]) -> None:
        calls[0] = 0
        if torch.is_grad_enabled() and not statistics_paused_now():
            x, counts = args[0], args[1]
            experts.observe("x", local_input(x), torch.cumsum(counts, 0))

    seam = type(module)._grouped_mm

    def grouped_mm(*, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == _HIDDEN_CALL and torch.is_grad_enabled() and not statistics_paused_now():
            experts.observe("h", A, offs)
        return seam(module, A=A, B_t=B_t, offs=offs)

    module.register_forward_pre_hook(before)
    module._grouped_mm = grouped_mm  # an instance attribute: shadows the class's seam for this module
    return experts
