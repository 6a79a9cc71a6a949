"""Memory: what GIFT keeps per rank, next to the FSDP-sharded model and AdamW state.

Sized by instantiating the real objects on the meta device (shapes, no storage): the model
(`bench.lib.wire.MODEL_CONFIGS`), the layers `gift_compile.api.eligible_linears` would manage,
a `GiftState` holding them (`GiftState.memory_bytes()` sums every tensor it keeps, by kind),
and `torch.optim.AdamW` after one step (its state is created lazily). No formula is kept
apart from the code: when the statistics or the residual change representation, the table
follows on the next run.

GIFT's state is replicated on every data-parallel rank (transforms, statistics, probes) or
kept per rank at the full local gradient's size (the error-feedback residual), so it does
not shrink with the rank count; FSDP shards parameters, gradients and optimizer state, so
those do. The all-reduce's second-hop residual is the exception: each rank keeps only the
residual of the shard it owns, 1/world of every managed weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bench.lib.wire import MODEL_CONFIGS, describe_config, meta_model
from gift_compile.api import eligible_linears
from gift_compile.config import GiftConfig
from gift_compile.runtime.state import GiftState
from bench.lib.tiny_llama import TinyLlamaConfig

Log = Callable[[str], None]

# label -> GiftConfig whose state is sized: the defaults with and without error feedback, the
# residual stored in 8 and in 4 bits, error feedback on both hops of the all-reduce, the first version's layout (dense d_in x d_in statistics
# per layer, fp32 residual) for the before/after, and the Euclidean codec for reference.
DEFAULTS = "GIFT defaults (lowrank r32, sketch statistics)"
WITH_EF = "GIFT defaults + error feedback (fp32 residual)"
CONFIGS: dict[str, GiftConfig] = {
    DEFAULTS: GiftConfig(geometry="lowrank"),
    WITH_EF: GiftConfig(geometry="lowrank", error_feedback=True),
    "GIFT + error feedback, fp8_e4m3 residual":
        GiftConfig(geometry="lowrank", error_feedback=True, residual_format="fp8_e4m3"),
    "GIFT + error feedback, int4 residual": GiftConfig(geometry="lowrank", error_feedback=True, residual_format="int4"),
    "GIFT + error feedback on both all-reduce hops, fp32 residuals":
        GiftConfig(geometry="lowrank", error_feedback=True, second_hop_error_feedback=True),
    "GIFT + error feedback on both all-reduce hops, int4 residuals":
        GiftConfig(geometry="lowrank", error_feedback=True, second_hop_error_feedback=True, residual_format="int4"),
    "first version: dense statistics + error feedback (fp32)":
        GiftConfig(geometry="lowrank", statistics="dense", error_feedback=True),
    "Euclidean low-bit (geometry=none)": GiftConfig(geometry="none"),
}


def _tensor_bytes(tensors: object) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def training_state_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Unsharded bytes of parameters, gradients and AdamW state (after one step on meta)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    opt.step()
    return {"params": _tensor_bytes(params), "grads": _tensor_bytes(p.grad for p in params),
            "optimizer": sum(_tensor_bytes(s.values()) for s in opt.state.values()),
            "param_count": sum(p.numel() for p in params)}


def gift_state_bytes(model: torch.nn.Module, config: GiftConfig, world: int) -> tuple[dict[str, int], int]:
    """`GiftState.memory_bytes()` of the layers GIFT would manage in `model` on a `world`-rank
    FSDP group (rows must split over the ranks), and how many layers that is. The second-hop
    residual, when configured, is sized for an all-reduce over `world` ranks."""
    state = GiftState(config, None)
    for fqn, module in eligible_linears(model, world, min_numel=config.min_numel, excluded=config.is_excluded,
                                        split_rows=True):
        state.add_layer(fqn, tuple(module.weight.shape), "meta", world=world)
    return state.memory_bytes(), len(state.layers)


def run(models: tuple[str, ...] = tuple(MODEL_CONFIGS), worlds: tuple[int, ...] = (8, 64),
        extra: dict[str, TinyLlamaConfig] | None = None, log: Log = print) -> dict[str, object]:
    """Per-rank bytes of GIFT's state and of FSDP's sharded training state, per model, rank
    count and config."""
    configs = {**{m: MODEL_CONFIGS[m] for m in models}, **(extra or {})}
    rows = []
    described = []
    for name, cfg in configs.items():
        model = meta_model(cfg)
        train = training_state_bytes(model)
        described.append({"model": name, "description": describe_config(cfg), "params": train["param_count"]})
        for world in worlds:
            fsdp = (train["params"] + train["grads"] + train["optimizer"]) / world
            for label, config in CONFIGS.items():
                gift, layers = gift_state_bytes(model, config, world)
                total = sum(gift.values())
                rows.append({"model": name, "world": world, "config": label, "layers": layers,
                             "gift": gift, "gift_total": total, "fsdp_per_rank": fsdp,
                             "fsdp_params": train["params"] / world, "fsdp_grads": train["grads"] / world,
                             "fsdp_optimizer": train["optimizer"] / world, "gift_vs_fsdp": total / fsdp})
            log(f"  memory {name} on {world} ranks: FSDP state {fsdp / 2**30:.2f} GiB/rank; "
                + ", ".join(f"{r['config'].split(' (')[0]} {r['gift_total'] / 2**30:.2f} GiB" for r in rows
                            if r["model"] == name and r["world"] == world))
    return {"models": described, "rows": rows, "configs": {k: v.to_dict() for k, v in CONFIGS.items()}}


if __name__ == "__main__":
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(description="GIFT's per-rank memory next to FSDP's (the report's memory table)")
    p.add_argument("--out", type=Path, required=True, help="where the table's JSON goes")
    a = p.parse_args()
    result = {"command": "python -m bench.fidelity.memory --out " + str(a.out), **run()}
    a.out.write_text(json.dumps(result, indent=1) + "\n")
