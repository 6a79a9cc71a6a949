"""Step-time model: project the step time of Llama-600M on 64 GPUs per communication config.

No GPU is available to this bench, so wall-clock claims at the paper's scale can only be
projected. Every arm is a configuration the code runs (`ARMS`: a `GiftConfig`, or None for
plain fp32 all-reduce), and what each arm costs is read off the code, not re-derived:

    step = compute + exposed_fraction * comm + codec + statistics + refresh

- which weights GIFT manages, and with which plan (format, transform kind): `GiftState`
  instantiated on the meta device for the model, with the arm's config and the code's own
  eligibility rule (`gift_compile.api.eligible_linears`). On the hook paths priced here a
  layer that `select` leaves out runs the Euclidean codec (its plan's kind is identity),
  feeds no statistics and is never refreshed, so an arm prices each layer by its own plan and
  `LayerState.collect_stats` / `selected` flags, exactly as `GiftState` sets them;
- codec time: bytes per gradient element *measured from the generated kernels* of each
  layer's all-reduce plan on `gpus` ranks (`bench.fidelity.overhead.codec_traffic`, a fake process group
  stands in for the peers) over HBM bandwidth, plus the transform's FLOPs
  (`gift_compile.runtime.selection.transform_flops`) at the fp32 rate (the projection and expansion run
  in fp32);
- statistics: FLOPs of the layer's statistics update (`stats.observe` on `tokens_per_gpu`
  tokens, counted by `torch.utils.flop_counter.FlopCounterMode`) at the fp32 rate;
- refresh: the geometry's own `refresh_flops` (from the layer's statistics: Nystrom on the
  sketch by default) per adaptive layer every `refresh_every` steps at an effective fp64
  rate, divided over the ranks (each layer has one owner rank, `GiftState.owners`);
- comm: bytes each rank transmits per step (`gift_compile.exchange.collectives.bucket_wire_bytes` of the
  layer's plan: the all_to_all sends (P-1)/P of its input, the all_gather P-1 copies of this
  rank's shard; unmanaged parameters and the fp32 arm take a ring all-reduce, 2 (P-1)/P of
  the fp32 buffer) over the link bandwidth;
- compute: `6 * params * tokens_per_gpu / (peak * MFU)`.

Hardware rates and efficiencies are assumptions (`StepModelInputs`); the exposed share of
communication is unknown, so the `calibrated` scenarios choose it such that Euclidean FP8
reproduces the paper's -10.8% and then predict the other arms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.fidelity.overhead import codec_traffic
from bench.lib.wire import MODEL_CONFIGS, describe_config, meta_model
from gift_compile.api import eligible_linears
from gift_compile.config import GiftConfig
from gift_compile.exchange.collectives import bucket_wire_bytes
from gift_compile.exchange.plan import BucketPlan, ItemPlan
from gift_compile.runtime.selection import transform_flops
from gift_compile.runtime.state import GiftState
from bench.lib.tiny_llama import TinyLlamaConfig

Log = Callable[[str], None]

PAPER = {"gift-fp8 (13 fc2)": -0.076, "euclid-fp8": -0.108}
_FP8 = dict(format="fp8_e5m2", scaling="tensor")  # the paper's wire format: E5M2, one scale per tensor
# the paper whitened 13 fc2 (= feed_forward.w2) layers; as globs (which 13 does not change the cost)
_FC2_13 = tuple(f"layers.{i}.feed_forward.w2.weight" for i in range(13))

# arm -> GiftConfig (None: plain fp32 all-reduce, no GIFT)
ARMS: dict[str, GiftConfig | None] = {
    "fp32": None,
    "bf16 (GIFT collective)": GiftConfig(format="bf16", geometry="none"),
    "euclid-fp8": GiftConfig(**_FP8, geometry="none"),
    "gift-fp8 (13 fc2)": GiftConfig(**_FP8, geometry="lowrank", select=_FC2_13),
    "gift-fp8 (all layers)": GiftConfig(**_FP8, geometry="lowrank", select="all"),
    "euclid-nvfp4": GiftConfig(format="nvfp4", geometry="none"),
    "gift-nvfp4 (all layers)": GiftConfig(format="nvfp4", geometry="lowrank", select="all"),
}
@dataclass(frozen=True)
class StepModelInputs:
    """Hardware and workload assumptions (defaults and their sources)."""

    gpus: int = 64  # the paper's 64 GH200
    tokens_per_gpu: int = 16384  # assumption: 1M-token global batch (256 x 4096) over 64 GPUs
    peak_tflops: float = 989.0  # H100 / GH200 dense BF16 tensor-core peak (NVIDIA datasheet)
    mfu: float = 0.40  # typical Megatron-LM MFU for a sub-1B Llama
    fp32_tflops: float = 67.0  # H100 / GH200 fp32 (non-tensor) peak: the codec's and the
    #                            statistics' fp32 matmuls and multiply-adds (NVIDIA datasheet)
    fp32_efficiency: float = 0.50  # share of the fp32 peak those skinny matmuls reach
    tf32_tflops: float = 494.0  # H100 / GH200 dense TF32 tensor-core peak (NVIDIA datasheet): the
    #                             rate of those matmuls if TF32 is allowed (not PyTorch's default)
    link_gbytes: float = 50.0  # InfiniBand NDR 400 Gb/s per GPU (one NIC per GPU)
    link_efficiency: float = 0.80  # achieved/peak bus bandwidth of large collectives (nccl-tests)
    hbm_tbytes: float = 4.0  # GH200 96 GB HBM3: 4 TB/s (NVIDIA GH200 datasheet)
    kernel_efficiency: float = 0.70  # share of HBM bandwidth the codec kernels reach
    exposed_fraction: float = 1.0  # share of gradient communication not hidden behind backward
    refresh_tflops: float = 5.0  # assumption: effective fp64 rate of the refresh (matmuls and
    #                              tall-skinny QR); GH200's fp64 tensor-core peak is 67 TFLOP/s
    refresh_sharded: bool = True  # True: each rank rebuilds 1/gpus of the transforms, then the
    #                               owners broadcast (as implemented: GiftState.owners);
    #                               False: every rank would rebuild every transform


@dataclass(frozen=True)
class LayerCost:
    """What one managed layer costs per step under an arm (per rank)."""

    fqn: str
    rows: int
    cols: int
    plan: ItemPlan
    codec_bytes: float
    transform_flops: float
    stats_flops: float
    refresh_flops: float
    sent_bytes: float


def _stats_flops(state: GiftState, fqn: str, tokens: int) -> float:
    """FLOPs of one statistics update of `fqn` on `tokens` tokens, counted while the layer's
    own `stats.observe` runs on meta tensors (so a cheaper statistic is priced as written)."""
    layer = state.layers[fqn]
    if layer.stats is None:
        return 0.0
    x = torch.empty(tokens, layer.shape[1], device="meta")
    with FlopCounterMode(display=False) as counter:
        layer.stats.observe(x)
    return float(counter.get_total_flops())


def _sent(plan: ItemPlan, world: int) -> float:
    """Bytes one rank transmits for `plan`'s all-reduce: (P-1)/P of the all_to_all input plus
    P-1 copies of the all_gather input (bucket_wire_bytes of the all-reduce minus that of the
    reduce-scatter is the all_gather input)."""
    padded = dataclasses.replace(plan, rows=plan.rows + (-plan.rows) % world)  # as the all-reduce sends it
    a2a = bucket_wire_bytes(BucketPlan((padded,), world, "g", True, "reduce_scatter"))
    total = bucket_wire_bytes(BucketPlan((padded,), world, "g", True, "all_reduce"))
    return (world - 1) / world * a2a + (world - 1) * (total - a2a)


class CodecBytes:
    """Measured codec bytes per element, memoised by plan shape (each distinct plan compiles once)."""

    def __init__(self, world: int, log: Log) -> None:
        self.world = world
        self.log = log
        self.cache: dict[tuple[str, str, str, int, int, int], float] = {}

    def __call__(self, plan: ItemPlan, rank: int) -> float:
        key = (plan.format, plan.scaling, plan.kind, plan.rows, plan.cols, rank)
        if key not in self.cache:
            t = codec_traffic(plan.format, plan.scaling, plan.kind, plan.rows, plan.cols, rank, self.world,
                              "all_reduce")
            self.cache[key] = float(t["bytes_per_element"])
            self.log(f"  codec {plan.format}/{plan.scaling} {plan.kind} [{plan.rows},{plan.cols}] on {self.world} "
                     f"ranks: {self.cache[key]:.2f} B/element (generated kernels)")
        return self.cache[key]


def arm_layers(config: GiftConfig, model_config: TinyLlamaConfig, inputs: StepModelInputs,
               codec: CodecBytes) -> list[LayerCost]:
    """Per-layer costs of `config`: a `GiftState` on the meta device manages what `apply` would.

    Layers that read the same input (q/k/v, w1/w3) share one statistic once the first refresh
    has seen them agree; on meta nothing is seen, so each is counted: statistics FLOPs are an
    upper bound for attention and gate/up inputs."""
    model = meta_model(model_config)
    state = GiftState(config, None)
    for fqn, module in eligible_linears(model, inputs.gpus, min_numel=config.min_numel, excluded=config.is_excluded,
                                        split_rows=False):
        state.add_layer(fqn, tuple(module.weight.shape), "meta")
    out = []
    for fqn, layer in state.layers.items():
        plan = layer.plan  # identity for a layer `select` leaves out: the Euclidean codec
        rows, cols = layer.shape
        refreshed = state.needs_geometry(layer)
        refresh = (type(layer.transform).refresh_flops(rows, cols, layer.transform.rank, layer.stats)
                   / config.refresh_every if refreshed else 0.0)
        if refreshed and inputs.refresh_sharded:
            refresh /= inputs.gpus
        stats = _stats_flops(state, fqn, inputs.tokens_per_gpu) if layer.collect_stats else 0.0
        out.append(LayerCost(
            fqn, rows, cols, plan, codec(plan, layer.transform.rank) * rows * cols,
            transform_flops(plan.kind, rows, cols, layer.transform.rank), stats, refresh, _sent(plan, inputs.gpus)))
    return out


def project(inputs: StepModelInputs, layers: dict[str, list[LayerCost]], model_config: TinyLlamaConfig,
            model_name: str) -> dict[str, object]:
    """Per-arm step-time breakdown (seconds) and the change against fp32 communication."""
    x = inputs
    params = sum(p.numel() for p in meta_model(model_config).parameters())
    compute = 6.0 * params * x.tokens_per_gpu / (x.peak_tflops * 1e12 * x.mfu)
    ring = 2.0 * (x.gpus - 1) / x.gpus
    link = x.link_gbytes * 1e9 * x.link_efficiency
    hbm = x.hbm_tbytes * 1e12 * x.kernel_efficiency
    fp32 = x.fp32_tflops * 1e12 * x.fp32_efficiency
    rows = {}
    for arm in ["fp32", *layers]:
        costs = layers.get(arm, [])
        managed = sum(c.rows * c.cols for c in costs)
        sent = sum(c.sent_bytes for c in costs) + ring * 4.0 * (params - managed)
        codec_bytes = sum(c.codec_bytes for c in costs)
        codec = codec_bytes / hbm + sum(c.transform_flops for c in costs) / fp32
        stats = sum(c.stats_flops for c in costs) / fp32
        refresh = sum(c.refresh_flops for c in costs) / (x.refresh_tflops * 1e12)
        comm = sent / link
        rows[arm] = {"compute_s": compute, "comm_s": comm, "exposed_comm_s": x.exposed_fraction * comm,
                     "codec_s": codec, "stats_s": stats, "refresh_s": refresh, "sent_bytes": sent,
                     "codec_bytes": codec_bytes, "managed_layers": len(costs),
                     "codec_bytes_per_element": codec_bytes / managed if managed else 0.0}
    for r in rows.values():
        r["step_s"] = r["compute_s"] + r["exposed_comm_s"] + r["codec_s"] + r["stats_s"] + r["refresh_s"]
    base = rows["fp32"]["step_s"]
    for r in rows.values():
        r["vs_fp32"] = r["step_s"] / base - 1.0
    return {"inputs": dataclasses.asdict(x), "model": model_name, "model_description": describe_config(model_config),
            "params": params, "arms": rows}


def calibrate_exposed_fraction(arms: dict[str, dict[str, float]], target: float = PAPER["euclid-fp8"]) -> float | None:
    """Exposed-communication share at which Euclidean FP8 changes step time by `target`.

    From a projection with `exposed_fraction=1`: the change is `(f dC + K) / (T + f C32)` with
    `dC` the FP8-minus-fp32 communication, `K` FP8's codec, statistics and refresh time and
    `T` compute; solved for `f`. None when no `f` in [0, 1] fits.
    """
    fp32, fp8 = arms["fp32"], arms["euclid-fp8"]
    d_comm = fp8["comm_s"] - fp32["comm_s"]
    extra = fp8["codec_s"] + fp8["stats_s"] + fp8["refresh_s"]
    denom = d_comm - target * fp32["comm_s"]
    if denom == 0:
        return None
    f = (target * fp32["compute_s"] - extra) / denom
    return f if 0.0 <= f <= 1.0 else None


def run(inputs: StepModelInputs | None = None, name: str = "Llama-600M", model_config: TinyLlamaConfig | None = None,
        arms: tuple[str, ...] | None = None, log: Log = print) -> dict[str, object]:
    """Measure each arm's codec on `inputs.gpus` ranks, then project the scenarios: the
    defaults and the exposed-communication share calibrated to the paper's Euclidean FP8
    result, each with the refresh as implemented (sharded over ranks) and unsharded, and the
    calibrated one with the fp32 matmuls at the TF32 tensor-core rate (a sensitivity: PyTorch
    runs fp32 matmuls without TF32 unless told to).

    The model is `MODEL_CONFIGS[name]` unless `model_config` is given; `arms` (default: all of
    `ARMS`) must include "fp32" and "euclid-fp8", the baseline and the calibration arm."""
    inputs = inputs or StepModelInputs()
    model_config = model_config or MODEL_CONFIGS[name]
    arms = tuple(ARMS) if arms is None else arms
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not {"fp32", "euclid-fp8"} <= set(arms):
        raise ValueError(f"step_model.run: arms {arms} must be names of ARMS ({list(ARMS)}) including fp32 and euclid-fp8")
    codec = CodecBytes(inputs.gpus, log)
    variants = {"sharded": inputs, "unsharded": dataclasses.replace(inputs, refresh_sharded=False)}
    layers = {v: {arm: arm_layers(ARMS[arm], model_config, x, codec) for arm in arms if ARMS[arm] is not None}
              for v, x in variants.items()}
    defaults = project(inputs, layers["sharded"], model_config, name)
    f = calibrate_exposed_fraction(defaults["arms"])
    scenarios = {"defaults": defaults,
                 "defaults, unsharded refresh": project(variants["unsharded"], layers["unsharded"], model_config, name)}
    if f is not None:
        for label, v in (("calibrated", "sharded"), ("calibrated, unsharded refresh", "unsharded")):
            scenarios[label] = project(dataclasses.replace(variants[v], exposed_fraction=f), layers[v], model_config,
                                       name)
        # sensitivity: the statistics' and the codec's fp32 matmuls on TF32 tensor cores
        scenarios["calibrated, TF32 matmuls"] = project(
            dataclasses.replace(inputs, exposed_fraction=f, fp32_tflops=inputs.tf32_tflops), layers["sharded"],
            model_config, name)
    measured = [{"format": k[0], "scaling": k[1], "kind": k[2], "rows": k[3], "cols": k[4], "rank": k[5],
                 "bytes_per_element": b} for k, b in codec.cache.items()]
    return {"paper": PAPER, "calibrated_exposed_fraction": f, "scenarios": scenarios, "codec_measured": measured,
            "arm_configs": {a: (ARMS[a].to_dict() if ARMS[a] else None) for a in arms}}
