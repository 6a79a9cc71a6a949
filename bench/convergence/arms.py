"""The convergence study's design: its arms (names, what each configures), the key of a run
and the study it belongs to, and the checks of settings before any run starts.

Shared by the runs (`bench.convergence.runner`), their summary (`bench.convergence.summary`) and the
pages that read the results (`bench.convergence.frontier`, `bench.pages.blocks`); it measures nothing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from bench.lib.settings import ConvergenceSettings
from gift_compile.api import managed_weights, resolve_auto
from gift_compile.codec import FormatSpec
from gift_compile.config import GiftConfig
from bench.lib.paths import RESULTS

# short format name -> GiftConfig keyword arguments (and the order of the bit-width axis)
FORMATS: dict[str, dict[str, object]] = {
    # the production bar: a 16-bit wire summed in fp32 (`euclid-bf16`, and `-sr` for stochastic rounding)
    "bf16": {"format": "bf16"},
    "fp8": {"format": "fp8_e4m3", "scaling": "row"},
    "int6": {"format": "int6", "block_size": 32},
    "nvfp4": {"format": "nvfp4"},
    "int4": {"format": "int4", "block_size": 32},
    "int3": {"format": "int3", "block_size": 32},
    # 2-bit codes with a scale per 16 elements (2.5 bits): finer scales instead of a wider code
    "int2b16": {"format": "int2", "block_size": 16},
    "int2": {"format": "int2", "block_size": 32},
    "ternary": {"format": "ternary", "block_size": 32},
}


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GiftConfig)}

# arm suffixes beyond `-ef` (the tuning runs): what each changes in the GIFT config
MODIFIERS: dict[str, dict[str, object]] = {
    "sr": {"stochastic_rounding": True},
    "dense": {"geometry": "dense"},
    "exact": {"statistics": "dense"},
    "r64": {"rank": 64},
    "rf5": {"refresh_every": 5},
    "grad": {"geometry": "gradient"},
    # the low-rank map built from the optimizer's momentum (what Muon orthogonalizes)
    "mom": {"geometry": "momentum"},
    # damping 1e-2 instead of 1e-3 (the fidelity sweep's best momentum candidate, `mom-r32-d1e-2`)
    "d2": {"damping": 1e-2},
    # the product's measured selection (`select="auto"`, default metric) instead of every layer whitened
    "auto": {"select": "auto"},
    # input columns scaled by AdamW's second moment (`geometry="second_moment"`, the sweep's vcol-p1)
    "vsq": {"geometry": "second_moment"},
    # the geometry the product picks for the optimizer (`geometry="auto"`: `geometry_for`)
    "geo": {"geometry": "auto"},
    # EXPERIMENT, not in the product: two-sided dense whitening from the momentum (`TwoSided`)
    "two": {"geometry": "none", "damping": 1e-2},
    # owner-side error feedback on the all-reduce's second hop (all-reduce path only); with
    # `-ef` both hops are compensated
    "ef2": {"second_hop_error_feedback": True},
    # a leaky residual, beta 0.9, on whichever hops have error feedback
    "b9": {"error_feedback_decay": 0.9},
    # what a user gets from `GiftConfig(format=..., geometry="auto")` with `optimizer=`: the
    # product's defaults for selection (measured, metric chosen from the optimizer), refresh
    # cadence and rank, instead of the study's every-layer, refresh-20 arms
    "dflt": {"geometry": "auto", **{f: _DEFAULTS[f] for f in ("select", "select_metric", "refresh_every",
                                                              "refresh_warmup", "rank")}},
    # the selection metric before it was chosen from the optimizer (plain L2 for every optimizer)
    "euc": {"select_metric": "euclidean"},
    # no refresh warm-up: refreshes only at multiples of refresh_every (the schedule before the
    # warm-up existed; every study arm without `-dflt` runs so, to keep its meaning)
    "nowarm": {"refresh_warmup": 0},
    # codes chosen on each scale block rotated by a signed Walsh-Hadamard (`block_rotation`),
    # a codec change both geometries can take
    "rot": {"block_rotation": True},
    # bits per layer at the arm format's total bytes: `layer_formats` from the measured
    # allocation (`bench.convergence.bit_allocation`, read by `arm_config`)
    "alloc": {},
    # GIFT's low-rank map with its matmul operands at TF32 / bf16, as the CUDA tensor-core
    # kernels run it (`map_precision="auto"` is TF32 on CUDA): the run emulates that rounding on
    # the CPU (`bench.fidelity.map_emulation.tensor_core_map`, installed by `bench.convergence.runner` for the
    # arm; `emulated_precision`), which otherwise runs the exact map only
    "tf32": {"map_precision": "tf32"},
    "bf16": {"map_precision": "bf16"},
    # the whole gradient compressed: the parameters outside GIFT's layers (embedding, output
    # head) at the arm's format in plain coordinates, the tiny ones (norms) at bf16; every arm
    # without `-uw`/`-ubf` sends them raw at fp32, as every study arm before them did (`STUDY_OUTSIDE`)
    "uw": {"excluded_format": "same", "unmapped_format": "same", "tiny_format": "bf16"},
    # the same with the embedding and head at bf16 instead of the arm's format (the product's default)
    "ubf": {"excluded_format": "bf16", "unmapped_format": "same", "tiny_format": "bf16"},
}

# what every arm without `-uw`/`-ubf` sends the parameters outside GIFT's layers at: raw fp32,
# the only choice before `GiftConfig.unmapped_format` existed, so earlier runs keep their meaning
STUDY_OUTSIDE: dict[str, object] = {"excluded_format": "fp32", "unmapped_format": "fp32", "tiny_format": "fp32"}

# the modifiers whose arms run the emulated tensor-core map, and the precision each emulates
EMULATED_PRECISIONS = {"tf32": "tf32", "bf16": "bf16"}

# the measured per-layer bit allocations, by budget format (`bench.convergence.bit_allocation` writes it)
ALLOCATION = RESULTS / "convergence" / "bit_allocation.json"
ALLOCATION_COMMAND = "python -m bench.convergence.bit_allocation"


def allocated_formats(fmt: str, path: Path = ALLOCATION) -> tuple[str, ...]:
    """The measured allocation's `layer_formats` at the bytes of `fmt` on every layer (the
    `-alloc` arms). Raises, naming the command, where none was measured for it."""
    if not path.exists():
        raise FileNotFoundError(f"no bit allocation measured ({path}); run `{ALLOCATION_COMMAND}`")
    results = json.loads(path.read_text())
    if fmt not in results:
        raise ValueError(f"no bit allocation measured for {fmt!r} in {path} (have {sorted(results)}); run "
                         f"`{ALLOCATION_COMMAND} --format {fmt}`")
    return tuple(results[fmt]["layer_formats"])


# the modifiers that change only GIFT's map (the rest, `sr`, `ef2`, `b9`, change the codec both
# geometries share): a GIFT arm with them is compared with the Euclidean arm without them
MAP_MODIFIERS = frozenset({"dense", "exact", "r64", "rf5", "grad", "mom", "d2", "auto", "vsq", "geo", "two", "dflt",
                           "euc", "nowarm", *EMULATED_PRECISIONS})
assert MAP_MODIFIERS <= MODIFIERS.keys()


def parse_arm(arm: str) -> tuple[str, str | None, bool]:
    """`(side, format short name, error feedback)` of an arm name (`fp32`: no format); the
    side is `euclid`, `gift` or `fp32`, the arm's coordinates (not a geometry name).

    Names are `fp32` or `(euclid|gift)-<format>[-ef][-<modifier>...]`, modifiers from
    `MODIFIERS` (stochastic rounding, dense whitening, exact statistics, rank 64, refresh
    every 5 steps, gradient-side geometry, momentum-side geometry, damping 1e-2, measured
    selection, the two-sided experiment, AdamW's second-moment column scaling, the geometry
    chosen from the optimizer, second-hop error feedback, a decaying residual, the product's
    defaults, the plain-L2 selection metric, no refresh warm-up, the block rotation, the measured
    per-layer bit allocation, the low-rank map's operands at TF32 / bf16, the parameters outside
    the layers at the arm's format or at bf16).
    """
    if arm == "fp32":
        return "fp32", None, False
    parts = arm.split("-")
    if (len(parts) < 2 or parts[0] not in ("euclid", "gift") or parts[1] not in FORMATS
            or any(p not in MODIFIERS and p != "ef" for p in parts[2:])):
        raise ValueError(f"unknown convergence arm {arm!r}: expected fp32 or (euclid|gift)-<format>[-ef][-mod...], "
                         f"format one of {sorted(FORMATS)}, modifiers {sorted(MODIFIERS)}")
    return parts[0], parts[1], "ef" in parts[2:]


def emulated_precision(arm: str) -> str | None:
    """The tensor-core map precision an arm's run emulates (`-tf32`, `-bf16`), None for an arm
    that runs the map as the CPU does. Raises for an arm with both, or a Euclidean arm (no
    low-rank map to round: the arm would be its plain twin under another name)."""
    side, _, _ = parse_arm(arm)
    found = [EMULATED_PRECISIONS[m] for m in arm.split("-")[2:] if m in EMULATED_PRECISIONS]
    if len(found) > 1:
        raise ValueError(f"arm {arm!r} asks for more than one map precision ({', '.join(found)})")
    if found and side != "gift":
        raise ValueError(f"arm {arm!r}: only a GIFT arm has a low-rank map whose precision could change")
    return found[0] if found else None


def arm_config(arm: str, s: ConvergenceSettings, seed: int) -> GiftConfig | None:
    side, fmt, ef = parse_arm(arm)
    if fmt is None:
        return None
    gift = {"geometry": "lowrank", "select": "all", "rank": s.rank} if side == "gift" else {"geometry": "none"}
    extra = {"refresh_every": s.refresh_every, "refresh_warmup": 0, **STUDY_OUTSIDE}  # the study's fixed cadence
    for mod in arm.split("-")[2:]:
        extra.update(MODIFIERS.get(mod, {}))
    if "alloc" in arm.split("-")[2:]:
        extra["layer_formats"] = allocated_formats(fmt)
    return GiftConfig(**{**FORMATS[fmt], **gift, "error_feedback": ef, "seed": seed, **extra})


def format_spec(fmt: str) -> FormatSpec:
    """The codec's `FormatSpec` of an arm's short format name (`FORMATS`)."""
    kw = FORMATS[fmt]
    return FormatSpec(str(kw["format"]), str(kw.get("scaling", "row")), int(kw.get("block_size", 32)))


def bits_per_element(fmt: str, cols: int = 512) -> float:
    """Exact wire bits per managed element of a format (payload + scales) at width `cols`."""
    return format_spec(fmt).bits_per_element(cols, 64)


def resolve_arm_auto(config: GiftConfig | None, model: nn.Module, optimizers: list[torch.optim.Optimizer], *,
                  split_rows: bool) -> GiftConfig | None:
    """The arm's `geometry="auto"` / `select_metric="auto"` chosen as `apply` chooses them
    (`gift_compile.api.resolve_auto`) from the optimizers that step the plain model's managed
    weights: here rather than in `apply`, because on the reduce-scatter path GIFT is applied to
    the twin, whose parameters no optimizer steps."""
    if config is None:
        return None
    return resolve_auto(config, optimizers, managed_weights(model, config, dist.group.WORLD, split_rows=split_rows))


PATHS = ("all-reduce", "reduce-scatter")


RunKey = tuple[str, int, int, str, int, str]


def run_key(record: dict) -> RunKey:
    """`(path, world, steps, optimizer, seed, arm)` of a run record. Records written before a
    field existed: the path is all-reduce, the world 2 ranks (every earlier run), the steps the
    length of the loss curve."""
    return (record.get("path", "all-reduce"), record.get("world", 2), record.get("steps", len(record["losses"])),
            record["optimizer"], record["seed"], record["arm"])


def settings_key(s: ConvergenceSettings, opt: str, seed: int, arm: str) -> RunKey:
    """The `run_key` the run of `(opt, seed, arm)` under settings `s` will have."""
    return s.path, s.world, s.steps, opt, seed, arm


def study(record: dict, s: ConvergenceSettings) -> str:
    """The study a run belongs to: its path, qualified by the ranks and steps where they differ
    from the settings' (the 4-rank subset, the longer confirmation), so runs of different
    designs are never paired with each other."""
    path, world, steps = run_key(record)[:3]
    return path + (f", {world} ranks" if world != s.world else "") + (f", {steps} steps" if steps != s.steps else "")


def rescaled(s: ConvergenceSettings, *, world: int, steps: int) -> ConvergenceSettings:
    """`s` on `world` ranks for `steps` steps, the same experiment otherwise: the global batch
    is kept (each rank takes its share of the same sequences, `language_modeling.batches`), warmup and
    the evaluation interval keep their share of the run. Raises where the batch cannot split."""
    global_batch = s.local_batch * s.world
    if world < 1 or global_batch % world:
        raise ValueError(f"cannot split the global batch of {global_batch} sequences over {world} ranks")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return dataclasses.replace(s, world=world, local_batch=global_batch // world, steps=steps,
                               warmup=max(1, round(s.warmup * steps / s.steps)),
                               eval_every=max(1, round(s.eval_every * steps / s.steps)))


def check_settings(s: ConvergenceSettings) -> None:
    """Raise, naming the problem, for settings a run could not honour (before any run starts)."""
    if s.path not in PATHS:
        raise ValueError(f"unknown convergence path {s.path!r}; allowed: {', '.join(PATHS)}")
    for _, arms in s.arms:
        for arm in arms:
            parse_arm(arm)
            mods = arm.split("-")[2:]
            if s.path == "reduce-scatter" and ("two" in mods or "mom" in mods):
                raise ValueError(f"arm {arm!r} cannot run on the reduce-scatter path: the optimizer steps the plain "
                                 "model (`ShardedTwin`), so a map built from the optimizer's momentum or the two-sided "
                                 "experiment has no state on the FSDP2 twin")
            if s.path == "reduce-scatter" and "ef2" in mods:
                raise ValueError(f"arm {arm!r} cannot run on the reduce-scatter path: a reduce-scatter has no second "
                                 "hop for second-hop error feedback to correct")
            emulated_precision(arm)
            arm_config(arm, s, 0)  # invalid combinations (a decay without any error feedback) fail here
    if s.path == "reduce-scatter" and s.compile:
        raise ValueError("the reduce-scatter path runs eager (FSDP2's reduce-scatter runs from eager hooks)")
