"""Sizes of one benchmark run: the `smoke`, `quick` and `full` profiles.

Every knob that trades run time for statistical weight lives here, so the sections stay
free of magic numbers and the report can print exactly what was run. `smoke` is for CI (a
tiny model, seconds), `quick` is the default developer run (a few minutes on 2 CPU cores,
one seed), `full` is the opt-in run (several seeds, more held-out batches, more kernels;
under ~25 minutes on 2 cores once the reference model is cached).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from bench.lib.tiny_llama import TinyLlamaConfig

# (label, format, scaling): the wire formats of the fidelity tables. mxfp8 and nvfp4 fix their
# own block scaling, so their "scaling" entry is only a label.
FORMATS: tuple[tuple[str, str, str], ...] = (
    ("e4m3/tensor", "fp8_e4m3", "tensor"),
    ("e4m3/row", "fp8_e4m3", "row"),
    ("e4m3/block32", "fp8_e4m3", "block"),
    ("e5m2/tensor", "fp8_e5m2", "tensor"),
    ("e5m2/row", "fp8_e5m2", "row"),
    ("e5m2/block32", "fp8_e5m2", "block"),
    ("mxfp8", "mxfp8", "row"),
    ("nvfp4", "nvfp4", "row"),
)

# (label, geometry.Transform kind, rank, factor source): `kfac` is A = E[x x^T] of the
# previous batch (forward pre-hooks), `kfac-sketch` the same A seen only through
# `gift_compile.geometry.statistics.SketchStatistics` (a 2 x rank column sketch plus diag(A)), `grad`
# the gradient-side factor G^T G / out of the previous batch's gradient (what
# GiftConfig(geometry="gradient") uses).
TRANSFORMS: tuple[tuple[str, str, int, str], ...] = (
    ("euclidean", "identity", 0, "none"),
    ("hadamard", "hadamard", 0, "none"),
    ("kfac-dense", "dense", 0, "kfac"),
    ("kfac-r8", "lowrank", 8, "kfac"),
    ("kfac-r16", "lowrank", 16, "kfac"),
    ("kfac-r32", "lowrank", 32, "kfac"),
    ("kfac-sketch-r32", "lowrank", 32, "kfac-sketch"),
    ("kfac-r64", "lowrank", 64, "kfac"),
    ("grad-r32", "lowrank", 32, "grad"),
)


@dataclass(frozen=True)
class ReferenceSettings:
    """The reference model trained (and cached) by the bench so that gradients are real.

    `optimizer` "adamw" (the default) or "muon" (Muon on the hidden matrices at `muon_lr`,
    AdamW on the rest: `bench.lib.reference.make_optimizers`); the gradient spectra a
    preconditioned optimizer produces differ from AdamW's, so the whitening sweep can measure
    on either.
    """

    model: TinyLlamaConfig
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int
    seed: int = 0
    optimizer: str = "adamw"
    muon_lr: float = 3e-3


@dataclass(frozen=True)
class FidelitySettings:
    """Held-out batches whose gradients and K-FAC factors the fidelity section measures.

    `heldout_batches` batches are measured; one more, before them, only supplies the first
    batch's factors. `micro_batches` sequences per batch are back-propagated one at a time so
    the multi-rank simulation can give every simulated rank its own gradient.
    """

    heldout_batches: int
    micro_batches: int
    seq_len: int
    ranks: tuple[int, ...]
    multirank_batches: int
    eigen_buckets: int = 8
    damping: float = 1e-3
    # keep each sample's two half-batch gradients (`LayerSample.halves`: the sweep's 2-rank metrics)
    keep_halves: bool = False


@dataclass(frozen=True)
class OverheadSettings:
    """Kernel-time measurement: shapes `(label, rows, cols)`, paths, repeats; generated-code
    traffic of the same paths, plus the fp8 codecs on `scale_world` ranks (a fake process
    group) at the first shape (its rows must divide by `scale_world`)."""

    shapes: tuple[tuple[str, int, int], ...]
    paths: tuple[str, ...]
    repeats: int
    compile: bool
    refresh_dims: tuple[int, ...] = ()
    rank: int = 32
    scale_world: int = 64


@dataclass(frozen=True)
class CodecMinimumSettings:
    """`bench.fidelity.codec_minimum`: the gradient shape `(label, rows, cols)`, low-rank `rank`, the
    plan's `world` (a fake process group), ops, formats `(format, scaling)`, maps, and timing
    rounds (each round runs every map's body of one op and format once)."""

    shape: tuple[str, int, int] = ("600M w2 (fc2) [1280,3456]", 1280, 3456)
    rank: int = 32
    world: int = 8
    ops: tuple[str, ...] = ("reduce_scatter", "all_reduce")
    formats: tuple[tuple[str, str], ...] = (("fp8_e4m3", "row"), ("nvfp4", "row"), ("int4", "row"), ("int2", "row"))
    kinds: tuple[str, ...] = ("identity", "lowrank", "dense")
    repeats: int = 5


@dataclass(frozen=True)
class StepSettings:
    """Step-time projection (`bench.step_model.cpu`) and memory table (`bench.fidelity.memory`).

    `model` names an entry of `bench.lib.wire.MODEL_CONFIGS` unless `model_config` overrides it
    (the smoke profile's toy model); `arms` is a subset of `bench.step_model.cpu.ARMS` (each GIFT
    arm compiles its codec once per distinct layer shape on `gpus` fake ranks).
    """

    model: str = "Llama-600M"
    gpus: int = 64
    arms: tuple[str, ...] | None = None  # None: every arm
    model_config: TinyLlamaConfig | None = None
    memory_models: tuple[str, ...] = ("Llama-600M", "Llama-3-8B", "Llama-3-70B")
    memory_worlds: tuple[int, ...] = (8, 64)


@dataclass(frozen=True)
class ConvergenceSettings:
    """2-rank gloo pretraining runs: one per (seed, optimizer, arm); within a seed every arm has
    the same init and data order. `arms` pairs each optimizer ("muon", "adamw") with its arms
    (`bench.convergence.arms.parse_arm`), each list starting with "fp32", the paired reference."""

    model: TinyLlamaConfig
    steps: int
    local_batch: int
    seq_len: int
    lr: float  # AdamW (and, under Muon, the AdamW part: embeddings, norms, head)
    warmup: int
    seeds: tuple[int, ...]
    arms: tuple[tuple[str, tuple[str, ...]], ...]
    refresh_every: int
    eval_every: int
    eval_tokens: int
    muon_lr: float = 3e-3
    rank: int = 32
    world: int = 2
    compile: bool = False
    # "all-reduce": plain modules, GIFT's quantized all-reduce (each rank's contribution and the
    # reduced shard re-encoded for the all-gather: two quantizations); "reduce-scatter": an FSDP2
    # twin (`bench.convergence.runner.ShardedTwin`), one quantization. Runs recorded before the field
    # existed are all-reduce runs.
    path: str = "all-reduce"


@dataclass(frozen=True)
class BenchSettings:
    """One complete run of `python -m bench.run`."""

    profile: str
    reference: ReferenceSettings
    fidelity: FidelitySettings
    overhead: OverheadSettings
    convergence: ConvergenceSettings
    step: StepSettings = StepSettings()
    codec: CodecMinimumSettings = CodecMinimumSettings()
    threads: int = 2
    formats: tuple[tuple[str, str, str], ...] = FORMATS
    transforms: tuple[tuple[str, str, int, str], ...] = TRANSFORMS

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Llama-600M layer shapes of the paper (hidden 1280, FFN 3456) plus the reference model's.
LLAMA600M_SHAPES = (("600M w2 (fc2) [1280,3456]", 1280, 3456), ("600M w1 (fc1) [3456,1280]", 3456, 1280))
_SMALL = TinyLlamaConfig.small()
SMALL_SHAPES = (
    (f"small w2 [{_SMALL.dim},{_SMALL.ffn_hidden}]", _SMALL.dim, _SMALL.ffn_hidden),
    (f"small w1 [{_SMALL.ffn_hidden},{_SMALL.dim}]", _SMALL.ffn_hidden, _SMALL.dim),
)


def _both(formats: tuple[str, ...], ef: bool) -> tuple[str, ...]:
    """Euclidean and GIFT arms at `formats`, without error feedback and (if `ef`) with it."""
    return tuple(f"{g}-{f}{s}" for f in formats for s in ([""] + (["-ef"] if ef else [])) for g in ("euclid", "gift"))


# The study (full profile): under Muon (the paper's optimizer) 8, 4.5, 4.25 and 2.25 bits, NVFP4
# and int2 with and without error feedback (8 bits: no EF); at NVFP4 the variants that judge
# what limits GIFT (`-mom-d2`: the map from the optimizer's momentum, damping 1e-2, the fidelity
# sweep's best product candidate; `-two`: the two-sided experiment); under AdamW 2.25 bits with
# and without EF, and the product's measured selection (`-auto`) next to every layer whitened.
# AdamW at NVFP4 is left out for time (21 runs per seed x 5 seeds of 120 steps take ~4 h on 2 free
# cores; seed 0 of the committed study ran it: bench/results/convergence/convergence_runs.jsonl).
STUDY_ARMS = (
    ("muon", ("fp32", *_both(("fp8",), False), *_both(("nvfp4",), True), *_both(("int4",), False),
              *_both(("int2",), True),
              "gift-nvfp4-mom-d2", "gift-nvfp4-two")),
    ("adamw", ("fp32", *_both(("int2",), True), "gift-int2-auto")),
)


# the smoke profile's step-model toy: one block, three distinct managed shapes
_TOY = TinyLlamaConfig(dim=64, n_layers=1, n_heads=2, vocab_size=256, multiple_of=32, max_seq_len=64)


def profile(name: str) -> BenchSettings:
    """The settings of profile `name` (`smoke`, `quick` or `full`)."""
    if name == "smoke":
        tiny = TinyLlamaConfig.tiny()
        return BenchSettings(
            profile="smoke",
            reference=ReferenceSettings(tiny, steps=8, batch_size=8, seq_len=64, lr=3e-3, warmup=2),
            fidelity=FidelitySettings(heldout_batches=1, micro_batches=8, seq_len=64, ranks=(2, 8),
                                      multirank_batches=1, eigen_buckets=4),
            overhead=OverheadSettings(shapes=(("tiny w2 [96,256]", 96, 256),),
                                      paths=("bf16", "euclid-fp8", "gift-fp8"), repeats=3, compile=False,
                                      refresh_dims=(96,), rank=8, scale_world=1),
            convergence=ConvergenceSettings(tiny, steps=4, local_batch=2, seq_len=64, lr=3e-3, warmup=1,
                                            seeds=(0, 1), arms=(("muon", ("fp32", "euclid-int2", "gift-int2-ef")),
                                                                ("adamw", ("fp32", "gift-fp8"))),
                                            refresh_every=2, eval_every=2,
                                            eval_tokens=512),
            step=StepSettings(model="toy", gpus=4, arms=("fp32", "euclid-fp8", "gift-fp8 (13 fc2)"),
                              model_config=_TOY, memory_models=("Llama-600M",), memory_worlds=(8,)),
            codec=CodecMinimumSettings(shape=("tiny w2 [96,256]", 96, 256), rank=8, world=2, ops=("reduce_scatter",),
                                       formats=(("fp8_e4m3", "row"),), kinds=("identity", "lowrank"), repeats=2),
            threads=1,
        )
    reference = ReferenceSettings(_SMALL, steps=200, batch_size=16, seq_len=128, lr=3e-3, warmup=20)
    if name == "quick":
        return BenchSettings(
            profile="quick",
            reference=reference,
            fidelity=FidelitySettings(heldout_batches=2, micro_batches=32, seq_len=128, ranks=(2, 8, 32),
                                      multirank_batches=1),
            overhead=OverheadSettings(shapes=LLAMA600M_SHAPES[:1] + SMALL_SHAPES[:1],
                                      paths=("bf16", "euclid-fp8", "gift-fp8"), repeats=15, compile=True,
                                      refresh_dims=(_SMALL.ffn_hidden,)),
            convergence=ConvergenceSettings(_SMALL, steps=30, local_batch=2, seq_len=128, lr=3e-3, warmup=5,
                                            seeds=(0,), arms=(("muon", ("fp32", *_both(("nvfp4", "int2"), False))),),
                                            refresh_every=10, eval_every=15,
                                            eval_tokens=4096),
        )
    if name == "full":
        return BenchSettings(
            profile="full",
            reference=reference,
            fidelity=FidelitySettings(heldout_batches=4, micro_batches=32, seq_len=128, ranks=(2, 8, 32),
                                      multirank_batches=2),
            overhead=OverheadSettings(shapes=LLAMA600M_SHAPES + SMALL_SHAPES,
                                      paths=("bf16", "euclid-fp8", "gift-fp8", "hadamard-fp8", "dense-fp8",
                                             "euclid-nvfp4", "gift-nvfp4"),
                                      repeats=25, compile=True, refresh_dims=(_SMALL.ffn_hidden, 1280)),
            convergence=ConvergenceSettings(_SMALL, steps=120, local_batch=4, seq_len=128, lr=3e-3, warmup=12,
                                            seeds=(0, 1, 2, 3, 4), arms=STUDY_ARMS, refresh_every=20,
                                            eval_every=40, eval_tokens=8192),
        )
    raise ValueError(f"unknown profile {name!r}; allowed: smoke, quick, full")
